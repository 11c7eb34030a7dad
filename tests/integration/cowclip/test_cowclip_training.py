"""The CowClip options through the real training job (torchrun, 2 gloo ranks, DMP): our fused
CowClip-Adam kernel and FBGEMM's native COWCLIP learn, the optimizer state lands in the DCP
checkpoint, the scaling rule's dense-lr warmup is what the paper prescribes. Slow; CI runs them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support.processes import run_main_and_children

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"


def _train(run_dir: Path, *overrides: str) -> dict:
    """`recsys train`, its launcher in this process (its torchrun and workers are real processes)."""
    r = run_main_and_children("recsys.cli", "train", "--config", str(SMOKE), f"run_dir={run_dir}", *overrides, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _records(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in rows if x["kind"] == kind]


def test_cowclip_adam_trains_with_scaling_rule_and_checkpoints_its_state(tmp_path):
    run = tmp_path / "cow"
    s = _train(
        run,
        "optim.embedding=cowclip_adam",
        "optim.embedding_lr=0.002",
        "optim.embedding_l2=1e-5",
        "optim.scale_from_batch=256",
        "train.max_steps=200",
        "train.log_every=20",
        "checkpoint.every_steps=100",
    )
    assert s["auc"] > 0.75 and s["oracle_auc"] - s["auc"] < 0.05, s
    train = _records(run, "train")
    assert all(0.0 <= x["clipped_row_fraction"] <= 1.0 for x in train)
    # batch 512 from base 256: dense lr x sqrt(2), warmed up linearly over the first epoch
    per_epoch = 200_000 // 512
    for x in train:
        want = 0.002 * math.sqrt(2) * min((x["step"] - 1) / per_epoch, 1.0)
        assert math.isclose(x["dense_lr"], want, rel_tol=1e-6), x
    # CowClip-Adam state of every table (deep and wide) in the DCP checkpoint: both moments and
    # the per-row step, with the table's full shape
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(run / "checkpoints" / "step_000000100")).read_metadata().state_dict_metadata
    for i in range(1, 27):
        for part, dim in (("embeddings", 8), ("wide", 4)):
            t = f"{'t' if part == 'embeddings' else 'w'}_C{i}"
            w = md[f"model.model.{part}.embedding_bags.{t}.weight"]
            rows = w.size[0]
            assert tuple(w.size) == (rows, dim)
            prefix = f"optim.state.fused.model.{part}.embedding_bags.{t}.weight.{t}"
            assert tuple(md[f"{prefix}.momentum1"].size) == (rows, dim)
            assert tuple(md[f"{prefix}.exp_avg_sq"].size) == (rows, dim)
            assert tuple(md[f"{prefix}.row_step"].size) == (rows,)


def test_fbgemm_native_cowclip_trains(tmp_path):
    s = _train(tmp_path / "fb", "optim.embedding=fbgemm_cowclip", "optim.cowclip_zeta=1e-3", "train.max_steps=200")
    assert s["auc"] > 0.75, s


def test_cowclip_adam_in_hierarchical_training_merges_its_tables(tmp_path):
    """2 simulated hosts x 2 ranks, k=4 with moments merged: the merger averages CowClip-Adam's
    weights and moments (our storage, not FBGEMM's) and max-reduces its per-row step, so every
    host ends with the same model."""
    out = tmp_path / "k"
    cmd = [
        sys.executable,
        "tools/experiments/kstep.py",
        "--quick",
        "--ks",
        "4",
        "--moments",
        "on",
        "--out",
        str(out),
        "--set",
        "optim.embedding=cowclip_adam",
        "--set",
        "optim.embedding_lr=0.002",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (summary,) = list(out.rglob("summary.json"))
    s = json.loads(summary.read_text())
    assert s["merges"] == 16 and s["replica_divergence"] == 0.0, s
    assert s["auc"] > 0.75, s
