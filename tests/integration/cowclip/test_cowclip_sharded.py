"""CowClip-Adam inside TorchRec sharding: the sharded kernel against the plain per-table formula
(``recsys.optim.cowclip.reference.cowclip_adam_step``, itself tested against a per-row loop in
tests/unit/recsys/optim/cowclip/test_reference.py), for every sharding type, 1 process vs 2 processes on the same global
batch, the DCP checkpoint round trip of the optimizer state, and the planner's storage count."""

from __future__ import annotations

import math
import zlib
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from recsys.training.distributed import free_port
from tests.support.processes import start_workers

DIM = 16
B = 12  # global batch
LR, L2, R, ZETA = 0.02, 1e-3, 1.0, 0.05  # zeta large enough that the floor is active on small rows

# table -> (rows, sharding spec for a 2-rank plan). All types at once, in one EBC.
TABLES_2 = {
    "t_tw": (40, ("table_wise", 1)),
    "t_rw": (41, ("row_wise", None)),
    "t_rw3": (3, ("row_wise", None)),  # a one-row shard: its per-row state must checkpoint as rows
    "t_cw": (42, ("column_wise", [0, 1])),
    "t_cw1": (43, ("column_wise", [1, 1])),  # two column shards in one kernel on rank 1
    "t_twrw": (44, ("table_row_wise", 0)),
    "t_dp": (45, ("data_parallel", None)),
}
WIDE = "w_tw"  # not clipped (the wide/linear tables of the paper)


def _full_init(name: str, rows: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.rand(rows, dim, generator=g) * 0.2 - 0.1


def _batches(names: list[str], rows: dict[str, int], dims: dict[str, int], steps: int):
    """Global batches: multi-hot bags with repeats inside bags and across samples, psw, empty bags."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(names) * B,), generator=g)
        vals = torch.cat(
            [
                torch.randint(0, min(8, rows[names[i // B]]), (int(n),), generator=g)  # few ids: repeats
                for i, n in enumerate(lengths)
            ]
        )
        psw = torch.rand(vals.numel(), generator=g) + 0.5
        target = torch.randn(B, sum(dims[n] for n in names), generator=g)
        out.append((lengths, vals, psw, target))
    return out


def _split_kjt(names, lengths, vals, psw, rank, world):
    """The rank's B/world samples of a key-major global KJT."""
    from torchrec import KeyedJaggedTensor

    b = B // world
    L = lengths.view(len(names), B)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    vs, ws, ls = [], [], []
    for f in range(len(names)):
        lo = int(offs[f * B + rank * b])
        hi = int(offs[f * B + (rank + 1) * b])
        vs.append(vals[lo:hi])
        ws.append(psw[lo:hi] if psw is not None else None)
        ls.append(L[f, rank * b : (rank + 1) * b])
    return KeyedJaggedTensor(keys=names, values=torch.cat(vs), lengths=torch.cat(ls), weights=torch.cat(ws) if psw is not None else None)


def _reference(names, rows, dims, clip, steps_data, pooling: str = "sum"):
    """Per-table formula on whole tables and the global batch. ``pooling="mean"``: a bag's mean is
    its sum with every id weighted 1/len(bag)."""
    w = {n: _full_init(n, rows[n], dims[n]) for n in names}
    st = {n: CowClipAdamState.zeros_like(w[n]) for n in names}
    for lengths, vals, psw, target in steps_data:
        offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        if pooling == "mean":  # unweighted bags (torchrec's EBC takes no weights with MEAN)
            psw = 1.0 / lengths.clamp(min=1).float().repeat_interleave(lengths)
        d0 = 0
        for f, n in enumerate(names):
            lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
            go = target[:, d0 : d0 + dims[n]] / B  # d(mean over the batch of <pooled, target>)
            d0 += dims[n]
            cowclip_adam_step(
                w[n],
                st[n],
                vals[lo:hi],
                offs[f * B : (f + 1) * B + 1] - lo,
                go.contiguous(),
                psw[lo:hi],
                lr=LR,
                l2=L2,
                r=R,
                zeta=ZETA,
                clip=clip[n],
            )
    return w, st


def _plan_specs(world: int, only: str | None):
    if world == 1:
        kind = only or "table_wise"
        arg = {"table_wise": 0, "table_row_wise": 0, "column_wise": [0, 0]}.get(kind)
        # the wide table (dim 4) cannot be split in two column shards of >= 4 columns
        return {n: (kind, arg) for n in TABLES_2} | {WIDE: ("table_wise", 0) if kind == "column_wise" else (kind, arg)}
    specs = {n: spec for n, (_, spec) in TABLES_2.items()}
    specs[WIDE] = ("table_wise", 0)
    return specs


def _worker(rank: int, world: int, port: int, out: str, steps: int, only: str | None, ckpt_at: int, pooling: str = "sum") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, out, steps, only, ckpt_at, pooling)
    finally:
        dist.destroy_process_group()


def _build(world, specs, names, rows, dims, pooling: str = "sum"):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam

    tables = [
        EmbeddingBagConfig(
            name=n,
            embedding_dim=dims[n],
            num_embeddings=rows[n],
            feature_names=[n],
            pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
        )
        for n in names
    ]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=pooling != "mean", device=torch.device("meta"))
    for n in names:
        tag_cowclip_adam(
            [ebc.embedding_bags[n].weight], lr=LR, l2=L2, cowclip_r=R, cowclip_zeta=ZETA, cowclip=n != WIDE, update_scope="batch"
        )  # the lazy formula (the catch-up: test_cowclip_catchup.py)
    sharder = CowClipEmbeddingBagCollectionSharder()
    gen = {
        "table_wise": lambda a: table_wise(rank=a),
        "row_wise": lambda a: row_wise(),
        "column_wise": lambda a: column_wise(ranks=a),
        "table_row_wise": lambda a: table_row_wise(host_index=a),
        "data_parallel": lambda a: data_parallel(),
    }
    per_param = {n: gen[specs[n][0]](specs[n][1]) for n in names}
    mplan = construct_module_sharding_plan(ebc, per_param, local_size=world, world_size=world, device_type="cpu", sharder=sharder)
    dmp = DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=ShardingPlan({"": mplan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    return dmp


def _load_full(dmp, full: dict[str, torch.Tensor]) -> None:
    for k, v in dmp.state_dict().items():
        n = k.split(".")[-2]
        if hasattr(v, "local_shards"):
            for s in v.local_shards():
                r0, c0 = s.metadata.shard_offsets
                s.tensor.copy_(full[n][r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]])
        else:
            v.copy_(full[n])


def _local_pieces(dmp) -> dict[str, list]:
    out: dict[str, list] = {}
    for k, v in dmp.state_dict().items():
        n = k.split(".")[-2]
        if hasattr(v, "local_shards"):
            out[n] = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in v.local_shards()]
        else:
            out[n] = [((0, 0), v.clone())]
    return out


def _run(rank, world, out, steps, only, ckpt_at, pooling="sum"):
    import torch.distributed.checkpoint as dcp

    names = list(TABLES_2) + [WIDE]
    rows = {n: r for n, (r, _) in TABLES_2.items()} | {WIDE: 30}
    dims = {n: DIM for n in names} | {WIDE: 4}
    specs = _plan_specs(world, only)
    data = _batches(names, rows, dims, steps)
    dmp = _build(world, specs, names, rows, dims, pooling)
    _load_full(dmp, {n: _full_init(n, rows[n], dims[n]) for n in names})
    opt = dmp.fused_optimizer
    ck = Path(out) / "ckpt"

    def step(i):
        lengths, vals, psw, target = data[i]
        kjt = _split_kjt(names, lengths, vals, psw if pooling != "mean" else None, rank, world)
        kt = dmp(kjt)
        kt = kt.wait() if hasattr(kt, "wait") else kt
        b = B // world
        local_t = target[rank * b : (rank + 1) * b]
        # by key: a sharded EBC orders its output keys by sharding type
        pooled = kt.to_dict()
        cols = torch.cumsum(torch.tensor([0] + [dims[n] for n in names]), 0).tolist()
        loss = sum((pooled[n] * local_t[:, cols[i] : cols[i + 1]]).sum() for i, n in enumerate(names)) / b
        # (this rank's mean; DMP averages gradients over ranks)
        loss.backward()
        opt.step()

    for i in range(steps):
        if ckpt_at and i == ckpt_at:
            dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(ck))
        step(i)
    torch.save(_local_pieces(dmp), Path(out) / f"final_r{rank}.pt")
    if ckpt_at:
        # a fresh model with other weights, restored from the checkpoint, replays the remaining steps
        dmp2 = _build(world, specs, names, rows, dims, pooling)
        sd = {"model": dmp2.state_dict(), "optim": dmp2.fused_optimizer.state_dict()}
        dcp.load(sd, checkpoint_id=str(ck))
        dmp2.load_state_dict(sd["model"])
        dmp2.fused_optimizer.load_state_dict(sd["optim"])
        dmp, opt = dmp2, dmp2.fused_optimizer
        for i in range(ckpt_at, steps):
            step(i)
        torch.save(_local_pieces(dmp), Path(out) / f"resumed_r{rank}.pt")


def _assemble(out: Path, world: int, prefix: str, rows, dims) -> dict[str, torch.Tensor]:
    full = {n: torch.full((rows[n], dims[n]), float("nan")) for n in rows}
    for r in range(world):
        for n, pieces in torch.load(out / f"{prefix}_r{r}.pt").items():
            for (r0, c0), t in pieces:
                full[n][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
    return full


def _spawn(world: int, tmp: Path, steps: int, only: str | None = None, ckpt_at: int = 0, pooling: str = "sum") -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    start_workers(_worker, (world, free_port(), str(tmp), steps, only, ckpt_at, pooling), world)


def _expected(steps, pooling: str = "sum"):
    names = list(TABLES_2) + [WIDE]
    rows = {n: r for n, (r, _) in TABLES_2.items()} | {WIDE: 30}
    dims = {n: DIM for n in names} | {WIDE: 4}
    clip = {n: n != WIDE for n in names}
    w, _ = _reference(names, rows, dims, clip, _batches(names, rows, dims, steps), pooling)
    return w, rows, dims


def test_private_torchrec_attributes_still_exist():
    """The sharder mirrors torchrec's create_lookup bodies through these private attributes."""
    import inspect

    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding import cw_sharding, dp_sharding, rw_sharding, tw_sharding, twrw_sharding

    for mod, attrs in [
        (tw_sharding, ["_grouped_embedding_configs", "_pg"]),
        (rw_sharding, ["_grouped_embedding_configs", "_pg"]),
        (cw_sharding, ["_grouped_embedding_configs", "_pg"]),
        (twrw_sharding, ["_grouped_embedding_configs_per_rank[self._rank]", "_pg"]),
        (dp_sharding, ["_grouped_embedding_configs", "_env.process_group"]),
    ]:
        src = inspect.getsource(mod)
        body = src[src.index("def create_lookup") :][:1200]
        for a in attrs:
            assert f"self.{a}" in body, (mod.__name__, a)
    assert hasattr(ShardedEmbeddingBagCollection, "_create_lookups")
    assert "lookup = lookup.module" in inspect.getsource(ShardedEmbeddingBagCollection._initialize_torch_state)
    # where data-parallel lookups get their DDP wrap (sharding/compat.py SEBC_WRAPS_DP_IN_INIT)
    from sharding.compat import SEBC_WRAPS_DP_IN_INIT

    init_src = inspect.getsource(ShardedEmbeddingBagCollection.__init__)
    if SEBC_WRAPS_DP_IN_INIT:
        assert "DistributedDataParallel(" in init_src and not hasattr(ShardedEmbeddingBagCollection, "init_data_parallel")
    else:
        assert "self.init_data_parallel()" in init_src
        assert "DistributedDataParallel(" in inspect.getsource(ShardedEmbeddingBagCollection.init_data_parallel)


@pytest.mark.parametrize("only", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_one_process_each_sharding_type_matches_formula(tmp_path, only):
    steps = 3
    _spawn(1, tmp_path, steps, only=only)
    want, rows, dims = _expected(steps)
    got = _assemble(tmp_path, 1, "final", rows, dims)
    for n in want:
        init = _full_init(n, rows[n], dims[n])
        assert not torch.equal(got[n], init), f"{n} did not train"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{only}: table {n}")


def test_two_processes_all_sharding_types_match_one_process_and_resume(tmp_path):
    """One EBC with TW, RW, CW (two ranks, and two shards on one rank), TWRW and DP CowClip tables
    plus an unclipped wide table, 2 gloo ranks with half of each global batch; DCP checkpoint at
    step 2 restored into a fresh model replays to the same weights."""
    steps = 5
    _spawn(2, tmp_path / "two", steps, ckpt_at=2)
    _spawn(1, tmp_path / "one", steps)
    want, rows, dims = _expected(steps)
    two = _assemble(tmp_path / "two", 2, "final", rows, dims)
    one = _assemble(tmp_path / "one", 1, "final", rows, dims)
    resumed = _assemble(tmp_path / "two", 2, "resumed", rows, dims)
    for n in want:
        assert not torch.isnan(two[n]).any(), f"{n}: shards do not cover the table"
        torch.testing.assert_close(two[n], want[n], rtol=1e-5, atol=1e-6, msg=f"2 ranks vs formula: {n}")
        torch.testing.assert_close(two[n], one[n], rtol=1e-5, atol=1e-6, msg=f"2 ranks vs 1 rank: {n}")
        torch.testing.assert_close(resumed[n], two[n], rtol=0, atol=0, msg=f"resume: {n}")


@pytest.mark.parametrize("only", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_mean_pooling_each_sharding_type_matches_formula(tmp_path, only):
    """MEAN tables (bags of 0-3 ids, repeats): table-wise, column-wise and data-parallel kernels
    pool MEAN themselves, torchrec pools row-wise shards by SUM and divides after the exchange;
    every table ends at the formula with weights 1/len(bag). One sharding type per EBC: torchrec
    itself mis-pools a table-wise MEAN table that shares its EBC with a row-wise MEAN one (it
    divides it twice; seen with its own sharder and SGD), which is not ours to test."""
    steps = 3
    _spawn(1, tmp_path, steps, only=only, pooling="mean")
    want, rows, dims = _expected(steps, pooling="mean")
    sums, _, _ = _expected(steps)
    got = _assemble(tmp_path, 1, "final", rows, dims)
    for n in want:
        assert not torch.isnan(got[n]).any(), f"{n}: shards do not cover the table"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"MEAN {only} {n}: {m}")
        assert not torch.allclose(want[n], sums[n]), f"{n}: MEAN and SUM give the same weights: the test cannot tell"


def test_planner_counts_adam_state_for_cowclip_tables():
    """Storage estimate = weights + 2 Adam moments (3x the weight bytes), vs 1x for plain SGD tags."""
    import torch.optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam

    def storage(tag) -> int:
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=100_000, feature_names=["f"])],
            device=torch.device("meta"),
        )
        tag(ebc.parameters())
        opts = EmbeddingEnumerator(Topology(world_size=1, compute_device="cuda"), batch_size=512).enumerate(
            ebc, [CowClipEmbeddingBagCollectionSharder()]
        )
        tw = [o for o in opts if o.sharding_type == "table_wise" and o.compute_kernel == "fused"][0]
        return tw.total_storage.hbm

    weight_bytes = 100_000 * 64 * 4
    cow = storage(lambda ps: tag_cowclip_adam(ps, lr=1e-3))
    sgd = storage(lambda ps: apply_optimizer_in_backward(torch.optim.SGD, list(ps), {"lr": 0.1}))
    assert cow - sgd == 2 * weight_bytes
    assert math.isclose(cow / weight_bytes, 3.0, rel_tol=0.01)


def _fbgemm_tbe(**kw):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        eps=1e-8,
        **kw,
    )
    tbe.split_embedding_weights()[0].copy_(torch.randn(10, 8, generator=torch.Generator().manual_seed(0)) * 0.01)
    return tbe


def test_fbgemm_native_cowclip_is_clip_by_lifetime_count_then_rowwise_adagrad():
    """optim.embedding=fbgemm_cowclip: FBGEMM's COWCLIP mode, checked against its documented math
    on a first step (lifetime count c = 1): g' = g * min(1, c*max(coef*||w||, lb) / ||g||), and the
    row-wise Adagrad accumulator sees the *unclipped* g, so ||dw|| = lr * ||g'|| / sqrt(mean(g^2))."""
    from sharding.compat import fbgemm_cowclip_types

    CounterWeightDecayMode, CowClipDefinition, WeightDecayMode = fbgemm_cowclip_types()

    def cow(lb):
        return dict(
            weight_decay_mode=WeightDecayMode.COWCLIP,
            cowclip_regularization=CowClipDefinition(
                counter_weight_decay_mode=CounterWeightDecayMode.NONE, counter_halflife=-1, weight_norm_coefficient=1.0, lower_bound=lb
            ),
        )

    idx, off = torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2, 4])
    go = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    g = {1: go[0], 2: go[0] + go[1], 3: go[1]}  # row 2 is in both bags
    steps = {}
    for name, kw in [("plain", {}), ("no_clip", cow(1e9)), ("clip", cow(0.0))]:
        tbe = _fbgemm_tbe(**kw)
        w0 = tbe.split_embedding_weights()[0].clone()
        tbe(idx, off).backward(go)
        steps[name] = tbe.split_embedding_weights()[0] - w0
        if name != "plain":
            assert {"prev_iter", "row_counter"} <= set(tbe.get_optimizer_state()[0])
    torch.testing.assert_close(steps["no_clip"], steps["plain"])  # clip bound never reached: plain Adagrad
    for k, gk in g.items():
        wk = _fbgemm_tbe().split_embedding_weights()[0][k]
        clip = 1.0 * max(float(wk.norm()), 0.0)
        want = 0.1 * min(float(gk.norm()), clip) / math.sqrt(float((gk * gk).mean()))
        assert math.isclose(float(steps["clip"][k].norm()), want, rel_tol=1e-3), (k, want)
        assert float(steps["clip"][k].norm()) < float(steps["plain"][k].norm())
    assert float(steps["clip"][0].abs().sum()) == 0.0  # rows not in the batch untouched


def test_all_rows_scope_equals_the_dense_reference():
    """embedding_l2_scope=all (the TF reference's dense L2 + Adam on every row) in the kernel's
    in-place form equals the reference formula's dense mode over several steps."""
    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    hp = CowClipHyper(learning_rate=0.01, l2=0.05, cowclip_r=1.0, cowclip_zeta=0.05, update_scope="all")
    tbe = CowClipAdamTBE([(30, 8), (20, 8)], [0, 1], hp, full_dims=[8, 8], mode="inline")
    tbe.weights.copy_(torch.randn(tbe.weights.numel(), generator=torch.Generator().manual_seed(3)) * 0.05)
    ref = [w.clone() for w in tbe.split_embedding_weights()]
    st = [CowClipAdamState.zeros_like(w) for w in ref]
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        lengths = torch.randint(0, 3, (2 * 6,), generator=g)
        idx = torch.cat([torch.randint(0, 20, (int(n),), generator=g) for n in lengths])
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        go = torch.randn(6, 16, generator=g)
        tbe.backward_update_all_rows(go, idx, off, None)
        for t in range(2):
            lo, hi = int(off[t * 6]), int(off[(t + 1) * 6])
            cowclip_adam_step(
                ref[t],
                st[t],
                idx[lo:hi],
                off[t * 6 : (t + 1) * 6 + 1] - lo,
                go[:, 8 * t : 8 * t + 8],
                lr=0.01,
                l2=0.05,
                r=1.0,
                zeta=0.05,
                update_scope="all",
                l2_scope="all",
            )
    for w, r_ in zip(tbe.split_embedding_weights(), ref):
        torch.testing.assert_close(w, r_, rtol=1e-5, atol=1e-6)  # float32 rounding of two formulations
    assert tbe.row_step.eq(4).all()
