"""sharding/plan/report.py: bytes per shard, table and rank counted by hand for each kernel and
sharding type, the text report's lines for a 2-table plan, and plan diffs."""

from __future__ import annotations

import copy

from sharding.plan import report as plan_report
from sharding.plan.file_format import plan_from_dict

MiB = 2**20
ADAM = {"kind": "adam", "bytes_per_weight": 8, "bytes_per_row": 0}
ROWWISE = {"kind": "rowwise_adagrad", "bytes_per_weight": 0, "bytes_per_row": 4}


def _param(sharding_type: str, kernel: str, shards: list[tuple[int, int, int, int, int]], device: str, load_factor=None) -> dict:
    """shards: (rank, row offset, col offset, rows, cols)."""
    return {
        "sharding_type": sharding_type,
        "compute_kernel": kernel,
        "ranks": [s[0] for s in shards],
        "shards": [{"offsets": [r0, c0], "sizes": [n, c], "placement": f"rank:{rank}/{device}"} for rank, r0, c0, n, c in shards],
        "cache_params": None if load_factor is None else {"load_factor": load_factor},
    }


def _plan(params: dict, tables: dict, device: str = "cuda", world: int = 2, meta: dict | None = None):
    d = {
        "format": "recsys-sharding-plan",
        "version": 2,
        "world_size": world,
        "compute_device": device,
        "tables": tables,
        "modules": {"m": {"type": "EmbeddingModuleShardingPlan", "params": params}},
        "meta": meta or {},
    }
    return plan_from_dict(d)


def _table(rows: int, cols: int, state: dict | None, data_type: str = "FP32") -> dict:
    return {"num_embeddings": rows, "embedding_dim": cols, "data_type": data_type, "optimizer_state": state}


def _two_tables():
    """'big': 65536 x 16 with Adam in HBM on rank 0; 'cached': 32768 x 32 with row-wise Adagrad in
    host memory on rank 1, half its weights cached in HBM."""
    return _plan(
        {
            "big": _param("table_wise", "fused", [(0, 0, 0, 65536, 16)], "cuda"),
            "cached": _param("table_wise", "fused_uvm_caching", [(1, 0, 0, 32768, 32)], "cuda", load_factor=0.5),
        },
        {"big": _table(65536, 16, ADAM), "cached": _table(32768, 32, ROWWISE)},
    )


def test_two_table_bytes_by_hand():
    rep = plan_report.report(*_two_tables())
    big, cached = rep["tables"]
    # big: 4 MiB of fp32 weights + 8 MiB of Adam moments, all in HBM
    assert (big["hbm_bytes"], big["host_bytes"], big["ssd_bytes"]) == (65536 * 16 * 4 + 65536 * 16 * 8, 0, 0) == (12 * MiB, 0, 0)
    # cached: weights + one float per row in host memory; an HBM cache of half the weights
    assert (
        (cached["hbm_bytes"], cached["host_bytes"]) == (32768 * 32 * 4 // 2, 32768 * 32 * 4 + 32768 * 4) == (2 * MiB, 4 * MiB + 128 * 1024)
    )
    assert (big["optimizer"], cached["optimizer"], cached["cache_load_factor"]) == ("adam", "rowwise_adagrad", 0.5)
    assert (big["shape"], cached["shape"]) == ((65536, 16), (32768, 32))
    assert rep["ranks"] == [
        {"rank": 0, "hbm_bytes": 12 * MiB, "host_bytes": 0, "ssd_bytes": 0, "tables": 1},
        {"rank": 1, "hbm_bytes": 2 * MiB, "host_bytes": 4 * MiB + 128 * 1024, "ssd_bytes": 0, "tables": 1},
    ]
    assert rep["optimizer_unknown"] == [] and (rep["world_size"], rep["compute_device"]) == (2, "cuda")


def test_text_report_of_a_two_table_plan():
    lines = plan_report.format_text(plan_report.report(*_two_tables())).splitlines()
    assert lines[0] == "plan for 2 ranks (cuda)"
    tables = {line.split()[0]: line.split() for line in lines[3:5]}
    assert tables["big"] == ["big", "m", "table_wise", "fused", "adam", "0", "12.0", "MB", "0.0", "MB"]
    assert tables["cached"] == ["cached", "m", "table_wise", "fused_uvm_caching", "rowwise_adagrad", "1", "0.50", "2.0", "MB", "4.1", "MB"]
    assert lines[6:] == [
        "rank   tables          HBM         host",
        "0           1      12.0 MB       0.0 MB",
        "1           1       2.0 MB       4.1 MB",
        "largest: rank 0 with 12.0 MB of HBM",
    ]


def test_row_wise_shards_each_keep_their_rows_state():
    plan, header = _plan(
        {"t": _param("row_wise", "fused", [(0, 0, 0, 600, 16), (1, 600, 0, 400, 16)], "cpu")},
        {"t": _table(1000, 16, ROWWISE)},
        device="cpu",
    )
    (info,) = plan_report.table_infos(plan, header)
    # CPU ranks: everything in host memory; weights + 4 B per row of the shard
    assert [(s.rank, s.rows, s.cols, s.hbm_bytes, s.host_bytes) for s in info.shards] == [
        (0, 600, 16, 0, 600 * 16 * 4 + 600 * 4),
        (1, 400, 16, 0, 400 * 16 * 4 + 400 * 4),
    ]
    assert info.shape == (1000, 16)


def test_column_wise_shards_each_keep_a_copy_of_the_row_state():
    plan, header = _plan(
        {"t": _param("column_wise", "fused", [(0, 0, 0, 100, 8), (1, 0, 8, 100, 8)], "cuda")},
        {"t": _table(100, 16, ROWWISE)},
    )
    (info,) = plan_report.table_infos(plan, header)
    assert [s.hbm_bytes for s in info.shards] == [100 * 8 * 4 + 100 * 4] * 2
    assert info.hbm_bytes == 2 * 3600 and info.shape == (100, 16)


def test_a_data_parallel_table_is_a_replica_on_every_rank():
    d_param = {"sharding_type": "data_parallel", "compute_kernel": "dense", "ranks": [0, 1, 2], "shards": None}
    plan, header = _plan({"t": d_param}, {"t": _table(10, 4, ADAM, "FP16")}, world=3)
    rep = plan_report.report(plan, header)
    assert [r["hbm_bytes"] for r in rep["ranks"]] == [10 * 4 * 2 + 10 * 4 * 8] * 3  # fp16 weights, fp32 moments
    assert rep["tables"][0]["shape"] == (10, 4)


def test_an_unrecorded_optimizer_counts_weights_only_and_says_so():
    plan, header = _plan(
        {
            "a": _param("table_wise", "fused", [(0, 0, 0, 1000, 16)], "cuda"),
            "b": _param("table_wise", "fused", [(1, 0, 0, 1000, 16)], "cuda"),
        },
        {"a": _table(1000, 16, None), "b": _table(1000, 16, ADAM)},
    )
    rep = plan_report.report(plan, header)
    assert rep["optimizer_unknown"] == ["a"] and rep["tables"][0]["optimizer"] == "unknown"
    assert rep["tables"][0]["hbm_bytes"] == 1000 * 16 * 4
    assert plan_report.format_text(rep).splitlines()[1] == (
        "optimizer state: not recorded for 1 of 2 tables (optimizer 'unknown'): their memory counts weights only, "
        "a lower bound (save the plan with the model, sharding.plan.io.save_plan(..., model=...))"
    )


def test_key_value_tables_live_on_ssd_with_an_hbm_cache():
    plan, header = _plan(
        {
            "kv": _param("table_wise", "key_value", [(1, 0, 0, 1000, 16)], "cuda"),
            "f": _param("table_wise", "fused_uvm", [(0, 0, 0, 10, 4)], "cuda"),
        },
        {"kv": _table(1000, 16, ADAM), "f": _table(10, 4, None)},
    )
    rep = plan_report.report(plan, header)
    kv, f = rep["tables"]
    weights = 1000 * 16 * 4
    assert (kv["hbm_bytes"], kv["host_bytes"], kv["ssd_bytes"]) == (int(weights * 0.2), 0, weights * 3)  # torchrec's default 0.2 cache
    assert (f["hbm_bytes"], f["host_bytes"], f["ssd_bytes"]) == (0, 160, 0)  # fused_uvm: host memory only
    assert plan_report.has_ssd(rep)
    text = plan_report.format_text(rep).splitlines()
    assert text[-5:-2] == [
        "rank   tables          HBM         host             SSD",
        "0           1       0.0 MB       0.0 MB          0.0 MB",
        "1           1       0.0 MB       0.0 MB          0.2 MB",
    ]
    assert text[-1] == "largest SSD: rank 1 with 0.2 MB (key_value tables: FBGEMM's SSD kernels, CUDA only)"


def test_diff_names_moved_tables_changed_setups_and_memory_deltas():
    a_plan, a_header = _two_tables()
    b_dict_params = {
        "big": _param("table_wise", "fused", [(1, 0, 0, 65536, 16)], "cuda"),
        "cached": _param("table_wise", "fused", [(1, 0, 0, 32768, 32)], "cuda"),
        "new": _param("table_wise", "fused", [(0, 0, 0, 8, 8)], "cuda"),
    }
    tables = copy.deepcopy(a_header["tables"]) | {"new": _table(8, 8, None)}
    b_plan, b_header = _plan(b_dict_params, tables, meta={"batch_size_per_rank": 64})
    d = plan_report.diff(a_plan, a_header, b_plan, b_header)
    assert d["plans"] == {"batch_size_per_rank": [None, 64]}
    assert d["changes"] == [
        {"table": "big", "module": "m", "ranks": [[0], [1]]},
        {"table": "cached", "module": "m", "compute_kernel": ["fused_uvm_caching", "fused"], "cache_load_factor": [0.5, None]},
        {"table": "new", "module": "m", "change": "added"},
    ]
    cached_total = 4 * MiB + 128 * 1024
    assert d["ranks"] == [
        {"rank": 0, "hbm_bytes_delta": 256 - 12 * MiB, "host_bytes_delta": 0, "ssd_bytes_delta": 0},
        {"rank": 1, "hbm_bytes_delta": 12 * MiB + cached_total - 2 * MiB, "host_bytes_delta": -cached_total, "ssd_bytes_delta": 0},
    ]
    assert plan_report.format_diff(d).splitlines() == [
        "the plans are for different setups: batch_size_per_rank None -> 64",
        "3 table(s) changed:",
        "  big (m): ranks: [0] -> [1]",
        "  cached (m): compute_kernel: fused_uvm_caching -> fused, cache_load_factor: 0.5 -> None",
        "  new (m): change: added",
        "memory per rank (b - a):",
        "  rank 0: HBM -12.0 MB, host +0.0 MB",
        "  rank 1: HBM +14.1 MB, host -4.1 MB",
    ]


def test_diff_of_a_plan_with_itself_changes_nothing():
    plan, header = _two_tables()
    d = plan_report.diff(plan, header, plan, header)
    assert d["plans"] == {} and d["changes"] == []
    assert plan_report.format_diff(d).splitlines() == [
        "no table changed",
        "memory per rank (b - a):",
        "  rank 0: HBM +0.0 MB, host +0.0 MB",
        "  rank 1: HBM +0.0 MB, host +0.0 MB",
    ]


def test_diff_of_resized_shards_and_another_model():
    a_plan, a_header = _plan(
        {"t": _param("row_wise", "fused", [(0, 0, 0, 50, 4), (1, 50, 0, 50, 4)], "cuda")}, {"t": _table(100, 4, ROWWISE)}
    )
    b_plan, b_header = _plan(
        {"t": _param("row_wise", "fused", [(0, 0, 0, 70, 4), (1, 70, 0, 50, 4)], "cuda")}, {"t": _table(120, 4, ROWWISE)}
    )
    (change,) = plan_report.diff(a_plan, a_header, b_plan, b_header)["changes"]
    assert change == {"table": "t", "module": "m", "shape": ["100 x 4", "120 x 4"], "shards": "resized"}
