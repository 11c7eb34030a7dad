"""What the cost model returns for a plan: ``PlanCost``, the modelled step and its parts per rank
and per collective phase (sharding/planner/cost/model.py says how each is computed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PlanCost:
    """A scored plan. ``step_time`` = slowest rank's lookups + host traffic, plus the collectives
    (every phase's busiest directed link + latency: ``comm_time``, the same for every rank).

    ``comm`` per rank is an attribution for reading a plan: each phase's busiest link among the
    rank's own first and last hops (its NVLink/PCIe/NIC send and receive sides), plus latency;
    ``rank_time = lookup + host_io + comm`` and ``step_time >= rank_time.max()``.
    ``phases``: phase -> (busiest directed link, seconds on it). ``ssd_io`` / ``ssd_bytes``: the
    SSD tier's seconds and bytes per rank (``rank_time`` includes ``ssd_io``; zeros without
    key_value shards)."""

    step_time: float  # seconds
    rank_time: np.ndarray  # seconds per rank (comm attributed to the rank's own links)
    lookup: np.ndarray
    host_io: np.ndarray
    comm: np.ndarray
    hbm_bytes: np.ndarray
    host_bytes: np.ndarray
    comm_time: float = 0.0
    phases: dict = field(default_factory=dict)
    ssd_io: np.ndarray | None = None
    ssd_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        w = len(self.rank_time)
        if self.ssd_io is None:
            self.ssd_io = np.zeros(w)
        if self.ssd_bytes is None:
            self.ssd_bytes = np.zeros(w)

    @property
    def bottleneck_rank(self) -> int:
        return int(np.argmax(self.rank_time)) if len(self.rank_time) else 0

    def as_dict(self) -> dict:
        out = {
            "step_time_ms": self.step_time * 1e3,
            "comm_time_ms": self.comm_time * 1e3,
            "rank_time_ms": [round(float(x) * 1e3, 4) for x in self.rank_time],
            "busiest_links": {p: [name, round(t * 1e3, 4)] for p, (name, t) in sorted(self.phases.items())},
            "max_hbm_bytes": int(self.hbm_bytes.max(initial=0)),
            "max_host_bytes_per_rank": int(self.host_bytes.max(initial=0)),
        }
        if self.ssd_bytes.any():  # only plans with key_value shards (others' reports stay as they were)
            out["ssd_io_ms"] = [round(float(x) * 1e3, 4) for x in self.ssd_io]
            out["max_ssd_bytes_per_rank"] = int(self.ssd_bytes.max(initial=0))
        return out
