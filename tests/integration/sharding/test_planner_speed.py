"""Planning speed work: the fast paths give the same numbers as the slow ones they replace."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.topology_file import load_topology
from sharding.planner.job_topology import torchrec_topology
from sharding.planner.topology_planner import default_constraints, greedy_patience_for
from sharding.planner.torchrec_speedups import fast_deepcopy, fast_planner_internals
from tests.support.plan_models import meta_ebc as ebc
from sharding.planner.cost.candidates import candidate_scores

logging.disable(logging.WARNING)


SPECS = [(2_000_000, 64), (300_000, 32), (50_000, 128), (7_000, 16), (123_457, 64), (900, 32)]


def _space(ss):
    return [
        (
            so.name,
            so.sharding_type,
            so.compute_kernel,
            so.cache_load_factor,
            [(tuple(s.size), tuple(s.offset), s.storage, s.perf, s.rank) for s in so.shards],
        )
        for so in ss
    ]


def test_fast_internals_give_torchrecs_estimates_and_copies():
    """Memoized estimator lookups / perf and the specialised deepcopy: same search space, same
    storage and perf for every shard, as torchrec's unpatched enumerator; torchrec restored after."""
    from torchrec.distributed.planner.estimator import annotations

    cluster = load_topology("dgx-a100-2host")
    module = ebc(SPECS)
    topo = torchrec_topology(cluster)

    def run():
        e = EmbeddingEnumerator(topology=topo, batch_size=512, constraints=default_constraints(module, "cuda"))
        return e.enumerate(module, [EmbeddingBagCollectionSharder()])

    before = annotations._get_annotated_method
    with fast_planner_internals():
        fast = run()
        copied = fast_deepcopy(fast)
    assert annotations._get_annotated_method is before
    slow = run()
    assert _space(fast) == _space(slow) == _space(copied)
    for a, b in zip(fast, copied):
        assert a is not b and a.tensor is b.tensor
        assert all(x is not y and x.size is not y.size and x.storage is not y.storage for x, y in zip(a.shards, b.shards))


def _shards(table, st, kernel, ranks, rows, cols):
    per = rows // len(ranks)
    return [PlacedShard(table, st, kernel, r, per, cols, rows, cols, 2.0, None, tuple(ranks)) for r in ranks]


@pytest.mark.parametrize("sharding_type", ["row_wise", "data_parallel"])
def test_add_many_equals_adds(sharding_type):
    cm = TopologyCostModel(load_topology("dgx-a100-2host"), 512)
    shards = _shards("t", sharding_type, "fused", list(range(16)), 1_600_000, 64)
    one, many = cm.new_state(), cm.new_state()
    for s in shards:
        one.add(s)
    many.add_many(shards)
    for f in ("lookup", "hbm_bytes", "host_bytes"):
        assert np.allclose(getattr(one, f), getattr(many, f), rtol=1e-12, atol=0), f
    assert sorted(one.loads) == sorted(many.loads)
    for phase in one.loads:
        assert np.allclose(one.loads[phase], many.loads[phase], rtol=1e-12, atol=0), phase
    assert one.comm_time() == pytest.approx(many.comm_time(), rel=1e-12)


def test_twrw_loads_equal_trial_adds():
    cm = TopologyCostModel(load_topology("pcie-8gpu-2socket"), 512)
    cm2 = TopologyCostModel(load_topology("dgx-a100-2host"), 512)
    for m in (cm, cm2):
        st = m.new_state()
        st.add(PlacedShard("x", "table_wise", "fused", 3, 1000, 32, 1000, 32))
        lw = m.topo.local_world_size
        for h in range(len(m.topo.hosts)):
            ranks = list(range(h * lw, (h + 1) * lw))
            shards = _shards("t", "table_row_wise", "fused", ranks, 800_003, 64)
            trial = st.copy()
            for s in shards:
                trial.add(s)
            lk, loads = st.twrw_loads(shards, ranks)
            assert np.allclose(st.lookup + lk, trial.lookup, rtol=1e-12)
            step, spread = st.step_time_with(lk, loads, "table_row_wise")
            assert step == pytest.approx(trial.step_time(), rel=1e-12)
            assert spread == pytest.approx(trial.spread(), rel=1e-12)


def test_greedy_patience():
    assert greedy_patience_for(12) == 50 and greedy_patience_for(100) == 20
    assert greedy_patience_for(500) == 4 and greedy_patience_for(200) == 10


def test_plan_is_the_same_in_every_process():
    """torchrec orders each table's sharding types by a set (PYTHONHASHSEED); the planner sorts
    the search space, so two processes with different hash seeds make the same plan."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = (
        "import logging, warnings, torch; logging.disable(logging.WARNING); warnings.filterwarnings('ignore')\n"
        "from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder\n"
        "from tests.integration.sharding.test_planner_speed import SPECS, ebc\n"
        "from sharding.planner.topology_planner import TopologyAwarePlanner\n"
        "print(TopologyAwarePlanner('dgx-a100-2host', 512).plan(ebc(SPECS * 3), [EmbeddingBagCollectionSharder()]))\n"
    )
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout)
    assert outs[0] == outs[1] and "t_17" in outs[0]


def test_candidate_scores_equal_trial_adds():
    """The vectorized step time and spread of a table-/column-wise shard on each candidate rank
    equal those of a state it was added to."""
    for name in ("dgx-a100-2host", "pcie-8gpu-2socket"):
        m = TopologyCostModel(load_topology(name), 512)
        st = m.new_state()
        st.add(PlacedShard("x", "table_wise", "fused", 3, 1000, 32, 1000, 32))
        st.add_many(_shards("r", "row_wise", "fused", list(range(m.world)), 80_000, 16))
        proto = PlacedShard("y", "column_wise", "fused", 0, 1000, 16, 1000, 64, 2.0)
        steps, spreads = candidate_scores(st, proto, list(range(m.world)))
        for r in range(m.world):
            trial = st.copy()
            trial.add(dataclasses.replace(proto, rank=r))
            assert steps[r] == pytest.approx(trial.step_time(), rel=1e-12)
            assert spreads[r] == pytest.approx(trial.spread(), rel=1e-9)


def test_one_rank_plans_without_links():
    """A one-rank CPU topology has no rank pairs: no link carries anything, the plan still comes."""
    from sharding.planner.job_topology import cpu_topology_like
    from sharding.planner.topology_planner import TopologyAwarePlanner

    topo = cpu_topology_like(load_topology("cpu-gloo"), 1)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100 * (i + 1), feature_names=[f"f{i}"]) for i in range(4)]
    planner = TopologyAwarePlanner(topo, 64)
    plan = planner.plan(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), [EmbeddingBagCollectionSharder()])
    assert sorted(n for m in plan.plan.values() for n in m) == ["t0", "t1", "t2", "t3"]
    assert planner.cost_model.score(planner.best_plan).comm_time == pytest.approx(
        sum(planner.cost_model.type_latency(t) for t in {so.sharding_type for so in planner.best_plan})
    )


def _dp_planner_run(monkeypatch, specs):
    """Plans ``specs`` on 2 DGX hosts with data-parallel allowed; returns the planner and every
    proposal it partitioned with the ranks it gave them (copies)."""
    from sharding.planner import partitioners
    from sharding.planner.topology_planner import TopologyAwarePlanner
    from sharding.constants import MODEL_PARALLEL_TYPES

    seen = []
    inner = partitioners.TopologyPartitioner.partition

    def recording(self, proposal, storage_constraint, hbm_per_device=None):
        out = inner(self, proposal, storage_constraint, hbm_per_device)
        seen.append((list(proposal), [[sh.rank for sh in so.shards] for so in proposal], storage_constraint))
        return out

    monkeypatch.setattr(partitioners.TopologyPartitioner, "partition", recording)
    module = ebc(specs)
    cluster = load_topology("dgx-a100-2host")
    cons = default_constraints(module, "cuda", list(MODEL_PARALLEL_TYPES) + ["data_parallel"])
    planner = TopologyAwarePlanner(cluster, 4096, cons, compare_default=False)
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    monkeypatch.setattr(partitioners.TopologyPartitioner, "partition", inner)
    return planner, seen


def test_replayed_greedy_steps_give_a_fresh_searchs_placement(monkeypatch):
    """The partitioner replays the greedy steps a recent proposal shares (same start, same
    candidates): every proposal of a data-parallel search gets exactly the ranks a partitioner
    without that memory gives it, and the memory spared most of the searches."""
    from sharding.planner import partitioners

    rng = np.random.default_rng(3)
    rows = np.exp(rng.uniform(np.log(100), np.log(2e6), 40)).astype(int)
    specs = [(int(r), int(d)) for r, d in zip(rows, rng.choice([16, 32, 64, 128], 40))]
    picks = {"n": 0}
    pick = partitioners._pick

    def counting(*a):
        picks["n"] += 1
        return pick(*a)

    monkeypatch.setattr(partitioners, "_pick", counting)
    planner, seen = _dp_planner_run(monkeypatch, specs)
    with_memory = picks["n"]
    assert len(seen) > 20 and any(so.sharding_type == "data_parallel" for p, _, _ in seen for so in p)
    picks["n"] = 0
    for proposal, ranks, sc in seen:
        fresh = partitioners.TopologyPartitioner(planner.cost_model, compare_default=False)
        fresh.partition(proposal, sc)
        assert [[sh.rank for sh in so.shards] for so in proposal] == ranks
    assert with_memory < 0.8 * picks["n"]


def test_a_data_parallel_table_moves_no_other_shard():
    """A data-parallel table costs every rank the same (lookups, all-reduce), so adding one
    leaves every table-wise shard where it was (its memory permitting), refinement included."""
    from sharding.planner.partitioners import TopologyPartitioner

    cluster = load_topology("dgx-a100-2host")
    cm = TopologyCostModel(cluster, 4096)
    topo = torchrec_topology(cluster)
    specs = [(200_000 + 1000 * i, 64 if i % 3 else 128) for i in range(30)] + [(5_000, 64), (20_000, 32)]
    module = ebc(specs)
    cons = default_constraints(module, "cuda", ["table_wise", "data_parallel"])
    space = EmbeddingEnumerator(topology=topo, batch_size=4096, constraints=cons).enumerate(module, [EmbeddingBagCollectionSharder()])

    def option(i, st):
        return next(so for so in space if so.name == f"t_{i}" and so.sharding_type == st)

    placed = []
    for extra in ([], [30], [30, 31]):
        proposal = [option(i, "table_wise") for i in range(30)] + [option(i, "data_parallel") for i in extra]
        TopologyPartitioner(cm, compare_default=False).partition(proposal, topo)
        placed.append([[sh.rank for sh in so.shards] for so in proposal[:30]])
        assert all(sh.rank == r for so in proposal[30:] for r, sh in enumerate(so.shards))
    assert placed[0] == placed[1] == placed[2]
    assert len({r for ranks in placed[0] for r in ranks}) == cm.world  # spread over every rank


def test_search_loops_hash_of_an_option_is_the_options_hash():
    """Inside the planner's speedups, torchrec's search loop hashes options through a memo: the
    same value as ``hash``, and a shard with a rank set is hashed afresh."""
    from torchrec.distributed.planner import planners

    cluster = load_topology("dgx-a100-2host")
    module = ebc(SPECS)
    space = EmbeddingEnumerator(
        topology=torchrec_topology(cluster), batch_size=512, constraints=default_constraints(module, "cuda")
    ).enumerate(module, [EmbeddingBagCollectionSharder()])
    with fast_planner_internals():
        memo = planners.hash
        assert [memo(so) for so in space] == [hash(so) for so in space] == [memo(so) for so in space]
        so = next(so for so in space if len(so.shards) > 1)
        before = memo(so)
        so.shards[1].rank = 5
        assert memo(so) == hash(so) != before
        so.shards[1].rank = None
        assert memo(so) == before
    assert "hash" not in planners.__dict__


def test_a_long_lived_planner_keeps_one_searchs_options():
    """What the partitioner and the cost model keep per option (memory, shards, contributions,
    greedy steps) is dropped when the next search starts: a planner that plans many models holds
    only the latest search's options."""
    from sharding.planner.topology_planner import TopologyAwarePlanner

    planner = TopologyAwarePlanner("dgx-a100-2host", 512)
    for _ in range(2):
        planner.plan(ebc(SPECS), [EmbeddingBagCollectionSharder()])
        space = {id(so) for so in planner.search_space + planner.best_plan}  # the best plan: torchrec's copy
        part, cm = planner.partitioner, planner.cost_model
        kept = [h[0] for h in part._placed.values()] + [h[2] for h in cm._contribution_cache.values()]
        kept += [so for _, steps, _ in part._traces.items for so, _, _ in steps]
        assert kept and all(id(so) in space for so in kept)
