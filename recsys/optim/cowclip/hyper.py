"""CowClip-Adam's hyperparameters as torchrec carries them: ``CowClipHyper`` (one group of tables'
settings, part of torchrec's table-grouping key), the ``fused_params`` keys that select our kernel,
and their checks. Apart from the TBE because the sharders, the planner glue and the kernels read
them without building a table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


COWCLIP_ADAM = "recsys.cowclip_adam"  # value of fused_params["optimizer"] that selects our kernel

# fused_params keys of ours; everything else torchrec/FBGEMM may add (cache_precision, ...) is ignored
FUSED_PARAM_KEYS = {
    "optimizer",
    "learning_rate",
    "beta1",
    "beta2",
    "eps",
    "eps_mode",
    "cowclip",
    "cowclip_r",
    "cowclip_zeta",
    "l2",
    "update_scope",
}


@dataclass(frozen=True)
class CowClipHyper:
    """Hyperparameters of one group of CowClip-Adam tables (they enter torchrec's table-grouping key
    as fused params, so tables in one kernel share them)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    eps_mode: str = "torch"  # "torch" (torch.optim.Adam) or "keras" (the paper's tf.keras Adam)
    cowclip: bool = True  # False: plain lazy Adam (e.g. the wide/linear tables, as the paper does)
    cowclip_r: float = 1.0
    cowclip_zeta: float = 1e-5
    l2: float = 0.0  # lambda of a Keras l2(lambda) regulariser
    # "catchup" (the default): the reference's dense semantics in O(batch): rows absent for n steps
    # are advanced by n dense steps when next read (recsys/optim/cowclip/catchup.py; every sharding
    # type, docs/cowclip.md); the better of the two in the paper-scale grid (docs/large_batch.md).
    # "batch": lazy Adam, only the batch's rows move (L2 on them only; bit-identical rows outside
    # the batch). "all": the dense semantics as a pass over the whole table each step (O(table)
    # per step, table-wise / row-wise shards only): the reference the catch-up is tested against.
    update_scope: str = "catchup"

    @classmethod
    def from_fused_params(cls, fp: dict[str, Any] | None) -> "CowClipHyper":
        fp = dict(fp or {})
        if fp.get("optimizer") != COWCLIP_ADAM:
            raise ValueError(f"fused_params do not select CowClip-Adam: optimizer={fp.get('optimizer')!r}")
        unknown = sorted(k for k in fp if (k.startswith("cowclip") or k in ("beta", "betas")) and k not in FUSED_PARAM_KEYS)
        if unknown:
            raise ValueError(f"unknown CowClip fused_params key(s): {', '.join(unknown)}")
        if "lr" in fp:  # sharder-level fused_params are not renamed as apply_optimizer_in_backward's kwargs are
            lr = fp.pop("lr")
            if "learning_rate" in fp and fp["learning_rate"] != lr:
                raise ValueError(f"CowClip fused_params: lr={lr!r} and learning_rate={fp['learning_rate']!r} differ")
            fp["learning_rate"] = lr
        kw = {k: fp[k] for k in FUSED_PARAM_KEYS - {"optimizer"} if k in fp}
        hp = cls(**kw)
        if hp.eps_mode not in ("torch", "keras"):
            raise ValueError(f"CowClip fused_params eps_mode must be torch|keras, got {hp.eps_mode!r}")
        if hp.update_scope not in ("batch", "all", "catchup"):
            raise ValueError(f"CowClip fused_params update_scope must be batch|all|catchup, got {hp.update_scope!r}")
        return hp


def other_fused_param_keys() -> set[str]:
    """The fused_params keys that belong to torchrec and FBGEMM rather than to CowClip-Adam: the
    keyword arguments of FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` and torchrec's
    ``FUSED_PARAM_*`` keys, read from the installed versions."""
    import inspect

    import torchrec.distributed.fused_params as trec_fused
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    keys = set(inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters) - {"self"}
    keys |= {v for n, v in vars(trec_fused).items() if n.startswith("FUSED_PARAM_") and isinstance(v, str)}
    return keys


def check_fused_params(fp: dict[str, Any] | None, where: str) -> None:
    """A user's CowClip fused_params (a sharder's): every key is CowClip-Adam's (``lr`` for
    ``learning_rate`` included) or torchrec's/FBGEMM's; anything else is one line naming it, the
    closest accepted key and CowClip-Adam's keys, instead of a silently ignored setting."""
    import difflib

    if not fp:
        return
    ours = FUSED_PARAM_KEYS | {"lr"}
    unknown = sorted(k for k in fp if k not in ours and k not in other_fused_param_keys())
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(ours | other_fused_param_keys()), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(
            f"{where}: unknown fused_params key(s) {', '.join(repr(k) for k in unknown)}{hint}; "
            f"CowClip-Adam takes {', '.join(sorted(ours))}, besides the keyword arguments of "
            "FBGEMM's SplitTableBatchedEmbeddingBagsCodegen and torchrec's FUSED_PARAM_* keys"
        )
    if is_cowclip_optimizer(fp):
        CowClipHyper.from_fused_params(fp)  # values: eps_mode, update_scope, lr vs learning_rate


def is_cowclip_optimizer(fp: dict[str, Any] | None) -> bool:
    return bool(fp) and fp.get("optimizer") == COWCLIP_ADAM


def cowclip_fused_params(hp: CowClipHyper) -> dict[str, Any]:
    """The per-table optimizer kwargs (``apply_optimizer_in_backward``) that select our kernel.
    ``lr`` is the name torchrec renames to ``learning_rate``."""
    d = {k: getattr(hp, k) for k in FUSED_PARAM_KEYS - {"optimizer", "learning_rate"}}
    return {"optimizer": COWCLIP_ADAM, "lr": hp.learning_rate, **d}
