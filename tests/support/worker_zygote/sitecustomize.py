"""The other half of ``tests/support/zygote.py``: a Python process that a test, a launcher or
torchrun starts to run a torchrun agent, ``-m recsys.train`` or a test's ``*_worker.py`` hands its
job to the test process's zygote, which forks a process with torch, torchrec, fbgemm and recsys
imported already, and stands in for that process until it ends: signals it gets are passed on,
and it exits the way that process did (the same code, or the same signal). That process uses this
one's stdin, stdout and stderr (passed over the socket), directory and environment.

Active only where the tests put this directory on PYTHONPATH and set ``RECSYS_TEST_ZYGOTE`` (the
zygotes' sockets); what the zygote cannot stand for starts as usual. Standard library only: it
runs before anything else is imported.
"""

from __future__ import annotations

import os


# the torchrun agents (torch's and the one `recsys train` starts) and the training worker
MODULES = ("torch.distributed.run", "recsys.training.torchrun_quiet", "recsys.train")


def _command() -> list[str] | None:
    """What this interpreter was asked to run, if the zygote can stand for it: ``["-m", one of
    MODULES, *args]`` or ``[tests/support/*_worker.py, *args]``; else None."""
    try:
        argv = open("/proc/self/cmdline", "rb").read().split(b"\0")[:-1]
    except OSError:
        return None
    args = [a.decode(errors="surrogateescape") for a in argv[1:]]
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c", "-"):
        i += 2 if args[i] in ("-W", "-X") else 1
    if i >= len(args) or args[i] in ("-c", "-"):
        return None
    if args[i] == "-m":
        return args[i:] if i + 1 < len(args) and args[i + 1] in MODULES else None
    return args[i:] if "/tests/support/" in os.path.realpath(args[i]) and args[i].endswith("_worker.py") else None


def _hand_over(sock_path: str, command: list[str]) -> None:
    import json
    import signal
    import socket
    import sys
    import time

    socks = sock_path.split(os.pathsep)  # one zygote per hash seed: rank r goes to zygote r mod n
    rank = os.environ.get("RANK", "0")
    sock_path = socks[int(rank) % len(socks) if rank.isdigit() else 0]
    pid_file = sock_path + ".pid"
    t0 = time.monotonic()
    while not os.path.exists(sock_path):  # the zygote is still importing: wait (no CPU spent)
        try:
            alive = os.path.exists(f"/proc/{int(open(pid_file).read())}")
        except (OSError, ValueError):
            alive = False
        if not alive or time.monotonic() - t0 > 120:
            return  # no zygote: start as usual
        time.sleep(0.05)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
    except OSError:
        return  # the zygote ended with its test process: start as usual
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    # held until they can be passed on (the worker's pid known, the handlers in place)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    header = {"command": command, "env": dict(os.environ), "cwd": os.getcwd(), "exe": os.path.realpath(sys.executable), "path": sys.path}
    socket.send_fds(s, [json.dumps(header).encode() + b"\n"], [0, 1, 2])
    reader = s.makefile("rb")
    first = reader.readline().decode().split(" ", 1)
    if first[0] != "pid":
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return  # refused (first[1] says why): start as usual

    # die (SIGTERM) with the parent, as recsys.train's main() does first and as `recsys train` has its
    # torchrun do; the SIGTERM is passed on to the forked process like any other
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def forward(sig: int, _frame: object) -> None:
        try:
            s.sendall(f"sig {sig}\n".encode())
        except OSError:
            pass

    for sig in forwarded:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if os.getppid() == 1:  # the parent died before PR_SET_PDEATHSIG took
        forward(signal.SIGTERM, None)
    line = reader.readline().decode().split()
    status = int(line[1]) if len(line) == 2 and line[0] == "exit" else -int(signal.SIGKILL)
    if status < 0:  # ended by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def _main() -> None:
    sock_path = os.environ.get("RECSYS_TEST_ZYGOTE")
    if not sock_path:
        return
    command = _command()
    if command is not None:
        _hand_over(sock_path, command)


_main()
