"""NCCL process groups on the GPUs of this machine: world 1, and 2 where there are 2 GPUs. The
collectives the training job relies on (all-reduce of dense gradients, all-to-all of the
embedding dists, broadcast of initial weights, all-gather of metrics) against values computed
here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_util import spawn_nccl


def _collectives(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    assert dist.get_backend() == "nccl"
    x = torch.arange(6, dtype=torch.float32, device=dev) + 10 * rank
    dist.all_reduce(x)
    # all-to-all: rank r sends [100*r + 10*j, 100*r + 10*j + 1] to rank j
    send = torch.cat([torch.tensor([100 * rank + 10 * j, 100 * rank + 10 * j + 1], device=dev) for j in range(world)]).float()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    b = torch.full((3,), float(rank + 7), device=dev)
    dist.broadcast(b, src=0)
    g = torch.empty(world * 2, device=dev)
    dist.all_gather_into_tensor(g, torch.tensor([rank, rank * rank], dtype=torch.float32, device=dev))
    torch.save({"all_reduce": x.cpu(), "all_to_all": recv.cpu(), "broadcast": b.cpu(), "all_gather": g.cpu()}, Path(out) / f"r{rank}.pt")


@pytest.mark.parametrize("world", [1, 2])
def test_nccl_collectives(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    spawn_nccl(_collectives, world, str(tmp_path))
    for r in range(world):
        got = torch.load(tmp_path / f"r{r}.pt")
        assert torch.equal(got["all_reduce"], sum(torch.arange(6.0) + 10 * k for k in range(world)))
        assert torch.equal(
            got["all_to_all"], torch.tensor([v for j in range(world) for v in (100 * j + 10 * r, 100 * j + 10 * r + 1)]).float()
        )
        assert torch.equal(got["broadcast"], torch.full((3,), 7.0))
        assert torch.equal(got["all_gather"], torch.tensor([v for k in range(world) for v in (k, k * k)]).float())
