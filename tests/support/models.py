"""A tiny CTR input shared by the model tests (unit and integration): three sparse features
with small tables on the CPU, so the models run as plain modules, unsharded."""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NAMES = ["a", "b", "c"]
CARDS = [7, 11, 13]
CPU = torch.device("cpu")


def kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    """[B, F] ids (-1 = missing) -> KJT with one id per present field."""
    valid = (ids >= 0).T
    return KeyedJaggedTensor.from_lengths_sync(NAMES, ids.T[valid], valid.reshape(-1).int())
