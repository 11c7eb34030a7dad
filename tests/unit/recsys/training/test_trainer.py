"""The training loop's order of work, over a stand-in for TorchRec's pipeline (it hands out the
real batches and a loss per step the test chose) in a gloo group of one: which rows each step
reads, the log records (window means of the loss), evals, checkpoints at the cadence and at the
end, the hooks' calls, the summary; a resume that continues from a checkpoint; a non-finite loss
that stops the run; the host-lost translation of `run`; the dense bytes DDP all-reduces."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

import recsys.training.trainer as trainer_mod
from recsys.config import ExperimentConfig
from recsys.data.source import DataSource
from recsys.data.synthetic import TRAIN, RowBlock
from recsys.training.checkpoint import Checkpointer
from recsys.training.comm_failure import HostLostError
from recsys.training.distributed import DistEnv
from recsys.training.finite import NonFiniteError
from recsys.training.hooks import TrainHook
from recsys.training.job import Job
from recsys.training.run_dir import ResumePoint
from recsys.training.trainer import Trainer, dense_parameter_bytes, run


def exactly(text: str) -> str:
    """The whole of `text` as a `pytest.raises(match=)` pattern."""
    return f"^{re.escape(text)}$"


BATCH = 8


class _Rows(DataSource):
    """80 training rows and 16 eval rows; dense column 0 holds the row's index in its split."""

    dense_names, sparse_names, cardinalities = ["I1"], ["C1"], [10]

    def num_rows(self, split: int) -> int:
        return 80 if split == TRAIN else 16

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        idx = np.arange(start, stop)
        return RowBlock(idx.astype(np.float32).reshape(-1, 1), (idx % 10).reshape(-1, 1), (idx % 2).astype(np.float32))

    def identity(self) -> dict:
        return {"source": "test"}


class _Model(nn.Module):
    """The training module's interface: batch -> (loss, (loss, logits, labels))."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, batch):
        logits = self.lin(batch.dense_features)[:, 0]
        return None, (None, logits, batch.labels)


class _Pipeline:
    """TrainPipelineSparseDist's interface: per `progress`, one batch and an optimizer step (so the
    optimizer has state to save), reporting the loss the test chose for the step."""

    def __init__(self, losses: dict[int, float]) -> None:
        self.losses = losses
        self.rows: list[list[int]] = []
        self.detached = 0

    def __call__(self, model: nn.Module, optimizer: Any, device: torch.device) -> "_Pipeline":
        self.model, self.optimizer = model, optimizer
        return self

    def progress(self, batches: Iterator[Any]) -> tuple[torch.Tensor, None, None]:
        batch = next(batches)
        self.rows.append(batch.dense_features[:, 0].long().tolist())
        self.optimizer.zero_grad()
        _, (_, logits, labels) = self.model(batch)
        nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        self.optimizer.step()
        step = len(self.rows)
        return torch.tensor(self.losses.get(step, 0.1 * step)), None, None

    def detach(self) -> None:
        self.detached += 1

    def attach(self, model: nn.Module) -> None:
        pass


class _Recorder(TrainHook):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_resume(self, step: int, rank_state: dict[str, Any]) -> None:
        self.calls.append(("on_resume", step))
        self.resumed_state = rank_state

    def before_step(self, step: int) -> None:
        self.calls.append(("before_step", step))

    def after_step(self, step: int, last_step: bool) -> None:
        self.calls.append(("after_step_last" if last_step else "after_step", step))

    def log_stats(self, step: int) -> dict[str, float]:
        self.calls.append(("log_stats", step))
        return {"hook_figure": float(step)}

    def before_checkpoint(self, step: int) -> None:
        self.calls.append(("before_checkpoint", step))

    def rank_state(self) -> dict[str, Any]:
        return {"calls_so_far": len(self.calls)}

    def summary(self, total_steps: int) -> dict[str, Any]:
        return {"hook_total": total_steps}


def _job(run_dir: Path, max_steps: int, resume_from: ResumePoint | None = None) -> tuple[Job, _Recorder]:
    cfg = ExperimentConfig(name="loop", run_dir=str(run_dir), resume=resume_from is not None)
    t = cfg.train
    t.batch_size, t.max_steps, t.log_every, t.eval_every, t.eval_batch_size = BATCH, max_steps, 4, 5, 16
    t.tensorboard = t.curves = False
    cfg.data.shuffle = False
    torch.manual_seed(0)
    model = _Model()
    dense = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.1))
    hook = _Recorder()
    ckpt = Checkpointer(run_dir / "checkpoints", 0, 1, keep=2, every_steps=4)
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")
    job = Job(cfg, env, _Rows(), model, CombinedOptimizer([dense]), dense, ckpt, run_dir, resume_from=resume_from, hooks=[hook])
    return job, hook


def _records(run_dir: Path) -> list[tuple[str, int, float | None]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append((r["kind"], r["step"], round(r["loss"], 6) if r["kind"] == "train" else None))
    return out


def test_the_loop_reads_logs_evaluates_checkpoints_and_summarises(tmp_path, gloo_world_of_one, monkeypatch):
    pipeline = _Pipeline({})
    monkeypatch.setattr(trainer_mod, "TrainPipelineSparseDist", pipeline)
    job, hook = _job(tmp_path / "run", max_steps=10)
    summary = Trainer(job).train()

    assert pipeline.rows == [list(range(8 * s, 8 * s + 8)) for s in range(10)]  # file order, one global batch a step
    # train lines at the log steps and the last, the loss a mean over the window; evals at 5 and the end
    assert _records(tmp_path / "run") == [
        ("train", 4, 0.25),
        ("eval", 5, None),
        ("train", 8, 0.65),
        ("train", 10, 0.95),
        ("eval", 10, None),
    ]
    assert pipeline.detached == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000000008", "step_000000010"]  # keep=2
    marker = json.loads((tmp_path / "run" / "checkpoints" / "step_000000010" / "COMMITTED").read_text())
    assert marker["extra"] == {"samples": 80}

    points = [c for c in hook.calls if c[0] not in ("before_step", "after_step")]
    assert points == [
        ("log_stats", 4),
        ("before_checkpoint", 4),
        ("log_stats", 8),
        ("before_checkpoint", 8),
        ("after_step_last", 10),
        ("log_stats", 10),
        ("before_checkpoint", 10),
    ]
    assert [c for c in hook.calls if c[0] == "before_step"] == [("before_step", s) for s in range(1, 11)]

    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: summary[k] for k in ("name", "world_size", "device", "steps", "global_batch", "samples", "resumed_from")} == {
        "name": "loop",
        "world_size": 1,
        "device": "cpu",
        "steps": 10,
        "global_batch": 8,
        "samples": 80,
        "resumed_from": None,
    }
    assert summary["eval_rows"] == 16 and summary["hook_total"] == 10
    assert summary["dense_parameter_bytes"] == 2 * 4  # the Linear(1, 1)'s weight and bias


def test_a_resumed_run_continues_after_the_checkpoint(tmp_path, gloo_world_of_one, monkeypatch):
    monkeypatch.setattr(trainer_mod, "TrainPipelineSparseDist", _Pipeline({}))
    first, _ = _job(tmp_path / "run", max_steps=10)
    Trainer(first).train()
    path = tmp_path / "run" / "checkpoints" / "step_000000008"

    pipeline = _Pipeline({})
    monkeypatch.setattr(trainer_mod, "TrainPipelineSparseDist", pipeline)
    job, hook = _job(tmp_path / "run", max_steps=12, resume_from=ResumePoint(path))
    summary = Trainer(job).train()
    assert hook.calls[0] == ("on_resume", 8) and hook.resumed_state == {"calls_so_far": 2 * 8 + 3}
    # steps 9..12: the last two rows of the first epoch, then the second epoch from its start
    assert pipeline.rows == [list(range(64, 72)), list(range(72, 80)), list(range(0, 8)), list(range(8, 16))]
    # the records after step 8 are replaced by this run's (whose stand-in pipeline counts its losses from 0.1 again)
    assert _records(tmp_path / "run") == [
        ("train", 4, 0.25),
        ("eval", 5, None),
        ("train", 8, 0.65),
        ("eval", 10, None),
        ("train", 12, 0.25),
        ("eval", 12, None),
    ]
    assert summary["resumed_from"] == str(path) and summary["steps"] == 12


def test_a_nonfinite_loss_stops_the_run_before_any_checkpoint(tmp_path, gloo_world_of_one, monkeypatch):
    monkeypatch.setattr(trainer_mod, "TrainPipelineSparseDist", _Pipeline({3: float("nan")}))
    job, _ = _job(tmp_path / "run", max_steps=10)
    message = (
        "training stopped: the loss is nan at step 3 (rank 0); nothing non-finite was saved, "
        "no checkpoint was written (lower optim.embedding_lr or optim.dense_lr and run again)"
    )
    with pytest.raises(NonFiniteError, match=exactly(message)):
        Trainer(job).train()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_run_names_a_lost_host_and_passes_other_failures_on(monkeypatch):
    cause = RuntimeError("Connection closed by peer [10.0.0.2]:4242")

    def setup(cfg, model_factory):
        raise cause

    monkeypatch.setattr(trainer_mod, "setup", setup)
    monkeypatch.setattr(trainer_mod, "host_lost", lambda e: HostLostError("host 1 (10.0.0.2) is gone") if e is cause else None)
    with pytest.raises(HostLostError, match=r"^host 1 \(10.0.0.2\) is gone$") as e:
        run(ExperimentConfig())
    assert e.value.__cause__ is cause
    monkeypatch.setattr(trainer_mod, "host_lost", lambda e: None)
    with pytest.raises(RuntimeError, match=r"^Connection closed by peer") as e:
        run(ExperimentConfig())
    assert e.value is cause


def test_dense_parameter_bytes_counts_each_trainable_parameter_once():
    shared = nn.Linear(3, 2)  # 6 + 2 floats
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(2, 4, dtype=torch.float64))  # 8 + 4 doubles
    frozen = nn.Linear(5, 5)
    frozen.requires_grad_(False)
    model.append(frozen)
    assert dense_parameter_bytes(model) == 8 * 4 + 12 * 8
