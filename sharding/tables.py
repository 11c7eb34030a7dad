"""The embedding tables of a model, as the planner and its tools see them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn


def table_configs(model: nn.Module) -> Iterator[Any]:
    """Every table config of every EmbeddingBagCollection / EmbeddingCollection in ``model``, in
    module order (torchrec ``EmbeddingBagConfig`` / ``EmbeddingConfig``)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    for m in model.modules():
        if isinstance(m, EmbeddingBagCollection):
            yield from m.embedding_bag_configs()
        elif isinstance(m, EmbeddingCollection):
            yield from m.embedding_configs()
