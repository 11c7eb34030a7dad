"""Embedding forward + backward + update time per step: fused CowClip-Adam vs FBGEMM vs baselines.

26 Criteo-like tables (one id per table and sample, power-law ids with Zipf exponent 1.05 as in
recsys/data/synthetic.py ``zipf_ranks``, scattered over the table by a bijective multiplicative
hash), dim 16, one KJT-shaped lookup (feature-major ``indices``/``offsets`` [26*B+1]) per step and a
fixed random upstream gradient [B, 26*16] (only the embedding part of a training step is timed).
Methods:

  ours      CowClipAdamTBE (recsys/optim/cowclip/tbe.py, inline mode, as the sharded kernel uses it):
            FBGEMM's dense TBE forward + autograd backward = ONE call of the multi-table C++ op
            torch.ops.recsys.cowclip_adam_tables_ for all 26 tables
  pertable  the same forward, then the single-table op torch.ops.recsys.cowclip_adam_step_ once per
            table from Python (how CowClipAdamTBE.backward_update worked before the multi-table op)
  fbgemm    FBGEMM CPU TBE (SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU) with fused
            EXACT_ROWWISE_ADAGRAD: forward + autograd backward (update fused in the backward)
  torchref  the same forward as ours; update: recsys.optim.cowclip.reference.cowclip_adam_step (torch ops)
            per table
  dense     nn.EmbeddingBag(mode="sum") per table, dense gradients + torch.optim.Adam (defaults)

ours/pertable/fbgemm/torchref run in ONE subprocess per (rows, batch) config, interleaved step by
step (round i: one step of each method, in the order ours, fbgemm, pertable, torchref), so machine
load hits them alike; ratios are of medians taken in the same rounds. ours and fbgemm have their own
tables; pertable and torchref share a third set (torchref runs right after pertable on the same
batch and so finds its rows warm: it is the slow reference, that does not change its story). Neither
ours nor fbgemm finds rows that another method just updated in the cache. dense runs in its own
subprocess, on ``--dense-tables`` tables when
26 tables would not fit the ``--dense-mem-gb`` budget (weights + grad + 2 Adam moments + Adam
temporaries ~ 7 x the table bytes); its step time is then scaled linearly to 26 tables (Adam over
dense parameters and the dense gradient are linear in the table count) and reported as such.

Per step we record wall time and process CPU time (``time.process_time``: on a shared, loaded
machine the CPU time of a 1-thread run is the steadier number; both are reported). ``step_peak_mb``
= peak RSS during the step (VmHWM, reset before each step through /proc/self/clear_refs) minus RSS
before it; malloc is told to mmap allocations >= 64 KB (MALLOC_MMAP_THRESHOLD_) so freed blocks
go back to the OS and one method cannot hide its peak in another's freed heap. The C++ op's scratch
(hash table + accumulators, thread-local, grow-only, sized by the batch) is allocated in warm-up and
reported as ``scratch_mb`` estimate instead.

Targets: ours <= 1.3x fbgemm step time; ours >= 5x faster than dense at 1M rows; ours'
step_peak_mb not growing with the number of rows.

    python tools/bench/cowclip.py                     # rows 100K/1M x batch 8K/64K, 1 thread
    python tools/bench/cowclip.py --threads 2         # same, 2 threads for every method
    python tools/bench/cowclip.py --thp               # same, all tables on 2 MB pages (ours and FBGEMM)
    python tools/bench/cowclip.py --quick             # 100K rows, batch 8K, few iterations
    python tools/bench/cowclip.py --device cuda       # on a GPU: 1M rows x batch 8K (see below)

On a GPU (``--device cuda``) the methods are ``ours`` (CowClipAdamTBE on the GPU with the default
``update_scope="catchup"``: the lookup first brings the batch's rows up to date with the steps
they missed (L2 and momentum decay), FBGEMM's dense CUDA forward, then one launch of the Triton
CowClip-Adam kernel for all 26 tables in the backward), ``ours_lazy`` (the same with
``update_scope="batch"``: only the batch's rows move, no catch-up) against FBGEMM's CUDA
TBE (SplitTableBatchedEmbeddingBagsCodegen, tables in HBM) with its fused ``EXACT_ROWWISE_ADAGRAD``
(``fbgemm_rowwise_adagrad``) and ``ADAM`` (``fbgemm_adam``; also lazy: only the batch's rows
move); forward + backward + update, with the device synchronised around each step, interleaved
round by round; targets: ours <= 1.3x rowwise Adagrad, ours <= ADAM.

The last line of stdout is one JSON object (the ratios, per config, and the target checks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

METHODS = ("ours", "pertable", "fbgemm", "torchref", "dense")
NUM_TABLES, DIM = 26, 16
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, r=1.0, zeta=1e-5, l2=1e-5)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_ids(rows: int, batch: int, steps: int, tables: int = NUM_TABLES, seed: int = 0):
    """[steps] lists of per-table int64 id tensors [batch]."""
    import numpy as np
    import torch

    from recsys.data.synthetic import zipf_ranks

    rng = np.random.default_rng(seed)
    n = np.full(batch, rows, dtype=np.int64)
    mult = 2654435761 % rows or 1
    while np.gcd(mult, rows) != 1:
        mult += 1
    out = []
    for _ in range(steps):
        per_table = []
        for _t in range(tables):
            k = zipf_ranks(rng.random(batch), n, 1.05)
            per_table.append(torch.from_numpy((k * mult) % rows))
        out.append(per_table)
    return out


def _anon_huge_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _timed(fn, i: int) -> dict:
    import gc

    gc.collect()
    rss0 = _rss_mb()
    _reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    fn(i)
    t1, c1 = time.perf_counter(), time.process_time()
    return {"wall": t1 - t0, "cpu": c1 - c0, "peak": max(0.0, _hwm_mb() - rss0)}


def _summary(samples: list[dict]) -> dict:
    w = [s["wall"] for s in samples]
    c = [s["cpu"] for s in samples]
    return {
        "step_ms": 1e3 * statistics.median(w),
        "step_ms_min": 1e3 * min(w),
        "cpu_ms": 1e3 * statistics.median(c),
        "cpu_ms_min": 1e3 * min(c),
        "step_peak_mb": max(s["peak"] for s in samples),
        "iters": len(samples),
    }


def _run_sparse(methods, rows, batch, iters, warmup, threads, thp=False, nsteps_ids=4):
    """ours / pertable / fbgemm / torchref in one process, interleaved."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    T = NUM_TABLES
    ids = make_ids(rows, batch, nsteps_ids)
    kjt = [(torch.cat(idt), torch.arange(T * batch + 1)) for idt in ids]
    grad = torch.randn(batch, T * DIM) * 1e-3
    info = {"unique_rows_per_table": int(sum(ids[0][t].unique().numel() for t in range(T)) / T)}
    steps = {}
    tbe_ours = tbe = fb = None

    if {"ours", "pertable", "torchref"} & set(methods):
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

        from recsys.optim.cowclip.reference import cowclip_adam_step
        from recsys.optim.cowclip.kernels.cpp_op import fused_available, fused_cowclip_adam_step
        from recsys.optim.cowclip.tbe import CowClipAdamTBE
        from recsys.optim.cowclip.hyper import CowClipHyper

        if not fused_available():
            raise RuntimeError("C++ extension unavailable")
        hyper = CowClipHyper(
            learning_rate=HP["lr"],
            beta1=HP["betas"][0],
            beta2=HP["betas"][1],
            eps=HP["eps"],
            cowclip=True,
            cowclip_r=HP["r"],
            cowclip_zeta=HP["zeta"],
            l2=HP["l2"],
        )

        def make_tbe():
            tbe = CowClipAdamTBE([(rows, DIM)] * T, list(range(T)), hyper, [DIM] * T, mode="inline")
            with torch.no_grad():
                tbe.weights.uniform_(-0.01, 0.01)
            return tbe

        # ours has its own tables (memory); pertable and torchref share a second set. No method
        # runs right after another one on the same memory, so none finds the other's rows in cache.
        tbe_ours = make_tbe() if "ours" in methods else None
        tbe = make_tbe() if {"pertable", "torchref"} & set(methods) else None
        upd = dict(HP)

        def ours(i):
            idx, off = kjt[i % len(kjt)]
            out = tbe_ours(idx, off)
            out.backward(grad)

        def per_table_loop(i, fn, **kw):
            idx, off = kjt[i % len(kjt)]
            with torch.no_grad():
                DenseTableBatchedEmbeddingBagsCodegen.forward(tbe, idx, off)
                for t, idt, offs, go, _w in tbe._feature_slices(grad, idx, off, None):
                    fn(tbe._view(tbe.weights, t), tbe._states[t], idt, offs, go.contiguous(), **upd, **kw)

        steps["ours"] = ours
        steps["pertable"] = lambda i: per_table_loop(i, fused_cowclip_adam_step)
        steps["torchref"] = lambda i: per_table_loop(i, cowclip_adam_step, update_scope="batch", l2_scope="batch", bias_correction="row")

    if "fbgemm" in methods:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        fb = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=1e-2,
            eps=1e-8,
            pooling_mode=PoolingMode.SUM,
        )

        def fbgemm(i):
            idx, off = kjt[i % len(kjt)]
            out = fb(idx, off)
            out.backward(grad)

        steps["fbgemm"] = fbgemm

    # round order: ours, fbgemm, pertable, torchref (pertable and torchref share memory, but run
    # on different batches; ours and fbgemm each follow a method on other memory)
    if thp:  # like for like: every method's table storage (weights and optimizer state)
        bufs = []
        for tb in (tbe_ours, tbe):
            if tb is not None:
                bufs += [tb.weights, tb.momentum1, tb.momentum2, tb.row_step]
        if fb is not None:
            bufs += [fb.weights_host, fb.momentum1_host]
        from recsys.optim.cowclip.kernels.cpp_op import advise_huge_pages

        info["thp_advised_mb"] = advise_huge_pages(bufs) / 2**20
        info["anon_huge_mb"] = _anon_huge_mb()
    order = [m for m in ("ours", "fbgemm", "pertable", "torchref") if m in steps and m in methods]
    for i in range(warmup):
        for m in order:
            steps[m](i)
    samples = {m: [] for m in order}
    for i in range(warmup, warmup + iters):
        for m in order:
            samples[m].append(_timed(steps[m], i))
    res = {m: {**_summary(samples[m]), **info} for m in order}
    if "ours" in res:
        # thread-local scratch of the op: hash (2L int32, pow2) + per-unique slots (int64 row, 3 int32,
        # D floats) sized by the occurrences L of the largest table, per thread
        L = batch
        hash_slots = 1 << max(4, (2 * L - 1).bit_length())
        res["ours"]["scratch_mb"] = threads * (4 * hash_slots + L * (8 + 12 + 4 * DIM)) / 2**20
    return res


def _run_dense(rows, batch, iters, warmup, threads, tables):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ids = make_ids(rows, batch, 2, tables=tables)
    offsets = torch.arange(batch)
    grad = [torch.randn(batch, DIM) * 1e-3 for _ in range(tables)]
    bags = [torch.nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(tables)]
    opt = torch.optim.Adam([b.weight for b in bags], lr=HP["lr"])

    def step(i):
        idt = ids[i % len(ids)]
        opt.zero_grad(set_to_none=True)
        outs = [bags[t](idt[t], offsets) for t in range(tables)]
        torch.autograd.backward(outs, grad)
        opt.step()

    for i in range(warmup):
        step(i)
    s = _summary([_timed(step, i) for i in range(warmup, warmup + iters)])
    scale = NUM_TABLES / tables
    s.update(
        tables_measured=tables,
        scale_to_26=scale,
        step_ms_measured=s["step_ms"],
        cpu_ms_measured=s["cpu_ms"],
        step_peak_mb_measured=s["step_peak_mb"],
    )
    for k in ("step_ms", "step_ms_min", "cpu_ms", "cpu_ms_min", "step_peak_mb"):
        s[k] *= scale
    return {"dense": s}


def _worker(kind, args, q) -> None:
    try:
        q.put(_run_sparse(*args) if kind == "sparse" else _run_dense(*args))
    except Exception as e:  # noqa: BLE001 - reported in the results
        import traceback

        q.put({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})


def _subprocess(kind, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(kind, args, q))
    p.start()
    res = q.get()
    p.join()
    return res


GPU_METHODS = ("ours", "ours_lazy", "fbgemm_rowwise_adagrad", "fbgemm_adam")


def run_gpu(rows: int, batch: int, iters: int, warmup: int, device: str, profile_steps: int = 0) -> dict:
    """ours vs FBGEMM's CUDA rowwise Adagrad and Adam, one process, interleaved (see the module
    docstring). On ``--device cpu`` the same code runs FBGEMM's CPU kernels and the C++ op: a
    rehearsal of the GPU run, not a CPU benchmark."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    dev = torch.device(device)
    torch.manual_seed(0)
    T = NUM_TABLES
    ids = make_ids(rows, batch, 4)
    kjt = [(torch.cat(idt).to(dev), torch.arange(T * batch + 1, device=dev)) for idt in ids]
    grad = (torch.randn(batch, T * DIM) * 1e-3).to(dev)
    hyper = CowClipHyper(
        learning_rate=HP["lr"],
        beta1=HP["betas"][0],
        beta2=HP["betas"][1],
        eps=HP["eps"],
        cowclip=True,
        cowclip_r=HP["r"],
        cowclip_zeta=HP["zeta"],
        l2=HP["l2"],
    )
    import dataclasses

    ours = CowClipAdamTBE([(rows, DIM)] * T, list(range(T)), hyper, [DIM] * T, mode="inline", device=dev)
    lazy = CowClipAdamTBE(
        [(rows, DIM)] * T, list(range(T)), dataclasses.replace(hyper, update_scope="batch"), [DIM] * T, mode="inline", device=dev
    )
    with torch.no_grad():
        ours.weights.uniform_(-0.01, 0.01)
        lazy.weights.uniform_(-0.01, 0.01)
    loc, cdev = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if dev.type == "cuda" else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    modules = {"ours": ours, "ours_lazy": lazy}
    errors = {}
    for name, opt, kw in (
        ("fbgemm_rowwise_adagrad", EmbOptimType.EXACT_ROWWISE_ADAGRAD, {}),
        ("fbgemm_adam", EmbOptimType.ADAM, {"beta1": HP["betas"][0], "beta2": HP["betas"][1]}),
    ):
        try:
            modules[name] = SplitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[(rows, DIM, loc, cdev)] * T,
                optimizer=opt,
                learning_rate=HP["lr"],
                eps=HP["eps"],
                pooling_mode=PoolingMode.SUM,
                device=dev,
                **kw,
            )
        except Exception as e:  # noqa: BLE001 - a kernel this build lacks is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(m, i):
        idx, off = kjt[i % len(kjt)]
        modules[m](idx, off).backward(grad)

    samples: dict[str, list[float]] = {m: [] for m in modules}
    for i in range(warmup + iters):
        for m in modules:
            sync()
            t0 = time.perf_counter()
            step(m, i)
            sync()
            if i >= warmup:
                samples[m].append(time.perf_counter() - t0)
    step_ms = {m: 1e3 * statistics.median(v) for m, v in samples.items()}
    ratios = {f"ours_over_{m}": step_ms["ours"] / step_ms[m] for m in step_ms if m != "ours"}
    profile = {}
    if profile_steps:  # where each method's step goes: the top device kernels and host ops by self time
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        for m in modules:
            sync()
            with torch_profile(activities=acts) as prof:
                for i in range(profile_steps):
                    step(m, i)
                sync()
            rows = []
            for e in prof.key_averages():
                dev_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                rows.append(
                    (
                        e.key[:70],
                        e.count // profile_steps,
                        round(dev_us / profile_steps, 1),
                        round(e.self_cpu_time_total / profile_steps, 1),
                    )
                )
            profile[m] = {
                "top_device_us_per_step": sorted(rows, key=lambda r: -r[2])[:12],
                "top_host_us_per_step": sorted(rows, key=lambda r: -r[3])[:12],
            }
    checks = {}
    if "ours_lazy" in step_ms:
        for m in list(step_ms):
            if m.startswith("fbgemm"):
                ratios[f"ours_lazy_over_{m}"] = step_ms["ours_lazy"] / step_ms[m]
        ratios.pop("ours_over_ours_lazy", None)
    if "ours_over_fbgemm_rowwise_adagrad" in ratios:
        checks["ours<=1.3*fbgemm_rowwise_adagrad"] = ratios["ours_over_fbgemm_rowwise_adagrad"] <= 1.3
    if "ours_over_fbgemm_adam" in ratios:
        checks["ours<=fbgemm_adam"] = ratios["ours_over_fbgemm_adam"] <= 1.0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    return {
        "bench": "cowclip_gpu",
        "device": name,
        "torch": torch.__version__,
        "rows": rows,
        "batch": batch,
        "tables": T,
        "dim": DIM,
        "iters": iters,
        "semantics": {
            "ours": "CowClip-Adam, update_scope=catchup (the default: L2 reaches absent rows through the catch-up on lookup)",
            "ours_lazy": "update_scope=batch (only the batch's rows move, as FBGEMM's row-wise Adagrad and Adam do)",
        },
        "ours_kernel": getattr(ours._tables_op, "__name__", str(ours._tables_op)),
        "step_ms": {m: round(v, 3) for m, v in step_ms.items()},
        "step_ms_min": {m: round(1e3 * min(v), 3) for m, v in samples.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "checks": checks,
        "errors": errors,
        **({"profile": profile} if profile else {}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--device",
        default=None,
        help="cuda: ours vs FBGEMM's CUDA kernels (GPU_METHODS); cpu: "
        "the same code on CPU (a rehearsal). Without it: the CPU benchmark (METHODS), to which "
        "the options other than --rows/--batch/--iters/--warmup belong",
    )
    ap.add_argument("--quick", action="store_true", help="one small config (100K rows, batch 8K), few iterations")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --device: also profile STEPS steps of each method (top kernels and host ops)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--batch", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--iters", type=int, default=15, help="timed rounds (one step of each method per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dense-iters", type=int, default=3, help="iterations of the (slow) dense baseline")
    ap.add_argument(
        "--dense-mem-gb", type=float, default=4.0, help="memory budget of the dense baseline: fewer tables (then scaled to 26) above it"
    )
    ap.add_argument(
        "--thp",
        action="store_true",
        help="back every method's table storage (ours and FBGEMM alike) with 2 MB transparent "
        "huge pages (madvise MADV_HUGEPAGE + MADV_COLLAPSE, Linux >= 6.1)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of every method (FBGEMM's CPU kernels use the same at::parallel_for pool)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.iters, args.warmup, args.dense_iters = [100_000], [8192], 6, 1, 2
    if args.device is not None:
        # defaults on a GPU: the target's one config (1M rows x batch 8K)
        rows = args.rows if args.rows != [100_000, 1_000_000] else [1_000_000]
        batch = args.batch if args.batch != [8192, 65536] else [8192]
        for r in rows:
            for b in batch:
                res = run_gpu(r, b, args.iters, args.warmup, args.device, args.profile)
                print(f"rows={r} batch={b} " + ", ".join(f"{m}={v:.3f} ms" for m, v in res["step_ms"].items()), flush=True)
                print(json.dumps(res), flush=True)
        return 0

    # children: mmap every allocation >= 64 KB (returned to the OS on free: clean per-step peaks)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")

    # build the extension once, before the timed subprocesses (they only load it)
    import torch

    import recsys.optim.cowclip.kernels.cpp_op as ck

    t0 = time.perf_counter()
    avail = ck.fused_available()
    print(
        f"cowclip extension: {'available' if avail else 'UNAVAILABLE'} ({ck.fallback_reason()}), load {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    machine = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "thp": args.thp,
        "load_avg_start": os.getloadavg(),
    }
    print(f"machine: {machine}", flush=True)

    results = []
    sparse_methods = [m for m in args.methods if m != "dense"]
    for rows in args.rows:
        for batch in args.batch:
            cfg = {
                "rows": rows,
                "batch": batch,
                "tables": NUM_TABLES,
                "dim": DIM,
                "threads": args.threads,
                "thp": args.thp,
                "load_avg": os.getloadavg(),
            }
            if sparse_methods:
                r = _subprocess("sparse", (sparse_methods, rows, batch, args.iters, args.warmup, args.threads, args.thp))
                if "error" in r:
                    print(f"rows={rows} batch={batch} sparse methods failed: {r['error']}\n{r.get('trace', '')}", flush=True)
                else:
                    cfg.update(r)
            if "dense" in args.methods:
                per_table = rows * DIM * 4 * 7
                tables = max(1, min(NUM_TABLES, int(args.dense_mem_gb * 2**30 // per_table)))
                r = _subprocess("dense", (rows, batch, args.dense_iters, 1, args.threads, tables))
                if "error" in r:
                    print(f"rows={rows} batch={batch} dense failed: {r['error']}", flush=True)
                else:
                    cfg.update(r)
            for m in args.methods:
                if m not in cfg:
                    continue
                r = cfg[m]
                extra = f"  [measured on {r['tables_measured']} tables, x{r['scale_to_26']:.2f}]" if "tables_measured" in r else ""
                print(
                    f"rows={rows:>8} batch={batch:>6} {m:>9}: {r['step_ms']:9.1f} ms/step wall "
                    f"(min {r['step_ms_min']:.1f})  cpu {r['cpu_ms']:9.1f} ms  "
                    f"step peak {r['step_peak_mb']:7.1f} MB{extra}",
                    flush=True,
                )
            ratios = {}
            if "ours" in cfg:
                for m in ("fbgemm", "dense", "torchref", "pertable"):
                    if m in cfg:
                        ratios[f"ours_over_{m}"] = cfg["ours"]["step_ms"] / cfg[m]["step_ms"]
                        ratios[f"ours_over_{m}_cpu"] = cfg["ours"]["cpu_ms"] / cfg[m]["cpu_ms"]
            cfg["ratios"] = ratios
            print(f"rows={rows:>8} batch={batch:>6} ratios: " + ", ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)
            results.append(cfg)

    checks = {}
    for cfg in results:
        key = f"{cfg['rows']}x{cfg['batch']}"
        r = cfg["ratios"]
        if "ours_over_fbgemm" in r:
            checks[f"{key}:ours<=1.3*fbgemm"] = r["ours_over_fbgemm"] <= 1.3
            checks[f"{key}:ours<=1.3*fbgemm_cpu"] = r["ours_over_fbgemm_cpu"] <= 1.3
        if "ours_over_dense" in r and cfg["rows"] >= 1_000_000:
            checks[f"{key}:dense>=5*ours"] = r["ours_over_dense"] <= 0.2
    for batch in args.batch:
        peaks = [c["ours"]["step_peak_mb"] for c in results if c["batch"] == batch and "ours" in c]
        if len(peaks) >= 2:
            checks[f"batch{batch}:ours_step_peak_flat"] = max(peaks) <= min(peaks) * 1.5 + 16
    summary = {
        "bench": "cowclip",
        "quick": args.quick,
        "machine": machine,
        "load_avg_end": os.getloadavg(),
        "extension": avail,
        "ratios": {f"{c['rows']}x{c['batch']}": c["ratios"] for c in results},
        "step_ms": {f"{c['rows']}x{c['batch']}": {m: round(c[m]["step_ms"], 2) for m in METHODS if m in c} for c in results},
        "cpu_ms": {f"{c['rows']}x{c['batch']}": {m: round(c[m]["cpu_ms"], 2) for m in METHODS if m in c} for c in results},
        "step_peak_mb": {f"{c['rows']}x{c['batch']}": {m: round(c[m]["step_peak_mb"], 1) for m in METHODS if m in c} for c in results},
        "anon_huge_mb": {f"{c['rows']}x{c['batch']}": c["ours"].get("anon_huge_mb") for c in results if "ours" in c},
        "checks": checks,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
