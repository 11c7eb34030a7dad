"""Simulated hosts behind a real, throttled network: Linux network namespaces on a bridge.

Why: two torchrun launches joined on loopback have effectively unlimited bandwidth, so k-step
merges could only be measured in bytes. Here every simulated host is a network namespace with
its own loopback and one veth into a bridge in the root namespace; `tc` shapes both directions
of each host's veth (tbf for the rate, netem for delay where the kernel has it); nftables drops
packets at random where `loss=` is set. Processes
started with `ip netns exec` in a host talk to the other hosts over the shaped link and to
themselves over the host's own loopback (the kernel routes traffic to a local address through
`lo`, also when it is the veth's address), so gloo with GLOO_SOCKET_IFNAME=simnet0 sends
cross-host bytes over the link only.

Layout for `--name NAME` and H hosts, subnet 10.213.N.0/24 (N: the lowest not used by another
simnet bridge):

    namespace snet-NAME-h<i>   veth simnet0 = 10.213.N.<i+1>/24  (tc: tbf [+ netem] on egress)
    root ns   snetNAMEr<i>     the veth's other end, a port of the bridge (tc: the same, toward the host)
    root ns   snetNAME         bridge = 10.213.N.254/24 (reachable from every host: a launcher's store)

Only these addresses are used; nothing is routed anywhere else (no forwarding or NAT is set up).

    python tools/experiments/simnet.py check                          # root? ip? tc? netns? tbf? netem? nft?
    python tools/experiments/simnet.py up --name demo --hosts 2 --net rate=100mbit,delay=1ms
                                                          # holds until Ctrl-C / SIGTERM, then deletes
    python tools/experiments/simnet.py up --name demo --detach ...    # leaves it up (then: down --name demo)
    python tools/experiments/simnet.py list                           # every simnet namespace/link, with byte counters
    python tools/experiments/simnet.py down [--name NAME]             # delete one, or every leftover by prefix

Library use (tools/experiments/kstep.py --net): ``with SimNet("k123", 2, LinkSpec.parse("rate=1gbit")) as net:``
then prefix commands with ``net.exec_prefix(i)`` and read ``net.counters()``.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "snet"
IFNAME = "simnet0"  # the veth's name inside every host namespace (GLOO_SOCKET_IFNAME)
SUBNET_BASE = "10.213"
BRIDGE_HOST = 254
LOCK = "/tmp/.snet.lock"  # held while a subnet is picked and claimed
_NAME_RE = re.compile(r"^[a-z0-9]{1,8}$")  # interface names are limited to 15 characters
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_RATE_MULT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_MULT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class SimNetError(RuntimeError):
    """A one-line reason why the simulated network cannot be made or used."""


@dataclass(frozen=True)
class LinkSpec:
    """Shaping of every host's link, both directions: rate (tc syntax, e.g. 100mbit), delay added
    by each shaped veth (e.g. 1ms; host to host passes two, so one way adds 2x and a round trip
    4x), packet loss in percent of the packets a host sends into the link (nftables, `_drop_rules`).
    None: not limited. `str()` parses back."""

    rate: str | None = None
    delay: str | None = None
    loss_pct: float | None = None

    @staticmethod
    def parse(text: str) -> "LinkSpec":
        """`rate=1gbit,delay=1ms,loss=1%`; keys may be left out. Raises SimNetError naming the bad part."""
        kw: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, val = part.partition("=")
            key, val = key.strip(), val.strip().lower()
            if not sep or not val:
                raise SimNetError(f"simnet: bad link setting {part!r} in {text!r}: expected key=value")
            if key == "rate":
                if val in ("0", "unlimited"):
                    kw["rate"] = None
                elif not _RATE_RE.match(val):
                    raise SimNetError(f"simnet: bad rate {val!r}: expected e.g. 100mbit, 1gbit, 500kbit")
                else:
                    kw["rate"] = None if float(_RATE_RE.match(val).group(1)) == 0 else val
            elif key == "delay":
                if val == "0":
                    kw["delay"] = None
                elif not _TIME_RE.match(val):
                    raise SimNetError(f"simnet: bad delay {val!r}: expected e.g. 1ms, 100us")
                else:
                    kw["delay"] = None if float(_TIME_RE.match(val).group(1)) == 0 else val
            elif key == "loss":
                try:
                    pct = float(val.rstrip("%"))
                except ValueError:
                    raise SimNetError(f"simnet: bad loss {val!r}: expected a percentage, e.g. 1%") from None
                if not 0 <= pct < 100:
                    raise SimNetError(f"simnet: bad loss {val!r}: must be in [0, 100)")
                kw["loss_pct"] = pct or None
            else:
                raise SimNetError(f"simnet: unknown link setting {key!r} in {text!r} (known: rate, delay, loss)")
        return LinkSpec(**kw)

    @property
    def rate_bps(self) -> float | None:
        if self.rate is None:
            return None
        m = _RATE_RE.match(self.rate)
        return float(m.group(1)) * _RATE_MULT[m.group(2)]

    @property
    def delay_s(self) -> float:
        if self.delay is None:
            return 0.0
        m = _TIME_RE.match(self.delay)
        return float(m.group(1)) * _TIME_MULT[m.group(2)]

    def __str__(self) -> str:
        parts = [f"rate={self.rate or 'unlimited'}", f"delay={self.delay or '0'}"]
        if self.loss_pct:
            parts.append(f"loss={self.loss_pct:g}%")
        return ",".join(parts)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise SimNetError(f"simnet: `{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit {r.returncode}'}")
    return r


def require_support() -> None:
    """Raises SimNetError (one line) unless this process can make namespaces and shape links."""
    if sys.platform != "linux":
        raise SimNetError("simnet: needs Linux network namespaces (this is " + sys.platform + ")")
    if os.geteuid() != 0:
        raise SimNetError("simnet: needs root to create network namespaces (run as root, or use the loopback launch)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SimNetError(f"simnet: `{tool}` not found on PATH (install iproute2)")


def probe(spec: LinkSpec | None = None) -> str | None:
    """None when a SimNet with this spec (default: a rate limit only) can be made here, else the
    one-line reason. Makes and deletes a throwaway namespace + veth (names `snetpr<pid>...`)."""
    try:
        require_support()
    except SimNetError as e:
        return str(e)
    tag = f"pr{os.getpid() % 10**6}"
    ns, a, b = f"{PREFIX}-{tag}-h0", f"{PREFIX}{tag}r0", f"{PREFIX}{tag}p0"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        _run(["ip", "link", "set", b, "netns", ns])
        _shape(["tc"], a, spec or LinkSpec(rate="100mbit"))
        if spec is not None and spec.loss_pct:
            _drop_rules(f"{PREFIX}{tag}", [a], spec.loss_pct)
        return None
    except SimNetError as e:
        return str(e)
    finally:
        if shutil.which("nft"):
            _run(["nft", "delete", "table", "netdev", f"{PREFIX}{tag}"], check=False)
        _run(["ip", "link", "del", a], check=False)
        _run(["ip", "netns", "del", ns], check=False)


def _shape(tc: list[str], dev: str, spec: LinkSpec) -> None:
    """tbf for the rate (burst: 5 ms of traffic, at least 128 KiB so GSO super-packets pass), netem
    as its child (or alone) for the delay. One line when the kernel lacks netem. Loss is not
    shaped here but dropped by nftables as packets enter the bridge (`_drop_rules`)."""
    parent = ["root"]
    if spec.rate is not None:
        burst = max(128 * 1024, int(spec.rate_bps / 8 * 0.005))
        _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", spec.rate, "burst", str(burst), "latency", "100ms"])
        parent = ["parent", "1:1"]
    if spec.delay is not None:
        r = _run([*tc, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem", "limit", "100000", "delay", spec.delay], check=False)
        if r.returncode != 0:
            err = (r.stderr or r.stdout).strip()
            if "unknown" in err.lower():
                raise SimNetError(
                    f"simnet: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so delay={spec.delay} "
                    f"cannot be emulated; use rate (and loss) only (e.g. --net rate=100mbit,loss=1%)"
                )
            raise SimNetError(f"simnet: tc netem on {dev} failed: {err.splitlines()[-1] if err else r.returncode}")


def _drop_rules(table: str, devs: list[str], loss_pct: float) -> None:
    """Random loss with nftables instead of netem (which many kernels lack, this machine's too):
    a netdev table with one ingress chain per root-side veth, `numgen random mod 10000 < N drop`.
    Each packet a host sends into the link passes exactly one such chain, so `loss` is the
    probability that a packet from one host to another (or to the bridge address) is lost."""
    if shutil.which("nft") is None:
        raise SimNetError("simnet: loss needs `nft` (nftables) on PATH (apt-get install nftables)")
    n = max(1, round(loss_pct * 100))
    script = [f"add table netdev {table}"]
    for i, dev in enumerate(devs):
        script += [
            f"add chain netdev {table} h{i} {{ type filter hook ingress device {dev} priority 0 ; policy accept ; }}",
            f"add rule netdev {table} h{i} numgen random mod 10000 < {n} counter drop",
        ]
    r = subprocess.run(["nft", "-f", "-"], input="\n".join(script) + "\n", capture_output=True, text=True)
    if r.returncode != 0:
        err = (r.stderr or r.stdout).strip().splitlines()
        raise SimNetError(f"simnet: nftables loss rule failed: {err[0] if err else r.returncode}")


def dropped_packets(table: str) -> int:
    """Packets the loss rules of `table` dropped so far (0 when there is no such table)."""
    r = _run(["nft", "list", "table", "netdev", table], check=False) if shutil.which("nft") else None
    if r is None or r.returncode != 0:
        return 0
    return sum(int(m.group(1)) for m in re.finditer(r"counter packets (\d+)", r.stdout))


def _no_ipv6(prefix: list[str], dev: str) -> None:
    """No IPv6 on simnet links: no router solicitations or MLD reports in the byte counters."""
    _run([*prefix, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"], check=False)


def _used_subnets() -> set[int]:
    r = _run(["ip", "-o", "-4", "addr", "show"], check=False)
    return {int(m.group(1)) for m in re.finditer(rf"inet {re.escape(SUBNET_BASE)}\.(\d+)\.", r.stdout)}


class SimNet:
    """H simulated hosts on one bridge. `up()` makes everything (undoing what it made if a step
    fails), `down()` deletes it; as a context manager it is torn down on exit, on Ctrl-C, on
    SIGTERM/SIGHUP (turned into SystemExit while it is up) and at interpreter exit."""

    def __init__(self, name: str, hosts: int = 2, link: LinkSpec | None = None) -> None:
        if not _NAME_RE.match(name):
            raise SimNetError(f"simnet: bad name {name!r}: 1-8 characters of [a-z0-9]")
        if not 1 <= hosts <= 99:
            raise SimNetError(f"simnet: bad host count {hosts}: 1..99")
        self.name, self.hosts, self.link = name, hosts, link or LinkSpec()
        self.net: int | None = None
        self._is_up = False
        self._old_handlers: dict[int, Any] = {}

    # names and addresses
    def ns(self, i: int) -> str:
        return f"{PREFIX}-{self.name}-h{i}"

    def root_veth(self, i: int) -> str:
        return f"{PREFIX}{self.name}r{i}"

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def nft_table(self) -> str:
        """The nftables table of the loss rules (`loss=`)."""
        return f"{PREFIX}{self.name}"

    def host_addr(self, i: int) -> str:
        return f"{SUBNET_BASE}.{self.net}.{i + 1}"

    @property
    def bridge_addr(self) -> str:
        return f"{SUBNET_BASE}.{self.net}.{BRIDGE_HOST}"

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a process inside host i."""
        return ["ip", "netns", "exec", self.ns(i)]

    def host_env(self, i: int) -> dict[str, str]:
        """Environment for gloo in host i: its sockets on the link's interface and address."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    # life cycle
    def up(self) -> "SimNet":
        require_support()
        if _run(["ip", "netns", "list"]).stdout.find(f"{PREFIX}-{self.name}-h") >= 0 or Path(f"/sys/class/net/{self.bridge}").exists():
            raise SimNetError(f"simnet: a network named {self.name!r} exists already (tools/experiments/simnet.py down --name {self.name})")
        self._is_up = True  # from here on, down() deletes what this object made
        try:
            with open(LOCK, "a") as lock:  # two networks made at once must not pick the same subnet
                fcntl.flock(lock, fcntl.LOCK_EX)
                used = _used_subnets()
                free = [n for n in range(1, 255) if n not in used]
                if not free:
                    raise SimNetError(f"simnet: every subnet {SUBNET_BASE}.1-254.0/24 is in use")
                self.net = free[0]
                _run(["ip", "link", "add", self.bridge, "type", "bridge"])
                _no_ipv6([], self.bridge)
                _run(["ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(self.hosts):
                ns, rv, peer = self.ns(i), self.root_veth(i), f"{PREFIX}{self.name}p{i}"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "link", "add", rv, "type", "veth", "peer", "name", peer])
                _run(["ip", "link", "set", peer, "netns", ns])
                _run(["ip", "-n", ns, "link", "set", peer, "name", IFNAME])
                _run(["ip", "-n", ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", IFNAME])
                _no_ipv6([], rv)
                _no_ipv6(self.exec_prefix(i), IFNAME)
                _run(["ip", "link", "set", rv, "master", self.bridge])
                _run(["ip", "link", "set", rv, "up"])
                _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
                _shape(["tc"], rv, self.link)  # toward the host
                _shape(["tc", "-n", ns], IFNAME, self.link)  # from the host
            if self.link.loss_pct:
                # a loss is one wire-sized packet, as on a real NIC, not a 64 KiB GSO super-packet:
                # TCP sends segments of at most one MTU through these links (costs CPU per packet)
                for i in range(self.hosts):
                    _run(["ip", "-n", self.ns(i), "link", "set", "dev", IFNAME, "gso_max_segs", "1"])
                    _run(["ip", "link", "set", "dev", self.root_veth(i), "gso_max_segs", "1"])
                _drop_rules(self.nft_table, [self.root_veth(i) for i in range(self.hosts)], self.link.loss_pct)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Deletes what `up` made (missing pieces are fine); nothing if `up` did not start making
        (e.g. refused because the name exists). Deleting the root-side veth deletes its peer in
        the namespace too."""
        if not self._is_up:
            return
        if self.link.loss_pct and shutil.which("nft"):
            _run(["nft", "delete", "table", "netdev", self.nft_table], check=False)
        for i in range(self.hosts):
            _run(["ip", "link", "del", self.root_veth(i)], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        for i in range(self.hosts):
            _run(["ip", "netns", "del", self.ns(i)], check=False)
        self._is_up = False

    def set_link(self, i: int, up: bool) -> None:
        """Cuts (or restores) host i's link: its root-side veth goes down, which takes the carrier
        of its peer in the host down too. Nothing passes either way; sockets stay open, so TCP
        retransmits (backing off) until the link is back, as with a pulled cable."""
        _run(["ip", "link", "set", self.root_veth(i), "up" if up else "down"])

    def dropped(self) -> int:
        """Packets dropped by the loss rules so far."""
        return dropped_packets(self.nft_table) if self.link.loss_pct else 0

    def counters(self) -> dict[str, int]:
        """Bytes through the link now, per host: `h<i>_sent` (into the link, = the root-side
        veth's rx) and `h<i>_received`; `sent_total` = the sum of the sent bytes. Cumulative since
        up(): take differences. Counts what is on the wire (Ethernet/IP/TCP headers, ACKs, ARP,
        store traffic) of every process in the hosts."""
        out: dict[str, int] = {}
        for i in range(self.hosts):
            stats = Path(f"/sys/class/net/{self.root_veth(i)}/statistics")
            out[f"h{i}_sent"] = int((stats / "rx_bytes").read_text())
            out[f"h{i}_received"] = int((stats / "tx_bytes").read_text())
        out["sent_total"] = sum(out[f"h{i}_sent"] for i in range(self.hosts))
        return out

    def __enter__(self) -> "SimNet":
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            return self.up()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.down()
        finally:
            for sig, h in self._old_handlers.items():
                signal.signal(sig, h)
            self._old_handlers.clear()
            atexit.unregister(self.down)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def list_all() -> dict[str, list[str]]:
    """Every simnet namespace and root-namespace link there is now (by the name prefix)."""
    ns = [ln.split()[0] for ln in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if ln.startswith(f"{PREFIX}-")]
    links = sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(PREFIX))
    tables = []
    if shutil.which("nft"):
        r = _run(["nft", "list", "tables", "netdev"], check=False)
        tables = sorted(m.group(1) for m in re.finditer(rf"^table netdev ({PREFIX}\w*)$", r.stdout, re.M))
    return {"namespaces": sorted(ns), "links": links, "nft_tables": tables}


def down_all(name: str | None = None) -> list[str]:
    """Deletes the simnet objects of one network (`name`) or all of them; returns what it deleted."""
    found = list_all()
    gone: list[str] = []
    for table in found["nft_tables"]:  # loss rules (before their devices go)
        if name is None or table == f"{PREFIX}{name}":
            if _run(["nft", "delete", "table", "netdev", table], check=False).returncode == 0:
                gone.append(f"nft table {table}")
    for link in found["links"]:
        if name is None or re.fullmatch(rf"{PREFIX}{re.escape(name)}([rp]\d+)?", link):
            if _run(["ip", "link", "del", link], check=False).returncode == 0:
                gone.append(link)
    for ns in found["namespaces"]:
        if name is None or re.fullmatch(rf"{PREFIX}-{re.escape(name)}-h\d+", ns):
            if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
                gone.append(ns)
    return gone


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether simulated hosts can be made here (exit 0) or why not (exit 2)")
    p_up = sub.add_parser("up", help="make a network; hold it until Ctrl-C/SIGTERM unless --detach")
    p_up.add_argument("--name", required=True)
    p_up.add_argument("--hosts", type=int, default=2)
    p_up.add_argument("--net", default="", help="rate=100mbit,delay=1ms,loss=1%% (keys optional)")
    p_up.add_argument("--detach", action="store_true", help="leave it up and exit (delete with `down`)")
    sub.add_parser("list", help="every simnet namespace and link, with byte counters")
    p_down = sub.add_parser("down", help="delete one network (--name) or every leftover by prefix")
    p_down.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "check":
            reason = probe()
            if reason is not None:
                print(reason)
                return 2
            no_netem = probe(LinkSpec(delay="1ms"))
            no_loss = probe(LinkSpec(loss_pct=1.0))
            print(
                "simnet: ok (root, ip, tc, netns, veth, tbf rate limits); delay: "
                + ("ok (netem)" if no_netem is None else "unavailable: " + no_netem)
                + "; loss: "
                + ("ok (nftables)" if no_loss is None else "unavailable: " + no_loss)
            )
            return 0
        require_support()
        if a.cmd == "list":
            found = list_all()
            for ns in found["namespaces"]:
                addrs = _run(["ip", "-n", ns, "-o", "-4", "addr", "show", "dev", IFNAME], check=False).stdout.split()
                addr = addrs[3] if len(addrs) > 3 else "-"
                print(f"namespace {ns}  {IFNAME} {addr}")
            for link in found["links"]:
                st = Path(f"/sys/class/net/{link}/statistics")
                print(f"link {link}  rx {int((st / 'rx_bytes').read_text()):,} B  tx {int((st / 'tx_bytes').read_text()):,} B")
            for table in found["nft_tables"]:
                print(f"nft table netdev {table}  dropped {dropped_packets(table):,} packets")
            if not found["namespaces"] and not found["links"]:
                print("simnet: nothing")
            return 0
        if a.cmd == "down":
            gone = down_all(a.name)
            print("simnet: deleted " + (", ".join(gone) if gone else "nothing"))
            return 0
        net = SimNet(a.name, a.hosts, LinkSpec.parse(a.net))
        if a.detach:
            net.up()
            print(
                f"simnet: {net.hosts} hosts up ({net.link}); bridge {net.bridge} {net.bridge_addr}; "
                + ", ".join(f"{net.ns(i)} {net.host_addr(i)}" for i in range(net.hosts))
            )
            return 0
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
        with net:
            print(
                f"simnet: {net.hosts} hosts up ({net.link}); bridge {net.bridge} {net.bridge_addr}; "
                + ", ".join(f"{net.ns(i)} {net.host_addr(i)}" for i in range(net.hosts))
                + "; Ctrl-C to delete",
                flush=True,
            )
            while True:
                time.sleep(3600)
    except SimNetError as e:
        print(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("simnet: interrupted; deleted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
