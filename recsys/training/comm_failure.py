"""A lost host in one line, and a launcher that cannot hang on it (docs/kstep.md, "When a host dies").

When a host dies, is frozen or loses its link, what the survivors see is a collective that fails:
gloo's `Connection closed by peer [addr]:port` when the peer's sockets closed (a killed host), or a
timeout after the process group's timeout (`train.pg_timeout_s`) when nothing tells them (a frozen
host, a cut cable). Those messages name a socket, not a host, and arrive as a traceback per rank.
:func:`host_lost` turns them into one line that names the host (`HostLostError`), which
`recsys.train` prints once per surviving host.

One hang is not ours to time out: torchrun's agent polls the c10d rendezvous store while its
workers run, and a store on a frozen host answers no read and closes no socket, so the agent
blocks forever (measured; no torchrun setting bounds that read). A worker that exits on a lost
host therefore leaves a watchdog (:func:`end_stuck_launcher`) that ends its agent if the agent
has not exited `grace_s` later. Only with `--max-restarts 0` (torchrun's default): an agent that
restarts its workers must not be cut short.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch.distributed as dist

# Substrings of the errors that gloo / c10d raise when a peer is gone or does not answer.
_CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
_TIMEOUT = ("Timed out", "timed out", "pair closure", "Socket Timeout", "timeout")
_PEER_RE = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]:\d+")
SIOCGIFADDR = 0x8915


class HostLostError(RuntimeError):
    """A collective failed because another host is gone or silent; the message is the one line."""


@dataclass
class Peers:
    """Where the ranks live: host-major (global rank g on host g // ranks_per_host) and, where the
    hosts' gloo addresses differ, which address is which host."""

    hosts: int
    ranks_per_host: int
    rank: int
    host_of_addr: dict[str, int] = field(default_factory=dict)
    timeout_s: float | None = None

    @property
    def my_host(self) -> int:
        return self.rank // self.ranks_per_host

    def describe_host(self, h: int) -> str:
        lo = h * self.ranks_per_host
        ranks = f"global rank {lo}" if self.ranks_per_host == 1 else f"global ranks {lo}-{lo + self.ranks_per_host - 1}"
        addr = next((a for a, hh in self.host_of_addr.items() if hh == h), None)
        return f"host {h} ({ranks}{', ' + addr if addr else ''})"


_peers: Peers | None = None


def gloo_address() -> str:
    """The IPv4 address gloo uses on this rank: GLOO_SOCKET_IFNAME's, else the host name's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def register_peers(hosts: int, timeout_s: float | None) -> Peers:
    """Collective over the default group (every rank calls it once, after init): records each
    host's gloo address so a failure can name the host. Addresses shared by several hosts (all on
    loopback) are left out."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_host = world // hosts if hosts > 0 and world % hosts == 0 else world
    mine = (rank // per_host, gloo_address())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    hosts_at: dict[str, set[int]] = {}
    for h, addr in everyone:
        if addr:
            hosts_at.setdefault(addr, set()).add(h)
    global _peers
    _peers = Peers(max(world // per_host, 1), per_host, rank, {a: next(iter(hs)) for a, hs in hosts_at.items() if len(hs) == 1}, timeout_s)
    return _peers


def _peers_from_env() -> Peers:
    """Without register_peers: the layout torchrun's environment gives (no addresses)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) or world
    return Peers(max(world // per_host, 1), per_host, int(os.environ.get("RANK", "0")))


def _failure_kind(e: BaseException) -> str | None:
    """ "closed" / "timeout" when `e` (or what it was raised from) is a lost-peer error, else None."""
    seen = 0
    while e is not None and seen < 5:
        text = str(e)
        if isinstance(e, (RuntimeError, ConnectionError, OSError)):
            if any(m in text for m in _CLOSED):
                return "closed"
            if any(m in text for m in _TIMEOUT) and (
                "gloo" in text.lower() or isinstance(e, dist.DistError) or "pair" in text or "waiting" in text
            ):
                return "timeout"
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def host_lost(e: BaseException, peers: Peers | None = None) -> HostLostError | None:
    """The one-line HostLostError for a collective failure caused by another host, else None."""
    kind = _failure_kind(e)
    if kind is None:
        return None
    p = peers or _peers or _peers_from_env()
    if p.hosts <= 1:
        return None  # one host: not a lost host (a local rank died; torchrun reports it)
    text = " ".join(str(e).split())
    gloo = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)[:160]
    m = _PEER_RE.search(text)
    others = [h for h in range(p.hosts) if h != p.my_host]
    if m and m.group(1) in p.host_of_addr and p.host_of_addr[m.group(1)] != p.my_host:
        who = p.describe_host(p.host_of_addr[m.group(1)])
    elif len(others) == 1:
        who = p.describe_host(others[0])
    else:
        who = "one of hosts " + ", ".join(str(h) for h in others)
    me = f"host {p.my_host}"
    if kind == "closed":
        msg = f"lost {who}: its connection to {me} closed ({gloo})"
    else:
        bound = f" within train.pg_timeout_s={p.timeout_s:g} s" if p.timeout_s else ""
        msg = f"{who} did not answer {me}{bound} ({gloo})"
    return HostLostError(msg + "; the job stops (resume=true continues from the last checkpoint)")


_WATCHDOG = r"""
import os, signal, sys, time
pid, start, grace = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def same():  # the agent still runs: same start time, and not a zombie its parent has yet to reap
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return fields[19] == start and fields[0] != "Z"
    except (OSError, IndexError):
        return False
deadline = time.monotonic() + grace
while time.monotonic() < deadline:
    if not same():
        sys.exit(0)
    time.sleep(0.2)
if same():
    print(f"recsys: torchrun agent {pid} had not exited {grace:g} s after its workers lost a host "
          "(a rendezvous store on a frozen host blocks it): killing it", file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)
"""


def first_to_report() -> bool:
    """True for the first rank of this host (this torchrun agent) that asks: the one that prints
    the line. Ranks of a host fail at nearly the same moment, and the agent stops the others as
    soon as one exits, so "local rank 0 prints" could print nothing; an O_EXCL file per agent
    (in the temp dir, named after the agent's pid) picks exactly one."""
    path = os.path.join(tempfile.gettempdir(), f"recsys-host-lost-{os.getppid()}-{os.environ.get('GROUP_RANK', '0')}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False
    except OSError:
        return os.environ.get("LOCAL_RANK", "0") == "0"


def _start_time(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def end_stuck_launcher(grace_s: float = 10.0) -> bool:
    """Leaves a detached watchdog that SIGKILLs this worker's torchrun agent unless it exits within
    `grace_s` (its workers die with it: they hold a parent-death signal). Only under torchrun with
    `--max-restarts 0` on Linux; returns whether a watchdog was started."""
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "") != "0" or not sys.platform.startswith("linux"):
        return False
    ppid = os.getppid()
    try:
        cmdline = open(f"/proc/{ppid}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:
        return False
    start = _start_time(ppid)
    if start is None or not (b"torch.distributed.run" in cmdline or b"torchrun" in cmdline):
        return False
    subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(ppid), start, str(grace_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return True
