"""Dense optimizer: Adam on every parameter that is not updated inside the embedding backward."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys.config import OptimConfig


def dense_optimizer(model: nn.Module, cfg: OptimConfig) -> KeyedOptimizerWrapper:
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adam(ps, lr=cfg.dense_lr, weight_decay=cfg.dense_weight_decay))


def combined_optimizer(dmp: nn.Module, dense: KeyedOptimizerWrapper) -> CombinedOptimizer:
    """DMP's fused (embedding) optimizer and the dense one behind one state dict, which is what
    the checkpoint saves."""
    return CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


class DenseLrWarmup:
    """Linear warmup of the dense optimizer's lr (the scaling rule's first epoch), set before each
    step; the fused embedding lr is not warmed up (the paper keeps it fixed)."""

    def __init__(self, dense: KeyedOptimizerWrapper, base_lr: float, warmup_steps: int) -> None:
        self.dense, self.base_lr, self.warmup_steps = dense, base_lr, warmup_steps

    def before_step(self, step: int) -> float:
        """``step``: 1-based number of the step about to run. Returns the lr it uses."""
        from recsys.optim.scaling import warmup_factor

        lr = self.base_lr * warmup_factor(step - 1, self.warmup_steps)
        for g in self.dense.param_groups:
            g["lr"] = lr
        return lr
