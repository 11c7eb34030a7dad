"""A zygote for the torchrun agents and training workers that the integration tests launch.

A worker that torchrun starts (``python -u -m recsys.train ...``) spends ~4.5 CPU-s importing
torch, torchrec, fbgemm and recsys before its first line of work, an agent ~1.7 CPU-s importing
torch; the integration tier starts ~130 workers and ~70 agents, most of its time on a 2-core
machine. Here a process per test process (the zygote; two, with different hash seeds, so the
ranks of a job do not share one) imports them once. The Python process that torchrun or a
launcher starts hands its job over at interpreter start-up
(``tests/support/worker_zygote/sitecustomize.py``), the zygote forks a process for it, and the
started process stands in for that one until it ends.

What stays real: torchrun and its rendezvous, the agent's and the worker's processes, their gloo
process groups, their stdin/stdout/stderr (the same file descriptors), environment, directory and
arguments, the module's own ``main`` (run as ``-m`` runs it), signals (passed on by the stand-in)
and exit status (the stand-in exits the same way). What differs: the process is a child of the
zygote, not of its launcher, so tests whose subject is the process tree (killing a tree, parent
death) start real ones (``real_worker_processes``), and a request the zygote cannot stand for
(another interpreter or checkout, other import-time settings, a launcher in another process whose
run lock only its descendants may take) starts as usual.

Per connection the zygote forks a reaper, which forks the process, passes on the stand-in's
signals, kills the process if the stand-in disappears (SIGKILL, as a killed tree would), and
reports its status.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# not resolved: where tests/ is linked into another directory (CI's stack tier, beside an installed
# wheel), the zygote imports what the tests there import
REPO = Path(__file__).absolute().parents[2]
SITE_DIR = Path(__file__).absolute().parent / "worker_zygote"
ENV_SOCKET = "RECSYS_TEST_ZYGOTE"
PRELOAD = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "torchrec.distributed", "recsys.optim", "recsys.training.trainer"]
# packages whose copy a worker must share with the zygote (the same files), and environment keys read
# when those are imported (a worker asking for other values starts as usual)
SAME_FILES = ["recsys", "sharding", "torch", "torchrec", "fbgemm_gpu"]
IMPORT_TIME_ENV = ("TRITON_", "TORCH_", "PYTORCH_", "CUDA", "FBGEMM", "LD_", "RECSYS_EXT_DIR", "XDG_CACHE_HOME", "PYTHON", "MKL_", "KMP_")
ENV_NOT_COMPARED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "TORCH_NCCL_")  # set per launch, read at run time


def start(env: dict[str, str], count: int = 2) -> tuple[list[subprocess.Popen], Path, dict[str, str]]:
    """Starts ``count`` zygotes, each with its own hash seed (a worker of rank r goes to zygote
    r mod count, so the ranks of a job do not share one, as processes started apart do not);
    returns them, their directory and the environment keys that send this process's children to
    them (PYTHONPATH with the stand-in first, the sockets)."""
    where = Path(tempfile.mkdtemp(prefix="recsys-zygote-"))
    seeds = random.SystemRandom().sample(range(1, 2**32), count)
    procs, socks = [], []
    for i, seed in enumerate(seeds):
        sock = str(where / f"s{i}")
        zenv = {k: v for k, v in env.items() if k != ENV_SOCKET}
        zenv["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        zenv["PYTHONHASHSEED"] = str(seed)
        procs.append(
            subprocess.Popen([sys.executable, "-u", "-m", "tests.support.zygote", sock], cwd=REPO, env=zenv, stdin=subprocess.DEVNULL)
        )
        Path(sock + ".pid").write_text(str(procs[-1].pid))  # a stand-in waits for the socket while this pid lives
        socks.append(sock)
    extra = {ENV_SOCKET: os.pathsep.join(socks), "PYTHONPATH": os.pathsep.join([str(SITE_DIR), *filter(None, [env.get("PYTHONPATH")])])}
    return procs, where, extra


def _loaded() -> dict[str, str | None]:
    """The files of SAME_FILES this zygote imported."""
    return {name: getattr(sys.modules.get(name), "__file__", None) for name in SAME_FILES}


def _found(path: list[str]) -> dict[str, str | None]:
    """The files of SAME_FILES that a new interpreter with ``path`` as sys.path would import: the
    import system's finders asked in their order, not this process's imported modules."""
    saved = sys.path[:]
    sys.path[:] = path
    try:
        out: dict[str, str | None] = {}
        for name in SAME_FILES:
            out[name] = None
            for finder in sys.meta_path:
                spec = finder.find_spec(name, None) if hasattr(finder, "find_spec") else None
                if spec is not None:
                    out[name] = spec.origin
                    break
        return out
    finally:
        sys.path[:] = saved


def _refusal(req: dict, mine: dict[str, str | None]) -> str | None:
    """Why this zygote cannot stand for the request's process, or None."""
    if req["exe"] != os.path.realpath(sys.executable):
        return f"another interpreter ({req['exe']})"
    theirs = _found([req["cwd"], *req["path"]])
    for name in SAME_FILES:
        if theirs[name] != mine[name]:
            return f"another {name} ({theirs[name]})"
    from recsys.training.run_dir import LAUNCHER_ENV, _ancestors  # the run lock's own rule

    launcher = req["env"].get(LAUNCHER_ENV, "")
    if launcher.isdigit() and int(launcher) not in _ancestors(os.getpid()):
        # a `recsys train` launcher in its own process: its workers take its run lock only as its descendants
        return f"the launcher {launcher} is not the zygote's ancestor"
    if "PYTHONHASHSEED" in req["env"]:
        return "PYTHONHASHSEED is set (each zygote has its own)"
    for k in set(req["env"]) | set(os.environ):
        if k.startswith(IMPORT_TIME_ENV) and not k.startswith(ENV_NOT_COMPARED) and req["env"].get(k) != os.environ.get(k):
            return f"{k}={req['env'].get(k)!r} (the zygote has {os.environ.get(k)!r})"
    return None


_FRESH: dict = {}


def _remember_fresh_interpreter_state() -> None:
    """Before the preload: what a new interpreter has that importing or logging may change."""
    import logging
    import warnings

    _FRESH["warnings"] = list(warnings.filters)
    _FRESH["root"] = (list(logging.root.handlers), logging.root.level)


def _fresh_interpreter_state() -> None:
    """In the worker: random generators, warning filters and the root logger as a new interpreter has them (a
    message logged during the preload configures the root logger, and ``logging.basicConfig`` in
    the worker's ``main`` would then do nothing)."""
    import logging
    import warnings

    import numpy
    import torch

    torch.seed()  # a new process seeds torch's default generator from the OS
    numpy.random.seed()  # numpy seeds its global generator from the OS when it is imported
    warnings.filters[:] = _FRESH["warnings"]
    getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' cache (CPython 3.11-3.13)
    logging.root.handlers[:] = _FRESH["root"][0]
    logging.root.setLevel(_FRESH["root"][1])


def _run_worker(req: dict, fds: list[int]) -> None:
    """In the forked worker: become the requested process and run its command; never returns."""
    code = 1
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _fresh_interpreter_state()
        command = req["command"]
        import runpy
        import types

        sys.modules["__main__"] = types.ModuleType("__main__")  # not the zygote's own namespace
        try:
            if command[0] == "-m":
                sys.argv = ["-m", *command[2:]]
                sys.path[:] = [req["cwd"], *req["path"]]
                runpy._run_module_as_main(command[1])
            else:
                sys.argv = list(command)
                sys.path[:] = [str(Path(command[0]).resolve().parent), *req["path"]]
                runpy.run_path(command[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            code = -int(signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        # what interpreter exit does that matters to a worker: non-daemon threads, atexit, flushed streams
        import threading

        with contextlib.suppress(BaseException):
            threading._shutdown()
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                f.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _reap(conn: socket.socket, mine: dict[str, str | None]) -> None:
    """In the reaper (one per worker): fork the worker, pass on signals, report its status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            os._exit(0)
        msg += more
    req = json.loads(msg)
    why = _refusal(req, mine)
    with open(os.path.join(os.path.dirname(_SOCK[0]), "log"), "a") as log:  # what was served, for counting
        test = req["env"].get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        log.write(f"{test}\t{'served' if why is None else 'refused: ' + why}\n")
    if why is not None:
        conn.sendall(f"refuse {why}\n".encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_worker(req, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    pidfd = os.pidfd_open(pid)
    buf = b""
    watch = [conn, pidfd]
    while True:
        ready, _, _ = select.select(watch, [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        data = conn.recv(4096)
        if not data:  # the stand-in is gone (killed): the worker goes too, as in a killed tree
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            watch = [pidfd]
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            kind, _, value = line.decode().partition(" ")
            if kind == "sig":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, int(value))


_SOCK: list[str] = []


def serve(sock_path: str) -> None:
    import importlib

    _SOCK.append(sock_path)
    _remember_fresh_interpreter_state()
    for name in PRELOAD:
        importlib.import_module(name)
    mine = _loaded()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reapers are reaped by the kernel
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path + ".tmp")
    os.rename(sock_path + ".tmp", sock_path)
    srv.listen(64)
    srv.settimeout(5.0)
    while os.getppid() == parent:  # ends with the test process
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            srv.close()
            try:
                _reap(conn, mine)
            finally:
                os._exit(0)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
