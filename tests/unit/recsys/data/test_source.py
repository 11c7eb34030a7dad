"""The data sources: which rows each split serves, where raw files and their cache are, and the
checks that stop a run before any worker starts when the data cannot fill a batch."""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pytest

from recsys.config import ConfigError, ExperimentConfig
from recsys.data.shard_reader import ShardedDataset
from recsys.data.shard_writer import ShardWriter
from recsys.data.source import (
    EVAL,
    TRAIN,
    ShardSource,
    SyntheticSource,
    build_source,
    check_row_counts,
    epoch_order,
    prepare_data,
    preprocess_task,
    raw_files,
    shard_dir,
    split_sizes,
)
from recsys.data.synthetic import CriteoLikeGenerator


def _cfg(**data) -> ExperimentConfig:
    cfg = ExperimentConfig()
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def _write_shards(root, n: int = 20):
    """Row i: dense i, ids (i, 2 i), label i % 2."""
    i = np.arange(n)
    with ShardWriter(root, kind="criteo", dense_names=["I1"], sparse_names=["C1", "C2"], rows_per_shard=8) as w:
        w.append(i[:, None].astype(np.float32), np.stack([i, 2 * i], axis=1), (i % 2).astype(np.float32))
        return w.commit(extra={"cache_key": {"files": [], "options": {"kind": "criteo"}}})


def test_split_sizes_put_the_last_rows_in_eval():
    assert split_sizes(20, 0.1) == (18, 2)
    assert split_sizes(25, 0.1) == (23, 2)  # round(2.5) is 2
    assert split_sizes(10, 0.0) == (10, 0)


def test_shard_source_serves_the_past_for_training_and_the_last_rows_for_eval(tmp_path):
    _write_shards(tmp_path / "ds")
    src = ShardSource(_cfg(source="criteo", cardinalities=[5, 7], eval_fraction=0.25), tmp_path / "ds")
    assert (src.num_rows(TRAIN), src.num_rows(EVAL)) == (15, 5)
    assert src.dense_names == ["I1"] and src.sparse_names == ["C1", "C2"] and src.cardinalities == [5, 7]
    block = src.read(EVAL, 1, 4)
    assert block.dense[:, 0].tolist() == [16.0, 17.0, 18.0] and block.sparse[:, 1].tolist() == [32, 34, 36]
    assert block.labels.tolist() == [0.0, 1.0, 0.0] and block.probs is None
    assert src.read(TRAIN, 7, 9).dense[:, 0].tolist() == [7.0, 8.0]  # across the shard boundary
    assert src.identity()["rows"] == 20 and src.identity()["eval_fraction"] == 0.25 and not src.has_oracle


def test_shard_source_refuses_table_sizes_for_another_field_count(tmp_path):
    _write_shards(tmp_path / "ds")
    msg = f"key 'data.cardinalities': 3 sizes for 2 fields in {tmp_path / 'ds'}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        ShardSource(_cfg(source="criteo", cardinalities=[5, 7, 9]), tmp_path / "ds")


def test_synthetic_source_serves_the_configured_generator():
    cfg = _cfg(train_rows=1000, eval_rows=300, seed=7, cardinalities=[50, 60, 70])
    src = build_source(cfg)
    assert isinstance(src, SyntheticSource) and src.has_oracle
    assert (src.num_rows(TRAIN), src.num_rows(EVAL)) == (1000, 300)
    assert src.dense_names == [f"I{i}" for i in range(1, 14)] and src.sparse_names == ["C1", "C2", "C3"]
    np.testing.assert_array_equal(src.read(EVAL, 5, 9).sparse, CriteoLikeGenerator([50, 60, 70], seed=7).rows(EVAL, 5, 9).sparse)
    assert src.identity()["source"] == "synthetic" and src.identity()["seed"] == 7
    assert prepare_data(cfg) is None  # nothing to preprocess
    with pytest.raises(ConfigError, match=re.escape("key 'data.source': generated data (synthetic) has nothing to preprocess")):
        preprocess_task(cfg, 0, 2)


def test_epoch_order_follows_the_shuffle_settings():
    cfg = _cfg(train_rows=1000, eval_rows=10, shuffle_seed=3, shuffle_block_rows=16, shuffle_buffer_rows=64)
    order = epoch_order(cfg, SyntheticSource(cfg))
    assert (order.num_rows, order.shuffle, order.seed, order.block_rows, order.buffer_rows) == (1000, True, 3, 16, 64)


def test_raw_files_of_a_directory_a_glob_or_a_file(tmp_path):
    for name in ("day_1.tsv", "day_0.tsv", ".hidden.tsv", "notes.txt"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "sub").mkdir()
    assert raw_files(_cfg(path=str(tmp_path))) == [tmp_path / n for n in ("day_0.tsv", "day_1.tsv", "notes.txt")]
    assert raw_files(_cfg(path=str(tmp_path / "day_*.tsv"))) == [tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"]
    assert raw_files(_cfg(path=str(tmp_path / "notes.txt"))) == [tmp_path / "notes.txt"]


@pytest.mark.parametrize(
    "path,why",
    [
        ("empty", "directory {t}/empty holds no data files"),
        ("nothing_*.tsv", "no file matches {t}/nothing_*.tsv"),
        ("s*", "{t}/sub is a directory, not a data file"),
        ("gone.tsv", "no such file {t}/gone.tsv"),
    ],
)
def test_raw_files_that_cannot_be_used(tmp_path, path, why):
    (tmp_path / "empty").mkdir()
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=re.escape("key 'data.path': " + why.format(t=tmp_path))):
        raw_files(_cfg(path=str(tmp_path / path)))


def test_the_cache_directory_is_named_for_the_source_the_input_and_its_absolute_path(tmp_path, monkeypatch):
    assert shard_dir(_cfg(cache_dir="/data/cache")) == type(tmp_path)("/data/cache")
    monkeypatch.chdir(tmp_path)
    where = hashlib.sha256(os.path.join(str(tmp_path), "raw/day_*.gz").encode()).hexdigest()[:10]
    assert str(shard_dir(_cfg(source="criteo", path="raw/day_*.gz"))) == f"data_cache/criteo-day__.gz-{where}"
    other = shard_dir(_cfg(source="criteo", path=str(tmp_path / "other" / "day_*.gz")))
    assert other.name.startswith("criteo-day__.gz-") and other != shard_dir(_cfg(source="criteo", path="raw/day_*.gz"))


def test_row_counts_too_small_for_a_batch_or_for_the_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    manifest = {"num_rows": 1000, "sources": [{"path": "/d/a.tsv", "good_rows": 1000}]}
    cfg = _cfg(source="criteo", eval_fraction=0.1)
    cfg.train.batch_size, cfg.train.nproc_per_node = 900, 2
    check_row_counts(cfg, manifest)  # 900 for training, 100 for eval: fits
    cfg.train.batch_size = 901
    msg = (
        "key 'data.path': /d/a.tsv (1000 rows) has 1000 valid rows, 900 for training after "
        "data.eval_fraction=0.1: fewer than one global batch (train.batch_size=901)"
    )
    with pytest.raises(ConfigError, match=re.escape(msg)):
        check_row_counts(cfg, manifest)
    cfg.train.batch_size = 8
    monkeypatch.setenv("WORLD_SIZE", "200")
    four = {"num_rows": 1000, "sources": [{"path": f"/d/{i}.tsv", "good_rows": 250} for i in range(4)]}
    msg = (
        "key 'data.path': /d/0.tsv (250 rows), /d/1.tsv (250 rows), /d/2.tsv (250 rows) and 1 more files have 1000 valid rows, "
        "100 for evaluation (data.eval_fraction=0.1): fewer than one per rank (200 ranks)"
    )
    with pytest.raises(ConfigError, match=re.escape(msg)):
        check_row_counts(cfg, four)


def test_prepare_data_preprocesses_raw_files_once_into_the_cache(tmp_path):
    ints = [""] * 11
    lines = ["\t".join(["1", "3", "", *ints, *["a1"] * 26]), "\t".join(["0", "", "5", *ints, *["ff"] * 25, ""])] * 10
    raw = tmp_path / "day_0.tsv"
    raw.write_text("\n".join(lines) + "\n")
    cfg = _cfg(source="criteo", path=str(raw), cache_dir=str(tmp_path / "cache"), cardinalities=[1000] * 26, eval_fraction=0.5)
    cfg.train.batch_size, cfg.train.nproc_per_node = 8, 1
    cfg.data.shuffle = False
    m = prepare_data(cfg)
    assert m["num_rows"] == 20 and ShardedDataset.open(tmp_path / "cache").manifest == m
    src = build_source(cfg)
    assert isinstance(src, ShardSource) and src.num_rows(TRAIN) == 10
    row = src.read(TRAIN, 0, 2)
    assert row.sparse[0, 0] == 0xA1 and row.sparse[1, 25] == -1 and row.labels.tolist() == [1.0, 0.0]
    np.testing.assert_allclose(row.dense[:, :2], np.log1p([[3, 0], [0, 5]]).astype(np.float32))
    assert prepare_data(cfg) == m  # up to date: reused as is
