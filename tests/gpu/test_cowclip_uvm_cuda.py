"""CowClip tables in host memory on a GPU, the round trip: a DMP over NCCL whose plan puts
CowClip tables in ``fused_uvm`` (table-wise, row-wise, column-wise; one with
``uvm_host_mapped``) next to one in ``fused`` (HBM). Checks that weights, both moments and
``row_step`` of the UVM tables are unified memory and those of the HBM table are not, that
training matches the per-table formula on CPU (``cowclip_adam_step``, as in
tests/test_cowclip_sharded.py), and that a DCP checkpoint restored into a fresh model (whose
state is UVM again) replays the remaining steps to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_util import spawn_nccl

STEPS, CKPT_AT = 5, 2
# table -> (sharding type, compute kernel, host-mapped)
TABLES = {
    "t_hbm": ("table_wise", "fused", False),
    "t_uvm": ("table_wise", "fused_uvm", False),
    "t_uvm_hm": ("table_wise", "fused_uvm", True),
    "t_uvm_rw": ("row_wise", "fused_uvm", False),
    "t_uvm_cw": ("column_wise", "fused_uvm", False),
}
NAMES = list(TABLES)


def _shapes():
    from tests import test_cowclip_sharded as cs  # the repository root is on the path (pyproject: pythonpath)

    rows = {n: 40 + i for i, n in enumerate(NAMES)}
    dims = {n: cs.DIM for n in NAMES}
    return cs, rows, dims


def _build(world: int, dev: torch.device):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim import Adam as TrecAdam

    from recsys.optim.cowclip_sharder import CowClipEmbeddingBagCollectionSharder
    from recsys.optim.cowclip_tbe import CowClipHyper, cowclip_fused_params

    cs, rows, dims = _shapes()
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=dims[n], num_embeddings=rows[n], feature_names=[n]) for n in NAMES],
        is_weighted=True, device=torch.device("meta"))
    hp = CowClipHyper(learning_rate=cs.LR, l2=cs.L2, cowclip_r=cs.R, cowclip_zeta=cs.ZETA)
    for n, (_, _, host_mapped) in TABLES.items():
        kw = cowclip_fused_params(hp) | ({"uvm_host_mapped": True} if host_mapped else {})
        apply_optimizer_in_backward(TrecAdam, [ebc.embedding_bags[n].weight], kw)
    gen = {"table_wise": lambda k: table_wise(rank=0, compute_kernel=k),
           "row_wise": lambda k: row_wise(compute_kernel=k),
           "column_wise": lambda k: column_wise(ranks=list(range(world)) * (2 // world), compute_kernel=k)}
    sharder = CowClipEmbeddingBagCollectionSharder()
    per_param = {n: gen[st](k) for n, (st, k, _) in TABLES.items()}
    mplan = construct_module_sharding_plan(ebc, per_param, local_size=world, world_size=world, device_type="cuda",
                                           sharder=sharder)
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                    plan=ShardingPlan({"": mplan}), sharders=[sharder], device=dev)


def _placement(dmp) -> dict[str, tuple[str, tuple[bool, ...]]]:
    """Table -> (the TBE's location, is_uvm_tensor of weights, momentum1, momentum2, row_step)."""
    from recsys.optim.cowclip_sharder import cowclip_tbes

    out = {}
    for tbe in cowclip_tbes(dmp):
        uvm = tuple(bool(torch.ops.fbgemm.is_uvm_tensor(getattr(tbe, b)))
                    for b in ("weights", "momentum1", "momentum2", "row_step"))
        for name in tbe.table_names:
            out[name] = (tbe.location, uvm)
    return out


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    cs, rows, dims = _shapes()
    dev = torch.device("cuda", rank)
    data = cs._batches(NAMES, rows, dims, STEPS)
    dmp = _build(world, dev)
    full = {n: cs._full_init(n, rows[n], dims[n]) for n in NAMES}
    for k, v in dmp.state_dict().items():
        n = k.split(".")[-2]
        for s in v.local_shards():
            r0, c0 = s.metadata.shard_offsets
            s.tensor.copy_(full[n][r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]].to(s.tensor.device))
    ck = Path(out) / "ckpt"

    def step(model, i):
        lengths, vals, psw, target = data[i]
        kt = model(cs._split_kjt(NAMES, lengths, vals, psw, rank, world).to(dev))
        kt = kt.wait() if hasattr(kt, "wait") else kt
        b = cs.B // world
        local_t = target[rank * b : (rank + 1) * b].to(dev)
        pooled = kt.to_dict()
        cols = torch.cumsum(torch.tensor([0] + [dims[n] for n in NAMES]), 0).tolist()
        loss = sum((pooled[n] * local_t[:, cols[j] : cols[j + 1]]).sum() for j, n in enumerate(NAMES)) / b
        loss.backward()
        model.fused_optimizer.step()

    for i in range(STEPS):
        if i == CKPT_AT:
            dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=str(ck))
        step(dmp, i)
    res = {"placement": _placement(dmp), "final": cs._local_pieces(dmp)}
    dmp2 = _build(world, dev)
    sd = {"model": dmp2.state_dict(), "optim": dmp2.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=str(ck))
    dmp2.load_state_dict(sd["model"])
    dmp2.fused_optimizer.load_state_dict(sd["optim"])
    for i in range(CKPT_AT, STEPS):
        step(dmp2, i)
    res["placement_resumed"] = _placement(dmp2)
    res["resumed"] = cs._local_pieces(dmp2)
    torch.save({k: ({n: [(o, t.cpu()) for o, t in p] for n, p in v.items()} if k in ("final", "resumed") else v)
                for k, v in res.items()}, Path(out) / f"r{rank}.pt")


def _assemble(tmp: Path, world: int, key: str, rows, dims) -> dict[str, torch.Tensor]:
    full = {n: torch.full((rows[n], dims[n]), float("nan")) for n in NAMES}
    for r in range(world):
        for n, pieces in torch.load(tmp / f"r{r}.pt")[key].items():
            for (r0, c0), t in pieces:
                full[n][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
    return full


@pytest.mark.parametrize("world", [1, 2])
def test_cowclip_uvm_tables_train_checkpoint_and_resume(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    spawn_nccl(_worker, world, str(tmp_path))
    cs, rows, dims = _shapes()
    placement: dict = {}
    for r in range(world):
        d = torch.load(tmp_path / f"r{r}.pt")
        for key in ("placement", "placement_resumed"):
            for n, p in d[key].items():
                placement.setdefault((key, n), set()).add(p)
    for key in ("placement", "placement_resumed"):
        assert placement[(key, "t_hbm")] == {("device", (False,) * 4)}, key
        assert placement[(key, "t_uvm_hm")] == {("host_mapped", (True,) * 4)}, key
        for n in ("t_uvm", "t_uvm_rw", "t_uvm_cw"):
            assert placement[(key, n)] == {("managed", (True,) * 4)}, (key, n)
    clip = {n: True for n in NAMES}
    want, _ = cs._reference(NAMES, rows, dims, clip, cs._batches(NAMES, rows, dims, STEPS))
    got = _assemble(tmp_path, world, "final", rows, dims)
    resumed = _assemble(tmp_path, world, "resumed", rows, dims)
    for n in NAMES:
        assert not torch.isnan(got[n]).any(), f"{n}: shards do not cover the table"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{n} vs the formula")
        torch.testing.assert_close(resumed[n], got[n], rtol=0, atol=0, msg=f"{n}: resumed vs straight")
