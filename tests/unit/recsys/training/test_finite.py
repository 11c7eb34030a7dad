"""A run stops on non-finite values: the first bad loss a rank saw, or the first state-dict
entry holding NaN/inf (named in the one line), and where a resume would start."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from recsys.training.finite import FiniteGuard, NonFiniteError, first_nonfinite_tensor


def exactly(text: str) -> str:
    """The whole of `text` as a `pytest.raises(match=)` pattern."""
    return f"^{re.escape(text)}$"


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    return m


def test_the_first_nonfinite_entry_is_named_in_state_dict_order():
    m = _model()
    assert first_nonfinite_tensor(m) is None
    with torch.no_grad():
        m[2].weight[0, 1] = float("inf")
        m[1].running_var[2] = float("nan")
    assert first_nonfinite_tensor(m) == "1.running_var"
    with torch.no_grad():
        m[1].running_var.fill_(1.0)
    assert first_nonfinite_tensor(m) == "2.weight"


def test_integer_and_empty_entries_are_not_checked():
    m = nn.Module()
    m.register_buffer("count", torch.tensor([7], dtype=torch.int64))
    m.register_buffer("empty", torch.empty(0))
    assert first_nonfinite_tensor(m) is None


def test_finite_losses_and_weights_pass():
    guard = FiniteGuard()
    for step, loss in enumerate((0.7, 0.6, 0.5), 1):
        guard.see_loss(step, loss)
    guard.check(3, _model())
    assert guard.first_bad is None


@pytest.mark.parametrize("value, word", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_the_first_bad_loss_stops_the_run_naming_its_step(value, word):
    guard = FiniteGuard()
    guard.see_loss(1, 0.7)
    guard.see_loss(2, value)
    guard.see_loss(3, float("nan"))  # later ones do not replace the first
    message = (
        f"training stopped: the loss is {word} at step 2 (rank 0); nothing non-finite was saved, "
        "no checkpoint was written (lower optim.embedding_lr or optim.dense_lr and run again)"
    )
    with pytest.raises(NonFiniteError, match=exactly(message)):
        guard.check(4)


def test_nonfinite_weights_stop_a_checkpoint_naming_the_tensor_and_the_last_checkpoint():
    m = _model()
    with torch.no_grad():
        m[0].bias[1] = float("nan")
    guard = FiniteGuard()
    guard.see_loss(7, 0.5)
    guard.check(7)  # the loss alone is fine
    message = (
        "training stopped: 0.bias holds non-finite values at step 7 (rank 0); nothing non-finite was saved, the last "
        "checkpoint is runs/x/checkpoints/step_000000005 (lower optim.embedding_lr or optim.dense_lr, then resume=true continues from it)"
    )
    with pytest.raises(NonFiniteError, match=exactly(message)):
        guard.check(7, m, last_checkpoint=lambda: "runs/x/checkpoints/step_000000005")


def test_a_bad_loss_is_named_before_bad_weights(gloo_world_of_one):
    m = _model()
    with torch.no_grad():
        m[0].bias[1] = float("nan")
    guard = FiniteGuard()
    guard.see_loss(6, float("inf"))
    with pytest.raises(NonFiniteError, match=r"^training stopped: the loss is inf at step 6 \(rank 0\);"):
        guard.check(7, m)
