"""Step-time models of a placed plan: the rank-aware cost model (``model``), its adapter to torchrec's
``performance_model=`` (``perf_model``), the one modelled step of a finished plan (``plan_cost``)
and the per-link traffic view (``traffic``).

Submodules are imported by their full names; importing this package imports nothing else.
"""
