"""Config errors are one line, name the file and the key, and happen before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "experiments" / "demo.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_demo_config_loads_with_overrides():
    cfg = load_config(DEMO, ["train.batch_size=8192", "resume=true", "model.dnn=[64,32]"])
    assert cfg.train.batch_size == 8192 and cfg.resume is True and cfg.model.dnn == [64, 32]
    assert cfg.model.name == "deepfm" and cfg.data.source == "synthetic"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("train:\n  batchsize: 10\n", "unknown key 'train.batchsize' (did you mean 'train.batch_size'?)"),
        ("trian:\n  batch_size: 10\n", "unknown key 'trian' (did you mean 'train'?)"),
        ("train:\n  batch_size: many\n", "key 'train.batch_size': expected an integer, got 'many'"),
        ("train:\n  batch_size: 1.5\n", "key 'train.batch_size': expected an integer"),
        ("optim:\n  dense_lr: fast\n", "key 'optim.dense_lr': expected a number"),
        ("resume: maybe\n", "key 'resume': expected true or false"),
        ("model:\n  dnn: 400\n", "key 'model.dnn': expected a list of int"),
        ("train:\n  batch_size: 1001\n  nproc_per_node: 2\n", "key 'train.batch_size': 1001 is not divisible by the world size 2"),
        ("model:\n  embedding_dim: 10\n", "key 'model.embedding_dim': 10 is not a positive multiple of 4"),
        ("model:\n  name: fm\n", "key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'"),
        ("data:\n  source: criteo\n", "key 'data.path': source 'criteo' needs a path"),
        ("data:\n  cardinalities: criteo_big\n", "key 'data.cardinalities': unknown preset 'criteo_big'"),
        ("data:\n  train_rows: 10\n", "key 'data.train_rows': 10 rows is less than one batch"),
        ("train: [1, 2]\n", "train: expected a mapping"),
        ("optim:\n  embedding_l2: 1e-5\n", "key 'optim.embedding_l2': is only applied by cowclip_adam"),
        ("optim:\n  embedding: cowclip_adam\n  adam_eps_mode: tf\n", "key 'optim.adam_eps_mode': expected one of torch, keras, got 'tf'"),
        ("optim:\n  embedding: adagrad\n  embedding_l2_scope: all\n", "key 'optim.embedding_l2_scope': 'all' is"),
        (
            "optim:\n  embedding: adam\n  embedding_l2_scope: dense\n",
            "key 'optim.embedding_l2_scope': expected one of auto, batch, all, catchup, got 'dense'",
        ),
        # the default scope for cowclip_adam is the catch-up, which assumes 2*l2 < r for the L2 as scaled
        (
            "optim:\n  embedding: cowclip_adam\n  embedding_l2: 0.01\n  scale_from_batch: 1024\ntrain:\n  batch_size: 65536\n",
            "key 'optim.embedding_l2': 0.64 (as scaled to the batch) needs 2*l2 < optim.cowclip_r (1) with embedding_l2_scope catchup",
        ),
        ("optim:\n  scale_rule: cubic\n", "key 'optim.scale_rule': expected one of cowclip, sqrt, linear, got 'cubic'"),
        (
            "train:\n  merge_every: 4\nsharding:\n  sharding_types: [table_row_wise]\n",
            "key 'sharding.sharding_types': table_row_wise is not supported with train.merge_every > 0",
        ),
        (
            "optim:\n  embedding: lamb\n",
            "key 'optim.embedding': expected one of rowwise_adagrad, adagrad, sgd, cowclip_adam, adam, fbgemm_cowclip, got 'lamb'",
        ),
        ("train:\n  batch_size: [\n", "is not valid YAML"),
        # a key given twice: YAML would keep the last silently
        (
            "train:\n  batch_size: 128\n  log_every: 5\n  batch_size: 1024\n",
            "line 4: key 'batch_size' given twice (first at line 2); keep one",
        ),
        ("train:\n  log_every: 5\ntrain:\n  max_steps: 3\n", "line 3: key 'train' given twice (first at line 1)"),
        ("", "holds no settings (it is empty or only comments); write at least one key, e.g. `name: my-run`"),
        ("# only a comment\n", "holds no settings (it is empty or only comments)"),
        ("data:\n  source: criteo\n  path: x.tsv\n  verify: all\n", "key 'data.verify': expected one of full, quick, got 'all'"),
        # non-finite numbers (YAML .nan/.inf and the strings float() accepts) and impossible signs
        ("optim:\n  dense_lr: .nan\n", "key 'optim.dense_lr': expected a finite number, got nan"),
        ("optim:\n  embedding_lr: .inf\n", "key 'optim.embedding_lr': expected a finite number, got inf"),
        ("optim:\n  cowclip_zeta: -.inf\n", "key 'optim.cowclip_zeta': expected a finite number, got -inf"),
        ("optim:\n  dense_lr: 'nan'\n", "key 'optim.dense_lr': expected a finite number, got 'nan'"),
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
        ("train:\n  pg_timeout_s: .inf\n", "key 'train.pg_timeout_s': expected a finite number"),
        ("checkpoint:\n  every_steps: -10\n", "key 'checkpoint.every_steps': must be >= 0"),
        ("data:\n  seed: -1\n", "key 'data.seed': must be >= 0"),
        ("data:\n  eval_rows: 1\n", "key 'data.eval_rows': 1 rows is fewer than one per rank (2 ranks)"),
        ("model:\n  embedding_init_std: -0.01\n", "key 'model.embedding_init_std': must be positive"),
        ("overwrit: true\n", "unknown key 'overwrit' (did you mean 'overwrite'?)"),
        ("overwrite: yes please\n", "key 'overwrite': expected true or false"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
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


def test_bad_override_is_named():
    with pytest.raises(ConfigError, match=r"override 'train.batch_sise=8': unknown key 'train.batch_sise'"):
        load_config(DEMO, ["train.batch_sise=8"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config(DEMO, ["train.batch_size"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_overwrite_key_defaults_to_false_and_parses():
    assert load_config(DEMO).overwrite is False
    assert load_config(DEMO, ["overwrite=true"]).overwrite is True


def test_nan_override_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["optim.dense_lr=.nan"])
    assert str(e.value) == "override 'optim.dense_lr=.nan': key 'optim.dense_lr': expected a finite number, got nan"


def test_binary_or_non_utf8_config_names_the_file(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(latin1)
    assert str(e.value) == f"config file {latin1} is not UTF-8 text (byte 0xe9 at offset 9); is it a YAML file?"
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\x00\x00name: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(binary)
    assert str(e.value) == f"config file {binary} is binary (NUL byte at offset 4); is it a YAML file?"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"config file {tmp_path} is a directory"


def test_shipped_name_wins_over_a_directory_of_that_name(tmp_path, monkeypatch):
    """`recsys train --config smoke run_dir=smoke`: the launcher creates ./smoke before the workers
    read `--config smoke` again; the name still means the shipped config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()
    assert load_config("smoke").name == "smoke"


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("not a run dir\n")
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [f"run_dir={f}"])
    assert str(e.value) == f"{DEMO}: key 'run_dir': run directory {f} is an existing file, not a directory"
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [f"run_dir={f}/sub/run"])
    assert str(e.value) == (f"{DEMO}: key 'run_dir': run directory {f}/sub/run is inside {f}, an existing file, not a directory")
    # a directory, or a path that can be created, is fine
    assert load_config(DEMO, [f"run_dir={tmp_path}/new/run"]).run_dir == f"{tmp_path}/new/run"


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
    from recsys.config import effective_l2_scope

    over = [f"optim.embedding={embedding}"] + ([f"optim.embedding_l2_scope={scope}"] if scope else [])
    cfg = load_config(None, over)
    assert cfg.optim.embedding_l2_scope == (scope or "auto")
    assert effective_l2_scope(cfg.optim) == effective
    if embedding != "rowwise_adagrad":  # with the lazy scope the catch-up's l2 bound does not apply
        assert load_config(None, [over[0], "optim.embedding_l2_scope=batch", "optim.embedding_l2=0.6"]).optim.embedding_l2 == 0.6


def test_config_built_in_python_is_checked_against_its_literal_types():
    """validate() checks the Literal-typed keys of a config built in code (no YAML, no _coerce)."""
    from recsys.config import ExperimentConfig, validate

    cfg = ExperimentConfig()
    cfg.train.merge_route = "ring"
    with pytest.raises(
        ConfigError,
        match=r"^config: key 'train.merge_route': expected one of auto, flat, hierarchical, "
        r"got 'ring'$",
    ):
        validate(cfg)


def test_environment_sets_its_keys_when_the_config_loads(monkeypatch):
    """RECSYS_RESUME, RECSYS_MERGE_ROUTE and RECSYS_PG_TIMEOUT_S are resolved into the config
    (so the run's config.yaml records them) and win over the file and the overrides."""
    from recsys.config import dump

    monkeypatch.setenv("RECSYS_RESUME", "1")
    monkeypatch.setenv("RECSYS_MERGE_ROUTE", "flat")
    monkeypatch.setenv("RECSYS_PG_TIMEOUT_S", "15")
    cfg = load_config(DEMO, ["train.merge_route=hierarchical", "train.pg_timeout_s=900"])
    assert (cfg.resume, cfg.train.merge_route, cfg.train.pg_timeout_s) == (True, "flat", 15.0)
    assert "resume: true" in dump(cfg) and "merge_route: flat" in dump(cfg)
    monkeypatch.setenv("RECSYS_RESUME", "0")
    monkeypatch.setenv("RECSYS_MERGE_ROUTE", "")  # empty: the key is left alone
    cfg = load_config(DEMO, ["resume=true", "train.merge_route=hierarchical"])
    assert (cfg.resume, cfg.train.merge_route) == (False, "hierarchical")


@pytest.mark.parametrize(
    "var, raw, message",
    [
        ("RECSYS_MERGE_ROUTE", "ring", "RECSYS_MERGE_ROUTE=ring: key 'train.merge_route': expected one of auto, flat, hierarchical"),
        ("RECSYS_PG_TIMEOUT_S", "soon", "environment RECSYS_PG_TIMEOUT_S=soon: key 'train.pg_timeout_s': expected a number, got 'soon'"),
        ("RECSYS_RESUME", "yes please", "environment RECSYS_RESUME=yes please: key 'resume': expected true or false, got 'yes please'"),
        ("RECSYS_PG_TIMEOUT_S", "-5", "key 'train.pg_timeout_s': must be positive"),
    ],
)  # fmt: skip
def test_bad_environment_value_is_one_line_naming_the_variable(monkeypatch, var, raw, message):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as e:
        load_config(DEMO)
    assert message in str(e.value) and "\n" not in str(e.value)
