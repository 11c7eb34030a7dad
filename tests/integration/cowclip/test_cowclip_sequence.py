"""CowClip-Adam for EmbeddingCollection (unpooled) tables, next to an EmbeddingBagCollection in one
model: the sharded kernels against the per-table formula with every id its own bag
(``recsys.optim.cowclip.reference.cowclip_adam_step``), for every sharding type torchrec offers
for EC, 1 process and 2 processes on the same global batch, and a DCP checkpoint round trip; plus
the one-line refusals (index dedup, a tagged EC without this sharder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from recsys.training.distributed import free_port
from tests.support.processes import start_workers
from test_cowclip_sharded import _assemble, _full_init, _load_full, _local_pieces, _split_kjt

DIM = 16
B = 12  # global batch
LR, L2, R, ZETA = 0.02, 1e-3, 1.0, 0.05

# EC tables -> (rows, 2-rank spec); every sharding type torchrec offers for EmbeddingCollection
SEQ = {
    "s_tw": (40, ("table_wise", 1)),
    "s_rw": (41, ("row_wise", None)),
    "s_rw3": (3, ("row_wise", None)),
    "s_cw": (42, ("column_wise", [0, 1])),
    "s_cw1": (43, ("column_wise", [1, 1])),  # two column shards in one kernel on rank 1
    "s_dp": (45, ("data_parallel", None)),
}
BAG = {"b_tw": (30, ("table_wise", 0))}  # a pooled CowClip table in the same model
ALL = list(SEQ) + list(BAG)
ROWS = {n: r for n, (r, _) in (SEQ | BAG).items()}


def _batches(steps: int):
    """Global batches: 0-3 ids per sample from few rows (repeats within and across samples); one
    target vector per EC id and per EBC sample."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(ALL) * B,), generator=g)
        vals = torch.cat([torch.randint(0, min(8, ROWS[ALL[i // B]]), (int(n),), generator=g) for i, n in enumerate(lengths)])
        per_id = torch.randn(vals.numel(), DIM, generator=g)
        per_sample = torch.randn(B, DIM * len(BAG), generator=g)
        out.append((lengths, vals, per_id, per_sample))
    return out


def _reference(steps_data):
    w = {n: _full_init(n, ROWS[n], DIM) for n in ALL}
    st = {n: CowClipAdamState.zeros_like(w[n]) for n in ALL}
    for lengths, vals, per_id, per_sample in steps_data:
        offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        for f, n in enumerate(ALL):
            lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
            if n in SEQ:  # every id its own bag: its gradient is its target row
                bags, go = torch.arange(hi - lo + 1), per_id[lo:hi] / B
            else:
                j = list(BAG).index(n)
                bags, go = offs[f * B : (f + 1) * B + 1] - lo, per_sample[:, j * DIM : (j + 1) * DIM] / B
            cowclip_adam_step(w[n], st[n], vals[lo:hi], bags, go.contiguous(), lr=LR, l2=L2, r=R, zeta=ZETA)
    return w


class _Model(torch.nn.Module):
    def __init__(self, ec, ebc):
        super().__init__()
        self.ec, self.ebc = ec, ebc

    def forward(self, seq_kjt, bag_kjt):
        return self.ec(seq_kjt), self.ebc(bag_kjt)


def _build(world: int, specs: dict):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from recsys.optim.cowclip.sequence import CowClipEmbeddingCollectionSharder
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam

    meta = torch.device("meta")
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS[n], feature_names=[n]) for n in SEQ], device=meta
    )
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS[n], feature_names=[n]) for n in BAG], device=meta
    )
    tag_cowclip_adam(list(ec.parameters()) + list(ebc.parameters()), lr=LR, l2=L2, cowclip_r=R, cowclip_zeta=ZETA, update_scope="batch")
    sharders = [CowClipEmbeddingCollectionSharder(), CowClipEmbeddingBagCollectionSharder()]
    gen = {
        "table_wise": lambda a: table_wise(rank=a),
        "row_wise": lambda a: row_wise(),
        "column_wise": lambda a: column_wise(ranks=a),
        "data_parallel": lambda a: data_parallel(),
    }
    plan = {}
    for path, module, names, sharder in (("ec", ec, SEQ, sharders[0]), ("ebc", ebc, BAG, sharders[1])):
        per_param = {n: gen[specs[n][0]](specs[n][1]) for n in names}
        plan[path] = construct_module_sharding_plan(
            module, per_param, local_size=world, world_size=world, device_type="cpu", sharder=sharder
        )
    return DistributedModelParallel(
        _Model(ec, ebc),
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=ShardingPlan(plan),
        sharders=sharders,
        device=torch.device("cpu"),
    )


def _specs(world: int, only: str | None) -> dict:
    if world == 1:
        arg = {"table_wise": 0, "column_wise": [0, 0]}.get(only)
        return {n: (only, arg) for n in SEQ} | {n: ("table_wise", 0) for n in BAG}
    return {n: spec for n, (_, spec) in (SEQ | BAG).items()}


def _worker(rank: int, world: int, port: int, out: str, steps: int, only: str | None, ckpt_at: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, Path(out), steps, only, ckpt_at)
    finally:
        dist.destroy_process_group()


def _run(rank, world, out: Path, steps, only, ckpt_at):
    import torch.distributed.checkpoint as dcp

    specs = _specs(world, only)
    data = _batches(steps)
    dmp = _build(world, specs)
    _load_full(dmp, {n: _full_init(n, ROWS[n], DIM) for n in ALL})
    b = B // world
    from sharding.optimizer_state import sharded_tables

    # what save_plan / recsys-plan read from the sharded model: the EC's tables are CowClip-Adam (not
    # the Adam torchrec's EC grouping writes over the tag); tables held by other ranks are unknown
    kinds = {c.name: k for c, k in sharded_tables(dmp)}
    assert set(kinds) == set(ALL) and {k for k in kinds.values() if k} == {"cowclip_adam"}, kinds

    def step(model, i):
        lengths, vals, per_id, per_sample = data[i]
        offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        seq = _split_kjt(list(SEQ), lengths[: len(SEQ) * B], vals[: int(offs[len(SEQ) * B])], None, rank, world)
        bag = _split_kjt(list(BAG), lengths[len(SEQ) * B :], vals[int(offs[len(SEQ) * B]) :], None, rank, world)
        jts, kt = model(seq, bag)
        kt = kt.wait() if hasattr(kt, "wait") else kt
        loss = 0.0
        for f, n in enumerate(SEQ):  # this rank's ids' targets: the same slice of the key-major values
            lo = [int(offs[f * B + k * b]) for k in (rank, rank + 1)]
            loss = loss + (jts[n].values() * per_id[lo[0] : lo[1]]).sum()
        pooled = kt.to_dict()
        for j, n in enumerate(BAG):
            loss = loss + (pooled[n] * per_sample[rank * b : (rank + 1) * b, j * DIM : (j + 1) * DIM]).sum()
        (loss / b).backward()  # this rank's mean; torchrec divides the embeddings' gradients by the world size
        model.fused_optimizer.step()

    ck = out / "ckpt"
    for i in range(steps):
        if ckpt_at and i == ckpt_at:
            dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=str(ck))
        step(dmp, i)
    torch.save(_local_pieces(dmp), out / f"final_r{rank}.pt")
    if ckpt_at:
        dmp2 = _build(world, specs)
        sd = {"model": dmp2.state_dict(), "optim": dmp2.fused_optimizer.state_dict()}
        dcp.load(sd, checkpoint_id=str(ck))
        dmp2.load_state_dict(sd["model"])
        dmp2.fused_optimizer.load_state_dict(sd["optim"])
        for i in range(ckpt_at, steps):
            step(dmp2, i)
        torch.save(_local_pieces(dmp2), out / f"resumed_r{rank}.pt")


def _spawn(world: int, tmp: Path, steps: int, only: str | None = None, ckpt_at: int = 0) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    start_workers(_worker, (world, free_port(), str(tmp), steps, only, ckpt_at), world)


def _check(got: dict, want: dict, what: str) -> None:
    for n in want:
        assert not torch.isnan(got[n]).any(), f"{what} {n}: shards do not cover the table"
        assert not torch.equal(got[n], _full_init(n, ROWS[n], DIM)), f"{what} {n} did not train"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{what} {n}: {m}")


@pytest.mark.parametrize("only", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_one_process_each_sharding_type_matches_formula(tmp_path, only):
    steps = 3
    _spawn(1, tmp_path, steps, only=only)
    _check(_assemble(tmp_path, 1, "final", ROWS, {n: DIM for n in ALL}), _reference(_batches(steps)), only)


def test_two_processes_every_sharding_type_matches_formula_and_resumes(tmp_path):
    """One EC with table-wise, row-wise (one a 3-row table), column-wise (two ranks, and two shards
    on one rank) and data-parallel CowClip tables, beside a CowClip EBC table; 2 gloo ranks with
    half of each global batch; a DCP checkpoint at step 2 restored into a fresh model replays to
    the same weights."""
    steps = 5
    _spawn(2, tmp_path, steps, ckpt_at=2)
    dims = {n: DIM for n in ALL}
    two = _assemble(tmp_path, 2, "final", ROWS, dims)
    _check(two, _reference(_batches(steps)), "2 ranks")
    resumed = _assemble(tmp_path, 2, "resumed", ROWS, dims)
    for n in ALL:
        torch.testing.assert_close(resumed[n], two[n], rtol=0, atol=0, msg=f"resume: {n}")


def test_the_formula_tells_unpooled_from_pooled():
    """The reference above treats EC ids as bags of one: on the same ids and per-id gradients, a
    pooled bag of several ids (the EBC formula) moves the rows differently, so the sharded tests
    could not pass by pooling EC lookups."""
    g = torch.Generator().manual_seed(0)
    w0 = _full_init("x", 10, DIM)
    ids = torch.tensor([1, 1, 2, 3])
    go = torch.randn(4, DIM, generator=g)
    unpooled, pooled = w0.clone(), w0.clone()
    cowclip_adam_step(unpooled, CowClipAdamState.zeros_like(w0), ids, torch.arange(5), go, lr=LR, zeta=ZETA)
    cowclip_adam_step(pooled, CowClipAdamState.zeros_like(w0), ids, torch.tensor([0, 2, 4]), go[[0, 2]], lr=LR, zeta=ZETA)
    assert not torch.allclose(unpooled, pooled)


def test_index_dedup_is_refused_in_one_line():
    from recsys.optim.cowclip.sequence import CowClipEmbeddingCollectionSharder

    with pytest.raises(ValueError, match=r"use_index_dedup=True hides how often an id occurs"):
        CowClipEmbeddingCollectionSharder(use_index_dedup=True)


def test_tagged_ec_without_the_sharder_names_it():
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam
    from sharding.optimizer_state import check_cowclip_sharders

    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=10, feature_names=["s"])], device=torch.device("meta")
    )
    tag_cowclip_adam(ec.parameters())
    for sharders in ([CowClipEmbeddingBagCollectionSharder()], [EmbeddingCollectionSharder()]):
        with pytest.raises(ValueError, match=r"table s of EmbeddingCollection .* add CowClipEmbeddingCollectionSharder"):
            check_cowclip_sharders(ec, sharders)


@pytest.mark.parametrize("scope", ["batch", "all", "catchup"])
def test_unpooled_kernel_matches_formula_for_every_update_scope(scope):
    """The unpooled TBE alone (2 tables, features of different lengths, repeated ids): forward rows
    are the table rows; after 6 steps the tables equal the formula with bags of one (lazy: to
    float32 rounding; the dense scopes against the formula's dense mode: ``all`` to rounding,
    the catch-up within 0.2 lr, its bound in docs/cowclip.md)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    lr, l2 = 0.01, 1e-3
    hp = CowClipHyper(learning_rate=lr, l2=l2, cowclip_zeta=ZETA, update_scope=scope)
    tbe = CowClipAdamTBE([(30, 8), (20, 8)], [0, 1], hp, full_dims=[8, 8], mode="inline", pooling_mode=PoolingMode.NONE)
    tbe.weights.copy_(torch.randn(tbe.weights.numel(), generator=torch.Generator().manual_seed(3)) * 0.05)
    ref = [w.clone() for w in tbe.split_embedding_weights()]
    st = [CowClipAdamState.zeros_like(w) for w in ref]
    dense = {} if scope == "batch" else {"update_scope": "all", "l2_scope": "all"}
    g = torch.Generator().manual_seed(4)
    b = 5
    for _ in range(6):
        lengths = torch.cat([torch.randint(0, 2, (b,), generator=g), torch.randint(1, 5, (b,), generator=g)])
        idx = torch.cat([torch.randint(0, 6, (int(n),), generator=g) for n in lengths])
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        out = tbe(idx, off)
        rows = torch.cat([ref[0][idx[: int(off[b])]], ref[1][idx[int(off[b]) :]]])
        tol = 0.2 * lr if scope == "catchup" else 1e-6
        torch.testing.assert_close(out.detach(), rows, rtol=0, atol=tol)
        target = torch.randn(out.shape, generator=g)
        (out * target).sum().backward()
        for t in range(2):
            lo, hi = int(off[t * b]), int(off[(t + 1) * b])
            cowclip_adam_step(
                ref[t], st[t], idx[lo:hi], torch.arange(hi - lo + 1), target[lo:hi].contiguous(), lr=lr, l2=l2, r=1.0, zeta=ZETA, **dense
            )
    tbe.catch_up_all()
    for w, r_ in zip(tbe.split_embedding_weights(), ref):
        torch.testing.assert_close(w, r_, rtol=0, atol=0.2 * lr if scope == "catchup" else 1e-6)


def test_private_torchrec_attributes_still_exist():
    """The EC sharder mirrors torchrec's sequence create_lookup bodies through these private
    attributes, and restores the tag after torchrec's grouping overwrites it."""
    import inspect

    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.sharding import (
        cw_sequence_sharding,
        dp_sequence_sharding,
        rw_sequence_sharding,
        tw_sequence_sharding,
    )

    for mod, attrs in [
        (tw_sequence_sharding, ["_grouped_embedding_configs", "_pg"]),
        (rw_sequence_sharding, ["_grouped_embedding_configs", "_pg"]),
        (cw_sequence_sharding, ["_grouped_embedding_configs", "_pg"]),
        (dp_sequence_sharding, ["_grouped_embedding_configs", "_env.process_group"]),
    ]:
        src = inspect.getsource(mod)
        body = src[src.index("def create_lookup") :][:1200]
        assert "GroupedEmbeddingsLookup(" in body, mod.__name__
        for a in attrs:
            assert f"self.{a}" in body, (mod.__name__, a)
    init = inspect.getsource(ShardedEmbeddingCollection.__init__)
    assert "self._create_lookups()" in init and "self.create_grouped_sharding_infos(" in init
    assert "lookup = lookup.module" in inspect.getsource(ShardedEmbeddingCollection._initialize_torch_state)
