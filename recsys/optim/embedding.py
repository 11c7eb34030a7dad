"""Embedding optimizer seam: which update runs inside the embedding backward.

Embedding tables are never touched by a regular optimizer: `apply_optimizer_in_backward` tags
their parameters, and the sharders turn the tag into a fused kernel that updates only the rows of
the batch during backward. Tagging (rather than sharder fused_params) also lets the planner count
the optimizer state in its memory estimate.

* ``rowwise_adagrad`` / ``adagrad`` / ``sgd``: FBGEMM's fused CPU/GPU kernels.
* ``cowclip_adam`` / ``adam``: our CowClip-Adam kernel (``recsys/optim/cowclip/sharder.py``); ``adam``
  is the same lazy Adam without clipping. The wide/linear tables are not clipped unless
  ``optim.cowclip_wide`` (the paper leaves its dimension-1 tables unclipped).
* ``fbgemm_cowclip``: FBGEMM's native ``WeightDecayMode.COWCLIP`` on EXACT_ROWWISE_ADAGRAD, fully
  FBGEMM. Not the paper's method (docs/cowclip.md): lifetime per-row counter instead of the
  in-batch count, Adagrad instead of Adam, the accumulator sees the unclipped gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys.config import OptimConfig, effective_l2_scope
from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam
from recsys.optim.cowclip.hyper import CowClipHyper

OUR_KERNEL = ("cowclip_adam", "adam")


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, EmbeddingBagCollection) for p in m.parameters()]


def split_wide(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(deep, wide) embedding tables. Wide = the EBCs a model registers as ``wide`` (our CTR
    models' linear part), the paper's unclipped dimension-1 tables."""
    deep, wide = [], []
    for name, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            (wide if name.split(".")[-1] == "wide" else deep).extend(m.parameters())
    return deep, wide


def cowclip_hyper(cfg: OptimConfig, clip: bool) -> CowClipHyper:
    return CowClipHyper(
        learning_rate=cfg.embedding_lr,
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        eps=cfg.embedding_eps,
        eps_mode=cfg.adam_eps_mode,
        cowclip=clip,
        cowclip_r=cfg.cowclip_r,
        cowclip_zeta=cfg.cowclip_zeta,
        l2=cfg.embedding_l2,
        update_scope=effective_l2_scope(cfg),
    )


def _fbgemm_cowclip_kwargs(cfg: OptimConfig, dim: int) -> dict:
    """FBGEMM: clip = c * max(coef*||w||, lower_bound) with c the row's lifetime batch count;
    coef = r and lower_bound = r * zeta' (zeta' = r sqrt(D) zeta) mirror the paper's constants."""
    from sharding.compat import fbgemm_cowclip_types

    CounterWeightDecayMode, CowClipDefinition, WeightDecayMode = fbgemm_cowclip_types()

    zeta_p = cfg.cowclip_r * math.sqrt(dim) * cfg.cowclip_zeta
    return {
        "lr": cfg.embedding_lr,
        "eps": cfg.embedding_eps,
        "weight_decay_mode": WeightDecayMode.COWCLIP,
        "weight_decay": cfg.embedding_l2,
        "cowclip_regularization": CowClipDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.L2 if cfg.embedding_l2 else CounterWeightDecayMode.NONE,
            counter_halflife=-1,
            weight_norm_coefficient=cfg.cowclip_r,
            lower_bound=cfg.cowclip_r * zeta_p,
        ),
    }


def attach_embedding_optimizer(model: nn.Module, cfg: OptimConfig) -> None:
    """Tags every embedding table with the fused optimizer named by `optim.embedding`."""
    params = embedding_parameters(model)
    if cfg.embedding == "rowwise_adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": cfg.embedding_lr, "eps": cfg.embedding_eps})
    elif cfg.embedding == "adagrad":
        apply_optimizer_in_backward(torch.optim.Adagrad, params, {"lr": cfg.embedding_lr, "eps": cfg.embedding_eps})
    elif cfg.embedding == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": cfg.embedding_lr})
    elif cfg.embedding in OUR_KERNEL:
        deep, wide = split_wide(model)
        clip = cfg.embedding == "cowclip_adam"
        if deep:
            tag_cowclip_adam(deep, cowclip_hyper(cfg, clip))
        if wide:
            tag_cowclip_adam(wide, cowclip_hyper(cfg, clip and cfg.cowclip_wide))
    elif cfg.embedding == "fbgemm_cowclip":
        deep, wide = split_wide(model)
        for p in deep:  # per table: the lower bound depends on the dim
            apply_optimizer_in_backward(RowWiseAdagrad, [p], _fbgemm_cowclip_kwargs(cfg, p.shape[1]))
        if wide:
            if cfg.cowclip_wide:
                for p in wide:
                    apply_optimizer_in_backward(RowWiseAdagrad, [p], _fbgemm_cowclip_kwargs(cfg, p.shape[1]))
            else:
                apply_optimizer_in_backward(RowWiseAdagrad, wide, {"lr": cfg.embedding_lr, "eps": cfg.embedding_eps})
    else:
        raise ValueError(f"unknown embedding optimizer '{cfg.embedding}'")


def embedding_sharders(cfg: OptimConfig) -> list[ModuleSharder[nn.Module]]:
    """The sharders DMP uses: ours for the CowClip-Adam kernel, torchrec's otherwise."""
    if cfg.embedding in OUR_KERNEL:
        return [CowClipEmbeddingBagCollectionSharder()]
    return [EmbeddingBagCollectionSharder()]
