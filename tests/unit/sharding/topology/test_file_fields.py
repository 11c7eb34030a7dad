"""The typed field readers of a topology file (sharding/topology/file_fields.py): what each accepts,
and the one-line message, naming the file and the key, for what it refuses."""

from __future__ import annotations

import math
import re

import pytest

from sharding.topology.cluster import TopologyError
from sharding.topology.file_fields import _choice, _Ctx, _fmt, _int, _list, _mapping, _number, _str

CTX = _Ctx("dgx.yaml")


def test_fail_names_the_file_and_the_key():
    assert str(CTX.fail("hosts[0].gpus", "bad")) == "dgx.yaml: key 'hosts[0].gpus': bad"
    assert str(CTX.fail("", "bad")) == "dgx.yaml: bad"  # the file as a whole
    assert isinstance(CTX.fail("k", "m"), ValueError)  # TopologyError is a ValueError callers may catch


def test_fmt_cuts_long_values_to_60_characters():
    assert _fmt("abc") == "'abc'"
    long = _fmt(list(range(100)))
    assert len(long) == 60 and long.endswith("...") and long.startswith("[0, 1, 2,")


def test_mapping_checks_required_and_unknown_keys():
    d = {"a": 1, "b": 2}
    assert _mapping(CTX, "x", d, ["a"], ["b", "c"]) is d
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'x\.c': missing required key$"):
        _mapping(CTX, "x", d, ["a", "c"], ["b"])
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'x\.hbm_gbb': unknown key \(did you mean 'x\.hbm_gb'\?\)$"):
        _mapping(CTX, "x", {"hbm_gbb": 1}, [], ["hbm_gb"])
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'zzz': unknown key \(known: hosts, name\)$"):
        _mapping(CTX, "", {"zzz": 1}, ["hosts"], ["name"])  # top level: no prefix
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'x': expected a mapping, got \[1, 2\]$"):
        _mapping(CTX, "x", [1, 2], [], [])


def test_list():
    assert _list(CTX, "k", [1]) == [1]
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'k': expected a list, got \{'a': 1\}$"):
        _list(CTX, "k", {"a": 1})


@pytest.mark.parametrize("value", [0, -1, True, "3", None, math.inf, math.nan])
def test_number_refuses_what_is_not_a_positive_finite_number(value):
    expected = "dgx.yaml: key 'bw': expected a positive number, got " + repr(value)
    with pytest.raises(TopologyError, match="^" + re.escape(expected) + "$"):
        _number(CTX, "bw", value)


def test_number_returns_a_float_and_may_allow_zero():
    assert _number(CTX, "bw", 25) == 25.0 and type(_number(CTX, "bw", 25)) is float
    assert _number(CTX, "lat", 0, positive=False) == 0.0
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'lat': expected a non-negative number, got -1$"):
        _number(CTX, "lat", -1, positive=False)


def test_int_refuses_bools_floats_and_values_under_the_minimum():
    assert _int(CTX, "n", 0) == 0 and _int(CTX, "n", 3, minimum=1) == 3
    for value in (True, 1.0, -1):
        with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'n': expected an integer >= 0, got "):
            _int(CTX, "n", value)
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'n': expected an integer >= 1, got 0$"):
        _int(CTX, "n", 0, minimum=1)


def test_str_and_choice():
    assert _str(CTX, "name", "h") == "h"
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'name': expected a non-empty string, got ''$"):
        _str(CTX, "name", "")
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'name': expected a non-empty string, got 7$"):
        _str(CTX, "name", 7)
    assert _choice(CTX, "kind", "cpu", ("cuda", "cpu")) == "cpu"
    with pytest.raises(TopologyError, match=r"^dgx\.yaml: key 'kind': expected one of cuda, cpu, got None$"):
        _choice(CTX, "kind", None, ("cuda", "cpu"))
