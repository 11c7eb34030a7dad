"""Whether a checkpoint on disk can load: every file its DCP metadata names, present and long
enough, one rank<r>.pt per writing rank, and the bytes against the SHA-256 recorded at save time;
and the hashes themselves, dealt over the ranks (a gloo group of one here)."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recsys.training.checkpoint.integrity import checkpoint_files, hash_files, incomplete_reason


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkpoint(path: Path, world_size: int = 1, hashes: bool = True) -> Path:
    """A checkpoint as the Checkpointer leaves it: DCP files, rank files, COMMITTED with hashes."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": {"a": torch.arange(10.0), "b": torch.ones(3, 2)}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False))
    for r in range(world_size):
        torch.save({"state": {}}, path / f"rank{r}.pt")
    files = sorted(p.name for p in path.iterdir())
    marker = {"step": 5, "world_size": world_size, "extra": {}}
    if hashes:
        marker["sha256"] = {f: _sha(path / f) for f in files}
    (path / "COMMITTED").write_text(json.dumps(marker))
    return path


def test_a_complete_checkpoint_has_no_reason(tmp_path):
    assert incomplete_reason(_checkpoint(tmp_path / "c", world_size=2)) is None


def test_a_missing_or_truncated_storage_file_is_named(tmp_path):
    path = _checkpoint(tmp_path / "c")
    storage = sorted(path.glob("*.distcp"))
    size = storage[1].stat().st_size
    storage[1].write_bytes(storage[1].read_bytes()[:100])
    assert incomplete_reason(path, verify_bytes=False) == f"{storage[1]} is truncated (100 of {size} bytes)"
    storage[0].unlink()
    assert incomplete_reason(path) == f"{storage[0]} is missing"


def test_a_missing_rank_file_marker_or_metadata_is_named(tmp_path):
    path = _checkpoint(tmp_path / "c", world_size=3)
    (path / "rank2.pt").write_bytes(b"")
    assert incomplete_reason(path) == f"{path / 'rank2.pt'} is missing"
    (path / ".metadata").write_bytes(b"\x80garbage")
    assert incomplete_reason(path) == f"{path / '.metadata'} is missing or unreadable"
    (path / "COMMITTED").write_text("{not json")
    assert incomplete_reason(path) == f"{path / 'COMMITTED'} is unreadable"


def test_other_bytes_of_the_same_length_fail_only_the_hash_check(tmp_path):
    path = _checkpoint(tmp_path / "c")
    victim = sorted(path.glob("*.distcp"))[0]
    victim.write_bytes(bytes(victim.stat().st_size))
    assert incomplete_reason(path, verify_bytes=False) is None
    assert incomplete_reason(path) == f"{victim} is corrupt (its SHA-256 differs from the one recorded when it was written)"
    old = _checkpoint(tmp_path / "old", hashes=False)  # written before hashes were recorded
    victim = sorted(old.glob("*.distcp"))[0]
    victim.write_bytes(bytes(victim.stat().st_size))
    assert incomplete_reason(old) is None


def _tree(tmp: Path) -> None:
    (tmp / "host1").mkdir(parents=True)
    for name, data in {"rank0.pt": b"zero", "__0_0.distcp": b"abc", "host1/.metadata": b"m", "COMMITTED": b"{}"}.items():
        (tmp / name).write_bytes(data)


def test_checkpoint_files_lists_every_file_but_the_marker(tmp_path):
    _tree(tmp_path)
    assert checkpoint_files(tmp_path) == ["__0_0.distcp", "host1/.metadata", "rank0.pt"]


def test_hash_files_gives_every_files_sha256(tmp_path, gloo_world_of_one):
    _tree(tmp_path)
    assert hash_files(tmp_path, rank=0, world_size=1) == {
        "__0_0.distcp": hashlib.sha256(b"abc").hexdigest(),
        "host1/.metadata": hashlib.sha256(b"m").hexdigest(),
        "rank0.pt": hashlib.sha256(b"zero").hexdigest(),
    }


def test_hash_files_raises_a_files_oserror_after_the_exchange(tmp_path, gloo_world_of_one, monkeypatch):
    import recsys.training.checkpoint.integrity as integrity

    _tree(tmp_path)

    def unreadable(path: Path) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(integrity, "file_sha256", unreadable)
    with pytest.raises(PermissionError, match="Permission denied"):
        hash_files(tmp_path, rank=0, world_size=1)
