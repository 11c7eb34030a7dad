"""Impossible values, checked before any process starts: the Literal-typed keys of a config
built in Python, then each section's own checks (a check sits with the section of the key it
names, and may read other sections where the value depends on them)."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Callable, Literal, NoReturn

from recsys.config.schema import CARDINALITY_PRESETS, ConfigError, ExperimentConfig, cardinalities, effective_l2_scope
from recsys.extras import missing_extra


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


Bad = Callable[[str, str], NoReturn]  # (dotted key, why) -> raises ConfigError


def validate(cfg: ExperimentConfig, source: str = "config") -> None:
    """Impossible values, checked before any process starts; the first one found is a
    ConfigError naming `source` and the key."""

    def bad(key: str, why: str) -> NoReturn:
        raise ConfigError(f"{source}: key '{key}': {why}")

    for key, value, allowed in _literal_fields(cfg):
        if value not in allowed:
            bad(key, f"expected one of {', '.join(allowed)}, got {value!r}")
    for check in SECTION_CHECKS:
        check(cfg, bad)
    _check_run_dir(cfg, bad)


def _world_size(cfg: ExperimentConfig) -> int:
    """Under torchrun the world size is known; before launch it is nproc_per_node (one node)."""
    return int(os.environ.get("WORLD_SIZE", cfg.train.nproc_per_node))


def check_model(cfg: ExperimentConfig, bad: Bad) -> None:
    m = cfg.model
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


def check_data(cfg: ExperimentConfig, bad: Bad) -> None:
    d, t = cfg.data, cfg.train
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
        world = _world_size(cfg)
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


def check_optim(cfg: ExperimentConfig, bad: Bad) -> None:
    o, t = cfg.optim, cfg.train
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


def check_train(cfg: ExperimentConfig, bad: Bad) -> None:
    t = cfg.train
    if t.nproc_per_node <= 0:
        bad("train.nproc_per_node", "must be positive")
    if t.batch_size <= 0:
        bad("train.batch_size", "must be positive")
    world = _world_size(cfg)
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
    if t.merge_outer != "average" and t.merge_every == 0:
        bad("train.merge_outer", "only meaningful with train.merge_every > 0")
    if t.merge_compress != "none" and t.merge_every == 0:
        bad("train.merge_compress", "only meaningful with train.merge_every > 0")
    if not t.merge_outer_lr > 0:
        bad("train.merge_outer_lr", f"{t.merge_outer_lr} must be positive (1 with momentum 0: plain averaging)")
    if not 0 <= t.merge_outer_momentum < 1:
        bad("train.merge_outer_momentum", f"{t.merge_outer_momentum} must be in [0, 1)")
    if t.pg_timeout_s <= 0:
        bad("train.pg_timeout_s", "must be positive")
    if t.hosts > 1 and "WORLD_SIZE" in os.environ and world % t.hosts:
        bad("train.hosts", f"the world size {world} is not divisible by {t.hosts} hosts")


SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")


def check_sharding(cfg: ExperimentConfig, bad: Bad) -> None:
    s = cfg.sharding
    if not 0.0 < s.target_hit_rate <= 1.0:
        bad("sharding.target_hit_rate", f"{s.target_hit_rate} is not in (0, 1]")
    if cfg.train.merge_every > 0 and "table_row_wise" in s.sharding_types:
        bad("sharding.sharding_types", "table_row_wise is not supported with train.merge_every > 0 (DMP runs on one host's group)")
    for st in s.sharding_types:
        if st not in SHARDING_TYPES:
            bad("sharding.sharding_types", f"unknown sharding type '{st}' (choose from {', '.join(SHARDING_TYPES)})")
    if cfg.plan and not Path(cfg.plan).is_file():
        bad("plan", f"no such plan file {cfg.plan}")


def check_checkpoint(cfg: ExperimentConfig, bad: Bad) -> None:
    c = cfg.checkpoint
    if c.keep <= 0:
        bad("checkpoint.keep", "must be positive")
    if c.every_steps < 0:
        bad("checkpoint.every_steps", "must be >= 0 (0: only at the end)")


SECTION_CHECKS: tuple[Callable[[ExperimentConfig, Bad], None], ...] = (
    check_model,
    check_data,
    check_optim,
    check_train,
    check_sharding,
    check_checkpoint,
)


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


def _check_run_dir(cfg: ExperimentConfig, bad: Bad) -> None:
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
