"""sharding/plan/fit_report.py: the does-not-fit line's figures computed by hand for each verdict
(short in all, one table too large for a rank, no placement, HBM below torchrec's reserve)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from sharding.plan import fit_report

KiB = 1024


def _model() -> EmbeddingBagCollection:
    """t_big: 1000 x 8 with CowClip-Adam; t_small: 100 x 8 untagged (FBGEMM's SGD)."""
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t_small", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
            EmbeddingBagConfig(name="t_big", embedding_dim=8, num_embeddings=1000, feature_names=["f1"]),
        ],
        device=torch.device("meta"),
    )
    ebc.embedding_bags["t_big"].weight._optimizer_kwargs = [{"optimizer": "recsys.cowclip_adam"}]
    return ebc


def _topology(hbm: int, ddr: int, world: int = 2, device: str = "cpu"):
    """What the line reads of a torchrec Topology: world size, device, each device's storage."""
    return SimpleNamespace(
        world_size=world, compute_device=device, devices=[SimpleNamespace(storage=SimpleNamespace(hbm=hbm, ddr=ddr)) for _ in range(world)]
    )


BIG = 1000 * 8 * 4 + 1000 * 8 * 8 + 1000 * 8  # fp32 weights, two moments, an int64 step per row: 104,000 B
SMALL = 100 * 8 * 4  # weights only: 3,200 B
LARGEST = "largest tables: t_big 101.56 KiB (1,000 x 8, cowclip_adam), t_small 3.12 KiB (100 x 8, sgd)"


@pytest.mark.parametrize(
    "n, text",
    [(512, "0.50 KiB"), (3 * 1024**2, "3.00 MiB"), (1.5 * 1024**3, "1.50 GiB"), (-2048, "-2.00 KiB"), (1536 * 1024**3, "1,536.00 GiB")],
)
def test_format_bytes(n, text):
    assert fit_report.format_bytes(n) == text


def test_table_bytes_from_plan_file_entries():
    tables = {
        "a": {"num_embeddings": 10, "embedding_dim": 4, "data_type": "FP16", "optimizer_state": {"kind": "adam"}},
        "b": {"num_embeddings": 10, "embedding_dim": 4},  # nothing recorded: FP32, row-wise Adagrad assumed
    }
    assert fit_report.table_bytes(tables) == {"a": 10 * 4 * 2 + 10 * 4 * 8, "b": 10 * 4 * 4 + 10 * 4}


def test_short_in_all_names_need_shortfall_ranks_and_largest_tables():
    msg = fit_report.does_not_fit_message(_model(), _topology(0, 40 * KiB), RuntimeError("Unable to find a plan\nproposal table ..."))
    need, usable = BIG + SMALL, 2 * 40 * KiB * 0.85
    assert (need, usable, need - usable) == (107_200, 69_632, 37_568)
    assert msg == (
        "model does not fit 2 ranks (cpu): embeddings need 104.69 KiB (weights + optimizer state), the ranks hold "
        "0.00 KiB HBM + 40.00 KiB host memory each, 68.00 KiB in all after torchrec's 15% reserve: short by 36.69 KiB; "
        f"{LARGEST}; to fit: about 4 ranks like these, or more memory per rank (--hbm-gb / --ddr-gb), or fewer rows / "
        "a smaller embedding_dim for the largest tables; planner said: Unable to find a plan"
    )  # 4 ranks: ceil(107,200 / (40 KiB x 0.85))


def test_enough_in_all_but_the_largest_table_exceeds_a_rank():
    msg = fit_report.does_not_fit_message(_model(), _topology(0, 100 * KiB), RuntimeError("insufficient storage"))
    assert (
        ": enough in all, but the largest table needs 101.56 KiB and one rank holds 85.00 KiB; "
        f"{LARGEST}; to fit: allow row_wise / column_wise sharding (and fused_uvm_caching on GPUs) for the largest tables; "
        "planner said: insufficient storage"
    ) in msg


def test_enough_everywhere_points_at_the_constraints():
    msg = fit_report.does_not_fit_message(_model(), _topology(64 * KiB, 1024 * KiB, device="cuda"), ValueError(""))
    assert msg.startswith("model does not fit 2 ranks (cuda): ")
    assert "the ranks hold 64.00 KiB HBM + 1.00 MiB host memory each, 1.81 MiB in all after torchrec's 15% reserve: " in msg
    assert msg.endswith(
        ": enough in all and per rank, but no placement the constraints allow fits (see what the planner said); "
        f"{LARGEST}; to fit: allow more sharding types and compute kernels for the largest tables, or more memory per rank; "
        "planner said: ValueError"
    )


def test_hbm_below_torchrecs_reserve():
    err = RuntimeError("Storage reservation: negative available hbm storage on rank 0")
    assert fit_report.reserve_exceeds_hbm(err) and not fit_report.reserve_exceeds_hbm(RuntimeError("insufficient storage"))
    msg = fit_report.does_not_fit_message(_model(), _topology(16 * KiB, 1024**3, device="cuda"), err)
    assert (
        ": each rank's 16.00 KiB HBM is less than what torchrec reserves before placing any table (15% of it, the dense "
        f"modules and the input buffers); {LARGEST}; to fit: more HBM per rank (--hbm-gb), or leave --hbm-gb out for the "
        "device's own; planner said: Storage reservation: negative available hbm storage on rank 0"
    ) in msg


def test_planner_said_is_the_first_line_whole():
    assert fit_report.planner_said(RuntimeError("  first line, whole \n second")) == "first line, whole"
    assert fit_report.planner_said(KeyError()) == "KeyError"
