"""Process helpers the multi-process tests share: the tree of processes a launch started (from
/proc), killing that tree at once, waiting for a file a running job writes, and the output of the
processes a launcher running in the test process starts, a snippet run in a fresh interpreter
(what importing a module pulls in of its own accord), and the gloo worker processes of a test
(`start_workers`). (A free port for a rendezvous is `recsys.training.distributed.free_port`.)"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import tempfile
import threading
import time
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support.cli import run_main
from tests.support.zygote import PRELOAD

REPO = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> list[int]:
    """pid and all its descendants, from /proc (torchrun starts its workers in new sessions, so
    killing the launcher's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL the whole tree at once, like a node losing power."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``path`` exists; fails if ``proc`` ends first or ``timeout`` seconds pass."""
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training ended before {path} appeared")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


@dataclasses.dataclass
class ChildOutput:
    """What the processes started inside a `child_output` block wrote to their stdout and stderr."""

    stdout: str = ""
    stderr: str = ""


@contextlib.contextmanager
def child_output() -> Iterator[ChildOutput]:
    """For the block, file descriptors 1 and 2 of this process (which the processes it starts
    inherit) write to temporary files; afterwards the returned object holds what was written.
    Python's own `sys.stdout` / `sys.stderr` are not touched (`tests/support/cli.py` redirects
    those), so a launcher called in this process gives its own lines there and its torchrun's and
    workers' lines here."""
    got = ChildOutput()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            yield got
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for f, field in ((out, "stdout"), (err, "stderr")):
                f.seek(0)
                setattr(got, field, f.read().decode(errors="replace"))


def run_main_and_children(module: str, *args: str, cwd: str | Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`tests/support/cli.py`'s `run_main` for a command that starts processes (`recsys train`
    starts torchrun and its workers): what `subprocess.run` would return, with the command's own
    lines first and then those of the processes it started. After `timeout` seconds every process
    this one started is killed (`subprocess.run`'s timeout kills the command itself), so a hung job
    fails the test instead of stopping the suite."""
    me = os.getpid()

    def kill_children() -> None:
        for p in descendants(me)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill_children)
    watchdog.daemon = True
    with child_output() as children:
        watchdog.start()
        try:
            r = run_main(module, *args, cwd=cwd)
        finally:
            watchdog.cancel()
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout + children.stdout, r.stderr + children.stderr)


def fresh_python(code: str, *, path: Sequence[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` run by a new interpreter in the repository root, with nothing imported yet: the
    repository (then ``path``) on its import path, PATH=/usr/bin:/bin and no other environment,
    so no variable of the test process (TRITON_INTERPRET, RECSYS_*) leaks in."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), *path]), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


# what a test's worker process imports anyway: the forkserver imports it once (below), as the
# torchrun workers' zygote does
WORKER_PRELOAD = PRELOAD


def start_workers(fn: Callable[..., Any], args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (``fn(i, *args)`` in process
    ``i``; a worker's exception fails the call with its traceback), the processes forked from a
    forkserver that imported torch, torchrec, fbgemm and recsys once per test process
    (``WORKER_PRELOAD``): a spawned worker spends ~4.5 CPU-s importing them before it does any
    work, a forked one nothing. The workers are real processes with their own gloo process group,
    started, like spawned ones, with the test process's current environment and directory."""
    import multiprocessing

    import torch.multiprocessing as mp

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    mp.start_processes(_in_callers_env, args=(fn, dict(os.environ), os.getcwd(), args), nprocs=nprocs, start_method="forkserver")


def _in_callers_env(i: int, fn: Callable[..., Any], env: dict[str, str], cwd: str, args: tuple) -> None:
    """A forked worker: the forkserver's environment and directory are those of the moment it
    started; the worker takes the caller's of now."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(i, *args)
