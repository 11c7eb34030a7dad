"""A run's checkpoints: the `Checkpointer` (when to save, what to resume, DCP save and load), and
beside it what the run directory's checks and `recsys export` also read without a process group:
the on-disk layout and its atomic commit (`layout.py`), completeness and hash checks
(`integrity.py`), the state-shape comparison that decides whether a resume is compatible
(`shape.py`), and the one-line reasons for a failed write (`failure.py`)."""

from recsys.training.checkpoint.checkpointer import CheckpointError, Checkpointer

__all__ = ["CheckpointError", "Checkpointer"]
