"""sharding/planner/does_not_fit.py: the one line that says what a model needs, what the cluster has and what would fit."""

from __future__ import annotations

import logging

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from sharding.planner.does_not_fit import ModelDoesNotFitError, fit_message
from sharding.planner.job_topology import torchrec_topology
from sharding.topology.topology_file import load_topology
from tests.support.plan_models import meta_ebc

logging.disable(logging.WARNING)
MIB = 1024**2
SHARDERS = [EmbeddingBagCollectionSharder()]


def _model():
    """1M x 64 and 1000 x 16 fp32 tables with row-wise Adagrad (one float of state per row):
    t_0 1e6 x (64 + 1) x 4 = 260,000,000 B (247.96 MiB), t_1 1000 x 17 x 4 = 68,000 B (66.41 KiB)."""
    model = meta_ebc([(1_000_000, 64), (1000, 16)])
    apply_optimizer_in_backward(RowWiseAdagrad, model.parameters(), {"lr": 0.01})
    return model


def test_the_error_is_torchrecs_insufficient_storage():
    err = ModelDoesNotFitError("the line")
    assert isinstance(err, PlannerError) and err.error_type == PlannerErrorType.INSUFFICIENT_STORAGE
    assert str(err) == "the line"


def test_a_model_larger_than_the_cluster_gets_the_ranks_it_would_need():
    cluster = load_topology("cpu-gloo")
    # 100 MiB of host memory per rank, 200 MiB per host. A rank brings 85% of its 100 MiB (torchrec's
    # reserve): 260,068,000 / (0.85 x 104,857,600) = 2.92 -> 3 ranks, 2 hosts of 2
    topology = torchrec_topology(cluster, ddr_bytes=100 * MIB)
    assert fit_message(cluster, _model(), topology, PlannerError("no room\nthe rest"), SHARDERS) == (
        "model does not fit cpu-gloo (2 ranks, 1 host): embeddings need 248.02 MiB (weights + optimizer state), "
        "available 0.00 KiB HBM per device (0.00 KiB in all) and 200.00 MiB host memory per host (200.00 MiB in all); "
        "largest tables: t_0 247.96 MiB, t_1 66.41 KiB; to fit: about 3 ranks (2 hosts like these), "
        "or smaller embedding_dim / fewer rows for the largest tables; planner said: no room"
    )


def test_a_model_the_cluster_could_hold_is_told_which_kernels_and_types_to_allow():
    cluster = load_topology("cpu-gloo")
    line = fit_message(cluster, _model(), torchrec_topology(cluster, ddr_bytes=1024 * MIB), PlannerError("partition"), SHARDERS)
    assert line.endswith(
        "2.00 GiB host memory per host (2.00 GiB in all); largest tables: t_0 247.96 MiB, t_1 66.41 KiB; "
        "to fit: allow fused_uvm_caching / fused_uvm and row_wise sharding for the largest tables, or smaller embedding_dim for them; "
        "planner said: partition"
    )


def test_hbm_below_torchrecs_reserve_asks_for_more_hbm_per_rank():
    cluster = load_topology("dgx-a100")
    topology = torchrec_topology(cluster, hbm_bytes=MIB)
    line = fit_message(cluster, _model(), topology, PlannerError("negative available hbm storage on rank 0"), SHARDERS)
    assert line.startswith(
        "model does not fit dgx-a100 (8 ranks, 1 host): embeddings need 248.02 MiB (weights + optimizer state), "
        "available 1.00 MiB HBM per device (8.00 MiB in all) and 2,048.00 GiB host memory per host (2,048.00 GiB in all); "
    )
    assert line.endswith(
        "to fit: more HBM per rank (each rank's 1.00 MiB is less than what torchrec reserves before placing any table: "
        "15% of it, the dense modules and the input buffers); planner said: negative available hbm storage on rank 0"
    )
