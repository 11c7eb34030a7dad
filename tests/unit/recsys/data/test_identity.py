"""What data a checkpoint records, and the one line a resume on other data stops with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from recsys.data.identity import SYNTHETIC_FIELDS, describe_data_change, shard_identity, synthetic_identity

MANIFEST = {
    "kind": "criteo",
    "num_rows": 300,
    "cache_key": {
        "files": [
            {"path": "/d/day_0.tsv", "size": 1000, "head_sha256": "h0", "tail_sha256": "t0"},
            {"path": "/d/day_1.tsv", "size": 2000, "head_sha256": "h1", "tail_sha256": "t1"},
        ],
        "options": {"kind": "criteo", "pad_short_rows": True, "rows_per_shard": 64, "max_bad_fraction": 0.01, "parser_version": 1},
    },
    "sources": [
        {"path": "/d/day_0.tsv", "good_rows": 100, "sha256": "s0"},
        {"path": "/d/day_1.tsv", "good_rows": 200},  # a cache built before whole-file hashes
    ],
}


def test_synthetic_identity_is_every_generator_setting():
    cfg = SimpleNamespace(**{f: i for i, f in enumerate(SYNTHETIC_FIELDS)}, path="ignored")
    assert synthetic_identity(cfg) == {"source": "synthetic", **{f: i for i, f in enumerate(SYNTHETIC_FIELDS)}}


def test_shard_identity_is_the_content_not_the_location():
    ident = shard_identity(MANIFEST, 0.1)
    assert ident == {
        "source": "criteo",
        "files": [
            {"name": "day_0.tsv", "bytes": 1000, "rows": 100, "sha256": "s0", "head_tail": "h0 t0"},
            {"name": "day_1.tsv", "bytes": 2000, "rows": 200, "sha256": None, "head_tail": "h1 t1"},
        ],
        "options": {"kind": "criteo", "pad_short_rows": True, "parser_version": 1},  # only what changes rows
        "rows": 300,
        "eval_fraction": 0.1,
    }
    moved = {**MANIFEST, "sources": [{**s, "path": s["path"].replace("/d/", "/elsewhere/")} for s in MANIFEST["sources"]]}
    moved["cache_key"] = {
        **MANIFEST["cache_key"],
        "files": [{**f, "path": f["path"].replace("/d/", "/elsewhere/")} for f in MANIFEST["cache_key"]["files"]],
    }
    assert describe_data_change(ident, shard_identity(moved, 0.1)) is None
    other_shards = {
        **MANIFEST,
        "cache_key": {**MANIFEST["cache_key"], "options": {**MANIFEST["cache_key"]["options"], "rows_per_shard": 8}},
    }
    assert describe_data_change(ident, shard_identity(other_shards, 0.1)) is None


def _files(*specs) -> list[dict]:
    return [{"name": n, "bytes": b, "rows": r, "sha256": s, "head_tail": ht} for n, b, r, s, ht in specs]


BASE = {"source": "criteo", "files": _files(("a.tsv", 10, 5, "s", "h t")), "options": {"kind": "criteo"}, "rows": 5, "eval_fraction": 0.1}


@pytest.mark.parametrize(
    "change,why",
    [
        ({}, None),
        ({"source": "avazu"}, "data.source criteo -> avazu"),
        ({"files": _files(("b.tsv", 10, 5, "s", "h t"))}, "the input a.tsv -> b.tsv"),
        ({"files": _files(("a.tsv", 12, 6, "s", "h t"))}, "a.tsv: 5 rows, 10 bytes -> 6 rows, 12 bytes"),
        ({"files": _files(("a.tsv", 10, 5, "x", "h t"))}, "a.tsv: other content, same size"),
        ({"files": _files(("a.tsv", 10, 5, None, "h t"))}, None),  # no whole-file hash: head and tail decide
        ({"files": _files(("a.tsv", 10, 5, None, "h t2"))}, "a.tsv: other content, same size"),
        (
            {"files": _files(("a.tsv", 10, 5, "s", "h t"), ("b.tsv", 1, 1, "s", "h t"))},
            "1 file -> 2 files (a.tsv -> a.tsv, b.tsv)",
        ),
        (
            {"options": {"kind": "criteo", "pad_short_rows": False}},
            "parse options {'kind': 'criteo'} -> {'kind': 'criteo', 'pad_short_rows': False}",
        ),
        ({"eval_fraction": 0.2}, "data.eval_fraction 0.1 -> 0.2"),
        ({"rows": 6}, "rows 5 -> 6"),
    ],
)
def test_describe_data_change_names_the_first_difference(change, why):
    assert describe_data_change(BASE, {**BASE, **change}) == why


def test_two_differences_are_both_named_and_many_files_are_cut_short():
    new = {**BASE, "files": _files(("a.tsv", 10, 5, "t", "h t")), "eval_fraction": 0.5}
    assert describe_data_change(BASE, new) == "a.tsv: other content, same size; data.eval_fraction 0.1 -> 0.5"
    many = {**BASE, "files": _files(*[(f"p{i}", 1, 1, "s", "") for i in range(5)])}
    assert describe_data_change(BASE, many) == "1 file -> 5 files (a.tsv -> p0, p1, p2 and 2 more)"
    second = {**BASE, "files": _files(("a.tsv", 10, 5, "s", "h t"), ("b.tsv", 1, 1, "s", ""))}
    changed = {**BASE, "files": _files(("a.tsv", 10, 5, "s", "h t"), ("c.tsv", 1, 1, "s", ""))}
    assert describe_data_change(second, changed) == "input 2 of 2 b.tsv -> c.tsv"


def test_generated_data_names_every_changed_setting():
    old = {"source": "synthetic", **{f: 1 for f in SYNTHETIC_FIELDS}}
    new = {**old, "seed": 2, "train_rows": 9}
    assert describe_data_change(old, new) == "data.seed 1 -> 2, data.train_rows 1 -> 9"
    assert describe_data_change(old, dict(old)) is None
