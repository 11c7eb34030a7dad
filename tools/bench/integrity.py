"""Benchmark: what the integrity checks cost, against the work they guard, in the same run.

- **Checkpoint hashes.** A raw-size checkpoint (Criteo Kaggle raw table sizes,
  `criteo_kaggle_raw`: 33.8M rows x `--dim`, fp32 weights plus one fp32 row-wise optimizer
  value per row, as FBGEMM's row-wise Adagrad keeps) is written with
  `torch.distributed.checkpoint` exactly as `Checkpointer` writes it (one file per tensor), in
  one process. Peers: the DCP save itself (`save_s`), the SHA-256 of every file as
  `Checkpointer._hash_files` takes it right after the save (`hash_s`, files in the page cache),
  and the load-side check `incomplete_reason(verify_bytes=True)` (`verify_s`). Ratios:
  hash/save and verify/save.
- **Data hashes.** A Criteo Kaggle-format TSV of `--data-mb` MB (the shared 1k-row sample
  repeated, or random rows without it) is preprocessed by `preprocess_criteo` (`parse_s`,
  what a cache build costs, whole-file hashes included) and hashed alone (`hash_s`, what
  `data.verify=full` adds to every reuse of the cache). Ratio: hash/parse.

    PYTHONPATH=. .venv/bin/python tools/bench/integrity.py --dim 16 --data-mb 256

The last line is one JSON object. Everything is written under `--workdir` and deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def checkpoint_costs(workdir: Path, dim: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from recsys.config import CARDINALITY_PRESETS
    from recsys.data.cache_key import file_sha256
    from recsys.training.checkpoint.integrity import checkpoint_files, incomplete_reason
    from recsys.training.checkpoint.layout import MARKER

    cards = CARDINALITY_PRESETS["criteo_kaggle_raw"]
    state = {}
    for i, rows in enumerate(cards):
        state[f"model.t{i}.weight"] = torch.rand(rows, dim) * 0.01
        state[f"optim.t{i}.momentum1"] = torch.rand(rows)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out = workdir / "ckpt"
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), single_file_per_rank=False))
    save_s = time.perf_counter() - t0
    del state
    t0 = time.perf_counter()
    hashes = {name: file_sha256(out / name) for name in checkpoint_files(out)}
    hash_s = time.perf_counter() - t0
    (out / "rank0.pt").write_bytes(b"x")
    hashes["rank0.pt"] = file_sha256(out / "rank0.pt")
    (out / MARKER).write_text(json.dumps({"step": 1, "world_size": 1, "extra": {}, "sha256": hashes}))
    t0 = time.perf_counter()
    why = incomplete_reason(out, verify_bytes=True)
    verify_s = time.perf_counter() - t0
    assert why is None, why
    written = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {
        "rows": sum(cards),
        "dim": dim,
        "state_gb": nbytes / 1e9,
        "files_gb": written / 1e9,
        "files": len(hashes),
        "save_s": save_s,
        "hash_s": hash_s,
        "verify_s": verify_s,
        "hash_over_save": hash_s / save_s,
        "verify_over_save": verify_s / save_s,
        "hash_gb_per_s": written / 1e9 / hash_s,
    }


def _criteo_lines(shared: Path) -> list[str]:
    sample = shared / "criteo_kaggle_sample_1k.tsv"
    if sample.is_file():
        return [ln if ln.endswith("\n") else ln + "\n" for ln in sample.read_text().splitlines()]
    rng = random.Random(0)
    return [
        "\t".join(
            [str(rng.randint(0, 1))] + [str(rng.randint(0, 99)) for _ in range(13)] + [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        )
        + "\n"
        for _ in range(1000)
    ]


def data_costs(workdir: Path, data_mb: int, shared: Path) -> dict:
    from recsys.data.cache_key import content_sha256
    from recsys.data.preprocess.raw_formats import preprocess_criteo

    lines = "".join(_criteo_lines(shared)).encode()
    path = workdir / "day.tsv"
    with open(path, "wb") as f:
        for _ in range(max(1, data_mb * 1_000_000 // len(lines))):
            f.write(lines)
    size = path.stat().st_size
    content_sha256(path)  # into the page cache, as after the parse
    t0 = time.perf_counter()
    content_sha256(path)
    hash_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = preprocess_criteo(path, workdir / "cache")
    parse_s = time.perf_counter() - t0
    shutil.rmtree(workdir / "cache")
    path.unlink()
    return {
        "bytes_gb": size / 1e9,
        "rows": manifest["num_rows"],
        "parse_s": parse_s,
        "hash_s": hash_s,
        "hash_over_parse": hash_s / parse_s,
        "hash_s_per_gb": hash_s / (size / 1e9),
        "parse_s_per_gb": parse_s / (size / 1e9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--data-mb", type=int, default=256)
    ap.add_argument("--skip-checkpoint", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[3] / "shared" / "data"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_integrity_", dir=args.workdir))
    try:
        result = {"machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}", "torch": torch.__version__}
        result["data"] = data_costs(work, args.data_mb, Path(args.shared))
        print("data:", result["data"], flush=True)
        if not args.skip_checkpoint:
            result["checkpoint"] = checkpoint_costs(work, args.dim)
            print("checkpoint:", result["checkpoint"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
