"""One step-time model: the topology-aware planner logs the modelled step of the plan it returns,
and `recsys-plan show/diff --topology` print that same number for the saved plan file (both go
through sharding/planner/cost/plan_cost.py); it is also no worse than what the planner's search rated."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from sharding import save_plan
from sharding.planner.topology_planner import TopologyAwarePlanner
from tests.support.cli import run_main
from tests.support.plan_models import PLANNER_SPECS as SPECS, meta_ebc

REPO = Path(__file__).resolve().parents[3]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("topology", ["pcie-8gpu-2socket", "dgx-a100-2host"])
def test_show_prints_the_step_the_planner_logged(tmp_path, topology):
    model = meta_ebc(SPECS)
    planner = TopologyAwarePlanner(topology, 512)
    handler, logger = _Lines(), logging.getLogger("sharding.planner.topology_planner")
    old_level, old_disable = logger.level, logging.root.manager.disable
    logging.disable(logging.NOTSET)  # other planner tests silence logging process-wide
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logging.disable(old_disable)
    (line,) = [ln for ln in handler.lines if ln.startswith("topology-aware plan: ")]
    step = re.search(r"modeled step ([0-9.]+) ms \(slowest rank \d+: [0-9.]+ ms; collectives [0-9.]+ ms\)", line)
    assert step, line
    # what the search rated its best proposal; the returned plan is that, or torchrec's placement
    # of it when the model prefers that (compare_with_default): never worse
    assert planner.last_cost.step_time * 1e3 <= planner.perf_model.tracker.rating * (1 + 1e-9)

    path = tmp_path / "plan.json"
    save_plan(
        plan,
        path,
        model,
        world_size=planner.cluster.world_size,
        compute_device="cuda",
        meta={"batch_size_per_rank": 512, "pooling": planner.last_pooling},
    )
    show = ["show", str(path), "--topology", topology]
    text = run_main("recsys.plan_cli", *show, cwd=REPO)
    assert text.returncode == 0, text.stderr
    assert step.group(0) in text.stdout  # the same line, to the printed digits
    shown = json.loads(run_main("recsys.plan_cli", *show, "--format", "json", cwd=REPO).stdout)["modeled_step"]
    assert shown["step_time_ms"] == pytest.approx(planner.last_cost.step_time * 1e3, rel=1e-12)
    assert shown["rank_time_ms"] == [round(float(x) * 1e3, 4) for x in planner.last_cost.rank_time]
    # diff of the plan with itself: the same step on both sides, no delta
    d = json.loads(run_main("recsys.plan_cli", "diff", str(path), str(path), "--topology", topology, "--format", "json", cwd=REPO).stdout)
    assert d["modeled_step_s"] == pytest.approx([planner.last_cost.step_time] * 2, rel=1e-12)
