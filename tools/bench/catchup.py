"""Extra cost per step of the reference's dense semantics by catch-up (``update_scope="catchup"``)
against the lazy kernel (``"batch"``) and the dense pass (``"all"``), at raw Criteo-Kaggle table
sizes (26 tables, 33.8M rows, ``criteo_kaggle_raw``), dim 16, batch 8K.

One process, one ``CowClipAdamTBE`` per method (inline mode, the C++ multi-table op for the batch
update), interleaved step by step (round i: one forward + backward of each method on the same
batch), so machine load hits them alike; ratios are of medians taken in the same rounds. Ids: one
per table and sample, Zipf 1.05 ranks scattered over the table by a multiplicative hash (as
tools/bench/cowclip.py and recsys/data/synthetic.py).

Steady state: the catch-up's cost depends on how long each row of a batch has been absent. Before
timing, the catch-up table is put in the state ``--trained-steps`` S steps of such batches leave:
global step S and, per row, ``row_step = S - gap`` with gap ~ Geometric(p_touch), p_touch =
1 - (1 - p_row)^batch, p_row the row's Zipf probability (0 if that is before step 0: never
touched). Moments are random, of a plausible size.

Memory: per method, (weights + 2 moments) x 4 bytes x 16 x rows. Three methods at full size need
about 21 GB, more than a shared 24 GB machine has; ``--fraction f`` keeps f of every table's rows (at least
one) and says so in the JSON. The lazy and catch-up costs depend on the batch and on the gaps,
hardly on the table size; the dense pass is O(rows) and its figure is also reported scaled by
1/f (``dense_ms_full_estimate``).

    python tools/bench/catchup.py                      # fraction 0.25, batch 8K, 1 thread
    python tools/bench/catchup.py --fraction 1.0 --methods batch catchup   # full size, no dense

``--all-rows``: instead of training steps, time ``catch_up_all`` (what a checkpoint, an export or a
merge runs first: every row brought to the global step) from the same steady state, for the
catch-up methods only, the state restored before each call (not timed).

    python tools/bench/catchup.py --all-rows --batch 65536 --trained-steps 183   # a 64K run's epoch

``--split``: a catch-up step's parts, the lookup's catch-up timed alone before the step (whose own
catch-up then finds the rows current); ``--growth g``: the blocks' growth (a huge g: one block
per gap, the floor of the block scheme's cost).

    python tools/bench/catchup.py --methods batch catchup --split --growth 1e9

Methods: ``batch`` (lazy), ``catchup`` (the fused C++ catch-up op, what CPU runs use),
``catchup_torch`` (the same scheme as torch ops: the peer the op replaced), ``all`` (dense pass).

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

DIM = 16
ZIPF = 1.05
HP = dict(learning_rate=1e-4, l2=1e-5 * 8, cowclip_r=1.0, cowclip_zeta=1e-5, eps=1e-8)  # paper's 1K values, l2 x 8
# catchup: the fused C++ op (rows found, read and advanced once); catchup_torch: the same block
# scheme as torch ops (recsys/optim/cowclip/catchup.py), the peer the C++ op replaces on CPU
METHODS = ("batch", "catchup", "catchup_torch", "all")


def _zipf_pmf(n: int):
    """P(rank k), k = 0..n-1, of recsys.data.synthetic.zipf_ranks (floored continuous power law)."""
    import torch

    b = 1.0 - ZIPF
    k = torch.arange(n, dtype=torch.float64)
    return ((k + 2) ** b - (k + 1) ** b) / ((n + 1.0) ** b - 1.0)


def _mult(rows: int) -> int:
    mult = 2654435761 % rows or 1
    while math.gcd(mult, rows) != 1:
        mult += 1
    return mult


def make_batches(cards: list[int], batch: int, steps: int, seed: int = 0):
    """[steps] of (indices [26*batch], offsets [26*batch+1]) feature-major, one id per sample."""
    import numpy as np
    import torch

    from recsys.data.synthetic import zipf_ranks

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = []
        for n in cards:
            k = zipf_ranks(rng.random(batch), np.full(batch, n, dtype=np.int64), ZIPF)
            ids.append(torch.from_numpy((k * _mult(n)) % n))
        out.append((torch.cat(ids), torch.arange(len(cards) * batch + 1)))
    return out


def steady_state_row_step(cards: list[int], batch: int, trained: int, seed: int = 1):
    """row_step [sum(cards)] int64 as after `trained` steps (module doc)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in cards:
        p = _zipf_pmf(n)
        p_touch = -torch.expm1(batch * torch.log1p(-p))  # 1 - (1-p)^batch
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_(min=1e-300)
        gap = torch.floor(torch.log(u) / torch.log1p(-p_touch.clamp(max=1 - 1e-16)))
        by_rank = (trained - gap).clamp(min=0).long()
        rows = (torch.arange(n) * _mult(n)) % n  # rank k sits at row k*mult mod n
        rs = torch.empty(n, dtype=torch.long)
        rs[rows] = by_rank
        out.append(rs)
    return torch.cat(out)


def _growth(args) -> dict:
    return {} if args.growth is None else {"catchup_growth": args.growth}


def _tbe(method: str, cards: list[int], args):
    """One method's ``CowClipAdamTBE`` over the tables (inline mode; ``catchup_torch``: the torch
    catch-up, else the op this machine runs)."""
    from recsys.optim.cowclip.hyper import CowClipHyper
    from recsys.optim.cowclip.tbe import CowClipAdamTBE

    hp = CowClipHyper(update_scope="catchup" if method.startswith("catchup") else method, **HP)
    return CowClipAdamTBE(
        [(n, DIM) for n in cards],
        list(range(len(cards))),
        hp,
        [DIM] * len(cards),
        mode="inline",
        catchup_op="torch" if method == "catchup_torch" else "auto",
        **_growth(args),
    )


def run(args) -> dict:
    import torch

    from recsys.config import CARDINALITY_PRESETS

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    full = CARDINALITY_PRESETS["criteo_kaggle_raw"]
    cards = [max(1, int(n * args.fraction)) for n in full]
    T = len(cards)
    batches = make_batches(cards, args.batch, args.warmup + args.iters, seed=0)
    grad = torch.randn(args.batch, T * DIM, generator=torch.Generator().manual_seed(2)) * 1e-4
    rs0 = steady_state_row_step(cards, args.batch, args.trained_steps)

    tbes = {}
    for m in args.methods:
        scope = "catchup" if m.startswith("catchup") else m
        tbe = _tbe(m, cards, args)
        with torch.no_grad():
            tbe.weights.normal_(0, 1e-2)
            tbe.momentum1.normal_(0, 1e-5)
            tbe.momentum2.uniform_(1e-12, 1e-10)
            if scope == "catchup":
                tbe.row_step.copy_(rs0)
                tbe.set_optimizer_step(args.trained_steps)
            else:  # the dense pass reads its global step from row_step; the lazy op its own counts
                tbe.row_step.fill_(args.trained_steps)
        tbes[m] = tbe

    parts: dict[str, list[float]] = {}

    def step(m: str, i: int) -> float:
        idx, off = batches[i]
        t0 = time.perf_counter()
        if args.split and m.startswith("catchup"):  # the lookup's catch-up alone, then the step
            tbes[m].catch_up_lookup(idx, off)
            parts.setdefault(m, []).append(time.perf_counter() - t0)
        tbes[m](idx, off).backward(grad)
        return time.perf_counter() - t0

    behind, gaps = [], []
    times = {m: [] for m in args.methods}
    for i in range(args.warmup + args.iters):
        cu = next((m for m in ("catchup", "catchup_torch") if m in tbes), None)
        if cu and i >= args.warmup:  # the catch-up's work this step (not timed)
            tb = tbes[cu]
            idx, _ = batches[i]
            starts = torch.tensor(tb.row_starts[:-1]).repeat_interleave(args.batch)
            u = torch.unique(idx + starts)
            gap = tb.dense_step() - tb.row_step[u]
            behind.append(int((gap > 0).sum()))
            gaps.append(float(gap[gap > 0].float().log2().mean()) if bool((gap > 0).any()) else 0.0)
        for m in args.methods:
            dt = step(m, i)
            if i >= args.warmup:
                times[m].append(dt)
    med = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    res = {
        "fraction": args.fraction,
        "rows": sum(cards),
        "rows_full": sum(full),
        "batch": args.batch,
        "tables": T,
        "dim": DIM,
        "threads": args.threads,
        "trained_steps": args.trained_steps,
        "iters": args.iters,
        "step_ms": med,
        "step_ms_min": {m: 1e3 * min(v) for m, v in times.items()},
        "growth": _growth(args).get("catchup_growth", "default"),
    }
    if parts:  # per catch-up method: the lookup's catch-up, and the rest of the step (medians)
        res["catch_up_lookup_ms"] = {m: 1e3 * statistics.median(v[args.warmup :]) for m, v in parts.items()}
        res["step_without_catch_up_ms"] = {
            m: 1e3 * statistics.median([t - c for t, c in zip(times[m], v[args.warmup :])]) for m, v in parts.items()
        }
    if cu:
        res["catchup_op"] = tbes[cu].catchup_op
        res["catchup_rows_behind_per_step"] = statistics.median(behind)
        res["catchup_mean_log2_gap"] = statistics.median(gaps)
        res["unique_rows_per_step"] = int(
            sum(torch.unique(batches[-1][0][t * args.batch : (t + 1) * args.batch]).numel() for t in range(T))
        )
    if "batch" in med and "catchup" in med:
        res["catchup_over_lazy"] = med["catchup"] / med["batch"]
        res["target_catchup_over_lazy_le_1.3"] = res["catchup_over_lazy"] <= 1.3
    if "batch" in med and "catchup_torch" in med:
        res["catchup_torch_over_lazy"] = med["catchup_torch"] / med["batch"]
    if "catchup" in med and "catchup_torch" in med:
        res["catchup_torch_over_fused"] = med["catchup_torch"] / med["catchup"]
    if "all" in med:
        res["dense_ms_full_estimate"] = med["all"] / args.fraction
        if "catchup" in med:
            res["dense_over_catchup"] = med["all"] / med["catchup"]
            res["dense_full_estimate_over_catchup"] = res["dense_ms_full_estimate"] / med["catchup"]
    res["host"] = platform.node()
    return res


def run_all_rows(args) -> dict:
    """``catch_up_all`` of the fused op against the torch version, from the same steady state."""
    import torch

    from recsys.config import CARDINALITY_PRESETS

    torch.set_num_threads(args.threads)
    full = CARDINALITY_PRESETS["criteo_kaggle_raw"]
    cards = [max(1, int(n * args.fraction)) for n in full]
    methods = [m for m in args.methods if m.startswith("catchup")]
    if not methods:
        raise SystemExit("--all-rows times catchup and/or catchup_torch: give one in --methods")
    rs0 = steady_state_row_step(cards, args.batch, args.trained_steps)
    g = torch.Generator().manual_seed(0)
    n = sum(cards) * DIM
    state0 = (torch.randn(n, generator=g) * 1e-2, torch.randn(n, generator=g) * 1e-5, torch.rand(n, generator=g) * 1e-10 + 1e-12)
    tbes = {}
    for m in methods:
        tbes[m] = _tbe(m, cards, args)
        tbes[m].set_optimizer_step(args.trained_steps)
    times: dict[str, list[float]] = {m: [] for m in methods}
    advanced = {}
    for i in range(args.warmup + args.iters):
        for m in methods:
            tb = tbes[m]
            with torch.no_grad():
                for buf, x in zip((tb.weights, tb.momentum1, tb.momentum2), state0):
                    buf.copy_(x)
                tb.row_step.copy_(rs0)
            t0 = time.perf_counter()
            advanced[m] = tb.catch_up_all()
            if i >= args.warmup:
                times[m].append(time.perf_counter() - t0)
    med = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    res = {
        "mode": "all_rows",
        "fraction": args.fraction,
        "rows": sum(cards),
        "rows_full": sum(full),
        "batch": args.batch,
        "trained_steps": args.trained_steps,
        "threads": args.threads,
        "iters": args.iters,
        "rows_behind": advanced[methods[0]],
        "catch_up_all_ms": med,
        "mean_log2_gap": float((args.trained_steps - rs0[rs0 < args.trained_steps]).float().log2().mean()),
        "ns_per_row_behind": {m: 1e6 * v / max(advanced[m], 1) for m, v in med.items()},
    }
    if len(methods) == 2:
        res["catch_up_all_torch_over_fused"] = med["catchup_torch"] / med["catchup"]
        a, b = tbes["catchup"], tbes["catchup_torch"]  # the last round's results, same start state
        res["max_abs_weight_diff"] = float((a.weights - b.weights).abs().max())
        res["row_step_equal"] = bool(torch.equal(a.row_step, b.row_step))
    res["host"] = platform.node()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fraction", type=float, default=0.25, help="share of every raw table's rows")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--iters", type=int, default=7, help="timed rounds (one step of each method per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--trained-steps",
        type=int,
        default=5500,
        help="steady state: steps trained before (1 epoch of raw Criteo-Kaggle at batch 8K is about 5,500)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--all-rows", action="store_true", help="time catch_up_all (what a checkpoint runs) instead")
    ap.add_argument(
        "--growth",
        type=float,
        default=None,
        help="catch-up block growth (default: the library's); a huge value is one block per gap, the block scheme's floor",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="also time a catch-up step's parts: the lookup's catch-up alone, then the step (whose catch-up finds the rows current)",
    )
    args = ap.parse_args(argv)
    if not 0 < args.fraction <= 1:
        ap.error("--fraction must be in (0, 1]")
    res = run_all_rows(args) if args.all_rows else run(args)
    for k, v in res.items():
        if k != "host":
            print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
