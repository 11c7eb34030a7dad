"""Hierarchical runs: checkpoints at merge steps, a host killed between merges, resume.

Two simulated hosts = two `torchrun --nnodes 2` launches joined on loopback (c10d rendezvous),
2 ranks each. One host's whole torchrun tree gets SIGKILL (a host losing power) after a merge
checkpoint; the surviving host must stop on its own (gloo sees the closed connections; the
process-group timeout bounds the case where nothing closes them), and a resume of both hosts from
the last merge checkpoint must end with the same metrics, log and weights as an uninterrupted
run. Slow (about a minute per case)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recsys.training.distributed import free_port
from tests.integration.training.test_kstep_merge import SMOKE, REPO
from tests.support.processes import descendants, kill_tree, wait_for
from tests.support.simulated_hosts import flat_checkpoint


COMMON = ["train.max_steps=48", "train.log_every=12", "train.merge_every=4", "checkpoint.every_steps=10"]


def _start(
    run_dir: Path,
    overrides: list[str],
    env_extra: dict[str, str] | None = None,
    port: int | None = None,
    torchrun_extra: tuple[str, ...] = (),
    net=None,
    store_on_node0: bool = False,
) -> list[subprocess.Popen]:
    """Two torchrun nodes of 2 ranks. `net` (a tools/experiments/simnet.py SimNet, up): node i in host
    namespace i, gloo over the shaped link. `store_on_node0`: node 0's agent hosts the c10d
    rendezvous store (torchrun's default; started first so it binds the endpoint)."""
    port = port or free_port()
    addr = net.bridge_addr if net is not None else "127.0.0.1"
    if store_on_node0 and net is not None:
        addr = net.host_addr(0)
    store = None
    if "is_host=false" not in torchrun_extra and not store_on_node0:
        # the rendezvous store in this process, not in an agent that may exit first (docs/kstep.md)
        store = torch.distributed.TCPStore(addr, port, is_master=True, multi_tenant=True, wait_for_workers=False)
        torchrun_extra = (*torchrun_extra, "--rdzv_conf", "is_host=false")
    env = dict(os.environ, OMP_NUM_THREADS="1", RECSYS_PG_TIMEOUT_S="60")
    env.update(env_extra or {})
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "2",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{addr}:{port}",
            "--rdzv_id",
            f"{run_dir.name}{port}",
            *torchrun_extra,
        ]
        node_env = env
        if net is not None:
            cmd = [*net.exec_prefix(node), *cmd, "--local_addr", net.host_addr(node)]
            node_env = dict(env, **net.host_env(node))
        cmd += ["-m", "recsys.train", "--config", str(SMOKE), f"run_dir={run_dir}", "train.threads_per_rank=1", *overrides]
        log = run_dir.parent / f"{run_dir.name}.node{node}.{port}.log"
        with open(log, "w") as out:
            p = subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if store_on_node0 and node == 0:
            _wait_listening(port, p)
        p.log_path = log  # type: ignore[attr-defined]
        p.rdzv_store = store  # type: ignore[attr-defined]  # alive as long as the processes
        procs.append(p)
    return procs


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until something listens on TCP `port` (in any namespace the test can see: /proc/net/tcp of
    the process), so node 0's agent has bound the rendezvous endpoint before node 1 starts."""
    t0 = time.monotonic()
    hexport = f":{port:04X}"
    while time.monotonic() - t0 < timeout:
        table = ""
        for name in ("tcp", "tcp6"):  # TCPStore listens on a dual-stack socket where it can
            try:
                table += Path(f"/proc/{proc.pid}/net/{name}").read_text()
            except OSError:
                pass
        rows = [line.split() for line in table.splitlines()]
        if any(len(f) > 3 and f[1].endswith(hexport) and f[3] == "0A" for f in rows):  # 0A: LISTEN
            return
        if proc.poll() is not None:
            raise AssertionError(f"node 0 exited before it bound port {port}")
        time.sleep(0.1)
    raise AssertionError(f"nothing listened on port {port} after {timeout} s")


LOST_LINE = re.compile(
    r"^error: (lost host (\d) \(global ranks \d-\d[^)]*\): its connection to host (\d) closed|"
    r"host (\d) \(global ranks \d-\d[^)]*\) did not answer host (\d)).*; the job stops \(resume=true continues "
    r"from the last checkpoint\)$",
    re.M,
)


def lost_lines(log: Path) -> list[tuple[int, int]]:
    """(lost host, reporting host) of every one-line host-loss error in a node's log."""
    return [(int(m.group(2) or m.group(4)), int(m.group(3) or m.group(5))) for m in LOST_LINE.finditer(log.read_text())]


def _finish(procs: list[subprocess.Popen], timeout: int = 400) -> None:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    for p in procs:
        assert p.returncode == 0, p.log_path.read_text()[-4000:]


def _ranks_of(proc: subprocess.Popen) -> set[int]:
    """Global ranks of the workers under a torchrun launcher (RANK in their environment)."""
    out = set()
    for pid in descendants(proc.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        out |= {int(kv[5:]) for kv in environ if kv.startswith(b"RANK=")}
    return out


def _freeze_and_wait(victim: subprocess.Popen, survivor: subprocess.Popen, timeout: float) -> float:
    """SIGSTOPs the victim's whole launcher tree (sockets stay open: a frozen host) and returns the
    seconds until the survivor's launcher exits."""
    import signal

    t0 = time.monotonic()
    for pid in descendants(victim.pid):
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    survivor.wait(timeout=timeout)
    return time.monotonic() - t0


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("moments", [False, True], ids=["moments_unmerged", "moments_merged"])
def test_host_killed_between_merges_then_resume_matches(tmp_path, moments):
    common = [*COMMON, f"train.merge_moments={str(moments).lower()}"]
    straight = tmp_path / "straight"
    _finish(_start(straight, common))

    killed = tmp_path / "killed"
    procs = _start(killed, common)
    try:
        # checkpoint.every_steps=10 is rounded up to a merge step: 12, 24, 36
        wait_for(killed / "checkpoints" / "step_000000024" / "COMMITTED", procs[0], timeout=300)
        victim = next(p for p in procs if 2 in _ranks_of(p))  # the host of global ranks 2, 3
        survivor = next(p for p in procs if p is not victim)
        t0 = time.monotonic()
        kill_tree(victim.pid)
        victim.wait(timeout=60)
        # the surviving host stops by itself, with an error, in bounded time
        survivor.wait(timeout=120)
        stopped_after = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    assert survivor.returncode != 0
    assert stopped_after < 120
    assert not (killed / "summary.json").exists()
    # one line, from the surviving host (host 0), naming the killed one (host 1)
    assert lost_lines(survivor.log_path) == [(1, 0)], survivor.log_path.read_text()[-3000:]
    time.sleep(1)

    # resume both hosts from the last merge checkpoint (RECSYS_RESUME=1 is resume=true, read by
    # the workers from their environment)
    _finish(_start(killed, common, {"RECSYS_RESUME": "1"}))
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((killed / "summary.json").read_text())
    assert b["resumed_from"] and b["resumed_from"].endswith(("step_000000024", "step_000000036"))
    assert a["checkpoint_every_steps"] == 12 and a["merge_route"] == "hierarchical"
    for key in ("auc", "logloss", "oracle_auc"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), (key, a[key], b[key])
    for key in ("merges", "cross_host_bytes_total", "cross_host_bytes_per_step"):
        assert b[key] == a[key], key  # counters restored from the checkpoint
    assert a["replica_divergence"] == b["replica_divergence"] == 0.0
    # each step logged once, same losses and byte rates as the uninterrupted run
    ra, rb = _records(straight), _records(killed)
    assert [(x["kind"], x["step"]) for x in rb] == [(x["kind"], x["step"]) for x in ra]
    assert [x.get("loss") for x in rb] == pytest.approx([x.get("loss") for x in ra], abs=1e-6)
    assert [x.get("cross_host_bytes_per_step") for x in rb] == [x.get("cross_host_bytes_per_step") for x in ra]
    # checkpoints only at merge steps; host 1 writes its own optimizer state only if unmerged
    final_a, final_b = (d / "checkpoints" / "step_000000048" for d in (straight, killed))
    for d in (straight, killed):
        assert all(int(p.name[5:]) % 12 == 0 for p in (d / "checkpoints").glob("step_?????????"))
    assert (final_a / "host1").is_dir() == (not moments)
    marker = json.loads((final_a / "COMMITTED").read_text())
    assert (marker["hosts"], marker["ranks_per_host"], marker["world_size"]) == (2, 2, 4)
    # the final weights and optimizer state (host 0's copy) equal the uninterrupted run's
    wa, wb = flat_checkpoint(final_a, tmp_path / "a.pt"), flat_checkpoint(final_b, tmp_path / "b.pt")
    assert wa.keys() == wb.keys() and any("embedding_bags" in k for k in wa)
    for k in wa:
        assert torch.allclose(wa[k].double(), wb[k].double(), atol=1e-6, rtol=0), k
    if not moments:  # host 1's own moments too
        ha, hb = flat_checkpoint(final_a / "host1", tmp_path / "ha.pt"), flat_checkpoint(final_b / "host1", tmp_path / "hb.pt")
        assert ha.keys() == hb.keys() and ha
        for k in ha:
            assert torch.allclose(ha[k].double(), hb[k].double(), atol=1e-6, rtol=0), k


def test_frozen_host_stops_the_job_after_the_pg_timeout(tmp_path):
    """A host that stops answering without closing its sockets (SIGSTOP of its tree: power loss,
    partition). The survivors' collectives fail after RECSYS_PG_TIMEOUT_S and the surviving
    torchrun exits. The c10d rendezvous store runs outside both hosts (here: in this process;
    `is_host=false` on the agents): when the frozen host holds the store, torchrun's agent blocks
    in a store read that does not time out (docs/kstep.md); the next test covers that case."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    run_dir = tmp_path / "frozen"
    procs = _start(
        run_dir,
        [*COMMON[:-1], "train.max_steps=2000", "checkpoint.every_steps=12"],
        {"RECSYS_PG_TIMEOUT_S": "15"},
        port=port,
        torchrun_extra=("--rdzv_conf", "is_host=false"),
    )
    try:
        wait_for(run_dir / "checkpoints" / "step_000000012" / "COMMITTED", procs[0], timeout=300)
        victim = next(p for p in procs if 0 in _ranks_of(p))  # global rank 0: the workers' store too
        survivor = next(p for p in procs if p is not victim)
        stopped_after = _freeze_and_wait(victim, survivor, timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)  # SIGKILL also ends stopped processes
        del store
    assert survivor.returncode != 0
    assert 10 <= stopped_after < 90, stopped_after
    assert lost_lines(survivor.log_path) == [(0, 1)], survivor.log_path.read_text()[-3000:]
    assert "did not answer host 1 within train.pg_timeout_s=15 s" in survivor.log_path.read_text()


def test_frozen_host_holding_the_rendezvous_store_still_stops_the_job(tmp_path):
    """The case torchrun alone cannot end: node 0's agent hosts the c10d store (torchrun's
    default) and node 0 is frozen. The surviving agent blocks in a store read that never returns;
    the survivors' workers fail after the process-group timeout, print the one line and leave a
    watchdog that ends their agent RECSYS_LAUNCHER_GRACE_S later (recsys/training/comm_failure.py)."""

    run_dir = tmp_path / "frozen_store"
    procs = _start(
        run_dir,
        [*COMMON[:-1], "train.max_steps=2000", "checkpoint.every_steps=12"],
        {"RECSYS_PG_TIMEOUT_S": "15", "RECSYS_LAUNCHER_GRACE_S": "5"},
        store_on_node0=True,
    )
    try:
        wait_for(run_dir / "checkpoints" / "step_000000012" / "COMMITTED", procs[0], timeout=300)
        victim, survivor = procs  # node 0: the store's agent
        victim_host = min(_ranks_of(victim)) // 2  # the host its global ranks make it
        stopped_after = _freeze_and_wait(victim, survivor, timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    log = survivor.log_path.read_text()
    assert survivor.returncode != 0
    assert stopped_after < 15 + 5 + 45, stopped_after  # timeout + grace + the step in flight, start-up
    assert lost_lines(survivor.log_path) == [(victim_host, 1 - victim_host)], log[-3000:]
    assert "had not exited 5 s after its workers lost a host" in log
