"""A trained run's model, out of the cluster: one unsharded state_dict on one device.

Why: a run's checkpoints are `torch.distributed.checkpoint` directories of sharded tables, which
only a job with DMP and a process group can load. For evaluation or serving, `export_model`
writes the model of a run's checkpoint as one file, every table whole: the plain model
(`recsys.models.ctr.build_model`, no DMP, no torchrec sharding, no process group) on one device
loads it with `load_state_dict` (`load_exported` does both). DCP reads the saved shards of every
table into whole CPU tensors. Checkpoints hold every row at the checkpoint's step (the CowClip
catch-up runs before each save), so the exported rows need no catch-up. The optimizer state
is not exported.

    recsys export --run-dir runs/smoke --out smoke.pt        # the newest complete checkpoint
    model = load_exported("smoke.pt")                         # the plain model, eval mode
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recsys.training.checkpoint import CheckpointError, Checkpointer
from recsys.training.checkpoint.integrity import incomplete_reason
from recsys.training.checkpoint.layout import read_marker, step_dir_name
from recsys.training.run_dir import RunDirError

FORMAT = "recsys-export"
VERSION = 1


def export_model(run_dir: str | os.PathLike, out: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """Writes the model of `run_dir`'s checkpoint at `step` (default: the newest complete one) to
    `out` (atomically); returns what was written, without the tensors. One-line RunDirError /
    CheckpointError for a run without config.yaml or a usable checkpoint."""
    from recsys.config import ConfigError, load_config
    from recsys.data.source import build_source
    from recsys.models.ctr import build_model

    run_dir = Path(run_dir)
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as e:
        raise RunDirError(f"cannot export {run_dir}: {e}") from None
    ckpt = _checkpoint(run_dir, step)
    source = build_source(cfg)  # the table names and sizes the run trained (the data cache for raw data)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(read_marker(ckpt)["step"]),
        "checkpoint": str(ckpt),
        "model": dataclasses.asdict(cfg.model),
        "sparse_names": list(source.sparse_names),
        "cardinalities": [int(c) for c in source.cardinalities],
        "dense_names": list(source.dense_names),
    }
    model = build_model(cfg.model, meta["sparse_names"], meta["cardinalities"], len(meta["dense_names"]), torch.device("meta")).to_empty(
        device="cpu"
    )
    state = model.state_dict()
    _load_whole(ckpt, state)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        torch.save({**meta, "state_dict": state}, tmp)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunDirError(f"cannot write {out}: {e.strerror or e}; nothing was written") from None
    return meta


def load_exported(path: str | os.PathLike, device: torch.device | str = "cpu") -> nn.Module:
    """The plain model of an `export_model` file on `device`, weights loaded, in eval mode."""
    from recsys.config import ModelConfig
    from recsys.models.ctr import build_model

    d = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a recsys export (written by `recsys export`)")
    device = torch.device(device)
    model = build_model(
        ModelConfig(**d["model"]), d["sparse_names"], d["cardinalities"], len(d["dense_names"]), torch.device("meta")
    ).to_empty(device=device)
    model.load_state_dict(d["state_dict"])
    return model.eval()


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    if step is not None:
        path = root / step_dir_name(step)
        why = incomplete_reason(path) if path.is_dir() else f"{path} does not exist"
        if why is not None:
            raise CheckpointError(f"cannot export step {step} of {run_dir}: {why}")
        return path
    path = Checkpointer(root, 0, 1).latest_complete()
    if path is None:
        raise CheckpointError(f"cannot export {run_dir}: no complete checkpoint in {root}")
    return path


def _load_whole(ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """DCP reads every saved shard of each tensor into the whole tensors of `state` (in place).
    The checkpoint's model keys are the training module's (`model.` + the CTR model's)."""
    import torch.distributed.checkpoint as dcp

    wrapped = {"model": {f"model.{k}": v for k, v in state.items()}}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wrapped, checkpoint_id=str(ckpt))
    except Exception as e:  # corrupt bytes behind complete-looking files, another model
        from recsys.training.checkpoint.failure import describe_failure

        raise CheckpointError(f"cannot export {ckpt}: {describe_failure(e)}") from None
