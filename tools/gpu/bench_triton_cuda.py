"""Step time of our Triton CowClip-Adam update on a CUDA device against the torch reference on the
same device: one kernel launch for all tables against ``cowclip_adam_step`` per table
(the chain of torch ops CUDA runs used before the kernel). With ``--catchup`` also the reference
semantics: the rows behind caught up, then the same update kernel, against the lazy
update alone, three ways: ``catchup_triton``, the lookup kernel ``triton_catch_up_lookup`` the TBE
runs (one launch over the ids, no host synchronisation); ``catchup_triton_rows``, the way before it (the rows
behind found by a mask and ``torch.unique``, then the per-row kernel); ``catchup_torch``, the torch
version.

Why this peer and not FBGEMM: the GPU machines lent to this project have torch and triton but no
fbgemm_gpu, and its CUDA wheel is far larger than what can be carried there, so FBGEMM's CUDA
row-wise Adagrad / Adam (the named peers) cannot run beside it; the torch reference can.

What is timed: the update alone (the backward's CowClip-Adam step of 26 tables, dim 16, batch 8K,
one id per table and sample, Zipf 1.05 ranks hashed over each table as tools/bench/catchup.py
does), with CUDA synchronisation around each step; both methods interleaved step by step on their
own copies of the tables, medians of ``--iters`` rounds. Also checks, after the timed steps, that
both methods' tables agree (the same batches, the same start).

    python3 tools/gpu/bench_triton_cuda.py                     # 1M rows per table, batch 8K, on cuda
    python3 tools/gpu/bench_triton_cuda.py --rows 1300000 --catchup   # 1.3M rows per table, + the catch-up
    python3 tools/gpu/bench_triton_cuda.py --sizes raw --catchup --dense   # raw Criteo sizes (33.8M rows), + dense pass
    python3 tools/gpu/bench_triton_cuda.py --host-time --rows 100000      # host time per call of the lookup's catch-up
    TRITON_INTERPRET=1 python tools/gpu/bench_triton_cuda.py --device cpu --rows 2000 --batch 64 --iters 2   # smoke test

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TABLES, DIM, ZIPF = 26, 16, 1.05
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, r=1.0, l2=1e-5 * 8)
ZETA = 1e-5


def _batches(cards: list[int], batch: int, steps: int, device, seed: int = 0):
    """[steps] of (indices [TABLES*batch], offsets [TABLES*batch+1], grad [batch, TABLES*DIM]),
    feature-major; table t's ids are Zipf ranks hashed over its cards[t] rows."""
    import numpy as np
    import torch

    from recsys.data.synthetic import zipf_ranks
    from tools.bench.catchup import _mult

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = np.repeat(np.asarray(cards, dtype=np.int64), batch)
    mult = np.repeat(np.asarray([_mult(c) for c in cards], dtype=np.int64), batch)
    out = []
    for _ in range(steps):
        k = zipf_ranks(rng.random(TABLES * batch), n, ZIPF)
        ids = torch.from_numpy((k * mult) % n)
        grad = torch.randn(batch, TABLES * DIM, generator=g) * 1e-3
        out.append((ids.to(device), torch.arange(TABLES * batch + 1, device=device), grad.to(device)))
    return out


def table_rows(args) -> list[int]:
    """Rows of each of the 26 tables: ``--rows`` each (uniform), or the raw Criteo-Kaggle sizes
    (``criteo_kaggle_raw``, 33.8M rows in all) times ``--fraction``, as tools/bench/catchup.py."""
    if args.sizes == "uniform":
        return [args.rows] * TABLES
    from recsys.config import CARDINALITY_PRESETS

    return [max(1, int(c * args.fraction)) for c in CARDINALITY_PRESETS["criteo_kaggle_raw"]]


def run(args) -> dict:
    import torch

    import recsys.optim.cowclip.kernels.triton_update as ctr
    from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step

    dev = torch.device(args.device)
    if not ctr.triton_available(dev):
        raise SystemExit(f"the Triton kernel is not available for {dev} (CPU needs TRITON_INTERPRET=1)")
    cards, B = table_rows(args), args.batch
    cum = [0]
    for c in cards:
        cum.append(cum[-1] + c)
    N = cum[-1]
    meta = torch.tensor([[cum[t] * DIM, cards[t], DIM, t * DIM, cum[t], 1] for t in range(TABLES)], dtype=torch.long)
    zeta = torch.full((TABLES,), ZETA, dtype=torch.float64)
    g = torch.Generator(device=dev).manual_seed(0)
    w0 = torch.randn(N * DIM, generator=g, device=dev) * 1e-2
    bufs = {
        m: [w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0), torch.zeros(N, dtype=torch.long, device=dev)]
        for m in ("triton", "torch")
    }
    del w0
    batches = _batches(cards, B, args.warmup + args.iters, dev)

    def table_state(buf: list, t: int, step):
        """Table t's [n, DIM] views of a method's buffers, as one table's CowClipAdamState."""
        n, sl = cards[t], slice(cum[t] * DIM, cum[t + 1] * DIM)
        st = CowClipAdamState(buf[1][sl].view(n, DIM), buf[2][sl].view(n, DIM), buf[3][cum[t] : cum[t + 1]], step)
        return buf[0][sl].view(n, DIM), st

    def triton_step(i: int) -> None:
        idx, off, grad = batches[i]
        ctr.triton_cowclip_adam_tables(*bufs["triton"], meta, zeta, idx, off, grad, None, **HP)

    def torch_step(i: int) -> None:
        idx, off, grad = batches[i]
        for t in range(TABLES):
            w, st = table_state(bufs["torch"], t, torch.zeros((), dtype=torch.long, device=dev))
            cowclip_adam_step(
                w,
                st,
                idx[t * B : (t + 1) * B],
                off[: B + 1],
                grad[:, t * DIM : (t + 1) * DIM].contiguous(),
                None,
                zeta=ZETA,
                clip=True,
                update_scope="batch",
                l2_scope="batch",
                bias_correction="row",
                **HP,
            )

    steps = {"triton": triton_step, "torch": torch_step}
    if args.catchup:  # the reference semantics on the GPU: rows behind caught up, then the same kernel
        from recsys.optim.cowclip.catchup import catch_up
        from recsys.optim.cowclip.kernels.triton_catchup import triton_catch_up_lookup, triton_catch_up_rows
        from tools.bench.catchup import steady_state_row_step

        rs0 = steady_state_row_step(cards, B, args.trained_steps).to(dev)
        starts = torch.tensor(cum[:-1], device=dev)
        behind_counts: list[int] = []

        def make_catchup(method: str):
            cu = bufs[method] = [b.clone() for b in bufs["triton"][:3]] + [rs0.clone()]
            state = {"step": args.trained_steps}

            def step_fn(i: int) -> None:
                idx, off, grad = batches[i]
                S = state["step"]
                if method == "catchup_triton":  # as CowClipAdamTBE.catch_up_lookup: one launch over the ids
                    triton_catch_up_lookup(
                        *cu,
                        meta_dev,
                        idx,
                        off,
                        S,
                        lr=HP["lr"],
                        max_dim=DIM,
                        betas=HP["betas"],
                        eps=HP["eps"],
                        eps_mode="torch",
                        l2=HP["l2"],
                    )
                    ctr.triton_cowclip_adam_tables(*cu, meta, zeta, idx, off, grad, None, **HP)
                    state["step"] = S + 1
                    return
                u = torch.unique(idx + starts.repeat_interleave(B))
                u = u[cu[3].index_select(0, u) < S]  # the rows behind (the TBE's way before the lookup kernel)
                if method == "catchup_triton_rows":
                    triton_catch_up_rows(
                        *cu,
                        u * DIM,
                        u,
                        torch.full_like(u, DIM),
                        S,
                        lr=HP["lr"],
                        betas=HP["betas"],
                        eps=HP["eps"],
                        eps_mode="torch",
                        l2=HP["l2"],
                        max_dim=DIM,
                    )
                else:  # the torch version, as CowClipAdamTBE._catch_up_rows: longest gaps first, whole rows
                    rs, order = torch.sort(cu[3].index_select(0, u), stable=True)
                    u = u[order]
                    views = [x.view(-1, DIM) for x in cu[:3]]
                    w, m, v = (x.index_select(0, u) for x in views)
                    w, m, v = catch_up(
                        w, m, v, rs, S, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], eps_mode="torch", l2=HP["l2"], presorted=True
                    )
                    for x, new in zip(views, (w, m, v)):
                        x.index_copy_(0, u, new)
                    cu[3].index_fill_(0, u, S)
                ctr.triton_cowclip_adam_tables(*cu, meta, zeta, idx, off, grad, None, **HP)
                state["step"] = S + 1
                if method == "catchup_triton_rows":
                    behind_counts.append(u.numel())

            return step_fn

        meta_dev = meta.to(dev)
        for method in ("catchup_triton", "catchup_triton_rows", "catchup_torch"):
            steps[method] = make_catchup(method)
    if args.dense:  # the ceiling to beat: the reference semantics as a dense pass over every row (torch ops)
        bufs["dense"] = [b.clone() for b in bufs["triton"][:3]] + [torch.zeros(N, dtype=torch.long, device=dev)]
        dense_step = [torch.full((), args.trained_steps, dtype=torch.long, device=dev) for _ in range(TABLES)]

        def dense_fn(i: int) -> None:
            idx, off, grad = batches[i]
            for t in range(TABLES):
                w, st = table_state(bufs["dense"], t, dense_step[t])
                cowclip_adam_step(
                    w,
                    st,
                    idx[t * B : (t + 1) * B],
                    off[: B + 1],
                    grad[:, t * DIM : (t + 1) * DIM].contiguous(),
                    None,
                    zeta=ZETA,
                    clip=True,
                    update_scope="all",
                    l2_scope="all",
                    **HP,
                )

        steps["dense"] = dense_fn
    times = {m: [] for m in steps}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for i in range(args.warmup + args.iters):
        for m, fn in steps.items():
            sync()
            t0 = time.perf_counter()
            fn(i)
            sync()
            if i >= args.warmup:
                times[m].append(time.perf_counter() - t0)
    med = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    diff = {
        name: float((a - b).abs().max()) for name, a, b in zip(("weights", "momentum1", "momentum2"), bufs["triton"][:3], bufs["torch"][:3])
    }
    if args.catchup:  # the two catch-ups, same batches, same start: the same tables to float rounding
        for m in ("catchup_triton", "catchup_triton_rows"):
            diff.update(
                {
                    f"{m}_{name}": float((a - b).abs().max())
                    for name, a, b in zip(("weights", "momentum1", "momentum2"), bufs[m][:3], bufs["catchup_torch"][:3])
                }
            )
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "sizes": args.sizes,
        "rows": N,
        "rows_per_table": cards[0] if args.sizes == "uniform" else None,
        "fraction": args.fraction if args.sizes == "raw" else None,
        "tables": TABLES,
        "dim": DIM,
        "batch": B,
        "iters": args.iters,
        "step_ms": med,
        "step_ms_min": {m: 1e3 * min(v) for m, v in times.items()},
        "torch_over_triton": med["torch"] / med["triton"],
        **(
            {
                "catchup_triton_over_lazy": med["catchup_triton"] / med["triton"],
                "catchup_triton_rows_over_lazy": med["catchup_triton_rows"] / med["triton"],
                "catchup_triton_rows_over_catchup_triton": med["catchup_triton_rows"] / med["catchup_triton"],
                "catchup_torch_over_lazy": med["catchup_torch"] / med["triton"],
                "trained_steps": args.trained_steps,
                "catchup_rows_behind_per_step": statistics.median(behind_counts),
            }
            if args.catchup
            else {}
        ),
        **({"dense_over_lazy": med["dense"] / med["triton"]} if args.dense else {}),
        **({"dense_over_catchup": med["dense"] / med["catchup_triton"]} if args.dense and args.catchup else {}),
        "max_abs_diff_after": diff,
        "row_steps_equal": bool(torch.equal(bufs["triton"][3], bufs["torch"][3])),
        **(
            {
                "catchup_row_steps_equal": all(
                    torch.equal(bufs[m][3], bufs["catchup_torch"][3]) for m in ("catchup_triton", "catchup_triton_rows")
                )
            }
            if args.catchup
            else {}
        ),
    }
    if args.profile:  # where a method's step goes: the top ops of a few more steps (after the check above)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for i in range(args.warmup, args.warmup + min(5, args.iters)):
                steps[args.profile](i)
            sync()
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        avg = prof.key_averages()
        print(avg.table(sort_by=key, row_limit=15), file=sys.stderr)
        steps_profiled = min(5, args.iters)
        # device time per step against the step's wall time above: how much of the step is the host
        # launching ops rather than the GPU running them
        from torch.autograd import DeviceType

        # kernels and copies only (as the table's "Self CUDA time total"): an op's row repeats its kernels' time
        dev_us = sum(
            e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        res["profile_device_ms_per_step"] = dev_us / 1e3 / steps_profiled
        res["profile_host_ms_per_step"] = sum(e.self_cpu_time_total for e in avg) / 1e3 / steps_profiled
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    return res


def host_time(args) -> dict:
    """Host time per call of the lookup's catch-up when no row is behind (all work is launching):
    ``triton_catch_up_lookup`` against the previous way (mask + ``torch.unique`` + the per-row
    kernel), plus the new way's parts. Each figure: ``n`` calls back to back, no synchronisation
    in between (the new way has none), so it is what the host spends per call."""
    import torch

    import recsys.optim.cowclip.kernels.triton_catchup as cct

    dev = torch.device(args.device)
    cards, B = table_rows(args), args.batch
    cum = [0]
    for c in cards:
        cum.append(cum[-1] + c)
    N, step = cum[-1], args.trained_steps
    meta = torch.tensor([[cum[t] * DIM, cards[t], DIM, t * DIM, cum[t], 1] for t in range(TABLES)], dtype=torch.long, device=dev)
    W = torch.zeros(N * DIM, device=dev)
    M, V = torch.zeros_like(W), torch.zeros_like(W)
    RS = torch.full((N,), step, dtype=torch.long, device=dev)  # every row current
    idx, off, _ = _batches(cards, B, 1, dev)[0]
    starts = torch.tensor(cum[:-1], device=dev)
    kw = dict(lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], eps_mode="torch", l2=HP["l2"])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def per_call_us(fn, n: int = 300) -> float:
        for _ in range(20):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        return 1e6 * (t1 - t0) / n

    def previous_way() -> None:
        u = torch.unique(idx + starts.repeat_interleave(B))
        u = u[RS.index_select(0, u) < step]
        cct.triton_catch_up_rows(W, M, V, RS, u * DIM, u, torch.full_like(u, DIM), step, max_dim=DIM, **kw)

    L = idx.numel()
    la = (W, M, V, RS, step, HP["lr"], HP["betas"], HP["eps"], "torch", HP["l2"], 2.0, DIM)
    launch_args, consts = cct._launch_args(*la)
    programs = -(-L // cct.LOOKUP_BLOCK)
    scratch = cct._scratch(dev, L, programs)
    kernel = cct._lookup_kernel()
    return {
        "lookup_us": per_call_us(lambda: cct.triton_catch_up_lookup(W, M, V, RS, meta, idx, off, step, max_dim=DIM, **kw)),
        "previous_way_us": per_call_us(previous_way, 100),
        "parts_us": {
            "launch_args": per_call_us(lambda: cct._launch_args(*la)),
            "scratch": per_call_us(lambda: cct._scratch(dev, L, programs)),
            "launch": per_call_us(
                lambda: kernel[(programs,)](
                    W,
                    M,
                    V,
                    RS,
                    idx,
                    off,
                    meta,
                    L,
                    TABLES,
                    B,
                    *scratch,
                    *launch_args,
                    BLOCK=cct.LOOKUP_BLOCK,
                    SEARCH_STEPS=max(1, math.ceil(math.log2(TABLES))),
                    **consts,
                )
            ),
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--sizes",
        choices=("uniform", "raw"),
        default="uniform",
        help="uniform: --rows per table; raw: the raw Criteo-Kaggle sizes times --fraction",
    )
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per table (--sizes uniform)")
    ap.add_argument("--fraction", type=float, default=1.0, help="share of every raw table's rows (--sizes raw)")
    ap.add_argument(
        "--dense",
        action="store_true",
        help="also time the dense pass (update_scope='all', torch "
        "ops): the reference semantics over every row each step, the ceiling the catch-up must beat",
    )
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--catchup",
        action="store_true",
        help="also time the reference semantics: the batch's rows "
        "behind (from the steady state of --trained-steps) caught up by the Triton kernel and, as its peer, "
        "by the torch version, then the same update kernel",
    )
    ap.add_argument("--trained-steps", type=int, default=5500)
    ap.add_argument(
        "--profile",
        nargs="?",
        const="triton",
        default=None,
        choices=("triton", "torch", "catchup_triton", "catchup_triton_rows", "catchup_torch"),
        help="also print torch.profiler's top ops of 5 more steps of this method (default triton)",
    )
    ap.add_argument(
        "--host-time",
        action="store_true",
        help="only the host time per call of the lookup's "
        "catch-up with no row behind: the new way against the previous one, and the new way's parts",
    )
    args = ap.parse_args(argv)
    res = host_time(args) if args.host_time else run(args)
    for k, v in res.items():
        print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
