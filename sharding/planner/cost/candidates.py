"""The greedy placement's question, for every candidate rank at once: the step time and the
spread if this table-/column-wise shard went there (``candidate_scores``).

A search of 500 tables on 128 ranks asks it ~50,000 times, so it reads only what can change the
answer: the links that some candidate can lift above their phase's busiest (the others cannot set
a new maximum; the result is the same, bit for bit), and the spread (the tie-break) only for the
candidates that tie on the step, from the state's running products ``CostState.dots``."""

from __future__ import annotations

import numpy as np

from sharding.constants import A2A_TYPES, SSD_KERNELS
from sharding.constants import BYTES_PER_WEIGHT as BYTES
from sharding.planner.cost.placement import PlacedShard, with_rank
from sharding.planner.cost.state import CostState


def candidate_step_times(st: CostState, proto: PlacedShard, candidates: list[int]) -> np.ndarray:
    """The modeled step time if ``proto`` (its rank ignored) were placed on each candidate.
    Vectorized for device-resident table-/column-wise shards; others are evaluated one by one."""
    return candidate_scores(st, proto, candidates)[0]


def candidate_scores(st: CostState, proto: PlacedShard, candidates: list[int], ties: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(step time, spread) for ``proto`` on each candidate (see ``CostState.step_time_with``).
    With ``ties``, spreads only for the candidates whose step is within ``ties`` x the lowest
    (the greedy's tie-break; the others get inf)."""
    m = st.model
    cand = np.asarray(candidates)
    hf = st._host_fraction(proto)
    if hf == 0.0 and proto.sharding_type in A2A_TYPES and proto.kernel not in SSD_KERNELS:
        base = st.local_time()
        lb = st._lookup_bytes(proto)
        own = base[cand] + lb / m.mem_bw[cand]
        lk_max = np.maximum(base.max(initial=0.0), own)
        comm = np.full(len(cand), st.comm_time() + st.new_type_latency(proto.sharding_type))
        b = m.batch * proto.cols * BYTES
        t = proto.sharding_type
        rows = m.link_rows(cand)
        phases = ((f"{t}:ids", m.ids_bytes(proto.pooling), "in"), (f"{t}:fwd", b, "out"), (f"{t}:bwd", b, "in"))
        for phase, coef, which in phases:
            cur = st.load(phase)
            top = cur.max(initial=0.0)
            # Only links that some candidate can lift above today's busiest can set the new
            # maximum; the others stay at or below it, and the busiest link itself only grows.
            # So the max over those links, floored at today's, is the max over all links,
            # bit for bit (one link in ten on 128 ranks, mid-search).
            active = np.flatnonzero(cur + coef * rows[f"{which}_max"] > top)
            if len(active):
                new = rows[which].take(active, axis=0)
                new *= coef
                new += cur[active][:, None]
                comm += np.maximum(new.max(axis=0), top) - top
        steps = lk_max + comm
        sel = slice(None)
        spread = np.full(len(cand), np.inf)
        if ties is not None:
            lo = steps.min()
            sel = np.flatnonzero(steps <= lo + ties * max(lo, 1e-12))
        c = cand[sel]
        part = float((base * base).sum()) - base[c] ** 2 + own[sel] ** 2
        # |cur + c M|^2 - |cur|^2 = 2 c M.cur + c^2 |M|^2; M.cur from the state's running
        # products where it keeps them (phases its own adds built), else one product per phase
        for phase, coef, which in phases:
            if phase not in st.loads:
                continue
            d = st.dots.get(phase)
            part += 2 * coef * (d[c] if d is not None else st.load(phase) @ rows[which][:, sel])
        (_, ci, _), (_, cf, _), (_, cb, _) = phases
        part += (ci * ci + cb * cb) * m._norm2["in"][c] + cf * cf * m._norm2["out"][c]
        part += st.squares()  # every phase's; the three above add their change
        spread[sel] = part
        return steps, spread
    steps, spreads = np.empty(len(cand)), np.empty(len(cand))
    for k, r in enumerate(cand):
        trial = st.copy()
        trial.add(with_rank(proto, int(r)))
        steps[k], spreads[k] = trial.step_time(), trial.spread()
    return steps, spreads
