"""Reading a config: YAML files (duplicate keys refused), `key=value` overrides and the
environment variables that set keys, each value checked against its dataclass field's type."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from recsys.config.checks import validate
from recsys.config.schema import ConfigError, ExperimentConfig


def _type_name(tp: Any) -> str:
    """A type as the error lines say it: "a string or a list of integers", not "Union"."""
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false", type(None): "null"}
    if tp in words:
        return words[tp]
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is list:
        return f"a list of {_plural(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _plural(tp: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers", bool: "true/false values"}.get(tp) or _type_name(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                if isinstance(value, list) and typing.get_origin(option) is list:
                    raise e from None  # a list with a bad item: the item's own line, e.g. key[3]
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, allowed))}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {_plural(item_tp)}, got {value!r}")
        # "key 'model.dnn'" -> "key 'model.dnn[1]'": the index inside the quoted key
        item = (lambda i: f"{where[:-1]}[{i}]'") if where.endswith("'") else (lambda i: f"{where}[{i}]")
        return [_coerce(v, item_tp, item(i)) for i, v in enumerate(value)]
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
    apply_environment(cfg)
    validate(cfg, str(path) if path is not None else "config")
    return cfg


# Environment variables that set a config key. They win over the file and the overrides, because
# they are how a launcher or an operator changes one run without editing its command line (e.g.
# `RECSYS_RESUME=1` on every host of a hierarchical job). They are read here, when the config is
# loaded, so the training code sees one resolved config and the run's config.yaml records them.
ENVIRONMENT_KEYS: dict[str, str] = {
    "RECSYS_RESUME": "resume",  # 1: resume=true (0: false)
    "RECSYS_MERGE_ROUTE": "train.merge_route",
    "RECSYS_PG_TIMEOUT_S": "train.pg_timeout_s",
}


def apply_environment(cfg: ExperimentConfig, environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """Applies ENVIRONMENT_KEYS from `environ` (default os.environ); returns the keys it set.
    An unset or empty variable leaves its key alone; a bad value is a ConfigError naming it."""
    environ = os.environ if environ is None else environ
    applied = []
    for var, key in ENVIRONMENT_KEYS.items():
        raw = environ.get(var, "")
        if raw == "":
            continue
        _, value = parse_override(f"{key}={raw}")
        if key == "resume" and value in (0, 1) and not isinstance(value, bool):
            value = bool(value)
        _apply(cfg, _nest(key, value), f"environment {var}={raw}")
        applied.append(key)
    return applied


def to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
