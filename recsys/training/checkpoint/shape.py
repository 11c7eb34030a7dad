"""Whether a checkpoint's state fits this run's config: the state shape it recorded against the
current one (docs/run_integrity.md).

COMMITTED records `shape`, the config that shapes the saved state (model, tables, embedding
optimizer, batch, shard world, merge settings; `run_dir.state_shape`); a resume whose config
differs stops with one line naming the keys (`Checkpointer.check_compatible`). The world size
(for k-step runs: the ranks per host) may change with FBGEMM's fused optimizers and our Adam
kernels (`reshardable`): DCP reshards on load.

Apart from the Checkpointer because the comparison is a pure function of two dicts, with its own
history of keys added over time (`SHAPE_DEFAULTS`).
"""

from __future__ import annotations

import json
from typing import Any

# Optimizers whose state is per-row or per-element tensors laid out like the table's shards, which
# DCP reshards by offset, so a checkpoint loads on another world size (a hierarchical one on
# another number of ranks per host: its files, host 0's and each host<h>/, are DCP checkpoints of
# one host's ranks): FBGEMM's fused ones, and our CowClip-Adam / Adam (moments per element, the row
# step per row; in both update scopes). Tested 2 -> 1 -> 2 ranks, and 1 -> 2 -> 1 ranks per host
# of a k-step run, with exact metrics (docs/run_integrity.md).
RESHARDABLE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "cowclip_adam", "adam")


def reshardable(shape: dict[str, Any]) -> bool:
    return shape.get("optim.embedding") in RESHARDABLE_OPTIMIZERS


# State-shape keys added after checkpoints were first written, with the value those older
# checkpoints had: a checkpoint without the key resumes when the run has this value.
SHAPE_DEFAULTS = {"optim.embedding_l2_scope": "batch"}


def shape_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key old -> new` for every key whose value differs (a key absent on one side counts)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):  # e.g. data.tables: only the tables that differ
            out.extend(f"{key}.{c}" for c in shape_changes(old, new))
        else:
            out.append(f"{key} {_short(old)} -> {_short(new)}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def incompatible_changes(marker: dict[str, Any], current: dict[str, Any], shard_world: int) -> list[str]:
    """`shape_changes` between the shape a checkpoint's marker recorded and `current`, the run's:
    keys the checkpoint predates count as their `SHAPE_DEFAULTS` value, and the world size is
    left out when both optimizers are reshardable. A checkpoint written before shapes were
    recorded is compared by its world size only (`shard_world`: this run's, when `current` has
    none)."""
    saved = marker.get("shape")
    if saved is None:  # written before shapes were recorded: the world size is all we know
        saved = {"train.world_size": marker.get("ranks_per_host", marker["world_size"])}
        current = {"train.world_size": current.get("train.world_size", shard_world)}
    else:
        saved = {**{k: v for k, v in SHAPE_DEFAULTS.items() if k in current}, **saved}
        if reshardable(saved) and reshardable(current):  # another world size is fine
            saved = {k: v for k, v in saved.items() if k != "train.world_size"}
            current = {k: v for k, v in current.items() if k != "train.world_size"}
    return shape_changes(saved, current)
