"""Helpers of the GPU suite: NCCL process groups in spawned workers, one per GPU."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_nccl(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes, rank r on cuda:r, inside an
    NCCL process group; an exception in any worker fails the caller."""
    mp.start_processes(_entry, args=(fn, world, free_port(), args), nprocs=world, start_method="spawn")
