"""TorchX components (torchx_components/launch.py): bad input stops before submission with one
line, `--dryrun -s slurm` renders the expected sbatch script (no Slurm needed), and a real
`torchx run -s local_cwd` trains (slow)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

torchx = pytest.importorskip("torchx", reason="torchx is not installed (make venv installs it)")

REPO = Path(__file__).resolve().parents[3]
COMPONENT = "torchx_components/launch.py:train"
SMOKE = "configs/experiments/smoke.yaml"
# the venv's `torchx` command, as a user runs it
TORCHX = [str(Path(sys.executable).parent / "torchx")]


def _torchx(args: list[str], timeout: int = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(TORCHX + args, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_help_documents_every_option():
    r = _torchx(["run", COMPONENT, "--help"])
    assert r.returncode == 0, r.stderr
    import inspect

    from torchx_components.launch import train

    for name, p in inspect.signature(train).parameters.items():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        assert f"--{name}" in r.stdout, name
    # the docstring's Args: text reaches the help, e.g. for max_retries
    assert "requeue" in r.stdout and "key=value" in r.stdout


# --- bad input: one line, before submission ------------------------------------------------

BAD = [
    (["--config", "configs/experiments/nope.yaml"], "nope.yaml does not exist"),
    (["--config", SMOKE, "--nproc_per_node", "0"], "--nproc_per_node must be at least 1, got 0"),
    (["--config", SMOKE, "--nnodes", "0"], "--nnodes must be at least 1"),
    (["--config", SMOKE, "--cpu", "0"], "--cpu (cores per node) must be at least 1"),
    (["--config", SMOKE, "--memMB", "100"], "--memMB 100 is too little for 2 processes"),
    (["--config", SMOKE, "--memMB", "-5"], "--memMB -5 is too little"),
    (["--config", SMOKE, "--gpu", "1"], "--gpu 1 is fewer than --nproc_per_node 2"),
    (["--config", SMOKE, "trian.max_steps=3"], "trian"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_input_fails_in_component(args, message):
    """The component itself (as torchx's Python API calls it) refuses, with a one-line error."""
    from torchx.specs.builders import materialize_appdef

    from torchx_components.launch import LaunchError, train

    with pytest.raises(SystemExit) as e:
        materialize_appdef(train, args)
    assert isinstance(e.value, LaunchError)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and message in msg and "\n" not in msg, msg


@pytest.mark.parametrize("args,message", [BAD[0], BAD[1], BAD[4]], ids=["config", "nproc", "memory"])
def test_bad_input_cli_one_line_before_submission(tmp_path, args, message):
    """`torchx run -s local_cwd` with bad input: exit 1, the last line is the error, no
    traceback, and nothing started (no log dir, no run dir)."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    r = _torchx(["run", "-s", "local_cwd", "-cfg", f"log_dir={logs}", COMPONENT, *args, "train.max_steps=5", f"run_dir={run_dir}"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = _lines(r.stderr)[-1]
    assert last.startswith("error: ") and message in last, r.stderr
    assert not logs.exists() and not run_dir.exists()


# --- Slurm dry run: the sbatch script ------------------------------------------------------


def _dryrun_slurm(extra: list[str]) -> str:
    r = _torchx(
        [
            "run",
            "-s",
            "slurm",
            "--dryrun",
            "-cfg",
            "partition=debug,time=30",
            COMPONENT,
            "--config",
            SMOKE,
            *extra,
            "train.max_steps=40",
            "run_dir=runs/tx_slurm",
        ]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_slurm_dryrun_two_nodes():
    out = _dryrun_slurm(
        ["--nnodes", "2", "--nproc_per_node", "2", "--cpu", "2", "--memMB", "4096", "--max_retries", "3", "--max_restarts", "1"]
    )
    script = out[out.index("#!/bin/bash") :]
    sbatch = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
    # torchx submits one heterogeneous group per node: 2 groups of 1 node x 1 task (torchrun)
    groups = [ln for ln in sbatch if "--job-name" in ln]
    assert len(groups) == 2 and sbatch.count("#SBATCH hetjob") == 1, sbatch
    for i, g in enumerate(groups):
        opts = g.split()[1:]
        assert f"--job-name=trainer-{i}" in opts
        for o in ("--requeue", "--partition=debug", "--time=30", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=4096"):
            assert o in opts, (o, g)
    assert "export TORCHX_MAX_RETRIES=3" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert script.count("srun ") == 1
    # the torchrun command: the venv's python, c10d rendezvous on the first node's host
    venv_bin = re.escape(str(Path(sys.executable).parent))
    assert re.search(
        venv_bin + r"/python[0-9.]* -m recsys.training.torchrun_quiet --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d", script
    ), script
    assert "--rdzv_endpoint ${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500" in script
    assert re.search(r"--rdzv_id '\"\$SLURM_JOB_ID\"'", script), script
    assert "--max_restarts 1 -m recsys.train --config configs/experiments/smoke.yaml" in script
    assert "train.max_steps=40 run_dir=runs/tx_slurm resume=true train.nproc_per_node=2" in script
    assert f"export PATH={Path(sys.executable).parent}:" in script
    assert "OMP_NUM_THREADS=1" in script


def test_slurm_dryrun_one_node_takes_nproc_from_config():
    out = _dryrun_slurm(["--cpu", "2", "--memMB", "4096"])
    script = out[out.index("#!/bin/bash") :]
    assert script.count("--job-name=") == 1 and "hetjob" not in script
    # smoke.yaml says train.nproc_per_node: 2; one node rendezvouses on a free local port
    assert "--nnodes 1 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint localhost:0" in script
    assert "export TORCHX_MAX_RETRIES=0" in script


# --- a real local run -----------------------------------------------------------------------


def test_local_cwd_trains_and_writes_metrics(tmp_path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    t0 = time.time()
    r = _torchx(
        [
            "run",
            "-s",
            "local_cwd",
            "-cfg",
            f"log_dir={logs}",
            COMPONENT,
            "--config",
            SMOKE,
            "--nproc_per_node",
            "2",
            "--cpu",
            "2",
            "--memMB",
            "4096",
            "train.max_steps=40",
            "train.log_every=10",
            f"run_dir={run_dir}",
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 40, s
    assert 0.0 <= s["auc"] <= 1.0 and s["resumed_from"] is None
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if x["kind"] == "train"][-1] == 40
    assert (run_dir / "checkpoints" / "step_000000040" / "COMMITTED").is_file()
    assert list(logs.rglob("*")), "torchx wrote no logs under log_dir"
    print(f"local_cwd run: {time.time() - t0:.1f} s")


def test_plan_component_writes_a_plan_file(tmp_path):
    """The `plan` component runs `recsys-plan make` as a job; bad input stops before submission."""
    out, logs = tmp_path / "p16.json", tmp_path / "logs"
    r = _torchx(
        [
            "run",
            "-s",
            "local_cwd",
            "-cfg",
            f"log_dir={logs}",
            "torchx_components/launch.py:plan",
            "--config",
            "configs/experiments/demo.yaml",
            "--world_size",
            "16",
            "--hbm_gb",
            "80",
            "--out",
            str(out),
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["format"] == "recsys-sharding-plan" and plan["world_size"] == 16 and plan["compute_device"] == "cuda"
    assert len(plan["tables"]) == 52
    bad = _torchx(
        [
            "run",
            "-s",
            "local_cwd",
            "torchx_components/launch.py:plan",
            "--config",
            "configs/experiments/demo.yaml",
            "--world_size",
            "12",
            "--local_world_size",
            "8",
            "--out",
            str(out),
        ]
    )
    assert bad.returncode != 0 and _lines(bad.stderr)[-1].startswith("error: plan: --world_size 12")


def test_preprocess_component_bad_input_and_slurm_script(tmp_path):
    """`preprocess`: a config without raw files, or impossible resources, stop before submission
    in one line; on Slurm each task is one job component with its own task number."""
    comp = "torchx_components/launch.py:preprocess"
    bad = _torchx(["run", "-s", "local_cwd", comp, "--config", SMOKE])
    assert (
        bad.returncode != 0
        and _lines(bad.stderr)[-1] == f"error: {SMOKE}: key 'data.source': generated data (synthetic) has nothing to preprocess"
    )
    bad = _torchx(["run", "-s", "local_cwd", comp, "--config", SMOKE, "--tasks", "0"])
    assert _lines(bad.stderr)[-1] == (
        "error: preprocess: --tasks, --procs_per_task and --cpu must be >= 1, --memMB >= 1024 and --max_retries >= 0"
    )
    bad = _torchx(["run", "-s", "local_cwd", comp, "--config", SMOKE, "data.source=criteo", f"data.path={tmp_path}/nope.tsv"])
    assert _lines(bad.stderr)[-1] == f"error: key 'data.path': no such file {tmp_path}/nope.tsv"
    raw = tmp_path / "day_0.tsv"
    raw.write_text("0" + "\t" * 39 + "\n")
    r = _torchx(
        [
            "run",
            "-s",
            "slurm",
            "--dryrun",
            "-cfg",
            "partition=debug",
            comp,
            "--config",
            SMOKE,
            "--tasks",
            "3",
            "data.source=criteo",
            f"data.path={raw}",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    script = r.stdout[r.stdout.index("#!/bin/bash") :]
    assert [ln.split("--job-name=")[1].split()[0] for ln in script.splitlines() if "--job-name=" in ln] == [
        "preprocess-0",
        "preprocess-1",
        "preprocess-2",
    ]
    for i in range(3):
        assert f"-m recsys.cli preprocess --config {SMOKE} --task {i} --tasks 3 --procs 2 data.source=criteo" in script


def test_local_cwd_worker_error_is_one_line_without_torchrun_report(tmp_path):
    """A config error the workers find (a missing data file): their one line, and no torchrun
    `ChildFailedError` report or traceback after it."""
    r = _torchx(
        [
            "run",
            "-s",
            "local_cwd",
            COMPONENT,
            "--config",
            SMOKE,
            "--nproc_per_node",
            "2",
            "--cpu",
            "2",
            "--memMB",
            "4096",
            "data.source=criteo",
            f"data.path={tmp_path}/nope.tsv",
            f"run_dir={tmp_path / 'run'}",
        ],
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"trainer/0 error: key 'data.path': no such file {tmp_path}/nope.tsv" in out, out[-3000:]
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
