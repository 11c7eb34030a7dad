"""Cache sizing from data (sharding/planner/cache_sizing.py): hit-rate curves against independent
computations, sample loading and its errors, and the cost model's use of measured miss rates."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torchrec.distributed.types import CacheParams
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from sharding.planner.cache_sizing import (
    IdFrequencyStats,
    SampleError,
    apply_cache_stats,
    choose_load_factor,
    counts_from_rows,
    load_histogram,
)
from recsys.data.id_histogram import load_sample
from sharding.planner.cost.model import TopologyCostModel
from sharding.planner.cost.placement import PlacedShard
from sharding.topology.topology_file import load_topology


def zipf_histogram(rows: int, a: float, scale: float = 1e6) -> np.ndarray:
    """Counts for every id of a table (no id unseen): floor(scale * r^-a) + 1 for rank r."""
    r = np.arange(1, rows + 1, dtype=np.float64)
    return np.floor(scale * r**-a) + 1


def brute_force_hit(counts, rows: int, lf: float) -> float:
    """Independent: sort the counts in Python, sum the top ceil(lf*rows)."""
    c = sorted((float(x) for x in counts), reverse=True)
    k = math.ceil(lf * rows - 1e-9)
    return sum(c[:k]) / sum(c)


def test_hit_rate_curve_matches_brute_force_on_zipf_histogram():
    rows = 20_000
    counts = zipf_histogram(rows, 1.1)
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(counts)  # any order
    st = IdFrequencyStats(shuffled, rows)
    assert st.missing_mass == 0.0  # every id seen: the histogram's own curve
    grid = [0.0, 0.0001, 0.001, 0.01, 0.05, 0.1, 0.2, 0.37, 0.5, 0.8, 1.0]
    for lf in grid:
        assert st.hit_rate(lf) == pytest.approx(brute_force_hit(counts, rows, lf), abs=1e-12), lf
    assert np.allclose(st.hit_rate(np.array(grid)), [brute_force_hit(counts, rows, x) for x in grid])
    # torchrec CacheStatistics contract: miss rate 1 at clf 0, 0 at clf 1
    assert st.expected_miss_rate(0.0) == 1.0 and st.expected_miss_rate(1.0) == pytest.approx(0.0)
    # skewed: 1% of the rows serve most lookups; uniform: hit rate == load factor
    assert st.hit_rate(0.01) > 0.5
    uni = IdFrequencyStats(np.full(rows, 7), rows)
    for lf in (0.01, 0.3, 0.95):
        assert uni.hit_rate(lf) == pytest.approx(lf, abs=1 / rows)
    assert choose_load_factor(uni, 0.95, 0.8) == 0.8  # capped
    assert choose_load_factor(st, 0.95, 0.8) < 0.5
    lf = choose_load_factor(st, 0.9, 1.0)
    assert st.hit_rate(lf) >= 0.9 and st.hit_rate(lf - 0.01) < 0.9  # smallest on the 0.01 grid


def test_sampled_curve_tracks_the_true_distribution():
    """A sample from the generator (Zipf 1.05) sees only part of a 1M-row table: the Good-Turing
    + power-law tail estimate stays near the true curve instead of jumping to 1.0."""
    from recsys.data.synthetic import CriteoLikeGenerator

    n, a = 1_000_000, 1.05
    gen = CriteoLikeGenerator([n], seed=0, zipf_exponent=a)
    ids = gen.rows(0, 0, 200_000).sparse[:, 0]
    _, counts = np.unique(ids, return_counts=True)
    st = IdFrequencyStats(counts, n)
    assert 0 < st.missing_mass < 1 and 0.7 < st.alpha < 1.3

    def true_hit(lf):  # the generator's continuous power law on [1, n+1), floored to ranks
        k = math.ceil(lf * n)
        return (1 - (k + 1) ** (1 - a)) / (1 - (n + 1) ** (1 - a))

    for lf in (0.01, 0.05, 0.1, 0.3, 0.6):
        assert st.hit_rate(lf) == pytest.approx(true_hit(lf), abs=0.08), lf
    naive = IdFrequencyStats(counts, len(counts))  # the in-sample curve ignores unseen ids
    assert naive.hit_rate(1.0) == 1.0 and st.hit_rate(len(counts) / n) < 0.9


def test_stats_are_shared_by_deepcopy_and_expected_lookups():
    st = IdFrequencyStats([5, 3, 1, 1], 10, batch=4)
    assert copy.deepcopy(CacheParams(load_factor=0.2, stats=st)).stats is st
    st_full = IdFrequencyStats([5, 3, 2], 3, batch=4)
    p = np.array([5, 3, 2]) / 10
    assert st_full.expected_lookups == pytest.approx(float(np.sum(1 - (1 - p) ** 4)))
    assert 0 < st_full.cacheability < 1


def ebc():
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=n, feature_names=[f]) for f, n in (("A", 1000), ("B", 50))]
    tables.append(EmbeddingBagConfig(name="w_A", embedding_dim=2, num_embeddings=1000, feature_names=["A"]))
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def test_load_json_histogram_by_table_and_feature(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(
        json.dumps(
            {
                "format": "recsys-id-histogram",
                "version": 1,
                "tables": {"A": {"counts": [10, 5, 2, 2]}, "t_B": {"counts": [3, 3], "num_embeddings": 50}},
            }
        )
    )
    stats = load_sample(str(f), ebc())
    assert sorted(stats) == ["t_A", "t_B", "w_A"]  # feature A feeds t_A and w_A
    assert stats["t_A"].rows == 1000 and stats["t_B"].rows == 50 and stats["t_A"].total == 19
    g = tmp_path / "plain.json"  # without the wrapper
    g.write_text(json.dumps({"t_B": {"counts": [1, 2, 3]}}))
    assert list(load_sample(str(g), ebc())) == ["t_B"]


@pytest.mark.parametrize(
    "doc,key",
    [
        ({"tables": {"t_A": {"counts": [1, -2]}}}, "tables.t_A.counts[1]"),
        ({"tables": {"t_Z": {"counts": [1]}}}, "t_Z"),
        ({"tables": {"t_A": {"cnts": [1]}}}, "tables.t_A.cnts"),
        ({"tables": {"t_A": {"counts": "1,2"}}}, "tables.t_A.counts"),
        ({"tables": {"t_B": {"counts": [1], "num_embeddings": 7}}}, "tables.t_B.num_embeddings"),
        ({"format": "other", "tables": {}}, "format"),
        ({"tables": {"t_B": {"counts": [1] * 60}}}, "t_B"),  # more distinct ids than rows
    ],
)
def test_bad_sample_is_one_line_naming_file_and_key(tmp_path, doc, key):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(SampleError) as e:
        load_sample(str(f), ebc())
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and f"key '{key}'" in msg, msg


def test_bad_sample_spec_errors(tmp_path):
    f = tmp_path / "trunc.json"
    f.write_text('{"tables": {"t_A": {"counts": [1, 2')
    with pytest.raises(SampleError, match="not JSON"):
        load_sample(str(f), ebc())
    with pytest.raises(SampleError, match="no such file"):
        load_sample(str(tmp_path / "nope.json"), ebc())
    with pytest.raises(SampleError, match="positive row count"):
        load_sample("synthetic:lots", ebc())


def test_counts_from_rows_hash_and_missing():
    sparse = np.array([[5, -1], [15, 3], [7, 3], [25, 53]])
    c = counts_from_rows(sparse, [10, 50], ["A", "B"])
    assert sorted(c["A"].tolist()) == [1, 3]  # 5, 15, 25 -> id 5 (mod 10) three times, 7 once
    assert c["B"].tolist() == [3]


def test_apply_cache_stats_sets_constraints():
    from torchrec.distributed.planner.types import ParameterConstraints

    skew = IdFrequencyStats(zipf_histogram(1000, 1.3), 1000)
    cons = {"t_A": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}
    chosen = apply_cache_stats(cons, {"t_A": skew, "t_B": IdFrequencyStats([4] * 50, 50)}, 0.95, 0.8)
    assert cons["t_A"].cache_params.stats is skew and cons["t_A"].compute_kernels == ["fused_uvm_caching"]
    assert chosen["t_A"] == cons["t_A"].cache_params.load_factor < 0.5 and chosen["t_B"] == 0.8


def test_cost_model_charges_measured_miss_rate():
    topo = load_topology("pcie-8gpu-2socket")
    cm = TopologyCostModel(topo, 512)
    base = dict(
        table="t",
        sharding_type="table_wise",
        kernel="fused_uvm_caching",
        rank=0,
        rows=4_000_000,
        cols=64,
        table_rows=4_000_000,
        table_cols=64,
        load_factor=0.05,
    )
    default = cm.score_shards([PlacedShard(**base)])  # miss = 1 - 0.05
    measured = cm.score_shards([PlacedShard(**base, miss_rate=0.1)])
    assert measured.host_io[0] == pytest.approx(default.host_io[0] * 0.1 / 0.95)
    assert measured.lookup[0] > default.lookup[0]  # the hits are HBM lookups
    assert measured.step_time < default.step_time


def test_synthetic_sample_from_config():
    from recsys.config import cardinalities, load_config
    from sharding.planner.cache_sizing import table_features

    cfg = load_config("configs/experiments/smoke.yaml", [])
    cards = cardinalities(cfg.data)
    module = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_C{i + 1}", embedding_dim=4, num_embeddings=n, feature_names=[f"C{i + 1}"])
            for i, n in enumerate(cards)
        ],
        device=torch.device("meta"),
    )
    stats = load_sample("synthetic:3000", module, cfg, batch=1024)
    assert sorted(stats) == sorted(table_features(module)) and all(s.total == 3000 for s in stats.values())
    big = max(stats, key=lambda t: stats[t].rows)
    assert stats[big].hit_rate(0.05) > 0.05  # Zipf ids: the cache beats its size


def test_histogram_json_round_trip(tmp_path):
    from sharding.planner.cache_sizing import histogram_json

    f = tmp_path / "h.json"
    f.write_text(histogram_json({"t_A": np.array([9, 4, 1]), "B": [2, 2]}, description="test"))
    stats = load_sample(str(f), ebc())
    assert stats["t_A"].total == 14 and stats["t_B"].total == 4


def test_load_histogram_takes_table_features_without_a_module(tmp_path):
    from sharding.planner.cache_sizing import table_features

    f = tmp_path / "h.json"
    f.write_text(json.dumps({"tables": {"A": {"counts": [4, 1]}}}))
    stats = load_histogram(f, table_features(ebc()))
    assert sorted(stats) == ["t_A", "w_A"] and stats["t_A"].total == 5 and stats["w_A"].rows == 1000
    with pytest.raises(SampleError, match="no such file"):
        load_histogram(tmp_path / "nope.json", table_features(ebc()))


class _LinearUpToHalf:
    """torchrec ``CacheStatistics`` of a table whose hit rate is 1.6 x the load factor up to 0.5
    (80% of the lookups), flat after: no id histogram behind it."""

    expected_lookups = 0.0
    cacheability = 0.0

    def expected_miss_rate(self, clf: float) -> float:
        return 1.0 - 1.6 * min(clf, 0.5)


def test_load_factors_of_statistics_without_a_histogram_by_their_miss_rate():
    from sharding.planner.cache_sizing import saturation_load_factor

    st = _LinearUpToHalf()
    # 1.6 x lf >= 0.4: lf = 0.25, the first point of the 0.01 grid there
    assert choose_load_factor(st, 0.4, 0.8) == 0.25
    assert choose_load_factor(st, 0.4, 0.2) == 0.2  # capped
    assert choose_load_factor(st, 0.0, 0.8) == 0.01  # at least MIN_LOAD_FACTOR
    assert choose_load_factor(st, 0.9, 0.8) == 0.8  # never reached: the cap
    # the curve stops rising at 0.5: 1.6 x lf within 1e-3 of a full cache's 0.8 from lf = 0.50 on the grid
    assert saturation_load_factor(st) == 0.5
    # a histogram: half the rows seen, twice each, the rest never: full hit rate at half the rows
    assert saturation_load_factor(IdFrequencyStats([2] * 50, 100)) == 0.5


def test_summary_per_table_hit_rates_target_and_plan():
    from sharding.planner.cache_sizing import summary

    st = IdFrequencyStats([4] * 20 + [2] * 30, 100)  # 50 of 100 rows seen: 80 + 60 = 140 lookups
    got = summary({"t": st}, load_factors={"t": 0.3}, target_hit_rate=0.5)
    # the 20 ids seen 4 times first: 1 row 4/140, 5 rows 20/140, 10 rows 40/140, 20 rows 80/140,
    # 50 rows all; a target of 50%: 18 rows (72/140 = 0.514); 30 rows: 80 + 10 x 2 = 100/140
    assert got == {
        "t": {
            "lookups": 140,
            "distinct_ids": 50,
            "rows": 100,
            "hit_rate_at": {
                "0.01": round(4 / 140, 4),
                "0.05": round(20 / 140, 4),
                "0.1": round(40 / 140, 4),
                "0.2": round(80 / 140, 4),
                "0.5": 1.0,
            },
            "target_load_factor": 0.18,
            "target_hit": round(72 / 140, 4),
            "load_factor": 0.3,
            "hit_rate": round(100 / 140, 4),
        }
    }
    assert summary({"t": st}) == {"t": {k: got["t"][k] for k in ("lookups", "distinct_ids", "rows", "hit_rate_at")}}
