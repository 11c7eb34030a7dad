"""The Checkpointer's cadence: which steps get a mid-run checkpoint, and the rounding to merge
steps of a hierarchical run (the saves themselves are tested over gloo ranks in
tests/integration/test_integrity_runs.py)."""

from __future__ import annotations

import pytest

from recsys.training.checkpoint import Checkpointer


def _due_steps(ckpt: Checkpointer, total: int) -> list[int]:
    return [s for s in range(1, total + 1) if ckpt.due(s, total)]


@pytest.mark.parametrize(
    "every, k, total, aligned, due",
    [
        (0, 4, 20, 0, []),  # only the final checkpoint
        (5, 1, 20, 5, [5, 10, 15]),  # the last step's own checkpoint is not a mid-run one
        (5, 4, 20, 8, [8, 16]),  # rounded up to a multiple of merge_every
        (8, 4, 20, 8, [8, 16]),  # already a multiple: unchanged
        (30, 16, 40, 32, [32]),
        (30, 16, 20, 32, []),  # rounded past the end: none before the final one
    ],
)
def test_cadence_and_its_rounding_to_merge_steps(tmp_path, every, k, total, aligned, due):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, every_steps=every)
    assert _due_steps(ckpt, total) == ([s for s in range(every, total, every)] if every else [])
    assert ckpt.align_every(k) == aligned == ckpt.every_steps
    assert _due_steps(ckpt, total) == due
