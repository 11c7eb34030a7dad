"""Worker entry point, run by torchrun in every process:

    torchrun --nproc_per_node 2 -m recsys.train --config configs/experiments/demo.yaml [key=value ...]

`recsys train` (recsys/cli.py) validates the config and launches this for you.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from recsys.config import ConfigError, load_config
from recsys.training.distributed import shutdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys.train")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.batch_size=8192")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # Our progress lines on rank 0; everyone else's (torchrec, fbgemm) only from WARNING up.
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("torchrec.distributed.utils").setLevel(logging.ERROR)  # per-table DP notices
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("recsys").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from recsys.training.loop import run

    try:
        run(cfg)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
