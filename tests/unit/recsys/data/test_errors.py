"""One-line errors for unreadable inputs and failed cache writes: the same message whichever
stage hit the problem, naming the file and saying what is wrong."""

from __future__ import annotations

import errno
import gzip
import re
import shutil
import zlib
from types import SimpleNamespace

import pytest

from recsys.data.errors import CacheWriteError, DataFileError, read_error, reading, write_error


def _read_gz(path) -> bytes:
    with gzip.open(path, "rb") as f:
        return f.read()


def test_a_truncated_gzip_file(tmp_path):
    f = tmp_path / "day_0.gz"
    f.write_bytes(gzip.compress(b"1\t2\t3\n" * 1000)[:-30])
    with pytest.raises(DataFileError, match=re.escape(f"{f}: truncated gzip file (the compressed stream ends early); nothing was written")):
        with reading(f):
            _read_gz(f)


def test_a_file_named_gz_that_is_not_gzip(tmp_path):
    f = tmp_path / "day_0.gz"
    f.write_bytes(b"1\t2\t3\n")
    with pytest.raises(DataFileError, match=re.escape(f"{f}: not a gzip file although named .gz; nothing was written")):
        with reading(f):
            _read_gz(f)


def test_a_corrupt_gzip_stream(tmp_path):
    f = tmp_path / "day_0.gz"
    data = bytearray(gzip.compress(b"0123456789" * 100))
    data[15:25] = b"\xff" * 10  # inside the deflate stream
    f.write_bytes(bytes(data))
    with pytest.raises(DataFileError, match=re.escape(f"{f}: corrupt gzip file (")) as e:
        with reading(f):
            _read_gz(f)
    assert str(e.value).endswith("; nothing was written") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "exc,what",
    [
        (EOFError(), "file ends unexpectedly"),
        (zlib.error("invalid stored block lengths"), "corrupt gzip file (invalid stored block lengths)"),
        (PermissionError(errno.EACCES, "Permission denied"), "cannot read it (permission denied)"),
        (FileNotFoundError(errno.ENOENT, "No such file"), "file disappeared while reading it"),
        (OSError(errno.EIO, "Input/output error"), "cannot read it (Input/output error)"),
        (OSError("device gone\nsecond line"), "cannot read it (device gone)"),
        (ValueError("odd\nmore"), "odd"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_read_error_says_what_went_wrong(tmp_path, exc, what):
    f = tmp_path / "a.tsv"
    err = read_error(f, exc)
    assert isinstance(err, DataFileError) and str(err) == f"{f}: {what}; nothing was written"


def test_a_directory_where_a_file_was_expected(tmp_path):
    assert str(read_error(tmp_path, OSError("x"))) == f"{tmp_path}: is a directory, not a data file; nothing was written"


def test_reading_lets_other_errors_through(tmp_path):
    with pytest.raises(ValueError, match="^bad column$"):
        with reading(tmp_path / "a.tsv"):
            raise ValueError("bad column")
    original = CacheWriteError("disk full")
    with pytest.raises(CacheWriteError, match="^disk full$") as e:
        with reading(tmp_path / "a.tsv"):
            raise original
    assert e.value is original  # a write failure inside a read stays a write failure


def test_write_error_names_the_cache_the_file_and_the_free_space(tmp_path, monkeypatch):
    probed = []

    def disk_usage(path):
        probed.append(path)
        return SimpleNamespace(total=10**12, used=10**12 - 4096, free=4096)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    err = write_error(
        tmp_path / "cache", tmp_path / "cache.tmp" / "shard_00003.sparse.npy", OSError(errno.ENOSPC, "No space left on device")
    )
    assert isinstance(err, CacheWriteError) and isinstance(err, OSError) and isinstance(err, ValueError)
    assert err.errno == errno.ENOSPC
    assert str(err) == (
        f"{tmp_path / 'cache'}: writing the shard cache failed at shard_00003.sparse.npy: No space left on device "
        "(4096 bytes free on that filesystem); nothing was written"
    )
    assert probed == [tmp_path]  # the nearest directory that exists: the temp dir is not there yet


def test_free_space_that_cannot_be_measured_is_left_out(tmp_path, monkeypatch):
    def disk_usage(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    err = write_error(tmp_path, tmp_path / "x.npy", OSError(errno.EIO, "Input/output error"))
    assert str(err) == f"{tmp_path}: writing the shard cache failed at x.npy: Input/output error; nothing was written"


def test_a_short_numpy_write_is_recognised_as_a_full_disk(tmp_path):
    err = write_error(tmp_path / "cache", tmp_path / "x.npy", OSError("1000 requested and 512 written"))
    assert err.errno is None
    assert str(err).startswith(
        f"{tmp_path / 'cache'}: writing the shard cache failed at x.npy: 1000 requested and 512 written: is the disk full? ("
    )
