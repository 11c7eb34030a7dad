"""The embedding optimizer seam (recsys/optim/embedding.py): which tables are tagged with which
in-backward optimizer and settings for every ``optim.embedding``, the wide/deep split, FBGEMM's
native CowClip constants, and the sharders DMP gets."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import Adam as TrecAdam
from torchrec.optim import RowWiseAdagrad

from recsys.config import OptimConfig
from recsys.optim.cowclip.hyper import COWCLIP_ADAM
from recsys.optim.embedding import (
    _fbgemm_cowclip_kwargs,
    attach_embedding_optimizer,
    cowclip_hyper,
    embedding_parameters,
    embedding_sharders,
    split_wide,
)
from sharding.compat import fbgemm_cowclip_types


def _ebc(*tables: tuple[str, int]) -> EmbeddingBagCollection:
    cfgs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=5, feature_names=[f"f_{n}"]) for n, d in tables]
    return EmbeddingBagCollection(cfgs, device=torch.device("cpu"))


class _WideDeep(nn.Module):
    """Deep tables of dims 4 and 2, a wide (dim-1) table registered as ``wide``, and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = _ebc(("a", 4), ("b", 2))
        self.wide = _ebc(("lin", 1))
        self.top = nn.Linear(6, 1)


def _tag(p: nn.Parameter) -> tuple[type, dict]:
    """The (optimizer class, kwargs) an in-backward tag put on ``p``."""
    assert len(p._optimizer_classes) == 1
    return p._optimizer_classes[0], p._optimizer_kwargs[0]


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def test_embedding_parameters_are_the_tables_of_every_collection():
    m = _WideDeep()
    got = {id(p) for p in embedding_parameters(m)}
    named = _named(m)
    assert got == {
        id(named[k]) for k in ("sparse.embedding_bags.a.weight", "sparse.embedding_bags.b.weight", "wide.embedding_bags.lin.weight")
    }


def test_split_wide_puts_the_collection_named_wide_apart():
    m = _WideDeep()
    deep, wide = split_wide(m)
    assert [tuple(p.shape) for p in deep] == [(5, 4), (5, 2)]
    assert [tuple(p.shape) for p in wide] == [(5, 1)]
    assert wide[0] is _named(m)["wide.embedding_bags.lin.weight"]


def test_cowclip_hyper_copies_every_setting_and_resolves_the_scope():
    cfg = OptimConfig(
        embedding="cowclip_adam",
        embedding_lr=0.02,
        adam_beta1=0.8,
        adam_beta2=0.99,
        embedding_eps=1e-7,
        adam_eps_mode="keras",
        cowclip_r=1.5,
        cowclip_zeta=1e-4,
        embedding_l2=3e-5,
    )
    hp = cowclip_hyper(cfg, clip=False)
    got = (hp.learning_rate, hp.beta1, hp.beta2, hp.eps, hp.eps_mode, hp.cowclip, hp.cowclip_r, hp.cowclip_zeta, hp.l2)
    assert got == (0.02, 0.8, 0.99, 1e-7, "keras", False, 1.5, 1e-4, 3e-5)
    assert hp.update_scope == "catchup"  # auto, for cowclip_adam
    assert cowclip_hyper(OptimConfig(embedding="adam"), clip=True).update_scope == "batch"
    assert cowclip_hyper(OptimConfig(embedding="cowclip_adam", embedding_l2_scope="all"), clip=True).update_scope == "all"


@pytest.mark.parametrize("l2", [0.0, 2e-5])
def test_fbgemm_cowclip_constants_mirror_the_papers(l2):
    """lower_bound = r * zeta' with zeta' = r * sqrt(D) * zeta; the counter decays by L2 only with L2."""
    counter_mode, _, decay_mode = fbgemm_cowclip_types()
    cfg = OptimConfig(embedding="fbgemm_cowclip", embedding_lr=0.03, embedding_eps=1e-6, cowclip_r=2.0, cowclip_zeta=1e-3, embedding_l2=l2)
    kw = _fbgemm_cowclip_kwargs(cfg, dim=9)
    assert (kw["lr"], kw["eps"], kw["weight_decay"], kw["weight_decay_mode"]) == (0.03, 1e-6, l2, decay_mode.COWCLIP)
    reg = kw["cowclip_regularization"]
    assert reg.lower_bound == pytest.approx(2.0 * (2.0 * math.sqrt(9) * 1e-3), rel=1e-12)  # 0.012
    assert reg.weight_norm_coefficient == 2.0 and reg.counter_halflife == -1
    assert reg.counter_weight_decay_mode == (counter_mode.L2 if l2 else counter_mode.NONE)


@pytest.mark.parametrize(
    "name, cls, kwargs",
    [
        ("rowwise_adagrad", RowWiseAdagrad, {"lr": 0.05, "eps": 1e-6}),
        ("adagrad", torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-6}),
        ("sgd", torch.optim.SGD, {"lr": 0.05}),
    ],
)
def test_fbgemm_optimizers_tag_every_table_alike(name, cls, kwargs):
    m = _WideDeep()
    attach_embedding_optimizer(m, OptimConfig(embedding=name, embedding_lr=0.05, embedding_eps=1e-6))
    for p in embedding_parameters(m):
        assert _tag(p) == (cls, kwargs)
    assert not hasattr(m.top.weight, "_optimizer_classes")


@pytest.mark.parametrize(
    "name, cowclip_wide, deep_clip, wide_clip",
    [("cowclip_adam", False, True, False), ("cowclip_adam", True, True, True), ("adam", True, False, False)],
)
def test_our_kernel_tags_deep_and_wide_with_their_clip(name, cowclip_wide, deep_clip, wide_clip):
    m = _WideDeep()
    cfg = OptimConfig(embedding=name, embedding_lr=0.02, cowclip_wide=cowclip_wide, embedding_l2=1e-5, embedding_l2_scope="batch")
    attach_embedding_optimizer(m, cfg)
    deep, wide = split_wide(m)
    for params, clip in ((deep, deep_clip), (wide, wide_clip)):
        for p in params:
            cls, kw = _tag(p)
            assert cls is TrecAdam
            assert (kw["optimizer"], kw["lr"], kw["cowclip"], kw["l2"], kw["update_scope"]) == (COWCLIP_ADAM, 0.02, clip, 1e-5, "batch")


@pytest.mark.parametrize("cowclip_wide", [False, True])
def test_fbgemm_cowclip_bounds_each_deep_table_by_its_dim(cowclip_wide):
    m = _WideDeep()
    cfg = OptimConfig(
        embedding="fbgemm_cowclip", embedding_lr=0.05, embedding_eps=1e-6, cowclip_r=1.0, cowclip_zeta=1e-2, cowclip_wide=cowclip_wide
    )
    attach_embedding_optimizer(m, cfg)
    deep, wide = split_wide(m)
    for p, dim in zip(deep, (4, 2)):
        cls, kw = _tag(p)
        assert cls is RowWiseAdagrad
        assert kw["cowclip_regularization"].lower_bound == pytest.approx(math.sqrt(dim) * 1e-2, rel=1e-12)
    cls, kw = _tag(wide[0])
    assert cls is RowWiseAdagrad
    if cowclip_wide:
        assert kw["cowclip_regularization"].lower_bound == pytest.approx(1e-2, rel=1e-12)  # sqrt(1) * zeta
    else:
        assert kw == {"lr": 0.05, "eps": 1e-6}


def test_unknown_embedding_optimizer_raises():
    with pytest.raises(ValueError, match=r"^unknown embedding optimizer 'lamb'$"):
        attach_embedding_optimizer(_WideDeep(), OptimConfig(embedding="lamb"))  # type: ignore[arg-type]


def test_sharders_are_ours_only_for_our_kernel():
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder

    for name in ("cowclip_adam", "adam"):
        assert [type(s) for s in embedding_sharders(OptimConfig(embedding=name))] == [CowClipEmbeddingBagCollectionSharder]
    for name in ("rowwise_adagrad", "adagrad", "sgd", "fbgemm_cowclip"):
        assert [type(s) for s in embedding_sharders(OptimConfig(embedding=name))] == [EmbeddingBagCollectionSharder]
