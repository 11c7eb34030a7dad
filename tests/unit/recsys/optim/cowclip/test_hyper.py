"""CowClip-Adam's fused_params: a sharder's keys are checked (a misspelled one is one line, never a
setting silently ignored), and ``lr`` means ``learning_rate`` there as it does for
``apply_optimizer_in_backward`` (which torchrec renames; sharder-level fused_params it does not)."""

from __future__ import annotations

import pytest

from recsys import CowClipEmbeddingBagCollectionSharder
from recsys.optim.cowclip.hyper import (
    COWCLIP_ADAM,
    CowClipHyper,
    check_fused_params,
    cowclip_fused_params,
    is_cowclip_optimizer,
    other_fused_param_keys,
)


def test_sharder_fused_params_lr_is_the_learning_rate():
    fp = cowclip_fused_params(CowClipHyper(learning_rate=0.01, l2=1e-5))
    assert fp["lr"] == 0.01 and "learning_rate" not in fp
    sharder = CowClipEmbeddingBagCollectionSharder(fused_params=fp)
    hp = CowClipHyper.from_fused_params(sharder.fused_params)
    assert (hp.learning_rate, hp.l2) == (0.01, 1e-5)  # not the default 1e-4
    assert CowClipHyper.from_fused_params({"optimizer": COWCLIP_ADAM, "lr": 0.5}).learning_rate == 0.5
    with pytest.raises(ValueError, match=r"^CowClip fused_params: lr=0\.5 and learning_rate=0\.1 differ$"):
        CowClipHyper.from_fused_params({"optimizer": COWCLIP_ADAM, "lr": 0.5, "learning_rate": 0.1})


@pytest.mark.parametrize(
    "key, hint", [("learnig_rate", "learning_rate"), ("cowclip_zeat", "cowclip_zeta"), ("totally_unrelated_option", None)]
)
def test_unknown_sharder_fused_params_key_is_one_line(key, hint):
    fp = {**cowclip_fused_params(CowClipHyper()), key: 1.0}
    with pytest.raises(ValueError, match=r"unknown fused_params key\(s\)") as e:
        CowClipEmbeddingBagCollectionSharder(fused_params=fp)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"CowClipEmbeddingBagCollectionSharder: unknown fused_params key(s) '{key}'" + (f" (did you mean '{hint}'?)" if hint else ";")
    )
    assert (
        "CowClip-Adam takes beta1, beta2, cowclip, cowclip_r, cowclip_zeta, eps, eps_mode, l2, learning_rate, lr, "
        "optimizer, update_scope" in msg
    )


def test_torchrec_and_fbgemm_keys_pass():
    assert {"cache_precision", "stochastic_rounding", "output_dtype", "bounds_check_mode"} <= other_fused_param_keys()
    CowClipEmbeddingBagCollectionSharder(
        fused_params={**cowclip_fused_params(CowClipHyper()), "cache_precision": None, "stochastic_rounding": True}
    )
    CowClipEmbeddingBagCollectionSharder(fused_params={"stochastic_rounding": False})  # stock tables only
    CowClipEmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match="update_scope must be batch|all|catchup"):
        CowClipEmbeddingBagCollectionSharder(fused_params={**cowclip_fused_params(CowClipHyper()), "update_scope": "x"})


def test_fused_params_round_trip_every_field():
    hp = CowClipHyper(
        learning_rate=0.03,
        beta1=0.8,
        beta2=0.95,
        eps=1e-7,
        eps_mode="keras",
        cowclip=False,
        cowclip_r=2.0,
        cowclip_zeta=1e-3,
        l2=4e-5,
        update_scope="batch",
    )
    fp = cowclip_fused_params(hp)
    assert fp == {
        "optimizer": COWCLIP_ADAM,
        "lr": 0.03,
        "beta1": 0.8,
        "beta2": 0.95,
        "eps": 1e-7,
        "eps_mode": "keras",
        "cowclip": False,
        "cowclip_r": 2.0,
        "cowclip_zeta": 1e-3,
        "l2": 4e-5,
        "update_scope": "batch",
    }
    assert CowClipHyper.from_fused_params(fp) == hp
    # what torchrec hands on after renaming lr, plus keys of its own: the same settings
    renamed = {**{k: v for k, v in fp.items() if k != "lr"}, "learning_rate": 0.03, "cache_precision": None}
    assert CowClipHyper.from_fused_params(renamed) == hp


def test_defaults_are_the_papers_with_catchup():
    assert CowClipHyper.from_fused_params({"optimizer": COWCLIP_ADAM}) == CowClipHyper(
        1e-4, 0.9, 0.999, 1e-8, "torch", True, 1.0, 1e-5, 0.0, "catchup"
    )


@pytest.mark.parametrize(
    "fp, match",
    [
        (None, r"^fused_params do not select CowClip-Adam: optimizer=None$"),
        ({"optimizer": "adam"}, r"^fused_params do not select CowClip-Adam: optimizer='adam'$"),
        ({"optimizer": COWCLIP_ADAM, "cowclip_q": 1, "betas": (0.9, 0.99)}, r"^unknown CowClip fused_params key\(s\): betas, cowclip_q$"),
        ({"optimizer": COWCLIP_ADAM, "eps_mode": "tf"}, r"^CowClip fused_params eps_mode must be torch\|keras, got 'tf'$"),
        (
            {"optimizer": COWCLIP_ADAM, "update_scope": "rows"},
            r"^CowClip fused_params update_scope must be batch\|all\|catchup, got 'rows'$",
        ),
    ],
)
def test_from_fused_params_rejects(fp, match):
    with pytest.raises(ValueError, match=match):
        CowClipHyper.from_fused_params(fp)


def test_is_cowclip_optimizer():
    assert is_cowclip_optimizer({"optimizer": COWCLIP_ADAM, "lr": 0.1})
    assert not is_cowclip_optimizer({"optimizer": "adam"})
    assert not is_cowclip_optimizer({})
    assert not is_cowclip_optimizer(None)


def test_check_fused_params_accepts_and_names_the_caller():
    check_fused_params(None, "here")
    check_fused_params({}, "here")
    check_fused_params({"stochastic_rounding": True}, "here")  # stock tables: no CowClip values checked
    check_fused_params({"optimizer": COWCLIP_ADAM, "lr": 0.1, "cache_precision": None}, "here")
    with pytest.raises(
        ValueError, match=r"^my sharder: unknown fused_params key\(s\) 'cowclip_rr', 'zzz_opt' \(did you mean 'cowclip_r'\?\); "
    ):
        check_fused_params({"cowclip_rr": 1.0, "zzz_opt": 2}, "my sharder")
    with pytest.raises(ValueError, match=r"^CowClip fused_params eps_mode must be torch\|keras, got 'x'$"):
        check_fused_params({"optimizer": COWCLIP_ADAM, "eps_mode": "x"}, "here")
