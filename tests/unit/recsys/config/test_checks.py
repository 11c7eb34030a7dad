"""Impossible values (recsys/config/checks.py): each section's checks, the Literal-typed keys of a
config built in Python, and the run directory, each a one-line ConfigError naming the source and
the key, before any process starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recsys.config import ConfigError, ExperimentConfig, load_config, validate

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "configs" / "experiments" / "demo.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


@pytest.fixture(autouse=True)
def _no_torchrun_world(monkeypatch):
    """Before launch the world size is train.nproc_per_node; WORLD_SIZE (torchrun's) is set per test."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("train:\n  batch_size: 1001\n  nproc_per_node: 2\n", "key 'train.batch_size': 1001 is not divisible by the world size 2"),
        ("model:\n  embedding_dim: 10\n", "key 'model.embedding_dim': 10 is not a positive multiple of 4"),
        ("data:\n  source: criteo\n", "key 'data.path': source 'criteo' needs a path"),
        ("data:\n  cardinalities: criteo_big\n", "key 'data.cardinalities': unknown preset 'criteo_big'"),
        ("data:\n  train_rows: 10\n", "key 'data.train_rows': 10 rows is less than one batch"),
        ("optim:\n  embedding_l2: 1e-5\n", "key 'optim.embedding_l2': is only applied by cowclip_adam"),
        ("optim:\n  embedding: adagrad\n  embedding_l2_scope: all\n", "key 'optim.embedding_l2_scope': 'all' is"),
        # the default scope for cowclip_adam is the catch-up, which assumes 2*l2 < r for the L2 as scaled
        (
            "optim:\n  embedding: cowclip_adam\n  embedding_l2: 0.01\n  scale_from_batch: 1024\ntrain:\n  batch_size: 65536\n",
            "key 'optim.embedding_l2': 0.64 (as scaled to the batch) needs 2*l2 < optim.cowclip_r (1) with embedding_l2_scope catchup",
        ),
        (
            "train:\n  merge_every: 4\nsharding:\n  sharding_types: [table_row_wise]\n",
            "key 'sharding.sharding_types': table_row_wise is not supported with train.merge_every > 0",
        ),
        # impossible signs
        ("optim:\n  dense_lr: -0.1\n", "key 'optim.dense_lr': must be positive"),
        ("optim:\n  embedding_eps: 0\n", "key 'optim.embedding_eps': must be positive"),
        ("optim:\n  dense_weight_decay: -1e-4\n", "key 'optim.dense_weight_decay': must be >= 0"),
        ("optim:\n  embedding: adam\n  embedding_l2: -1e-5\n", "key 'optim.embedding_l2': must be >= 0"),
        ("optim:\n  adam_beta1: 1.0\n", "key 'optim.adam_beta1': 1.0 is not in [0, 1)"),
        ("optim:\n  adam_beta2: -0.5\n", "key 'optim.adam_beta2': -0.5 is not in [0, 1)"),
        ("train:\n  max_steps: -5\n", "key 'train.max_steps': -5 is negative (0: run train.epochs epochs)"),
        ("train:\n  epochs: -1\n  max_steps: 10\n", "key 'train.epochs': -1 is negative"),
        ("train:\n  eval_every: -10\n", "key 'train.eval_every': must be >= 0"),
        ("train:\n  batch_size: -512\n", "key 'train.batch_size': must be positive"),
        ("train:\n  nproc_per_node: -2\n", "key 'train.nproc_per_node': must be positive"),
        ("train:\n  threads_per_rank: -1\n", "key 'train.threads_per_rank': must be >= 0"),
        ("checkpoint:\n  every_steps: -10\n", "key 'checkpoint.every_steps': must be >= 0"),
        ("data:\n  seed: -1\n", "key 'data.seed': must be >= 0"),
        ("data:\n  eval_rows: 1\n", "key 'data.eval_rows': 1 rows is fewer than one per rank (2 ranks)"),
        ("model:\n  embedding_init_std: -0.01\n", "key 'model.embedding_init_std': must be positive"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        load_config(path)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg
    if "override" not in msg:
        assert str(path) in msg


def test_cowclip_options_parse_and_any_dim_for_our_kernel(tmp_path):
    path = _write(tmp_path, "model:\n  embedding_dim: 10\noptim:\n  embedding: cowclip_adam\n  embedding_l2: 1e-5\n")
    cfg = load_config(path, ["optim.cowclip_zeta=1e-4"])
    assert cfg.optim.embedding_l2 == 1e-5 and cfg.optim.cowclip_zeta == 1e-4 and cfg.model.embedding_dim == 10


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("not a run dir\n")
    with pytest.raises(ConfigError, match="is an existing file") as e:
        load_config(DEMO, [f"run_dir={f}"])
    assert str(e.value) == f"{DEMO}: key 'run_dir': run directory {f} is an existing file, not a directory"
    with pytest.raises(ConfigError, match="is inside") as e:
        load_config(DEMO, [f"run_dir={f}/sub/run"])
    assert str(e.value) == (f"{DEMO}: key 'run_dir': run directory {f}/sub/run is inside {f}, an existing file, not a directory")
    # a directory, or a path that can be created, is fine
    assert load_config(DEMO, [f"run_dir={tmp_path}/new/run"]).run_dir == f"{tmp_path}/new/run"


def test_config_built_in_python_is_checked_against_its_literal_types():
    """validate() checks the Literal-typed keys of a config built in code (no YAML, no _coerce)."""
    cfg = ExperimentConfig()
    cfg.train.merge_route = "ring"
    with pytest.raises(
        ConfigError,
        match=r"^config: key 'train.merge_route': expected one of auto, flat, hierarchical, "
        r"got 'ring'$",
    ):
        validate(cfg)


def _problem(cfg: ExperimentConfig, source: str = "config") -> str:
    with pytest.raises(ConfigError, match=f"^{re.escape(source)}: key '") as e:
        validate(cfg, source)
    return str(e.value)


def test_the_world_size_under_torchrun_is_what_batches_must_divide(monkeypatch, tmp_path):
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    validate(cfg)  # 1024 rows on nproc_per_node=2 ranks
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert _problem(cfg, "exp.yaml") == "exp.yaml: key 'train.batch_size': 1024 is not divisible by the world size 3"
    cfg.train.batch_size = 1023
    assert _problem(cfg) == "config: key 'train.eval_batch_size': 8192 is not a positive multiple of the world size 3"
    cfg.train.eval_batch_size = 8190
    validate(cfg)
    cfg.train.hosts, cfg.train.merge_every = 2, 4
    assert _problem(cfg) == "config: key 'train.hosts': the world size 3 is not divisible by 2 hosts"


def test_kstep_keys_need_each_other(tmp_path):
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.train.hosts = 2
    assert _problem(cfg) == "config: key 'train.merge_every': train.hosts=2 needs merge_every > 0 (hosts would never synchronise)"
    cfg.train.hosts = 1
    cfg.train.merge_moments = True
    assert _problem(cfg) == "config: key 'train.merge_moments': only meaningful with train.merge_every > 0"
    cfg.train.merge_every = 8
    validate(cfg)


def test_sharding_types_and_a_saved_plan_are_checked(tmp_path):
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.sharding.sharding_types = ["row_wise", "diagonal"]
    assert _problem(cfg) == (
        "config: key 'sharding.sharding_types': unknown sharding type 'diagonal' (choose from table_wise, row_wise, "
        "column_wise, table_row_wise, table_column_wise, data_parallel)"
    )
    cfg.sharding.sharding_types = ["row_wise"]
    cfg.plan = str(tmp_path / "plan.json")
    assert _problem(cfg) == f"config: key 'plan': no such plan file {tmp_path / 'plan.json'}"
    (tmp_path / "plan.json").write_text("{}")
    validate(cfg)  # the plan's content is checked where it is read (sharding/plan/validation.py)
    cfg.sharding.target_hit_rate = 0.0
    assert _problem(cfg) == "config: key 'sharding.target_hit_rate': 0.0 is not in (0, 1]"


def test_raw_data_sources_need_their_field_counts(tmp_path):
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.data.source, cfg.data.path = "avazu", str(tmp_path)
    assert _problem(cfg) == ("config: key 'data.cardinalities': Avazu has 22 categorical fields, got 26 sizes (use the 'avazu' preset)")
    cfg.data.cardinalities = "avazu"
    validate(cfg)
    cfg.data.source = "criteo"
    assert _problem(cfg) == "config: key 'data.cardinalities': Criteo has 26 categorical fields, got 22 sizes"
    cfg.data.cardinalities = [5] * 26
    cfg.data.cache_dir = str(tmp_path / "file")
    (tmp_path / "file").write_text("")
    assert _problem(cfg) == f"config: key 'data.cache_dir': {tmp_path / 'file'} is an existing file, not a directory"


def test_the_first_problem_is_reported_in_section_order(tmp_path):
    """model, data, optim, train, sharding, checkpoint, then the run directory."""
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.checkpoint.keep = 0
    cfg.train.log_every = 0
    cfg.model.dropout = 1.0
    assert _problem(cfg) == "config: key 'model.dropout': 1.0 is not in [0, 1)"
    cfg.model.dropout = 0.5
    assert _problem(cfg) == "config: key 'train.log_every': must be positive"
    cfg.train.log_every = 10
    assert _problem(cfg) == "config: key 'checkpoint.keep': must be positive"


def test_embedding_dim_must_be_a_multiple_of_four_for_fbgemm_kernels_only(tmp_path):
    cfg = ExperimentConfig(run_dir=str(tmp_path / "run"))
    cfg.model.embedding_dim = 6
    assert _problem(cfg) == (
        "config: key 'model.embedding_dim': 6 is not a positive multiple of 4 (FBGEMM fused kernels need it; "
        "optim.embedding=cowclip_adam|adam take any dim)"
    )
    for kernel in ("cowclip_adam", "adam"):
        cfg.optim.embedding = kernel
        validate(cfg)
    cfg.model.embedding_dim = 0
    assert _problem(cfg).startswith("config: key 'model.embedding_dim': 0 is not a positive multiple of 4")
