"""FBGEMM's CUDA TBE through DistributedModelParallel over NCCL: one table each with the fused
(HBM), fused_uvm (host memory) and fused_uvm_caching (host memory + HBM cache of hot rows)
kernels, table-wise and row-wise, trained with FBGEMM's exact SGD and read back by a forward pass
(so the caching kernel answers from its cache) against plain SGD on ``F.embedding_bag`` on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_util import spawn_nccl

ROWS, DIM, B, STEPS, LR = 300, 16, 64, 5, 0.1
# table -> (sharding type, compute kernel); the caching table's cache holds 20% of its rows and
# the batches touch far more, so rows are evicted and refetched during training
TABLES = {
    "t_fused": ("table_wise", "fused"),
    "t_uvm": ("table_wise", "fused_uvm"),
    "t_cache": ("table_wise", "fused_uvm_caching"),
    "t_uvm_rw": ("row_wise", "fused_uvm"),
    "t_cache_rw": ("row_wise", "fused_uvm_caching"),
}
NAMES = list(TABLES)


def _init(i: int) -> torch.Tensor:
    return torch.rand(ROWS, DIM, generator=torch.Generator().manual_seed(100 + i)) * 0.2 - 0.1


def _batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 5, (len(NAMES), B), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        target = torch.randn(B, len(NAMES) * DIM, generator=g)
        out.append((lengths, ids, target))
    return out


def _reference() -> dict[str, torch.Tensor]:
    w = {n: _init(i).requires_grad_() for i, n in enumerate(NAMES)}
    for lengths, ids, target in _batches():
        offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
        loss = 0
        for f, n in enumerate(NAMES):
            lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
            pooled = F.embedding_bag(ids[lo:hi], w[n], offs[f * B : (f + 1) * B] - lo, mode="sum")
            loss = loss + (pooled * target[:, f * DIM : (f + 1) * DIM]).sum() / B
        loss.backward()
        with torch.no_grad():
            for t in w.values():
                t -= LR * t.grad
                t.grad = None
    return {n: t.detach() for n, t in w.items()}


def _local_kjt(lengths, ids, rank, world, dev):
    from torchrec import KeyedJaggedTensor

    b = lengths.shape[1] // world
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
    vals, lens = [], []
    for f in range(len(NAMES)):
        lo = int(offs[f * lengths.shape[1] + rank * b])
        hi = int(offs[f * lengths.shape[1] + (rank + 1) * b])
        vals.append(ids[lo:hi])
        lens.append(lengths[f, rank * b : (rank + 1) * b])
    return KeyedJaggedTensor(keys=NAMES, values=torch.cat(vals), lengths=torch.cat(lens)).to(dev)


def _train(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    dev = torch.device("cuda", rank)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[n]) for n in NAMES],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(torch.optim.SGD, list(ebc.parameters()), {"lr": LR})
    gen = {"table_wise": lambda i, k: table_wise(rank=i % world, compute_kernel=k), "row_wise": lambda i, k: row_wise(compute_kernel=k)}
    per_param = {n: gen[st](i, k) for i, (n, (st, k)) in enumerate(TABLES.items())}
    sharder = EmbeddingBagCollectionSharder()
    mplan = construct_module_sharding_plan(ebc, per_param, local_size=world, world_size=world, device_type="cuda", sharder=sharder)
    dmp = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), plan=ShardingPlan({"": mplan}), sharders=[sharder], device=dev
    )
    # the initial weights, through the sharded state dict (every rank loads its pieces)
    full = {n: _init(i) for i, n in enumerate(NAMES)}
    for k, v in dmp.state_dict().items():
        n = k.split(".")[-2]
        for s in v.local_shards():
            r0, c0 = s.metadata.shard_offsets
            s.tensor.copy_(full[n][r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]].to(s.tensor.device))
    # where FBGEMM put each table: HBM, UVM, UVM + cache. One TBE may hold tables of several
    # kernels (torchrec groups them; each table keeps its own EmbeddingLocation), so the table's
    # own location is read, and the TBE's UVM buffer / cache checked where the location needs one.
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    kinds: dict[str, tuple[bool, bool]] = {}
    lookups = [lk for mod in dmp.modules() for lk in (getattr(mod, "_lookups", None) or [])]
    for lk in lookups:
        for m in getattr(getattr(lk, "module", lk), "_emb_modules", []):
            tbe = m._emb_module
            for i, t in enumerate(m._config.embedding_tables):
                loc = EmbeddingLocation(tbe.embedding_specs[i][2])
                managed = loc in (EmbeddingLocation.MANAGED, EmbeddingLocation.MANAGED_CACHING)
                uvm = managed and tbe.weights_uvm.numel() > 0 and bool(torch.ops.fbgemm.is_uvm_tensor(tbe.weights_uvm))
                cached = loc == EmbeddingLocation.MANAGED_CACHING and tbe.lxu_cache_weights.numel() > 0
                kinds[t.name] = (uvm, cached)
    for lengths, ids, target in _batches():
        kt = dmp(_local_kjt(lengths, ids, rank, world, dev))
        kt = kt.wait() if hasattr(kt, "wait") else kt
        b = B // world
        local_t = target[rank * b : (rank + 1) * b].to(dev)
        pooled = kt.to_dict()
        loss = sum((pooled[n] * local_t[:, f * DIM : (f + 1) * DIM]).sum() for f, n in enumerate(NAMES)) / b
        loss.backward()
    # read the tables back with a forward: bag i of this rank = [row i]
    rows = torch.arange(rank * ROWS // world, (rank + 1) * ROWS // world)
    lengths = torch.ones(len(NAMES), ROWS, dtype=torch.long)
    ids = torch.arange(ROWS).repeat(len(NAMES))
    with torch.no_grad():
        kt = dmp(_local_kjt(lengths, ids, rank, world, dev))
        kt = kt.wait() if hasattr(kt, "wait") else kt
    torch.save({"rows": rows, "tables": {n: t.cpu() for n, t in kt.to_dict().items()}, "kinds": kinds}, Path(out) / f"r{rank}.pt")


@pytest.mark.parametrize("world", [1, 2])
def test_fused_uvm_and_uvm_caching_tables_train_like_sgd(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    spawn_nccl(_train, world, str(tmp_path))
    want = _reference()
    got = {n: torch.full((ROWS, DIM), float("nan")) for n in NAMES}
    kinds: dict[str, tuple[bool, bool]] = {}
    for r in range(world):
        d = torch.load(tmp_path / f"r{r}.pt")
        for n in NAMES:
            got[n][d["rows"]] = d["tables"][n]
        kinds.update(d["kinds"])
    assert kinds["t_fused"] == (False, False), kinds
    assert kinds["t_uvm"] == (True, False) and kinds["t_uvm_rw"] == (True, False)
    assert kinds["t_cache"] == (True, True) and kinds["t_cache_rw"] == (True, True)
    for i, n in enumerate(NAMES):
        assert not torch.allclose(got[n], _init(i)), f"{n} did not train"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n} ({TABLES[n]}): {m}")
