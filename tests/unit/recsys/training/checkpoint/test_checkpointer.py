"""The Checkpointer's decisions: the cadence (which steps get a mid-run checkpoint, rounded to
merge steps in a hierarchical run), a save -> resume round trip through DCP, what an interrupted
or failed save leaves, pruning by lineage, and the checks a resume makes (state shape, data,
world size, corrupt bytes). Collectives run over an in-process gloo group of one rank; saves over
several ranks are tested in tests/integration/training/test_integrity_runs.py."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

import recsys.training.checkpoint.checkpointer as checkpoint_mod
from recsys.training.checkpoint import Checkpointer, CheckpointError


def exactly(text: str) -> str:
    """The whole of `text` as a `pytest.raises(match=)` pattern."""
    return f"^{re.escape(text)}$"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recsys.training.checkpoint.checkpointer"]


def _due_steps(ckpt: Checkpointer, total: int) -> list[int]:
    return [s for s in range(1, total + 1) if ckpt.due(s, total)]


@pytest.mark.parametrize(
    "every, k, total, aligned, due",
    [
        (0, 4, 20, 0, []),  # only the final checkpoint
        (5, 1, 20, 5, [5, 10, 15]),  # the last step's own checkpoint is not a mid-run one
        (5, 4, 20, 8, [8, 16]),  # rounded up to a multiple of merge_every
        (8, 4, 20, 8, [8, 16]),  # already a multiple: unchanged
        (30, 16, 40, 32, [32]),
        (30, 16, 20, 32, []),  # rounded past the end: none before the final one
    ],
)
def test_cadence_and_its_rounding_to_merge_steps(tmp_path, every, k, total, aligned, due):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, every_steps=every)
    assert _due_steps(ckpt, total) == ([s for s in range(every, total, every)] if every else [])
    assert ckpt.align_every(k) == aligned == ckpt.every_steps
    assert _due_steps(ckpt, total) == due


def test_the_shard_world_is_the_ranks_per_host_of_a_hierarchical_run(tmp_path):
    assert Checkpointer(tmp_path, 0, 8).shard_world == 8
    assert Checkpointer(tmp_path, 0, 8, groups=SimpleNamespace(ranks_per_host=4)).shard_world == 4


class _Trained:
    """A small model with a dense Adam through torchrec's keyed optimizers, as a job holds them."""

    def __init__(self, seed: int, steps: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        self.dense = KeyedOptimizerWrapper(dict(self.model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.05))
        self.optimizer = CombinedOptimizer([self.dense])
        for _ in range(steps):
            self.optimizer.zero_grad()
            self.model(torch.randn(8, 4)).pow(2).mean().backward()
            self.optimizer.step()

    def adam_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {n: v.clone() for n, v in s.items()} for k, s in self.optimizer.state_dict()["state"].items()}


def _save(ckpt: Checkpointer, step: int, seed: int = 0) -> Path:
    job = _Trained(seed, 1)
    return ckpt.save(step, job.model, job.optimizer, {"samples": step * 8})


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_save_then_resume_restores_model_optimizer_rng_and_rank_state(tmp_path, gloo_world_of_one):
    a = _Trained(seed=1, steps=3)
    ckpt = Checkpointer(tmp_path, 0, 1, shape={"optim.embedding": "adam"}, data={"source": "synthetic", "seed": 3})
    rng = torch.get_rng_state()
    path = ckpt.save(7, a.model, a.optimizer, {"samples": 56}, {"merger": {"merges": 3}})
    assert path == tmp_path / "step_000000007" and _steps(tmp_path) == ["step_000000007"]
    marker = json.loads((path / "COMMITTED").read_text())
    assert {k: marker[k] for k in ("step", "world_size", "extra", "shape", "data", "data_start_step")} == {
        "step": 7,
        "world_size": 1,
        "extra": {"samples": 56},
        "shape": {"optim.embedding": "adam"},
        "data": {"source": "synthetic", "seed": 3},
        "data_start_step": 0,
    }
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != "COMMITTED")
    assert marker["sha256"] == {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in files}

    torch.rand(100)  # the RNG moves on after the save
    b = _Trained(seed=2, steps=1)  # other weights, other moments
    assert not torch.equal(a.model[0].weight, b.model[0].weight)
    other = Checkpointer(tmp_path, 0, 1)
    extra = other.resume(path, b.model, b.optimizer, b.dense)
    assert extra == {"samples": 56, "step": 7, "world_size": 1, "shard_world": 1, "rank_state": {"merger": {"merges": 3}}}
    for (name, wa), wb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(wa, wb), name
    sa, sb = a.adam_state(), b.adam_state()
    assert sa.keys() == sb.keys()
    for key in sa:
        for n in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key][n], sb[key][n]), (key, n)
    assert torch.equal(torch.get_rng_state(), rng)
    assert other.lineage == ckpt.lineage  # checkpoints from here on continue that run


def test_a_save_interrupted_before_its_commit_leaves_the_last_complete_checkpoint(tmp_path, gloo_world_of_one, monkeypatch):
    ckpt = Checkpointer(tmp_path, 0, 1, keep=5)
    first = _save(ckpt, 5)

    def killed(*args: object) -> None:
        raise KeyboardInterrupt("killed")  # the process stops between the write and the commit

    monkeypatch.setattr(checkpoint_mod, "commit_dir", killed)
    with pytest.raises(KeyboardInterrupt, match="^killed$"):
        _save(ckpt, 10)
    assert _steps(tmp_path) == ["step_000000005", "step_000000010.tmp"]
    assert ckpt.latest() == first and ckpt.latest_complete() == first
    monkeypatch.undo()
    _save(ckpt, 15)  # the next save removes the crashed one's directory
    assert _steps(tmp_path) == ["step_000000005", "step_000000015"]


def test_a_failed_write_removes_its_tmp_and_names_the_reason_and_the_last_checkpoint(tmp_path, gloo_world_of_one, monkeypatch):
    ckpt = Checkpointer(tmp_path, 0, 1)

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/disk/part")

    monkeypatch.setattr(checkpoint_mod, "hash_files", full)
    no_room = r"^checkpoint .*step_000000005 not written: No space left on device \(/disk/part\); no earlier checkpoint$"
    with pytest.raises(CheckpointError, match=no_room):
        _save(ckpt, 5)
    assert _steps(tmp_path) == []
    monkeypatch.undo()
    kept = _save(ckpt, 5)
    monkeypatch.setattr(checkpoint_mod, "hash_files", full)
    message = f"checkpoint {tmp_path / 'step_000000010'} not written: No space left on device (/disk/part); the last complete one is {kept}"
    with pytest.raises(CheckpointError, match=exactly(message)):
        _save(ckpt, 10)
    assert _steps(tmp_path) == ["step_000000005"]


def _fake(root: Path, step: int, lineage: str) -> None:
    d = root / f"step_{step:09d}"
    d.mkdir(parents=True)
    (d / "COMMITTED").write_text(json.dumps({"step": step, "world_size": 1, "extra": {}, "lineage": lineage}))


def test_pruning_keeps_the_newest_of_this_lineage_and_leaves_later_steps_and_other_runs(tmp_path, gloo_world_of_one):
    ckpt = Checkpointer(tmp_path, 0, 1, keep=2)
    _fake(tmp_path, 1, "another-run")
    _fake(tmp_path, 50, ckpt.lineage)  # an abandoned branch of this run, after a fallback
    for step in (10, 20, 30):
        _save(ckpt, step)
    assert _steps(tmp_path) == ["step_000000001", "step_000000020", "step_000000030", "step_000000050"]


def test_a_resave_of_the_same_step_replaces_it(tmp_path, gloo_world_of_one):
    ckpt = Checkpointer(tmp_path, 0, 1)
    _save(ckpt, 5, seed=1)
    before = json.loads((tmp_path / "step_000000005" / "COMMITTED").read_text())["sha256"]
    _save(ckpt, 5, seed=2)
    after = json.loads((tmp_path / "step_000000005" / "COMMITTED").read_text())["sha256"]
    assert _steps(tmp_path) == ["step_000000005"] and before != after


def test_latest_complete_falls_back_past_corrupt_bytes_with_one_warning(tmp_path, gloo_world_of_one, caplog):
    ckpt = Checkpointer(tmp_path, 0, 1, keep=3)
    good = _save(ckpt, 5)
    bad = _save(ckpt, 10)
    victim = sorted(bad.glob("*.distcp"))[0]
    victim.write_bytes(bytes(len(victim.read_bytes())))  # the same length, other bytes
    with caplog.at_level(logging.WARNING, logger="recsys.training.checkpoint.checkpointer"):
        assert ckpt.latest_complete() == good
    assert _warnings(caplog) == [
        f"warning: checkpoint step_000000010 is incomplete ({victim} is corrupt (its SHA-256 differs from the one recorded "
        "when it was written)); falling back to an earlier one"
    ]
    assert ckpt.latest_complete(verify_bytes=False) == bad  # presence and length only
    assert ckpt.latest() == bad


def test_resume_of_corrupt_bytes_is_one_line(tmp_path, gloo_world_of_one):
    ckpt = Checkpointer(tmp_path, 0, 1)
    path = _save(ckpt, 5)
    (path / ".metadata").write_bytes(b"not a pickle")
    b = _Trained(seed=2, steps=1)
    one_line = r"^cannot load checkpoint .*step_000000005: [^\n]*; move it aside to resume from an earlier one$"
    with pytest.raises(CheckpointError, match=one_line):
        ckpt.resume(path, b.model, b.optimizer, b.dense)


def _marker(tmp_path: Path, **fields: object) -> Path:
    d = tmp_path / "step_000000020"
    d.mkdir(parents=True)
    (d / "COMMITTED").write_text(json.dumps({"step": 20, "world_size": 1, "extra": {}, **fields}))
    return d


def test_check_compatible_names_the_changed_keys(tmp_path):
    saved = {"model.embedding_dim": 8, "optim.embedding": "rowwise_adagrad", "train.batch_size": 512, "train.world_size": 2}
    path = _marker(tmp_path, shape=saved)
    Checkpointer(tmp_path, 0, 1, shape={**saved, "train.world_size": 1}).check_compatible(path)  # resharded on load
    message = (
        f"cannot resume from {path}: the config changed (model.embedding_dim 8 -> 16; train.batch_size 512 -> 256); "
        "restore these values, or start a new run (another run_dir, or overwrite=true)"
    )
    with pytest.raises(CheckpointError, match=exactly(message)):
        Checkpointer(tmp_path, 0, 1, shape={**saved, "model.embedding_dim": 16, "train.batch_size": 256}).check_compatible(path)


def test_check_data_returns_where_the_epochs_count_from(tmp_path, caplog):
    data = {"source": "synthetic", "seed": 0, "train_rows": 1000}
    path = _marker(tmp_path, data=data, data_start_step=4)
    assert Checkpointer(tmp_path, 0, 1, data=data).check_data(path, allow_new=False) == 4
    assert Checkpointer(tmp_path, 0, 1, data=None).check_data(path, allow_new=False) == 4
    other = Checkpointer(tmp_path, 0, 1, data={**data, "train_rows": 2000})
    message = (
        f"cannot resume from {path}: it trained on other data (data.train_rows 1000 -> 2000); restore that data, or pass "
        "resume_on_new_data=true to go on training on this data (its epochs counted from step 20)"
    )
    with pytest.raises(CheckpointError, match=exactly(message)):
        other.check_data(path, allow_new=False)
    with caplog.at_level(logging.WARNING, logger="recsys.training.checkpoint.checkpointer"):
        assert other.check_data(path, allow_new=True) == 20
    assert _warnings(caplog) == [
        "resume_on_new_data=true: step 20's model goes on training on other data (data.train_rows 1000 -> 2000); "
        "epoch 0 of this data starts at step 20"
    ]


def test_load_refuses_another_world_size_unless_the_optimizer_state_reshards(tmp_path):
    path = _marker(tmp_path, world_size=2, shape={"optim.embedding": "fbgemm_cowclip"})
    b = _Trained(seed=0, steps=0)
    with pytest.raises(CheckpointError, match=exactly(f"checkpoint {path} was written by 2 ranks, this job has 1 ranks")):
        Checkpointer(tmp_path, 0, 1).load(path, b.model, b.optimizer, b.dense)
    hier = _marker(tmp_path / "h", world_size=4, ranks_per_host=2, shape={"optim.embedding": "fbgemm_cowclip"})
    groups = SimpleNamespace(ranks_per_host=1, host=0, local_rank=0, host_pg=None)
    with pytest.raises(CheckpointError, match=exactly(f"checkpoint {hier} was written by 2 ranks per host, this job has 1 ranks per host")):
        Checkpointer(tmp_path, 0, 2, groups=groups).load(hier, b.model, b.optimizer, b.dense)
