"""The config's schema (recsys/config/schema.py): defaults, the table-size presets, the run
directory a config names, and the embedding update scope `auto` resolves to."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys.config import (
    CARDINALITY_PRESETS,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    OptimConfig,
    cardinalities,
    effective_l2_scope,
    load_config,
)

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "configs" / "experiments" / "demo.yaml"


def test_overwrite_key_defaults_to_false_and_parses():
    assert load_config(DEMO).overwrite is False
    assert load_config(DEMO, ["overwrite=true"]).overwrite is True


@pytest.mark.parametrize(
    "embedding, scope, effective",
    [
        ("cowclip_adam", None, "catchup"),  # the default: the reference's semantics (docs/large_batch.md)
        ("adam", None, "batch"),  # plain Adam stays lazy, as FBGEMM's and TorchRec's fused Adam
        ("rowwise_adagrad", None, "batch"),
        ("cowclip_adam", "batch", "batch"),  # the lazy semantics stay an option
        ("adam", "catchup", "catchup"),
    ],
)
def test_auto_l2_scope_resolves_per_kernel_and_an_explicit_scope_wins(tmp_path, embedding, scope, effective):
    over = [f"optim.embedding={embedding}"] + ([f"optim.embedding_l2_scope={scope}"] if scope else [])
    cfg = load_config(None, over)
    assert cfg.optim.embedding_l2_scope == (scope or "auto")
    assert effective_l2_scope(cfg.optim) == effective
    if embedding != "rowwise_adagrad":  # with the lazy scope the catch-up's l2 bound does not apply
        assert load_config(None, [over[0], "optim.embedding_l2_scope=batch", "optim.embedding_l2=0.6"]).optim.embedding_l2 == 0.6


@pytest.mark.parametrize(
    "embedding, effective",
    [("cowclip_adam", "catchup"), ("adam", "batch"), ("sgd", "batch"), ("adagrad", "batch"), ("fbgemm_cowclip", "batch")],
)
def test_auto_scope_of_each_kernel_built_in_python(embedding, effective):
    assert effective_l2_scope(OptimConfig(embedding=embedding)) == effective
    assert effective_l2_scope(OptimConfig(embedding=embedding, embedding_l2_scope="all")) == "all"


def test_presets_have_one_size_per_categorical_field_and_are_handed_out_as_copies():
    """Criteo has 26 categorical fields (C1..C26), Avazu 22."""
    assert {name: len(sizes) for name, sizes in CARDINALITY_PRESETS.items()} == {
        "criteo_kaggle_filtered": 26,
        "criteo_kaggle_raw": 26,
        "criteo_1tb": 26,
        "avazu": 22,
    }
    sizes = cardinalities(DataConfig(cardinalities="avazu"))
    assert sizes[:3] == [240, 7, 7]
    sizes[0] = 1  # the caller's list: the preset stays as it was
    assert CARDINALITY_PRESETS["avazu"][0] == 240
    given = [3, 4, 5]
    out = cardinalities(DataConfig(cardinalities=given))
    assert out == given and out is not given


def test_list_defaults_are_not_shared_between_configs():
    a = ExperimentConfig()
    a.model.dnn.append(7)
    a.sharding.sharding_types.append("row_wise")
    b = ExperimentConfig()
    assert b.model.dnn == [400, 400, 400] and b.sharding.sharding_types == []
    assert ModelConfig().dnn == [400, 400, 400]


def test_run_dir_defaults_to_runs_slash_name():
    assert ExperimentConfig(name="exp1").resolved_run_dir() == Path("runs/exp1")
    assert ExperimentConfig(name="exp1", run_dir="/scratch/r").resolved_run_dir() == Path("/scratch/r")
