"""Topology-aware planner (sharding/topology_planner.py) and its cost model (sharding/cost_model.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from sharding.cost_model import PlacedShard, TopologyCostModel
from sharding.topology import load_topology
from sharding.topology_planner import ModelDoesNotFitError, TopologyAwarePlanner

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
logging.disable(logging.WARNING)


def ebc(specs):
    tables = [EmbeddingBagConfig(name=f"t_{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f_{i}"]) for i, (n, d) in enumerate(specs)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


SPECS = [(1_000_000, 64), (500_000, 64), (200_000, 32), (50_000, 32), (10_000, 16), (5_000, 16), (1_000, 16), (300, 16),
         (2_000_000, 32), (80_000, 64), (120, 16), (7_000, 32)]


def plan_for(topo, specs=SPECS, batch=512, **kw):
    planner = TopologyAwarePlanner(topo, batch, timeout_seconds=10, **kw)
    return planner, planner.plan(ebc(specs), [EmbeddingBagCollectionSharder()])


def shards_of(plan):
    out = {}
    for mplan in plan.plan.values():
        for name, ps in mplan.items():
            out[name] = ps
    return out


def check_cover_and_fit(topo, planner, plan, specs):
    tabs = shards_of(plan)
    assert sorted(tabs) == sorted(f"t_{i}" for i in range(len(specs)))
    for name, ps in tabs.items():  # every row and column of each table covered exactly once
        n, d = specs[int(name[2:])]
        area = sum(s.shard_sizes[0] * s.shard_sizes[1] for s in ps.sharding_spec.shards)
        assert area == n * d, name
    # HBM per rank and host memory per host within the planner's (reserved) capacities
    opts = planner._best_plan
    sc = planner.partitioner.last_storage_constraint
    hbm = [0] * topo.world_size
    host = [0] * len(topo.hosts)
    for so in opts:
        for sh in so.shards:
            hbm[sh.rank] += sh.storage.hbm
            host[sh.rank // topo.local_world_size] += sh.storage.ddr
    for r in range(topo.world_size):
        assert hbm[r] <= topo.gpu(r).hbm_bytes
        assert hbm[r] <= sc.devices[r].storage.hbm * 1.25  # load-factor tuning stays near the cap
    for h, used in enumerate(host):
        assert used <= topo.hosts[h].ddr_bytes


@pytest.mark.parametrize("name", ["dgx-a100", "pcie-8gpu-2socket", "dgx-a100-2host"])
def test_plans_cover_fit_and_are_deterministic(name):
    topo = load_topology(name)
    planner, plan = plan_for(topo)
    check_cover_and_fit(topo, planner, plan, SPECS)
    _, again = plan_for(topo)
    assert str(plan) == str(again)


def starved(topo_name="pcie-8gpu-2socket", hbm_gb=1.0):
    topo = load_topology(topo_name)
    hosts = []
    for h in topo.hosts:
        gpus = tuple(dataclasses.replace(g, hbm_bytes=int(hbm_gb * GIB)) for g in h.gpus)
        hosts.append(dataclasses.replace(h, gpus=gpus))
    return dataclasses.replace(topo, hosts=tuple(hosts), name="starved")


BIG = [(6_000_000, 64), (5_000_000, 64), (4_000_000, 64), (3_000_000, 64)] + [(20_000, 16)] * 8


def test_memory_starved_uses_uvm_spread_over_switches():
    topo = starved()
    planner, plan = plan_for(topo, BIG)
    check_cover_and_fit(topo, planner, plan, BIG)
    tabs = shards_of(plan)
    uvm = {n: ps for n, ps in tabs.items() if ps.compute_kernel in ("fused_uvm", "fused_uvm_caching")}
    assert uvm, {n: ps.compute_kernel for n, ps in tabs.items()}
    # the largest UVM tables (single-shard placements) sit on distinct PCIe switches
    largest = sorted((n for n, ps in uvm.items() if len(ps.ranks) == 1), key=lambda n: -BIG[int(n[2:])][0])[:4]
    switches = [topo.gpu(tabs[n].ranks[0]).pcie_switch for n in largest]
    assert len(set(switches)) == len(switches), dict(zip(largest, switches))


def test_model_that_cannot_fit_raises_one_line_error():
    topo = starved("pcie-8gpu-2socket", hbm_gb=1.0)
    huge = [(3_000_000_000, 128), (10_000, 16)]  # ~1.4 TiB of weights
    with pytest.raises(ModelDoesNotFitError) as e:
        plan_for(topo, huge)
    msg = str(e.value)
    assert "\n" not in msg
    assert "t_0" in msg and "largest tables" in msg and "host memory per host" in msg and "to fit" in msg


def test_cost_model_cross_host_tw_costs_more_than_nvlink_peer():
    topo = load_topology("dgx-a100-2host")
    cm = TopologyCostModel(topo, 512)
    base = dict(table="t", sharding_type="table_wise", kernel="fused", rows=100_000, cols=64, table_rows=100_000, table_cols=64)
    # a TW table on rank 1, consumed by rank 0: rank 0's comm from an NVLink peer ...
    near = cm.score_shards([PlacedShard(rank=1, **base)])
    far = cm.score_shards([PlacedShard(rank=8, **base)])
    assert far.comm[0] > near.comm[0]
    assert cm.bw[0, 8] < cm.bw[0, 1]
    # UVM on two GPUs of one PCIe switch costs more than on two switches
    pcie = load_topology("pcie-8gpu-2socket")
    pm = TopologyCostModel(pcie, 512)
    u = dict(base, kernel="fused_uvm", rows=1_000_000, table_rows=1_000_000)
    same = pm.score_shards([PlacedShard(rank=0, **u), PlacedShard(rank=1, **u)])
    apart = pm.score_shards([PlacedShard(rank=0, **u), PlacedShard(rank=2, **u)])
    assert same.step_time > apart.step_time


def test_cpu_gloo_plan():
    topo = load_topology("cpu-gloo")
    planner, plan = plan_for(topo, [(2000, 8)] * 6)
    tabs = shards_of(plan)
    assert len(tabs) == 6 and {ps.compute_kernel for ps in tabs.values()} == {"fused"}


@pytest.mark.slow
def test_training_with_topology_planner(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [str(ROOT / ".venv/bin/recsys"), "train", "--config", str(ROOT / "configs/experiments/smoke.yaml"),
           "sharding.planner=topology", "train.max_steps=20", f"run_dir={run_dir}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "summary.json").exists()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert "topology" in json.dumps(plan.get("meta", plan))
