"""A DMP whose plan puts CowClip tables in ``fused_uvm`` (table-wise, row-wise, column-wise; one
with ``uvm_host_mapped``) next to one in ``fused``, trained on the batches of
tests/integration/cowclip/test_cowclip_sharded.py, with a DCP checkpoint restored into a fresh model. Shared by
tests/integration/cowclip/test_cowclip_uvm.py (gloo, CPU: host memory through FBGEMM's CPU allocator) and
tests/gpu/test_cowclip_uvm_cuda.py (NCCL, CUDA: unified memory)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.integration.cowclip import test_cowclip_sharded as cs

STEPS, CKPT_AT = 5, 2
# table -> (sharding type, compute kernel, host-mapped). t_hbm and t_uvm share fused params, so
# torchrec puts them in one group, which the sharder cuts by location.
TABLES = {
    "t_hbm": ("table_wise", "fused", False),
    "t_uvm": ("table_wise", "fused_uvm", False),
    "t_uvm_hm": ("table_wise", "fused_uvm", True),
    "t_uvm_rw": ("row_wise", "fused_uvm", False),
    "t_uvm_cw": ("column_wise", "fused_uvm", False),
}
NAMES = list(TABLES)
ROWS = {n: 40 + i for i, n in enumerate(NAMES)}
DIMS = {n: cs.DIM for n in NAMES}
# what each table's CowClipAdamTBE.location must be
LOCATION = {n: "device" if k == "fused" else ("host_mapped" if hm else "managed") for n, (_, k, hm) in TABLES.items()}


def build(world: int, device: torch.device):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import Adam as TrecAdam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder
    from recsys.optim.cowclip.hyper import CowClipHyper, cowclip_fused_params

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIMS[n], num_embeddings=ROWS[n], feature_names=[n]) for n in NAMES],
        is_weighted=True,
        device=torch.device("meta"),
    )
    hp = CowClipHyper(
        learning_rate=cs.LR, l2=cs.L2, cowclip_r=cs.R, cowclip_zeta=cs.ZETA, update_scope="batch"
    )  # checked against the lazy formula
    for n, (_, _, host_mapped) in TABLES.items():
        kw = cowclip_fused_params(hp) | ({"uvm_host_mapped": True} if host_mapped else {})
        apply_optimizer_in_backward(TrecAdam, [ebc.embedding_bags[n].weight], kw)
    gen = {
        "table_wise": lambda k: table_wise(rank=0, compute_kernel=k),
        "row_wise": lambda k: row_wise(compute_kernel=k),
        "column_wise": lambda k: column_wise(ranks=[0, 0] if world == 1 else [0, 1], compute_kernel=k),
    }
    sharder = CowClipEmbeddingBagCollectionSharder()
    per_param = {n: gen[st](k) for n, (st, k, _) in TABLES.items()}
    mplan = construct_module_sharding_plan(ebc, per_param, local_size=world, world_size=world, device_type=device.type, sharder=sharder)
    return DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), plan=ShardingPlan({"": mplan}), sharders=[sharder], device=device
    )


def placement(dmp) -> dict[str, tuple[str, tuple[bool, ...] | None]]:
    """Table -> (its TBE's location, on CUDA whether weights, momentum1, momentum2 and row_step
    are unified memory (``is_uvm_tensor``; None on CPU, where FBGEMM has no such op))."""
    from recsys.optim.cowclip.sharder import cowclip_tbes

    out = {}
    for tbe in cowclip_tbes(dmp):
        uvm = None
        if tbe.weights.is_cuda:
            uvm = tuple(bool(torch.ops.fbgemm.is_uvm_tensor(getattr(tbe, b))) for b in ("weights", "momentum1", "momentum2", "row_step"))
        for name in tbe.table_names:
            out[name] = (tbe.location, uvm)
    return out


def _pieces(dmp) -> dict[str, list]:
    return {n: [(o, t.cpu()) for o, t in p] for n, p in cs._local_pieces(dmp).items()}


def run(rank: int, world: int, out: str, device: torch.device) -> None:
    """Train STEPS steps (checkpoint before step CKPT_AT), restore the checkpoint into a fresh
    model and replay the rest; save placements and this rank's pieces of every table."""
    import torch.distributed.checkpoint as dcp

    data = cs._batches(NAMES, ROWS, DIMS, STEPS)
    dmp = build(world, device)
    full = {n: cs._full_init(n, ROWS[n], DIMS[n]) for n in NAMES}
    for k, v in dmp.state_dict().items():
        n = k.split(".")[-2]
        for s in v.local_shards():
            r0, c0 = s.metadata.shard_offsets
            s.tensor.copy_(full[n][r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]].to(s.tensor.device))
    ck = Path(out) / "ckpt"
    cols = torch.cumsum(torch.tensor([0] + [DIMS[n] for n in NAMES]), 0).tolist()

    def step(model, i):
        lengths, vals, psw, target = data[i]
        kt = model(cs._split_kjt(NAMES, lengths, vals, psw, rank, world).to(device))
        kt = kt.wait() if hasattr(kt, "wait") else kt
        b = cs.B // world
        local_t = target[rank * b : (rank + 1) * b].to(device)
        pooled = kt.to_dict()
        loss = sum((pooled[n] * local_t[:, cols[j] : cols[j + 1]]).sum() for j, n in enumerate(NAMES)) / b
        loss.backward()
        model.fused_optimizer.step()

    for i in range(STEPS):
        if i == CKPT_AT:
            dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=str(ck))
        step(dmp, i)
    res = {"placement": placement(dmp), "final": _pieces(dmp)}
    dmp2 = build(world, device)
    sd = {"model": dmp2.state_dict(), "optim": dmp2.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=str(ck))
    dmp2.load_state_dict(sd["model"])
    dmp2.fused_optimizer.load_state_dict(sd["optim"])
    for i in range(CKPT_AT, STEPS):
        step(dmp2, i)
    res["placement_resumed"] = placement(dmp2)
    res["resumed"] = _pieces(dmp2)
    torch.save(res, Path(out) / f"r{rank}.pt")


def gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, out, torch.device("cpu"))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (a rare SIGABRT in CI)
    finally:
        dist.destroy_process_group()


def check(out: Path, world: int, uvm: bool, atol: float = 1e-6) -> None:
    """Placements as planned (and, with ``uvm``, all four buffers of a UVM table unified memory,
    none of the HBM table's), the final weights equal to the per-table formula, the resumed
    ones bit-identical to the straight run's."""
    results = [torch.load(out / f"r{r}.pt") for r in range(world)]
    for key in ("placement", "placement_resumed"):
        seen: dict[str, set] = {}
        for d in results:
            for n, p in d[key].items():
                seen.setdefault(n, set()).add(p)
        assert sorted(seen) == sorted(NAMES), (key, seen)
        for n in NAMES:
            want_uvm = (LOCATION[n] != "device",) * 4 if uvm else None
            assert seen[n] == {(LOCATION[n], want_uvm)}, (key, n, seen[n])
    want, _ = cs._reference(NAMES, ROWS, DIMS, {n: True for n in NAMES}, cs._batches(NAMES, ROWS, DIMS, STEPS))
    final: dict[str, torch.Tensor] = {}  # the straight run's tables, which the resumed run must equal
    for key in ("final", "resumed"):
        got = {n: torch.full((ROWS[n], DIMS[n]), float("nan")) for n in NAMES}
        for d in results:
            for n, pieces in d[key].items():
                for (r0, c0), t in pieces:
                    got[n][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
        errors = []  # every table's mismatch in one message (which tables, and by how much, tells why)
        for n in NAMES:
            assert not torch.isnan(got[n]).any(), f"{key} {n}: shards do not cover the table"
            ref, tol = (want[n], dict(rtol=1e-5, atol=atol)) if key == "final" else (final[n], dict(rtol=0, atol=0))
            try:
                torch.testing.assert_close(got[n], ref, **tol)
            except AssertionError as e:
                errors.append(f"{n} ({'vs the formula' if key == 'final' else 'resumed vs straight'}): {e}")
        assert not errors, "\n".join(errors)
        if key == "final":
            final = got
