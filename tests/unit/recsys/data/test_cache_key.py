"""The cache key of a set of input files: hashes checked against hashlib over the same bytes, a
key that changes whenever an input or an option does, and the one line saying what changed."""

from __future__ import annotations

import hashlib
import os
import re

import pytest

from recsys.data.cache_key import KEY_VERSION, content_sha256, describe_change, file_identity, file_sha256, make_key
from recsys.data.errors import DataFileError


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_file_sha256_hashes_every_byte_across_chunks(tmp_path):
    data = bytes(range(256)) * 41 + b"tail"
    f = tmp_path / "a.bin"
    f.write_bytes(data)
    assert file_sha256(f) == file_sha256(f, chunk_bytes=100) == _sha(data)
    assert content_sha256(f) == _sha(data)
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == _sha(b"")


def test_content_sha256_of_a_missing_file_is_one_line(tmp_path):
    msg = f"{tmp_path / 'gone.tsv'}: file disappeared while reading it; nothing was written"
    with pytest.raises(DataFileError, match=re.escape(msg)):
        content_sha256(tmp_path / "gone.tsv")


def test_file_identity_records_size_mtime_and_the_head_and_tail_blocks(tmp_path):
    data = b"0123456789" * 5  # 50 bytes, blocks of 16
    f = tmp_path / "a.tsv"
    f.write_bytes(data)
    os.utime(f, ns=(1_000_000_000, 1_234_567_890_123))
    ident = file_identity(tmp_path / "." / "a.tsv", block_bytes=16)
    assert ident == {
        "path": str(f.resolve()),
        "size": 50,
        "mtime_ns": 1_234_567_890_123,
        "head_sha256": _sha(data[:16]),
        "tail_sha256": _sha(data[-16:]),
    }
    small = file_identity(f, block_bytes=64)  # one block: head and tail are the same bytes
    assert small["head_sha256"] == small["tail_sha256"] == _sha(data)


def test_file_identity_of_a_directory_is_one_line(tmp_path):
    with pytest.raises(DataFileError, match=re.escape(f"{tmp_path}: is a directory, not a data file; nothing was written")):
        file_identity(tmp_path)


def test_the_key_changes_with_every_input_and_option(tmp_path):
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_bytes(b"1\t2\n" * 10)
    b.write_bytes(b"0\t5\n" * 10)
    key = make_key([a, b], {"z": 1, "kind": "criteo"})
    assert key["key_version"] == KEY_VERSION and list(key["options"]) == ["kind", "z"]  # options sorted
    assert [f["path"] for f in key["files"]] == [str(a.resolve()), str(b.resolve())]
    assert make_key([a, b], {"kind": "criteo", "z": 1}) == key  # same files, same options
    assert make_key([b, a], {"kind": "criteo", "z": 1}) != key
    assert make_key([a, b], {"kind": "criteo", "z": 2}) != key
    st = a.stat()
    a.write_bytes(b"1\t3\n" * 10)  # same size, other content ...
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old mtime
    assert make_key([a, b], {"kind": "criteo", "z": 1}) != key


def _key(files: list[dict], **options) -> dict:
    return {"key_version": KEY_VERSION, "files": files, "options": options}


def _file(path: str, size: int = 10, head: str = "h", tail: str = "t", mtime: int = 1) -> dict:
    return {"path": path, "size": size, "mtime_ns": mtime, "head_sha256": head, "tail_sha256": tail}


@pytest.mark.parametrize(
    "old,new,why",
    [
        (_key([_file("/a")], kind="criteo"), _key([_file("/a")], kind="criteo"), None),
        (None, _key([_file("/a")]), "it was built without a content key (an older version); its inputs cannot be verified"),
        ({"key_version": 0}, _key([_file("/a")]), "it was built without a content key (an older version); its inputs cannot be verified"),
        (_key([_file("/a")]), _key([_file("/a", size=12)]), "/a changed (size 10 -> 12 bytes)"),
        (_key([_file("/a")]), _key([_file("/a", tail="t2")]), "/a changed (content changed)"),
        (_key([_file("/a")]), _key([_file("/a", mtime=2)]), "/a changed (modification time changed)"),
        (_key([_file("/a")]), _key([_file("/a"), _file("/b")]), "new input file /b"),
        (
            _key([_file("/a")]),
            _key([_file(f"/n{i}") for i in range(5)]),
            "new input files /n0, /n1, /n2 and 2 more; input file /a no longer given",
        ),
        (_key([_file("/a"), _file("/b"), _file("/c")]), _key([_file("/a")]), "input files /b, /c no longer given"),
        (_key([_file("/a"), _file("/b")]), _key([_file("/b"), _file("/a")]), "the input files are given in another order"),
        (
            _key([_file("/a")], kind="criteo", rows_per_shard=64),
            _key([_file("/a")], kind="criteo", rows_per_shard=100, pad=True),
            "parse options changed: pad None -> True, rows_per_shard 64 -> 100",
        ),
    ],
)
def test_describe_change_says_what_changed(old, new, why):
    assert describe_change(old, new) == why
