"""sharding/tables.py: every EmbeddingBagCollection / EmbeddingCollection table of a model, in module order."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from sharding.tables import table_configs

META = torch.device("meta")


class _Model(torch.nn.Module):
    """An EC before an EBC, each nested one level, and a dense layer that holds no tables."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(4, 1)
        self.seq = torch.nn.Sequential(
            EmbeddingCollection(
                tables=[EmbeddingConfig(name="ids", embedding_dim=4, num_embeddings=7, feature_names=["f_ids"])], device=META
            )
        )
        self.pooled = torch.nn.ModuleDict(
            {
                "ebc": EmbeddingBagCollection(
                    tables=[
                        EmbeddingBagConfig(name="b1", embedding_dim=8, num_embeddings=30, feature_names=["f1"]),
                        EmbeddingBagConfig(name="b0", embedding_dim=2, num_embeddings=5, feature_names=["f0"]),
                    ],
                    device=META,
                )
            }
        )


def test_tables_in_module_order_with_their_configs():
    configs = list(table_configs(_Model()))
    assert [(c.name, c.num_embeddings, c.embedding_dim, type(c).__name__) for c in configs] == [
        ("ids", 7, 4, "EmbeddingConfig"),
        ("b1", 30, 8, "EmbeddingBagConfig"),
        ("b0", 5, 2, "EmbeddingBagConfig"),
    ]


def test_a_model_without_embeddings_has_no_tables():
    assert list(table_configs(torch.nn.Sequential(torch.nn.Linear(2, 2)))) == []
