"""The CowClip sharder (recsys/optim/cowclip/sharder.py) in one process, on a gloo world of one: what
it offers the planner (sharding types, compute kernels), what it refuses and with which message,
which tables of a plan become CowClip kernels, and one sharded EBC of two tables of 8 rows x 8
trained two steps under every sharding type against the dense reference
(``recsys.optim.cowclip.reference.cowclip_adam_step``), with its update counters and the catch-up
of every row."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ParameterSharding

from recsys.optim.cowclip.embedding_kernel import CowClipEmbeddingBag
from recsys.optim.cowclip.exchange import ExchangeTable
from recsys.optim.cowclip.hyper import COWCLIP_ADAM
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from recsys.optim.cowclip.sharder import (
    CowClipEmbeddingBagCollectionSharder,
    ShardedCowClipEmbeddingBagCollection,
    _lookup_for,
    cowclip_tables_by_sharding_type,
    cowclip_tbes,
    tag_cowclip_adam,
    take_update_stats,
)
from tests.support.cowclip_one_rank import DIM, L2, LR, NAMES, ROWS, ZETA, initial, sharded, tables, tagged_ebc

# zeta' = sqrt(8) * 0.05 = 0.14: the floor of rows of norm ~0.16
# two steps of 3 samples; bags per feature (f_a, f_b): repeats inside and across bags, empty bags
BAGS = [
    ([[1, 2], [2], [5, 1]], [[3], [], [0, 7, 3]]),
    ([[2], [6, 6], [1]], [[7], [3, 4], []]),
]
SAMPLE_SCALE = torch.tensor([1.0, 0.01, 0.01]).unsqueeze(1)  # large and small gradients: some rows clip, some not
PLANS = {
    "table_wise": lambda: table_wise(rank=0),
    "row_wise": lambda: row_wise(),
    "column_wise": lambda: column_wise(ranks=[0, 0]),  # two column shards of 4 columns on the one rank
    "table_row_wise": lambda: table_row_wise(host_index=0),
    "data_parallel": lambda: data_parallel(),
}


def _batch(step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The step's KJT and the gradient of the loss w.r.t. the pooled output, [3, 2 * DIM]."""
    bags = [b for feature in BAGS[step] for b in feature]
    kjt = KeyedJaggedTensor(
        keys=[f"f_{n}" for n in NAMES],
        values=torch.tensor([i for b in bags for i in b], dtype=torch.long),
        lengths=torch.tensor([len(b) for b in bags], dtype=torch.long),
    )
    return kjt, torch.randn(3, 2 * DIM, generator=torch.Generator().manual_seed(10 + step)) * SAMPLE_SCALE


def _train_step(dmp: DistributedModelParallel, step: int) -> None:
    kjt, grad = _batch(step)
    kt = dmp(kjt)
    pooled = (kt.wait() if hasattr(kt, "wait") else kt).to_dict()
    loss = sum((pooled[f"f_{n}"] * grad[:, i * DIM : (i + 1) * DIM]).sum() for i, n in enumerate(NAMES))
    loss.backward()
    dmp.fused_optimizer.step()


def _reference_step(w: dict[str, torch.Tensor], st: dict[str, CowClipAdamState], step: int, **kw: Any) -> tuple[int, int]:
    """The dense reference's step on whole tables; returns (rows updated, rows clipped)."""
    _, grad = _batch(step)
    unique = clipped = 0
    for i, n in enumerate(NAMES):
        bags = BAGS[step][i]
        idx = torch.tensor([k for b in bags for k in b], dtype=torch.long)
        off = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
        s = cowclip_adam_step(w[n], st[n], idx, off, grad[:, i * DIM : (i + 1) * DIM].contiguous(), lr=LR, l2=L2, zeta=ZETA, **kw)
        unique, clipped = unique + s.unique_rows, clipped + int(s.clipped_rows)
    return unique, clipped


# ----------------------------------------------------------------------------- what the planner sees


def test_sharder_adds_row_wise_and_table_row_wise_on_cpu():
    stock = EmbeddingBagCollectionSharder().sharding_types("cpu")
    ours = CowClipEmbeddingBagCollectionSharder().sharding_types("cpu")
    assert ours[: len(stock)] == stock
    assert set(ours) == set(stock) | {"row_wise", "table_row_wise"}
    assert len(ours) == len(set(ours))


def test_compute_kernels_never_offer_the_uvm_cache():
    sharder = CowClipEmbeddingBagCollectionSharder()
    assert sharder.compute_kernels("data_parallel", "cpu") == ["dense"]
    assert sharder.compute_kernels("data_parallel", "cuda") == ["dense"]
    for st in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"):
        assert sharder.compute_kernels(st, "cpu") == ["fused"]
        assert sharder.compute_kernels(st, "cuda") == ["fused", "fused_uvm"]


def test_sharder_refuses_fused_params_it_would_ignore_or_cannot_use():
    ours = "beta1, beta2, cowclip, cowclip_r, cowclip_zeta, eps, eps_mode, l2, learning_rate, lr, optimizer, update_scope"
    typo = (
        "CowClipEmbeddingBagCollectionSharder: unknown fused_params key(s) 'cowclip_zetta' (did you mean 'cowclip_zeta'?); "
        f"CowClip-Adam takes {ours}, besides the keyword arguments of FBGEMM's SplitTableBatchedEmbeddingBagsCodegen "
        "and torchrec's FUSED_PARAM_* keys"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(typo)}$"):
        CowClipEmbeddingBagCollectionSharder(fused_params={"optimizer": COWCLIP_ADAM, "cowclip_zetta": 0.1})
    with pytest.raises(ValueError, match=r"^CowClip fused_params update_scope must be batch\|all\|catchup, got 'rows'$"):
        CowClipEmbeddingBagCollectionSharder(fused_params={"optimizer": COWCLIP_ADAM, "update_scope": "rows"})
    with pytest.raises(ValueError, match=r"^CowClip fused_params: lr=0\.1 and learning_rate=0\.2 differ$"):
        CowClipEmbeddingBagCollectionSharder(fused_params={"optimizer": COWCLIP_ADAM, "lr": 0.1, "learning_rate": 0.2})
    kept = {"optimizer": COWCLIP_ADAM, "lr": 0.1, "stochastic_rounding": False}  # an FBGEMM key passes through
    assert CowClipEmbeddingBagCollectionSharder(fused_params=kept).fused_params == kept


def test_cowclip_tables_per_sharding_type_come_from_the_plan_and_the_tags():
    """Tagged tables of the plan, per sharding type, sorted by name; an untagged table joins only
    when the sharder's own fused params select CowClip-Adam; a table the plan lacks never."""
    tables = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[n]) for n, r in (("z", 5), ("y", 6), ("x", 7))]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    tag_cowclip_adam([ebc.embedding_bags["z"].weight, ebc.embedding_bags["y"].weight], lr=LR)
    params = {
        "z": ParameterSharding(sharding_type="column_wise", compute_kernel="fused", ranks=[0, 0]),
        "y": ParameterSharding(sharding_type="column_wise", compute_kernel="fused", ranks=[0, 0]),
        "x": ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=[0]),
    }
    assert cowclip_tables_by_sharding_type(ebc, params, None) == {"column_wise": [ExchangeTable("y", 6, DIM), ExchangeTable("z", 5, DIM)]}
    by_sharder = cowclip_tables_by_sharding_type(ebc, params, {"optimizer": COWCLIP_ADAM})
    assert by_sharder == {
        "column_wise": [ExchangeTable("y", 6, DIM), ExchangeTable("z", 5, DIM)],
        "data_parallel": [ExchangeTable("x", 7, DIM)],
    }
    assert cowclip_tables_by_sharding_type(ebc, {"x": params["x"]}, None) == {}


def test_unknown_sharding_is_refused_by_name():
    class GridSharding:  # a sharding the five lookups do not mirror
        _device = torch.device("cpu")
        _env = None

    with pytest.raises(NotImplementedError, match=r"^CowClip sharder: sharding GridSharding is not supported$"):
        _lookup_for(GridSharding(), {})


# ----------------------------------------------------------------------------- the sharded module


def test_tagged_tables_get_cowclip_kernels_with_their_fused_params(gloo_world_of_one):
    dmp = sharded(tagged_ebc(tagged=("a",)), {n: PLANS["table_wise"] for n in NAMES})
    assert type(dmp.module) is ShardedCowClipEmbeddingBagCollection
    kernels = [k for lk in dmp.module._lookups for k in lk._emb_modules]
    ours = [k for k in kernels if isinstance(k, CowClipEmbeddingBag)]
    assert len(kernels) == 2 and len(ours) == 1
    assert [t.name for t in ours[0]._config.embedding_tables] == ["a"]
    want = {
        "optimizer": COWCLIP_ADAM,
        "learning_rate": LR,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "eps_mode": "torch",
        "cowclip": True,
        "cowclip_r": 1.0,
        "cowclip_zeta": ZETA,
        "l2": L2,
        "update_scope": "batch",
    }
    assert {k: ours[0]._config.fused_params[k] for k in want} == want
    assert [t.table_names for t in cowclip_tbes(dmp)] == [["a"]]


def test_a_cowclip_table_on_the_uvm_cache_is_refused(gloo_world_of_one):
    plans = {"a": lambda: table_wise(rank=0, compute_kernel="fused_uvm_caching"), "b": PLANS["table_wise"]}
    msg = (
        "CowClip-Adam table a: compute kernel fused_uvm_caching is not supported (FBGEMM's cache of hot rows cannot stay "
        "coherent with the CowClip update); use fused_uvm or fused"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        sharded(tagged_ebc(tagged=NAMES), plans)


def test_data_parallel_tables_must_all_be_cowclip_or_none(gloo_world_of_one):
    msg = (
        "CowClip sharder: data-parallel tables of one ShardedCowClipEmbeddingBagCollection must all be CowClip-Adam "
        "or none (found 1 other data-parallel kernel(s))"
    )
    with pytest.raises(NotImplementedError, match=f"^{re.escape(msg)}$"):
        sharded(tagged_ebc(tagged=("a",)), {n: PLANS["data_parallel"] for n in NAMES})


@pytest.mark.parametrize("sharding", list(PLANS))
def test_two_steps_of_each_sharding_type_equal_the_reference(gloo_world_of_one, sharding):
    """Weights after two steps equal the reference's on whole tables, rows the batches skip
    included; the update counters are the reference's (rows updated, rows clipped), per column
    shard for column-wise tables, and reset when taken."""
    dmp = sharded(tagged_ebc(tagged=NAMES), {n: PLANS[sharding] for n in NAMES})
    start = {n: initial(n) for n in NAMES}
    tables(dmp, start)
    want = {n: t.clone() for n, t in start.items()}
    st = {n: CowClipAdamState.zeros_like(t) for n, t in want.items()}
    for step in range(2):
        _train_step(dmp, step)
        counts = _reference_step(want, st, step)
        assert 0 < counts[1] < counts[0], "the case should clip some rows and not others"
        # each column shard updates, and counts, its piece of a row (the log's clipped fraction is the same)
        shards = 2 if sharding == "column_wise" else 1
        assert take_update_stats(dmp) == (shards * counts[0], shards * counts[1])
        assert take_update_stats(dmp) == (0, 0)
    got = tables(dmp)
    for n in NAMES:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{sharding} table {n}: {m}")
        skipped = {"a": [0, 3, 4, 7], "b": [1, 2, 5, 6]}[n]  # ids in neither batch
        assert torch.equal(got[n][skipped], start[n][skipped])


def test_catch_up_all_advances_every_row_behind_to_the_dense_reference(gloo_world_of_one):
    """``update_scope="catchup"``: after one step the rows absent from it are one step behind;
    ``catch_up_all`` advances them (8 rows less the 3 distinct ids of each table), once, to the
    dense reference (``update_scope="all"``, L2 on every row)."""
    dmp = sharded(tagged_ebc(tagged=NAMES, update_scope="catchup"), {"a": PLANS["table_wise"], "b": PLANS["row_wise"]})
    start = {n: initial(n) for n in NAMES}
    tables(dmp, start)
    _train_step(dmp, 0)
    assert dmp.module.catch_up_all() == (ROWS - 3) + (ROWS - 3)
    assert dmp.module.catch_up_all() == 0
    want = {n: t.clone() for n, t in start.items()}
    _reference_step(want, {n: CowClipAdamState.zeros_like(t) for n, t in want.items()}, 0, update_scope="all", l2_scope="all")
    got = tables(dmp)
    for n in NAMES:
        # the catch-up's block formula in float64 against the reference's float32 iteration
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
        assert not torch.equal(got[n], start[n])
