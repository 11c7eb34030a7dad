"""The grouped lookups over CowClip kernels (recsys/optim/cowclip/lookups.py) in one process, on a gloo
world of one: which lookup each sharding type gets, their pooled output against a hand sum of
weighted rows (training and no-grad forwards), and the exchange lookup's update inside the
backward (column-wise, data-parallel) against the dense reference
(``recsys.optim.cowclip.reference.cowclip_adam_step``), with the learning rate its kernels' fused
optimizers hold. Two tables of 8 rows x 8, per-sample weights."""

from __future__ import annotations


import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)

from recsys.optim.cowclip.exchange import ExchangeTable
from recsys.optim.cowclip.lookups import CowClipExchangeLookup, CowClipGroupedPooledEmbeddingsLookup, ExchangeLookup
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from tests.support.cowclip_one_rank import DIM, L2, LR, NAMES, ROWS, ZETA, initial, initial_dmp, tables

# 3 samples, per feature (f_a, f_b): repeats inside and across bags, an empty bag
BAGS = ([[1, 2, 1], [2], [5]], [[3], [], [0, 7, 3]])
PSW = ([[0.5, 2.0, 1.5], [3.0], [0.25]], [[1.0], [], [2.0, 0.5, 4.0]])
PLANS = {
    "table_wise": lambda: table_wise(rank=0),
    "row_wise": lambda: row_wise(),
    "table_row_wise": lambda: table_row_wise(host_index=0),
    "column_wise": lambda: column_wise(ranks=[0, 0]),  # two column shards of 4 columns on the one rank
    "data_parallel": lambda: data_parallel(),
}
EXCHANGED = ("column_wise", "data_parallel")  # updated by the lookup's exchange node in backward


def _dmp(sharding: str) -> DistributedModelParallel:
    """A weighted EBC, both tables tagged and sharded ``sharding``, weights set to ``initial``."""
    return initial_dmp({n: PLANS[sharding] for n in NAMES}, weighted=True)


def _kjt() -> KeyedJaggedTensor:
    bags = [b for feature in BAGS for b in feature]
    return KeyedJaggedTensor(
        keys=[f"f_{n}" for n in NAMES],
        values=torch.tensor([i for b in bags for i in b], dtype=torch.long),
        lengths=torch.tensor([len(b) for b in bags], dtype=torch.long),
        weights=torch.tensor([x for feature in PSW for b in feature for x in b]),
    )


def _pooled(dmp: DistributedModelParallel) -> dict[str, torch.Tensor]:
    kt = dmp(_kjt())
    return (kt.wait() if hasattr(kt, "wait") else kt).to_dict()


def _grad() -> torch.Tensor:
    """d loss / d pooled: large for sample 0 (its rows clip), small for the others."""
    return torch.randn(3, 2 * DIM, generator=torch.Generator().manual_seed(5)) * torch.tensor([[1.0], [0.01], [0.01]])


def _lookups(dmp: DistributedModelParallel) -> list[CowClipGroupedPooledEmbeddingsLookup]:
    return list(dmp.module._lookups)


@pytest.mark.parametrize("sharding", list(PLANS))
def test_each_sharding_type_pools_the_hand_sum_of_weighted_rows(gloo_world_of_one, sharding):
    """Bag b of feature f pools sum_i psw_i * W_f[id_i] (a row twice in a bag counts twice, an
    empty bag is 0), in a training forward (the exchange lookup joins its node to the output) and
    under no_grad (torchrec's own forward)."""
    dmp = _dmp(sharding)
    (lookup,) = _lookups(dmp)
    assert isinstance(lookup, CowClipExchangeLookup) == (sharding in EXCHANGED)
    assert isinstance(lookup, CowClipGroupedPooledEmbeddingsLookup) and lookup.module is lookup
    assert lookup.cowclip_update_mode == ("deferred" if sharding in EXCHANGED else "inline")
    assert [k.emb_module.mode for k in lookup.cowclip_kernels()] == [lookup.cowclip_update_mode]
    want = {}
    for i, n in enumerate(NAMES):
        w = initial(n)
        want[f"f_{n}"] = torch.stack([sum((p * w[k] for k, p in zip(bag, psw)), torch.zeros(DIM)) for bag, psw in zip(BAGS[i], PSW[i])])
    for grad_enabled in (True, False):
        with torch.set_grad_enabled(grad_enabled):
            got = _pooled(dmp)
        for f, t in want.items():
            torch.testing.assert_close(got[f], t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sharding", EXCHANGED)
def test_exchange_lookup_updates_in_backward_with_its_kernels_lr(gloo_world_of_one, sharding):
    """``backward`` alone (no optimizer call) updates every table of the exchange lookup, at the
    learning rate its kernel's fused optimizer holds then; the lookup's own fused optimizer holds
    no state. A no-grad forward before it leaves nothing pending."""
    dmp = _dmp(sharding)
    (lookup,) = _lookups(dmp)
    assert isinstance(lookup, ExchangeLookup)
    assert lookup.exchange_tables == [ExchangeTable("a", ROWS, DIM), ExchangeTable("b", ROWS, DIM)]
    assert lookup.fused_optimizer.state_dict()["state"] == {}
    (kernel,) = lookup.cowclip_kernels()
    kernel.fused_optimizer.param_groups[0]["lr"] = 0.03  # as a schedule writes it, no step() after
    with torch.no_grad():
        _pooled(dmp)
    pooled = _pooled(dmp)
    grad = _grad()
    sum((pooled[f"f_{n}"] * grad[:, i * DIM : (i + 1) * DIM]).sum() for i, n in enumerate(NAMES)).backward()
    got = tables(dmp)
    clipped = 0
    for i, n in enumerate(NAMES):
        want, st = initial(n), CowClipAdamState.zeros_like(initial(n))
        idx = torch.tensor([k for b in BAGS[i] for k in b])
        off = torch.tensor([0] + [len(b) for b in BAGS[i]]).cumsum(0)
        psw = torch.tensor([x for b in PSW[i] for x in b])
        s = cowclip_adam_step(want, st, idx, off, grad[:, i * DIM : (i + 1) * DIM].contiguous(), psw, lr=0.03, l2=L2, zeta=ZETA)
        clipped += int(s.clipped_rows)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{sharding} table {n}: {m}")
    assert 0 < clipped < 6


def test_a_loss_on_one_feature_still_runs_the_exchange_for_every_table(gloo_world_of_one):
    """The exchange updates every CowClip table of the lookup: a loss on f_b alone updates the batch
    rows of table a too, with zero data gradient (the L2 term and Adam's step on it)."""
    dmp = _dmp("column_wise")
    pooled = _pooled(dmp)
    grad = _grad()[:, DIM:]
    (pooled["f_b"] * grad).sum().backward()
    got = tables(dmp)
    for i, (n, go) in enumerate((("a", torch.zeros(3, DIM)), ("b", grad.contiguous()))):
        want, st = initial(n), CowClipAdamState.zeros_like(initial(n))
        idx = torch.tensor([k for b in BAGS[i] for k in b])
        off = torch.tensor([0] + [len(b) for b in BAGS[i]]).cumsum(0)
        psw = torch.tensor([x for b in PSW[i] for x in b])
        cowclip_adam_step(want, st, idx, off, go, psw, lr=LR, l2=L2, zeta=ZETA)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(got[n], initial(n))
