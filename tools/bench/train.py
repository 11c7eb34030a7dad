"""Training-throughput benchmark: our sharded DeepFM vs DeepCTR-Torch vs the dense floor.

Why three systems:
  * ours          `recsys train` (TorchRec DMP, FBGEMM fused rowwise-Adagrad tables, dense Adam,
                  TrainPipelineSparseDist) with 1 and 2 processes: what users actually run;
  * DeepCTR-Torch the same DeepFM (dim 16, DNN 400-400-400, 13 dense + 26 sparse fields, the same
                  table sizes, Adam) in the widely used reference library (PyPI deepctr-torch
                  0.3.0), one process: what "a plain PyTorch CTR trainer" costs;
  * dense floor   the DNN alone (429 -> 400 -> 400 -> 400 -> 1, BCE-with-logits, Adam) on random
                  inputs: the tower is the bulk of the arithmetic, so no end-to-end DeepFM
                  figure can beat it on this machine. It tells how much of the machine we use.

Each configuration runs in its own subprocess (so its memory is its own, and a crash or a hang
costs only that row), one at a time, with a timeout. Peak memory is measured from outside by
polling /proc every 0.2 s over the whole process tree (launcher, torchrun agent and ranks).

    .venv/bin/python tools/bench/train.py --quick            # ~2 minutes: checks the script
    .venv/bin/python tools/bench/train.py --out bench.json   # the full grid (see --help)

The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "experiments" / "demo.yaml"
SETTINGS = ("criteo_kaggle_filtered", "criteo_kaggle_raw")
SHORT = {"criteo_kaggle_filtered": "filtered", "criteo_kaggle_raw": "raw"}
NUM_DENSE, EMB_DIM, DNN = 13, 16, (400, 400, 400)
TARGET_BATCH = 8192
MB = 1024.0 * 1024.0

# The acceptance targets (evaluated at batch 8K; do not weaken).
FILTERED_MIN_FRACTION_OF_FLOOR = 0.75
FILTERED_MIN_SPEEDUP_VS_DEEPCTR = 1.5
RAW_MIN_SPEEDUP_VS_DEEPCTR = 20.0
RAW_MAX_MEMORY_FRACTION_OF_DEEPCTR = 0.5


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class MemoryReading:
    """Memory of one process tree, from /proc. `peak_mb` sums every process's own high-water mark
    (VmHWM): an upper bound on the tree's simultaneous peak that cannot miss a short spike;
    `sampled_peak_mb` is the largest simultaneous VmRSS sum seen at a 0.2 s poll (a lower bound);
    `train_peak_mb` is `peak_mb` when the last train record appeared (before eval/checkpoint)."""

    peak_mb: float | None = None
    sampled_peak_mb: float | None = None
    train_peak_mb: float | None = None
    processes: int = 0


@dataclass
class RunResult:
    """One measured configuration. `status`: ok | error | skipped | missing."""

    system: str  # ours | deepctr_torch | dense_floor
    setting: str  # table-size preset ("-" for the dense floor, which has no tables)
    batch: int
    nproc: int
    status: str = "ok"
    samples_per_s: float | None = None  # median over the measured windows / steps
    windows: list[float] = field(default_factory=list)  # samples/s of every measured window
    warmup_windows: list[float] = field(default_factory=list)  # discarded
    memory: MemoryReading = field(default_factory=MemoryReading)
    wall_s: float = 0.0
    detail: str = ""  # error text, skip reason, or notes

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.samples_per_s is not None


@dataclass
class StepPlan:
    """How long one `recsys train` run is: `records` train records of `log_every` steps each; the
    first `warmup_records` are discarded (pipeline fill, first-touch allocations, lazy init)."""

    log_every: int
    records: int
    warmup_records: int = 1

    @property
    def max_steps(self) -> int:
        return self.log_every * self.records


def ours_plan(batch: int, quick: bool) -> StepPlan:
    """~64K samples per window (at least 2 steps), 5 windows (4 at >= 64K), first one dropped."""
    if quick:
        return StepPlan(log_every=5, records=4)
    log_every = max(2, min(25, round(65536 / batch)))
    return StepPlan(log_every=log_every, records=4 if batch >= 65536 else 5)


@dataclass
class ChildPlan:
    """Step loop of an in-process child (DeepCTR-Torch, dense floor): `warmup` untimed steps, then
    timed steps until both `min_steps` and `min_time_s` are reached, or `max_steps`/`max_time_s`."""

    warmup: int
    min_steps: int
    min_time_s: float
    max_steps: int
    max_time_s: float


def floor_plan(quick: bool) -> ChildPlan:
    if quick:
        return ChildPlan(warmup=2, min_steps=3, min_time_s=1.0, max_steps=20, max_time_s=5.0)
    return ChildPlan(warmup=3, min_steps=5, min_time_s=5.0, max_steps=200, max_time_s=20.0)


def deepctr_plan(setting: str, quick: bool) -> ChildPlan:
    """The raw tables make every DeepCTR-Torch step touch ~34M rows (dense gradients, L2 on whole
    tables, Adam on whole tables): a few steps only."""
    if quick:
        return ChildPlan(warmup=1, min_steps=3, min_time_s=1.0, max_steps=10, max_time_s=10.0)
    if setting == "criteo_kaggle_raw":
        return ChildPlan(warmup=1, min_steps=2, min_time_s=0.0, max_steps=3, max_time_s=45.0)
    return ChildPlan(warmup=2, min_steps=3, min_time_s=5.0, max_steps=30, max_time_s=30.0)


# ---------------------------------------------------------------------------------------------
# Process-tree memory and subprocess handling


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # The command name may contain spaces or parentheses: the fields follow the last ')'.
            out[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppid_map().items():
        children.setdefault(ppid, []).append(pid)
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(children.get(pid, ()))
    return seen


def _status_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in kB, or None for a process that is gone (or a zombie without memory)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    rss = hwm = None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    if rss is None or hwm is None:
        return None
    return rss, hwm


class TreeMonitor(threading.Thread):
    """Polls /proc every `interval` s for the process tree under `root`; optionally watches a
    metrics.jsonl for the moment the last expected train record lands."""

    def __init__(self, root: int, interval: float = 0.2, metrics: Path | None = None, train_records: int = 0) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.metrics, self.train_records = metrics, train_records
        self.hwm_kb: dict[int, int] = {}
        self.sampled_peak_kb = 0
        self.train_peak_kb: int | None = None
        self._metrics_size = -1
        self._stop_event = threading.Event()

    def _train_done(self) -> bool:
        if self.metrics is None or not self.train_records:
            return False
        try:
            size = self.metrics.stat().st_size
        except OSError:
            return False
        if size == self._metrics_size:
            return False
        self._metrics_size = size
        n = sum(1 for line in self.metrics.read_text().splitlines() if '"kind": "train"' in line or '"kind":"train"' in line)
        return n >= self.train_records

    def sample(self) -> None:
        total = 0
        for pid in _tree(self.root):
            st = _status_kb(pid)
            if st is None:
                continue
            total += st[0]
            self.hwm_kb[pid] = max(self.hwm_kb.get(pid, 0), st[1])
        self.sampled_peak_kb = max(self.sampled_peak_kb, total)
        if self.train_peak_kb is None and self._train_done():
            self.train_peak_kb = sum(self.hwm_kb.values())

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> MemoryReading:
        self._stop_event.set()
        self.join(timeout=5)
        peak = sum(self.hwm_kb.values())
        return MemoryReading(
            peak_mb=peak / 1024 if peak else None,
            sampled_peak_mb=self.sampled_peak_kb / 1024 if self.sampled_peak_kb else None,
            train_peak_mb=self.train_peak_kb / 1024 if self.train_peak_kb else None,
            processes=len(self.hwm_kb),
        )


@dataclass
class Completed:
    returncode: int | None  # None: killed at the timeout
    log: str
    wall_s: float
    memory: MemoryReading


def run_monitored(
    cmd: Sequence[str],
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    metrics: Path | None = None,
    train_records: int = 0,
) -> Completed:
    """Runs `cmd` in its own session (so a timeout can end its whole tree by process group) with
    stdout+stderr to `log_path`, measuring the tree's memory while it runs."""
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        mon = TreeMonitor(proc.pid, metrics=metrics, train_records=train_records)
        mon.sample()
        mon.start()
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(proc)
        except BaseException:  # Ctrl-C: the child has its own session and would outlive us
            _kill_group(proc)
            raise
        finally:
            memory = mon.stop()
    return Completed(rc, log_path.read_text(errors="replace"), time.perf_counter() - t0, memory)


def _kill_group(proc: subprocess.Popen) -> None:
    """Ends the process group this script started for `proc` (its own session), and nothing else."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-1500:]


def _child_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "child" in obj:
                return obj
    return None


# ---------------------------------------------------------------------------------------------
# ours: `recsys train`


def recsys_command() -> list[str]:
    script = Path(sys.executable).parent / "recsys"
    return [str(script)] if script.exists() else [sys.executable, "-m", "recsys.cli"]


def bench_ours(
    setting: str,
    batch: int,
    nproc: int,
    plan: StepPlan,
    workdir: Path,
    timeout_s: float,
    micro_batch_rows: int | None = None,
    system: str = "ours",
) -> RunResult:
    """One `recsys train` run; throughput is the median samples/s of its train records after the
    warm-up ones (the loop measures each window excluding eval and checkpoint time).
    `micro_batch_rows`: train.micro_batch_rows (None: the config's default; 0: whole batches)."""
    res = RunResult(system, setting, batch, nproc)
    name = f"bench_{system}_{SHORT[setting]}_b{batch}_p{nproc}"
    run_dir = workdir / name
    eval_rows = max(8192, 2 * nproc)
    overrides = [
        f"name={name}",
        f"run_dir={run_dir}",
        "model.name=deepfm",
        f"model.embedding_dim={EMB_DIM}",
        f"model.dnn=[{','.join(map(str, DNN))}]",
        "model.dropout=0.0",
        "data.source=synthetic",
        f"data.cardinalities={setting}",
        f"data.train_rows={batch * plan.max_steps}",
        f"data.eval_rows={eval_rows}",
        f"train.batch_size={batch}",
        f"train.nproc_per_node={nproc}",
        f"train.max_steps={plan.max_steps}",
        f"train.log_every={plan.log_every}",
        "train.eval_every=0",
        f"train.eval_batch_size={eval_rows}",
        "train.device=cpu",
        "train.threads_per_rank=0",
        "checkpoint.every_steps=0",
        "resume=false",
    ] + ([f"train.micro_batch_rows={micro_batch_rows}"] if micro_batch_rows is not None else [])
    cmd = [*recsys_command(), "train", "--config", str(CONFIG), *overrides]
    metrics = run_dir / "metrics.jsonl"
    try:
        done = run_monitored(cmd, workdir / f"{name}.log", timeout_s, metrics=metrics, train_records=plan.records)
        res.wall_s, res.memory = done.wall_s, done.memory
        records = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("kind") == "train" and "samples_per_s" in rec:
                    records.append(rec)
        records.sort(key=lambda r: r["step"])
        rates = [float(r["samples_per_s"]) for r in records]
        res.warmup_windows, res.windows = rates[: plan.warmup_records], rates[plan.warmup_records :]
        if done.returncode is None:
            res.status, res.detail = "error", f"timed out after {timeout_s:.0f} s; log: {_tail(done.log)}"
        elif done.returncode != 0:
            res.status, res.detail = "error", f"exit code {done.returncode}: {_tail(done.log)}"
        elif not res.windows:
            res.status, res.detail = "error", f"no train records after the warm-up ({len(rates)} in all)"
        else:
            res.samples_per_s = statistics.median(res.windows)
            res.detail = f"{plan.max_steps} steps, log_every {plan.log_every}"
    except Exception as e:  # noqa: BLE001 - one failed row must not stop the grid
        res.status, res.detail = "error", f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------------------
# In-process children: DeepCTR-Torch and the dense floor (run as `bench_train.py --child ...`)


def _timed_loop(step: Callable[[], None], plan: ChildPlan) -> dict[str, Any]:
    """Calls `step()` `plan.warmup` times untimed, then times single steps (the step itself
    synchronises: .item() on CPU tensors)."""
    warm = []
    for _ in range(plan.warmup):
        t = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t)
    times: list[float] = []
    t_start = time.perf_counter()
    while True:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t_start
        if len(times) >= plan.max_steps or elapsed >= plan.max_time_s:
            break
        if len(times) >= plan.min_steps and elapsed >= plan.min_time_s:
            break
    return {"warmup_step_s": warm, "step_s": times}


def _child_dense(batch: int, threads: int, plan: ChildPlan) -> dict[str, Any]:
    """The DNN tower alone. The input does not require grad (no dX for the first layer), so this
    is a slight over-estimate of the tower's share of a DeepFM step: a true upper bound."""
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    in_features = NUM_DENSE + 26 * EMB_DIM  # 429
    layers: list[nn.Module] = []
    width = in_features
    for h in DNN:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    mlp = nn.Sequential(*layers, nn.Linear(width, 1))
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    x = torch.randn(batch, in_features)
    y = torch.randint(0, 2, (batch,)).float()

    def step() -> None:
        loss = nn.functional.binary_cross_entropy_with_logits(mlp(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()

    return _timed_loop(step, plan)


def _child_deepctr(setting: str, batch: int, threads: int, plan: ChildPlan) -> dict[str, Any]:
    """DeepCTR-Torch's DeepFM with its defaults (l2 on embeddings, dense nn.Embedding gradients,
    `compile("adam", "binary_crossentropy")`), one step exactly as `BaseModel.fit` does it (minus
    metrics and the DataLoader: batches are pre-generated, which only favours the reference)."""
    import types

    # deepctr_torch checks PyPI for a newer version in a thread at import: keep it off the network.
    fake = types.ModuleType("requests")

    def _offline(*_a: Any, **_k: Any) -> Any:
        raise OSError("network disabled by bench_train")

    fake.get = _offline  # type: ignore[attr-defined]
    sys.modules.setdefault("requests", fake)
    try:
        import deepctr_torch
        from deepctr_torch.inputs import DenseFeat, SparseFeat
        from deepctr_torch.models import DeepFM
    except Exception as e:  # noqa: BLE001 - reported as "missing" by the parent
        return {"missing": f"{type(e).__name__}: {e}"}
    for t in threading.enumerate():  # let the version-check thread finish printing
        if t is not threading.current_thread():
            t.join(timeout=5)
    import torch

    sys.path.insert(0, str(REPO))
    from recsys.config import CARDINALITY_PRESETS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cards = CARDINALITY_PRESETS[setting]
    t0 = time.perf_counter()
    sparse = [SparseFeat(f"C{i + 1}", vocabulary_size=c, embedding_dim=EMB_DIM) for i, c in enumerate(cards)]
    dense = [DenseFeat(f"I{i + 1}", 1) for i in range(NUM_DENSE)]
    columns = sparse + dense
    model = DeepFM(columns, columns, dnn_hidden_units=DNN, task="binary", device="cpu")
    model.compile("adam", "binary_crossentropy")
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    width = max(end for _, end in model.feature_index.values())
    batches = []
    for _ in range(2):
        x = torch.empty(batch, width)
        for feat in columns:
            lo, hi = model.feature_index[feat.name]
            if isinstance(feat, SparseFeat):
                x[:, lo:hi] = torch.randint(0, feat.vocabulary_size, (batch, hi - lo), generator=g).float()
            else:
                x[:, lo:hi] = torch.rand(batch, hi - lo, generator=g)
        batches.append((x, torch.randint(0, 2, (batch,), generator=g).float()))
    i = [0]
    model.train()

    def step() -> None:  # BaseModel.fit's inner loop
        x, y = batches[i[0] % 2]
        i[0] += 1
        y_pred = model(x).squeeze(-1)
        model.optim.zero_grad()
        loss = model.loss_func(y_pred, y, reduction="sum")
        total = loss + model.get_regularization_loss() + model.aux_loss
        loss.item()
        total.item()
        total.backward()
        model.optim.step()

    out = _timed_loop(step, plan)
    out.update(build_s=build_s, version=getattr(deepctr_torch, "__version__", "?"))
    return out


def child_main(args: argparse.Namespace) -> int:
    import resource

    plan = ChildPlan(**json.loads(args.child_plan))
    if args.child == "dense":
        out = _child_dense(args.child_batch, args.threads, plan)
    else:
        out = _child_deepctr(args.child_setting, args.child_batch, args.threads, plan)
    out["child"] = args.child
    out["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)
    return 0


def bench_child(
    kind: str, setting: str, batch: int, plan: ChildPlan, threads: int, workdir: Path, timeout_s: float
) -> tuple[RunResult, dict[str, Any]]:
    """Runs one DeepCTR-Torch / dense-floor measurement in a fresh interpreter; throughput is the
    median of the timed steps' samples/s."""
    system = "dense_floor" if kind == "dense" else "deepctr_torch"
    res = RunResult(system, setting, batch, 1)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--child-batch",
        str(batch),
        "--child-setting",
        setting,
        "--threads",
        str(threads),
        "--child-plan",
        json.dumps(asdict(plan)),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    info: dict[str, Any] = {}
    try:
        done = run_monitored(cmd, workdir / f"{system}_{SHORT.get(setting, 'x')}_b{batch}.log", timeout_s, env=env)
        res.wall_s, res.memory = done.wall_s, done.memory
        info = _child_json(done.log) or {}
        if "missing" in info:
            res.status, res.detail = "missing", f"deepctr-torch not importable ({info['missing']})"
        elif done.returncode is None:
            res.status, res.detail = "error", f"timed out after {timeout_s:.0f} s; log: {_tail(done.log)}"
        elif done.returncode != 0 or "step_s" not in info:
            res.status, res.detail = "error", f"exit code {done.returncode}: {_tail(done.log)}"
        else:
            res.windows = [batch / t for t in info["step_s"]]
            res.warmup_windows = [batch / t for t in info["warmup_step_s"]]
            res.samples_per_s = statistics.median(res.windows)
            # One process: its own exact high-water mark (ru_maxrss) is the peak.
            if info.get("ru_maxrss_mb"):
                res.memory.peak_mb = max(res.memory.peak_mb or 0.0, float(info["ru_maxrss_mb"]))
                res.memory.train_peak_mb = res.memory.peak_mb
            res.detail = f"{len(info['step_s'])} timed steps after {len(info['warmup_step_s'])} warm-up"
            if "build_s" in info:
                res.detail += f", model built in {info['build_s']:.1f} s"
    except Exception as e:  # noqa: BLE001
        res.status, res.detail = "error", f"{type(e).__name__}: {e}"
    return res, info


# ---------------------------------------------------------------------------------------------
# Orchestration and report


def _fmt_rate(x: float | None) -> str:
    return f"{x:>10,.0f}" if x is not None else f"{'-':>10}"


def _fmt_mb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1024:.2f} GB" if x >= 1024 else f"{x:.0f} MB"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt_ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def progress_line(i: int, n: int, r: RunResult) -> str:
    where = SHORT.get(r.setting, "-")
    head = f"[{i:>2}/{n}] {r.system:<13} {where:<8} batch {r.batch:>6} procs {r.nproc}"
    if r.ok:
        spread = f"windows {min(r.windows):,.0f}..{max(r.windows):,.0f}" if r.windows else ""
        return (
            f"{head}  {_fmt_rate(r.samples_per_s)} samples/s  peak {_fmt_mb(r.memory.peak_mb):>8}  ({spread}; {r.detail}; {r.wall_s:.0f} s)"
        )
    return f"{head}  {r.status.upper()}: {r.detail} ({r.wall_s:.0f} s)"


def _deepctr_estimate(prior: list[tuple[int, float, float]], batch: int, plan: ChildPlan) -> float | None:
    """Predicted wall seconds of a DeepCTR-Torch run from earlier runs at the same table sizes:
    step time fitted as a + b*batch, plus model build. Needs two batch sizes (at raw sizes a
    large fixed cost per step, whole-table L2 and Adam, makes a proportional guess far too high);
    None (no prediction: run it) otherwise."""
    if len({p[0] for p in prior}) < 2:
        return None
    build = max(p[2] for p in prior)
    xs, ys = [p[0] for p in prior], [p[1] for p in prior]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    step = max(my + slope * (batch - mx), max(ys) if batch >= max(xs) else min(ys))
    return build + step * (plan.warmup + plan.min_steps) + 5.0  # + interpreter start


def best_ours(results: list[RunResult], setting: str, batch: int) -> RunResult | None:
    ok = [r for r in results if r.system == "ours" and r.setting == setting and r.batch == batch and r.ok]
    return max(ok, key=lambda r: r.samples_per_s) if ok else None


def find(results: list[RunResult], system: str, setting: str, batch: int) -> RunResult | None:
    for r in results:
        if r.system == system and r.setting == setting and r.batch == batch:
            return r
    return None


def _ge(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a >= b


def evaluate_targets(results: list[RunResult], settings: Sequence[str], batches: Sequence[int]) -> dict[str, Any]:
    """The acceptance targets at batch 8K. A flag is null when a figure it needs was not measured
    (e.g. --quick, a failed run, or deepctr-torch not installed)."""
    b = TARGET_BATCH
    t: dict[str, Any] = {}
    floor = find(results, "dense_floor", "-", b)
    floor_v = floor.samples_per_s if floor and floor.ok else None
    if "criteo_kaggle_filtered" in settings and b in batches:
        ours = best_ours(results, "criteo_kaggle_filtered", b)
        ref = find(results, "deepctr_torch", "criteo_kaggle_filtered", b)
        o = ours.samples_per_s if ours else None
        rv = ref.samples_per_s if ref and ref.ok else None
        t["filtered_8k_ours_ge_0.75x_floor"] = _ge(o, None if floor_v is None else FILTERED_MIN_FRACTION_OF_FLOOR * floor_v)
        t["filtered_8k_ours_ge_1.5x_deepctr"] = _ge(o, None if rv is None else FILTERED_MIN_SPEEDUP_VS_DEEPCTR * rv)
    else:
        t["filtered_8k_ours_ge_0.75x_floor"] = t["filtered_8k_ours_ge_1.5x_deepctr"] = None
    speed = mem = mem_train = None
    chosen = None
    if "criteo_kaggle_raw" in settings and b in batches:
        ref = find(results, "deepctr_torch", "criteo_kaggle_raw", b)
        if ref and ref.ok and ref.memory.peak_mb:
            candidates = [r for r in results if r.system == "ours" and r.setting == "criteo_kaggle_raw" and r.batch == b and r.ok]

            # One configuration must meet both; prefer one that does, else the fastest.
            def verdict(r: RunResult) -> tuple[bool, bool]:
                return (
                    r.samples_per_s >= RAW_MIN_SPEEDUP_VS_DEEPCTR * ref.samples_per_s,
                    r.memory.peak_mb is not None and r.memory.peak_mb < RAW_MAX_MEMORY_FRACTION_OF_DEEPCTR * ref.memory.peak_mb,
                )

            if candidates:
                both = [r for r in candidates if all(verdict(r))]
                chosen = max(both or candidates, key=lambda r: r.samples_per_s)
                speed, mem = verdict(chosen)
                if chosen.memory.train_peak_mb is not None:
                    mem_train = chosen.memory.train_peak_mb < RAW_MAX_MEMORY_FRACTION_OF_DEEPCTR * ref.memory.peak_mb
    t["raw_8k_ours_ge_20x_deepctr"] = speed
    t["raw_8k_ours_memory_lt_0.5x_deepctr"] = mem
    t["raw_8k_judged_procs"] = chosen.nproc if chosen else None
    flags = [v for k, v in t.items() if k != "raw_8k_judged_procs"]
    # Informational, not part of all_pass: the same memory test on ours' training phase only
    # (DeepCTR-Torch's figure has no eval or checkpoint in it; ours' whole-run peak does).
    t["info_raw_8k_ours_train_phase_memory_lt_0.5x_deepctr"] = mem_train
    t["all_pass"] = None if any(v is None for v in flags) else all(flags)
    return t


def machine_info(threads: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "reference_threads": threads,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads_default"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        info["torch"] = None
    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            from importlib.metadata import version

            info[mod] = version({"torchrec": "torchrec", "fbgemm_gpu": "fbgemm-gpu-cpu"}[mod])
        except Exception:  # noqa: BLE001
            info[mod] = None
    try:
        from importlib.metadata import version

        info["deepctr_torch"] = version("deepctr-torch")
    except Exception:  # noqa: BLE001
        info["deepctr_torch"] = None
    try:
        info["loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / MB, 1)
    except OSError:
        pass
    return info


def report(results: list[RunResult], settings: Sequence[str], batches: Sequence[int], procs: Sequence[int], threads: int) -> dict[str, Any]:
    """Prints the table, ratios, memory comparison and targets; returns the headline dict."""
    print("\n=== Throughput (samples/s; median of measured windows) ===")
    cols = [f"ours p{p}" for p in procs] + ["ours best", "DeepCTR", "floor", "best/DeepCTR", "best/floor"]
    print(f"{'setting':<9}{'batch':>7} " + "".join(f"{c:>13}" for c in cols))
    headline: dict[str, Any] = {"ours": {}, "deepctr_torch": {}, "dense_floor": {}, "ratios": {}, "peak_rss_mb": {}}
    for b in batches:
        f = find(results, "dense_floor", "-", b)
        headline["dense_floor"][str(b)] = f.samples_per_s if f and f.ok else None
    for s in settings:
        name = SHORT[s]
        for key in ("ours", "deepctr_torch", "ratios", "peak_rss_mb"):
            headline[key][name] = {}
        for b in batches:
            row = []
            ours_b: dict[str, Any] = {}
            mem_b: dict[str, Any] = {}
            for p in procs:
                r = next((x for x in results if x.system == "ours" and x.setting == s and x.batch == b and x.nproc == p), None)
                v = r.samples_per_s if r and r.ok else None
                ours_b[str(p)] = v
                mem_b[f"ours_p{p}"] = r.memory.peak_mb if r else None
                mem_b[f"ours_p{p}_train_phase"] = r.memory.train_peak_mb if r else None
                row.append(_fmt_rate(v))
            best = best_ours(results, s, b)
            bv = best.samples_per_s if best else None
            ours_b["best"], ours_b["best_procs"] = bv, best.nproc if best else None
            ref = find(results, "deepctr_torch", s, b)
            rv = ref.samples_per_s if ref and ref.ok else None
            mem_b["deepctr_torch"] = ref.memory.peak_mb if ref and ref.ok else None
            fv = headline["dense_floor"][str(b)]
            r_ref, r_floor = _ratio(bv, rv), _ratio(bv, fv)
            ref_cell = _fmt_rate(rv) if ref is None or ref.ok else f"{ref.status:>10}"
            row += [_fmt_rate(bv), ref_cell, _fmt_rate(fv), f"{_fmt_ratio(r_ref):>10}", f"{_fmt_ratio(r_floor):>10}"]
            print(f"{name:<9}{b:>7} " + "".join(f"{c:>13}" for c in row))
            headline["ours"][name][str(b)] = ours_b
            headline["deepctr_torch"][name][str(b)] = rv
            headline["ratios"][name][str(b)] = {"ours_over_deepctr": r_ref, "ours_over_floor": r_floor}
            headline["peak_rss_mb"][name][str(b)] = mem_b
    over = [
        (SHORT[s], b)
        for s in settings
        for b in batches
        if (r := _ratio((best_ours(results, s, b) or RunResult("", "", 0, 0)).samples_per_s, headline["dense_floor"][str(b)])) is not None
        and r > 1.0
    ]
    if over:
        print(
            f"note: ours above the dense floor at {over}: the floor is one process on {threads} threads; at small "
            f"batches 2 one-thread ranks can use the cores better, and a loaded machine makes single figures noisy"
        )
    skipped = [r for r in results if r.status in ("skipped", "missing", "error")]
    if skipped:
        print("\nNot measured:")
        for r in skipped:
            print(f"  {r.system} {SHORT.get(r.setting, '-')} batch {r.batch} procs {r.nproc}: {r.status}: {r.detail}")

    print("\n=== Peak memory (whole process tree; ours: sum of each process's VmHWM, incl. launcher/agent) ===")
    for s in settings:
        for b in batches:
            ref = find(results, "deepctr_torch", s, b)
            parts = []
            for p in procs:
                r = next((x for x in results if x.system == "ours" and x.setting == s and x.batch == b and x.nproc == p), None)
                if r and r.ok:
                    parts.append(f"ours p{p} {_fmt_mb(r.memory.peak_mb)} (train phase {_fmt_mb(r.memory.train_peak_mb)})")
            refm = ref.memory.peak_mb if ref and ref.ok else None
            best = min(
                (x for x in results if x.system == "ours" and x.setting == s and x.batch == b and x.ok and x.memory.peak_mb),
                key=lambda x: x.memory.peak_mb,
                default=None,
            )
            frac = _ratio(best.memory.peak_mb, refm) if best else None
            print(
                f"  {SHORT[s]:<8} batch {b:>6}: "
                + ", ".join(parts)
                + f"; DeepCTR {_fmt_mb(refm)}"
                + (f"; lowest ours / DeepCTR = {frac:.2f}" if frac is not None else "")
            )

    headline["micro_batching"] = report_micro_batching(results, settings, batches, procs)
    targets = evaluate_targets(results, settings, batches)
    print(f"\n=== Targets (batch {TARGET_BATCH}; ours = best of the process counts) ===")

    def verdict(v: bool | None) -> str:
        return "PASS" if v is True else "FAIL" if v is False else "n/a (not measured)"

    fo = best_ours(results, "criteo_kaggle_filtered", TARGET_BATCH)
    fl = find(results, "dense_floor", "-", TARGET_BATCH)
    fr = find(results, "deepctr_torch", "criteo_kaggle_filtered", TARGET_BATCH)
    print(
        f"  filtered: ours >= {FILTERED_MIN_FRACTION_OF_FLOOR} x dense floor: "
        f"{verdict(targets['filtered_8k_ours_ge_0.75x_floor'])}"
        f" ({_fmt_ratio(_ratio(fo.samples_per_s if fo else None, fl.samples_per_s if fl and fl.ok else None))})"
    )
    print(
        f"  filtered: ours >= {FILTERED_MIN_SPEEDUP_VS_DEEPCTR} x DeepCTR-Torch: "
        f"{verdict(targets['filtered_8k_ours_ge_1.5x_deepctr'])}"
        f" ({_fmt_ratio(_ratio(fo.samples_per_s if fo else None, fr.samples_per_s if fr and fr.ok else None))})"
    )
    rr = find(results, "deepctr_torch", "criteo_kaggle_raw", TARGET_BATCH)
    jp = targets["raw_8k_judged_procs"]
    judged = (
        next(
            (x for x in results if x.system == "ours" and x.setting == "criteo_kaggle_raw" and x.batch == TARGET_BATCH and x.nproc == jp),
            None,
        )
        if jp
        else None
    )
    ref_ok = rr is not None and rr.ok
    print(
        f"  raw:      ours >= {RAW_MIN_SPEEDUP_VS_DEEPCTR:.0f} x DeepCTR-Torch: {verdict(targets['raw_8k_ours_ge_20x_deepctr'])}"
        + (f" (procs {jp}: {_fmt_ratio(_ratio(judged.samples_per_s, rr.samples_per_s))})" if judged and ref_ok else "")
    )
    print(
        f"  raw:      ours peak memory < {RAW_MAX_MEMORY_FRACTION_OF_DEEPCTR} x DeepCTR-Torch's: "
        f"{verdict(targets['raw_8k_ours_memory_lt_0.5x_deepctr'])}"
        + (
            f" (procs {jp}: {_fmt_mb(judged.memory.peak_mb)} vs {_fmt_mb(rr.memory.peak_mb)}; whole run incl. the final"
            f" eval+checkpoint. Training phase only: {_fmt_mb(judged.memory.train_peak_mb)},"
            f" {verdict(targets['info_raw_8k_ours_train_phase_memory_lt_0.5x_deepctr'])}, for information)"
            if judged and ref_ok
            else ""
        )
    )
    print(f"  all targets: {verdict(targets['all_pass'])}")
    headline["targets"] = targets
    return headline


def report_micro_batching(
    results: list[RunResult], settings: Sequence[str], batches: Sequence[int], procs: Sequence[int]
) -> dict[str, Any]:
    """Large batches against the 8K batch (target: samples/s at 64K and 128K at least the 8K
    figure, best of the process counts), and, with --whole-batch-peer, each of ours' rows against
    the same run with whole batches."""
    out: dict[str, Any] = {}
    print(f"\n=== Large batches vs batch {TARGET_BATCH} (ours, best of the process counts) ===")
    for s in settings:
        name = SHORT[s]
        base = best_ours(results, s, TARGET_BATCH)
        per: dict[str, Any] = {}
        for b in batches:
            cur = best_ours(results, s, b)
            ratio = _ratio(cur.samples_per_s if cur else None, base.samples_per_s if base else None)
            entry: dict[str, Any] = {"over_8k": ratio}
            line = f"  {name:<8} batch {b:>6}: {_fmt_rate(cur.samples_per_s if cur else None).strip()}" + (
                f" = {_fmt_ratio(ratio).strip()} of batch {TARGET_BATCH}" if ratio is not None else ""
            )
            for p in procs:
                mb = next((x for x in results if x.system == "ours" and x.setting == s and x.batch == b and x.nproc == p), None)
                wh = next((x for x in results if x.system == "ours_whole" and x.setting == s and x.batch == b and x.nproc == p), None)
                if wh is None:
                    continue
                mv, wv = (mb.samples_per_s if mb and mb.ok else None), (wh.samples_per_s if wh.ok else None)
                entry[f"p{p}"] = {"micro": mv, "whole": wv, "micro_over_whole": _ratio(mv, wv)}
                line += (
                    f"; p{p} micro-batched {_fmt_rate(mv).strip()} vs whole {_fmt_rate(wv).strip()} ({_fmt_ratio(_ratio(mv, wv)).strip()})"
                )
            print(line)
            per[str(b)] = entry
        large = [per[str(b)]["over_8k"] for b in batches if b > TARGET_BATCH]
        per["large_ge_8k"] = None if not large or any(v is None for v in large) else all(v >= 1.0 for v in large)
        out[name] = per
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny check: batch 1024, filtered tables, few steps (< 3 min)")
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated global batch sizes (default 1024,8192,65536)",
    )
    p.add_argument(
        "--settings",
        type=lambda s: [x.strip() for x in s.split(",")],
        default=None,
        help=f"comma-separated table-size presets (default {','.join(SETTINGS)}; 'filtered'/'raw' accepted)",
    )
    p.add_argument(
        "--procs", type=lambda s: [int(x) for x in s.split(",")], default=None, help="comma-separated process counts for ours (default 1,2)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of DeepCTR-Torch and the dense floor (default 2)")
    p.add_argument("--skip-deepctr", action="store_true", help="do not run DeepCTR-Torch")
    p.add_argument(
        "--micro-batch-rows", type=int, default=None, help="train.micro_batch_rows of ours (default: the config's; 0: whole batches)"
    )
    p.add_argument(
        "--whole-batch-peer",
        action="store_true",
        help="also run ours with whole batches (train.micro_batch_rows=0) as a peer: the micro-batching gain",
    )
    p.add_argument(
        "--deepctr-budget-s",
        type=float,
        default=120.0,
        help="at raw table sizes, skip a DeepCTR-Torch run predicted (from its smaller batches) to take longer than this (default 120)",
    )
    p.add_argument("--timeout-s", type=float, default=None, help="per-run timeout (default: by table size)")
    p.add_argument("--out", type=Path, default=None, help="also write the full results as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the run logs")
    # internal: child processes
    p.add_argument("--child", choices=("dense", "deepctr"), help=argparse.SUPPRESS)
    p.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-setting", default="-", help=argparse.SUPPRESS)
    p.add_argument("--child-plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    alias = {"filtered": "criteo_kaggle_filtered", "raw": "criteo_kaggle_raw"}
    if args.settings is not None:
        args.settings = [alias.get(s, s) for s in args.settings]
        bad = [s for s in args.settings if s not in SETTINGS]
        if bad:
            p.error(f"unknown setting(s) {bad}; choose from {', '.join(SETTINGS)}")
    # Ascending, so that DeepCTR-Torch's small batches can predict (and skip) its slow big ones.
    args.batch_sizes = sorted(set(args.batch_sizes or ([1024] if args.quick else [1024, 8192, 65536])))
    args.settings = args.settings or (["criteo_kaggle_filtered"] if args.quick else list(SETTINGS))
    args.procs = args.procs or [1, 2]
    if any(b <= 0 or any(b % n for n in args.procs) for b in args.batch_sizes):
        p.error("every batch size must be positive and divisible by every process count")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    t_start = time.perf_counter()
    info = machine_info(args.threads)
    print(
        f"bench_train: {info.get('cpu_count')} CPUs, torch {info.get('torch')}, torchrec {info.get('torchrec')}, "
        f"fbgemm {info.get('fbgemm_gpu')}, deepctr-torch {info.get('deepctr_torch') or 'NOT INSTALLED'}; "
        f"settings {[SHORT[s] for s in args.settings]}, batches {args.batch_sizes}, procs {args.procs}"
        + (" (quick)" if args.quick else ""),
        flush=True,
    )
    load = info.get("loadavg_1m_at_start")
    if load is not None and load > 0.5:
        print(f"warning: load average {load} before start: other work is running, figures will be low and noisy", flush=True)
    if info.get("cpu_count") != args.threads:
        print(
            f"note: reference/floor use {args.threads} threads but this machine has {info.get('cpu_count')} CPUs "
            f"(ours uses all of them); pass --threads to match",
            flush=True,
        )

    jobs: list[tuple[str, str, int, int]] = [("dense_floor", "-", b, 1) for b in args.batch_sizes]
    for s in args.settings:
        for b in args.batch_sizes:
            jobs += [("ours", s, b, p) for p in args.procs]
            if args.whole_batch_peer:
                jobs += [("ours_whole", s, b, p) for p in args.procs]
            if not args.skip_deepctr:
                jobs.append(("deepctr_torch", s, b, 1))
    workdir = Path(tempfile.mkdtemp(prefix="bench_train_"))
    results: list[RunResult] = []
    deepctr_missing: str | None = None
    deepctr_prior: dict[str, list[tuple[int, float, float]]] = {}
    try:
        for i, (system, s, b, p) in enumerate(jobs, 1):
            raw = s == "criteo_kaggle_raw"
            timeout = args.timeout_s or (240.0 if args.quick else 900.0 if raw else 600.0)
            if system == "ours":
                r = bench_ours(s, b, p, ours_plan(b, args.quick), workdir, timeout, args.micro_batch_rows)
            elif system == "ours_whole":
                r = bench_ours(s, b, p, ours_plan(b, args.quick), workdir, timeout, 0, system="ours_whole")
            elif system == "dense_floor":
                r, _ = bench_child("dense", "-", b, floor_plan(args.quick), args.threads, workdir, timeout)
            else:
                plan = deepctr_plan(s, args.quick)
                est = _deepctr_estimate(deepctr_prior.get(s, []), b, plan)
                if deepctr_missing:
                    r = RunResult(system, s, b, 1, status="missing", detail=deepctr_missing)
                elif raw and b != TARGET_BATCH and est is not None and est > args.deepctr_budget_s:
                    r = RunResult(
                        system,
                        s,
                        b,
                        1,
                        status="skipped",
                        detail=f"predicted {est:.0f} s from its smaller batches > --deepctr-budget-s {args.deepctr_budget_s:.0f}",
                    )
                else:
                    r, child = bench_child("deepctr", s, b, plan, args.threads, workdir, timeout)
                    if r.status == "missing":
                        deepctr_missing = r.detail
                    elif r.ok:
                        deepctr_prior.setdefault(s, []).append((b, statistics.median(child["step_s"]), float(child.get("build_s", 0.0))))
            results.append(r)
            print(progress_line(i, len(jobs), r), flush=True)
        headline = report(results, args.settings, args.batch_sizes, args.procs, args.threads)
    finally:
        if args.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.perf_counter() - t_start
    try:
        info["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    print(f"\ntotal wall time {total_s / 60:.1f} min")
    headline = {
        "benchmark": "bench_train",
        "quick": args.quick,
        "machine": info,
        "settings": [SHORT[s] for s in args.settings],
        "batch_sizes": args.batch_sizes,
        "procs": args.procs,
        "samples_per_s": {k: headline[k] for k in ("ours", "deepctr_torch", "dense_floor")},
        "ratios": headline["ratios"],
        "peak_rss_mb": headline["peak_rss_mb"],
        "targets": headline["targets"],
        "micro_batching": headline["micro_batching"],
        "failed": [f"{r.system}/{SHORT.get(r.setting, '-')}/b{r.batch}/p{r.nproc}: {r.status}" for r in results if r.status != "ok"],
        "wall_s": round(total_s, 1),
    }
    headline = _clean(headline)
    if args.out:
        full = {**headline, "runs": [_clean(asdict(r)) for r in results]}
        args.out.write_text(json.dumps(full, indent=2) + "\n")
    print(json.dumps(headline, separators=(",", ":")), flush=True)
    return 0


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf -> null, floats rounded for reading."""
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else round(obj, 3)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
