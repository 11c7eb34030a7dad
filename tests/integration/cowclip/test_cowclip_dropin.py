"""CowClip-Adam as a drop-in inside a stock TorchRec training loop.

A stock ``torchrec.models.dlrm.DLRM`` (through ``DLRMTrain``), sharded by
``DistributedModelParallel`` with ``CowClipEmbeddingBagCollectionSharder``, one CowClip table per
sharding type (TW, RW, TWRW, CW, TWCW, DP), trained on 2 gloo ranks by ``TrainPipelineSparseDist``
handed ONLY the dense optimizer, as torchrec's ``examples/golden_training/train_dlrm.py`` does:
no ``CombinedOptimizer``, no ``fused_optimizer.step()``. Every table must train, and match the
per-table formula of ``recsys.optim.cowclip.reference`` computed here, in one process, on the global batch
with an unsharded copy of the model (its dense part trained by the same torch Adam).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step
from recsys.training.distributed import free_port
from tests.support.processes import start_workers

WORLD = 2
DIM = 16
B = 16  # global batch; each rank trains on B / WORLD samples
DENSE_IN = 8
STEPS = 4
EMB_LR, L2, R, ZETA = 0.02, 1e-3, 0.005, 0.05  # small r: the clip acts on about a third of the rows
DENSE_LR = 1e-3
# table -> (rows, sharding). TWCW sits on rank 1 only: rank 0 holds no table of that type and
# must still join its exchange.
TABLES = {
    "t_tw": (40, ("table_wise", 1)),
    "t_rw": (41, ("row_wise", None)),
    "t_twrw": (42, ("table_row_wise", 0)),
    "t_cw": (43, ("column_wise", [0, 1])),
    "t_twcw": (44, ("table_column_wise", [1, 1])),
    "t_dp": (45, ("data_parallel", None)),
}
NAMES = list(TABLES)


def _full_init(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.rand(TABLES[name][0], DIM, generator=g) * 0.2 - 0.1


def _global_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(dense [B, DENSE_IN], lengths [F*B] key-major, values, labels [B]): multi-hot bags over few
    ids, so rows repeat inside bags, across samples and across ranks; some bags empty."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        dense = torch.randn(B, DENSE_IN, generator=g)
        lengths = torch.randint(0, 4, (len(NAMES) * B,), generator=g)
        vals = torch.cat([torch.randint(0, 8, (int(n),), generator=g) for n in lengths])
        labels = torch.randint(0, 2, (B,), generator=g).float()
        out.append((dense, lengths, vals, labels))
    return out


def _rank_batch(batch, rank: int):
    """The rank's B / WORLD samples as a torchrec ``Batch``."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    dense, lengths, vals, labels = batch
    b = B // WORLD
    L = lengths.view(len(NAMES), B)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    vs, ls = [], []
    for f in range(len(NAMES)):
        vs.append(vals[int(offs[f * B + rank * b]) : int(offs[f * B + (rank + 1) * b])])
        ls.append(L[f, rank * b : (rank + 1) * b])
    kjt = KeyedJaggedTensor(keys=NAMES, values=torch.cat(vs), lengths=torch.cat(ls))
    return Batch(dense_features=dense[rank * b : (rank + 1) * b], sparse_features=kjt, labels=labels[rank * b : (rank + 1) * b])


def _dlrm(ebc):
    from torchrec.models.dlrm import DLRM, DLRMTrain

    torch.manual_seed(3)  # same dense weights in every process (DDP broadcasts rank 0's anyway)
    return DLRMTrain(
        DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    )


def _configs():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=TABLES[n][0], feature_names=[n]) for n in NAMES]


def _table_column_wise(ranks: list[int]):
    """torchrec has no plan helper for TWCW: its ``column_wise`` generator, with the type renamed
    (TWCW shards are column shards on the ranks of one host)."""
    from torchrec.distributed.sharding_plan import column_wise
    from torchrec.distributed.types import ShardingType

    gen = column_wise(ranks=ranks)
    return lambda *a, **k: dataclasses.replace(gen(*a, **k), sharding_type=ShardingType.TABLE_COLUMN_WISE.value)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _train(rank, Path(out))
    finally:
        dist.destroy_process_group()


def _train(rank: int, out: Path) -> None:
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam, take_update_stats

    ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("meta"))
    model = _dlrm(ebc)
    tag_cowclip_adam(
        model.model.sparse_arch.parameters(), lr=EMB_LR, l2=L2, cowclip_r=R, cowclip_zeta=ZETA, update_scope="batch"
    )  # the lazy formula below
    sharder = CowClipEmbeddingBagCollectionSharder()
    gen = {
        "table_wise": lambda a: table_wise(rank=a),
        "row_wise": lambda a: row_wise(),
        "column_wise": lambda a: column_wise(ranks=a),
        "table_row_wise": lambda a: table_row_wise(host_index=a),
        "table_column_wise": _table_column_wise,
        "data_parallel": lambda a: data_parallel(),
    }
    per_param = {n: gen[kind](arg) for n, (_, (kind, arg)) in TABLES.items()}
    mplan = construct_module_sharding_plan(ebc, per_param, local_size=WORLD, world_size=WORLD, device_type="cpu", sharder=sharder)
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": mplan})
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    got_types = {n: p.sharding_type for n, p in mplan.items()}

    # the same full tables on every process (DP replicas included), through the state dict
    for k, v in dmp.state_dict().items():
        if not k.endswith(".weight") or "embedding_bags" not in k:
            continue
        full = _full_init(k.split(".")[-2])
        for s in v.local_shards() if hasattr(v, "local_shards") else []:
            r0, c0 = s.metadata.shard_offsets
            s.tensor.copy_(full[r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]])
        if not hasattr(v, "local_shards"):
            v.copy_(full)

    # train_dlrm.py, with Adam: the pipeline gets only the optimizer of the non-fused parameters
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=DENSE_LR),
    )
    pipeline = TrainPipelineSparseDist(dmp, dense_opt, torch.device("cpu"))
    it = iter([_rank_batch(b, rank) for b in _global_batches()])
    steps = 0
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        steps += 1
    updated, clipped = take_update_stats(dmp)

    pieces: dict[str, list] = {}
    for k, v in dmp.state_dict().items():
        if not k.endswith(".weight") or "embedding_bags" not in k:
            continue
        n = k.split(".")[-2]
        if hasattr(v, "local_shards"):
            pieces[n] = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in v.local_shards()]
        else:
            pieces[n] = [((0, 0), v.clone())]
    torch.save({"pieces": pieces, "steps": steps, "types": got_types, "updated": updated, "clipped": clipped}, out / f"r{rank}.pt")


def _reference() -> tuple[dict[str, torch.Tensor], int]:
    """One process, global batches: DLRM with a plain EBC; dense part by torch Adam on the batch
    mean loss; each table by ``cowclip_adam_step`` from the gradient of its pooled output."""
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    ebc = EmbeddingBagCollection(tables=_configs())
    model = _dlrm(ebc)
    with torch.no_grad():
        for n in NAMES:
            ebc.embedding_bags[n].weight.copy_(_full_init(n))
            ebc.embedding_bags[n].weight.requires_grad_(False)
    dense = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(dense, lr=DENSE_LR)
    w = {n: ebc.embedding_bags[n].weight.data for n in NAMES}
    st = {n: CowClipAdamState.zeros_like(w[n]) for n in NAMES}
    clipped = 0
    for d, lengths, vals, labels in _global_batches():
        kjt = KeyedJaggedTensor(keys=NAMES, values=vals, lengths=lengths)
        with torch.no_grad():
            kt = ebc(kjt)
        values = kt.values().detach().requires_grad_(True)
        # rerun the model with the pooled output as a leaf: d loss / d pooled, and the dense grads
        handle = ebc.register_forward_hook(
            lambda m, i, o, leaf=values: type(o)(keys=o.keys(), length_per_key=o.length_per_key(), values=leaf)
        )
        opt.zero_grad()
        loss, _ = model(Batch(dense_features=d, sparse_features=kjt, labels=labels))
        loss.backward()
        handle.remove()
        go = values.grad
        opt.step()
        offs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        for f, n in enumerate(NAMES):
            lo, hi = int(offs[f * B]), int(offs[(f + 1) * B])
            stats = cowclip_adam_step(
                w[n],
                st[n],
                vals[lo:hi],
                offs[f * B : (f + 1) * B + 1] - lo,
                go[:, f * DIM : (f + 1) * DIM].contiguous(),
                None,
                lr=EMB_LR,
                l2=L2,
                r=R,
                zeta=ZETA,
            )
            clipped += int(stats.clipped_rows)
    return w, clipped


def test_stock_dlrm_pipeline_with_dense_optimizer_only_trains_every_sharding_type(tmp_path):
    start_workers(_worker, (free_port(), str(tmp_path)), WORLD)
    res = [torch.load(tmp_path / f"r{r}.pt") for r in range(WORLD)]
    assert [r["steps"] for r in res] == [STEPS] * WORLD
    assert res[0]["types"] == {n: kind for n, (_, (kind, _)) in TABLES.items()}
    got = {n: torch.full((TABLES[n][0], DIM), float("nan")) for n in NAMES}
    for r in res:
        for n, pieces in r["pieces"].items():
            for (r0, c0), t in pieces:
                got[n][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
    want, ref_clipped = _reference()
    assert ref_clipped > 0, "the clip never acted: the comparison would not cover it"
    assert sum(r["clipped"] for r in res) > 0
    for n in NAMES:
        assert not torch.isnan(got[n]).any(), f"{n}: shards do not cover the table"
    frozen = [f"{n} ({TABLES[n][1][0]})" for n in NAMES if (got[n] - _full_init(n)).abs().max() < 1e-3]
    assert not frozen, f"tables that did not train: {frozen}"
    for n in NAMES:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=f"{n} ({TABLES[n][1][0]}) vs formula")


def test_forward_after_a_missed_update_raises():
    """A deferred kernel whose staged rows never reached an exchange (here: called outside its
    lookup) refuses the next forward, eval included, instead of reading stale weights."""
    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    tbe = CowClipAdamTBE([(10, 8)], [0], CowClipHyper(), full_dims=[8], mode="deferred")
    tbe.table_names = ["t_cw"]
    before = tbe.weights.clone()
    indices, offsets = torch.tensor([1, 2, 2, 5]), torch.tensor([0, 2, 4])
    tbe(indices, offsets).sum().backward()
    assert len(tbe.staged) == 1 and torch.equal(tbe.weights, before)
    msg = (
        "CowClip-Adam tables ['t_cw']: the previous backward staged rows whose column-wise/data-parallel "
        "update never ran (no exchange after backward); refusing to read stale weights"
    )
    with pytest.raises(RuntimeError) as e:
        tbe(indices, offsets)
    assert str(e.value) == msg
    with torch.no_grad(), pytest.raises(RuntimeError, match="refusing to read stale weights"):
        tbe(indices, offsets)
