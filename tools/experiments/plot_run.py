"""Plot a run's curves: `python tools/experiments/plot_run.py runs/demo [--out curves.png]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recsys.training.plots import plot_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir / 'metrics.jsonl'} not found", file=sys.stderr)
        return 2
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
