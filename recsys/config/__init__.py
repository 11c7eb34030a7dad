"""Experiment configuration: typed dataclasses, YAML files and `key=value` overrides.

Every problem with a config (unknown key, wrong type, impossible value, missing file, a bad
environment override) is a `ConfigError` with a one-line message naming the file and the dotted
key, raised before any process group starts, so a typo never costs a cluster allocation.

- `schema.py`: the sections as dataclasses, string options as Literal types, table-size presets;
- `loading.py`: YAML, overrides and environment variables into the schema (`load_config`);
- `checks.py`: impossible values, one check function per section (`validate`).
"""

from recsys.config.checks import SECTION_CHECKS, check_training_extras, validate
from recsys.config.loading import ENVIRONMENT_KEYS, apply_environment, dump, load_config, parse_override, to_dict
from recsys.config.schema import (
    AUTO_L2_SCOPE,
    CARDINALITY_PRESETS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DataSource,
    EmbeddingOptimizer,
    ExperimentConfig,
    ModelConfig,
    ModelName,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
    cardinalities,
    effective_l2_scope,
)

__all__ = [
    "AUTO_L2_SCOPE",
    "CARDINALITY_PRESETS",
    "ENVIRONMENT_KEYS",
    "SECTION_CHECKS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "EmbeddingOptimizer",
    "ExperimentConfig",
    "ModelConfig",
    "ModelName",
    "OptimConfig",
    "ShardingConfig",
    "TrainConfig",
    "apply_environment",
    "cardinalities",
    "check_training_extras",
    "dump",
    "effective_l2_scope",
    "load_config",
    "parse_override",
    "to_dict",
    "validate",
]
