"""A checkpoint directory on disk: step names, the marker, the listing of committed checkpoints,
and the atomic commit of a written `.tmp` directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.training.checkpoint.layout import MARKER, commit_dir, committed, read_marker, step_dir_name, step_of


def test_step_names_round_trip_and_refuse_steps_without_a_name():
    assert step_dir_name(120) == "step_000000120"
    assert step_dir_name(0) == "step_000000000"
    assert step_of(Path("/runs/x") / step_dir_name(999_999_999)) == 999_999_999
    with pytest.raises(ValueError, match=r"^checkpoint step -5 is outside \[0, 1e9\)$"):
        step_dir_name(-5)
    with pytest.raises(ValueError, match=r"^checkpoint step 1000000000 is outside \[0, 1e9\)$"):
        step_dir_name(10**9)


@pytest.mark.parametrize("name", ["step_000000120.tmp", "step_000000120.old.tmp", "step_120", "step_0000001200", "host1"])
def test_other_names_have_no_step(name):
    assert step_of(Path(name)) is None


def _dir(root: Path, name: str, marker: bool) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if marker:
        (d / MARKER).write_text(json.dumps({"step": step_of(d)}))
    return d


def test_committed_lists_marked_step_directories_oldest_first(tmp_path):
    assert committed(tmp_path / "absent") == []
    _dir(tmp_path, "step_000000030", True)
    _dir(tmp_path, "step_000000010", True)
    _dir(tmp_path, "step_000000020", False)  # no marker: a crashed commit
    _dir(tmp_path, "step_000000040.tmp", True)  # still being written
    _dir(tmp_path, "notes", True)
    assert [p.name for p in committed(tmp_path)] == ["step_000000010", "step_000000030"]
    assert read_marker(tmp_path / "step_000000030") == {"step": 30}


def test_commit_dir_writes_the_marker_and_renames_the_whole_directory(tmp_path):
    tmp = tmp_path / "step_000000010.tmp"
    (tmp / "host1").mkdir(parents=True)
    (tmp / "rank0.pt").write_bytes(b"r0")
    (tmp / "host1" / ".metadata").write_bytes(b"m")
    final = tmp_path / "step_000000010"
    commit_dir(tmp, final, {"step": 10, "extra": {"samples": 5}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000010"]
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == ["COMMITTED", "host1", "host1/.metadata", "rank0.pt"]
    assert read_marker(final) == {"step": 10, "extra": {"samples": 5}}
    assert (final / "host1" / ".metadata").read_bytes() == b"m"


def test_commit_dir_replaces_a_checkpoint_of_the_same_step(tmp_path):
    final = tmp_path / "step_000000010"
    for n, content in enumerate((b"first", b"second")):
        tmp = tmp_path / "step_000000010.tmp"
        tmp.mkdir()
        (tmp / "rank0.pt").write_bytes(content)
        commit_dir(tmp, final, {"step": 10, "n": n})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000010"]  # no .old.tmp left
    assert (final / "rank0.pt").read_bytes() == b"second" and read_marker(final) == {"step": 10, "n": 1}
