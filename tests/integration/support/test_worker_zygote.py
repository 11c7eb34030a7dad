"""The integration tier's worker zygote (tests/support/zygote.py): a process it stands in for
behaves, to its parent, like the process itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import zygote

PROBE = str(Path(zygote.__file__).with_name("zygote_probe_worker.py"))


@pytest.fixture
def zygotes(worker_zygote):
    if worker_zygote is None:
        pytest.skip("the worker zygote is off (RECSYS_TEST_NO_ZYGOTE)")
    for sock in os.environ[zygote.ENV_SOCKET].split(os.pathsep):  # the first tests may come before it is ready
        deadline = time.monotonic() + 120
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
    return worker_zygote


def _probe(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", PROBE, *args], stdout=subprocess.PIPE, text=True, env=env or dict(os.environ), cwd=cwd)


def test_a_served_process_exits_with_the_workers_code_output_argv_cwd_and_environment(zygotes, tmp_path):
    p = _probe("3", "x y", env=dict(os.environ, PROBE="here"), cwd=tmp_path)
    out, _ = p.communicate(timeout=60)
    seen = json.loads(out)
    assert p.returncode == 3
    assert seen["argv"] == ["3", "x y"] and seen["cwd"] == str(tmp_path) and seen["probe"] == "here"
    assert seen["pid"] != p.pid and seen["ppid"] != p.pid  # forked by the zygote, not the process itself


def test_a_signal_to_the_stand_in_ends_the_worker_the_same_way(zygotes):
    p = _probe("wait")
    seen = json.loads(p.stdout.readline())
    assert seen["pid"] != p.pid
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert not Path(f"/proc/{seen['pid']}").exists()


def test_killing_the_stand_in_kills_the_worker(zygotes):
    p = _probe("wait")
    seen = json.loads(p.stdout.readline())
    p.kill()
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{seen['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{seen['pid']}").exists()


def test_ranks_get_zygotes_of_different_hash_seeds(zygotes):
    seeds = []
    for rank in ("0", "1"):
        p = _probe("0", env=dict(os.environ, RANK=rank))
        seeds.append(json.loads(p.communicate(timeout=60)[0])["hash"])
    assert seeds[0] != seeds[1]


def test_a_process_with_other_import_time_settings_starts_as_usual(zygotes):
    p = _probe("0", env=dict(os.environ, TRITON_INTERPRET="1"))
    seen = json.loads(p.communicate(timeout=120)[0])
    assert seen["pid"] == p.pid
    assert "refused: TRITON_INTERPRET='1'" in (zygotes / "log").read_text()
