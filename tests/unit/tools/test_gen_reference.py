"""The generated reference pages match the code they are generated from (tools/ci/gen_reference.py):
a config key, a CLI option or a default that changes without the page failing here would leave the
reference wrong."""

from __future__ import annotations

import dataclasses

import pytest

from recsys.config import ExperimentConfig
from tools.ci import gen_reference


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_reference_page_is_current(page):
    path = gen_reference.PAGES[page]
    assert path.read_text() == gen_reference.render()[page], f"{path.name} is stale: run python tools/ci/gen_reference.py"


def test_every_config_key_is_in_the_reference_with_its_meaning():
    text = gen_reference.config_reference()
    root = ExperimentConfig()
    keys = [f.name for f in dataclasses.fields(root) if not dataclasses.is_dataclass(getattr(root, f.name))]
    for section in (f.name for f in dataclasses.fields(root) if dataclasses.is_dataclass(getattr(root, f.name))):
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(getattr(root, section))]
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    assert sorted(k for k in keys if k not in rows) == []
    assert [k for k in keys if rows[k].rstrip().endswith("|  |")] == []  # every key says what it does


def test_field_comments_are_read_from_the_source():
    from recsys.config.schema import CheckpointConfig, TrainConfig

    comments = gen_reference._field_comments(CheckpointConfig)
    assert comments["every_steps"] == "0: only at the end"
    # a block of comment lines above a field and its trailing comment are joined
    train = gen_reference._field_comments(TrainConfig)
    assert train["micro_batch_rows"].startswith("The dense part of a training step")
    assert train["batch_size"] == "global batch; each rank gets batch_size / world_size rows"
