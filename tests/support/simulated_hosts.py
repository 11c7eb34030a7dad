"""Jobs on simulated hosts: ``nnodes`` torchrun agents on this machine, joined through a rendezvous
store the test holds (not one in an agent that may exit before the other: docs/kstep.md). What the
k-step and drop-in tests launch; ``train_on_hosts``: the smoke config, 4 ranks in all."""

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
    entry = ["-m", "recsys.train", "--config", str(SMOKE), f"run_dir={run_dir}", "train.threads_per_rank=1", *overrides]
    run_agents(nnodes, 4 // nnodes, run_dir.name, entry, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout)
    return json.loads((run_dir / "summary.json").read_text())


def run_agents(nnodes: int, nproc_per_node: int, rdzv_id: str, entry: list[str], *, cwd: Path, env: dict[str, str], timeout: int) -> None:
    """``torch.distributed.run`` once per simulated host, ``entry`` (a script or ``-m module`` and
    its arguments) in each of its ``nproc_per_node`` workers, joined through a c10d store held
    here; fails with the tail of an agent's output unless every agent exits 0."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}",
            f"--node_rank={node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id={rdzv_id}",
            "--rdzv_conf=is_host=false",
            *entry,
        ]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    del store
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]


def flat_checkpoint(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """A run's DCP checkpoint directory as one flat {dotted key: tensor} dict (written to ``out``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                flat[prefix + str(k)] = v

    walk(torch.load(out, weights_only=False), "")
    return flat
