"""Model factories for `recsys-plan --model tests.support.plan_models:<factory>` in the plan tests: stock
torchrec models, built the way a user's own module would build them (no project config)."""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

DIM = 8
# table -> rows; one CowClip-Adam, one row-wise Adagrad, one SGD table (mixed_dlrm)
ROWS = {"t_cowclip": 1000, "t_adagrad": 600, "t_sgd": 100}


# The planner tests' model: twelve tables of 120 to 2M rows and dims 16-64, (rows, dim) each.
PLANNER_SPECS: list[tuple[int, int]] = [
    (1_000_000, 64), (500_000, 64), (200_000, 32), (50_000, 32), (10_000, 16), (5_000, 16),
    (1_000, 16), (300, 16), (2_000_000, 32), (80_000, 64), (120, 16), (7_000, 32),
]  # fmt: skip


def meta_ebc(specs: list[tuple[int, int]] = PLANNER_SPECS) -> EmbeddingBagCollection:
    """Table ``t_i`` read by feature ``f_i`` per (rows, dim), on the meta device: planning only."""
    tables = [
        EmbeddingBagConfig(name=f"t_{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f_{i}"]) for i, (n, d) in enumerate(specs)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _ebc(rows: dict[str, int], device: torch.device | None = None) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in rows.items()],
        device=device,
    )


def _dlrm(ebc: EmbeddingBagCollection) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])


def dlrm() -> DLRM:
    """A stock torchrec DLRM, tables tagged with row-wise Adagrad (torchrec's usual choice)."""
    model = _dlrm(_ebc(ROWS))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.embedding_bag_collection.parameters(), {"lr": 0.01})
    return model


def mixed_dlrm() -> DLRM:
    """The same DLRM with one table per optimizer: CowClip-Adam, row-wise Adagrad, SGD."""
    from recsys.optim.cowclip.sharder import tag_cowclip_adam

    model = _dlrm(_ebc(ROWS))
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    tag_cowclip_adam([bags["t_cowclip"].weight], lr=1e-3)
    apply_optimizer_in_backward(RowWiseAdagrad, [bags["t_adagrad"].weight], {"lr": 0.01})
    apply_optimizer_in_backward(torch.optim.SGD, [bags["t_sgd"].weight], {"lr": 0.01})
    return model


def not_a_model() -> int:
    return 3


def custom_optimizer_dlrm() -> DLRM:
    """Tables tagged with an optimizer torchrec has no fused equivalent for."""
    model = _dlrm(_ebc(ROWS))
    apply_optimizer_in_backward(torch.optim.RMSprop, model.sparse_arch.embedding_bag_collection.parameters(), {"lr": 0.01})
    return model
