"""Hyperparameter scaling rules for growing the batch from ``base_batch`` to ``batch`` (s = batch /
base_batch), as pure functions.

* ``"cowclip"`` (CowClip paper, arXiv 2204.06240, and the commands in bytedance/LargeBatchCTR's
  README): embedding lr unchanged, embedding L2 lambda x s, dense lr x sqrt(s), and a linear
  warmup of the dense lr over the first epoch (``--warmup 1``). From the Criteo 1K base (dense lr
  8e-4, l2 1e-5) this gives 22.6274e-4 / 8e-5 at 8K and 90.5097e-4 / 128e-5 at 128K, the
  reference's command lines.
* ``"sqrt"`` / ``"linear"``: the CV/NLP rules the paper uses as baselines: *every* learning rate
  (embedding and dense) x sqrt(s) or x s. L2 is left unchanged: these rules are learning-rate
  rules (Goyal et al. linear scaling; Hoffer et al./Malladi et al. sqrt scaling for Adam), and
  scaling lambda by s is precisely CowClip's addition, so leaving it out keeps the baselines
  the rules as published. The same dense-lr warmup is applied to every rule so that the rules
  differ only in their scaling.

Warmup follows the reference (Keras ``PolynomialDecay(1e-8, warmup_steps, lr, power=1)`` on the
0-based optimizer step): the lr factor is ``step / warmup_steps`` until ``warmup_steps``, then 1
(the 1e-8 start is taken as 0).

Note: bytedance/LargeBatchCTR's README table lists l2 "1e-4 ... 128e-4" next to command lines
using ``--l2 8e-05`` (8K) and ``--l2 128e-05`` (128K); the command lines (base 1e-5, as in
/work/shared/notes/field-facts.md) are what this module reproduces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, TypeVar

__all__ = ["RULES", "scale_factors", "scale_hyperparameters", "warmup_factor"]

RULES = ("cowclip", "sqrt", "linear")

# Field names understood in the base hyperparameters (other fields are passed through unchanged).
EMBEDDING_LR_KEYS = ("embedding_lr",)
DENSE_LR_KEYS = ("dense_lr",)
L2_KEYS = ("l2", "embedding_l2")
WARMUP_KEYS = ("warmup_steps",)

T = TypeVar("T")


def scale_factors(base_batch: int, batch: int, rule: str = "cowclip") -> dict[str, float]:
    """Multipliers ``{"embedding_lr", "dense_lr", "l2"}`` for going from base_batch to batch."""
    for name, value in (("base_batch", base_batch), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if rule not in RULES:
        raise ValueError(f"unknown scaling rule {rule!r}; expected one of {'|'.join(RULES)}")
    s = batch / base_batch
    if rule == "cowclip":
        return {"embedding_lr": 1.0, "dense_lr": math.sqrt(s), "l2": s}
    if rule == "sqrt":
        return {"embedding_lr": math.sqrt(s), "dense_lr": math.sqrt(s), "l2": 1.0}
    return {"embedding_lr": s, "dense_lr": s, "l2": 1.0}


def scale_hyperparameters(
    base: T,
    base_batch: int,
    batch: int,
    rule: str = "cowclip",
    steps_per_epoch: int | None = None,
    warmup_epochs: float = 1.0,
) -> T:
    """Scaled copy of ``base`` (a mapping or a dataclass instance; same type back).

    Scales ``embedding_lr``, ``dense_lr`` and ``l2``/``embedding_l2`` where present. With
    ``steps_per_epoch`` (at the new batch size), ``warmup_steps`` becomes
    ``int(warmup_epochs * steps_per_epoch)`` (the reference's rounding; a mapping gains the key,
    a dataclass needs the field); without it ``warmup_steps`` is left as given. Raises ``ValueError`` (one line) on bad input.
    """
    factors = scale_factors(base_batch, batch, rule)
    if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0):
        raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
    if not (isinstance(warmup_epochs, (int, float)) and warmup_epochs >= 0):
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs!r}")

    if dataclasses.is_dataclass(base) and not isinstance(base, type):
        values: Mapping[str, Any] = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    elif isinstance(base, Mapping):
        values = base
    else:
        raise ValueError(f"base must be a mapping or a dataclass instance, got {type(base).__name__}")

    groups = ((EMBEDDING_LR_KEYS, "embedding_lr"), (DENSE_LR_KEYS, "dense_lr"), (L2_KEYS, "l2"))
    known = [k for keys, _ in groups for k in keys if k in values]
    if not known:
        raise ValueError("base has none of embedding_lr, dense_lr, l2, embedding_l2")
    changes: dict[str, Any] = {}
    for keys, factor_name in groups:
        for key in keys:
            if key in values:
                value = values[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"{key} must be a non-negative number, got {value!r}")
                changes[key] = value * factors[factor_name]
    if steps_per_epoch is not None:
        for key in WARMUP_KEYS:
            # a mapping gains the key; a dataclass must already have the field
            if key in values or isinstance(base, Mapping):
                changes[key] = int(warmup_epochs * steps_per_epoch)

    if isinstance(base, Mapping):
        out = dict(base)
        out.update(changes)
        return out  # type: ignore[return-value]
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup multiplier for the dense lr at 0-based ``step``: ``step / warmup_steps``,
    1.0 from ``warmup_steps`` on (and always 1.0 when ``warmup_steps`` is 0)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
    if warmup_steps == 0 or step >= warmup_steps:
        return 1.0
    return step / warmup_steps


def effective_optim(optim: T, batch: int, steps_per_epoch: int) -> tuple[T, int]:
    """The run's optimizer config after the scaling rule, and its dense-lr warmup steps.

    ``optim`` is a ``recsys.config.OptimConfig``: with ``scale_from_batch > 0`` its embedding_lr,
    dense_lr and embedding_l2 are the hyperparameters for that batch and are scaled to ``batch``
    by ``scale_rule``; ``warmup_epochs`` -1 means one epoch when scaling (the paper), none otherwise.
    The returned config has ``scale_from_batch = 0`` so it is never scaled twice.
    """
    base = optim.scale_from_batch
    warm_epochs = optim.warmup_epochs
    if warm_epochs == -1.0:
        warm_epochs = 1.0 if base else 0.0
    warmup_steps = int(warm_epochs * steps_per_epoch)
    if not base:
        return optim, warmup_steps
    scaled = scale_hyperparameters(optim, base, batch, optim.scale_rule)
    return dataclasses.replace(scaled, scale_from_batch=0), warmup_steps  # type: ignore[type-var]
