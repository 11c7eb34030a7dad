"""A topology-aware drop-in for torchrec's ``EmbeddingShardingPlanner``.

It is torchrec's planner (enumerator, shard estimators, proposers, storage reservation, plan
output) with these pieces swapped in through torchrec's extension points, i.e. the constructor
arguments of an ``EmbeddingShardingPlanner`` that ``plan()`` builds for each model (the
constraints depend on the model's tables; no private attribute is set from outside):

- the ``Topology`` is built from a :class:`ClusterTopology` (HBM per GPU, host memory per rank =
  host memory / ranks per host, SSD per rank = a host's SSD tier / ranks per host, bandwidths
  from the path model in ``sharding/topology/paths.py``, through ``bandwidth.py``);
- :class:`TopologyPartitioner` places shards greedily by the modeled step time of
  ``sharding/planner/cost/model.py`` (rank-pair bandwidths, shared PCIe uplinks, NUMA placement) subject to
  HBM per rank and host memory per host; row-wise-in-host groups stay inside one host (its NVLink
  domain); then a local search (``refine_placement``) moves and swaps table-/column-wise shards
  while the modeled step time drops. After the search it also runs torchrec's
  ``GreedyPerfPartitioner`` on the chosen proposal and keeps the better of the two by the model,
  so it never does worse than torchrec's placement by that model;
- :class:`TopologyPerfModel` rates plans, so torchrec's search keeps the best plan by that model;
- :class:`TopologyEnumerator` (torchrec's enumerator, given as ``enumerator=``) enumerates with
  the model's constraints: the planner's defaults merged per table with the user's
  (``merge_constraints``), in a fixed order; the proposers (``default_proposers``, given as
  ``proposer=``) are torchrec's, the greedy ones with early stopping, the uniform one per table
  (``PerTableUniformProposer``: a table a constraint keeps off a type keeps its own choice);
- the search space gets column-wise variants cut into 2 and 4 column shards
  (``finer_column_splits``; torchrec cuts columns in blocks of 128, so a dim-16 or dim-128 table
  has no split of its own), and a last proposer (``sharding/planner/balance_proposer.py``) starts from
  the best plan found and cuts the tables of its slowest rank finer while the model says it helps.

On a topology with an SSD tier, tables that fit neither HBM nor host memory are also offered
torchrec's ``key_value`` kernel (FBGEMM's SSD kernels, CUDA only; ``sharding/planner/ssd_tier.py``): their
rows live on the host's SSD behind an HBM cache, the partitioner checks SSD capacity per host and
the cost model charges the cache misses' SSD reads and write-backs.

After the search, a callback raises the cache load factor of ``fused_uvm_caching`` and
``key_value`` tables into the HBM left free on their ranks (``sharding/planner/load_factor_tuning.py``).
With ``cache_stats`` (per-table id frequencies measured from data, ``sharding/planner/cache_sizing.py``)
each such table starts at the smallest load factor reaching ``target_hit_rate``, the cost model
charges its measured miss rate, and the callback stops where its hit-rate curve stops rising.
A model that cannot fit raises :class:`ModelDoesNotFitError` (a torchrec ``PlannerError``) with a
one-line message.

Deterministic: the same inputs give the same plan on an idle or a loaded machine. Nothing in the
search reads a clock: the greedy proposers stop after ``greedy_patience_for(tables)`` fitting
proposals that do not improve, and every proposer after ``max_proposals`` proposals
(``BudgetedProposer``; one log line, with the plan's distance from the lower bound, when that cut
a search). torchrec's wall-clock ``timeout_seconds`` is off unless the caller sets it (then plans
depend on the machine's load again, and the log says when it cut the search).

Speed (500 tables on 128 GPUs in ~10 s on a 2-core machine, idle; ~23 s with data-parallel
allowed; the cyclic garbage collector paused while planning): torchrec's enumerator runs with
memoized estimator internals
(``sharding/planner/torchrec_speedups.py``, only while this planner plans); the partitioner adds
row-wise and data-parallel tables in bulk (their cost recorded once per option), scores
table-row-wise hosts in closed form, and replays the greedy steps a proposal shares with a recent
one (``partitioners._Traces``: the same ranks a fresh search gives).

    planner = TopologyAwarePlanner(load_topology("dgx-a100-2host"), batch_size=512)
    plan = planner.plan(model_on_meta, sharders)       # or collective_plan(model, sharders, pg)
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Mapping

from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.types import (
    Enumerator,
    Partitioner,
    PerfModel,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Stats,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import CacheStatistics, ModuleSharder, ShardingPlan

from sharding.planner.balance_proposer import BalanceProposer
from sharding.planner.cache_sizing import DEFAULT_TARGET_HIT_RATE, apply_cache_stats
from sharding.constants import MODEL_PARALLEL_TYPES
from sharding.planner.cost.model import TopologyCostModel
from sharding.optimizer_state import check_cowclip_sharders, table_bytes
from sharding.planner.constraints import default_constraints, merge_constraints
from sharding.planner.enumerators import DEFAULT_COLUMN_SPLITS, TopologyEnumerator, finer_column_splits
from sharding.planner.partitioners import TopologyPartitioner, refine_placement
from sharding.planner.cost.perf_model import CachedPerfModel
from sharding.planner.cost.plan_cost import modeled_step, step_line
from sharding.planner.bounds import step_time_lower_bound
from sharding.planner.proposers import (
    DEFAULT_MAX_PROPOSALS,
    BudgetedProposer,
    PatientGreedyProposer,
    SearchReport,
    PerTableUniformProposer,
    default_proposers,
    greedy_patience_for,
)
from sharding.planner.ssd_tier import key_value_tables
from sharding.tables import table_configs
from sharding.topology.cluster import ClusterTopology
from sharding.topology.topology_file import load_topology
from sharding.planner.torchrec_speedups import fast_planner_internals, paused_gc
from sharding.planner.job_topology import cluster_to_plan, remap_plan_to_host, torchrec_topology
from sharding.planner.does_not_fit import ModelDoesNotFitError, fit_message
from sharding.planner.load_factor_tuning import grow_cache_load_factors

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "TopologyAwarePlanner",
    "ModelDoesNotFitError",
    # the roles, each in its own module (the torchrec planner package's layout), re-exported here
    "TopologyPartitioner",
    "refine_placement",
    "CachedPerfModel",
    "TopologyEnumerator",
    "finer_column_splits",
    "DEFAULT_COLUMN_SPLITS",
    "default_proposers",
    "greedy_patience_for",
    "PatientGreedyProposer",
    "PerTableUniformProposer",
    "default_constraints",
    "merge_constraints",
]

logger = logging.getLogger(__name__)

GIB = 1024**3


class TopologyAwarePlanner(EmbeddingShardingPlanner):
    """A torchrec ``ShardingPlanner`` for a :class:`ClusterTopology` (see module docstring).

    ``topology``: a shipped name (``"dgx-a100"``, ``"cpu-gloo"``), a YAML path, a
    :class:`ClusterTopology`, or torchrec's own ``Topology`` (planned on as given; our cost model
    sees the uniform cluster it describes: sharding/topology/from_torchrec.py). ``batch_size`` is
    per rank, as for torchrec's planner. torchrec's other constructor arguments are taken with
    torchrec's meaning: ``enumerator``, ``storage_reservation``, ``partitioner``,
    ``performance_model``, ``proposer`` and ``stats`` replace the planner's own (a given enumerator
    holds its own constraints, as in torchrec; a given partitioner or performance model turns off
    the comparison with torchrec's default plan and the score reuse that rely on ours),
    ``callbacks`` run after the planner's own, ``timeout_seconds`` and ``debug`` as in torchrec
    (``timeout_seconds`` defaults to None, as in torchrec: a wall-clock limit makes the plan depend
    on the machine's load). ``max_proposals``: proposals each proposer may make (the given ones
    too), the search's deterministic budget; ``None``: no limit. ``last_search`` reports the
    latest search (proposals per proposer, what cut it).
    ``constraints``: torchrec ``ParameterConstraints`` per table, merged per table with the
    planner's defaults (model-parallel types, fused kernels, plus UVM / UVM caching on GPUs): a
    constraint on one table never changes another table's options, and fields left None on a
    constrained table (``sharding_types``, ``compute_kernels``) keep the defaults.

    ``hosts`` > 1 is for k-step merging (``recsys.KStepMergeHook``): every host holds a whole
    replica, so the plan is made for one host's ranks (the topology's first host if it lists
    ``hosts`` hosts) and ``collective_plan`` returns it with its placements moved to the calling
    rank's host, ready for ``DistributedModelParallel(env=<the host's ShardingEnv>)``. A CPU
    topology with one host is resized to the ranks it plans for: ``world_size`` ranks, or, for a
    topology given by name or path, the initialised process group's world size / ``hosts``
    (a ``ClusterTopology`` object is used as given).

    Example (in every rank of a torchrun job)::

        from sharding import TopologyAwarePlanner
        planner = TopologyAwarePlanner("cpu-gloo", batch_size=512)
        model = DistributedModelParallel(model, plan=planner.collective_plan(model, sharders), sharders=sharders)
        # or, offline on a meta-device model: planner.plan(model, sharders)
    """

    def __init__(
        self,
        topology: ClusterTopology | Topology | str | os.PathLike,
        batch_size: int,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        *,
        hosts: int = 1,
        world_size: int | None = None,
        hbm_bytes: int | None = None,
        ddr_bytes: int | None = None,
        compare_default: bool = True,
        tune_cache_load_factor: bool = True,
        timeout_seconds: int | None = None,
        max_proposals: int | None = DEFAULT_MAX_PROPOSALS,
        proposer=None,
        debug: bool = False,
        greedy_patience: int | None | str = "auto",
        cache_stats: Mapping[str, CacheStatistics] | None = None,
        target_hit_rate: float = DEFAULT_TARGET_HIT_RATE,
        column_splits: tuple[int, ...] = DEFAULT_COLUMN_SPLITS,
        enumerator: Enumerator | None = None,
        storage_reservation: StorageReservation | None = None,
        partitioner: Partitioner | None = None,
        performance_model: PerfModel | None = None,
        stats: Stats | list[Stats] | None = None,
        callbacks: list | None = None,
    ) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        self.hosts = int(hosts)
        self.column_splits = tuple(column_splits)
        self.search_space: list[ShardingOption] = []
        given_topology = topology if isinstance(topology, Topology) else None
        if given_topology is not None:  # torchrec's own: planned on as given; a cluster of it for our cost model
            if hbm_bytes is not None or ddr_bytes is not None or world_size is not None:
                raise ValueError(
                    "TopologyAwarePlanner(torchrec Topology, ...): set HBM, DDR and the world size in the "
                    "Topology (TopologyFactory.create_topology), not hbm_bytes / ddr_bytes / world_size"
                )
            from sharding.topology.from_torchrec import cluster_from_torchrec

            self.cluster = cluster_to_plan(cluster_from_torchrec(topology), self.hosts, None, from_job=False)
        elif isinstance(topology, ClusterTopology):  # used as given (the caller sized it), unless world_size
            self.cluster = cluster_to_plan(topology, self.hosts, world_size, from_job=False)
        else:
            self.cluster = cluster_to_plan(load_topology(topology), self.hosts, world_size, from_job=True)
        if given_topology is not None and self.hosts > 1:
            raise ValueError(
                "TopologyAwarePlanner(torchrec Topology, hosts > 1): give one host's Topology and "
                "hosts=1, or a ClusterTopology / topology name with hosts"
            )
        self.user_constraints: dict[str, ParameterConstraints] = dict(constraints or {})
        self.greedy_patience = greedy_patience
        self.cache_stats = dict(cache_stats or {})
        self.target_hit_rate = float(target_hit_rate)
        if not 0.0 < self.target_hit_rate <= 1.0:
            raise ValueError(f"target_hit_rate must be in (0, 1], got {target_hit_rate}")
        self.cost_model = TopologyCostModel(self.cluster, batch_size)
        # torchrec's roles, as EmbeddingShardingPlanner takes them: a role the caller gives replaces
        # ours (torchrec's semantics); callbacks are added to ours
        ours = partitioner is None
        self.partitioner = TopologyPartitioner(self.cost_model, compare_default=compare_default) if ours else partitioner
        perf_model = performance_model or CachedPerfModel(self.cost_model, self.partitioner if ours else None)
        if proposer is None:
            proposer = default_proposers(greedy_patience)
            if self.column_splits and isinstance(perf_model, CachedPerfModel):
                proposer.append(BalanceProposer(perf_model.tracker))
        proposer = [BudgetedProposer(p, max_proposals) for p in (proposer if isinstance(proposer, list) else [proposer])]
        self.max_proposals = max_proposals
        self.last_search: SearchReport | None = None
        own_callbacks = [self.partitioner.compare_with_default] if ours else []
        if tune_cache_load_factor and self.cluster.compute_device != "cpu":
            own_callbacks.append(self._tune_load_factors)
        # What each plan() hands torchrec's planner through its constructor (the constraints and the
        # enumerator that holds them are per model: the defaults depend on the model's tables).
        self.torchrec_topology = given_topology or torchrec_topology(self.cluster, hbm_bytes, ddr_bytes)
        self.batch_size_per_rank = int(batch_size)
        self.perf_model = perf_model
        self.proposers = proposer
        self.callbacks = own_callbacks + list(callbacks or [])
        self.timeout_seconds = timeout_seconds
        self.debug = debug
        self.user_enumerator = enumerator  # holds its own constraints, as in torchrec
        self.storage_reservation = storage_reservation
        self.stats = stats
        self.constraints: dict[str, ParameterConstraints] = {}
        self.last_planner: EmbeddingShardingPlanner | None = None
        self.last_enumerator: TopologyEnumerator | None = None
        # a valid torchrec planner of its own too (collective_plan, isinstance checks)
        super().__init__(**self._torchrec_planner_args({}))

    def _torchrec_planner_args(self, constraints: dict[str, ParameterConstraints]) -> dict:
        """The constructor arguments of torchrec's planner: our roles, and ``constraints`` with the
        enumerator that holds them."""
        enumerator = self.user_enumerator or TopologyEnumerator(
            self.torchrec_topology, self.batch_size_per_rank, self.column_splits, constraints
        )
        extra = {k: v for k, v in (("storage_reservation", self.storage_reservation), ("stats", self.stats)) if v is not None}
        return dict(
            topology=self.torchrec_topology,
            batch_size=self.batch_size_per_rank,
            enumerator=enumerator,
            partitioner=self.partitioner,
            performance_model=self.perf_model,
            constraints=constraints or None,
            debug=self.debug,
            callbacks=self.callbacks,
            timeout_seconds=self.timeout_seconds,
            proposer=self.proposers,
            **extra,
        )

    @property
    def best_plan(self) -> list[ShardingOption] | None:
        """The sharding options of the latest plan (torchrec's planner keeps them as its best plan)."""
        return None if self.last_planner is None else self.last_planner._best_plan

    def constraints_for(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]] | None = None) -> dict[str, ParameterConstraints]:
        """The constraints a plan of ``module`` uses: the planner's defaults for every table,
        merged per table with the user's (``merge_constraints``), plus measured cache statistics.
        The SSD tier is offered to the tables that HBM and host memory cannot hold, each counted
        with the state of the optimizer it trains with (its tag, else its sharder's fused params)."""
        types = [t for t in MODEL_PARALLEL_TYPES if self.hosts == 1 or t != "table_row_wise"]
        ssd = key_value_tables(table_bytes(module, sharders), self.torchrec_topology)
        merged = merge_constraints(default_constraints(module, self.cluster.compute_device, types, ssd), self.user_constraints)
        if self.cache_stats:
            apply_cache_stats(merged, self.cache_stats, self.target_hit_rate)
        return merged

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """A plan for ``module`` on the planner's topology (one host's ranks when ``hosts`` > 1,
        with host-local placements; ``collective_plan`` moves them to the caller's host)."""
        with paused_gc():  # the search makes no cyclic garbage to speak of; the collector's passes cost ~15%
            return self._plan(module, sharders)

    def _plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        check_cowclip_sharders(module, sharders)  # a tagged table no sharder trains: one line, not a wrong run
        # torchrec's planner, configured through its constructor for this model: our enumerator
        # (holding this model's constraints), partitioner, perf model, proposers and callbacks
        self.constraints = self.constraints_for(module, sharders)
        args = self._torchrec_planner_args(self.constraints)
        self.last_enumerator = args["enumerator"] if isinstance(args["enumerator"], TopologyEnumerator) else None
        self.last_planner = EmbeddingShardingPlanner(**args)
        if isinstance(self.perf_model, CachedPerfModel):
            self.perf_model.tracker.reset()
        try:
            with fast_planner_internals():
                plan = self.last_planner.plan(module, sharders)
        except ModelDoesNotFitError:
            raise
        except PlannerError as e:
            self.last_search = SearchReport.of(self.proposers, self.max_proposals, self.timeout_seconds)
            if self.last_search.timeout_cut and not self.last_planner._num_plans:
                raise PlannerError(
                    f"no plan: timeout_seconds={self.timeout_seconds} stopped the search after "
                    f"{self.last_planner._num_proposals} proposals, before any plan was made (raise it, "
                    "or leave it None and bound the search by max_proposals)",
                    PlannerErrorType.OTHER,
                ) from None
            raise ModelDoesNotFitError(fit_message(self.cluster, module, self.torchrec_topology, e, sharders)) from None
        self.search_space = self.last_enumerator.last_search_space if self.last_enumerator is not None else []
        # The number the search minimised, for the plan it returns: the same function and inputs
        # as `recsys-plan show --topology` (sharding/planner/cost/plan_cost.py), so the two always agree.
        self.last_pooling = {
            c.name: float(sum(self.constraints[c.name].pooling_factors))
            if c.name in self.constraints and self.constraints[c.name].pooling_factors
            else POOLING_FACTOR
            for c in table_configs(module)
        }
        tables = {c.name: {"num_embeddings": c.num_embeddings, "embedding_dim": c.embedding_dim} for c in table_configs(module)}
        self.last_cost = modeled_step(plan, tables, self.cluster, self.cost_model.batch, self.last_pooling, self.cost_model)
        logger.info("topology-aware plan: %s on %s", step_line(self.last_cost), self.cluster.name or "the topology")
        self.last_search = SearchReport.of(self.proposers, self.max_proposals, self.timeout_seconds)
        if self.last_search.cut:
            self.last_search.step_s = self.last_cost.step_time
            if self.search_space:
                self.last_search.lower_bound_s = step_time_lower_bound(self.cost_model, self.search_space)
            logger.warning(self.last_search.line())
        return plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: "dist.ProcessGroup | None" = None,
    ) -> ShardingPlan:
        """Plans on rank 0 of ``pg`` (default: the whole job) and broadcasts. With ``hosts`` > 1
        the plan is for one host's ranks and comes back with its shard placements moved to the
        calling rank's host (``remap_plan_to_host``): pass it to DMP with the host's ShardingEnv."""
        import torch.distributed as dist

        check_cowclip_sharders(module, sharders)  # on every rank, before rank 0 plans and the others wait
        plan = super().collective_plan(module, sharders, pg)
        if self.hosts == 1:
            return plan
        world = dist.get_world_size()
        per_host = self.cluster.world_size
        if world != self.hosts * per_host:
            raise ValueError(
                f"planner plans {self.hosts} hosts x {per_host} ranks ({self.cluster.name or 'topology'}), the job has {world} ranks"
            )
        return remap_plan_to_host(plan, dist.get_rank() // per_host, per_host, self.cluster.compute_device)

    def _tune_load_factors(self, plan: list[ShardingOption]) -> list[ShardingOption]:
        """Grow the chosen plan's cache load factors into the HBM it leaves free on the storage our
        partitioner placed it in (``grow_cache_load_factors``)."""
        return grow_cache_load_factors(plan, self.partitioner.last_storage_constraint)
