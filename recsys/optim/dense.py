"""Dense optimizer: Adam on every parameter that is not updated inside the embedding backward."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys.config import OptimConfig


def dense_optimizer(model: nn.Module, cfg: OptimConfig) -> KeyedOptimizerWrapper:
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return KeyedOptimizerWrapper(
        params, lambda ps: torch.optim.Adam(ps, lr=cfg.dense_lr, weight_decay=cfg.dense_weight_decay)
    )


def combined_optimizer(dmp: nn.Module, dense: KeyedOptimizerWrapper) -> CombinedOptimizer:
    """DMP's fused (embedding) optimizer and the dense one behind one state dict, which is what
    the checkpoint saves."""
    return CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])
