"""Run integrity: run directories own their runs, no orphaned workers, resume only what
is compatible, broken checkpoints and full disks. Real `recsys train` launches (torchrun, gloo,
DMP, FBGEMM) on configs/experiments/smoke.yaml with tiny step counts; the unit tests at the top
need no processes.

A launch costs ~13 s of CPU, nearly all of it process start-up (the launcher, torchrun and each
worker importing torch, torchrec and fbgemm), so runs that several tests read are module fixtures
(tests change copies of them), and most launchers run in this process (`_launched`, `_ok`; their
torchrun and workers are real processes). The launches whose launcher is signalled or killed, a
second launch into a locked run_dir, and the run a worker stops mid-training (the diverging run)
start the real command (`_recsys`): there the exit status a shell sees is the point."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.training.checkpoint import Checkpointer
from recsys.training.checkpoint.failure import disk_reason
from recsys.training.checkpoint.integrity import incomplete_reason
from recsys.training.checkpoint.layout import MARKER, step_dir_name
from recsys.training.checkpoint.shape import shape_changes
from recsys.training.run_dir import RunDirError, RunLock, check_fresh
from tests.support.cli import run_main
from tests.support.processes import descendants, run_main_and_children

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
RECSYS = [sys.executable, "-m", "recsys.cli", "train", "--config", str(SMOKE)]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _recsys(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(RECSYS + args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)


def _checked(args: list[str]) -> subprocess.CompletedProcess:
    """`recsys train ARGS` where the launcher's own checks answer before any worker starts, run in
    this process (tests/support/cli.py); the tests about processes, signals and locks between
    processes launch the real command (`_recsys`)."""
    return run_main("recsys.cli", "train", "--config", str(SMOKE), *args, cwd=REPO)


def _launched(args: list[str]) -> subprocess.CompletedProcess:
    """`recsys train ARGS` with its launcher in this process (its torchrun and workers are real
    processes): the launcher's ~3 s of CPU starting up saved."""
    return run_main_and_children("recsys.cli", "train", "--config", str(SMOKE), *args, cwd=REPO)


def _ok(args: list[str]) -> subprocess.CompletedProcess:
    r = _launched(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _last_line(r: subprocess.CompletedProcess) -> str:
    """The one line a refusal prints (stderr), after checking there is no traceback."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1]


def _fake_checkpoint(root: Path, step: int, lineage: str = "old") -> Path:
    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    (d / MARKER).write_text(json.dumps({"step": step, "world_size": 1, "extra": {}, "lineage": lineage}))
    return d


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- unit tests: no processes ------------------------------------------------------------------


def test_lock_names_the_holder_and_admits_its_children(tmp_path):
    with RunLock(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
        take = "from recsys.training.run_dir import RunLock; import sys; RunLock(sys.argv[1]).acquire(allow_ancestor=True)"
        child = [sys.executable, "-c", take, str(tmp_path / "run")]
        launched = dict(ENV, RECSYS_RUN_LOCK_PID=str(os.getpid()))  # what `recsys train` tells its workers
        assert subprocess.run(child, env=launched, capture_output=True).returncode == 0
        for env in (ENV, dict(ENV, RECSYS_RUN_LOCK_PID="1")):  # not started by the holder as its launcher
            stranger = subprocess.run(child, env=env, capture_output=True, text=True)
            assert stranger.returncode != 0
            assert f"run_dir {tmp_path / 'run'} is in use by another run (pid {os.getpid()})" in stranger.stderr
    RunLock(tmp_path / "run").acquire().release()  # released with its holder


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=r"^run_dir .*/f exists and is not a directory$"):
        RunLock(tmp_path / "f").acquire()


def test_fresh_run_refuses_old_checkpoints_and_overwrite_moves_them_aside(tmp_path):
    run = tmp_path / "run"
    for s in (30, 40):
        _fake_checkpoint(run / "checkpoints", s)
    (run / "metrics.jsonl").write_text("{}\n")
    assert check_fresh(run, resume=True, overwrite=False) is None  # a resume continues them
    with pytest.raises(RunDirError) as e:
        check_fresh(run, resume=False, overwrite=False)
    assert str(e.value) == (
        f"run_dir {run} holds checkpoints of an earlier run (newest step 40); pass resume=true to "
        "continue it, overwrite=true to move it aside, or choose another run_dir"
    )
    with RunLock(run):
        aside = check_fresh(run, resume=False, overwrite=True)
        assert aside.name.startswith("run.old-") and aside.parent == tmp_path
        assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_000000030", "step_000000040"]
        assert (aside / "metrics.jsonl").read_text() == "{}\n"  # nothing deleted
        assert [p.name for p in run.iterdir()] == [".lock"]


def test_pruning_keeps_the_newest_of_this_run_only(tmp_path):
    """keep-2 by name deleted a new run's step 10/20 next to an old run's 30/40."""
    root = tmp_path / "checkpoints"
    for s in (30, 40):
        _fake_checkpoint(root, s, "old")
    ck = Checkpointer(root, 0, 1, keep=2)
    ck.lineage = "new"
    for s in (10, 20, 25):
        _fake_checkpoint(root, s, "new")
        ck._prune(s)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step_000000020", "step_000000025", "step_000000030", "step_000000040"]


def test_checkpoint_names_refuse_negative_steps():
    assert step_dir_name(120) == "step_000000120"
    with pytest.raises(ValueError, match=r"checkpoint step -5 is outside"):
        step_dir_name(-5)


def test_shape_changes_name_keys_old_and_new():
    old = {"train.batch_size": 512, "data.tables": {"C1": 100, "C2": 50}, "model.name": "deepfm"}
    new = {"train.batch_size": 256, "data.tables": {"C1": 100, "C2": 60}, "model.name": "deepfm"}
    assert shape_changes(old, new) == ["data.tables.C2 50 -> 60", "train.batch_size 512 -> 256"]


# -- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run30(tmp_path_factory):
    """A finished 2-rank run: 30 steps, checkpoints at 10, 20, 30 (keep 3)."""
    run_dir = tmp_path_factory.mktemp("run30") / "run"
    _ok([f"run_dir={run_dir}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=3"])
    return run_dir


def test_fresh_run_into_a_finished_run_dir_stops(run30):
    before = (run30 / "metrics.jsonl").read_text()
    r = _checked([f"run_dir={run30}", "train.max_steps=30"])
    assert r.returncode == 2
    assert _last_line(r) == (
        f"error: run_dir {run30} holds checkpoints of an earlier run (newest step 30); pass "
        "resume=true to continue it, overwrite=true to move it aside, or choose another run_dir"
    )
    assert (run30 / "metrics.jsonl").read_text() == before


def test_resuming_a_finished_run_says_so_and_writes_nothing(run30):
    def snapshot() -> dict:
        return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in run30.rglob("*") if p.name != ".lock"}

    before = snapshot()
    r = _checked([f"run_dir={run30}", "train.max_steps=30", "resume=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _last_line(r) == (
        f"the run in {run30} already finished at step 30 (step_000000030, summary.json); nothing "
        "to do (raise train.max_steps or train.epochs to train on)"
    )
    assert snapshot() == before  # no duplicate eval line, no new checkpoint


@pytest.mark.parametrize(
    "override, change",
    [
        ("train.batch_size=256", "train.batch_size 512 -> 256"),
        ("model.name=dcn", "model.name deepfm -> dcn"),
        ("model.embedding_dim=16", "model.embedding_dim 8 -> 16"),
        ("optim.embedding=adagrad", "optim.embedding rowwise_adagrad -> adagrad"),
        ("data.shuffle=false", "data.order shuffle seed=0 block=256 buffer=65536 -> null"),
        ("data.shuffle_seed=1", "data.order shuffle seed=0 block=256 buffer=65536 -> shuffle seed=1 block=256 buffer=65536"),
    ],
)
def test_resume_with_changed_state_shape_names_the_keys(run30, override, change):
    r = _checked([f"run_dir={run30}", "train.max_steps=40", "resume=true", override])
    assert r.returncode == 2
    assert _last_line(r) == (
        f"error: cannot resume from {run30}/checkpoints/step_000000030: the config changed "
        f"({change}); restore these values, or start a new run (another run_dir, or overwrite=true)"
    )


def test_worker_entry_point_checks_the_lock_too(run30):
    """`torchrun -m recsys.train` users have no launcher: rank 0 takes the lock itself."""
    with RunLock(run30):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "recsys.train",
                "--config",
                str(SMOKE),
                f"run_dir={run30}",
                "train.nproc_per_node=1",
                "resume=true",
                "train.max_steps=40",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
            env=ENV,
        )
    assert r.returncode == 2
    assert (
        _last_line(r) == f"error: run_dir {run30} is in use by another run (pid {os.getpid()}); wait for it to "
        "finish, stop it, or choose another run_dir"
    )


def test_corrupt_newest_checkpoint_falls_back_and_matches_an_uninterrupted_run(run30, tmp_path):
    """Newest checkpoint truncated: a one-line warning naming the file, resume from step 20, and
    the end metrics equal those of the uninterrupted 30-step run (same steps 21..30 replayed)."""
    broken = tmp_path / "run"
    shutil.copytree(run30, broken)
    (broken / "summary.json").unlink()
    victim = sorted((broken / "checkpoints" / "step_000000030").glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    r = _ok([f"run_dir={broken}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=3", "resume=true"])
    warn = [ln for ln in r.stderr.splitlines() if "incomplete" in ln]
    assert len(warn) == 1 and f"checkpoint step_000000030 is incomplete ({victim} is truncated" in warn[0], r.stderr
    s, ref = _summary(broken), _summary(run30)
    assert s["resumed_from"].endswith("step_000000020")
    for key in ("auc", "logloss"):
        assert s[key] == pytest.approx(ref[key], abs=1e-6), key
    # a missing .metadata is found the same way
    (broken / "checkpoints" / "step_000000020" / ".metadata").unlink()
    assert (
        incomplete_reason(broken / "checkpoints" / "step_000000020")
        == f"{broken}/checkpoints/step_000000020/.metadata is missing or unreadable"
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _launch_until_a_checkpoint(run_dir: Path) -> subprocess.Popen:
    """A long `recsys train` run, returned once it has a complete checkpoint."""
    launcher = subprocess.Popen(
        RECSYS + [f"run_dir={run_dir}", "train.max_steps=100000", "checkpoint.every_steps=10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=ENV,
    )
    # Any complete checkpoint, not step_10 itself: at ~100 steps/s keep-2 pruning removes
    # step_10 a fraction of a second after it is written, between two polls.
    deadline = time.monotonic() + 300
    while not list((run_dir / "checkpoints").glob(f"step_*/{MARKER}")):
        if launcher.poll() is not None or time.monotonic() > deadline:
            for p in descendants(launcher.pid):  # communicate() would wait for 100000 steps
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
            pytest.fail(f"no checkpoint within 300 s (launcher rc {launcher.poll()}):\n" + launcher.communicate(timeout=60)[1][-3000:])
        time.sleep(0.2)
    return launcher


def test_torchrun_killed_alone_is_said_by_the_launcher(tmp_path, real_worker_processes):
    """kill -9 of torchrun (the OOM killer's choice, say): the workers follow it, and the launcher
    says what happened in one line and exits 128 + 9, instead of a silent 247."""
    run_dir = tmp_path / "run"
    launcher = _launch_until_a_checkpoint(run_dir)
    try:
        tree = descendants(launcher.pid)
        torchrun = [p for p in tree if b"torchrun_quiet" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(torchrun) == 1, tree
        os.kill(torchrun[0], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in tree if p != launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree if p != launcher.pid and _alive(p)]
    finally:
        for p in descendants(launcher.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "Traceback" not in err
    tail = err.strip().splitlines()[-1]
    assert tail.startswith(
        f"error: torchrun (pid {torchrun[0]}) was killed by SIGKILL; its workers were stopped with "
        f"it; the last complete checkpoint is {run_dir}/checkpoints/step_"
    ), err[-2000:]
    assert tail.endswith(" (resume=true continues from it)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_the_launcher_stops_every_worker(tmp_path, sig, real_worker_processes):
    """A second run on the same dir stops at once naming the holder; the launcher alone killed
    (Ctrl-C, SIGTERM, SIGKILL) takes torchrun and every worker with it; SIGINT/SIGTERM print one
    line, and the last complete checkpoint resumes. Under SIGINT the second run is the real command
    (the exit status a shell sees); under the other signals its launcher runs in this process,
    which does not hold the lock either, so the refusal is the same and is over before the running
    workers have burnt seconds of CPU."""
    run_dir = tmp_path / "run"
    launcher = _launch_until_a_checkpoint(run_dir)
    try:
        tree = descendants(launcher.pid)
        assert len(tree) >= 4  # launcher, torchrun, 2 workers
        second = (_recsys if sig == signal.SIGINT else _checked)([f"run_dir={run_dir}", "train.max_steps=20", "resume=true"])
        assert second.returncode == 2
        assert _last_line(second) == (
            f"error: run_dir {run_dir} is in use by another run (pid {launcher.pid}); "
            "wait for it to finish, stop it, or choose another run_dir"
        )
        os.kill(launcher.pid, sig)
        _, err = launcher.communicate(timeout=120)
        deadline = time.monotonic() + 60  # a liveness bound, not a speed check
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree if _alive(p)]
    finally:
        for p in descendants(launcher.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert launcher.returncode == (-sig if sig == signal.SIGKILL else 128 + sig)
    if sig != signal.SIGKILL:
        assert "Traceback" not in err
        tail = err.strip().splitlines()[-1]
        assert tail.startswith(
            f"stopped by {sig.name}: every worker has exited; the last complete checkpoint is {run_dir}/checkpoints/step_"
        ), err[-2000:]
        assert not [ln for ln in err.splitlines() if not ln.startswith("[rank0]") and ln != tail], err[-3000:]
    if sig == signal.SIGINT:  # resumable from the last complete checkpoint
        latest = Checkpointer(run_dir / "checkpoints", -1, 1).latest_complete()
        _ok([f"run_dir={run_dir}", f"train.max_steps={int(latest.name[5:]) + 10}", "resume=true"])
        assert _summary(run_dir)["resumed_from"] == str(latest)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, options: str = ""):
    """A tmpfs of ``size`` mounted at ``where`` (made here) for the block; skips without root."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_full_disk_during_a_checkpoint(tmp_path):
    """A tmpfs too small for the first checkpoint: one line, no `.tmp` directory or plan temp file."""
    with _tmpfs(tmp_path / "small", "700k") as mnt:
        run_dir = mnt / "run"
        r = _launched([f"run_dir={run_dir}", "train.max_steps=20", "checkpoint.every_steps=10"])
        assert r.returncode == 2
        assert _last_line(r) == (
            f"error: checkpoint {run_dir}/checkpoints/step_000000010 not written: No space left on device; no earlier checkpoint"
        )
        assert not list(run_dir.rglob("*tmp*"))
        assert (run_dir / "plan.json").is_file() and not list((run_dir / "checkpoints").iterdir())


def test_full_disk_is_named_when_torch_save_lost_the_oserror(tmp_path):
    """torch.save reports a short write as `RuntimeError: [enforce fail ...] unexpected pos`, with the
    ENOSPC OSError as its context only sometimes. Wrapped by DCP with no OSError anywhere, the reason
    comes from the disk itself: full -> "No space left on device"; not full -> the exception's line."""
    from torch.distributed.checkpoint.api import CheckpointException

    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("ranks:dict_keys([0, 1])", {0: (lost, None), 1: (lost, None)})
    with _tmpfs(tmp_path / "full", "64k") as mnt:
        step_tmp = mnt / "step_000000010.tmp"
        step_tmp.mkdir()
        assert disk_reason(wrapped, step_tmp) == "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        with pytest.raises(OSError):
            with open(step_tmp / "fill", "wb") as f:
                f.write(bytes(128 << 10))
        assert disk_reason(wrapped, step_tmp) == "No space left on device"
        with_context = RuntimeError("unexpected pos")
        with_context.__context__ = OSError(28, "No space left on device")
        assert disk_reason(CheckpointException("x", {1: (with_context, None)})) == "No space left on device"


def test_checkpoint_with_corrupt_bytes_falls_back_by_its_hashes(run30, tmp_path):
    """Files of the right size with other bytes inside pass the completeness check; their SHA-256
    (recorded in COMMITTED at save time) does not: one warning naming the file, the resume goes
    on from step 20 and ends where the uninterrupted run ended."""
    broken = tmp_path / "run"
    shutil.copytree(run30, broken)
    (broken / "summary.json").unlink()
    victim = sorted((broken / "checkpoints" / "step_000000030").glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    data = bytearray(victim.read_bytes())
    data[100:8292] = bytes(8192)  # 8 KB overwritten, same size
    victim.write_bytes(bytes(data))
    r = _ok([f"run_dir={broken}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=3", "resume=true"])
    warn = [ln for ln in r.stderr.splitlines() if "incomplete" in ln]
    assert len(warn) == 1 and warn[0].endswith(
        f"warning: checkpoint step_000000030 is incomplete ({victim} is corrupt (its SHA-256 differs from the one "
        "recorded when it was written)); falling back to an earlier one"
    ), r.stderr[-3000:]
    s, ref = _summary(broken), _summary(run30)
    assert s["resumed_from"].endswith("step_000000020")
    for key in ("auc", "logloss"):
        assert s[key] == pytest.approx(ref[key], abs=1e-6), key


def test_corrupt_bytes_in_a_checkpoint_without_hashes_is_one_line(run30, tmp_path):
    """A checkpoint written before hashes were recorded: the corruption shows only when DCP loads
    it: one line naming the checkpoint, exit 2, nothing written."""
    broken = tmp_path / "run"
    shutil.copytree(run30, broken)
    (broken / "summary.json").unlink()
    newest = broken / "checkpoints" / "step_000000030"
    marker = json.loads((newest / MARKER).read_text())
    assert set(marker["sha256"]) == {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file() and p.name != MARKER}
    del marker["sha256"]
    (newest / MARKER).write_text(json.dumps(marker))
    victim = sorted(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    data = bytearray(victim.read_bytes())
    data[100:400] = bytes(300)
    victim.write_bytes(bytes(data))
    before = (broken / "metrics.jsonl").read_text()
    r = _launched([f"run_dir={broken}", "train.max_steps=40", "resume=true"])
    assert r.returncode == 2
    line = _last_line(r)
    assert line.startswith(f"error: cannot load checkpoint {newest}: ") and line.endswith(
        "; move it aside to resume from an earlier one"
    ), r.stderr[-3000:]
    assert [ln for ln in r.stderr.splitlines() if not ln.startswith("[rank0]")] == [line]
    assert (broken / "metrics.jsonl").read_text() == before


@pytest.fixture(scope="module")
def overwritten10(run30, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of `run30` overwritten by a new 10-step run that merges every 50 steps and asks for a
    checkpoint every 5: the overwrite test reads what was moved aside, the interval test the
    rounded checkpoint interval (one launch for both)."""
    run_dir = tmp_path_factory.mktemp("overwritten10") / "run"
    shutil.copytree(run30, run_dir)
    r = _ok([f"run_dir={run_dir}", "train.max_steps=10", "overwrite=true", "train.merge_every=50", "checkpoint.every_steps=5"])
    return run_dir, r


def test_overwrite_moves_the_earlier_run_aside(run30, overwritten10):
    run_dir, r = overwritten10
    old_metrics = (run30 / "metrics.jsonl").read_text()
    (aside,) = run_dir.parent.glob("run.old-*")
    assert f"overwrite=true: moved the earlier run in {run_dir} to {aside}" in r.stderr
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == [f"step_{s:09d}" for s in (10, 20, 30)]
    assert (aside / "metrics.jsonl").read_text() == old_metrics
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000000010"]
    assert _summary(run_dir)["steps"] == 10 and _summary(run_dir)["resumed_from"] is None


def test_world_size_change_reshards_model_and_optimizer_exactly(run30, tmp_path):
    """DCP reshards on load. The sound comparison: the 2-rank checkpoint of step 20 goes through a
    1-rank job (loaded, nothing trained, saved again at step 20 by 1 rank), then back to 2 ranks,
    which train steps 21..30: if the model and the fused optimizer state (rowwise Adagrad) survive
    both reshardings exactly, the end equals the uninterrupted 2-rank run. (A 1-rank continuation
    is not compared with the 2-rank run: another world size gets another sharding plan, whose
    floating-point sums differ; see docs/run_integrity.md.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(run30, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000000030")
    r = _ok([f"run_dir={run_dir}", "train.max_steps=20", "resume=true", "train.nproc_per_node=1"])
    assert "resharded from 2 to 1 ranks" in r.stderr
    marker = json.loads((run_dir / "checkpoints" / "step_000000020" / MARKER).read_text())
    assert marker["world_size"] == 1 and marker["shape"]["train.world_size"] == 1
    assert not (run_dir / "checkpoints" / "step_000000020" / "rank1.pt").exists()  # written by one rank
    r = _ok([f"run_dir={run_dir}", "train.max_steps=30", "checkpoint.every_steps=10", "resume=true"])
    assert "resharded from 1 to 2 ranks" in r.stderr
    s, ref = _summary(run_dir), _summary(run30)
    assert s["world_size"] == 2 and s["resumed_from"].endswith("step_000000020")
    for key in ("auc", "logloss"):
        assert s[key] == pytest.approx(ref[key], abs=1e-6), (key, s[key], ref[key])


COWCLIP = ["optim.embedding=cowclip_adam", "optim.embedding_lr=0.002"]


def _cowclip30(run_dir: Path, extra: list[str]) -> Path:
    """A finished 2-rank CowClip-Adam run: 30 steps, checkpoints at 10, 20, 30 (keep 3)."""
    _ok([f"run_dir={run_dir}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=3", *COWCLIP, *extra])
    return run_dir


@pytest.fixture(scope="module")
def cowclip30(tmp_path_factory):
    """`_cowclip30` with the defaults (catch-up), which the resharding and the export tests both
    read (tests change copies of it)."""
    return _cowclip30(tmp_path_factory.mktemp("cowclip30") / "run", [])


@pytest.mark.parametrize(
    "extra", [[], ["sharding.sharding_types=[row_wise]", "optim.embedding_l2_scope=batch"]], ids=["catchup", "row_wise-lazy"]
)
def test_cowclip_adam_reshards_2_1_2_exactly(request, tmp_path, extra):
    """CowClip-Adam's state (moments per element, each row's step) through 2 -> 1 -> 2 ranks: the
    2-rank checkpoint of step 20 is loaded and saved again by 1 rank, then 2 ranks train steps
    21..30; the end equals the uninterrupted 2-rank run to the last digit."""
    opts = [*COWCLIP, *extra]
    ref = _cowclip30(tmp_path / "ref", extra) if extra else request.getfixturevalue("cowclip30")
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_000000030")
    (run / "summary.json").unlink()
    r = _ok([f"run_dir={run}", "train.max_steps=20", "resume=true", "train.nproc_per_node=1", *opts])
    assert "resharded from 2 to 1 ranks" in r.stderr
    r = _ok([f"run_dir={run}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=3", "resume=true", *opts])
    assert "resharded from 1 to 2 ranks" in r.stderr
    s, want = _summary(run), _summary(ref)
    assert (s["auc"], s["logloss"]) == (want["auc"], want["logloss"])


def test_kstep_run_reshards_1_2_1_ranks_per_host_exactly(tmp_path):
    """A k-step run (2 hosts, merges every 5 steps, unmerged moments: host 1 keeps its own
    optimizer state in host1/) with CowClip-Adam: its checkpoint of step 20, written by 1 rank per
    host, is loaded and saved again by 2 ranks per host, then 1 rank per host trains steps 21..30;
    the end equals the uninterrupted run to the last digit."""
    opts = [
        "optim.embedding=cowclip_adam",
        "optim.embedding_lr=0.002",
        "train.hosts=2",
        "train.merge_every=5",
        "checkpoint.every_steps=10",
        "checkpoint.keep=3",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _ok([f"run_dir={ref}", "train.max_steps=30", *opts])
    assert (ref / "checkpoints" / "step_000000020" / "host1").is_dir()  # the case with per-host optimizer files
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_000000030")
    (run / "summary.json").unlink()
    r = _ok([f"run_dir={run}", "train.max_steps=20", "resume=true", "train.nproc_per_node=4", *opts])
    assert "resharded from 1 to 2 ranks per host" in r.stderr
    marker = json.loads((run / "checkpoints" / "step_000000020" / MARKER).read_text())
    assert (marker["hosts"], marker["ranks_per_host"]) == (2, 2)
    r = _ok([f"run_dir={run}", "train.max_steps=30", "resume=true", *opts])
    assert "resharded from 2 to 1 ranks per host" in r.stderr
    s, want = _summary(run), _summary(ref)
    assert s["resumed_from"].endswith("step_000000020")
    assert (s["auc"], s["logloss"]) == (want["auc"], want["logloss"])


@pytest.mark.parametrize(
    "saved_optim, merge_every, reshards",
    [
        ("rowwise_adagrad", 0, True),  # FBGEMM's fused state: DCP reshards it
        ("cowclip_adam", 0, True),  # our moments and per-row step: laid out like the shards, DCP reshards them
        ("adam", 0, True),
        ("rowwise_adagrad", 4, True),  # hierarchical: host 0's files and each host<h>/ are DCP checkpoints too
        ("fbgemm_cowclip", 0, False),  # FBGEMM's COWCLIP counters live outside the state dict: refused
    ],
)
def test_another_world_size_reshards_or_is_refused_in_one_line(tmp_path, saved_optim, merge_every, reshards):
    """Which states may resume on another world size (checkpoint.reshardable); the others stop
    with the one line naming train.world_size, before anything loads."""

    def shape(world: int) -> dict:
        return {"optim.embedding": saved_optim, "train.merge_every": merge_every, "train.world_size": world, "train.batch_size": 512}

    err, d = _resume_check(tmp_path, shape(2), 2, shape(1))
    assert err == (
        None
        if reshards
        else f"cannot resume from {d}: the config changed (train.world_size 2 -> 1); "
        "restore these values, or start a new run (another run_dir, or overwrite=true)"
    )


def _resume_check(tmp_path: Path, saved: dict, saved_world: int, current: dict) -> tuple[str | None, Path]:
    """(the CheckpointError's line or None, the checkpoint): a checkpoint written under the shape
    `saved` on `saved_world` ranks, checked by a 1-rank Checkpointer of shape `current`."""
    from recsys.training.checkpoint import CheckpointError

    d = _fake_checkpoint(tmp_path / "checkpoints", 20)
    marker = json.loads((d / MARKER).read_text())
    (d / MARKER).write_text(json.dumps({**marker, "world_size": saved_world, "shape": saved}))
    try:
        Checkpointer(tmp_path / "checkpoints", 0, 1, shape=current).check_compatible(d)
    except CheckpointError as e:
        return str(e), d
    return None, d


@pytest.mark.parametrize(
    "saved_scope, current_scope, change",
    [
        (None, "batch", None),  # a checkpoint from before the scope was recorded: it was lazy
        (None, "catchup", "optim.embedding_l2_scope batch -> catchup"),  # the new default cannot continue it
        ("catchup", "batch", "optim.embedding_l2_scope catchup -> batch"),
        ("catchup", "catchup", None),
    ],
)
def test_a_resume_under_another_embedding_update_scope_is_refused(tmp_path, saved_scope, current_scope, change):
    """row_step is a row's own update count when lazy and the global step it is current at with
    catch-up: one state cannot continue as the other, and a checkpoint without the key was lazy."""
    base = {"optim.embedding": "cowclip_adam", "train.merge_every": 0, "train.world_size": 1, "train.batch_size": 512}
    saved = {**base, **({"optim.embedding_l2_scope": saved_scope} if saved_scope else {})}
    err, d = _resume_check(tmp_path, saved, 1, {**base, "optim.embedding_l2_scope": current_scope})
    assert err == (
        None
        if change is None
        else f"cannot resume from {d}: the config changed ({change}); restore "
        "these values, or start a new run (another run_dir, or overwrite=true)"
    )


def test_the_state_shape_records_the_resolved_scope_of_our_adam_kernels():
    from recsys.config import load_config
    from recsys.training.run_dir import state_shape

    shape = lambda *over: state_shape(load_config(None, list(over)), ["c"], [7], 2)  # noqa: E731
    assert shape("optim.embedding=cowclip_adam")["optim.embedding_l2_scope"] == "catchup"
    assert shape("optim.embedding=cowclip_adam", "optim.embedding_l2_scope=batch")["optim.embedding_l2_scope"] == "batch"
    assert shape("optim.embedding=adam")["optim.embedding_l2_scope"] == "batch"
    assert "optim.embedding_l2_scope" not in shape("optim.embedding=rowwise_adagrad")  # FBGEMM: no such choice


# -- what a run trains on, and when it must stop ----------------------------------------------------


def test_finite_guard_names_the_first_bad_step_or_tensor():
    from torch import nn

    from recsys.training.finite import FiniteGuard, NonFiniteError

    guard = FiniteGuard()
    model = nn.Linear(3, 2)
    guard.see_loss(4, 0.5)
    guard.check(4, model)  # all finite: nothing happens
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(
        NonFiniteError,
        match=r"^training stopped: bias holds non-finite values at step 6 \(rank 0\); "
        r"nothing non-finite was saved, the last checkpoint is /x/step_000000004 ",
    ):
        guard.check(6, model, lambda: "/x/step_000000004")
    guard.see_loss(7, float("nan"))
    guard.see_loss(8, float("inf"))  # the first one is named
    with pytest.raises(
        NonFiniteError,
        match=r"^training stopped: the loss is nan at step 7 \(rank 0\); nothing "
        r"non-finite was saved, no checkpoint was written \(lower "
        r"optim.embedding_lr or optim.dense_lr and run again\)$",
    ):
        guard.check(9)


def test_metrics_write_null_for_undefined_and_non_finite_values(tmp_path):
    from recsys.training.metrics import MetricsWriter, auc, one_class, write_json_atomic

    labels = torch.zeros(6)
    assert auc(torch.arange(6.0), labels) is None and one_class(labels) == "every eval label is 0"
    assert one_class(torch.ones(3)) == "every eval label is 1" and one_class(torch.tensor([0.0, 1.0])) is None
    assert auc(torch.tensor([0.1, 0.9, 0.2, 0.8]), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 1.0
    w = MetricsWriter(tmp_path, True, tensorboard=False)
    w.log({"kind": "train", "step": 1, "loss": float("nan"), "auc": None})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"kind": "train", "step": 1, "loss": None, "auc": None}
    write_json_atomic(tmp_path / "s.json", {"auc": float("inf"), "x": [1.0, float("nan")]})
    assert json.loads((tmp_path / "s.json").read_text()) == {"auc": None, "x": [1.0, None]}


def _snapshot(run_dir: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*") if p.name != ".lock"}


def test_a_resume_past_max_steps_refuses_and_writes_nothing(run30, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run30, run)
    (run / "summary.json").unlink()  # not finished as far as the resume can tell
    before = _snapshot(run)
    r = _checked([f"run_dir={run}", "train.max_steps=20", "resume=true"])
    assert r.returncode == 2
    assert _last_line(r) == (
        f"error: cannot resume from {run}/checkpoints/step_000000030: the run is already at step "
        "30, past train.max_steps=20; nothing written (raise it above 30 to train on, or start a "
        "new run: another run_dir, or overwrite=true)"
    )
    assert _snapshot(run) == before


def test_a_resume_on_other_data_refuses_unless_asked_and_then_counts_new_epochs(run30, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run30, run)
    before = _snapshot(run)
    r = _checked([f"run_dir={run}", "train.max_steps=40", "resume=true", "data.seed=1", "data.train_rows=150000"])
    assert r.returncode == 2
    assert _last_line(r) == (
        f"error: cannot resume from {run}/checkpoints/step_000000030: it trained on other data "
        "(data.seed 0 -> 1, data.train_rows 200000 -> 150000); restore that data, or pass "
        "resume_on_new_data=true to go on training on this data (its epochs counted from step 30)"
    )
    assert _snapshot(run) == before
    r = _ok(
        [
            f"run_dir={run}",
            "train.max_steps=40",
            "resume=true",
            "data.seed=1",
            "data.train_rows=150000",
            "resume_on_new_data=true",
            "train.log_every=5",
            "checkpoint.every_steps=5",
        ]
    )
    assert (
        "resume_on_new_data=true: step 30's model goes on training on other data (data.seed 0 -> 1, "
        "data.train_rows 200000 -> 150000); epoch 0 of this data starts at step 30"
    ) in r.stderr
    marker = json.loads((run / "checkpoints" / "step_000000040" / MARKER).read_text())
    assert marker["data"]["seed"] == 1 and marker["data_start_step"] == 30
    per_epoch = 150000 // 512
    evals = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["epoch"]) for e in evals if e["kind"] == "train" and e["step"] > 30] == [
        (35, 5 / per_epoch),
        (40, 10 / per_epoch),
    ]
    # resuming the fine-tuning run (from its step 35) continues its epoch count on its own data
    shutil.rmtree(run / "checkpoints" / "step_000000040")
    (run / "summary.json").unlink()
    _ok(
        [
            f"run_dir={run}",
            "train.max_steps=40",
            "resume=true",
            "data.seed=1",
            "data.train_rows=150000",
            "train.log_every=5",
            "checkpoint.every_steps=5",
        ]
    )
    assert json.loads((run / "checkpoints" / "step_000000040" / MARKER).read_text())["data_start_step"] == 30
    assert _summary(run)["resumed_from"].endswith("step_000000035")


def test_a_diverging_run_stops_and_keeps_its_finite_checkpoints(run30, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run30, run)
    r = _recsys(
        [
            f"run_dir={run}",
            "train.max_steps=60",
            "resume=true",
            "checkpoint.every_steps=10",
            "checkpoint.keep=3",
            "optim.dense_lr=1e30",
            "optim.embedding_lr=1e30",
        ]
    )
    assert r.returncode == 2
    line = _last_line(r)
    assert re.fullmatch(
        r"error: training stopped: the loss is (nan|inf) at step 3[1-9] \(rank [01]\); nothing non-finite was saved, "
        rf"the last checkpoint is {re.escape(str(run))}/checkpoints/step_000000030 \(lower optim.embedding_lr or "
        r"optim.dense_lr, then resume=true continues from it\)",
        line,
    ), line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000010", "step_000000020", "step_000000030"]
    assert all(
        v is None or math.isfinite(v)
        for ln in (run / "metrics.jsonl").read_text().splitlines()
        for v in json.loads(ln).values()
        if isinstance(v, float)
    )
    _ok([f"run_dir={run}", "train.max_steps=40", "resume=true", "checkpoint.every_steps=10", "checkpoint.keep=3"])
    s = _summary(run)
    assert s["resumed_from"].endswith("step_000000030") and math.isfinite(s["auc"])
    # nothing was lost: the same resume without the diverged attempt ends on the same metrics
    ref = tmp_path / "ref"
    shutil.copytree(run30, ref)
    _ok([f"run_dir={ref}", "train.max_steps=40", "resume=true", "checkpoint.every_steps=10", "checkpoint.keep=3"])
    for key in ("auc", "logloss"):
        assert s[key] == pytest.approx(_summary(ref)[key], abs=1e-6), key


@pytest.mark.parametrize("sub", ["new", ""])
def test_run_dir_on_a_read_only_file_system_is_one_line(tmp_path, sub):
    """A new run_dir inside a read-only file system, or the read-only mount itself."""
    with _tmpfs(tmp_path / "ro", "1m", ",ro") as ro:
        run = ro / sub if sub else ro
        r = _checked([f"run_dir={run}", "train.max_steps=2"])
        assert r.returncode == 2
        expected = (
            f"error: cannot create run_dir {run}: Read-only file system; choose a writable run_dir"
            if sub
            else f"error: cannot write in run_dir {run} ({run}/.lock: Read-only file system); choose a writable run_dir"
        )
        assert _last_line(r) == expected


def test_resume_when_no_checkpoint_is_complete_stops_and_keeps_them(run30, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run30, run)
    (run / "summary.json").unlink()
    for meta in (run / "checkpoints").glob("*/.metadata"):
        meta.unlink()
    before = _snapshot(run)
    r = _checked([f"run_dir={run}", "train.max_steps=40", "resume=true"])
    assert r.returncode == 2
    assert _last_line(r) == (
        f"error: resume=true, but none of the 3 checkpoints in {run}/checkpoints is complete (newest: "
        f"{run}/checkpoints/step_000000030/.metadata is missing or unreadable); to start from scratch, pass "
        "overwrite=true instead of resume=true (the old run is moved aside)"
    )
    assert _snapshot(run) == before


def test_checkpoint_interval_rounded_to_merge_steps_is_said(overwritten10):
    run, r = overwritten10
    assert (
        "checkpoint.every_steps=5 rounded up to 50: checkpoints are taken at merge steps only "
        "(train.merge_every=50); none before the final one at step 10"
    ) in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000010"]


def _export(args: list[str], real: bool) -> subprocess.CompletedProcess:
    """`recsys export ARGS`: the real command, or (~5 s of CPU less) its `main` in this process."""
    if not real:
        return run_main("recsys.cli", "export", *args, cwd=REPO)
    cmd = [sys.executable, "-m", "recsys.cli", "export", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)


@pytest.mark.parametrize("optim", ["rowwise_adagrad", "cowclip_adam"])
def test_export_gives_the_plain_model_the_sharded_run_evaluated(request, tmp_path, optim):
    """`recsys export`: the run's last checkpoint as one unsharded state_dict; the plain model on
    one device (no DMP, no process group) loaded from it evaluates the eval split to the 2-rank
    sharded run's own AUC and logloss. CowClip-Adam with catch-up: rows are current at the
    checkpoint. (Before the models read their pooled embeddings by feature name, the 2-rank
    FBGEMM plan fed the dense layers a permuted feature order, and this failed in the 4th digit.)
    The real command exports the rowwise Adagrad run; the CowClip-Adam run is exported in this process."""
    from recsys.config import load_config
    from recsys.training.export import load_exported

    real = optim == "rowwise_adagrad"
    run = request.getfixturevalue("run30" if real else "cowclip30")
    want = _summary(run)
    out = tmp_path / "model.pt"
    r = _export(["--run-dir", str(run), "--out", str(out)], real)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(f"wrote {out}: deepfm at step 30 (26 sparse features, ")
    model = load_exported(out)
    assert not any(p.is_meta for p in model.parameters())
    got = _evaluate_all(model, load_config(run / "config.yaml"))
    assert got["rows"] == want["eval_rows"]
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-6) and got["logloss"] == pytest.approx(want["logloss"], abs=1e-6)
    bad = _export(["--run-dir", str(run), "--step", "7", "--out", str(tmp_path / "x.pt")], real)
    assert bad.returncode == 2 and _last_line(bad) == (
        f"error: cannot export step 7 of {run}: {run}/checkpoints/step_000000007 does not exist"
    )
    assert not (tmp_path / "x.pt").exists()


def _evaluate_all(model, cfg) -> dict:
    """AUC and logloss of `model` on the rows a 2-rank eval reads (both ranks' slices), in one process."""
    from recsys.data.batching import eval_blocks, to_batch
    from recsys.data.source import build_source
    from recsys.training.metrics import auc, logloss

    source = build_source(cfg)
    cards = np.asarray(source.cardinalities, dtype=np.int64)
    logits, labels = [], []
    with torch.no_grad():
        for rank in range(2):
            for block in eval_blocks(source, cfg.train.eval_batch_size, rank, 2):
                batch = to_batch(block, source.sparse_names, cards)
                logits.append(model(batch.dense_features, batch.sparse_features).float())
                labels.append(batch.labels.float())
    x, y = torch.cat(logits), torch.cat(labels)
    return {"auc": auc(x, y), "logloss": logloss(x, y), "rows": int(y.numel())}
