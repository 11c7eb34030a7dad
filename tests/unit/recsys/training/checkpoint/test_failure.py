"""One line for a failed checkpoint write or load: the first line of an exception, DCP's
per-rank wrapping undone, the OSError dug out of the chain, and a full disk named when torch.save
lost its OSError."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

from torch.distributed.checkpoint.api import CheckpointException

import recsys.training.checkpoint.failure as failure
from recsys.training.checkpoint.failure import FULL_DISK_BYTES, describe_failure, disk_reason


def test_describe_failure_is_the_type_and_the_first_line():
    assert describe_failure(ValueError("bad header\nmore detail")) == "ValueError: bad header"
    assert describe_failure(KeyError()) == "KeyError"
    wrapped = CheckpointException("ranks:dict_keys([1, 0])", {1: (OSError("disk gone\ntrace"), None), 0: (ValueError("x"), None)})
    assert describe_failure(wrapped) == "OSError: disk gone"


def test_disk_reason_finds_the_oserror_in_the_chain():
    full = OSError(errno.ENOSPC, "No space left on device", "/ck/step_000000010.tmp/__0_0.distcp")
    assert disk_reason(full) == "No space left on device (/ck/step_000000010.tmp/__0_0.distcp)"
    outer = RuntimeError("unexpected pos 704 vs 598")
    outer.__context__ = OSError(errno.EDQUOT, "quota")
    assert disk_reason(outer) == os.strerror(errno.EDQUOT)
    caused = RuntimeError("write failed")
    caused.__cause__ = OSError("no errno here")
    assert disk_reason(CheckpointException("x", {0: (caused, None)})) == "no errno here"


def _statvfs(free: int, total: int, asked: list[str]):
    def fake(path: object) -> SimpleNamespace:
        asked.append(str(path))
        if not Path(path).exists():
            raise FileNotFoundError(path)
        return SimpleNamespace(f_bavail=free, f_frsize=1, f_blocks=total)

    return fake


def test_without_an_oserror_a_nearly_full_disk_is_the_reason(tmp_path, monkeypatch):
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    where = tmp_path / "step_000000010.tmp" / "host1"  # not there (any more): its parents are asked
    asked: list[str] = []
    monkeypatch.setattr(failure.os, "statvfs", _statvfs(FULL_DISK_BYTES - 1, 1 << 40, asked))
    assert disk_reason(lost, where) == "No space left on device"
    assert asked == [str(where), str(where.parent), str(tmp_path)]
    monkeypatch.setattr(failure.os, "statvfs", _statvfs(FULL_DISK_BYTES, 1 << 40, []))
    assert disk_reason(lost, where) == "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    # a small file system: 1/16 of it counts as nearly full
    monkeypatch.setattr(failure.os, "statvfs", _statvfs(15, 16 * 16, []))
    assert disk_reason(lost, where) == "No space left on device"
    monkeypatch.setattr(failure.os, "statvfs", _statvfs(16, 16 * 16, []))
    assert disk_reason(lost, where) == describe_failure(lost)
    assert disk_reason(lost) == describe_failure(lost)  # nowhere to ask
