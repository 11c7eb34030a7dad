"""Optimizer state per embedding table: which fused optimizer a table trains with, and its bytes.

A plan's memory figures are only right if they count what the optimizer really keeps next to the
weights. CowClip-Adam keeps two moments of the weight's shape plus an int64 step per row, about
3x the weights; row-wise Adagrad keeps one float per row. So a plan file records, per table, the
optimizer kind and its state as ``bytes_per_weight`` (state that has the weight's shape) and
``bytes_per_row`` (state with one entry per row; every column-wise shard keeps its own copy).

The kind is read from the model the way torchrec's sharders read it: the per-table tag set by
``apply_optimizer_in_backward`` (``param._optimizer_classes`` / ``_optimizer_kwargs``), whose
explicit ``"optimizer"`` key wins over the class; then the sharder's ``fused_params``; FBGEMM's
default (exact SGD, no state) when neither says anything. This module must not import ``recsys``:
the CowClip-Adam kernel is recognised by the fused-param value it is tagged with.

    >>> kinds = table_optimizers(model)                      # {"t_cat_0": "cowclip_adam", ...}
    >>> state_bytes(kinds["t_cat_0"], rows=1000, cols=16)    # 2 moments + a step per row
    136000
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

# Value of fused_params["optimizer"] that selects this project's CowClip-Adam kernel
# (recsys/optim/cowclip/tbe.py COWCLIP_ADAM; duplicated because sharding/ never imports recsys/).
COWCLIP_ADAM_TAG = "recsys.cowclip_adam"


@dataclass(frozen=True)
class OptimizerState:
    """State bytes an optimizer keeps per table: ``bytes_per_weight * rows * cols + bytes_per_row * rows``."""

    kind: str
    bytes_per_weight: int
    bytes_per_row: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "bytes_per_weight": self.bytes_per_weight, "bytes_per_row": self.bytes_per_row}


# FBGEMM keeps optimizer state in fp32 whatever the weights' precision; CowClip-Adam (recsys/optim/
# recsys/optim/cowclip/tbe.py) registers momentum1 and momentum2 like the weights (fp32) and row_step (int64).
KINDS: dict[str, OptimizerState] = {
    s.kind: s
    for s in (
        OptimizerState("sgd", 0, 0),
        OptimizerState("rowwise_adagrad", 0, 4),  # momentum1: one float per row
        OptimizerState("rowwise_adagrad_counter", 0, 12),  # + prev_iter, row_counter (COWCLIP / COUNTER decay)
        OptimizerState("adagrad", 4, 0),
        OptimizerState("adam", 8, 0),
        OptimizerState("partial_rowwise_adam", 4, 4),
        OptimizerState("lamb", 8, 0),
        OptimizerState("partial_rowwise_lamb", 4, 4),
        OptimizerState("lars_sgd", 4, 0),
        OptimizerState("cowclip_adam", 8, 8),
    )
}


def _data_type_bits() -> dict[str, int]:
    from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS

    return {t.value: bits for t, bits in DATA_TYPE_NUM_BITS.items()}


DATA_TYPE_BITS: dict[str, int] = _data_type_bits()  # "FP32" -> 32, "FP16" -> 16, ...


def weight_bytes(data_type: str, rows: int, cols: int) -> int:
    """Bytes of a rows x cols block of weights stored as ``data_type`` (torchrec's DataType value)."""
    return (rows * cols * DATA_TYPE_BITS[data_type] + 7) // 8


_EMB_OPT_KIND = {
    "exact_sgd": "sgd",
    "sgd": "sgd",
    "none": "sgd",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
    "exact_adagrad": "adagrad",
    "adam": "adam",
    "partial_row_wise_adam": "partial_rowwise_adam",
    "lamb": "lamb",
    "partial_row_wise_lamb": "partial_rowwise_lamb",
    "lars_sgd": "lars_sgd",
}


class UnknownOptimizerError(ValueError):
    """A table's optimizer has no known state layout; pass the kind explicitly."""


def state_of(kind: str) -> OptimizerState:
    if kind not in KINDS:
        raise UnknownOptimizerError(f"unknown optimizer kind '{kind}' (known: {', '.join(KINDS)})")
    return KINDS[kind]


def state_bytes(kind: str, rows: int, cols: int) -> int:
    """Optimizer state bytes of a rows x cols shard."""
    s = state_of(kind)
    return rows * cols * s.bytes_per_weight + rows * s.bytes_per_row


def _module_tables(m: nn.Module) -> Iterator[tuple[Any, nn.Parameter]]:
    """(table config, weight parameter) of ``m`` itself when it is an EBC / EC; nothing else."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(m, EmbeddingBagCollection):
        for c in m.embedding_bag_configs():
            yield c, m.embedding_bags[c.name].weight
    elif isinstance(m, EmbeddingCollection):
        for c in m.embedding_configs():
            yield c, m.embeddings[c.name].weight


def check_cowclip_sharders(model: nn.Module, sharders: Sequence[Any] | None) -> None:
    """ValueError (one line) when a table tagged for CowClip-Adam (``tag_cowclip_adam``) sits in a
    module that no given sharder trains with CowClip-Adam: without it the table is either left
    unsharded and replicated under the dense optimizer (no sharder for its module type: silently
    wrong) or handed to a stock sharder whose FBGEMM kernel rejects the CowClip fused params.
    A sharder that trains CowClip-Adam says so with ``trains_cowclip_adam = True``. Checked by the
    planners before planning, on every rank, so all stop together."""
    for path, m in model.named_modules():
        tagged = [
            c.name for c, p in _module_tables(m) if (getattr(p, "_optimizer_kwargs", [{}])[0] or {}).get("optimizer") == COWCLIP_ADAM_TAG
        ]
        if not tagged:
            continue
        sharder = next((s for s in sharders or () if isinstance(m, s.module_type)), None)
        if sharder is not None and getattr(sharder, "trains_cowclip_adam", False):
            continue
        kind = type(m).__name__
        what = (
            f"no sharder given shards its {kind}"
            if sharder is None
            else f"its sharder {type(sharder).__name__} does not train CowClip-Adam"
        )
        from torchrec.modules.embedding_modules import EmbeddingCollection

        base = "EmbeddingCollection" if isinstance(m, EmbeddingCollection) else "EmbeddingBagCollection"
        fix = f"CowClip-Adam trains {base} tables: add CowClip{base}Sharder() to the sharders"
        names = ", ".join(tagged[:3]) + (f" and {len(tagged) - 3} more" if len(tagged) > 3 else "")
        raise ValueError(
            f"table{'s' if len(tagged) > 1 else ''} {names} of {kind} '{path or '<model>'}' "
            f"{'are' if len(tagged) > 1 else 'is'} tagged for CowClip-Adam, but {what}; {fix}"
        )


def table_parameters(model: nn.Module) -> Iterator[tuple[Any, nn.Parameter]]:
    """(table config, weight parameter) for every table of every EBC / EC in ``model``."""
    for m in model.modules():
        yield from _module_tables(m)


def sharder_fused_params(sharders: Sequence[Any] | None, module: nn.Module) -> Mapping[str, Any] | None:
    """The fused params of the sharder that shards ``module`` (the first whose ``module_type`` it
    is, as DistributedModelParallel picks one): what untagged tables of it train with."""
    for sharder in sharders or ():
        if isinstance(module, sharder.module_type):
            return getattr(sharder, "fused_params", None)
    return None


def optimizer_kind(param: nn.Parameter, fused_params: Mapping[str, Any] | None = None) -> str:
    """The kind of one table's fused optimizer, read as torchrec's sharders read it."""
    kwargs = dict(fused_params or {})
    kwargs.update(getattr(param, "_optimizer_kwargs", [{}])[0] or {})
    return fused_params_kind(kwargs, getattr(param, "_optimizer_classes", [None])[0])


def sharded_tables(model: nn.Module) -> Iterator[tuple[Any, str | None]]:
    """(table config, optimizer kind or None when unknown) for every table of every *sharded*
    EBC / EC in ``model`` (after ``DistributedModelParallel``, where the unsharded modules and their
    parameters' optimizer tags are gone). A ShardedEmbeddingBagCollection keeps each table's fused
    params, as its sharder merged them, in ``sharding_type_to_sharding_infos`` (every table, on
    every rank); a ShardedEmbeddingCollection keeps them only for its local shards, so a table
    placed on other ranks has kind None."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    for m in model.modules():
        if isinstance(m, ShardedEmbeddingBagCollection):
            for infos in m.sharding_type_to_sharding_infos.values():
                for info in infos:
                    yield info.embedding_config, _kind_or_none(info.fused_params)
        elif isinstance(m, ShardedEmbeddingCollection):
            local = {}
            for lookup in getattr(m, "_lookups", []):
                for emb in getattr(lookup, "_emb_modules", []):
                    for t in emb._config.embedding_tables:
                        local[t.name] = t.fused_params
            for c in m._embedding_configs:
                yield c, _kind_or_none(local[c.name]) if c.name in local else None


def _kind_or_none(fused_params: Mapping[str, Any] | None) -> str | None:
    try:
        return fused_params_kind(dict(fused_params or {}))
    except UnknownOptimizerError:
        return None


def fused_params_kind(kwargs: Mapping[str, Any], optimizer_class: Any = None) -> str:
    """The optimizer kind a table's fused params (and optimizer class, if tagged with one) select."""
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    cls = optimizer_class
    opt = kwargs.get("optimizer")
    if opt == COWCLIP_ADAM_TAG:
        return "cowclip_adam"
    if opt is None and cls is not None:
        try:
            opt = optimizer_type_to_emb_opt_type(cls)
        except ValueError:
            raise UnknownOptimizerError(f"optimizer {cls.__name__} has no fused-embedding equivalent in torchrec") from None
    if opt is None:
        return "sgd"  # FBGEMM's default when neither the tag nor the sharder names one
    name = getattr(opt, "value", opt)
    if not isinstance(name, str) or name.lower() not in _EMB_OPT_KIND:
        raise UnknownOptimizerError(f"optimizer '{name}' has no known state layout")
    kind = _EMB_OPT_KIND[name.lower()]
    decay = getattr(kwargs.get("weight_decay_mode"), "name", kwargs.get("weight_decay_mode"))
    if kind == "rowwise_adagrad" and str(decay).upper() in ("COWCLIP", "COUNTER"):
        kind = "rowwise_adagrad_counter"
    return kind


def table_optimizers(model: nn.Module, fused_params: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Table name -> optimizer kind, for every embedding table of ``model``. ``fused_params``: the
    sharder's (e.g. ``EmbeddingBagCollectionSharder(fused_params=...)``), used where a table has no tag."""
    out = {}
    for c, p in table_parameters(model):
        try:
            out[c.name] = optimizer_kind(p, fused_params)
        except UnknownOptimizerError as e:
            raise UnknownOptimizerError(f"table {c.name}: {e}") from None
    return out


def table_bytes(model: nn.Module, sharders: Sequence[Any] | None = None) -> dict[str, int]:
    """Table name -> bytes of its weights (in its data type) plus the state of the optimizer it
    trains with (its tag, else the fused params of the sharder of its module), for every embedding
    table of ``model``: the one count behind the planner's SSD tier and its "does not fit" lines.
    A table whose optimizer has no known state layout is counted as row-wise Adagrad (one float
    per row, FBGEMM's usual choice)."""
    out = {}
    for m in model.modules():
        fused_params = None
        for c, p in _module_tables(m):
            fused_params = fused_params or sharder_fused_params(sharders, m)
            try:
                kind = optimizer_kind(p, fused_params)
            except UnknownOptimizerError:
                kind = "rowwise_adagrad"
            dtype = getattr(c.data_type, "value", str(c.data_type))
            out[c.name] = weight_bytes(dtype, c.num_embeddings, c.embedding_dim) + state_bytes(kind, c.num_embeddings, c.embedding_dim)
    return out
