"""Training hooks (recsys/training/hooks.py) at the points the Trainer calls them, without a
process group: the no-op base, the dense-lr warmup, CowClip's hook on a model without CowClip
tables. The merger's hook runs in the k-step integration tests (tests/integration/test_kstep_merge.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from recsys.optim.dense import DenseLrWarmup
from recsys.training.hooks import CowClipHook, DenseWarmupHook, TrainHook


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
