"""Reading a config (recsys/config/loading.py): YAML files, `key=value` overrides and the
environment variables that set keys. Every problem is one line that names the file (or the
override, or the variable) and the dotted key; overrides win over the file, the environment over both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from recsys.config import ConfigError, ExperimentConfig, apply_environment, dump, load_config, parse_override, to_dict

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "configs" / "experiments" / "demo.yaml"
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"


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
        ("model:\n  dnn: 400\n", "key 'model.dnn': expected a list of integers, got 400"),
        ("model:\n  dnn: [64, wide]\n", "key 'model.dnn[1]': expected an integer, got 'wide'"),
        ("data:\n  cardinalities: 5\n", "key 'data.cardinalities': expected a string or a list of integers, got 5"),
        ("data:\n  cardinalities: [10, 2.5]\n", "key 'data.cardinalities[1]': expected an integer, got 2.5"),
        ("model:\n  name: fm\n", "key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'"),
        ("train: [1, 2]\n", "train: expected a mapping"),
        ("optim:\n  embedding: cowclip_adam\n  adam_eps_mode: tf\n", "key 'optim.adam_eps_mode': expected one of torch, keras, got 'tf'"),
        (
            "optim:\n  embedding: adam\n  embedding_l2_scope: dense\n",
            "key 'optim.embedding_l2_scope': expected one of auto, batch, all, catchup, got 'dense'",
        ),
        ("optim:\n  scale_rule: cubic\n", "key 'optim.scale_rule': expected one of cowclip, sqrt, linear, got 'cubic'"),
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
        # non-finite numbers (YAML .nan/.inf and the strings float() accepts)
        ("optim:\n  dense_lr: .nan\n", "key 'optim.dense_lr': expected a finite number, got nan"),
        ("optim:\n  embedding_lr: .inf\n", "key 'optim.embedding_lr': expected a finite number, got inf"),
        ("optim:\n  cowclip_zeta: -.inf\n", "key 'optim.cowclip_zeta': expected a finite number, got -inf"),
        ("optim:\n  dense_lr: 'nan'\n", "key 'optim.dense_lr': expected a finite number, got 'nan'"),
        ("train:\n  pg_timeout_s: .inf\n", "key 'train.pg_timeout_s': expected a finite number"),
        ("overwrit: true\n", "unknown key 'overwrit' (did you mean 'overwrite'?)"),
        ("overwrite: yes please\n", "key 'overwrite': expected true or false"),
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


def test_bad_override_is_named():
    with pytest.raises(ConfigError, match=r"override 'train.batch_sise=8': unknown key 'train.batch_sise'"):
        load_config(DEMO, ["train.batch_sise=8"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config(DEMO, ["train.batch_size"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_nan_override_is_refused():
    with pytest.raises(ConfigError, match="expected a finite number") as e:
        load_config(DEMO, ["optim.dense_lr=.nan"])
    assert str(e.value) == "override 'optim.dense_lr=.nan': key 'optim.dense_lr': expected a finite number, got nan"


def test_binary_or_non_utf8_config_names_the_file(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text") as e:
        load_config(latin1)
    assert str(e.value) == f"config file {latin1} is not UTF-8 text (byte 0xe9 at offset 9); is it a YAML file?"
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\x00\x00name: x\n")
    with pytest.raises(ConfigError, match="is binary") as e:
        load_config(binary)
    assert str(e.value) == f"config file {binary} is binary (NUL byte at offset 4); is it a YAML file?"
    with pytest.raises(ConfigError, match="is a directory") as e:
        load_config(tmp_path)
    assert str(e.value) == f"config file {tmp_path} is a directory"


def test_shipped_name_wins_over_a_directory_of_that_name(tmp_path, monkeypatch):
    """`recsys train --config smoke run_dir=smoke`: the launcher creates ./smoke before the workers
    read `--config smoke` again; the name still means the shipped config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()
    assert load_config("smoke").name == "smoke"


def test_environment_sets_its_keys_when_the_config_loads(monkeypatch):
    """RECSYS_RESUME, RECSYS_MERGE_ROUTE and RECSYS_PG_TIMEOUT_S are resolved into the config
    (so the run's config.yaml records them) and win over the file and the overrides."""
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
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(DEMO)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_wrong_type_and_unknown_option_are_one_exact_line_naming_file_and_key(tmp_path):
    path = _write(tmp_path, "train:\n  batch_size: many\n")
    with pytest.raises(ConfigError, match="expected an integer") as e:
        load_config(path)
    assert str(e.value) == f"{path}: key 'train.batch_size': expected an integer, got 'many'"
    path = _write(tmp_path, "model:\n  name: fm\n")
    with pytest.raises(ConfigError, match="expected one of") as e:
        load_config(path)
    assert str(e.value) == f"{path}: key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'"
    path = _write(tmp_path, "data:\n  shuffle: 1\n")  # YAML's 1 is an integer, not true
    with pytest.raises(ConfigError, match="expected true or false") as e:
        load_config(path)
    assert str(e.value) == f"{path}: key 'data.shuffle': expected true or false, got 1"
    with pytest.raises(ConfigError, match="expected an integer") as e:
        load_config(None, ["train.batch_size=true"])  # a bool is no integer
    assert str(e.value) == "override 'train.batch_size=true': key 'train.batch_size': expected an integer, got True"


def test_an_override_wins_over_the_file_and_the_last_override_wins():
    """smoke.yaml sets train.batch_size 512 and model.embedding_dim 8."""
    file_values = yaml.safe_load(SMOKE.read_text())
    assert file_values["train"]["batch_size"] == 512 and file_values["model"]["embedding_dim"] == 8
    cfg = load_config(SMOKE, ["train.batch_size=1024", "train.log_every=5", "train.log_every=7"])
    assert cfg.train.batch_size == 1024 and cfg.train.log_every == 7
    assert cfg.model.embedding_dim == 8 and cfg.model.dnn == file_values["model"]["dnn"]  # the rest of the file stays
    assert cfg.optim.dense_lr == ExperimentConfig().optim.dense_lr * 2  # smoke: 0.002, the default 0.001


def test_environment_wins_over_file_and_override_and_the_dump_records_it(tmp_path, monkeypatch):
    path = _write(tmp_path, "train:\n  merge_route: flat\n  pg_timeout_s: 30\n")
    monkeypatch.setenv("RECSYS_MERGE_ROUTE", "hierarchical")
    monkeypatch.setenv("RECSYS_PG_TIMEOUT_S", "45.5")
    cfg = load_config(path, ["train.merge_route=auto", "train.pg_timeout_s=60"])
    assert (cfg.train.merge_route, cfg.train.pg_timeout_s) == ("hierarchical", 45.5)
    recorded = yaml.safe_load(dump(cfg))
    assert recorded["train"]["merge_route"] == "hierarchical" and recorded["train"]["pg_timeout_s"] == 45.5


def test_apply_environment_reads_the_mapping_it_is_given_and_returns_the_keys_it_set(monkeypatch):
    monkeypatch.setenv("RECSYS_MERGE_ROUTE", "flat")  # not read: a mapping is given
    cfg = ExperimentConfig()
    applied = apply_environment(cfg, {"RECSYS_PG_TIMEOUT_S": "12", "RECSYS_RESUME": "1", "RECSYS_MERGE_ROUTE": "", "OTHER": "x"})
    assert applied == ["resume", "train.pg_timeout_s"]  # in the order of ENVIRONMENT_KEYS
    assert cfg.resume is True and cfg.train.pg_timeout_s == 12.0 and cfg.train.merge_route == "auto"
    assert apply_environment(cfg, {"RECSYS_RESUME": "0"}) == ["resume"] and cfg.resume is False


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("a.b=c", ("a.b", "c")),
        ("train.batch_size=8192", ("train.batch_size", 8192)),
        ("model.dnn=[64, 32]", ("model.dnn", [64, 32])),
        (" resume = true", ("resume", True)),
        ("name=", ("name", "")),
        ("data.path=/d/x=y.tsv", ("data.path", "/d/x=y.tsv")),  # only the first '=' splits
        ("data.path=[unclosed", ("data.path", "[unclosed")),  # not YAML: the raw text
        ("optim.embedding_l2=1e-5", ("optim.embedding_l2", "1e-5")),  # YAML 1.1: a string; the float key reads it
    ],
)
def test_parse_override(text, parsed):
    assert parse_override(text) == parsed


def test_numbers_given_as_integers_or_exponent_strings_are_floats():
    cfg = load_config(None, ["optim.dense_lr=1", "optim.embedding_l2=1e-5", "optim.embedding=adam"])
    assert cfg.optim.dense_lr == 1.0 and type(cfg.optim.dense_lr) is float
    assert cfg.optim.embedding_l2 == 1e-5 and type(cfg.optim.embedding_l2) is float


def test_dump_reads_back_to_the_same_config(tmp_path):
    cfg = load_config(SMOKE, ["train.batch_size=1024", "model.name=dcnv2", "data.cardinalities=criteo_kaggle_filtered"])
    path = tmp_path / "config.yaml"
    path.write_text(dump(cfg))
    again = load_config(path)
    assert again == cfg
    assert to_dict(again)["model"] == {**to_dict(ExperimentConfig())["model"], "name": "dcnv2", "embedding_dim": 8, "dnn": [64, 32]}
