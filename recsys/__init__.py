"""Recommender training on TorchRec: the public API for one's own TorchRec pipeline (docs/dropin.md).

    from recsys import tag_cowclip_adam, CowClipEmbeddingBagCollectionSharder, CowClipEmbeddingCollectionSharder
    from recsys import KStepMergeHook

    tag_cowclip_adam(ebc.parameters(), lr=1e-3)              # CowClip-Adam for these tables
    sharders = [CowClipEmbeddingBagCollectionSharder(),      # shards them (other tables: stock FBGEMM)
                CowClipEmbeddingCollectionSharder()]         # the same for EmbeddingCollection tables
    merger = KStepMergeHook(every_k=16, total_steps=steps)   # k-step merging across hosts
    ...
    merger.step(model, optimizer)                            # after each optimizer step

Names are imported lazily (PEP 562): ``import recsys`` stays cheap and loads torchrec only when
a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

import sharding  # noqa: F401  - installs the version-compatibility log filters (sharding/compat.py)

# public name -> module that defines it
_EXPORTS = {
    "tag_cowclip_adam": "recsys.optim.cowclip.tables",
    "CowClipEmbeddingBagCollectionSharder": "recsys.optim.cowclip.sharder",
    "CowClipEmbeddingCollectionSharder": "recsys.optim.cowclip.sequence",
    "KStepMergeHook": "recsys.training.kstep.merge_hook",
    "KStepMerger": "recsys.training.kstep.merger",
    "export_model": "recsys.training.export",
    "load_exported": "recsys.training.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recsys' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
