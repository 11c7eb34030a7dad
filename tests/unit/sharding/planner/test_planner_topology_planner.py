"""sharding/planner/topology_planner.py: TopologyAwarePlanner takes what torchrec's
EmbeddingShardingPlanner takes: a torchrec Topology, and its roles (storage reservation,
enumerator, partitioner, performance model, stats, callbacks) with torchrec's meaning; every plan
torchrec's planner makes under a set of constraints, ours can make under the same constraints.
Its own arguments are checked, its constraints merged per table, its search bounded and
reported, and the same inputs give the same plan."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Stats,
    TopologyFactory,
    TrainerConfig,
)

from tests.support import plan_models
from sharding import TopologyAwarePlanner
from sharding.constants import MODEL_PARALLEL_TYPES

TABLES = ("t_cowclip", "t_adagrad", "t_sgd")


def _topology(world: int = 2, device: str = "cpu", local: int | None = None, **hardware):
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, local_world_size=local or world),
        hardware_config=HardwareConfig(**hardware),
        kernel_config=KernelConfig(compute_device=device),
    )


def _model():
    with torch.device("meta"):
        return plan_models.dlrm()


def _types(plan) -> dict[str, tuple[str, str]]:
    return {t: (ps.sharding_type, ps.compute_kernel) for m in plan.plan.values() for t, ps in m.items()}


SHARDERS = [EmbeddingBagCollectionSharder()]


@pytest.mark.parametrize("device, world, local", [("cpu", 2, 2), ("cuda", 4, 4), ("cuda", 8, 4)])
def test_a_torchrec_topology_is_planned_on_as_given(device, world, local):
    topo = _topology(world, device, local)
    planner = TopologyAwarePlanner(topo, batch_size=64)
    assert planner.torchrec_topology is topo
    assert (planner.cluster.world_size, planner.cluster.local_world_size, planner.cluster.compute_device) == (world, local, device)
    plan = planner.plan(_model(), SHARDERS)
    assert set(_types(plan)) == set(TABLES)
    ranks = {r for m in plan.plan.values() for ps in m.values() for r in (ps.ranks or [])}
    assert ranks and ranks <= set(range(world))
    with pytest.raises(ValueError, match="set HBM, DDR and the world size in the Topology"):
        TopologyAwarePlanner(topo, batch_size=64, hbm_bytes=1 << 30)


def test_storage_reservation_stats_and_callbacks_are_used():
    """A reservation of 99.99% of every rank's HBM leaves no room for HBM-only tables: the plan
    fails where the default reservation fits; a Stats and a callback given by the caller are
    called with the plan."""
    fused = {t: ParameterConstraints(compute_kernels=["fused"]) for t in TABLES}
    for reservation, fits in ((None, True), (HeuristicalStorageReservation(percentage=0.9999), False)):
        topo = _topology(2, "cuda", hbm_cap_bytes=8 << 20)  # 8 MiB per rank: the tables (~60 KB) fit
        planner = TopologyAwarePlanner(topo, batch_size=64, constraints=fused, storage_reservation=reservation)
        if fits:
            planner.plan(_model(), SHARDERS)
        else:
            with pytest.raises(Exception, match="does not fit"):
                planner.plan(_model(), SHARDERS)
    topo = _topology(2, "cpu")

    class Spy(Stats):
        calls: list = []

        def log(
            self,
            sharding_plan,
            topology,
            batch_size,
            storage_reservation,
            num_proposals,
            num_plans,
            run_time,
            best_plan,
            constraints=None,
            sharders=None,
            debug=False,
            **kwargs,
        ) -> None:
            Spy.calls.append((batch_size, len(best_plan)))

    seen = []

    def callback(plan):
        seen.append(sorted(so.name for so in plan))
        return plan

    TopologyAwarePlanner(topo, batch_size=64, stats=[Spy()], callbacks=[callback]).plan(_model(), SHARDERS)
    assert Spy.calls == [(64, 3)]
    assert seen == [sorted(TABLES)]


CONSTRAINT_SETS = {
    "data_parallel": {"t_adagrad": ParameterConstraints(sharding_types=["data_parallel"])},
    "table_wise": {t: ParameterConstraints(sharding_types=["table_wise"]) for t in TABLES},
    "row_wise": {t: ParameterConstraints(sharding_types=["row_wise"]) for t in TABLES},
    "column_wise": {"t_cowclip": ParameterConstraints(sharding_types=["column_wise"])},
    "dense_kernel": {"t_sgd": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])},
    "mixed": {
        "t_cowclip": ParameterConstraints(sharding_types=["row_wise"]),
        "t_adagrad": ParameterConstraints(sharding_types=["table_wise"]),
        "t_sgd": ParameterConstraints(sharding_types=["data_parallel"]),
    },
}


# torchrec's stock EBC sharder offers no row_wise on CPU: those sets are for CUDA topologies only
CASES = [(name, device) for device in ("cpu", "cuda") for name in CONSTRAINT_SETS if device == "cuda" or name not in ("row_wise", "mixed")]


@pytest.mark.parametrize("name, device", CASES)
def test_every_constraint_set_torchrecs_planner_plans_ours_plans_too(name, device):
    constraints = CONSTRAINT_SETS[name]
    topo = _topology(2, device)
    theirs = _types(EmbeddingShardingPlanner(topology=topo, batch_size=64, constraints=constraints).plan(_model(), SHARDERS))
    ours = _types(TopologyAwarePlanner(topo, batch_size=64, constraints=constraints).plan(_model(), SHARDERS))
    assert set(ours) == set(theirs) == set(TABLES)
    for table, c in constraints.items():  # each constrained table keeps to its constraint, in both
        for plan in (ours, theirs):
            assert plan[table][0] in c.sharding_types, (name, table, plan[table])
            if c.compute_kernels:
                assert plan[table][1] in c.compute_kernels, (name, table, plan[table])


def _ebc_and_ec_model():
    """A two-tower-like model: pooled features in an EBC, a sequence feature in an EC."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class TwoKinds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = plan_models._ebc({"t_user": 500}, torch.device("meta"))
            self.ec = EmbeddingCollection(
                tables=[EmbeddingConfig(name="t_seq", embedding_dim=8, num_embeddings=300, feature_names=["f_seq"])],
                device=torch.device("meta"),
            )

    return TwoKinds()


@pytest.mark.parametrize("with_ec_sharder", [False, True])
@pytest.mark.parametrize("planner_kind", ["topology", "torchrec"])
def test_cowclip_tags_on_tables_no_sharder_trains_are_one_line(with_ec_sharder, planner_kind):
    """EC tables tagged for CowClip-Adam: with only the CowClip EBC sharder DMP would leave the EC
    replicated under the dense optimizer (silently); with torchrec's EC sharder FBGEMM would reject
    the CowClip fused params. Both planners stop first, naming the table and what to do."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    from recsys import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam
    from recsys.config import ShardingConfig
    from sharding.planner.build import build_planner

    model = _ebc_and_ec_model()
    tag_cowclip_adam(model.parameters(), lr=0.01)
    sharders = [CowClipEmbeddingBagCollectionSharder()] + ([EmbeddingCollectionSharder()] if with_ec_sharder else [])
    planner = (
        TopologyAwarePlanner(_topology(2, "cpu"), batch_size=64)
        if planner_kind == "topology"
        else build_planner(ShardingConfig(), model, 2, 2, "cpu", 64)
    )
    what = (
        "its sharder EmbeddingCollectionSharder does not train CowClip-Adam"
        if with_ec_sharder
        else "no sharder given shards its EmbeddingCollection"
    )
    for call in (lambda: planner.plan(model, sharders), lambda: planner.collective_plan(model, sharders)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == (
            f"table t_seq of EmbeddingCollection 'ec' is tagged for CowClip-Adam, but {what}; "
            "CowClip-Adam trains EmbeddingCollection tables: add CowClipEmbeddingCollectionSharder() "
            "to the sharders"
        )
    # the EBC table alone, with the CowClip sharder: plans
    untagged = _ebc_and_ec_model()
    tag_cowclip_adam(untagged.ebc.parameters(), lr=0.01)
    planner.plan(untagged, sharders + ([] if with_ec_sharder else [EmbeddingCollectionSharder()]))
    # both tagged, with the CowClip EC sharder: plans, with kernels the CowClip kernel has
    from recsys import CowClipEmbeddingCollectionSharder

    plan = planner.plan(model, [CowClipEmbeddingBagCollectionSharder(), CowClipEmbeddingCollectionSharder()])
    seq = plan.plan["ec"]["t_seq"]
    assert seq.compute_kernel == ("dense" if seq.sharding_type == "data_parallel" else "fused"), seq


def test_cowclip_tagged_ebc_under_the_stock_sharder_names_ours():
    from recsys import tag_cowclip_adam

    with torch.device("meta"):
        model = plan_models._dlrm(plan_models._ebc(plan_models.ROWS))
    tag_cowclip_adam(model.sparse_arch.parameters(), lr=0.01)
    with pytest.raises(ValueError) as e:
        TopologyAwarePlanner(_topology(2, "cpu"), batch_size=64).plan(model, SHARDERS)
    assert str(e.value) == (
        "tables t_cowclip, t_adagrad, t_sgd of EmbeddingBagCollection 'sparse_arch.embedding_bag_collection' are "
        "tagged for CowClip-Adam, but its sharder EmbeddingBagCollectionSharder does not train CowClip-Adam; "
        "CowClip-Adam trains EmbeddingBagCollection tables: add CowClipEmbeddingBagCollectionSharder() to the sharders"
    )


def test_its_own_arguments_are_checked():
    with pytest.raises(ValueError, match=r"^hosts must be >= 1, got 0$"):
        TopologyAwarePlanner("cpu-gloo", batch_size=64, hosts=0)
    with pytest.raises(ValueError, match=r"^target_hit_rate must be in \(0, 1\], got 1.5$"):
        TopologyAwarePlanner("cpu-gloo", batch_size=64, target_hit_rate=1.5)
    with pytest.raises(ValueError, match=r"^TopologyAwarePlanner\(torchrec Topology, hosts > 1\): give one host's Topology and hosts=1, "):
        TopologyAwarePlanner(_topology(2, "cpu"), batch_size=64, hosts=2)


def test_the_constraints_of_a_plan_are_the_defaults_merged_per_table_with_the_users():
    user = {"t_adagrad": ParameterConstraints(sharding_types=["column_wise"])}
    planner = TopologyAwarePlanner("cpu-gloo", batch_size=64, constraints=user)
    got = {t: (c.sharding_types, c.compute_kernels) for t, c in planner.constraints_for(_model(), SHARDERS).items()}
    assert got == {
        "t_cowclip": (list(MODEL_PARALLEL_TYPES), ["fused"]),
        "t_adagrad": (["column_wise"], ["fused"]),
        "t_sgd": (list(MODEL_PARALLEL_TYPES), ["fused"]),
    }
    # k-step replicas on several hosts: no table-row-wise (a replica lives on one host)
    replicas = TopologyAwarePlanner("cpu-gloo", batch_size=64, hosts=2).constraints_for(_model(), SHARDERS)
    assert replicas["t_sgd"].sharding_types == [t for t in MODEL_PARALLEL_TYPES if t != "table_row_wise"]


def test_the_same_inputs_give_the_same_plan():
    plans = [TopologyAwarePlanner("cpu-gloo", batch_size=64).plan(_model(), SHARDERS) for _ in range(2)]
    placements = [
        {
            t: (ps.sharding_type, ps.compute_kernel, ps.ranks, [s.shard_sizes for s in ps.sharding_spec.shards])
            for m in p.plan.values()
            for t, ps in m.items()
        }
        for p in plans
    ]
    assert placements[0] == placements[1]


def test_a_search_the_budget_cut_reports_its_distance_from_the_lower_bound():
    from sharding.planner.bounds import step_time_lower_bound

    planner = TopologyAwarePlanner("cpu-gloo", batch_size=64, max_proposals=1)
    planner.plan(_model(), SHARDERS)
    report = planner.last_search
    # each of the four default proposers and the balance proposer made its one proposal
    assert report.proposals == {
        "GridSearchProposer#0": 1,
        "PatientGreedyProposer#1": 1,
        "PatientGreedyProposer#2": 1,
        "PerTableUniformProposer#3": 1,
        "BalanceProposer#4": 1,
    }
    assert report.budget_cut[:2] == ["GridSearchProposer#0", "PatientGreedyProposer#1"] and not report.timeout_cut
    assert report.step_s == planner.last_cost.step_time
    assert report.lower_bound_s == step_time_lower_bound(planner.cost_model, planner.search_space) <= report.step_s
    assert report.line().startswith(
        f"planner search cut: the budget of 1 proposals per proposer stopped {', '.join(report.budget_cut)} after 5 proposals; plan "
    )
    # without a cut: no bound computed
    free = TopologyAwarePlanner("cpu-gloo", batch_size=64)
    free.plan(_model(), SHARDERS)
    assert not free.last_search.cut and free.last_search.lower_bound_s is None


def test_a_model_that_cannot_fit_is_one_line():
    from sharding import ModelDoesNotFitError

    planner = TopologyAwarePlanner("cpu-gloo", batch_size=64, ddr_bytes=64 << 10)  # 64 KiB of host memory per rank
    with pytest.raises(ModelDoesNotFitError, match=r"^model does not fit cpu-gloo \(2 ranks, 1 host\): embeddings need [^\n]*$"):
        planner.plan(_model(), SHARDERS)


def test_on_gpus_the_caches_grow_into_the_hbm_the_plan_leaves_free():
    caching = {t: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"]) for t in TABLES}
    topo = _topology(2, "cuda", hbm_cap_bytes=8 << 20)  # 8 MiB per rank, the tables ~60 KB: room for whole caches

    def load_factors(**kw) -> dict[str, float | None]:
        plan = TopologyAwarePlanner(topo, batch_size=64, constraints=caching, **kw).plan(_model(), SHARDERS)
        return {t: ps.cache_params.load_factor if ps.cache_params else None for m in plan.plan.values() for t, ps in m.items()}

    assert load_factors() == {t: 0.8 for t in TABLES}  # MAX_CACHE_LOAD_FACTOR
    assert load_factors(tune_cache_load_factor=False) == {t: None for t in TABLES}  # torchrec's default when run
