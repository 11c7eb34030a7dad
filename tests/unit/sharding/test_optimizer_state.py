"""sharding/optimizer_state.py: the state bytes of each optimizer kind counted by hand, the kind read
from a table's tag, its sharder's fused params or FBGEMM's default, and the CowClip sharder check."""

from __future__ import annotations

import re

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from sharding import optimizer_state as opt


def _exactly(line: str) -> str:
    """A ``match=`` pattern for the whole message and nothing else."""
    return f"^{re.escape(line)}$"


def _ebc(*tables: tuple[str, int, int], data_type: DataType = DataType.FP32) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"], data_type=data_type)
            for n, r, d in tables
        ],
        device=torch.device("meta"),
    )


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = _ebc(("t0", 100, 8), ("t1", 50, 4))
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="e0", embedding_dim=4, num_embeddings=10, feature_names=["f_e0"])], device=torch.device("meta")
        )


def test_adam_and_cowclip_state_bytes_by_hand():
    rows, cols = 1000, 16
    # Adam: two fp32 moments of the weight's shape
    assert opt.state_bytes("adam", rows, cols) == 2 * 4 * rows * cols == 128_000
    # CowClip-Adam: the two moments plus an int64 step per row
    assert opt.state_bytes("cowclip_adam", rows, cols) == 2 * 4 * rows * cols + 8 * rows == 136_000
    assert opt.state_bytes("rowwise_adagrad", rows, cols) == 4 * rows
    assert opt.state_bytes("rowwise_adagrad_counter", rows, cols) == 3 * 4 * rows
    assert opt.state_bytes("partial_rowwise_adam", rows, cols) == 4 * rows * cols + 4 * rows
    assert opt.state_bytes("sgd", rows, cols) == 0


def test_weight_bytes_round_up_to_whole_bytes():
    assert opt.weight_bytes("FP32", 10, 3) == 120
    assert opt.weight_bytes("FP16", 10, 3) == 60
    assert opt.weight_bytes("INT4", 3, 3) == 5  # 36 bits
    assert opt.weight_bytes("INT2", 1, 3) == 1  # 6 bits


def test_state_to_dict_is_what_a_plan_file_records():
    assert opt.state_of("cowclip_adam").to_dict() == {"kind": "cowclip_adam", "bytes_per_weight": 8, "bytes_per_row": 8}


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(
        opt.UnknownOptimizerError, match=r"^unknown optimizer kind 'adamw' \(known: sgd, rowwise_adagrad, .*, cowclip_adam\)$"
    ):
        opt.state_bytes("adamw", 1, 1)


@pytest.mark.parametrize(
    "kwargs, cls, kind",
    [
        ({}, None, "sgd"),  # FBGEMM's default when nothing names one
        ({"optimizer": "recsys.cowclip_adam"}, None, "cowclip_adam"),
        ({"optimizer": "EXACT_ROW_WISE_ADAGRAD"}, None, "rowwise_adagrad"),
        ({"optimizer": "row_wise_adagrad", "weight_decay_mode": "COWCLIP"}, None, "rowwise_adagrad_counter"),
        ({"optimizer": "row_wise_adagrad", "weight_decay_mode": "L2"}, None, "rowwise_adagrad"),
        ({}, torch.optim.Adam, "adam"),
        ({"optimizer": "exact_sgd"}, torch.optim.Adam, "sgd"),  # the explicit key wins over the class
        ({}, torch.optim.Adagrad, "adagrad"),
    ],
)
def test_fused_params_kind(kwargs, cls, kind):
    assert opt.fused_params_kind(kwargs, cls) == kind


def test_fused_params_kind_accepts_fbgemms_enum():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    assert opt.fused_params_kind({"optimizer": EmbOptimType.ADAM}) == "adam"
    assert opt.fused_params_kind({"optimizer": EmbOptimType.PARTIAL_ROWWISE_LAMB}) == "partial_rowwise_lamb"


def test_fused_params_kind_refuses_what_has_no_state_layout():
    with pytest.raises(opt.UnknownOptimizerError, match=r"^optimizer 'shampoo' has no known state layout$"):
        opt.fused_params_kind({"optimizer": "shampoo"})
    with pytest.raises(opt.UnknownOptimizerError, match=r"^optimizer RMSprop has no fused-embedding equivalent in torchrec$"):
        opt.fused_params_kind({}, torch.optim.RMSprop)


def test_table_optimizers_reads_tags_over_the_sharders_fused_params():
    m = _Model()
    m.ebc.embedding_bags["t0"].weight._optimizer_classes = [torch.optim.Adam]
    m.ebc.embedding_bags["t0"].weight._optimizer_kwargs = [{"lr": 0.1}]
    assert opt.table_optimizers(m) == {"t0": "adam", "t1": "sgd", "e0": "sgd"}
    # the merged kwargs' "optimizer" key wins over the tagged class, as in torchrec's sharders
    fused = {"optimizer": "row_wise_adagrad"}
    assert opt.table_optimizers(m, fused) == {"t0": "rowwise_adagrad", "t1": "rowwise_adagrad", "e0": "rowwise_adagrad"}
    m.ebc.embedding_bags["t0"].weight._optimizer_kwargs = [{"optimizer": "adam"}]  # the tag's own key wins over the sharder's
    assert opt.table_optimizers(m, fused) == {"t0": "adam", "t1": "rowwise_adagrad", "e0": "rowwise_adagrad"}
    m.ebc.embedding_bags["t1"].weight._optimizer_classes = [torch.optim.RMSprop]
    with pytest.raises(opt.UnknownOptimizerError, match=r"^table t1: optimizer RMSprop has no fused-embedding equivalent in torchrec$"):
        opt.table_optimizers(m)


def test_table_bytes_weights_plus_state_by_hand():
    m = _Model()
    m.ebc.embedding_bags["t0"].weight._optimizer_kwargs = [{"optimizer": "recsys.cowclip_adam"}]
    sharders = [EmbeddingBagCollectionSharder(fused_params={"optimizer": "adam"})]
    assert opt.table_bytes(m, sharders) == {
        "t0": 100 * 8 * 4 + 100 * 8 * 8 + 100 * 8,  # fp32 weights + two moments + an int64 step per row
        "t1": 50 * 4 * 4 + 50 * 4 * 8,  # untagged: the EBC sharder's Adam
        "e0": 10 * 4 * 4,  # no sharder for the EC: FBGEMM's SGD, no state
    }
    m.ebc.embedding_bags["t1"].weight._optimizer_kwargs = [{"optimizer": "shampoo"}]
    assert opt.table_bytes(m)["t1"] == 50 * 4 * 4 + 50 * 4  # unknown: counted as row-wise Adagrad


def test_table_bytes_use_the_tables_data_type():
    assert opt.table_bytes(_ebc(("h", 10, 8), data_type=DataType.FP16)) == {"h": 10 * 8 * 2}


def test_sharder_fused_params_picks_the_first_sharder_of_the_module_type():
    first = EmbeddingBagCollectionSharder(fused_params={"optimizer": "adam"})
    second = EmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd"})
    ebc = _ebc(("t", 1, 1))
    assert opt.sharder_fused_params([first, second], ebc) == {"optimizer": "adam"}
    assert opt.sharder_fused_params([first], torch.nn.Linear(1, 1)) is None


def test_table_parameters_are_every_ebc_and_ec_table_in_module_order():
    m = _Model()
    assert [(c.name, p.shape) for c, p in opt.table_parameters(m)] == [
        ("t0", (100, 8)),
        ("t1", (50, 4)),
        ("e0", (10, 4)),
    ]


class _CowClipSharder(EmbeddingBagCollectionSharder):
    trains_cowclip_adam = True


def test_check_cowclip_sharders_names_the_tables_and_the_fix():
    m = _Model()
    for name in ("t0", "t1"):
        m.ebc.embedding_bags[name].weight._optimizer_kwargs = [{"optimizer": "recsys.cowclip_adam"}]
    with pytest.raises(
        ValueError,
        match=_exactly(
            "tables t0, t1 of EmbeddingBagCollection 'ebc' are tagged for CowClip-Adam, but no sharder given shards its "
            "EmbeddingBagCollection; CowClip-Adam trains EmbeddingBagCollection tables: "
            "add CowClipEmbeddingBagCollectionSharder() to the sharders"
        ),
    ):
        opt.check_cowclip_sharders(m, None)
    with pytest.raises(
        ValueError, match=r"^tables t0, t1 of .* but its sharder EmbeddingBagCollectionSharder does not train CowClip-Adam; "
    ):
        opt.check_cowclip_sharders(m, [EmbeddingBagCollectionSharder()])
    opt.check_cowclip_sharders(m, [_CowClipSharder()])  # no error


def test_check_cowclip_sharders_ignores_untagged_models():
    opt.check_cowclip_sharders(_Model(), None)
    m = _Model()
    m.ec.embeddings["e0"].weight._optimizer_kwargs = [{"optimizer": "recsys.cowclip_adam"}]
    with pytest.raises(
        ValueError,
        match=_exactly(
            "table e0 of EmbeddingCollection 'ec' is tagged for CowClip-Adam, but no sharder given shards its EmbeddingCollection; "
            "CowClip-Adam trains EmbeddingCollection tables: add CowClipEmbeddingCollectionSharder() to the sharders"
        ),
    ):
        opt.check_cowclip_sharders(m, [_CowClipSharder()])
