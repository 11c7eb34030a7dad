"""The state-shape comparison a resume makes: which keys changed (tables one by one), which
optimizers reshard to another world size, and the defaults of keys older checkpoints lack."""

from __future__ import annotations

import pytest

from recsys.training.checkpoint.shape import RESHARDABLE_OPTIMIZERS, incompatible_changes, reshardable, shape_changes


def test_shape_changes_name_keys_old_and_new_and_tables_one_by_one():
    old = {"train.batch_size": 512, "data.tables": {"C1": 10, "C2": 50, "C3": 7}, "model.name": "deepfm"}
    new = {"train.batch_size": 256, "data.tables": {"C1": 10, "C2": 60, "C4": 7}, "model.cross_layers": 2, "model.name": "deepfm"}
    assert shape_changes(old, new) == [
        "data.tables.C2 50 -> 60",
        "data.tables.C3 7 -> null",
        "data.tables.C4 null -> 7",
        "model.cross_layers null -> 2",
        "train.batch_size 512 -> 256",
    ]
    assert shape_changes(old, dict(old)) == []


def test_long_values_are_cut_to_60_characters():
    dnn = list(range(100, 130))  # "[100, 101, ..." : 5 characters a number, 1 for the bracket
    changes = shape_changes({"model.dnn": dnn}, {"model.dnn": [1]})
    assert changes == ["model.dnn [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 1... -> [1]"]
    assert len(changes[0].split(" -> ")[0]) == len("model.dnn ") + 60


@pytest.mark.parametrize("optimizer", RESHARDABLE_OPTIMIZERS)
def test_per_row_optimizers_reshard(optimizer):
    assert reshardable({"optim.embedding": optimizer})


def test_other_optimizers_and_unknown_shapes_do_not_reshard():
    assert not reshardable({"optim.embedding": "fbgemm_cowclip"})
    assert not reshardable({})


SAVED = {"optim.embedding": "adam", "train.world_size": 2, "model.embedding_dim": 8}


def test_a_reshardable_checkpoint_ignores_the_world_size():
    marker = {"world_size": 2, "shape": SAVED}
    assert incompatible_changes(marker, {**SAVED, "train.world_size": 4}, 4) == []
    fixed = {**SAVED, "optim.embedding": "fbgemm_cowclip"}
    assert incompatible_changes({"world_size": 2, "shape": fixed}, {**fixed, "train.world_size": 4}, 4) == ["train.world_size 2 -> 4"]


def test_a_key_the_checkpoint_predates_counts_as_its_old_default():
    marker = {"world_size": 2, "shape": SAVED}  # written before optim.embedding_l2_scope was recorded: lazy, "batch"
    assert incompatible_changes(marker, {**SAVED, "optim.embedding_l2_scope": "batch"}, 2) == []
    changes = incompatible_changes(marker, {**SAVED, "optim.embedding_l2_scope": "catchup"}, 2)
    assert changes == ["optim.embedding_l2_scope batch -> catchup"]


def test_a_checkpoint_without_a_shape_is_compared_by_its_shard_world():
    assert incompatible_changes({"world_size": 2}, {}, 2) == []
    assert incompatible_changes({"world_size": 2}, {}, 1) == ["train.world_size 2 -> 1"]
    assert incompatible_changes({"world_size": 4, "ranks_per_host": 2}, {"train.world_size": 2}, 8) == []
    assert incompatible_changes({"world_size": 4, "ranks_per_host": 2}, {"train.world_size": 4}, 2) == ["train.world_size 2 -> 4"]
