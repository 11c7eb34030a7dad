"""The torchrec kernel of CowClip tables (recsys/optim/cowclip/embedding_kernel.py) in one process, on a
gloo world of one: the optimizer state torchrec checkpoints (the Adam moments and ``row_step`` per
table, as ShardedTensors laid out like the weight's shards, or plain tensors for data-parallel
tables) against the dense reference (``recsys.optim.cowclip.reference.cowclip_adam_step``), a
learning rate set on the fused optimizer reaching the update, the flush before a state dict, and
the weights kept away from outside optimizers. Two tables of 8 rows x 8, two steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_wise
from torchrec.optim.fused import EmptyFusedOptimizer

from recsys.optim.cowclip.embedding_kernel import CowClipEmbeddingBag, CowClipFusedOptimizer, ReplicatedCowClipFusedOptimizer
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from tests.support.cowclip_one_rank import DIM, L2, LR, NAMES, ROWS, ZETA, initial, initial_dmp

BAGS = [  # per step, per feature (f_a, f_b): 3 bags with repeats and an empty one
    ([[1, 2], [2], [5, 1]], [[3], [], [0, 7, 3]]),
    ([[2], [6, 6], [1]], [[7], [3, 4], []]),
]
PLANS = {
    "table_wise": lambda: table_wise(rank=0),
    "row_wise": lambda: row_wise(),
    "column_wise": lambda: column_wise(ranks=[0, 0]),  # two column shards of 4 columns on the one rank
    "data_parallel": lambda: data_parallel(),
}


def _dmp(sharding: str, update_scope: str = "batch") -> DistributedModelParallel:
    """Both tables tagged, both sharded ``sharding``, weights set to ``initial``."""
    return initial_dmp({n: PLANS[sharding] for n in NAMES}, update_scope=update_scope)


def _assembled(v: torch.Tensor | ShardedTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A ShardedTensor's local shards (all shards, in a world of one) written into one tensor."""
    if not isinstance(v, ShardedTensor):
        return v.clone()
    out = torch.full(shape, -1.0 if v.dtype.is_floating_point else -1, dtype=v.dtype)
    for s in v.local_shards():
        out[tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.tensor.shape))] = s.tensor
    return out


def _grad(step: int) -> torch.Tensor:
    return torch.randn(3, 2 * DIM, generator=torch.Generator().manual_seed(10 + step)) * torch.tensor([[1.0], [0.01], [0.01]])


def _train_step(dmp: DistributedModelParallel, step: int) -> None:
    bags = [b for feature in BAGS[step] for b in feature]
    kjt = KeyedJaggedTensor(
        keys=[f"f_{n}" for n in NAMES],
        values=torch.tensor([i for b in bags for i in b], dtype=torch.long),
        lengths=torch.tensor([len(b) for b in bags], dtype=torch.long),
    )
    kt = dmp(kjt)
    pooled = (kt.wait() if hasattr(kt, "wait") else kt).to_dict()
    grad = _grad(step)
    sum((pooled[f"f_{n}"] * grad[:, i * DIM : (i + 1) * DIM]).sum() for i, n in enumerate(NAMES)).backward()


def _reference(steps: int, lrs: tuple[float, ...] = (LR, LR), **kw: Any) -> tuple[dict[str, torch.Tensor], dict[str, CowClipAdamState]]:
    w = {n: initial(n) for n in NAMES}
    st = {n: CowClipAdamState.zeros_like(t) for n, t in w.items()}
    for step in range(steps):
        grad = _grad(step)
        for i, n in enumerate(NAMES):
            bags = BAGS[step][i]
            idx = torch.tensor([k for b in bags for k in b], dtype=torch.long)
            off = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
            go = grad[:, i * DIM : (i + 1) * DIM].contiguous()
            cowclip_adam_step(w[n], st[n], idx, off, go, lr=lrs[step], l2=L2, zeta=ZETA, **kw)
    return w, st


def _kernels(dmp: DistributedModelParallel) -> list[CowClipEmbeddingBag]:
    return [k for lk in dmp.module._lookups for k in lk._emb_modules if isinstance(k, CowClipEmbeddingBag)]


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_checkpointed_optimizer_state_is_the_reference_moments_and_row_steps(gloo_world_of_one, sharding):
    dmp = _dmp(sharding)
    for step in range(2):
        _train_step(dmp, step)
    _, st = _reference(2)
    kernels = _kernels(dmp)
    want_type = ReplicatedCowClipFusedOptimizer if sharding == "data_parallel" else CowClipFusedOptimizer
    assert [type(k.fused_optimizer) for k in kernels] == [want_type]
    state = dmp.fused_optimizer.state_dict()["state"]
    for n in NAMES:
        got = state[f"embedding_bags.{n}.weight"]
        assert set(got) == {f"{n}.momentum1", f"{n}.exp_avg_sq", f"{n}.row_step"}
        torch.testing.assert_close(_assembled(got[f"{n}.momentum1"], (ROWS, DIM)), st[n].exp_avg, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(_assembled(got[f"{n}.exp_avg_sq"], (ROWS, DIM)), st[n].exp_avg_sq, rtol=1e-5, atol=1e-12)
        row_step = got[f"{n}.row_step"]
        if sharding == "column_wise":  # one full-length block of row steps per column shard
            assert row_step.size() == torch.Size([2 * ROWS])
            assert sorted(m.shard_offsets[0] for m in row_step.metadata().shards_metadata) == [0, ROWS]
            assert torch.equal(_assembled(row_step, (2 * ROWS,)), st[n].row_step.repeat(2))
        else:
            assert isinstance(row_step, ShardedTensor) == (sharding != "data_parallel")
            assert torch.equal(_assembled(row_step, (ROWS,)), st[n].row_step)
        assert st[n].row_step.tolist() == ([0, 2, 2, 0, 0, 1, 1, 0] if n == "a" else [1, 0, 0, 2, 1, 0, 0, 2])


@pytest.mark.parametrize("sharding", ["table_wise", "data_parallel"])
def test_a_learning_rate_set_on_the_fused_optimizer_is_the_next_steps(gloo_world_of_one, sharding):
    """A schedule writes the param groups' lr; the stock loop's ``zero_grad`` hands it to the
    kernel, whose next backward updates with it."""
    dmp = _dmp(sharding)
    _train_step(dmp, 0)
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.03
    dmp.fused_optimizer.zero_grad()
    assert [k.emb_module.get_learning_rate() for k in _kernels(dmp)] == [0.03]
    _train_step(dmp, 1)
    want, _ = _reference(2, lrs=(LR, 0.03))
    for n, v in dmp.state_dict().items():
        torch.testing.assert_close(_assembled(v, (ROWS, DIM)), want[n.split(".")[-2]], rtol=1e-5, atol=1e-6)


def test_replicated_optimizer_hands_lr_and_hyperparameters_to_the_table_batch(gloo_world_of_one):
    (kernel,) = _kernels(_dmp("data_parallel"))
    opt, tbe = kernel.fused_optimizer, kernel.emb_module
    assert isinstance(opt, ReplicatedCowClipFusedOptimizer)
    assert opt.param_groups[0]["lr"] == LR
    opt.param_groups[0]["lr"] = 0.2
    opt.step()
    assert tbe.get_learning_rate() == 0.2
    opt.update_hyper_parameters({"lr": 0.5, "cowclip_zeta": 0.25, "beta2": 0.99, "not_ours": 1})
    assert tbe.get_learning_rate() == 0.5
    assert (tbe.hyper.learning_rate, tbe.hyper.cowclip_zeta, tbe.hyper.beta2, tbe.hyper.l2) == (0.5, 0.25, 0.99, L2)


def test_state_dict_flushes_rows_behind_to_the_dense_reference(gloo_world_of_one):
    """``update_scope="catchup"``: taking the model's state dict flushes the kernels, so it holds
    the dense reference's tables (every row a step further, L2 on every row) without a call to
    ``catch_up_all``; every ``row_step`` is then the current step."""
    dmp = _dmp("table_wise", update_scope="catchup")
    _train_step(dmp, 0)
    (kernel,) = _kernels(dmp)
    assert sorted(kernel.emb_module.row_step.tolist()) == [0] * 10 + [1] * 6  # 3 distinct ids per table
    want, _ = _reference(1, update_scope="all", l2_scope="all")
    for n, v in dmp.state_dict().items():
        # the catch-up's block formula in float64 against the reference's float32 iteration
        torch.testing.assert_close(_assembled(v, (ROWS, DIM)), want[n.split(".")[-2]], rtol=1e-5, atol=1e-6)
    assert kernel.emb_module.row_step.tolist() == [1] * (2 * ROWS)


def test_weights_are_fused_parameters_that_outside_optimizers_skip(gloo_world_of_one):
    """The kernel's parameters are views of its table batch that require no gradient and carry an
    in-backward optimizer, its buffers are none; per table, a view of that table's rows."""
    dmp = _dmp("table_wise")
    (kernel,) = _kernels(dmp)
    tbe = kernel.emb_module
    params = dict(kernel.named_parameters())
    assert list(params) == ["a.weight", "b.weight"]
    for t, (n, p) in enumerate(params.items()):
        assert not p.requires_grad
        assert [type(o) for o in p._in_backward_optimizers] == [EmptyFusedOptimizer]
        assert torch.equal(p, initial(n.split(".")[0])) and p.data_ptr() == tbe.split_embedding_weights()[t].data_ptr()
    assert list(kernel.named_buffers()) == []
    assert [n for n, p in dmp.named_parameters() if p.requires_grad] == []
    per_table = kernel._param_per_table
    assert list(per_table) == ["a", "b"]
    for n in NAMES:
        assert torch.equal(per_table[n], initial(n))
