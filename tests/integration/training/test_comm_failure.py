"""recsys/training/comm_failure.py: a collective failure caused by another host, in one line.

The texts are gloo's own (torch 2.13, third_party/gloo/gloo/transport/tcp); the end-to-end cases
(a killed, a frozen and a cut-off host) are in tests/system/test_kstep_resume.py and
tests/system/test_simnet_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time


from recsys.training.comm_failure import HostLostError, Peers, end_stuck_launcher, first_to_report, host_lost

CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.213.1.3]:41234"
TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation to complete"


def _peers(rank: int, hosts: int = 2, addrs: dict[str, int] | None = None) -> Peers:
    return Peers(hosts, 2, rank, addrs or {}, 15.0)


def test_closed_connection_names_the_host_of_the_address():
    p = _peers(0, hosts=3, addrs={"10.213.1.1": 0, "10.213.1.2": 1, "10.213.1.3": 2})
    e = host_lost(RuntimeError(CLOSED), p)
    assert isinstance(e, HostLostError)
    assert str(e) == (
        "lost host 2 (global ranks 4-5, 10.213.1.3): its connection to host 0 closed (Connection closed by peer "
        "[10.213.1.3]:41234); the job stops (resume=true continues from the last checkpoint)"
    )


def test_timeout_with_two_hosts_names_the_other_one_and_the_bound():
    e = host_lost(RuntimeError(TIMEOUT), _peers(2))
    assert str(e) == (
        "host 0 (global ranks 0-1) did not answer host 1 within train.pg_timeout_s=15 s (Timed out waiting "
        "15000ms for recv operation to complete); the job stops (resume=true continues from the last checkpoint)"
    )


def test_unknown_address_among_three_hosts_lists_the_candidates():
    e = host_lost(RuntimeError(TIMEOUT), _peers(3, hosts=3))
    assert str(e).startswith("one of hosts 0, 2 did not answer host 1 within train.pg_timeout_s=15 s (")


def test_the_cause_chain_is_searched_and_other_errors_are_not_host_losses():
    try:
        try:
            raise RuntimeError(CLOSED)
        except RuntimeError as inner:
            raise ValueError("while merging") from inner
    except ValueError as outer:
        assert host_lost(outer, _peers(0)) is not None
    assert host_lost(RuntimeError("CUDA out of memory"), _peers(0)) is None
    assert host_lost(KeyError("timeout"), _peers(0)) is None  # not an error type gloo raises
    assert host_lost(RuntimeError(CLOSED), Peers(1, 2, 0)) is None  # one host: nobody else to lose


def test_watchdog_kills_a_stuck_torchrun_agent_and_spares_one_that_exits(tmp_path):
    """A stand-in agent named like torchrun (its argv holds `torch.distributed.run`) starts a
    worker that calls end_stuck_launcher and exits: an agent that then hangs is SIGKILLed after the
    grace; one that exits by itself is left alone (and its pid is not reused by mistake). The second
    agent gets a grace that a loaded machine cannot use up (worker teardown with torch imported
    took over 1 s on a 2-core CI machine), so what it checks is "an exited agent is not killed"."""
    worker = (
        "import os; os.environ['TORCHELASTIC_MAX_RESTARTS'] = '0';"
        "from recsys.training.comm_failure import end_stuck_launcher;"
        "import sys; print(end_stuck_launcher(float(sys.argv[1])), flush=True)"
    )
    agent = (
        "import subprocess, sys, time;"
        f"subprocess.run([sys.executable, '-c', {worker!r}, sys.argv[3]], check=True); time.sleep(float(sys.argv[2]))"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def launch(sleep_s: str, grace_s: str) -> subprocess.Popen:
        argv = [sys.executable, "-c", agent, "torch.distributed.run", sleep_s, grace_s]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    stuck = launch("60", "1.0")
    t0 = time.monotonic()
    out, err = stuck.communicate(timeout=30)
    assert stuck.returncode == -9 and time.monotonic() - t0 < 20
    assert out.strip() == "True" and "killing it" in err
    t1 = time.monotonic()
    fine = launch("0", "20")
    out, err = fine.communicate(timeout=30)
    assert fine.returncode == 0 and out.strip() == "True" and "killing" not in err
    # the watchdog (holding the agent's stderr) leaves as soon as the agent is a zombie, not after the grace
    assert time.monotonic() - t1 < 15
    # not under torchrun: no watchdog
    assert end_stuck_launcher(0.1) is False


def test_exactly_one_rank_per_agent_reports(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("GROUP_RANK", "1")
    assert [first_to_report() for _ in range(3)] == [True, False, False]
    monkeypatch.setenv("GROUP_RANK", "0")  # another host (agent) of the same job on this machine
    assert first_to_report() is True
