"""CowClip-Adam's fused_params: a sharder's keys are checked (a misspelled one is one line, never a
setting silently ignored), and ``lr`` means ``learning_rate`` there as it does for
``apply_optimizer_in_backward`` (which torchrec renames; sharder-level fused_params it does not)."""

from __future__ import annotations

import pytest

from recsys import CowClipEmbeddingBagCollectionSharder
from recsys.optim.cowclip.hyper import COWCLIP_ADAM, CowClipHyper, cowclip_fused_params, other_fused_param_keys


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
    with pytest.raises(ValueError) as e:
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
