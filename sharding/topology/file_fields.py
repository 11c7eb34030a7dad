"""Typed readers for the fields of a topology file: each takes the file's context and the key it
reads, and a wrong type, a missing or unknown key, or an impossible value raises a one-line
``TopologyError`` naming the file and the key (with the closest known key for a misspelt one).
Apart from the readers of the file's sections, which all share them."""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

from sharding.topology.cluster import TopologyError


class _Ctx:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, msg: str) -> TopologyError:
        return TopologyError(f"{self.source}: key '{key}': {msg}" if key else f"{self.source}: {msg}")


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapping(ctx: _Ctx, key: str, value: Any, required: Iterable[str], optional: Iterable[str]) -> dict:
    required, optional = list(required), list(optional)
    if not isinstance(value, dict):
        raise ctx.fail(key, f"expected a mapping, got {_fmt(value)}")
    names = required + optional
    for k in value:
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean '{_join(key, close[0])}'?)" if close else f" (known: {', '.join(names)})"
            raise ctx.fail(_join(key, str(k)), f"unknown key{hint}")
    for k in required:
        if k not in value:
            raise ctx.fail(_join(key, k), "missing required key")
    return value


def _join(prefix: str, k: str) -> str:
    return f"{prefix}.{k}" if prefix else k


def _list(ctx: _Ctx, key: str, value: Any) -> list:
    if not isinstance(value, list):
        raise ctx.fail(key, f"expected a list, got {_fmt(value)}")
    return value


def _number(ctx: _Ctx, key: str, value: Any, *, positive: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        what = "a positive number" if positive else "a non-negative number"
        raise ctx.fail(key, f"expected {what}, got {_fmt(value)}")
    return float(value)


def _int(ctx: _Ctx, key: str, value: Any, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ctx.fail(key, f"expected an integer >= {minimum}, got {_fmt(value)}")
    return value


def _str(ctx: _Ctx, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ctx.fail(key, f"expected a non-empty string, got {_fmt(value)}")
    return value


def _choice(ctx: _Ctx, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ctx.fail(key, f"expected one of {', '.join(choices)}, got {_fmt(value)}")
    return value
