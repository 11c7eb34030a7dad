"""A training job on simulated hosts: ``nnodes`` torchrun agents on this machine, joined through a
rendezvous store the test holds (not one in an agent that may exit before the other:
docs/kstep.md), 4 ranks in all, on the smoke config. What the k-step tests launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from recsys.training.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"


def train_on_hosts(run_dir: Path, nnodes: int, overrides: list[str], timeout: int = 400) -> dict:
    """Trains ``smoke.yaml`` with ``overrides`` on ``nnodes`` simulated hosts of 4 // nnodes ranks
    (one thread each); every agent must exit 0. Returns the run's summary.json."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--nproc_per_node",
            str(4 // nnodes),
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            "--rdzv_id",
            run_dir.name,
            "--rdzv_conf",
            "is_host=false",
            "-m",
            "recsys.train",
            "--config",
            str(SMOKE),
            f"run_dir={run_dir}",
            "train.threads_per_rank=1",
            *overrides,
        ]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    del store
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return json.loads((run_dir / "summary.json").read_text())
