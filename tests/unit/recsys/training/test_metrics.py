"""Evaluation figures against hand computations (AUC as the share of ordered positive/negative
pairs, logloss from its formula), their undefined cases, and the metrics files: JSON lines cut
back on resume, NaN written as null, summary.json written atomically."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from recsys.data.source import DataSource
from recsys.data.synthetic import EVAL, RowBlock
from recsys.training.metrics import MetricsWriter, auc, evaluate, finite_or_null, format_metric, logloss, one_class, write_json_atomic


def _pair_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    won = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return won / (len(pos) * len(neg))


def test_auc_is_the_share_of_ordered_pairs():
    scores = [0.1, 0.4, 0.35, 0.8, 0.4, -2.0, 3.0]
    labels = [0, 0, 1, 1, 1, 0, 0]
    assert _pair_auc(scores, labels) == pytest.approx(7.5 / 12)
    assert auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32)) == pytest.approx(7.5 / 12)


def test_auc_is_undefined_with_one_class():
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])) is None
    assert one_class(torch.tensor([0.0, 0.0])) == "every eval label is 0"
    assert one_class(torch.tensor([1.0, 1.0, 1.0])) == "every eval label is 1"
    assert one_class(torch.tensor([])) == "the eval split is empty"
    assert one_class(torch.tensor([0.0, 1.0])) is None


def test_format_metric():
    assert format_metric(0.123456) == "0.1235"
    assert format_metric(None) == "undefined" and format_metric(None, "n/a") == "n/a"


def test_logloss_from_its_formula():
    logits, labels = [2.0, -1.0, 0.0], [1, 0, 1]
    p = [1 / (1 + math.exp(-z)) for z in logits]
    want = -sum(y * math.log(q) + (1 - y) * math.log(1 - q) for q, y in zip(p, labels)) / 3
    assert logloss(torch.tensor(logits), torch.tensor(labels, dtype=torch.float32)) == pytest.approx(want, rel=1e-12)


def test_finite_or_null_replaces_nan_and_inf_everywhere():
    obj = {"a": float("nan"), "b": [1.0, float("inf"), (float("-inf"), 2)], "c": {"d": 0.5, "e": "nan"}}
    assert finite_or_null(obj) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": 0.5, "e": "nan"}}


def test_write_json_atomic(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"auc": float("nan"), "steps": 3})
    assert path.read_text() == '{\n  "auc": null,\n  "steps": 3\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_writer_appends_and_cuts_back_to_the_resume_step(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    for step in (10, 20, 30):
        w.log({"kind": "train", "step": step, "loss": float("nan") if step == 20 else 0.5})
    w.close()
    assert _lines(tmp_path / "metrics.jsonl") == [
        {"kind": "train", "step": 10, "loss": 0.5},
        {"kind": "train", "step": 20, "loss": None},
        {"kind": "train", "step": 30, "loss": 0.5},
    ]
    w = MetricsWriter(tmp_path, enabled=True, resume_step=20, tensorboard=False)  # resumed at step 20
    w.log({"kind": "eval", "step": 40, "auc": 0.7})
    assert [(r["kind"], r["step"]) for r in _lines(tmp_path / "metrics.jsonl")] == [("train", 10), ("train", 20), ("eval", 40)]
    MetricsWriter(tmp_path, enabled=True, tensorboard=False)  # a fresh run starts a new file
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "run", enabled=False)
    w.log({"step": 1})
    assert not (tmp_path / "run").exists()


class _Rows(DataSource):
    """An eval split of given rows: dense column 0 is the model's logit."""

    def __init__(self, logits: list[float], labels: list[int], probs: list[float] | None) -> None:
        n = len(labels)
        self.dense_names, self.sparse_names, self.cardinalities = ["I1"], ["C1"], [10]
        self.block = RowBlock(
            np.array(logits, dtype=np.float32).reshape(n, 1),
            np.arange(n, dtype=np.int64).reshape(n, 1) % 10,
            np.array(labels, dtype=np.float32),
            None if probs is None else np.array(probs, dtype=np.float32),
        )

    def num_rows(self, split: int) -> int:
        return len(self.block) if split == EVAL else 0

    def read(self, split: int, start: int, stop: int) -> RowBlock:
        return self.block.take(slice(start, stop))

    def identity(self) -> dict:
        return {}


class _DenseLogit(nn.Module):
    """The training module's interface: batch -> (loss, (loss, logits, labels))."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_training: list[bool] = []

    def forward(self, batch):
        self.seen_training.append(self.training)
        return None, (None, batch.dense_features[:, 0], batch.labels)


def test_evaluate_over_the_whole_split_in_batches(gloo_world_of_one):
    logits = [0.3, -1.0, 2.0, 0.1, -0.5, 1.5, 0.0]
    labels = [1, 0, 1, 0, 0, 1, 1]
    probs = [0.6, 0.2, 0.9, 0.5, 0.3, 0.7, 0.4]
    model = _DenseLogit()
    out = evaluate(model, _Rows(logits, labels, probs), global_batch=3, rank=0, world=1, device=torch.device("cpu"))
    assert model.seen_training == [False, False, False] and model.training  # 3 + 3 + 1 rows, then back to training
    assert out["eval_rows"] == 7
    assert out["auc"] == pytest.approx(_pair_auc(logits, labels))
    assert out["oracle_auc"] == pytest.approx(_pair_auc(probs, labels))
    p = [1 / (1 + math.exp(-z)) for z in logits]
    want = -sum(y * math.log(q) + (1 - y) * math.log(1 - q) for q, y in zip(p, labels)) / 7
    assert out["logloss"] == pytest.approx(want, rel=1e-6)
    want = -sum(y * math.log(q) + (1 - y) * math.log(1 - q) for q, y in zip(probs, labels)) / 7
    assert out["oracle_logloss"] == pytest.approx(want, rel=1e-6)
    assert "auc_undefined" not in out


def test_evaluate_says_why_auc_is_undefined():
    out = evaluate(_DenseLogit(), _Rows([0.1, 0.2], [0, 0], None), global_batch=8, rank=0, world=1, device=torch.device("cpu"))
    assert out["auc"] is None and out["auc_undefined"] == "every eval label is 0"
    assert "oracle_auc" not in out
