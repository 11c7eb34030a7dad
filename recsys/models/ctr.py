"""CTR models on `torchrec.EmbeddingBagCollection`: DeepFM, Wide&Deep, DCN, DCNv2.

Each model maps (dense features [B, num_dense], KeyedJaggedTensor of 26 single-id fields) to one
logit per sample. The embedding collections are the only sharded parts; everything else is a
small dense network that DistributedModelParallel replicates (DDP).

The first-order ("wide"/linear) weights of DeepFM and Wide&Deep live in their own collection of
tables 4 columns wide whose columns are averaged: FBGEMM's fused kernels need row widths that are
multiples of 4, and a width-1 table would fall back to a data-parallel dense table whose whole
gradient is all-reduced every step. The 4 columns start at zero and receive identical gradients,
so they stay equal and their mean is one weight; with a row-wise (Adagrad, Adam) update, whose
step does not depend on the gradient's scale, it moves exactly like a width-1 weight would.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet, VectorCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys.config import ModelConfig
from recsys.models.micro_batch import MicroBatchedLoss, SplitCTRModel

WIDE_DIM = 4


def in_feature_order(kt: KeyedTensor, names: list[str]) -> torch.Tensor:
    """The pooled embeddings [B, sum of dims] in the model's own feature order.

    Why: a sharded EmbeddingBagCollection returns its KeyedTensor in the order of its shardings
    (by sharding type and rank), not in the order of its tables, and that order changes with the
    plan (world size, sharding types). `.values()` would feed the dense layers a plan-dependent
    permutation of the features: the same weights then give other predictions on another world
    size or unsharded (export). torchrec's own DLRM reads its KeyedTensor by name for this reason."""
    if kt.keys() == names:
        return kt.values()
    return KeyedTensor.regroup([kt], [names])[0]


# a leaf for torch.fx (TrainPipelineSparseDist traces the model): it runs, with its key check,
# on the real KeyedTensor instead of being traced through
torch.fx.wrap("in_feature_order")


def embedding_bag_collection(
    prefix: str, names: list[str], cards: list[int], dim: int, init_std: float, device: torch.device
) -> EmbeddingBagCollection:
    """One table per feature. FBGEMM kernels initialise rows uniformly in [min, max], so a
    standard deviation s becomes the interval +-s*sqrt(3)."""
    half = init_std * math.sqrt(3.0)
    tables = [
        EmbeddingBagConfig(
            name=f"{prefix}{name}",
            embedding_dim=dim,
            num_embeddings=card,
            feature_names=[name],
            pooling=PoolingType.SUM,
            weight_init_min=-half,
            weight_init_max=half,
        )
        for name, card in zip(names, cards)
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def deep_tower(in_features: int, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """The 400-400-400 ReLU tower (torchrec's MLP), optionally with dropout between layers."""
    if cfg.dropout == 0.0:
        return MLP(in_features, list(cfg.dnn), device=device)
    layers: list[nn.Module] = []
    width = in_features
    for h in cfg.dnn:
        layers += [nn.Linear(width, h, device=device), nn.ReLU(), nn.Dropout(cfg.dropout)]
        width = h
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    """Base: holds the embedding collection and the concatenated dense+embedding input."""

    def __init__(
        self,
        names: list[str],
        cards: list[int],
        num_dense: int,
        cfg: ModelConfig,
        device: torch.device,
        emb_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.names = list(names)  # the feature order the dense layers see (in_feature_order)
        self.num_fields = len(names)
        self.dim = cfg.embedding_dim
        # Tables are built on `meta`: DistributedModelParallel materialises only each rank's
        # shards, and the planner can plan tables far larger than this machine's memory.
        self.emb_device = emb_device or torch.device("meta")
        self.embeddings = embedding_bag_collection("t_", names, cards, cfg.embedding_dim, cfg.embedding_init_std, self.emb_device)
        self.in_features = num_dense + self.num_fields * self.dim

    # Every model here is split in two (recsys/models/micro_batch.py): `sparse` runs the embedding
    # lookups over the whole batch, `over` everything after them, per sample, so the dense part
    # can run in micro-batches (train.micro_batch_rows) with one embedding update per batch.
    _sparse_modules = ("embeddings",)

    def sparse(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
        """The pooled embeddings [B, F*D] (and whatever else a subclass looks up)."""
        return (in_feature_order(self.embeddings(sparse), self.names),)

    def over(self, dense: torch.Tensor, *sparse_out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(dense, *self.sparse(dense, sparse))

    def over_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters `over` uses: all but the embedding collections'."""
        for name, child in self.named_children():
            if name not in self._sparse_modules:
                yield from child.parameters()


class _WideMixin:
    def _init_wide(self, names: list[str], cards: list[int], num_dense: int, device: torch.device) -> None:
        self.wide = embedding_bag_collection("w_", names, cards, WIDE_DIM, 0.0, self.emb_device)
        self.dense_linear = nn.Linear(num_dense, 1, device=device) if num_dense else None
        if self.dense_linear is not None:  # the linear part starts at zero, like the wide tables
            nn.init.zeros_(self.dense_linear.weight)
            nn.init.zeros_(self.dense_linear.bias)

    def _wide_logit(self, dense: torch.Tensor, wide_values: torch.Tensor) -> torch.Tensor:
        """The linear part from the wide lookups [B, F*WIDE_DIM] and the dense features."""
        out = wide_values.sum(dim=1) / WIDE_DIM
        if self.dense_linear is not None:
            out = out + self.dense_linear(dense).squeeze(1)
        return out


def factorization_machine(emb: torch.Tensor) -> torch.Tensor:
    """Second-order FM term sum_{f<g} <v_f, v_g> of [B, F, D] field embeddings -> [B].

    Not torchrec.modules.deepfm.FactorizationMachine: that module flattens the input to
    [B, F*D] before the square-of-sum trick, so it also multiplies different dimensions of
    different fields (and dimensions within one field) with each other, which is not the FM
    of the DeepFM paper (tests/unit/recsys/models/test_ctr.py checks this one against explicit dot products).
    """
    s = emb.sum(dim=1)
    return 0.5 * (s.pow(2).sum(dim=1) - emb.pow(2).sum(dim=(1, 2)))


class DeepFM(CTRModel, _WideMixin):
    """logit = linear(sparse, dense) + FM(sparse embeddings) + DNN([dense, embeddings])."""

    use_fm = True

    def __init__(self, names, cards, num_dense, cfg: ModelConfig, device: torch.device, emb_device=None) -> None:
        super().__init__(names, cards, num_dense, cfg, device, emb_device)
        self._init_wide(names, cards, num_dense, device)
        self.dnn = deep_tower(self.in_features, cfg, device)
        self.head = nn.Linear(cfg.dnn[-1], 1, device=device)

    _sparse_modules = ("embeddings", "wide")

    def sparse(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
        """(pooled embeddings [B, F*D], wide lookups [B, F*WIDE_DIM])."""
        return in_feature_order(self.embeddings(sparse), self.names), self.wide(sparse).values()  # (wide: summed)

    def over(self, dense: torch.Tensor, emb: torch.Tensor, wide_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = torch.cat([dense, emb], dim=1)
        out = self._wide_logit(dense, wide_values) + self.head(self.dnn(x)).squeeze(1)
        if self.use_fm:
            out = out + factorization_machine(emb.view(-1, self.num_fields, self.dim))
        return out


class WideDeep(DeepFM):
    """logit = linear(sparse, dense) + DNN([dense, embeddings]): DeepFM without the FM term."""

    use_fm = False


class DCN(CTRModel):
    """Deep & Cross: a cross network and the DNN side by side on [dense, embeddings], then a
    linear layer on their concatenation. v1 uses vector cross layers, v2 matrix (or low-rank)."""

    def __init__(self, names, cards, num_dense, cfg: ModelConfig, device: torch.device, emb_device=None, v2: bool = False) -> None:
        super().__init__(names, cards, num_dense, cfg, device, emb_device)
        n = self.in_features
        if not v2:
            cross: nn.Module = VectorCrossNet(n, cfg.cross_layers)
        elif cfg.cross_low_rank > 0:
            cross = LowRankCrossNet(n, cfg.cross_layers, cfg.cross_low_rank)
        else:
            cross = CrossNet(n, cfg.cross_layers)
        self.cross = cross.to(device)
        self.dnn = deep_tower(n, cfg, device)
        self.head = nn.Linear(n + cfg.dnn[-1], 1, device=device)

    def over(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = torch.cat([dense, emb], dim=1)
        return self.head(torch.cat([self.cross(x), self.dnn(x)], dim=1)).squeeze(1)


def build_model(
    cfg: ModelConfig,
    names: list[str],
    cards: list[int],
    num_dense: int,
    device: torch.device,
    emb_device: torch.device | None = None,
) -> nn.Module:
    """Builds a model by name: embedding tables on `meta`, the dense network on `device`.
    Tables have ``cfg.table_rows_factor`` x ``cards`` rows."""
    if cfg.table_rows_factor < 1:
        raise ValueError(f"model.table_rows_factor must be >= 1, got {cfg.table_rows_factor}")
    cards = [int(c) * cfg.table_rows_factor for c in cards]
    if cfg.name == "deepfm":
        return DeepFM(names, cards, num_dense, cfg, device, emb_device)
    if cfg.name == "wide_deep":
        return WideDeep(names, cards, num_dense, cfg, device, emb_device)
    if cfg.name in ("dcn", "dcnv2"):
        return DCN(names, cards, num_dense, cfg, device, emb_device, v2=cfg.name == "dcnv2")
    raise ValueError(f"unknown model '{cfg.name}'")


class TrainModule(nn.Module):
    """Wraps any CTR model (dense, KJT) -> logits into what TrainPipelineSparseDist expects:
    batch -> (loss, (loss, logits, labels)).

    ``micro_batch_rows`` > 0: a model split into ``sparse``/``over`` (micro_batch.SplitCTRModel)
    runs its dense part in chunks of that many rows whenever a training batch is larger (one
    embedding lookup and update per batch, the same gradients; recsys/models/micro_batch.py).
    A model without the split runs whole batches (``micro_batched`` says which)."""

    def __init__(self, model: nn.Module, micro_batch_rows: int = 0) -> None:
        super().__init__()
        if micro_batch_rows < 0:
            raise ValueError(f"micro_batch_rows must be >= 0, got {micro_batch_rows}")
        self.model = model
        self.micro_batch_rows = micro_batch_rows
        self.micro_batched = micro_batch_rows > 0 and isinstance(model, SplitCTRModel)
        self.loss_arch = MicroBatchedLoss(model, micro_batch_rows) if self.micro_batched else None

    def forward(self, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.loss_arch is not None:
            dense = batch.dense_features
            loss, logits = self.loss_arch(dense, batch.labels, *self.model.sparse(dense, batch.sparse_features))
            return loss, (loss.detach(), logits, batch.labels)
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)
