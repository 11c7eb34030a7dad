"""Process-group set-up: one place that knows ranks, devices and backends."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recsys.config import TrainConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type(cfg: TrainConfig) -> str:
    """ "cuda" or "cpu": what `train.device` (auto: CUDA when visible) selects; the launcher checks
    a topology against it before any worker starts."""
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"


def resolve_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if device_type(cfg) == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def local_tensors(value: object) -> list[torch.Tensor]:
    """The tensors this rank holds for a parameter / state value: a ShardedTensor's local shards,
    a DTensor's local part, or the tensor itself ([] for anything else)."""
    if hasattr(value, "local_shards"):  # ShardedTensor
        return [s.tensor for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):  # DTensor
            return [value.to_local()]
        return [value]
    return []


def init_distributed(cfg: TrainConfig) -> DistEnv:
    """Joins the torchrun process group (gloo on CPU, NCCL on CUDA); a plain `python` run
    becomes a world of one, so the same code path serves tests and single-process debugging."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    device = resolve_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device, backend)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor of host values (a loss, a count, a flag) must live for a collective on
    ``group``: NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"),
    gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_across_ranks(value: float) -> float:
    """The mean of a host value over all ranks of the default group (collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous on 127.0.0.1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
