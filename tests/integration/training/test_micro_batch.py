"""Micro-batched dense part (recsys/models/micro_batch.py): the gradients of every parameter,
the embedding tables included, the loss and the logits equal those of the whole batch, for each
model, with chunks that do not divide the batch; checked against a plain `loss.backward()`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models.ctr import TrainModule, build_model
from recsys.models.micro_batch import SplitCTRModel, chunked_loss
from tests.support.models import CARDS, CPU, NAMES, kjt
from tests.support.processes import run_main_and_children


def _batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], dim=1)
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1  # some missing fields
    return SimpleNamespace(
        dense_features=torch.randn(n, 4, generator=g), sparse_features=kjt(ids), labels=(torch.rand(n, generator=g) < 0.3).float()
    )


def _grads(module: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss, (_, logits, _) = module(batch)
    (loss * 3.0).backward()  # a scaled loss: the chunks' gradients follow the incoming gradient
    return loss.detach(), logits, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["deepfm", "wide_deep", "dcn", "dcnv2"])
def test_chunked_step_has_the_whole_batch_gradients(name):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, embedding_dim=8, dnn=[16, 8], cross_layers=2), NAMES, CARDS, 4, CPU, emb_device=CPU)
    assert isinstance(model, SplitCTRModel)
    batch = _batch(23)
    whole = TrainModule(model, 0)
    chunked = TrainModule(model, 5)  # 5 + 5 + 5 + 5 + 3 rows
    assert not whole.micro_batched and chunked.micro_batched
    loss0, logits0, g0 = _grads(whole, batch)
    loss1, logits1, g1 = _grads(chunked, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logits1, logits0, rtol=1e-6, atol=1e-6)
    assert sorted(g1) == sorted(g0)
    assert any(k.startswith("model.embeddings") for k in g0)  # tables get their gradient through the chunks
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7, msg=k)
    # a wrong share of the loss per chunk would be caught: the scale of the whole-batch mean matters
    assert float(g0["model.head.bias"].abs()) > 1e-3


def test_eval_and_small_batches_run_whole():
    """No gradient (eval) or a batch no larger than a chunk: the plain forward, same numbers."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=8, dnn=[16, 8]), NAMES, CARDS, 4, CPU, emb_device=CPU)
    batch = _batch(10)
    with torch.no_grad():
        a = TrainModule(model, 3)(batch)[1][1]
    b = TrainModule(model, 10)(batch)[1][1]
    torch.testing.assert_close(a, b)
    assert TrainModule(model, 10)(batch)[0].grad_fn.name() != "ChunkedOverArchBackward"
    assert TrainModule(model, 9)(batch)[0].grad_fn.name() == "ChunkedOverArchBackward"


def test_a_model_without_the_split_runs_whole_batches():
    class Plain(nn.Module):  # a user's model: forward(dense, kjt) only
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, dense, sparse):
            return self.lin(dense).squeeze(1)

    m = TrainModule(Plain(), 4)
    assert not m.micro_batched
    loss, _ = m(_batch(10))
    assert loss.grad_fn.name() != "ChunkedOverArchBackward"


def test_bad_rows_are_refused():
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=8, dnn=[16, 8]), NAMES, CARDS, 4, CPU, emb_device=CPU)
    with pytest.raises(ValueError, match="micro_batch_rows must be >= 0, got -1"):
        TrainModule(model, -1)
    b = _batch(4)
    with pytest.raises(ValueError, match="micro-batch rows must be > 0, got 0"):
        chunked_loss(model.over, model.over_parameters(), b.dense_features, model.sparse(b.dense_features, b.sparse_features), b.labels, 0)


REPO = Path(__file__).resolve().parents[3]


def _train(run_dir: Path, rows: int) -> tuple[list[float], dict, str]:
    r = run_main_and_children(
        "recsys.cli",
        "train",
        "--config",
        str(REPO / "configs/experiments/smoke.yaml"),
        f"run_dir={run_dir}",
        "train.batch_size=4096",
        "train.max_steps=12",
        "train.log_every=4",
        f"train.micro_batch_rows={rows}",
        cwd=REPO,
    )  # the launcher in this process; its torchrun and workers are real processes
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in recs if x.get("kind") == "train"], json.loads((run_dir / "summary.json").read_text()), r.stderr


def test_sharded_job_trains_the_same_with_micro_batches(tmp_path):
    """The real job (torchrun, 2 gloo ranks, DMP with FBGEMM's fused table update, DDP on the dense
    part, TrainPipelineSparseDist, which fx-traces the model): 2048 rows per rank in chunks of
    1000 + 1000 + 48 give the same losses and eval metrics as whole batches, to float rounding."""
    whole_losses, whole, _ = _train(tmp_path / "whole", 0)
    mb_losses, mb, log = _train(tmp_path / "micro", 1000)
    assert "dense part in micro-batches of 1000 rows (local batch 2048: 3 chunks)" in log
    assert len(mb_losses) == len(whole_losses) == 3
    assert mb_losses == pytest.approx(whole_losses, rel=1e-5)
    assert mb["auc"] == pytest.approx(whole["auc"], abs=1e-5)
    assert mb["logloss"] == pytest.approx(whole["logloss"], abs=1e-5)
