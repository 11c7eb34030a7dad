"""Worker entry point, run by torchrun in every process:

    torchrun --nproc_per_node 2 -m recsys.train --config configs/experiments/demo.yaml [key=value ...]

`recsys train` (recsys/cli.py) validates the config and launches this for you.

Expected failures (a locked or foreign run directory, an incompatible checkpoint, a full disk
during a checkpoint, a non-finite loss or weight, ...) end every rank with exit code 2; rank 0 prints one `error: ...` line,
the others nothing. A host lost during training (killed, frozen, its link cut) ends every
surviving rank with exit code 2 and one `error: ...` line per surviving host that names the lost
host (recsys/training/comm_failure.py). A resume of a finished run prints one line and exits 0. Interrupted
(SIGINT) workers exit 130 without a traceback; SIGTERM ends them at once (Python's default).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from recsys.config import ConfigError, check_training_extras, load_config
from recsys.library_warnings import quiet_known_library_warnings
from recsys.training.distributed import shutdown
from recsys.training.parent_death import die_with_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys.train")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.batch_size=8192")
    args = parser.parse_args(argv)
    die_with_parent()  # our torchrun (or launcher) killed outright: this worker goes too
    rank = int(os.environ.get("RANK", "0"))
    # Our progress lines on rank 0; everyone else's (torchrec, fbgemm) only from WARNING up.
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("torchrec.distributed.utils").setLevel(logging.ERROR)  # per-table DP notices
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("recsys").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    quiet_known_library_warnings()
    try:
        cfg = load_config(args.config, args.overrides)
        check_training_extras(cfg, args.config)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    from recsys.training.checkpoint import CheckpointError
    from recsys.training.comm_failure import HostLostError, end_stuck_launcher, first_to_report
    from recsys.training.finite import NonFiniteError
    from recsys.training.trainer import run
    from recsys.training.run_dir import RunDirError, RunFinished

    try:
        run(cfg)
    except RunFinished as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return 0
    except (RunDirError, CheckpointError, NonFiniteError, ConfigError, FileNotFoundError, FileExistsError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)  # peers may be blocked in a collective on a dead group: no teardown
    except HostLostError as e:  # another host is gone or silent: one line per surviving host
        if first_to_report():
            print(f"error: {e}", file=sys.stderr, flush=True)
        end_stuck_launcher(float(os.environ.get("RECSYS_LAUNCHER_GRACE_S", "10")))
        os._exit(2)  # no teardown: the groups are broken, and the store may be on the lost host
    except KeyboardInterrupt:  # a direct run's Ctrl-C (under `recsys train` the launcher says it)
        if rank == 0 and "RECSYS_RUN_LOCK_PID" not in os.environ:
            print("interrupted: the last complete checkpoint is kept (resume=true continues from it)", file=sys.stderr, flush=True)
        os._exit(130)
    finally:
        shutdown()
    return 0


def _exit_now(code: int) -> None:
    """Leaves without interpreter teardown, once everything is written and the process groups are
    destroyed: at teardown, C++ objects of torch.distributed / gloo that Python still references
    (sub-groups held by the merger, DMP's sharding env) are destroyed in no set order, and one of
    them has been seen to abort a worker ("terminate called without an active exception") after
    a run that had finished and written everything. The run's files are closed by then
    (checkpoints fsynced, summary.json renamed into place, metrics and TensorBoard closed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
