"""Hyperparameter scaling rules (recsys/optim/scaling.py) against the CowClip paper's Criteo table."""

from __future__ import annotations

import dataclasses
import math

import pytest

from recsys.optim.scaling import scale_factors, scale_hyperparameters, warmup_factor

K = 1024
CRITEO_BASE = {"embedding_lr": 1e-4, "dense_lr": 8e-4, "l2": 1e-5, "warmup_steps": 0}
# bytedance/LargeBatchCTR README (Criteo, DeepFM): dense lr per batch as printed there (x1e-4),
# l2 as in its command lines / field-facts.md (x1e-5): 1K ... 128K
CRITEO_TABLE = {
    1: (8.0, 1),
    2: (11.31, 2),
    4: (16.0, 4),
    8: (22.62, 8),
    16: (32.0, 16),
    32: (45.25, 32),
    64: (64.0, 64),
    128: (90.50, 128),
}


@pytest.mark.parametrize("k", sorted(CRITEO_TABLE))
def test_cowclip_rule_reproduces_criteo_table(k):
    lr_e4, l2_e5 = CRITEO_TABLE[k]
    out = scale_hyperparameters(CRITEO_BASE, base_batch=K, batch=k * K, rule="cowclip")
    # the README prints the lr truncated to 2 decimals (22.627 -> 22.62, 90.5097 -> 90.50)
    assert 0 <= out["dense_lr"] / 1e-4 - lr_e4 < 0.01
    assert out["dense_lr"] == pytest.approx(8e-4 * math.sqrt(k), rel=1e-12)
    assert out["l2"] == pytest.approx(l2_e5 * 1e-5, rel=1e-12)
    assert out["embedding_lr"] == 1e-4


def test_reference_command_lines():
    out8 = scale_hyperparameters(CRITEO_BASE, K, 8 * K)
    out128 = scale_hyperparameters(CRITEO_BASE, K, 128 * K)
    assert out8["dense_lr"] == pytest.approx(22.6274e-4, abs=1e-8) and out8["l2"] == pytest.approx(8e-05)
    assert out128["dense_lr"] == pytest.approx(90.5096e-4, abs=1e-8) and out128["l2"] == pytest.approx(128e-05)


def test_sqrt_per_doubling():
    lrs = [scale_hyperparameters(CRITEO_BASE, K, (2**i) * K)["dense_lr"] for i in range(8)]
    for a, b in zip(lrs, lrs[1:]):
        assert b / a == pytest.approx(math.sqrt(2), rel=1e-12)


def test_baseline_rules_scale_all_lrs_and_keep_l2():
    sq = scale_hyperparameters(CRITEO_BASE, K, 16 * K, rule="sqrt")
    lin = scale_hyperparameters(CRITEO_BASE, K, 16 * K, rule="linear")
    assert (sq["embedding_lr"], sq["dense_lr"], sq["l2"]) == pytest.approx((4e-4, 32e-4, 1e-5))
    assert (lin["embedding_lr"], lin["dense_lr"], lin["l2"]) == pytest.approx((16e-4, 128e-4, 1e-5))
    assert scale_factors(K, K, "linear") == {"embedding_lr": 1.0, "dense_lr": 1.0, "l2": 1.0}


def test_dataclass_in_dataclass_out_and_passthrough():
    @dataclasses.dataclass(frozen=True)
    class HP:
        embedding_lr: float = 1e-4
        dense_lr: float = 8e-4
        embedding_l2: float = 1e-5
        warmup_steps: int = 0
        other: str = "kept"

    base = HP()
    out = scale_hyperparameters(base, K, 4 * K, steps_per_epoch=39_000_000 // (4 * K))
    assert isinstance(out, HP) and base.dense_lr == 8e-4  # base untouched
    assert out.dense_lr == pytest.approx(16e-4) and out.embedding_l2 == pytest.approx(4e-5)
    assert out.warmup_steps == 39_000_000 // (4 * K) and out.other == "kept"
    # without steps_per_epoch warmup_steps is left alone; a mapping gains it when given
    assert scale_hyperparameters(base, K, 4 * K).warmup_steps == 0
    assert scale_hyperparameters({"dense_lr": 1.0}, K, K, steps_per_epoch=10, warmup_epochs=0.5)["warmup_steps"] == 5
    assert scale_hyperparameters({"dense_lr": 1.0, "x": 1}, K, K)["x"] == 1


def test_warmup_shape():
    n = 100
    vals = [warmup_factor(s, n) for s in range(0, 2 * n)]
    assert vals[0] == 0.0 and vals[50] == pytest.approx(0.5) and vals[99] == pytest.approx(0.99)
    assert all(b > a for a, b in zip(vals[:n], vals[1:n]))  # strictly increasing, linear
    assert all(abs((vals[i + 1] - vals[i]) - 1 / n) < 1e-12 for i in range(n - 1))
    assert vals[n:] == [1.0] * n
    assert warmup_factor(0, 0) == 1.0 and warmup_factor(7, 0) == 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(base_batch=K, batch=0), "batch must be a positive integer"),
        (dict(base_batch=K, batch=-8), "batch must be a positive integer"),
        (dict(base_batch=0, batch=K), "base_batch must be a positive integer"),
        (dict(base_batch=K, batch=2.5), "batch must be a positive integer"),
        (dict(base_batch=K, batch=K, rule="cubic"), "unknown scaling rule"),
        (dict(base_batch=K, batch=K, steps_per_epoch=0), "steps_per_epoch"),
    ],
)
def test_bad_inputs_raise_one_line_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match) as exc:
        scale_hyperparameters(CRITEO_BASE, **kwargs)
    assert "\n" not in str(exc.value)


def test_bad_base_and_warmup_inputs():
    for base, match in (({"foo": 1}, "none of"), ({"dense_lr": -1.0}, "non-negative"), ([1, 2], "mapping or a dataclass")):
        with pytest.raises(ValueError, match=match) as exc:
            scale_hyperparameters(base, K, K)
        assert "\n" not in str(exc.value)
    for args, name in (((-1, 10), "step"), ((0, -1), "warmup_steps"), ((1.5, 10), "step")):
        with pytest.raises(ValueError, match=rf"^{name} must be a non-negative integer, got "):
            warmup_factor(*args)


def test_effective_optim_applies_the_rule_once_with_one_epoch_warmup():
    from recsys.config import OptimConfig
    from recsys.optim.scaling import effective_optim

    base = OptimConfig(embedding="cowclip_adam", embedding_lr=1e-4, dense_lr=8e-4, embedding_l2=1e-5, scale_from_batch=1024)
    eff, warm = effective_optim(base, 8192, steps_per_epoch=122)
    assert eff.embedding_lr == 1e-4 and eff.scale_from_batch == 0 and warm == 122
    assert math.isclose(eff.dense_lr, 22.6274e-4, rel_tol=1e-5)  # the reference's 8K command line
    assert math.isclose(eff.embedding_l2, 8e-5, rel_tol=1e-9)
    assert effective_optim(eff, 8192, 122) == (eff, 0)  # never scaled twice; no warmup unless asked
    lin, _ = effective_optim(dataclasses.replace(base, scale_rule="linear", warmup_epochs=0.5), 8192, 122)
    assert math.isclose(lin.embedding_lr, 8e-4) and math.isclose(lin.dense_lr, 6.4e-3) and lin.embedding_l2 == 1e-5
    assert effective_optim(dataclasses.replace(base, warmup_epochs=0.5), 8192, 122)[1] == 61


def test_error_messages_are_exact():
    cases = [
        (lambda: scale_factors(K, True), r"^batch must be a positive integer, got True$"),
        (lambda: scale_factors(K, K, "cubic"), r"^unknown scaling rule 'cubic'; expected one of cowclip\|sqrt\|linear$"),
        (lambda: scale_hyperparameters(CRITEO_BASE, K, K, steps_per_epoch=True), r"^steps_per_epoch must be a positive integer, got True$"),
        (lambda: scale_hyperparameters(CRITEO_BASE, K, K, warmup_epochs=-0.5), r"^warmup_epochs must be >= 0, got -0.5$"),
        (lambda: scale_hyperparameters({"l2": "1e-5"}, K, K), r"^l2 must be a non-negative number, got '1e-5'$"),
        (lambda: scale_hyperparameters({"dense_lr": True}, K, K), r"^dense_lr must be a non-negative number, got True$"),
        (lambda: scale_hyperparameters((1.0,), K, K), r"^base must be a mapping or a dataclass instance, got tuple$"),
        (lambda: scale_hyperparameters({"x": 1}, K, K), r"^base has none of embedding_lr, dense_lr, l2, embedding_l2$"),
        (lambda: warmup_factor(0, 2.0), r"^warmup_steps must be a non-negative integer, got 2.0$"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_both_l2_keys_scale_and_a_dataclass_without_warmup_steps_gains_none():
    out = scale_hyperparameters({"l2": 1e-5, "embedding_l2": 2e-5}, K, 4 * K)
    assert (out["l2"], out["embedding_l2"]) == pytest.approx((4e-5, 8e-5), rel=1e-12)

    @dataclasses.dataclass
    class NoWarmup:
        dense_lr: float = 1e-3

    out = scale_hyperparameters(NoWarmup(), K, 9 * K, steps_per_epoch=100)
    assert out == NoWarmup(dense_lr=pytest.approx(3e-3, rel=1e-12))
    assert not hasattr(out, "warmup_steps")


def test_effective_optim_without_scaling_keeps_the_config_and_warms_up_only_when_asked():
    from recsys.config import OptimConfig
    from recsys.optim.scaling import effective_optim

    base = OptimConfig(dense_lr=8e-4)
    assert effective_optim(base, 8192, steps_per_epoch=122) == (base, 0)  # warmup_epochs -1, no scaling: none
    cfg = dataclasses.replace(base, warmup_epochs=2.5)
    assert effective_optim(cfg, 8192, steps_per_epoch=122) == (cfg, 305)  # int(2.5 * 122)
