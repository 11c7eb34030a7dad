"""Evaluation (AUC, logloss, oracle AUC) and where metrics go: metrics.jsonl, summary.json and
TensorBoard event files in the run directory. Only rank 0 writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from recsys.data.batching import eval_blocks, to_batch
from recsys.data.source import DataSource


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC AUC, or None when it is undefined: with one class among the labels there is no
    positive/negative pair to rank (torchmetrics then returns 0.0, which reads as a perfectly
    inverted model)."""
    if one_class(labels) is not None:
        return None
    return float(binary_auroc(scores.float(), labels.long()))


def one_class(labels: torch.Tensor) -> str | None:
    """Why AUC is undefined for these labels ("every eval label is 0"), or None when both occur."""
    positives = int((labels > 0.5).sum())
    if labels.numel() and 0 < positives < labels.numel():
        return None
    if not labels.numel():
        return "the eval split is empty"
    return f"every eval label is {1 if positives else 0}"


def format_metric(value: float | None, undefined: str = "undefined") -> str:
    """A metric for a log line: 4 decimals, or the word when it is undefined."""
    return undefined if value is None else f"{value:.4f}"


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def _gather(t: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    from recsys.training.distributed import collective_device

    dev = collective_device()
    parts = [torch.empty_like(t, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(dev))
    return torch.cat(parts).to(t.device)


@torch.no_grad()
def evaluate(model: nn.Module, source: DataSource, global_batch: int, rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Runs the (sharded) model over the whole eval split; every rank takes part because the
    embedding lookups are collective. Scores are gathered so AUC is computed on all rows."""
    was_training = model.training
    model.eval()
    cards = np.asarray(source.cardinalities, dtype=np.int64)
    logits, labels, probs = [], [], []
    for block in eval_blocks(source, global_batch, rank, world):
        batch = to_batch(block, source.sparse_names, cards).to(device)
        _, (_, out, lab) = model(batch)
        logits.append(out.float().cpu())
        labels.append(lab.float().cpu())
        if block.probs is not None:
            probs.append(torch.from_numpy(block.probs))
    model.train(was_training)
    all_logits, all_labels = _gather(torch.cat(logits)), _gather(torch.cat(labels))
    out: dict[str, Any] = {
        "auc": auc(all_logits, all_labels),
        "logloss": logloss(all_logits, all_labels),
        "eval_rows": int(all_labels.numel()),
    }
    why = one_class(all_labels)
    if why is not None:  # null in JSON, a word in the log, and the reason beside it
        out["auc_undefined"] = why
    if probs:
        p = _gather(torch.cat(probs)).double().clamp(1e-7, 1 - 1e-7)
        out["oracle_auc"] = auc(p, all_labels)
        out["oracle_logloss"] = float(nn.functional.binary_cross_entropy(p, all_labels.double()))
    return out


class MetricsWriter:
    """Appends JSON lines and TensorBoard scalars. On resume, entries past the checkpoint's step
    are dropped, so the log of a resumed run reads like an uninterrupted one."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        if not tensorboard:  # train.tensorboard=false (TensorBoard is the [viz] extra)
            return
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
        if self.tb is None:
            return
        step = int(record.get("step", 0))
        kind = record.get("kind", "train")
        for key, value in record.items():
            if isinstance(value, (int, float)) and math.isfinite(value) and key not in ("step", "epoch"):
                self.tb.add_scalar(f"{kind}/{key}", value, step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def finite_or_null(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None: JSON has no NaN (Python writes a
    bare `NaN` that other readers reject), and null says "no number" where a value is undefined."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(finite_or_null(obj), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
