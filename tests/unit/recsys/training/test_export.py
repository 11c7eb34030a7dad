"""A run's checkpoint out of the cluster: the model of a DCP checkpoint (keys as the training
module saves them) written as one file and loaded back into the plain model with every weight
equal, and the one-line refusals for a run without a config or a usable checkpoint."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recsys.config import dump, load_config
from recsys.data.source import build_source
from recsys.models.ctr import build_model
from recsys.training.checkpoint import CheckpointError
from recsys.training.export import FORMAT, VERSION, export_model, load_exported
from recsys.training.run_dir import RunDirError


def exactly(text: str) -> str:
    """The whole of `text` as a `pytest.raises(match=)` pattern."""
    return f"^{re.escape(text)}$"


REPO = Path(__file__).resolve().parents[4]


def _run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory with config.yaml and a checkpoint at step 20 of weights drawn here."""
    cfg = load_config(REPO / "configs" / "experiments" / "smoke.yaml", ["model.embedding_dim=4", "model.dnn=[8]"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump(cfg))
    source = build_source(cfg)
    model = build_model(cfg.model, source.sparse_names, source.cardinalities, len(source.dense_names), torch.device("meta"))
    state = model.to_empty(device="cpu").state_dict()
    gen = torch.Generator().manual_seed(7)
    for t in state.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    ckpt = run / "checkpoints" / "step_000000020"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {f"model.{k}": v for k, v in state.items()}}, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    torch.save({"state": {}}, ckpt / "rank0.pt")
    (ckpt / "COMMITTED").write_text(json.dumps({"step": 20, "world_size": 1, "extra": {}}))
    return run, {k: v.clone() for k, v in state.items()}


def test_export_then_load_gives_the_checkpoints_weights(tmp_path):
    run, saved = _run(tmp_path)
    meta = export_model(run, tmp_path / "model.pt")
    assert {k: meta[k] for k in ("format", "version", "step", "checkpoint")} == {
        "format": FORMAT,
        "version": VERSION,
        "step": 20,
        "checkpoint": str(run / "checkpoints" / "step_000000020"),
    }
    assert meta["sparse_names"] == [f"C{i}" for i in range(1, 27)] and len(meta["dense_names"]) == 13
    assert meta["cardinalities"][:3] == [100, 50, 2000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "run"]  # no temp file left
    model = load_exported(tmp_path / "model.pt")
    assert not model.training
    loaded = model.state_dict()
    assert loaded.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    assert export_model(run, tmp_path / "again.pt", step=20)["step"] == 20


def test_a_run_without_a_config_or_checkpoint_is_refused(tmp_path):
    with pytest.raises(RunDirError, match=rf"^cannot export {tmp_path}: config file {tmp_path / 'config.yaml'} does not exist$"):
        export_model(tmp_path, tmp_path / "m.pt")
    run, _ = _run(tmp_path)
    message = f"cannot export step 7 of {run}: {run / 'checkpoints' / 'step_000000007'} does not exist"
    with pytest.raises(CheckpointError, match=exactly(message)):
        export_model(run, tmp_path / "m.pt", step=7)
    (run / "checkpoints" / "step_000000020" / "rank0.pt").unlink()
    message = f"cannot export step 20 of {run}: {run / 'checkpoints' / 'step_000000020' / 'rank0.pt'} is missing"
    with pytest.raises(CheckpointError, match=exactly(message)):
        export_model(run, tmp_path / "m.pt", step=20)
    with pytest.raises(CheckpointError, match=exactly(f"cannot export {run}: no complete checkpoint in {run / 'checkpoints'}")):
        export_model(run, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_load_exported_refuses_other_files(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt: not a recsys export \(written by `recsys export`\)$"):
        load_exported(tmp_path / "other.pt")
