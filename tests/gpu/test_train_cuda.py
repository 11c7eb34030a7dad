"""The training job on the GPU: ``recsys train`` with ``train.device=cuda`` (one process, NCCL),
the smoke DeepFM with CowClip-Adam embeddings (the Triton kernel in the sharded lookup's
backward), 200 steps with checkpoints at 100 and 200; resumed from the step-100 checkpoint it
ends where the straight run ends; and it reaches the AUC of the same run on CPU (target:
within 0.002)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
COMMON = [
    "optim.embedding=cowclip_adam",
    "train.nproc_per_node=1",
    "train.max_steps=200",
    "checkpoint.every_steps=100",
    "train.log_every=50",
]


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "recsys.cli", "train", "--config", str(SMOKE), f"run_dir={run_dir}", *COMMON, *extra],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("gpu") / "run"
    _train(run_dir, "train.device=cuda")
    return run_dir


def test_deepfm_200_steps_on_gpu_with_checkpoints(gpu_run, record_property):
    s = _summary(gpu_run)
    for key in ("auc", "logloss", "steps"):
        record_property(f"gpu_{key}", s[key])
    assert s["device"].startswith("cuda") and s["world_size"] == 1 and s["steps"] == 200, s
    assert s["auc"] > 0.65, s  # far above chance after 200 steps of 512
    for step in (100, 200):
        assert (gpu_run / "checkpoints" / f"step_{step:09d}" / "COMMITTED").is_file()
    assert "cowclip_adam" in (gpu_run / "plan.json").read_text()


def test_resume_from_step_100_ends_where_the_straight_run_ends(gpu_run, tmp_path, record_property):
    """The run directory as a crash after step 100 would leave it (the later checkpoint and the
    summary gone), resumed with ``resume=true``."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(gpu_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000000200")
    (run_dir / "summary.json").unlink()
    r = _train(run_dir, "train.device=cuda", "resume=true")
    assert "resumed from" in r.stderr
    a, b = _summary(gpu_run), _summary(run_dir)
    assert b["resumed_from"].endswith("step_000000100") and b["steps"] == 200
    record_property("straight_auc", a["auc"])
    record_property("resumed_auc", b["auc"])
    for key in ("auc", "logloss"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a[key], b[key])


def test_gpu_reaches_the_cpu_auc(gpu_run, tmp_path, record_property):
    cpu = tmp_path / "cpu"
    _train(cpu, "train.device=cpu")
    g, c = _summary(gpu_run), _summary(cpu)
    record_property("gpu_auc", g["auc"])
    record_property("cpu_auc", c["auc"])
    record_property("auc_gap", abs(g["auc"] - c["auc"]))
    assert c["device"] == "cpu" and c["steps"] == g["steps"] == 200
    assert abs(g["auc"] - c["auc"]) <= 0.002, (g["auc"], c["auc"])
