"""Training hooks (recsys/training/hooks.py) at the points the Trainer calls them: the no-op base,
the dense-lr warmup, CowClip's hook (with and without statistics), and the merger's hook over a
stand-in merger (merges at its steps and at the last, byte accounting across a resume) in a gloo
group of one. The real merger's hook runs in the k-step integration tests
(tests/integration/training/test_kstep_merge.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from recsys.optim.dense import DenseLrWarmup
from recsys.training.hooks import CowClipHook, DenseWarmupHook, MergeHook, TrainHook


def test_the_base_hook_does_nothing_at_every_point():
    hook = TrainHook()
    hook.on_resume(3, {})
    hook.before_step(4)
    hook.after_step(4, last_step=True)
    hook.before_checkpoint(4)
    assert (hook.log_stats(4), hook.rank_state(), hook.summary(4)) == ({}, {}, {})


def test_dense_warmup_sets_the_lr_before_each_step_and_logs_it():
    model = nn.Linear(4, 1)
    dense = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=1.0))
    hook = DenseWarmupHook(DenseLrWarmup(dense, base_lr=0.2, warmup_steps=4), dense)
    seen = []
    for step in range(1, 7):
        hook.before_step(step)
        seen.append(hook.log_stats(step)["dense_lr"])
    # linear from 0 at the first step (0-based step k: k/4 of the base), then the base lr
    assert seen == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2])


def test_cowclip_hook_is_silent_for_a_model_without_cowclip_tables():
    hook = CowClipHook(nn.Sequential(nn.Linear(3, 2)))
    assert hook.log_stats(10) == {}  # no statistics, and no collective for them
    hook.before_checkpoint(10)  # no table to catch up
    assert hook.rank_state() == {} and hook.summary(10) == {}


def test_cowclip_hook_logs_the_clipped_share_of_updated_rows(gloo_world_of_one, monkeypatch):
    import recsys.training.hooks as hooks

    counts = iter([(200, 50), (0, 0)])
    monkeypatch.setattr(hooks, "take_update_stats", lambda model: next(counts))
    hook = CowClipHook(nn.Linear(2, 1))
    assert hook.log_stats(20) == {"clipped_row_fraction": 0.25}
    assert hook.log_stats(40) == {}  # nothing updated since the last line


class _Merger:
    """The KStepMerger's interface as the hook uses it: merges every `every_k` steps."""

    def __init__(self, every_k: int) -> None:
        self.every_k, self.merge_moments, self.route, self.rows = every_k, False, "flat", "touched"
        self.merges = 0
        self.cross_host_bytes_total = 0
        self.payload_bytes_per_merge = 400
        self.rows_merged, self.rows_tracked = 30, 120
        self.seconds = {"union": 0.12345}
        self.outer = SimpleNamespace(kind="nesterov", lr=0.7, momentum=0.9, compress="bf16", state_bytes=lambda: 4096)
        self.loaded: list[dict] = []

    def step(self, step: int) -> bool:
        if step % self.every_k:
            return False
        self.merge()
        return True

    def merge(self) -> None:
        self.merges += 1
        self.cross_host_bytes_total += 400

    def state_dict(self) -> dict:
        return {"merges": self.merges, "cross_host_bytes_total": self.cross_host_bytes_total}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)
        self.merges = state.get("merges", 0)
        self.cross_host_bytes_total = state.get("cross_host_bytes_total", 0)

    def max_divergence(self) -> float:
        return 0.0


def test_merge_hook_merges_at_its_steps_and_once_more_at_the_last(gloo_world_of_one):
    merger = _Merger(every_k=4)
    hook = MergeHook(merger, SimpleNamespace(hosts=2), world_size=1, checkpoint_every=8)
    for step in range(1, 11):
        hook.after_step(step, last_step=step == 10)
    assert merger.merges == 3  # steps 4, 8 and the last, 10
    for step in range(11, 13):
        hook.after_step(step, last_step=step == 12)
    assert merger.merges == 4  # the last step is a merge step: no second merge


def test_merge_hook_accounts_cross_host_bytes_per_step_across_a_resume(gloo_world_of_one):
    merger = _Merger(every_k=4)
    hook = MergeHook(merger, SimpleNamespace(hosts=2), world_size=1, checkpoint_every=8)
    hook.on_resume(8, {"merger": {"merges": 2, "cross_host_bytes_total": 800}})
    assert merger.loaded == [{"merges": 2, "cross_host_bytes_total": 800}]
    assert hook.rank_state() == {"merger": {"merges": 2, "cross_host_bytes_total": 800}}
    for step in range(9, 17):
        hook.after_step(step, last_step=step == 20)
    assert hook.log_stats(16) == {"cross_host_bytes_per_step": 800 / 8}  # 2 merges since step 8
    for step in range(17, 21):
        hook.after_step(step, last_step=step == 20)
    assert hook.log_stats(20) == {"cross_host_bytes_per_step": 400 / 4}
    assert hook.summary(20) == {
        "hosts": 2,
        "merge_every": 4,
        "merge_moments": False,
        "merges": 5,
        "merge_route": "flat",
        "checkpoint_every_steps": 8,
        "cross_host_bytes_total": 2000.0,
        "merge_payload_bytes_per_rank": 400,
        "merge_rows": "touched",
        "merge_outer": {"kind": "nesterov", "lr": 0.7, "momentum": 0.9},
        "merge_compress": "bf16",
        "merge_outer_state_bytes": 4096,
        "rows_merged_last": 30,
        "rows_tracked": 120,
        "merge_seconds": {"union": 0.123},
        "replica_divergence": 0.0,
        "cross_host_bytes_per_step": 2000.0 / 20,  # the counters cover every step (the merger had merged before)
    }


def test_a_resume_before_any_merge_counts_bytes_from_the_resume_step(gloo_world_of_one):
    merger = _Merger(every_k=4)
    hook = MergeHook(merger, SimpleNamespace(hosts=2), world_size=1, checkpoint_every=0)
    hook.on_resume(2, {})
    for step in range(3, 11):
        hook.after_step(step, last_step=step == 10)
    assert hook.summary(10)["cross_host_bytes_per_step"] == 3 * 400 / 8  # merges at 4, 8, 10 over steps 3..10
