"""The dense optimizer (recsys/optim/dense.py): Adam on exactly the parameters no in-backward
optimizer updates, one state behind the fused and dense names, and the dense lr's linear warmup."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper

from recsys.config import OptimConfig
from recsys.optim.dense import DenseLrWarmup, combined_optimizer, dense_optimizer


class _Tiny(nn.Module):
    """One embedding table (tagged for an in-backward optimizer by the tests) and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"])
        self.ebc = EmbeddingBagCollection([cfg], device=torch.device("cpu"))
        self.lin = nn.Linear(3, 2)


def _tagged_model() -> _Tiny:
    torch.manual_seed(0)
    m = _Tiny()
    apply_optimizer_in_backward(torch.optim.SGD, list(m.ebc.parameters()), {"lr": 0.1})
    return m


def test_dense_optimizer_holds_only_the_untagged_parameters():
    m = _tagged_model()
    opt = dense_optimizer(m, OptimConfig(dense_lr=0.5, dense_weight_decay=0.1))
    assert sorted(opt.params) == ["lin.bias", "lin.weight"]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.5, 0.1)]


def test_dense_optimizer_first_step_is_adam_with_weight_decay():
    """Adam's first step, written out: g' = g + wd*w, m = (1-b1) g', v = (1-b2) g'^2, and with
    the bias corrections w <- w - lr * g' / (|g'| + eps)."""
    m = _tagged_model()
    lr, wd, eps = 0.01, 0.1, 1e-8
    opt = dense_optimizer(m, OptimConfig(dense_lr=lr, dense_weight_decay=wd))
    w0 = m.lin.weight.detach().clone()
    x = torch.tensor([[1.0, -2.0, 0.5]])
    m.lin(x).sum().backward()
    g = m.lin.weight.grad.clone()
    opt.step()
    expect = torch.empty_like(w0)
    for i in range(w0.shape[0]):
        for j in range(w0.shape[1]):
            gp = g[i, j].item() + wd * w0[i, j].item()
            m1, v1 = 0.1 * gp, 0.001 * gp * gp
            expect[i, j] = w0[i, j].item() - lr * (m1 / 0.1) / (math.sqrt(v1) / math.sqrt(0.001) + eps)
    torch.testing.assert_close(m.lin.weight.detach(), expect, rtol=1e-6, atol=1e-7)


def test_combined_optimizer_names_the_fused_and_dense_parts():
    m = _tagged_model()
    dense = dense_optimizer(m, OptimConfig())

    class _Dmp(nn.Module):
        pass

    dmp = _Dmp()
    fused_param = nn.Parameter(torch.zeros(2))
    dmp.fused_optimizer = KeyedOptimizerWrapper({"x": fused_param}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    combined = combined_optimizer(dmp, dense)
    assert sorted(combined.params) == ["dense.lin.bias", "dense.lin.weight", "fused.x"]
    assert combined.params["fused.x"] is fused_param
    assert combined.params["dense.lin.weight"] is m.lin.weight


def test_warmup_sets_every_group_lr_linearly_then_holds_it():
    m = _tagged_model()
    dense = dense_optimizer(m, OptimConfig(dense_lr=0.2))
    warm = DenseLrWarmup(dense, base_lr=0.2, warmup_steps=4)
    # 1-based step s uses (s - 1) / 4 of the base lr until step 5, then the base lr
    expected = [0.0, 0.05, 0.1, 0.15, 0.2, 0.2]
    for step, lr in enumerate(expected, start=1):
        assert warm.before_step(step) == pytest.approx(lr, abs=1e-15)
        assert [g["lr"] for g in dense.param_groups] == pytest.approx([lr], abs=1e-15)


def test_warmup_of_zero_steps_is_the_base_lr_from_the_first_step():
    dense = dense_optimizer(_tagged_model(), OptimConfig(dense_lr=0.3))
    assert DenseLrWarmup(dense, base_lr=0.3, warmup_steps=0).before_step(1) == 0.3
    assert dense.param_groups[0]["lr"] == 0.3


def test_warmup_rejects_step_zero():
    dense = dense_optimizer(_tagged_model(), OptimConfig())
    with pytest.raises(ValueError, match=r"^step must be a non-negative integer, got -1$"):
        DenseLrWarmup(dense, base_lr=0.1, warmup_steps=3).before_step(0)
