"""The topology-aware planner: torchrec's ``EmbeddingShardingPlanner`` with our enumerator,
proposers, partitioner and cost model injected (``topology_planner``), the seam the trainer calls
(``build``), and the per-table inputs (``constraints``, ``cache_sizing``, ``ssd_tier``).

Submodules are imported by their full names; importing this package imports nothing else.
"""
