"""The proposers given to torchrec's planner as ``proposer=``: torchrec's grid and greedy
proposers (the greedy ones stop early, deterministically) and a per-table uniform one, each under
a budget of proposals (``BudgetedProposer``) instead of a wall-clock limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
from torchrec.distributed.planner.types import Enumerator, Proposer, ShardingOption, Topology

# Proposals one proposer may make in a search (BudgetedProposer). The default proposers stay far
# below it on every model of tools/bench/planner.py (the greedy ones stop by patience: ~50 each on
# 26 tables); what it bounds is torchrec's grid search, which walks up to 10,000 proposals on a
# model with few tables and few options each.
DEFAULT_MAX_PROPOSALS = 1000


def greedy_patience_for(num_tables: int) -> int | None:
    """How many consecutive fitting-but-worse proposals a greedy proposer may make before it
    stops (torchrec's ``GreedyProposer(threshold=...)``): 2000 / tables, within [4, 50].

    torchrec's greedy proposers walk from each table's fastest option (by torchrec's estimate)
    towards smaller ones, one table per proposal, for memory; once a proposal fits, later ones
    trade speed for memory and rarely win. Measured without a limit: on the quick benchmark
    (26 tables, 8-16 GPUs) the first greedy proposer's ~360 proposals never beat the best plan,
    which came from the second proposer's first few; on 500 tables x 128 GPUs the first fitting
    proposal of each greedy proposer was its best (of 33 tried in 60 s). Proposals that do not
    fit do not count, so a model that needs many steps to fit still gets them (up to the budget of
    ``BudgetedProposer``). A count instead of a wall-clock limit keeps plans deterministic on a
    loaded machine: with a timeout, a busy 2-core machine cut the 16-GPU DeepFM search early and
    returned a 0.88 ms plan instead of 0.63 ms."""
    return max(4, min(50, 2000 // max(1, num_tables)))


class PatientGreedyProposer(GreedyProposer):
    """torchrec's ``GreedyProposer`` whose early-stopping threshold is chosen when it sees the
    search space: ``greedy_patience_for(tables)`` with ``patience="auto"``, else ``patience``."""

    def __init__(self, use_depth: bool = True, patience: int | None | str = "auto") -> None:
        super().__init__(use_depth=use_depth, threshold=None if patience == "auto" else patience)  # type: ignore[arg-type]
        self.patience = patience

    def load(self, search_space: list[ShardingOption], enumerator=None) -> None:
        super().load(search_space, enumerator)
        if self.patience == "auto":
            self._threshold = greedy_patience_for(len({so.name for so in search_space}))


class PerTableUniformProposer(UniformProposer):
    """torchrec's ``UniformProposer`` (one plan per sharding type, every table of that type),
    except that a table without the type (a user constraint excludes it) keeps its own best
    option instead of cancelling the type's plan for all tables.

    torchrec proposes a type's uniform plan only if every table offers it, so constraining one
    table to ``column_wise`` removed the "all table-column-wise" plan the planner chose without
    constraints, and the other tables' choice changed with it (a constraint leaking to other tables)."""

    def load(self, search_space: list[ShardingOption], enumerator=None) -> None:
        from torchrec.distributed.planner.proposers import _sharding_option_score

        self._reset()
        by_fqn: dict[str, list[ShardingOption]] = {}
        for so in search_space:
            by_fqn.setdefault(so.fqn, []).append(so)
        types: list[str] = []
        for so in search_space:
            if so.sharding_type not in types:
                types.append(so.sharding_type)
        for fqn in by_fqn:
            by_fqn[fqn].sort(key=lambda x: _sharding_option_score(x, self._use_depth))
        for st in types:
            proposal = []
            for options in by_fqn.values():
                same = [so for so in options if so.sharding_type == st]
                proposal.append(same[0] if same else options[0])
            self._grouped_sharding_options.append(proposal)


class BudgetedProposer(Proposer):
    """A proposer that stops after ``max_proposals`` proposals (``None``: never), counted here.

    torchrec's ``timeout_seconds`` stops the whole search at a wall-clock limit, so the plan
    depends on how busy the machine is: on a loaded 2-core machine the limit was reached after 40
    proposals and the later proposers (the uniform and balance ones, where most of the gain comes
    from) never ran. A count per proposer gives the same plan for the same inputs on any machine,
    and every proposer gets its turn. ``proposals`` counts what it proposed, ``evaluated`` the
    proposals the planner rated (fed back); ``cut`` says the budget stopped it; ``exhausted`` that
    it ran out of proposals itself (neither: something else stopped the search, e.g. a timeout)."""

    def __init__(self, inner: Proposer, max_proposals: int | None = DEFAULT_MAX_PROPOSALS) -> None:
        if max_proposals is not None and max_proposals < 1:
            raise ValueError(f"max_proposals must be >= 1 or None, got {max_proposals}")
        self.inner = inner
        self.max_proposals = max_proposals
        self.proposals = 0
        self.evaluated = 0
        self.cut = False
        self.exhausted = False

    @property
    def name(self) -> str:
        return type(self.inner).__name__

    def load(self, search_space: list[ShardingOption], enumerator: Optional[Enumerator] = None) -> None:
        self.proposals, self.evaluated, self.cut, self.exhausted = 0, 0, False, False
        self.inner.load(search_space, enumerator)

    def propose(self) -> Optional[list[ShardingOption]]:
        if self.max_proposals is not None and self.proposals >= self.max_proposals:
            self.cut = True
            return None
        proposal = self.inner.propose()
        if proposal is None:
            self.exhausted = True
        else:
            self.proposals += 1
        return proposal

    def feedback(
        self,
        partitionable: bool,
        plan: Optional[list[ShardingOption]] = None,
        perf_rating: Optional[float] = None,
        storage_constraint: Optional[Topology] = None,
    ) -> None:
        self.evaluated += 1
        self.inner.feedback(partitionable=partitionable, plan=plan, perf_rating=perf_rating, storage_constraint=storage_constraint)


@dataclass
class SearchReport:
    """What a search did: proposals evaluated per proposer (in order), which proposers the budget stopped,
    whether something else (torchrec's ``timeout_seconds``) stopped it; with the plan's modelled
    step and the lower bound of the search space when a cut makes the distance worth knowing."""

    proposals: dict[str, int]
    budget_cut: list[str] = field(default_factory=list)
    timeout_cut: bool = False
    max_proposals: int | None = None
    step_s: float | None = None
    lower_bound_s: float | None = None

    @property
    def cut(self) -> bool:
        return bool(self.budget_cut) or self.timeout_cut

    @classmethod
    def of(cls, proposers: list[BudgetedProposer], max_proposals: int | None, timeout_seconds: float | None) -> "SearchReport":
        names = [f"{p.name}#{i}" for i, p in enumerate(proposers)]
        return cls(
            proposals={n: p.evaluated for n, p in zip(names, proposers)},
            budget_cut=[n for n, p in zip(names, proposers) if p.cut],
            # torchrec's loop leaves a proposer without asking it again when its clock ran out
            timeout_cut=timeout_seconds is not None and any(not p.cut and not p.exhausted for p in proposers),
            max_proposals=max_proposals,
        )

    def line(self) -> str:
        """One log line: what cut the search, and how far the plan may be from the best."""
        what = []
        if self.budget_cut:
            what.append(f"the budget of {self.max_proposals} proposals per proposer stopped {', '.join(self.budget_cut)}")
        if self.timeout_cut:
            what.append("torchrec's timeout_seconds stopped the search (the plan depends on the machine's load)")
        gap = ""
        if self.step_s is not None and self.lower_bound_s:
            gap = (
                f"; plan {self.step_s * 1e3:.4g} ms, lower bound of any plan {self.lower_bound_s * 1e3:.4g} ms "
                f"({self.step_s / self.lower_bound_s:.2f}x)"
            )
        return f"planner search cut: {'; '.join(what)} after {sum(self.proposals.values())} proposals{gap}"


def default_proposers(patience: int | None | str = "auto") -> list:
    """torchrec's default proposers, the greedy ones with early stopping after ``patience``
    fitting proposals that do not improve (``"auto"``: ``greedy_patience_for(tables)``), the
    uniform one per table (``PerTableUniformProposer``)."""
    from torchrec.distributed.planner.proposers import GridSearchProposer

    return [
        GridSearchProposer(),
        PatientGreedyProposer(patience=patience),
        PatientGreedyProposer(use_depth=False, patience=patience),
        PerTableUniformProposer(),
    ]
