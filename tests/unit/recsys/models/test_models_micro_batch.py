"""The chunked over-arch (recsys/models/micro_batch.py) on a logistic regression small enough to
differentiate by hand: the loss, the logits and the gradients of a batch run in chunks equal the
closed forms of the whole batch. (The CTR models and the sharded job: tests/integration/training/test_micro_batch.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys.models.micro_batch import MicroBatchedLoss, chunked_loss


class _Logistic(nn.Module):
    """over(dense, emb) = dense @ w + emb @ v + c: the logit of a logistic regression on both inputs."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, generator=g))
        self.v = nn.Parameter(torch.randn(2, generator=g))
        self.c = nn.Parameter(torch.tensor(0.3))

    def sparse(self, dense: torch.Tensor, sparse: object) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError  # the tests hand `over` its inputs directly

    def over(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return dense @ self.w + emb @ self.v + self.c

    def over_parameters(self):
        return iter([self.w, self.v, self.c])


def _inputs(n: int = 7):
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(n, 3, generator=g)
    emb = torch.randn(n, 2, generator=g).requires_grad_(True)
    labels = (torch.rand(n, generator=g) < 0.5).float()
    return dense, emb, labels


def _closed_form(m: _Logistic, dense: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor):
    """Mean BCE of sigmoid(z) and its gradients, dL/dz_i = (sigmoid(z_i) - y_i) / B, in float64
    and given back in float32 (the dtype of the model)."""
    with torch.no_grad():
        x, e, y = dense.double(), emb.double(), labels.double()
        w, v, c = m.w.double(), m.v.double(), m.c.double()
        z = x @ w + e @ v + c
        p = 1.0 / (1.0 + torch.exp(-z))
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        r = (p - y) / len(y)
        grads = {"w": x.T @ r, "v": e.T @ r, "c": r.sum(), "emb": r[:, None] * v[None, :]}
        return loss.float(), z.float(), {k: g.float() for k, g in grads.items()}


@pytest.mark.parametrize("rows", [1, 3, 7, 100])
def test_chunks_give_the_whole_batch_loss_logits_and_gradients(rows):
    """rows 3 over 7 samples: chunks of 3 + 3 + 1; a scaled loss scales every gradient."""
    m = _Logistic()
    dense, emb, labels = _inputs()
    loss, logits = chunked_loss(m.over, m.over_parameters(), dense, (emb,), labels, rows)
    (2.5 * loss).backward()
    want_loss, want_z, grads = _closed_form(m, dense, emb, labels)
    torch.testing.assert_close(loss.detach(), want_loss)
    torch.testing.assert_close(logits, want_z)
    assert not logits.requires_grad
    for name in ("w", "v", "c"):
        torch.testing.assert_close(getattr(m, name).grad, 2.5 * grads[name], msg=name)
    torch.testing.assert_close(emb.grad, 2.5 * grads["emb"])


def test_frozen_parameters_and_inputs_without_grad_get_none():
    m = _Logistic()
    m.v.requires_grad_(False)
    dense, emb, labels = _inputs()
    emb = emb.detach()
    loss, _ = chunked_loss(m.over, m.over_parameters(), dense, (emb,), labels, 2)
    loss.backward()
    assert m.v.grad is None and emb.grad is None and dense.grad is None
    torch.testing.assert_close(m.w.grad, _closed_form(m, dense, emb, labels)[2]["w"])


def test_micro_batched_loss_chunks_only_training_batches_larger_than_a_chunk():
    m = _Logistic()
    dense, emb, labels = _inputs()
    want_loss, want_z, _ = _closed_form(m, dense, emb, labels)
    for rows, chunked in ((3, True), (7, False)):
        loss, logits = MicroBatchedLoss(m, rows)(dense, labels, emb)
        assert (loss.grad_fn.name() == "ChunkedOverArchBackward") is chunked
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(logits, want_z)
    with torch.no_grad():  # eval: the plain forward, whatever the size
        loss, logits = MicroBatchedLoss(m, 3)(dense, labels, emb)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, want_loss)


def test_bad_rows_and_an_empty_batch_are_refused():
    m = _Logistic()
    dense, emb, labels = _inputs()
    with pytest.raises(ValueError, match=r"^micro-batch rows must be > 0, got 0$"):
        MicroBatchedLoss(m, 0)
    with pytest.raises(ValueError, match=r"^micro-batch rows must be > 0, got -1$"):
        chunked_loss(m.over, m.over_parameters(), dense, (emb,), labels, -1)
    with pytest.raises(ValueError, match=r"^chunked_loss: empty batch$"):
        chunked_loss(m.over, m.over_parameters(), dense[:0], (emb[:0],), labels[:0], 4)
