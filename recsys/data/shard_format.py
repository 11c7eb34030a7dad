"""The on-disk shard format for preprocessed CTR data: file names, dtypes and the manifest's schema.

Raw Criteo/Avazu text is parsed once (see :mod:`recsys.data.preprocess.raw_formats`) into fixed-size numpy
shards so that training never re-parses text and every rank can memory-map any row range cheaply.

Layout of a shard directory::

    manifest.json               # written last; its presence marks a complete directory
    shard_00000.dense.npy       # float32 [n, num_dense], log1p(max(x, 0)), missing -> 0
    shard_00000.sparse.npy      # int64   [n, num_sparse], raw 32-bit ids >= 0, -1 = missing
    shard_00000.labels.npy      # float32 [n]
    shard_00001.*.npy ...

Why a module of its own: the writer (:mod:`recsys.data.shard_writer`), the reader
(:mod:`recsys.data.shard_reader`) and the joining of fanned-out parts
(:mod:`recsys.data.preprocess.fanout`) must agree on exactly these names, dtypes and manifest keys;
:func:`read_manifest` is the one check of a manifest that all of them rely on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MISSING_ID = -1
DENSE_TRANSFORM = "log1p(max(x, 0)); missing -> 0"
KINDS = ("criteo", "avazu")

DENSE_DTYPE = np.dtype(np.float32)
SPARSE_DTYPE = np.dtype(np.int64)
LABEL_DTYPE = np.dtype(np.float32)

_SHARD_NAME_RE = re.compile(r"^shard_\d{5,}$")
# A joined dataset (recsys/data/preprocess/fanout.py) lists the shards of its parts where they were written,
# ``parts/NNNNN`` below the manifest, instead of copying them; nothing else is allowed (no ``..``).
_PART_DIR_RE = re.compile(r"^parts/\d{5,}$")


class InvalidShardDirError(ValueError):
    """A path that is not a complete, consistent shard directory (one-line message)."""


def shard_name(index: int) -> str:
    """Base name of shard ``index`` (files are ``<name>.dense.npy`` etc.)."""
    return f"shard_{index:05d}"


def shard_paths(root: Path, name: str) -> tuple[Path, Path, Path]:
    """(dense, sparse, labels) file paths of one shard."""
    return (
        root / f"{name}.dense.npy",
        root / f"{name}.sparse.npy",
        root / f"{name}.labels.npy",
    )


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Load and structurally validate ``<path>/manifest.json``.

    Raises :class:`InvalidShardDirError` (a ``ValueError``) with a one-line message naming the
    path for a missing directory, missing manifest, bad JSON or missing/ill-typed keys.
    """
    root = Path(path)
    mpath = root / MANIFEST_NAME
    if not root.is_dir():
        raise InvalidShardDirError(f"{root}: shard directory does not exist")
    if not mpath.is_file():
        raise InvalidShardDirError(f"{root}: not a complete shard directory (no {MANIFEST_NAME}; an interrupted write?)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidShardDirError(f"{mpath}: corrupt manifest ({msg})") from None

    def bad(what: str) -> InvalidShardDirError:
        return InvalidShardDirError(f"{mpath}: corrupt manifest ({what})")

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    if manifest.get("kind") not in KINDS:
        raise bad(f"kind {manifest.get('kind')!r}, expected one of {list(KINDS)}")
    for key in ("dense_names", "sparse_names"):
        names = manifest.get(key)
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise bad(f"{key} must be a list of strings")
    num_rows = manifest.get("num_rows")
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise bad("num_rows must be a non-negative integer")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("shards must be a list")
    total = 0
    for s in shards:
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("name"), str)
            or not _SHARD_NAME_RE.match(s["name"])
            or not isinstance(s.get("num_rows"), int)
            or s["num_rows"] <= 0
            or ("dir" in s and not (isinstance(s["dir"], str) and _PART_DIR_RE.match(s["dir"])))
        ):
            raise bad(f"bad shard entry {s!r}")
        total += s["num_rows"]
    if total != num_rows:
        raise bad(f"shard row counts sum to {total}, num_rows says {num_rows}")
    if not isinstance(manifest.get("sources", []), list):
        raise bad("sources must be a list")
    return manifest
