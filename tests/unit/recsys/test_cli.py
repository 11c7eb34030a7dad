"""`recsys` (recsys/cli.py) in this process: its arguments, the one-line refusals that come before
any process starts (exit 2), and the command a valid `recsys train` would launch, with the run
directory locked while it runs. (The launch itself, signals and exit codes of real workers:
tests/integration/training/.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import recsys.cli as cli
from recsys.training.run_dir import LAUNCHER_ENV, RunDirError, RunLock
from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[3]
SMOKE = str(REPO / "configs" / "experiments" / "smoke.yaml")


def _recsys(*args: str):
    return run_main("recsys.cli", *args, cwd=REPO)


def test_train_arguments():
    args = cli.build_parser().parse_args(["train", "--config", "exp.yaml", "train.batch_size=8", "resume=true"])
    assert (args.command, args.config, args.overrides, args.torchrun) == ("train", "exp.yaml", ["train.batch_size=8", "resume=true"], False)
    assert cli.build_parser().parse_args(["train", "--torchrun", "--config", "x"]).torchrun is True


def test_preprocess_task_and_tasks_default_to_the_slurm_array(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT", raising=False)
    args = cli.build_parser().parse_args(["preprocess", "--config", "x", "data.path=/d"])
    assert (args.task, args.tasks, args.procs, args.overrides) == (0, 1, 1, ["data.path=/d"])
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "8")
    args = cli.build_parser().parse_args(["preprocess", "--config", "x"])
    assert (args.task, args.tasks) == (3, 8)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3-5")  # not a number: the default
    assert cli.build_parser().parse_args(["preprocess", "--config", "x", "--tasks", "2"]).task == 0


def test_export_arguments():
    args = cli.build_parser().parse_args(["export", "--run-dir", "runs/a", "--out", "m.pt"])
    assert (args.run_dir, args.out, args.step) == ("runs/a", "m.pt", None)
    assert cli.build_parser().parse_args(["export", "--run-dir", "r", "--out", "m.pt", "--step", "40"]).step == 40


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: command"),
        (["export", "--out", "m.pt"], "the following arguments are required: --run-dir"),
        (["train", "x=1"], "the following arguments are required: --config"),
        (["preprocess", "--config", "x", "--task", "one"], "argument --task: invalid int value: 'one'"),
    ],
)
def test_usage_errors_exit_2(argv, message):
    r = _recsys(*argv)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].endswith(message)


def test_bad_config_is_refused_before_anything_starts(tmp_path):
    r = _recsys("train", "--config", SMOKE, "model.name=fm", f"run_dir={tmp_path / 'run'}")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: override 'model.name=fm': key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'\n"
    assert not (tmp_path / "run").exists()


def test_topology_for_another_device_is_refused_naming_the_key(tmp_path):
    r = _recsys("train", "--config", SMOKE, "train.device=cpu", "sharding.planner=topology", "sharding.topology=dgx-a100",
                f"run_dir={tmp_path / 'run'}")  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == "error: key 'sharding.topology': topology dgx-a100 is for cuda, the run is on cpu\n"
    assert not (tmp_path / "run").exists()


def test_saved_plan_for_another_world_or_model_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    made = run_main("recsys.plan_cli", "make", "--config", SMOKE, "--world-size", "2", "--compute-device", "cpu", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    run = f"run_dir={tmp_path / 'run'}"
    r = _recsys("train", "--config", SMOKE, f"plan={plan}", "train.nproc_per_node=4", run)
    assert (r.returncode, r.stderr) == (2, f"error: {plan}: key 'world_size': plan is for 2 ranks, this job has 4\n")
    r = _recsys("train", "--config", SMOKE, f"plan={plan}", "model.embedding_dim=16", run)
    assert r.returncode == 2
    assert r.stderr == (
        f"error: {plan}: key 'tables': plan is for another model (table t_C1 is [100, 8] (rows, dim) in the plan, [100, 16] in the model)\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_run_dir_in_use_or_holding_an_earlier_run_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        r = _recsys("train", "--config", SMOKE, f"run_dir={run_dir}")
    assert r.returncode == 2
    assert r.stderr == (
        f"error: run_dir {run_dir} is in use by another run (pid {os.getpid()}); wait for it to finish, stop it, "
        "or choose another run_dir\n"
    )
    step = run_dir / "checkpoints" / "step_000000040"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("")
    r = _recsys("train", "--config", SMOKE, f"run_dir={run_dir}")
    assert r.returncode == 2
    assert r.stderr == (
        f"error: run_dir {run_dir} holds checkpoints of an earlier run (newest step 40); pass resume=true "
        "to continue it, overwrite=true to move it aside, or choose another run_dir\n"
    )


def test_a_valid_train_launches_its_workers_under_the_run_lock(tmp_path, monkeypatch):
    """What `recsys train` would start: one process runs the worker itself, more go through torchrun;
    the workers learn which launcher holds their lock; the lock is held for the job and released."""
    launched = []

    def supervise(cmd, env, run_dir):
        with pytest.raises(RunDirError, match="is in use by another run"):
            RunLock(run_dir).acquire()
        launched.append((cmd, env, run_dir))
        return 7

    monkeypatch.setattr(cli, "_supervise", supervise)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir = tmp_path / "run"
    one = [f"run_dir={run_dir}", "train.nproc_per_node=1"]
    assert _recsys("train", "--config", SMOKE, *one).returncode == 7
    assert _recsys("train", "--torchrun", "--config", SMOKE, *one).returncode == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an operator's choice is kept
    assert _recsys("train", "--config", SMOKE, f"run_dir={run_dir}").returncode == 7  # smoke: 2 processes
    (direct, env1, where), (forced, _, _), (two, env2, _) = launched
    assert where == run_dir
    worker = ["-m", "recsys.train", "--config", SMOKE]
    torchrun = [sys.executable, "-m", "recsys.training.torchrun_quiet", "--standalone"]
    assert direct == [sys.executable, *worker, *one]
    assert forced == [*torchrun, "--nproc_per_node=1", *worker, *one]
    assert two == [*torchrun, "--nproc_per_node=2", *worker, f"run_dir={run_dir}"]
    assert env1[LAUNCHER_ENV] == env2[LAUNCHER_ENV] == str(os.getpid())
    assert (env1["OMP_NUM_THREADS"], env2["OMP_NUM_THREADS"]) == (str(os.cpu_count() or 1), "3")
    with RunLock(run_dir):  # released when the job ended
        pass


def test_preprocess_refusals(tmp_path):
    r = _recsys("preprocess", "--config", SMOKE, f"run_dir={tmp_path}")
    assert (r.returncode, r.stderr) == (2, f"error: {SMOKE}: key 'data.source': generated data (synthetic) has nothing to preprocess\n")
    r = _recsys("preprocess", "--config", SMOKE, "--task", "2", "--tasks", "2")
    assert (r.returncode, r.stderr) == (2, "error: --task 2 of --tasks 2 (--procs 1): need 0 <= task < tasks and procs >= 1\n")
    r = _recsys("preprocess", "--config", SMOKE, "--procs", "0")
    assert r.stderr == "error: --task 0 of --tasks 1 (--procs 0): need 0 <= task < tasks and procs >= 1\n"


def test_export_of_a_missing_run_dir(tmp_path):
    r = _recsys("export", "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "m.pt"))
    assert r.returncode == 2
    assert r.stderr == f"error: cannot export {tmp_path / 'none'}: config file {tmp_path / 'none'}/config.yaml does not exist\n"
    assert not (tmp_path / "m.pt").exists()
