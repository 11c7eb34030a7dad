"""The trainer's samples for cache sizing: a shard directory (all rows or the first N) read into
per-table lookup counts, and the one-line errors for a sample that cannot be used."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys.data.id_histogram import load_sample
from recsys.data.shard_writer import ShardWriter
from sharding.planner.cache_sizing import SampleError

# ids of feature A (table of 10 rows: id mod 10) and B (table of 100 rows); -1 = missing
SPARSE = np.array([[3, 7], [13, -1], [23, 7], [4, 50], [-1, 150], [5, 7]], dtype=np.int64)


def _module(features=("A", "B")) -> EmbeddingBagCollection:
    sizes = {"A": 10, "B": 100}
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=sizes[f], feature_names=[f]) for f in features]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


@pytest.fixture
def shard_dir(tmp_path):
    with ShardWriter(tmp_path / "ds", kind="avazu", dense_names=[], sparse_names=["A", "B"], rows_per_shard=4) as w:
        w.append(np.zeros((6, 0), np.float32), SPARSE, np.zeros(6, np.float32))
        w.commit()
    return tmp_path / "ds"


def test_a_shard_directory_gives_per_table_lookup_counts(shard_dir):
    stats = load_sample(str(shard_dir), _module(), batch=64)
    # A: 3, 13, 23 -> row 3 three times; 4 and 5 once each: 5 lookups, 3 distinct rows
    assert (stats["t_A"].total, stats["t_A"].distinct, stats["t_A"].rows) == (5, 3, 10)
    # B: 7 three times, 50 and 150 -> row 50 twice: 5 lookups, 2 distinct rows
    assert (stats["t_B"].total, stats["t_B"].distinct, stats["t_B"].rows) == (5, 2, 100)


def test_dir_colon_n_reads_the_first_n_rows_only(shard_dir):
    stats = load_sample(f"{shard_dir}:3", _module())
    assert stats["t_A"].total == 3 and stats["t_A"].distinct == 1  # 3, 13, 23: all row 3
    assert stats["t_B"].total == 2 and stats["t_B"].distinct == 1  # 7, missing, 7
    assert load_sample(f"{shard_dir}:1000", _module())["t_A"].total == 5  # capped at the rows there


def test_samples_that_cannot_be_used_are_one_line(shard_dir, tmp_path):
    with pytest.raises(SampleError, match=re.escape(f"{shard_dir}: key 'B': feature read by no table of the model")):
        load_sample(str(shard_dir), _module(features=("A",)))
    (tmp_path / "empty").mkdir()
    msg = (
        f"{tmp_path / 'empty'}: not a preprocessed shard directory: {tmp_path / 'empty'}: not a complete shard directory (no manifest.json"
    )
    with pytest.raises(SampleError, match=re.escape(msg)):
        load_sample(str(tmp_path / "empty"), _module())
    with pytest.raises(SampleError, match=re.escape(f"--data-sample {shard_dir}:0: expected a positive row count after ':', got '0'")):
        load_sample(f"{shard_dir}:0", _module())
    with pytest.raises(SampleError, match=re.escape("--data-sample data:100: needs the experiment config")):
        load_sample("data:100", _module())
    missing = tmp_path / "nope.json"
    with pytest.raises(
        SampleError, match=re.escape(f"{missing}: no such file (expected a JSON id histogram, a shard directory, synthetic:N or data:N)")
    ):
        load_sample(str(missing), _module())
