"""Ranks, devices and backends: the device `train.device` selects, the tensors a rank holds for
a value (plain, sharded, DTensor), joining a process group (a gloo group of one already up), and
the mean of a host value over the ranks."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import recsys.training.distributed as distributed
from recsys.config import TrainConfig
from recsys.training.distributed import (
    DistEnv,
    collective_device,
    device_type,
    free_port,
    init_distributed,
    local_tensors,
    mean_across_ranks,
    resolve_device,
    shutdown,
)


@pytest.mark.parametrize(
    "device, cuda, want",
    [("cpu", True, "cpu"), ("cuda", False, "cuda"), ("auto", False, "cpu"), ("auto", True, "cuda")],
)
def test_device_type_follows_train_device_and_auto_follows_cuda(monkeypatch, device, cuda, want):
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: cuda)
    assert device_type(TrainConfig(device=device)) == want


def test_resolve_device_puts_each_local_rank_on_its_gpu(monkeypatch):
    assert resolve_device(TrainConfig(device="cpu"), 3) == torch.device("cpu")
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^train.device=cuda but no CUDA device is visible$"):
        resolve_device(TrainConfig(device="cuda"), 0)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    assert resolve_device(TrainConfig(device="auto"), 3) == torch.device("cuda", 3)


def test_local_tensors_of_plain_sharded_and_other_values():
    t = torch.ones(3)
    assert local_tensors(t)[0] is t and len(local_tensors(t)) == 1
    shards = [torch.zeros(2), torch.ones(4)]
    sharded = SimpleNamespace(local_shards=lambda: [SimpleNamespace(tensor=s) for s in shards])  # a ShardedTensor's interface
    assert [x is s for x, s in zip(local_tensors(sharded), shards)] == [True, True]
    assert local_tensors(5) == [] and local_tensors({"step": t}) == []


def test_local_tensors_of_a_dtensor_is_its_local_part(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(6.0).reshape(3, 2)
    (local,) = local_tensors(distribute_tensor(full, mesh, [Shard(0)]))
    assert torch.equal(local, full)


def test_collectives_of_host_values_go_through_the_cpu_under_gloo(gloo_world_of_one):
    assert collective_device() == torch.device("cpu")
    assert mean_across_ranks(2.5) == 2.5


def test_without_a_group_host_values_stay_on_the_cpu():
    assert not dist.is_initialized() and collective_device() == torch.device("cpu")


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def test_a_plain_python_run_becomes_a_world_of_one(gloo_world_of_one, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "x")  # put back as they were (absent) after the test
        monkeypatch.delenv(var)
    threads = torch.get_num_threads()
    try:
        env = init_distributed(TrainConfig(device="cpu", threads_per_rank=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert env == DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo") and env.is_main
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert os.environ["MASTER_PORT"].isdigit()


def test_shutdown_leaves_no_group(gloo_world_of_one):
    shutdown()
    assert not dist.is_initialized()
    shutdown()  # twice is fine
