"""Experiment configuration: typed dataclasses, YAML files and `key=value` overrides.

Every problem with a config (unknown key, wrong type, impossible value, missing file) is a
`ConfigError` with a one-line message naming the file and the dotted key, raised before any
process group starts, so a typo never costs a cluster allocation.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from recsys.extras import missing_extra


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the file and key."""


# The options a string key takes: checked when a file or override sets them (``_coerce``) and
# again by ``validate`` for configs built in Python.
ModelName = Literal["deepfm", "wide_deep", "dcn", "dcnv2"]
DataSource = Literal["synthetic", "criteo", "avazu"]
EmbeddingOptimizer = Literal["rowwise_adagrad", "adagrad", "sgd", "cowclip_adam", "adam", "fbgemm_cowclip"]


@dataclass
class ModelConfig:
    """Model architecture. Defaults follow the CowClip paper (DNN 400-400-400) except the
    embedding dim: the paper uses 10, FBGEMM's fused kernels need dims divisible by 4, so 16."""

    name: ModelName = "deepfm"
    embedding_dim: int = 16
    dnn: list[int] = field(default_factory=lambda: [400, 400, 400])
    cross_layers: int = 3  # dcn / dcnv2
    cross_low_rank: int = 0  # dcnv2: 0 = full-rank matrix cross layers
    dropout: float = 0.0
    # Embedding rows start uniform with this standard deviation (CowClip reference: 1e-2).
    embedding_init_std: float = 0.01
    # Tables get this many times the data's cardinality in rows; the ids stay in the first part
    # (headroom, as hashed tables sized for future ids have). 1: the cardinality.
    table_rows_factor: int = 1


@dataclass
class DataConfig:
    """Where batches come from. `synthetic` is the embedded default (no files needed)."""

    source: DataSource = "synthetic"
    # criteo/avazu: raw files (a file, a directory or a glob); preprocessed once into cache_dir.
    path: str = ""
    format: Literal["auto", "tsv", "csv"] = "auto"  # criteo
    cache_dir: str = ""  # default: data_cache/<source>-<name of path>-<hash of its absolute path> (docs/data.md)
    eval_fraction: float = 0.1  # criteo/avazu: the last fraction of rows is the eval split
    max_bad_fraction: float = 0.01
    # How a shard cache that matches its inputs' names, sizes, mtimes and first/last MiB is checked
    # before reuse: full (every byte hashed again, ~0.7 s/GB) | quick (trust those; said in the log)
    verify: Literal["full", "quick"] = "full"
    # Training epochs in a seeded, shuffled order (recsys/data/order.py, docs/data.md): blocks of
    # shuffle_block_rows consecutive rows permuted per epoch, rows permuted again inside windows
    # of shuffle_buffer_rows (0: blocks only). Eval always reads its split in order.
    shuffle: bool = True
    shuffle_seed: int = 0
    shuffle_block_rows: int = 256
    shuffle_buffer_rows: int = 65536
    # Table sizes: a preset name or an explicit list (raw ids are hashed into these sizes).
    cardinalities: Union[str, list[int]] = "criteo_kaggle_filtered"
    # synthetic source
    train_rows: int = 1_000_000  # rows per epoch
    eval_rows: int = 100_000
    seed: int = 0
    zipf_exponent: float = 1.05
    teacher_head: int = 200  # ids (by popularity rank) per field that carry signal
    teacher_dim: int = 4
    teacher_scale: float = 1.0
    positive_rate: float = 0.25


@dataclass
class OptimConfig:
    """Optimizers: embeddings are updated inside the backward (FBGEMM fused); dense by Adam."""

    # rowwise_adagrad | adagrad | sgd (FBGEMM fused); cowclip_adam | adam (our fused kernel,
    # recsys/optim/cowclip/sharder.py); fbgemm_cowclip (FBGEMM's native COWCLIP on rowwise Adagrad)
    embedding: EmbeddingOptimizer = "rowwise_adagrad"
    embedding_lr: float = 0.005
    embedding_eps: float = 1e-8
    dense_lr: float = 1e-3
    dense_weight_decay: float = 0.0
    # CowClip (paper: r=1, zeta=1e-5; the wide/linear tables unclipped; L2 lambda on embedding rows)
    cowclip_r: float = 1.0
    cowclip_zeta: float = 1e-5
    cowclip_wide: bool = False  # also clip the wide/linear tables
    embedding_l2: float = 0.0  # Keras l2(lambda) (cowclip_adam/adam/fbgemm_cowclip)
    # auto (effective_l2_scope): catchup for cowclip_adam, batch otherwise | batch: rows of the batch
    # only (lazy) | all: every row, every step | catchup: as all, absent rows advanced when next read
    embedding_l2_scope: Literal["auto", "batch", "all", "catchup"] = "auto"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps_mode: Literal["torch", "keras"] = "torch"  # torch.optim.Adam's eps | the paper's tf.keras Adam's
    # Scaling rule (recsys/optim/scaling.py): hyperparameters above are for batch `scale_from_batch`;
    # the run's train.batch_size scales them (0: off). cowclip: embedding lr x1, L2 x s, dense lr
    # x sqrt(s); sqrt / linear: every lr x sqrt(s) / x s.
    scale_from_batch: int = 0
    scale_rule: Literal["cowclip", "sqrt", "linear"] = "cowclip"
    warmup_epochs: float = -1.0  # linear dense-lr warmup; -1: 1 epoch when scaling, else none


# What optim.embedding_l2_scope=auto (the default) is for each embedding kernel. CowClip-Adam: the
# reference's semantics by catch-up (bytedance/LargeBatchCTR's dense L2 + Adam, at lazy cost): in
# the paper-scale grid it beat the lazy semantics at batch 1K (final AUC +0.0109: lazy Adam
# overfits) and at 128K (+0.0014, and in every epoch), and the lazy semantics never clip
# (docs/large_batch.md). Plain Adam: lazy, as FBGEMM's and TorchRec's fused Adam. FBGEMM's
# optimizers have no such choice ("batch").
AUTO_L2_SCOPE = {"cowclip_adam": "catchup"}


def effective_l2_scope(o: "OptimConfig") -> str:
    """The embedding update scope a run trains with: ``o.embedding_l2_scope`` with ``auto`` resolved
    (``AUTO_L2_SCOPE``). The kernels and the checkpoint's state shape both read it from here."""
    if o.embedding_l2_scope != "auto":
        return o.embedding_l2_scope
    return AUTO_L2_SCOPE.get(o.embedding, "batch")


@dataclass
class TrainConfig:
    batch_size: int = 1024  # global batch; each rank gets batch_size / world_size rows
    epochs: int = 1
    max_steps: int = 0  # 0: run `epochs` epochs
    eval_every: int = 0  # steps between evals; 0: only at the end
    eval_batch_size: int = 8192
    log_every: int = 20
    nproc_per_node: int = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    threads_per_rank: int = 0  # 0: cores / local ranks
    # The dense part of a training step (everything after the embedding lookups, and the loss) runs
    # in chunks of this many rows when a rank's batch is larger: same gradients, one embedding
    # update per batch, activations that stay in cache (recsys/models/micro_batch.py). 0: whole batches.
    micro_batch_rows: int = 8192
    # Hierarchical (k-step merge) training, docs/kstep.md. hosts: how many hosts the world is
    # split into (host-major ranks; 1 = plain synchronous training). Under torchrun a value of
    # 1 with merge_every > 0 takes the host count from NNODES / GROUP_WORLD_SIZE.
    hosts: int = 1
    merge_every: int = 0  # k: average dense params and embedding shards across hosts every k steps; 0: off
    merge_moments: bool = False  # also average optimizer state (Adam moments, Adagrad momentum)
    merge_route: Literal["auto", "flat", "hierarchical"] = "auto"  # auto: hierarchical when a host has > 1 rank
    # which embedding rows a merge averages: touched (rows some host looked up since the last
    # merge; the others are equal everywhere already) | all (whole shards)
    merge_rows: Literal["touched", "all"] = "touched"
    pg_timeout_s: float = 600.0  # collective timeout of hierarchical runs: a lost host stops the job
    # Outputs that need the [viz] extra (tensorboard, matplotlib): TensorBoard events in
    # <run_dir>/tb and the picture <run_dir>/curves.png. metrics.jsonl and summary.json are always written.
    tensorboard: bool = True
    curves: bool = True


@dataclass
class ShardingConfig:
    # torchrec: torchrec's EmbeddingShardingPlanner; topology: sharding/planner/topology_planner.py
    planner: Literal["torchrec", "topology"] = "torchrec"
    topology: str = ""  # planner=topology: a topology file or shipped name (CPU runs default to cpu-gloo)
    # Sharding types the planner may use. Empty: the model-parallel ones (TW, RW, CW, TWRW,
    # TWCW). data_parallel tables are updated by the dense optimizer, so they are opt-in.
    sharding_types: list[str] = field(default_factory=list)
    # UVM cache sizing from data (sharding/planner/cache_sizing.py): a JSON id histogram, a shard directory,
    # synthetic:N or data:N; each cached table gets the smallest load factor reaching target_hit_rate
    data_sample: str = ""
    target_hit_rate: float = 0.95


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end
    keep: int = 2


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    run_dir: str = ""  # default: runs/<name>
    resume: bool = False
    # Resume on other data than the checkpoint trained on (fine-tuning): its epochs count from the
    # checkpoint's step. Without it such a resume stops with one line saying what changed.
    resume_on_new_data: bool = False
    # Fresh run in a run_dir that has checkpoints: move the old run aside (without it such a run stops).
    overwrite: bool = False
    # A saved plan file (sharding/plan/io.py; `recsys-plan`) to use instead of planning.
    plan: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or os.path.join("runs", self.name))


# Table-size presets (Criteo Kaggle C1..C26; see docs/data.md for where they come from).
CARDINALITY_PRESETS: dict[str, list[int]] = {
    "criteo_kaggle_filtered": [
        1446, 554, 157339, 117822, 306, 18, 11882, 630, 5, 39530, 5131, 156656, 3176, 28, 11043,
        148913, 12, 4560, 2003, 5, 154564, 18, 17, 53031, 82, 40955,
    ],
    "criteo_kaggle_raw": [
        1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
    ],
    "criteo_1tb": [
        45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
        2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
    ],
    # Avazu's 22 categorical fields hashed into tables sized after its vocabularies (min count 2).
    "avazu": [
        240, 7, 7, 4737, 7745, 26, 8552, 559, 36, 2686408, 6729486, 8251, 5, 4, 2626, 8, 9, 435,
        4, 68, 172, 60,
    ],
}  # fmt: skip

_MODELS = typing.get_args(ModelName)
_SOURCES = typing.get_args(DataSource)
_EMB_OPTIMS = typing.get_args(EmbeddingOptimizer)


def cardinalities(data: DataConfig) -> list[int]:
    """The table sizes a data config asks for."""
    if isinstance(data.cardinalities, str):
        return list(CARDINALITY_PRESETS[data.cardinalities])
    return list(data.cardinalities)


# ---------------------------------------------------------------------------------------------
# Loading and checking


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, allowed))}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):  # no setting has a meaning for nan or inf
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp}")


def _apply(obj: Any, values: dict[str, Any], source: str, prefix: str = "") -> None:
    """Writes a nested dict into a dataclass tree, refusing unknown keys."""
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {values!r}")
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: unknown key '{dotted}'{hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, source, dotted + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{source}: key '{dotted}'"))


def parse_override(text: str) -> tuple[str, Any]:
    """`train.batch_size=8192` -> ("train.batch_size", 8192); values are read as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error naming both
    lines: YAML's own rule (the last wins) silently drops the first value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"line {line}: key '{key}' given twice (first at line {seen[key]}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment file, applies overrides and validates the result."""
    cfg = ExperimentConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():  # a shipped config's name (`--config demo`) works from any directory,
            from recsys.configs import shipped_experiment  # even one holding a directory of that name

            p = shipped_experiment(str(path)) or p
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); is it a YAML file?"
            ) from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read ({e.strerror or e})") from None
        if "\0" in text:
            raise ConfigError(f"config file {p} is binary (NUL byte at offset {text.index(chr(0))}); is it a YAML file?")
        try:
            values = yaml.load(text, Loader=_UniqueKeyLoader)
        except _DuplicateKey as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{p}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
        if values is None:  # a 0-byte file (a failed copy?) would otherwise run every default silently
            raise ConfigError(
                f"config file {p} holds no settings (it is empty or only comments); write at least one key, e.g. `name: my-run`"
            )
        _apply(cfg, values, str(p))
    for text in overrides:
        key, value = parse_override(text)
        _apply(cfg, _nest(key, value), f"override '{text}'")
    validate(cfg, str(path) if path is not None else "config")
    return cfg


def _literal_fields(obj: Any, prefix: str = "") -> list[tuple[str, Any, tuple[Any, ...]]]:
    """(dotted key, value, allowed values) of every Literal-typed field in a config tree."""
    out = []
    for name, tp in typing.get_type_hints(type(obj)).items():
        value = getattr(obj, name)
        if typing.get_origin(tp) is Literal:
            out.append((prefix + name, value, typing.get_args(tp)))
        elif dataclasses.is_dataclass(value):
            out.extend(_literal_fields(value, f"{prefix}{name}."))
    return out


def validate(cfg: ExperimentConfig, source: str = "config") -> None:
    """Impossible values, checked before any process starts."""

    def bad(key: str, why: str) -> None:
        raise ConfigError(f"{source}: key '{key}': {why}")

    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    for key, value, allowed in _literal_fields(cfg):
        if value not in allowed:
            bad(key, f"expected one of {', '.join(allowed)}, got {value!r}")
    if m.embedding_dim <= 0 or (m.embedding_dim % 4 and cfg.optim.embedding not in ("cowclip_adam", "adam")):
        bad(
            "model.embedding_dim",
            f"{m.embedding_dim} is not a positive multiple of 4 (FBGEMM fused kernels need it; "
            "optim.embedding=cowclip_adam|adam take any dim)",
        )
    if not m.dnn or any(h <= 0 for h in m.dnn):
        bad("model.dnn", f"{m.dnn}: need at least one positive layer width")
    if not 0.0 <= m.dropout < 1.0:
        bad("model.dropout", f"{m.dropout} is not in [0, 1)")
    if m.cross_layers < 0:
        bad("model.cross_layers", "must be >= 0")
    if m.cross_low_rank < 0:
        bad("model.cross_low_rank", "must be >= 0 (0: full-rank cross layers)")
    if m.embedding_init_std <= 0:
        bad("model.embedding_init_std", "must be positive")
    if m.table_rows_factor < 1:
        bad("model.table_rows_factor", "must be >= 1")
    if isinstance(d.cardinalities, str) and d.cardinalities not in CARDINALITY_PRESETS:
        bad("data.cardinalities", f"unknown preset '{d.cardinalities}' (choose from {', '.join(CARDINALITY_PRESETS)} or give a list)")
    cards = cardinalities(d)
    if any(c <= 0 for c in cards):
        bad("data.cardinalities", "table sizes must be positive")
    if d.source == "synthetic":
        if len(cards) != 26:
            bad("data.cardinalities", f"the synthetic Criteo-like source has 26 fields, got {len(cards)} sizes")
        if d.train_rows < t.batch_size:
            bad("data.train_rows", f"{d.train_rows} rows is less than one batch of {t.batch_size}")
        world = int(os.environ.get("WORLD_SIZE", t.nproc_per_node))
        if d.eval_rows < max(world, 1):
            bad("data.eval_rows", f"{d.eval_rows} rows is fewer than one per rank ({world} ranks)")
        if d.seed < 0:
            bad("data.seed", "must be >= 0")
        if d.teacher_head <= 0:
            bad("data.teacher_head", "must be positive")
        if d.teacher_dim <= 0:
            bad("data.teacher_dim", "must be positive")
        if d.teacher_scale < 0:
            bad("data.teacher_scale", "must be >= 0")
        if not 0.0 < d.positive_rate < 1.0:
            bad("data.positive_rate", f"{d.positive_rate} is not in (0, 1)")
        if d.zipf_exponent <= 0:
            bad("data.zipf_exponent", "must be positive")
    else:
        if not d.path:
            bad("data.path", f"source '{d.source}' needs a path to raw files")
        if d.source == "criteo" and len(cards) != 26:
            bad("data.cardinalities", f"Criteo has 26 categorical fields, got {len(cards)} sizes")
        if d.source == "avazu" and len(cards) != 22:
            bad("data.cardinalities", f"Avazu has 22 categorical fields, got {len(cards)} sizes (use the 'avazu' preset)")
        if not 0.0 < d.eval_fraction < 1.0:
            bad("data.eval_fraction", f"{d.eval_fraction} is not in (0, 1)")
        if d.cache_dir and os.path.exists(d.cache_dir) and not os.path.isdir(d.cache_dir):
            bad("data.cache_dir", f"{d.cache_dir} is an existing file, not a directory")
    if not 0.0 <= d.max_bad_fraction <= 1.0:
        bad("data.max_bad_fraction", f"{d.max_bad_fraction} is not in [0, 1]")
    if d.shuffle_seed < 0:
        bad("data.shuffle_seed", "must be >= 0")
    if d.shuffle_block_rows < 1:
        bad("data.shuffle_block_rows", "must be positive")
    if d.shuffle_buffer_rows < 0:
        bad("data.shuffle_buffer_rows", "must be >= 0 (0: shuffle blocks only)")
    for key in ("embedding_lr", "dense_lr", "embedding_eps"):
        if getattr(o, key) <= 0:
            bad(f"optim.{key}", "must be positive")
    if o.dense_weight_decay < 0:
        bad("optim.dense_weight_decay", "must be >= 0")
    for key in ("cowclip_r", "cowclip_zeta"):
        if getattr(o, key) <= 0:
            bad(f"optim.{key}", "must be positive")
    if o.embedding_l2 < 0:
        bad("optim.embedding_l2", "must be >= 0")
    if o.embedding_l2 and o.embedding not in ("cowclip_adam", "adam", "fbgemm_cowclip"):
        bad("optim.embedding_l2", f"is only applied by cowclip_adam, adam and fbgemm_cowclip, not {o.embedding}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            bad(f"optim.{key}", f"{getattr(o, key)} is not in [0, 1)")
    if o.embedding_l2_scope in ("all", "catchup") and o.embedding not in ("cowclip_adam", "adam"):
        bad("optim.embedding_l2_scope", f"'{o.embedding_l2_scope}' is implemented by the cowclip_adam and adam kernels only")
    if o.scale_from_batch < 0:
        bad("optim.scale_from_batch", "must be >= 0 (0: no scaling)")
    if o.warmup_epochs < 0 and o.warmup_epochs != -1.0:
        bad("optim.warmup_epochs", "must be >= 0 (or -1: 1 epoch when scaling)")
    if effective_l2_scope(o) == "catchup" and o.embedding == "cowclip_adam" and t.batch_size > 0:
        # the catch-up assumes absent rows are never clipped (recsys/optim/cowclip/catchup.py),
        # for the L2 the run trains with (the scaling rule's, as the trainer computes it)
        from recsys.optim.scaling import effective_optim

        l2 = effective_optim(o, t.batch_size, 1)[0].embedding_l2
        if 2 * l2 >= o.cowclip_r:
            bad(
                "optim.embedding_l2",
                f"{l2:g} (as scaled to the batch) needs 2*l2 < optim.cowclip_r ({o.cowclip_r:g}) "
                "with embedding_l2_scope catchup; lower it or set optim.embedding_l2_scope=batch",
            )
    if t.nproc_per_node <= 0:
        bad("train.nproc_per_node", "must be positive")
    if t.batch_size <= 0:
        bad("train.batch_size", "must be positive")
    # Under torchrun the world size is known; before launch it is nproc_per_node (one node).
    world = int(os.environ.get("WORLD_SIZE", t.nproc_per_node))
    if t.batch_size % world:
        bad("train.batch_size", f"{t.batch_size} is not divisible by the world size {world}")
    if t.eval_batch_size <= 0 or t.eval_batch_size % world:
        bad("train.eval_batch_size", f"{t.eval_batch_size} is not a positive multiple of the world size {world}")
    if t.max_steps < 0:
        bad("train.max_steps", f"{t.max_steps} is negative (0: run train.epochs epochs)")
    if t.epochs < 0:
        bad("train.epochs", f"{t.epochs} is negative")
    if t.epochs == 0 and t.max_steps == 0:
        bad("train.epochs", "need epochs > 0 or max_steps > 0")
    if t.eval_every < 0:
        bad("train.eval_every", "must be >= 0 (0: only at the end)")
    if t.threads_per_rank < 0:
        bad("train.threads_per_rank", "must be >= 0 (0: cores / local ranks)")
    if t.micro_batch_rows < 0:
        bad("train.micro_batch_rows", "must be >= 0 (0: whole batches)")
    if t.log_every <= 0:
        bad("train.log_every", "must be positive")
    if t.hosts <= 0:
        bad("train.hosts", "must be positive")
    if t.merge_every < 0:
        bad("train.merge_every", "must be >= 0 (0: no k-step merging)")
    if t.hosts > 1 and t.merge_every == 0:
        bad("train.merge_every", f"train.hosts={t.hosts} needs merge_every > 0 (hosts would never synchronise)")
    if t.merge_moments and t.merge_every == 0:
        bad("train.merge_moments", "only meaningful with train.merge_every > 0")
    if not 0.0 < cfg.sharding.target_hit_rate <= 1.0:
        bad("sharding.target_hit_rate", f"{cfg.sharding.target_hit_rate} is not in (0, 1]")
    if t.merge_every > 0 and "table_row_wise" in cfg.sharding.sharding_types:
        bad("sharding.sharding_types", "table_row_wise is not supported with train.merge_every > 0 (DMP runs on one host's group)")
    if t.pg_timeout_s <= 0:
        bad("train.pg_timeout_s", "must be positive")
    if t.hosts > 1 and "WORLD_SIZE" in os.environ and world % t.hosts:
        bad("train.hosts", f"the world size {world} is not divisible by {t.hosts} hosts")
    known_types = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
    for st in cfg.sharding.sharding_types:
        if st not in known_types:
            bad("sharding.sharding_types", f"unknown sharding type '{st}' (choose from {', '.join(known_types)})")
    if cfg.plan and not Path(cfg.plan).is_file():
        bad("plan", f"no such plan file {cfg.plan}")
    if cfg.checkpoint.keep <= 0:
        bad("checkpoint.keep", "must be positive")
    if cfg.checkpoint.every_steps < 0:
        bad("checkpoint.every_steps", "must be >= 0 (0: only at the end)")
    _check_run_dir(cfg, bad)


def check_training_extras(cfg: ExperimentConfig, source: str = "config") -> None:
    """The optional packages a training run's outputs need (pyproject extras), checked by
    `recsys train` and the workers before anything starts; planning and preprocessing need none."""
    for key, feature, module in (
        ("tensorboard", "writing TensorBoard events", "tensorboard"),
        ("curves", "drawing curves.png", "matplotlib"),
    ):
        if getattr(cfg.train, key):
            line = missing_extra(feature, module, "viz", instead=f"set train.{key}=false")
            if line:
                raise ConfigError(f"{source}: key 'train.{key}': {line}")


def _check_run_dir(cfg: ExperimentConfig, bad: Any) -> None:
    """run_dir (or its default runs/<name>) must be a directory or creatable as one."""
    run_dir = cfg.resolved_run_dir()
    key = "run_dir" if cfg.run_dir else "name"
    for p in (run_dir, *run_dir.parents):
        try:
            exists, is_dir = p.exists(), p.is_dir()
        except OSError as e:  # e.g. a parent this user may not search
            bad(key, f"run directory {run_dir} cannot be checked ({e.strerror or e} on {p})")
        if exists:
            if not is_dir:
                what = "is an existing file" if p == run_dir else f"is inside {p}, an existing file"
                bad(key, f"run directory {run_dir} {what}, not a directory")
            return


def to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
