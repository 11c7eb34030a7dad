"""Plan files: lossless round trips with torchrec ShardingPlans (including UVM-caching plans made
for a GPU cluster on this CPU machine), one-line errors, atomic writes, and the checks a
training job runs before using a saved plan."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig, HardwareConfig

from recsys.config import CARDINALITY_PRESETS, ModelConfig, OptimConfig
from recsys.models.ctr import TrainModule, build_model
from recsys.optim.embedding import attach_embedding_optimizer
import sharding.plan.file_format as plan_format
import sharding.plan.io as plan_io
from sharding.plan.io import PlanFileError


def _exactly(line: str) -> str:
    """A ``match=`` pattern for the whole message and nothing else."""
    return f"^{re.escape(line)}$"


NAMES = [f"C{i + 1}" for i in range(26)]


def _model(cards):
    m = TrainModule(build_model(ModelConfig(), NAMES, cards, 13, torch.device("meta")))
    attach_embedding_optimizer(m, OptimConfig())
    return m


@pytest.fixture(scope="module")
def gpu_plan():
    """A 4-GPU plan for the raw Criteo tables with only 256 MB of HBM per GPU: the planner must
    offload to UVM caching, so the plan carries cache params and enums."""
    cards = CARDINALITY_PRESETS["criteo_kaggle_raw"]
    model = _model(cards)
    topo = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=4, local_world_size=4),
        hardware_config=HardwareConfig(hbm_cap_bytes=256 * 1024**2),
        kernel_config=KernelConfig(compute_device="cuda"),
    )
    plan = EmbeddingShardingPlanner(topology=topo, batch_size=2048).plan(model, [EmbeddingBagCollectionSharder()])
    return model, plan


def test_round_trip_is_lossless(gpu_plan, tmp_path):
    model, plan = gpu_plan
    kernels = {ps.compute_kernel for m in plan.plan.values() for ps in m.values()}
    assert "fused_uvm_caching" in kernels  # the interesting case: cache params and enums
    tables = plan_io.model_tables(model)
    path = plan_io.save_plan(plan, tmp_path / "plan.json", model, meta={"by": "test"})
    back = plan_io.load_plan(path)
    assert back.plan.keys() == plan.plan.keys()
    for mod in plan.plan:
        assert dict(back.plan[mod]) == dict(plan.plan[mod])  # dataclass equality, field by field
    assert str(back) == str(plan)
    _, header = plan_io.read_plan_file(path)
    # world size and device inferred from the shards' placements
    assert header["world_size"] == 4 and header["compute_device"] == "cuda" and header["meta"] == {"by": "test"}
    assert header["tables"] == tables and header["version"] == 2
    assert tables["t_C1"] == {
        "num_embeddings": CARDINALITY_PRESETS["criteo_kaggle_raw"][0],
        "embedding_dim": 16,
        "data_type": "FP32",
        "optimizer_state": {"kind": "rowwise_adagrad", "bytes_per_weight": 0, "bytes_per_row": 4},
    }
    # and again: the JSON is a fixed point
    assert plan_format.plan_to_dict(back, 4, "cuda", tables, {"by": "test"}) == json.loads(path.read_text())
    assert not [p for p in tmp_path.iterdir() if p.name != "plan.json"]  # no temp file left


def test_version_1_files_still_load(gpu_plan, tmp_path):
    """A plan written by the version-1 tools (tables with shapes only) loads; reports show the
    optimizer as unknown, count weights only and say so (nothing is assumed)."""
    import sharding.plan.report as plan_report

    model, plan = gpu_plan
    d = plan_format.plan_to_dict(
        plan, 4, "cuda", {n: {k: t[k] for k in ("num_embeddings", "embedding_dim")} for n, t in plan_io.model_tables(model).items()}
    )
    d["version"] = 1
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(d))
    assert str(plan_io.load_plan(p)) == str(plan)
    _, header = plan_io.read_plan_file(p)
    assert header["tables"]["t_C1"]["data_type"] == "FP32" and header["tables"]["t_C1"]["optimizer_state"] is None
    rep = plan_report.report(plan, header)
    assert len(rep["optimizer_unknown"]) == 52 and {t["optimizer"] for t in rep["tables"]} == {"unknown"}
    text = plan_report.format_text(rep)
    assert (
        "optimizer state: not recorded for 52 of 52 tables (optimizer 'unknown'): their memory counts weights only, a lower bound" in text
        and "rowwise_adagrad" not in text
    )
    c1 = next(t for t in rep["tables"] if t["table"] == "t_C1")
    assert c1["hbm_bytes"] + c1["host_bytes"] == CARDINALITY_PRESETS["criteo_kaggle_raw"][0] * 16 * 4  # weights only


def test_checks_for_another_model_or_world(gpu_plan):
    model, plan = gpu_plan
    tables = plan_io.model_tables(model)
    header = {"world_size": 4, "tables": tables}
    plan_io.check_plan_fits(header, plan, tables, 4, "p.json")
    with pytest.raises(PlanFileError, match=r"p.json: key 'world_size': plan is for 4 ranks, this job has 2"):
        plan_io.check_plan_fits(header, plan, tables, 2, "p.json")
    other = plan_io.model_tables(_model(CARDINALITY_PRESETS["criteo_kaggle_filtered"]))
    with pytest.raises(PlanFileError, match=r"key 'tables': plan is for another model \(table t_C1 is"):
        plan_io.check_plan_fits({"world_size": 4, "tables": tables}, plan, other, 4, "p.json")


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.update(version=7), "key 'version': unsupported plan format version 7 (this tool reads 1, 2)"),
        (lambda d: d["tables"]["t_C2"].update(num_embeddings=-3), "key 'tables.t_C2.num_embeddings': expected a positive integer"),
        (lambda d: d["tables"]["t_C2"].update(data_type="FP12"), "key 'tables.t_C2.data_type': unknown data type 'FP12'"),
        (lambda d: d["tables"]["t_C2"].update(optimizer_state={"kind": "adam"}), "key 'tables.t_C2.optimizer_state': expected"),
        (lambda d: d.update(format="x"), "not a sharding plan file"),
        (lambda d: d.pop("world_size"), "key 'world_size': expected int"),
        (
            lambda d: next(iter(next(iter(d["modules"].values()))["params"].values())).update(ranks="zero"),
            ".ranks: expected a list of ranks",
        ),
        (lambda d: next(iter(next(iter(d["modules"].values()))["params"].values())).update(colour=1), "unknown key 'colour'"),
        (
            lambda d: next(iter(next(iter(d["modules"].values()))["params"].values())).update(
                bounds_check_mode={"enum": "BoundsCheckMode", "name": "SOMETIMES"}
            ),
            "'SOMETIMES' is not a BoundsCheckMode",
        ),
    ],
)
def test_bad_files_give_one_line_errors(gpu_plan, tmp_path, mutate, needle):
    model, plan = gpu_plan
    d = plan_format.plan_to_dict(plan, 4, "cuda", plan_io.model_tables(model))
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=re.escape(needle)) as e:
        plan_io.read_plan_file(p)
    assert needle in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_not_json_and_truncated(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"format": "recsys-sharding-plan", "vers')
    with pytest.raises(PlanFileError, match=r"x.json: not valid JSON \(line 1, column"):
        plan_io.load_plan(p)
    with pytest.raises(PlanFileError, match="no such plan file"):
        plan_io.load_plan(tmp_path / "missing.json")
    b = tmp_path / "binary.json"
    b.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(PlanFileError, match=_exactly(f"{b}: not a text file (byte 12 is not UTF-8)")):
        plan_io.load_plan(b)


def test_save_is_atomic(gpu_plan, tmp_path, monkeypatch):
    """A failure while writing leaves the previous file intact and no partial or temp file."""
    model, plan = gpu_plan
    target = tmp_path / "plan.json"
    target.write_text("previous")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(plan_io.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        plan_io.save_plan(plan, target, model)
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_save_refuses_an_invalid_plan_and_writes_nothing(gpu_plan, tmp_path):
    """save_plan validates first: a plan torchrec could not run is never written."""
    import copy

    model, plan = gpu_plan
    bad = copy.deepcopy(plan)
    name, ps = next(iter(next(iter(bad.plan.values())).items()))
    ps.compute_kernel = "bogus_kernel"
    target = tmp_path / "plan.json"
    with pytest.raises(
        PlanFileError, match=rf"plan.json: key 'modules\.[^']*\.{name}\.compute_kernel': 'bogus_kernel' is not a torchrec compute kernel"
    ):
        plan_io.save_plan(bad, target, model)
    assert not list(tmp_path.iterdir())


def test_save_plan_refuses_a_model_without_tables_and_records_the_planners_batch(gpu_plan, tmp_path):
    model, plan = gpu_plan
    with pytest.raises(
        PlanFileError,
        match=r"save_plan\(model=\.\.\.\) found no EmbeddingBagCollection / "
        r"EmbeddingCollection tables in Linear, sharded or not; nothing was written",
    ):
        plan_io.save_plan(plan, tmp_path / "p.json", model=torch.nn.Linear(2, 2))
    assert not list(tmp_path.iterdir())
    planner = EmbeddingShardingPlanner(
        topology=TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=4, local_world_size=4),
            hardware_config=HardwareConfig(),
            kernel_config=KernelConfig(compute_device="cuda"),
        ),
        batch_size=2048,
    )
    plan_io.save_plan(plan, tmp_path / "p.json", model=model, planner=planner)
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["batch_size_per_rank"] == 2048


def test_show_says_when_the_batch_for_the_modelled_step_is_assumed(gpu_plan, tmp_path, capsys):
    from recsys.plan_cli import main

    model, plan = gpu_plan
    plan_io.save_plan(plan, tmp_path / "none.json", model=model)
    plan_io.save_plan(plan, tmp_path / "b.json", model=model, batch_size=2048)
    assert main(["show", str(tmp_path / "none.json"), "--topology", "workstation-4gpu-nvlink-pairs"]) == 0
    out = capsys.readouterr().out
    assert "batch 512 per rank" in out and out.rstrip().endswith(
        "batch per rank: 512 assumed (the plan file records none: save_plan(..., planner=...) records it); --batch-size sets it"
    )
    assert main(["show", str(tmp_path / "b.json"), "--topology", "workstation-4gpu-nvlink-pairs"]) == 0
    out = capsys.readouterr().out
    assert "batch 2048 per rank" in out and "assumed" not in out
    assert main(["show", str(tmp_path / "none.json"), "--topology", "workstation-4gpu-nvlink-pairs", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "batch 64 per rank" in out and "assumed" not in out


# -- a hand-made plan with every ParameterSharding field ------------------------------------------


def _ebc():
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["fa"], data_type=DataType.FP16),
            EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=60, feature_names=["fb"]),
        ],
        device=torch.device("meta"),
    )


def _every_field_plan():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, KeyValueParams, ParameterSharding, ShardingPlan
    from torchrec.types import DataType

    mplan = EmbeddingModuleShardingPlan()
    mplan["a"] = ParameterSharding(
        sharding_type="table_wise",
        compute_kernel="fused_uvm_caching",
        ranks=[1],
        sharding_spec=EnumerableShardingSpec([ShardMetadata(shard_offsets=[0, 0], shard_sizes=[100, 8], placement="rank:1/cuda:1")]),
        cache_params=CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.25, precision=DataType.FP16, prefetch_pipeline=True),
        enforce_hbm=True,
        stochastic_rounding=False,
        bounds_check_mode=BoundsCheckMode.WARNING,
        output_dtype=DataType.FP16,
    )
    mplan["b"] = ParameterSharding(
        sharding_type="row_wise",
        compute_kernel="key_value",
        ranks=[0, 1],
        sharding_spec=EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[40, 4], placement="rank:0/cuda:0"),
                ShardMetadata(shard_offsets=[40, 0], shard_sizes=[20, 4], placement="rank:1/cuda:1"),
            ]
        ),
        key_value_params=KeyValueParams(ssd_storage_directory="/ssd/kv"),
    )
    return ShardingPlan({"sparse.ebc": mplan})


def test_save_then_load_keeps_every_field_and_the_header(tmp_path):
    plan = _every_field_plan()
    path = plan_io.save_plan(
        plan, tmp_path / "sub" / "p.json", _ebc(), optimizer={"a": "cowclip_adam", "b": "adam"}, meta={"by": "test"}, batch_size=1024
    )
    assert path == tmp_path / "sub" / "p.json"
    back = plan_io.load_plan(path)
    assert list(back.plan["sparse.ebc"]) == ["a", "b"]
    for name in ("a", "b"):
        assert back.plan["sparse.ebc"][name] == plan.plan["sparse.ebc"][name]
    _, header = plan_io.read_plan_file(path)
    assert header == {
        "version": 2,
        "world_size": 2,  # from the highest placement, rank 1
        "compute_device": "cuda",  # from the placements
        "tables": {
            "a": {
                "num_embeddings": 100,
                "embedding_dim": 8,
                "data_type": "FP16",
                "optimizer_state": {"kind": "cowclip_adam", "bytes_per_weight": 8, "bytes_per_row": 8},
            },
            "b": {
                "num_embeddings": 60,
                "embedding_dim": 4,
                "data_type": "FP32",
                "optimizer_state": {"kind": "adam", "bytes_per_weight": 8, "bytes_per_row": 0},
            },
        },
        "meta": {"by": "test", "batch_size_per_rank": 1024},
    }


def test_world_size_and_device_given_override_the_placements(tmp_path):
    path = plan_io.save_plan(_every_field_plan(), tmp_path / "p.json", world_size=4, compute_device="cuda")
    _, header = plan_io.read_plan_file(path)
    assert (header["world_size"], header["compute_device"], header["tables"], header["meta"]) == (4, "cuda", {}, {})


def test_model_tables_reads_tags_then_fused_params_then_fbgemms_default():
    ebc = _ebc()
    assert {n: t["optimizer_state"]["kind"] for n, t in plan_io.model_tables(ebc).items()} == {"a": "sgd", "b": "sgd"}
    ebc.embedding_bags["a"].weight._optimizer_kwargs = [{"optimizer": "recsys.cowclip_adam"}]
    tables = plan_io.model_tables(ebc, fused_params={"optimizer": "row_wise_adagrad"})
    assert tables["a"]["optimizer_state"] == {"kind": "cowclip_adam", "bytes_per_weight": 8, "bytes_per_row": 8}
    assert tables["b"]["optimizer_state"] == {"kind": "rowwise_adagrad", "bytes_per_weight": 0, "bytes_per_row": 4}
    assert (tables["a"]["data_type"], tables["b"]["data_type"]) == ("FP16", "FP32")
    ebc.embedding_bags["b"].weight._optimizer_kwargs = [{"optimizer": "shampoo"}]  # no known state layout
    assert plan_io.model_tables(ebc)["b"]["optimizer_state"] is None


def test_load_plan_of_a_wrong_version_or_a_missing_key_is_one_exact_line(tmp_path):
    d = plan_format.plan_to_dict(_every_field_plan(), 2, "cuda", {})
    p = tmp_path / "p.json"
    p.write_text(json.dumps(dict(d, version=3)))
    with pytest.raises(PlanFileError, match=_exactly(f"{p}: key 'version': unsupported plan format version 3 (this tool reads 1, 2)")):
        plan_io.load_plan(p)
    del d["modules"]
    p.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=_exactly(f"{p}: key 'modules': expected dict, got None")):
        plan_io.load_plan(p)


def test_write_plan_file_is_indented_json_ending_in_a_newline(tmp_path):
    path = plan_io.write_plan_file(tmp_path / "new" / "p.json", {"b": [1, 2], "a": None})
    assert path.read_text() == '{\n "b": [\n  1,\n  2\n ],\n "a": null\n}\n'


def _fits_tables():
    return {"a": {"num_embeddings": 100, "embedding_dim": 8}, "b": {"num_embeddings": 60, "embedding_dim": 4}}


@pytest.mark.parametrize(
    "tables, world, line",
    [
        ({"a": {"num_embeddings": 100, "embedding_dim": 8}}, 2, "p.json: key 'tables': plan is for another model (unknown tables ['b'])"),
        (
            dict(_fits_tables(), c={"num_embeddings": 1, "embedding_dim": 1}),
            2,
            "p.json: key 'tables': plan is for another model (missing tables ['c'])",
        ),
    ],
)
def test_check_plan_fits_names_what_differs(tables, world, line):
    header = {"world_size": 2, "tables": _fits_tables()}
    with pytest.raises(PlanFileError, match=_exactly(line)):
        plan_io.check_plan_fits(header, _every_field_plan(), tables, world, "p.json")


def test_check_plan_fits_without_recorded_tables_checks_the_placements():
    """A plan saved without a model records no tables: the placements are checked against the model's."""
    plan = _every_field_plan()
    header = {"world_size": 2, "tables": {}}
    plan_io.check_plan_fits(header, plan, _fits_tables(), 2, "p.json")
    with pytest.raises(PlanFileError, match=_exactly("p.json: key 'modules.sparse.ebc.b': the model has no table 'b'")):
        plan_io.check_plan_fits(header, plan, {"a": _fits_tables()["a"]}, 2, "p.json")
    with pytest.raises(PlanFileError, match=_exactly("p.json: key 'modules': no placement for tables ['c']")):
        plan_io.check_plan_fits(header, plan, dict(_fits_tables(), c={}), 2, "p.json")
    plan.plan["other"] = {"a": plan.plan["sparse.ebc"]["a"]}
    with pytest.raises(PlanFileError, match=_exactly("p.json: key 'modules.other.a': table also planned in 'sparse.ebc'")):
        plan_io.check_plan_fits(header, plan, _fits_tables(), 2, "p.json")
    del plan.plan["other"]
    plan.plan["sparse.ebc"]["a"].ranks = [5]
    with pytest.raises(PlanFileError, match=_exactly("p.json: key 'modules.sparse.ebc.a.ranks': rank 5 >= world size 2")):
        plan_io.check_plan_fits(header, plan, _fits_tables(), 2, "p.json")
