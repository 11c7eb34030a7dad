"""The proposers given to torchrec's planner as ``proposer=``: torchrec's grid and greedy
proposers (the greedy ones stop early, deterministically) and a per-table uniform one.
"""

from __future__ import annotations

from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
from torchrec.distributed.planner.types import ShardingOption


def greedy_patience_for(num_tables: int) -> int | None:
    """How many consecutive fitting-but-worse proposals a greedy proposer may make before it
    stops (torchrec's ``GreedyProposer(threshold=...)``): 2000 / tables, within [4, 50].

    torchrec's greedy proposers walk from each table's fastest option (by torchrec's estimate)
    towards smaller ones, one table per proposal, for memory; once a proposal fits, later ones
    trade speed for memory and rarely win. Measured without a limit: on the quick benchmark
    (26 tables, 8-16 GPUs) the first greedy proposer's ~360 proposals never beat the best plan,
    which came from the second proposer's first few; on 500 tables x 128 GPUs the first fitting
    proposal of each greedy proposer was its best (of 33 tried in 60 s). Proposals that do not
    fit do not count, so a model that needs many steps to fit still gets them. A count instead of
    the wall-clock timeout (still there, 20 s, as a safety net) keeps plans deterministic on a
    loaded machine: with only the timeout, a busy 2-core machine cut the 16-GPU DeepFM search
    early and returned a 0.88 ms plan instead of 0.63 ms."""
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


def default_proposers(patience: int | None | str = "auto") -> list:
    """torchrec's default proposers, the greedy ones with early stopping after ``patience``
    fitting proposals that do not improve (``"auto"``: ``greedy_patience_for(tables)``), the
    uniform one per table (``PerTableUniformProposer``)."""
    from torchrec.distributed.planner.proposers import GridSearchProposer

    return [GridSearchProposer(), PatientGreedyProposer(patience=patience),
            PatientGreedyProposer(use_depth=False, patience=patience), PerTableUniformProposer()]
