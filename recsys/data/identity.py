"""What data a run trains on, as a checkpoint records it, and how two of them differ.

Why: a checkpoint that does not know its data resumes on anything: another file under the same
name, the first rows of the training file as "new data" (its eval split then holds training
rows, AUC 1.0), another eval fraction. Every checkpoint records the identity of its data
(`DataSource.identity()`), and a resume on other data stops with one line saying what changed
(recsys/training/run_dir.py), unless `resume_on_new_data=true` asks for exactly that.

The identity is the content, not the location: for preprocessed files each input's name, size,
row count and SHA-256 of all its bytes (the shard cache's manifest, recsys/data/cache_key.py;
where one side's cache predates whole-file hashes, the hashes of the first and last MiB),
the parse options that change rows, the row count and the eval fraction; for generated data
every setting of the generator. Moving the files elsewhere keeps the identity; the row order
(`data.order`) is part of the checkpoint's state shape instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# cache-key options that change which rows come out (rows_per_shard and max_bad_fraction do not)
ROW_OPTIONS = ("kind", "pad_short_rows", "parser_version", "format_version")

SYNTHETIC_FIELDS = ("seed", "train_rows", "eval_rows", "zipf_exponent", "teacher_head", "teacher_dim", "teacher_scale", "positive_rate")


def synthetic_identity(data_cfg: Any) -> dict[str, Any]:
    return {"source": "synthetic", **{f: getattr(data_cfg, f) for f in SYNTHETIC_FIELDS}}


def shard_identity(manifest: dict[str, Any], eval_fraction: float) -> dict[str, Any]:
    """The identity of a preprocessed cache's inputs, from its manifest."""
    key = manifest.get("cache_key") or {}
    sizes = {f.get("path"): f for f in key.get("files", []) if isinstance(f, dict)}
    files = []
    for src in manifest.get("sources", []):
        path = str(src.get("path"))
        known = sizes.get(path, {})
        files.append(
            {
                "name": Path(path).name,
                "bytes": known.get("size"),
                "rows": src.get("good_rows"),
                "sha256": src.get("sha256"),  # None for caches built before whole-file hashes
                "head_tail": f"{known.get('head_sha256')} {known.get('tail_sha256')}",
            }
        )
    options = key.get("options", {})
    return {
        "source": manifest.get("kind"),
        "files": files,
        "options": {k: options.get(k) for k in ROW_OPTIONS if k in options},
        "rows": manifest.get("num_rows"),
        "eval_fraction": eval_fraction,
    }


def _same_file(x: dict[str, Any], y: dict[str, Any]) -> bool:
    """Name, size and rows equal, and the content: by whole-file SHA-256 where both sides have
    one, else by the head and tail hashes (a cache built before whole-file hashes, on either side)."""
    if any(x.get(k) != y.get(k) for k in ("name", "bytes", "rows")):
        return False
    if x.get("sha256") and y.get("sha256"):
        return x["sha256"] == y["sha256"]
    return x.get("head_tail") == y.get("head_tail")


def describe_data_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """One line saying how the data `new` differs from `old` (None when it is the same)."""
    same_files = len(old.get("files", [])) == len(new.get("files", [])) and all(
        _same_file(x, y) for x, y in zip(old.get("files", []), new.get("files", []))
    )
    rest = ("source", "options", "rows", "eval_fraction", *SYNTHETIC_FIELDS)
    if same_files and all(old.get(k) == new.get(k) for k in rest):
        return None
    if old.get("source") != new.get("source"):
        return f"data.source {old.get('source')} -> {new.get('source')}"
    if new.get("source") == "synthetic":
        diffs = [f"data.{f} {old.get(f)} -> {new.get(f)}" for f in SYNTHETIC_FIELDS if old.get(f) != new.get(f)]
        return ", ".join(diffs) or "generated data settings changed"
    parts = []
    a, b = old.get("files", []), new.get("files", [])
    if len(a) != len(b):
        parts.append(f"{_files(len(a))} -> {_files(len(b))} ({_names(a)} -> {_names(b)})")
    else:
        for i, (x, y) in enumerate(zip(a, b)):
            if _same_file(x, y):
                continue
            where = f"input {i + 1} of {len(b)}" if len(b) > 1 else "the input"
            if x.get("name") != y.get("name"):
                parts.append(f"{where} {x.get('name')} -> {y.get('name')}")
            elif x.get("bytes") != y.get("bytes") or x.get("rows") != y.get("rows"):
                parts.append(
                    f"{y.get('name')}: {x.get('rows')} rows, {x.get('bytes')} bytes -> {y.get('rows')} rows, {y.get('bytes')} bytes"
                )
            else:
                parts.append(f"{y.get('name')}: other content, same size")
            break  # the first file that differs says enough
    if old.get("options") != new.get("options"):
        parts.append(f"parse options {old.get('options')} -> {new.get('options')}")
    if old.get("eval_fraction") != new.get("eval_fraction"):
        parts.append(f"data.eval_fraction {old.get('eval_fraction')} -> {new.get('eval_fraction')}")
    if not parts and old.get("rows") != new.get("rows"):
        parts.append(f"rows {old.get('rows')} -> {new.get('rows')}")
    return "; ".join(parts) or "the data changed"


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _names(files: list[dict[str, Any]]) -> str:
    names = [str(f.get("name")) for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
