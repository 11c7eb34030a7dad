"""torchrun, as `recsys train` runs it: the same arguments and behaviour as
`python -m torch.distributed.run`, but without torchrun's own multi-line reports for outcomes
the workers have already explained in one line (docs/run_integrity.md):

- a worker that failed with an expected error exits 2 after rank 0 printed `error: ...`;
- a stop by SIGINT/SIGTERM (the launcher's forwarding) tears the workers down as torchrun does,
  then exits 128 + signal silently (the launcher prints the one line).

Any other worker failure keeps the worker's own traceback (printed by the worker) and gets one
line here naming the rank and exit code. torchrun's log lines below ERROR stay as they are.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

EXPECTED = (2, 130)  # a worker's one-line error / interrupt (recsys/train.py)


def main(argv: list[str] | None = None) -> int:
    # the agent's "failed (exitcode ...)" and "shutting down workers" lines repeat what we say
    # (torch's elastic loggers set their own levels, so each one is quieted, not just the parent)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in EXPECTED:
            return failure.exitcode
        code = failure.exitcode
        what = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"error: worker rank {rank} failed with {what} (its output is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
