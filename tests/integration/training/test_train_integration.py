"""Multi-process integration: real torchrun, gloo process groups, DistributedModelParallel and
FBGEMM kernels. Slow (tens of seconds each); CI runs them.

Nearly all of a launch's CPU is process start-up, so the launcher of a run that must succeed, and
of one the launcher itself refuses, runs in this process (its torchrun and workers are real
processes); the run that is killed is the real command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import run_main
from tests.support.processes import kill_tree, run_main_and_children, wait_for

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
RECSYS = [sys.executable, "-m", "recsys.cli", "train", "--config", str(SMOKE)]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """`recsys train ARGS`, which must succeed, with its launcher in this process."""
    r = run_main_and_children("recsys.cli", *RECSYS[3:], *args, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_two_process_run_learns(tmp_path):
    run_dir = tmp_path / "run"
    r = _run([f"run_dir={run_dir}", "train.max_steps=300", "train.eval_every=150"])
    s = _summary(run_dir)
    assert s["world_size"] == 2 and s["steps"] == 300 and s["samples"] == 300 * 512
    # a real AUC: far above chance, and most of the way to the teacher's (oracle) AUC
    assert s["auc"] > 0.75, s
    assert s["oracle_auc"] - s["auc"] < 0.05, s
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in records if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [150, 300]
    assert evals[1]["auc"] > evals[0]["auc"] - 0.01
    train = [x for x in records if x["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(x["samples_per_s"] > 0 for x in train)
    # progress lines with throughput and ETA on stderr
    assert "samples/s" in r.stderr and "ETA" in r.stderr
    plan = (run_dir / "plan.txt").read_text()
    # every table model-parallel (fused optimizer), none data-parallel (dense optimizer)
    assert "data_parallel" not in plan and "fused" in plan
    assert all(f"t_C{i} " in plan and f"w_C{i} " in plan for i in range(1, 27))
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "step_000000300" / "COMMITTED").is_file()


def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path, real_worker_processes):
    """Killed mid-run (shuffled epochs, the default; 80 steps an epoch, so the resumed part
    crosses into epoch 2): the resumed run logs the uninterrupted run's losses step by step,
    i.e. it reads the same rows in the same order, each once per epoch."""
    common = ["train.max_steps=160", "checkpoint.every_steps=40", "train.log_every=10", "data.train_rows=40960"]
    straight = tmp_path / "straight"
    _run([f"run_dir={straight}", *common])

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        RECSYS + [f"run_dir={killed}", *common],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(killed / "checkpoints" / "step_000000080" / "COMMITTED", proc, timeout=300)
        kill_tree(proc.pid)  # the launcher, torchrun and both workers
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    time.sleep(1)
    assert not (killed / "summary.json").exists()

    r = _run([f"run_dir={killed}", *common, "resume=true"])
    assert "resumed from" in r.stderr
    a, b = _summary(straight), _summary(killed)
    assert b["resumed_from"] and b["resumed_from"].endswith(tuple(f"step_{s:09d}" for s in (80, 120)))
    for key in ("auc", "logloss", "oracle_auc"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), (key, a[key], b[key])
    # the resumed run's log reads like the uninterrupted one: same train steps, no duplicates
    steps = lambda d: [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps(killed) == steps(straight)
    losses = lambda d: [json.loads(ln).get("loss") for ln in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(killed) == pytest.approx(losses(straight), abs=1e-6)


@pytest.fixture(scope="module")
def run40(tmp_path_factory):
    """A finished 2-rank run of 40 steps with checkpoints at 20 and 40 (tests change copies of it)."""
    run_dir = tmp_path_factory.mktemp("run40") / "run"
    _run([f"run_dir={run_dir}", "train.max_steps=40", "checkpoint.every_steps=20"])
    return run_dir


@pytest.fixture(scope="module")
def resumed40(run40, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of `run40` with what a crash mid-save leaves (a .tmp directory with partial content
    and no marker, for step 60) and a directory with a checkpoint's name but no COMMITTED marker
    (copied by hand, truncated), resumed to step 60 with run40's saved plan: the half-written
    checkpoint test reads the resume, the saved-plan test the plan the run used (one launch)."""
    run_dir = tmp_path_factory.mktemp("resumed40") / "run"
    shutil.copytree(run40, run_dir)
    ckpts = run_dir / "checkpoints"
    partial = ckpts / "step_000000060.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    (ckpts / "step_000000080").mkdir()
    r = _run([f"run_dir={run_dir}", "train.max_steps=60", "checkpoint.every_steps=20", "resume=true", f"plan={run40 / 'plan.json'}"])
    return run_dir, r


def test_half_written_checkpoint_is_ignored(run40, resumed40):
    """A crash mid-save leaves only a .tmp directory; resume never picks it up."""
    assert sorted(p.name for p in (run40 / "checkpoints").iterdir()) == ["step_000000020", "step_000000040"]
    run_dir, r = resumed40
    assert "step_000000040" in r.stderr
    assert _summary(run_dir)["resumed_from"].endswith("step_000000040")
    assert not (run_dir / "checkpoints" / "step_000000060.tmp").exists()


SHARED = REPO.parent / "shared" / "data"


@pytest.mark.skipif(not (SHARED / "criteo_kaggle_sample_1k.tsv").exists(), reason="shared data not present")
def test_train_on_raw_criteo_tsv(tmp_path):
    """Raw Criteo TSV -> preprocessed shards -> 2-rank sharded training -> eval on the last 10%."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = [
        f"run_dir={run_dir}",
        "data.source=criteo",
        f"data.path={SHARED / 'criteo_kaggle_sample_1k.tsv'}",
        f"data.cache_dir={cache}",
        "data.cardinalities=criteo_kaggle_filtered",
        "train.batch_size=64",
        "train.eval_batch_size=64",
        "train.epochs=2",
        "train.log_every=5",
    ]
    _run(args)
    s = _summary(run_dir)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["num_rows"] == 1000
    assert s["steps"] == 2 * (900 // 64)
    assert s["eval_rows"] == 100  # the last 10% of 1000 rows, each evaluated once
    assert 0.0 <= s["auc"] <= 1.0 and s["logloss"] > 0 and "oracle_auc" not in s


@pytest.mark.skipif(not (SHARED / "criteo_sample_200.csv").exists(), reason="shared data not present")
def test_too_many_bad_rows_stops_before_launch(tmp_path):
    lines = (SHARED / "criteo_sample_200.csv").read_text().splitlines()
    for i in (3, 10, 20):
        lines[i] = lines[i].replace(",", ";", 5)  # wrong column count
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    r = run_main(
        "recsys.cli",
        *RECSYS[3:],
        f"run_dir={tmp_path / 'run'}",
        "data.source=criteo",
        f"data.path={bad}",
        f"data.cache_dir={tmp_path / 'c'}",
        cwd=REPO,
    )  # in this process
    assert r.returncode == 2
    assert str(bad) in r.stderr and "first bad lines: 4, 11, 21" in r.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


def test_saved_plan_is_reused_and_checked(run40, resumed40, tmp_path):
    """A run writes the plan it used; a second run given that file (`resumed40`) uses it
    unchanged; a plan for another world size or model is refused before any process starts."""
    first, (second, _) = run40, resumed40
    plan_file = first / "plan.json"
    saved = json.loads(plan_file.read_text())
    assert saved["format"] == "recsys-sharding-plan" and saved["world_size"] == 2
    reused = json.loads((second / "plan.json").read_text())
    assert reused["modules"] == saved["modules"]
    assert reused["meta"]["loaded_from"] == str(plan_file)
    assert (second / "plan.txt").read_text() == (first / "plan.txt").read_text()

    for extra, needle in [
        (["train.nproc_per_node=1"], "key 'world_size': plan is for 2 ranks, this job has 1"),
        (["model.embedding_dim=12"], "key 'tables': plan is for another model"),
    ]:
        r = run_main("recsys.cli", *RECSYS[3:], f"run_dir={tmp_path / 'x'}", f"plan={plan_file}", *extra, cwd=REPO)  # in this process
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0] and str(plan_file) in lines[0]
