"""Durable writes and crash leftovers: what the files hold, the manifest replaced in place, and
only the side directories of dead writers on this host removed."""

from __future__ import annotations

import json
import os
import socket

import numpy as np

from recsys.data.durable_writes import OLD_TAG, TMP_TAG, clean_stale_temp_dirs, replace_manifest, save_npy, side_name, write_json


def _dead_pid() -> int:
    """A pid no process has now (counting down from a high one)."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


def test_write_json_and_save_npy_write_what_they_are_given(tmp_path):
    write_json(tmp_path / "m.json", {"b": 1, "a": [1, 2]})
    text = (tmp_path / "m.json").read_text()
    assert text == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}\n'  # key order kept, final newline
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    save_npy(tmp_path / "a.npy", arr)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), arr)


def test_replace_manifest_swaps_the_file_and_leaves_no_temp(tmp_path):
    (tmp_path / "manifest.json").write_text('{"num_rows": 1}\n')
    replace_manifest(tmp_path, {"num_rows": 2})
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"num_rows": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_side_names_are_hidden_and_carry_host_and_pid(tmp_path):
    name = side_name(tmp_path / "cache", TMP_TAG)
    prefix = f".cache.tmp.{_host()}.{os.getpid()}."
    assert name.startswith(prefix) and len(name) == len(prefix) + 8
    assert side_name(tmp_path / "cache", TMP_TAG) != name  # a random tail: two writers never collide


def test_only_leftovers_of_dead_processes_on_this_host_are_removed(tmp_path):
    dest = tmp_path / "cache"
    dead, host = _dead_pid(), _host()
    stale_tmp = tmp_path / f".cache.{TMP_TAG}.{host}.{dead}.abcd1234"
    stale_old = tmp_path / f".cache.{OLD_TAG}.{host}.{dead}.0000ffff"
    live = tmp_path / f".cache.{TMP_TAG}.{host}.{os.getpid()}.12345678"
    other_host = tmp_path / f".cache.{TMP_TAG}.{host}-elsewhere.{dead}.12345678"
    other_dest = tmp_path / f".cache2.{TMP_TAG}.{host}.{dead}.12345678"
    not_ours = tmp_path / f".cache.{TMP_TAG}.{host}.notapid.12345678"
    for d in (stale_tmp, live, other_host, other_dest, not_ours):
        d.mkdir()
        (d / "shard_00000.dense.npy").write_bytes(b"x")
    stale_old.write_bytes(b"a file, not a directory")
    removed = clean_stale_temp_dirs(dest)
    assert sorted(removed) == sorted([stale_tmp, stale_old])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, other_host, other_dest, not_ours))
    assert clean_stale_temp_dirs(tmp_path / "nowhere" / "cache") == []
