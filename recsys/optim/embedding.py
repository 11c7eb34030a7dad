"""Embedding optimizer seam: which update runs inside the embedding backward.

Embedding tables are never touched by a regular optimizer: `apply_optimizer_in_backward` tags
their parameters, and torchrec's sharders turn the tag into an FBGEMM fused kernel that updates
only the rows of the batch during backward. Tagging (rather than sharder fused_params) also lets
the planner count the optimizer state in its memory estimate. FBGEMM's CPU kernels support
EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD; CowClip-Adam plugs in here.
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
import torch

from recsys.config import OptimConfig


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, EmbeddingBagCollection) for p in m.parameters()]


def attach_embedding_optimizer(model: nn.Module, cfg: OptimConfig) -> None:
    """Tags every embedding table with the fused optimizer named by `optim.embedding`."""
    params = embedding_parameters(model)
    if cfg.embedding == "rowwise_adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": cfg.embedding_lr, "eps": cfg.embedding_eps})
    elif cfg.embedding == "adagrad":
        apply_optimizer_in_backward(torch.optim.Adagrad, params, {"lr": cfg.embedding_lr, "eps": cfg.embedding_eps})
    elif cfg.embedding == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": cfg.embedding_lr})
    else:
        raise ValueError(f"unknown embedding optimizer '{cfg.embedding}'")


def embedding_sharders(cfg: OptimConfig) -> list[ModuleSharder[nn.Module]]:
    """The sharders DMP uses; a custom fused kernel would come with its own sharder here."""
    return [EmbeddingBagCollectionSharder()]
