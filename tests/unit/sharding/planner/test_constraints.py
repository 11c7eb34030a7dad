"""sharding/planner/constraints.py: the planner's default constraints per table and their per-table merge with a user's."""

from __future__ import annotations

from torchrec.distributed.planner import ParameterConstraints

from sharding.constants import MODEL_PARALLEL_TYPES
from sharding.planner.constraints import default_constraints, merge_constraints
from tests.support.plan_models import meta_ebc

MODEL = meta_ebc([(100, 16), (200, 8)])
GPU_KERNELS = ["fused", "fused_uvm", "fused_uvm_caching"]


def _fields(constraints: dict[str, ParameterConstraints]) -> dict[str, tuple]:
    return {name: (c.sharding_types, c.compute_kernels) for name, c in constraints.items()}


def test_defaults_per_table_on_cpu_and_cuda():
    assert _fields(default_constraints(MODEL, "cpu")) == {
        "t_0": (list(MODEL_PARALLEL_TYPES), ["fused"]),
        "t_1": (list(MODEL_PARALLEL_TYPES), ["fused"]),
    }
    assert _fields(default_constraints(MODEL, "cuda", ["table_wise"])) == {
        "t_0": (["table_wise"], GPU_KERNELS),
        "t_1": (["table_wise"], GPU_KERNELS),
    }


def test_data_parallel_adds_the_dense_kernel_and_key_value_only_the_named_tables_on_cuda():
    got = default_constraints(MODEL, "cuda", ["table_wise", "data_parallel"], key_value_tables=["t_1"])
    assert _fields(got) == {
        "t_0": (["table_wise", "data_parallel"], GPU_KERNELS + ["dense"]),
        "t_1": (["table_wise", "data_parallel"], GPU_KERNELS + ["dense", "key_value"]),
    }
    # FBGEMM's SSD kernels are CUDA only: a CPU plan never offers them
    assert _fields(default_constraints(MODEL, "cpu", ["table_wise"], key_value_tables=["t_1"]))["t_1"] == (["table_wise"], ["fused"])


def test_a_users_constraint_keeps_the_defaults_it_leaves_open_and_touches_no_other_table():
    defaults = default_constraints(MODEL, "cuda")
    user = {"t_0": ParameterConstraints(sharding_types=["column_wise"], pooling_factors=[3.0])}
    merged = merge_constraints(defaults, user)
    assert (merged["t_0"].sharding_types, merged["t_0"].compute_kernels, merged["t_0"].pooling_factors) == (
        ["column_wise"],
        GPU_KERNELS,
        [3.0],
    )
    assert _fields({"t_1": merged["t_1"]}) == {"t_1": (list(MODEL_PARALLEL_TYPES), GPU_KERNELS)}
    # copies: neither the user's nor the defaults' objects change, nor are they shared
    assert user["t_0"].compute_kernels is None
    assert merged["t_1"] is not defaults["t_1"] and merged["t_0"] is not user["t_0"]


def test_data_parallel_asked_with_kernels_left_open_gets_the_dense_kernel():
    merged = merge_constraints(default_constraints(MODEL, "cpu"), {"t_1": ParameterConstraints(sharding_types=["data_parallel"])})
    assert _fields(merged)["t_1"] == (["data_parallel"], ["fused", "dense"])
    # kernels the user names are theirs, dense or not
    named = merge_constraints(
        default_constraints(MODEL, "cpu"), {"t_1": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["fused"])}
    )
    assert _fields(named)["t_1"] == (["data_parallel"], ["fused"])


def test_a_constraint_on_a_table_without_defaults_is_kept_as_given():
    merged = merge_constraints({}, {"t_9": ParameterConstraints(sharding_types=["row_wise"])})
    assert _fields(merged) == {"t_9": (["row_wise"], None)}
    assert merge_constraints(default_constraints(MODEL, "cpu"), None) == default_constraints(MODEL, "cpu")
