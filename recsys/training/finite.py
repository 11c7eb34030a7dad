"""A run stops on non-finite values instead of training, evaluating and checkpointing them.

Why: a diverged run (a learning rate far too high, a corrupt row) keeps going with `loss nan`,
and its NaN checkpoints rotate the last finite ones out of the keep window, so nothing is left to
resume from. `FiniteGuard` notes each rank's first non-finite step loss (the loss is read on the
host every step anyway) and, at the points where all ranks meet (every log step, before every
eval and checkpoint), agrees on it across ranks with one all-reduce of two integers. Before a checkpoint it
also checks every local tensor of the model's state (weights that went non-finite while the
loss of this step was still finite), so no checkpoint with non-finite values is ever written.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from recsys.training.distributed import collective_device, local_tensors

_NONE = 2**62  # "no bad step" in the MIN all-reduce


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or weights; the message is one line."""


def first_nonfinite_tensor(model: nn.Module) -> str | None:
    """The name of the first floating state-dict entry of `model` with a NaN or inf among this
    rank's values, or None."""
    for name, value in model.state_dict().items():
        for t in local_tensors(value):
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                return name
    return None


class FiniteGuard:
    """Collects this rank's first non-finite loss; `check` is collective and raises
    NonFiniteError on every rank when any rank saw one."""

    def __init__(self) -> None:
        self.first_bad: int | None = None  # this rank's first step with a non-finite loss
        self.bad_value = float("nan")

    def see_loss(self, step: int, loss: float) -> None:
        if self.first_bad is None and not math.isfinite(loss):
            self.first_bad, self.bad_value = step, loss

    def check(self, step: int, model: nn.Module | None = None, last_checkpoint: Callable[[], str | None] = lambda: None) -> None:
        """Collective over the default group. `model`: also check its weights (before a checkpoint).
        `last_checkpoint`: where a resume would start, for the message (asked only on failure)."""
        bad_tensor = first_nonfinite_tensor(model) if model is not None else None
        # one MIN all-reduce: the earliest bad step, and (negated) whether any rank holds a bad tensor
        flags = torch.tensor(
            [self.first_bad if self.first_bad is not None else _NONE, -int(bad_tensor is not None)],
            dtype=torch.int64,
            device=collective_device(),
        )
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        first, tensors_bad = int(flags[0].item()), bool(flags[1].item() < 0)
        if first == _NONE and not tensors_bad:
            return
        # the failure path only: who saw what, so the one line can name it
        mine = (self.first_bad, self.bad_value, bad_tensor)
        seen = [mine] * world
        if world > 1:
            seen = [None] * world
            dist.all_gather_object(seen, mine)
        latest = last_checkpoint()
        then = (
            f"the last checkpoint is {latest} (lower optim.embedding_lr or optim.dense_lr, then resume=true continues from it)"
            if latest
            else "no checkpoint was written (lower optim.embedding_lr or optim.dense_lr and run again)"
        )
        if first != _NONE:
            rank, (s, value, _) = min(((r, x) for r, x in enumerate(seen) if x[0] is not None), key=lambda rx: rx[1][0])
            what = f"the loss is {_word(value)} at step {s} (rank {rank})"
        else:
            rank, (_, _, name) = next((r, x) for r, x in enumerate(seen) if x[2] is not None)
            what = f"{name} holds non-finite values at step {step} (rank {rank})"
        raise NonFiniteError(f"training stopped: {what}; nothing non-finite was saved, {then}")


def _word(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
