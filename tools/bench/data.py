"""Benchmark: raw Criteo text -> shards, our parser against today's per-line parser, pyarrow and pandas.

All peers run on the same generated multi-million-row Criteo Kaggle-format TSV (rows of the shared
1k-row sample with random 8-hex-digit ids; random rows if the sample is absent), in the same run,
``--repeats`` times, interleaved, so the ratios hold on a machine shared with other work:

- ``reference``: end to end (read, parse, write shards) with every line through the per-line
  reference parser (``parse_criteo_block(fast=False)``: the parser preprocessing used before);
- ``ours_1w`` / ``ours_2w``: ``recsys.data.preprocess.raw_formats.preprocess_criteo`` end to end with 1 and
  2 worker threads; their shards are checked byte-identical to the reference's;
- ``pyarrow_raw``: ``pyarrow.csv.read_csv`` with all cores, ids kept as strings: a raw parse into
  an Arrow table, no validation, no hex decoding, nothing written;
- ``pandas``: ``pandas.read_csv`` (C engine), ids as strings, same caveats;
- ``loader_read`` / ``loader``: reading the shards in file order, 8192 rows at a time, as arrays /
  into torchrec ``Batch``es (``recsys.data.batching.to_batch``: ids hashed into 2^20-row tables);
- ``loader_shuffled_read`` / ``loader_shuffled``: the same through a shuffled epoch
  (``recsys.data.order``, the training default: 256-row blocks, 64K-row windows) on one rank;
  ``loader_shuffled_rank_of_2``: rank 0 of 2 (it reads every window, keeps its half of each batch),
  counted in the samples that rank trains on.

pyarrow and pandas are optional (not project dependencies): install them outside the venv, e.g.
``.venv/bin/pip install --target /tmp/parser-site pyarrow pandas`` and run with
``PYTHONPATH=.:/tmp/parser-site``; without them their rows say ``null``.

    PYTHONPATH=. .venv/bin/python tools/bench/data.py --rows 2000000 --repeats 3

Rates are rows/s of wall time (the file is in the page cache after the first pass), and rows per
CPU-second of this process (all its threads): on a machine shared with other work the CPU
figures depend much less on the load. The last line is one JSON object. The generated file lives in
``--workdir`` and is deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recsys.data.preprocess.bad_rows import FileReport  # noqa: E402
from recsys.data.preprocess.parse_criteo import CRITEO_COLUMNS, CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, parse_criteo_block  # noqa: E402
from recsys.data.preprocess.pipeline import Progress, run_file  # noqa: E402
from recsys.data.preprocess.raw_formats import preprocess_criteo  # noqa: E402
from recsys.data.preprocess.read_blocks import BlockReader  # noqa: E402
from recsys.data.shard_reader import ShardedDataset  # noqa: E402
from recsys.data.shard_writer import ShardWriter  # noqa: E402

SAMPLE = (
    Path(os.environ.get("RECSYS_SHARED_DIR") or Path(__file__).resolve().parents[3] / "shared") / "data" / "criteo_kaggle_sample_1k.tsv"
)


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """Kaggle-format TSV: label and integers of real sample rows, random ids where the row has one."""
    rng = random.Random(seed)
    if SAMPLE.is_file():
        templates = [(line.rstrip("\n").split("\t") + [""] * 40)[:40] for line in open(SAMPLE) if line.strip()]
    else:
        templates = [[str(rng.randint(0, 1)), *(str(rng.randint(0, 500)) for _ in range(13)), *(["x"] * 26)] for _ in range(1000)]
    with open(path, "w", buffering=1 << 22) as f:
        out: list[str] = []
        for _ in range(rows):
            t = templates[rng.randrange(len(templates))]
            ids = "%0208x" % rng.getrandbits(832)
            out.append("\t".join(t[:14] + [ids[8 * j : 8 * j + 8] if t[14 + j] else "" for j in range(26)]))
            if len(out) == 10_000:
                f.write("\n".join(out) + "\n")
                out = []
        if out:
            f.write("\n".join(out) + "\n")


def reference_preprocess(path: Path, out: Path) -> int:
    """End to end with every line through the reference (per-line) parser, single thread."""
    reader = BlockReader(path, b"\t", CRITEO_COLUMNS, CRITEO_COLUMNS)
    report = FileReport(path=str(path), format="tsv")
    with ShardWriter(
        out, kind="criteo", dense_names=CRITEO_DENSE_NAMES, sparse_names=CRITEO_SPARSE_NAMES, rows_per_shard=1 << 20, overwrite=True
    ) as writer:
        run_file(
            reader, lambda b, lay: parse_criteo_block(b, lay, 14, fast=False), writer, report, None, 1, Progress([path], every_s=1e9), 0.01
        )
        writer.commit([report.to_dict()])
    return report.good_rows


def ours(path: Path, out: Path, workers: int) -> int:
    return preprocess_criteo(path, out, overwrite=True, workers=workers)["num_rows"]


def pyarrow_raw(path: Path) -> int | None:
    try:
        import pyarrow as pa
        from pyarrow import csv as pacsv
    except ImportError:
        return None
    table = pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=CRITEO_COLUMNS, use_threads=True),
        parse_options=pacsv.ParseOptions(delimiter="\t"),
        convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in CRITEO_SPARSE_NAMES}),
    )
    return table.num_rows


def pandas_read(path: Path) -> int | None:
    try:
        import pandas as pd
    except ImportError:
        return None
    df = pd.read_csv(path, sep="\t", header=None, names=CRITEO_COLUMNS, engine="c", dtype={c: str for c in CRITEO_SPARSE_NAMES})
    return len(df)


def loader(out: Path, batch: int = 8192, batches: bool = True, shuffle: bool = False, world: int = 1) -> int:
    """One epoch of the shards, 8192 rows a global batch, in file order or shuffled, on rank 0 of
    ``world``: read only, or read into torchrec Batches. Returns the rows rank 0 trains on."""
    from recsys.data.batching import rank_rows, to_batch  # imported before the clock starts: see main()
    from recsys.data.order import EpochOrder, WindowReader
    from recsys.data.synthetic import RowBlock

    ds = ShardedDataset.open(out)
    cards = np.full(len(ds.sparse_names), 1 << 20, dtype=np.int64)
    reader = WindowReader(EpochOrder(ds.num_rows, shuffle), lambda lo, hi: RowBlock(*ds.read(lo, hi), None))
    n = 0
    for step in range(ds.num_rows // batch):
        lo, hi = rank_rows(step, batch, 0, world)
        block = reader.read(0, lo, hi)
        if batches:
            to_batch(block, ds.sparse_names, cards)
        n += hi - lo
    return n


def shard_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("shard_*.npy")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], int | None]) -> tuple[float | None, float | None, int | None]:
    """(rows per wall second, rows per CPU second of this process, rows)."""
    t, c = time.perf_counter(), _cpu_s()
    n = fn()
    dt, dc = time.perf_counter() - t, _cpu_s() - c
    return (None, None, None) if n is None else (n / dt, n / max(dc, 1e-9), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_data"))
    ap.add_argument("--file", type=Path, help="an existing Criteo TSV instead of a generated one")
    ap.add_argument("--keep", action="store_true", help="keep the generated file and shards")
    ap.add_argument(
        "--peers",
        default="",
        help="comma-separated subset of the peers (default: all); the loader peers read ours_1w's shards, so keep ours_1w among them",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import recsys.data.batching  # noqa: F401  (torch and torchrec load here, not inside a timing)

    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.file or args.workdir / f"criteo_{args.rows}.tsv"
    if not path.is_file():
        t = time.perf_counter()
        generate(path, args.rows)
        print(f"generated {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.0f} s", flush=True)
    size_mb = path.stat().st_size / 1e6
    outs = {k: args.workdir / f"shards_{k}" for k in ("reference", "ours_1w", "ours_2w")}
    peers: dict[str, Callable[[], int | None]] = {
        "reference": lambda: reference_preprocess(path, outs["reference"]),
        "ours_1w": lambda: ours(path, outs["ours_1w"], 1),
        "ours_2w": lambda: ours(path, outs["ours_2w"], 2),
        "pyarrow_raw": lambda: pyarrow_raw(path),
        "pandas": lambda: pandas_read(path),
        "loader_read": lambda: loader(outs["ours_1w"], batches=False),
        "loader": lambda: loader(outs["ours_1w"]),
        "loader_shuffled_read": lambda: loader(outs["ours_1w"], batches=False, shuffle=True),
        "loader_shuffled": lambda: loader(outs["ours_1w"], shuffle=True),
        "loader_shuffled_rank_of_2": lambda: loader(outs["ours_1w"], shuffle=True, world=2),
    }
    chosen = args.peers.split(",") if args.peers else list(peers)
    if set(chosen) - set(peers):
        ap.error(f"unknown peers {sorted(set(chosen) - set(peers))} (choose from {', '.join(peers)})")
    rates: dict[str, list[float]] = {k: [] for k in peers}  # a peer left out keeps no figures (null)
    cpu_rates: dict[str, list[float]] = {k: [] for k in peers}
    rows: dict[str, int | None] = {k: None for k in peers}
    for r in range(args.repeats):
        for name, fn in peers.items():
            if name not in chosen:
                continue
            rate, cpu_rate, n = timed(fn)
            rows[name] = n
            if rate is not None and cpu_rate is not None:
                rates[name].append(rate)
                cpu_rates[name].append(cpu_rate)
            print(
                f"round {r + 1}: {name:12s} "
                + ("not available" if rate is None else f"{rate / 1e3:8.0f}K rows/s, {cpu_rate / 1e3:8.0f}K rows per CPU-second"),
                flush=True,
            )
    med = {k: (statistics.median(v) if v else None) for k, v in rates.items()}
    cpu_med = {k: (statistics.median(v) if v else None) for k, v in cpu_rates.items()}
    digests = {k: shard_digest(o) for k, o in outs.items() if k in chosen}
    identical = len(set(digests.values())) == 1 if len(digests) > 1 else None  # None: nothing to compare

    def ratio(a: str, b: str) -> float | None:
        return None if med[a] is None or med[b] is None else round(med[a] / med[b], 2)

    print(f"\n{path.name}: {rows['ours_1w']} rows, {size_mb:.0f} MB; median of {args.repeats} rounds, rows/s")
    for k, v in med.items():
        print(f"  {k:12s} {'-' if v is None else f'{v / 1e3:8.0f}K'}")
    print(f"  shards of {' / '.join(digests)} byte-identical: {identical}")
    result = {
        "bench": "data",
        "file": str(path),
        "rows": rows["ours_1w"],
        "file_mb": round(size_mb, 1),
        "repeats": args.repeats,
        "cores": len(os.sched_getaffinity(0)),
        "rows_per_s": {k: (None if v is None else round(v)) for k, v in med.items() if not k.startswith("loader")},
        "loader_read_samples_per_s": None if med["loader_read"] is None else round(med["loader_read"]),
        "loader_samples_per_s": None if med["loader"] is None else round(med["loader"]),
        **{
            f"{k}_samples_per_s": None if med[k] is None else round(med[k])
            for k in ("loader_shuffled_read", "loader_shuffled", "loader_shuffled_rank_of_2")
        },
        "rows_per_cpu_s": {k: (None if v is None else round(v)) for k, v in cpu_med.items() if not k.startswith("loader")},
        "cpu_ratios": {
            k: (None if cpu_med[a] is None or cpu_med[b] is None else round(cpu_med[a] / cpu_med[b], 2))
            for k, (a, b) in {
                "ours_1w/reference": ("ours_1w", "reference"),
                "ours_2w/reference": ("ours_2w", "reference"),
                "ours_1w/pyarrow_raw": ("ours_1w", "pyarrow_raw"),
            }.items()
        },
        "ratios": {
            "ours_1w/reference": ratio("ours_1w", "reference"),
            "ours_2w/reference": ratio("ours_2w", "reference"),
            "ours_2w/pyarrow_raw": ratio("ours_2w", "pyarrow_raw"),
            "ours_1w/pyarrow_raw": ratio("ours_1w", "pyarrow_raw"),
            "ours_2w/pandas": ratio("ours_2w", "pandas"),
        },
        "round_ratios": {  # the same ratios per round: peers ran back to back, under the same load
            "ours_1w/reference": [round(a / b, 2) for a, b in zip(rates["ours_1w"], rates["reference"])],
            "ours_2w/reference": [round(a / b, 2) for a, b in zip(rates["ours_2w"], rates["reference"])],
            "ours_2w/pyarrow_raw": [round(a / b, 2) for a, b in zip(rates["ours_2w"], rates["pyarrow_raw"])],
        },
        "identical_shards": identical,
    }
    if not args.keep:
        for o in outs.values():
            shutil.rmtree(o, ignore_errors=True)
        if args.file is None:
            path.unlink()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
