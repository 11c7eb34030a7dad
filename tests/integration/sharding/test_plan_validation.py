"""Plans are validated for real, for any model: one check
of sharding types, kernels, shards and ranks shared by `recsys-plan validate`/`show`, load_plan and
the pre-launch check of `recsys train`; plan files carry each table's optimizer state, so memory
figures need no model and count CowClip-Adam, row-wise Adagrad and SGD state as they really are."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

import sharding.plan.io as plan_io
import sharding.plan.report as plan_report
from sharding.plan.io import PlanFileError
from sharding.plan.validation import plan_problems, validate_plan
from tests.support import plan_models
from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[3]
SMOKE = str(REPO / "configs" / "experiments" / "smoke.yaml")
EBC = "sparse_arch.embedding_bag_collection"


def _mixed_plan(world: int = 2) -> tuple[torch.nn.Module, ShardingPlan]:
    """mixed_dlrm on 2 CPU ranks: CowClip table column-wise, Adagrad table row-wise, SGD table on rank 1."""
    with torch.device("meta"):
        model = plan_models.mixed_dlrm()
    ebc = model.sparse_arch.embedding_bag_collection
    mp = construct_module_sharding_plan(
        ebc,
        per_param_sharding={
            "t_cowclip": column_wise(ranks=[0, 1]),
            "t_adagrad": row_wise(),
            "t_sgd": table_wise(rank=1),
        },
        world_size=world,
        device_type="cpu",
        local_size=world,
    )
    return model, ShardingPlan({EBC: mp})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    model, plan = _mixed_plan()
    path = plan_io.save_plan(plan, tmp_path_factory.mktemp("mixed") / "mixed.json", model)
    return model, plan, path


def _param(d: dict, table: str) -> dict:
    return d["modules"][EBC]["params"][table]


def _shard(offsets, sizes, rank):
    return {"offsets": offsets, "sizes": sizes, "placement": f"rank:{rank}/cpu"}


# each: (mutation of the mixed plan's JSON, the one line expected after "<file>: ")
CASES = {
    "diagonal_wise": (
        lambda d: _param(d, "t_sgd").update(sharding_type="diagonal_wise"),
        f"key 'modules.{EBC}.t_sgd.sharding_type': 'diagonal_wise' is not a torchrec sharding type (one of "
        "data_parallel, table_wise, column_wise, row_wise, table_row_wise, table_column_wise, grid_shard)",
    ),
    "bogus_kernel": (
        lambda d: _param(d, "t_sgd").update(compute_kernel="bogus_kernel"),
        f"key 'modules.{EBC}.t_sgd.compute_kernel': 'bogus_kernel' is not a torchrec compute kernel (one of dense, ",
    ),
    "7x4 of 100 rows": (
        lambda d: _param(d, "t_sgd").update(shards=[_shard([0, 0], [7, 4], 1)]),
        f"key 'modules.{EBC}.t_sgd.shards[0]': a table_wise shard is the whole table [100, 8] (rows, dim), "
        "got offsets [0, 0], sizes [7, 4]",
    ),
    "kernel for another type": (
        lambda d: _param(d, "t_sgd").update(compute_kernel="dense"),
        f"key 'modules.{EBC}.t_sgd.compute_kernel': torchrec does not run a table_wise table with kernel 'dense' on cpu (allowed: fused)",
    ),
    "uvm on cpu": (
        lambda d: _param(d, "t_adagrad").update(compute_kernel="fused_uvm_caching"),
        f"key 'modules.{EBC}.t_adagrad.compute_kernel': torchrec does not run a row_wise table with kernel "
        "'fused_uvm_caching' on cpu (allowed: fused)",
    ),
    "rank outside the world": (
        lambda d: _param(d, "t_sgd").update(ranks=[2], shards=[_shard([0, 0], [100, 8], 2)]),
        f"key 'modules.{EBC}.t_sgd.ranks': rank 2 is outside the world of 2 ranks (0..1)",
    ),
    "ranks differ from placements": (
        lambda d: _param(d, "t_sgd").update(ranks=[0]),
        f"key 'modules.{EBC}.t_sgd.ranks': [0] differ from the shards' placements [1]",
    ),
    "row-wise gap": (
        lambda d: _param(d, "t_adagrad").update(shards=[_shard([0, 0], [250, 8], 0), _shard([300, 0], [300, 8], 1)]),
        f"key 'modules.{EBC}.t_adagrad.shards': rows 250..299 of 600 are in no shard",
    ),
    "row-wise short": (
        lambda d: _param(d, "t_adagrad").update(shards=[_shard([0, 0], [300, 8], 0), _shard([300, 0], [200, 8], 1)]),
        f"key 'modules.{EBC}.t_adagrad.shards': shards cover rows 0..499 of 600; rows 500..599 are in no shard",
    ),
    "past the end": (
        lambda d: _param(d, "t_adagrad").update(shards=[_shard([0, 0], [300, 8], 0), _shard([300, 0], [400, 8], 1)]),
        f"key 'modules.{EBC}.t_adagrad.shards[1]': offsets [300, 0] + sizes [400, 8] run past the table's [600, 8] (rows, dim)",
    ),
    "column-wise split along rows": (
        lambda d: _param(d, "t_cowclip").update(shards=[_shard([0, 0], [500, 8], 0), _shard([500, 0], [500, 8], 1)]),
        f"key 'modules.{EBC}.t_cowclip.shards[0]': a column_wise shard splits dim 1 only and spans "
        "all rows (1000), got offsets [0, 0], sizes [500, 8]",
    ),
    "row-wise split along columns": (
        lambda d: _param(d, "t_adagrad").update(shards=[_shard([0, 0], [600, 4], 0), _shard([0, 4], [600, 4], 1)]),
        f"key 'modules.{EBC}.t_adagrad.shards[0]': a row_wise shard splits dim 0 only and spans "
        "the full dim (8), got offsets [0, 0], sizes [600, 4]",
    ),
    "data-parallel with shards": (
        lambda d: _param(d, "t_sgd").update(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1]),
        f"key 'modules.{EBC}.t_sgd.shards': a data_parallel table has no shards (a full copy on every rank)",
    ),
    "table not planned": (lambda d: d["modules"][EBC]["params"].pop("t_sgd"), "key 'modules': no placement for tables ['t_sgd']"),
    "table unknown": (lambda d: d["tables"].pop("t_sgd"), f"key 'modules.{EBC}.t_sgd': table 't_sgd' is not in the plan's 'tables'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_invalid_plan_is_one_line_naming_file_and_key(mixed, tmp_path, case):
    _, _, good = mixed
    mutate, expected = CASES[case]
    d = json.loads(good.read_text())
    mutate(d)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    plan, header = plan_io.read_plan_file(bad)  # well-formed: only validation can tell
    problems = plan_problems(plan, header, str(bad))
    assert problems and problems[0].startswith(f"{bad}: {expected}"), problems
    assert all("\n" not in p for p in problems)
    with pytest.raises(PlanFileError) as e:
        plan_io.load_plan(bad)
    assert str(e.value) == problems[0]


def test_overlapping_shards_are_refused_when_read(mixed, tmp_path):
    """torch cannot build a sharding spec with overlapping shards: the file is not a usable plan."""
    _, _, good = mixed
    d = json.loads(good.read_text())
    _param(d, "t_adagrad").update(shards=[_shard([0, 0], [350, 8], 0), _shard([300, 0], [300, 8], 1)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanFileError) as e:
        plan_io.read_plan_file(bad)
    assert str(e.value) == (
        f"{bad}: modules.{EBC}.t_adagrad.shards[1]: overlaps shards[0] (offsets [300, 0] and [0, 0], sizes [300, 8] and [350, 8])"
    )


def test_valid_plans_pass(mixed):
    model, plan, path = mixed
    assert str(plan_io.load_plan(path)) == str(plan)
    _, header = plan_io.read_plan_file(path)
    assert plan_problems(plan, header, "p") == []
    # a plan saved without a model: the shards are checked against their own extent
    no_model = copy.deepcopy(header)
    no_model["tables"] = {}
    assert plan_problems(plan, no_model, "p") == []
    # the job's world is smaller than the plan's: the rank is named
    with pytest.raises(
        PlanFileError,
        match=r"^p: key 'modules\.sparse_arch\.embedding_bag_collection\.t_cowclip\.ranks': rank 1 is outside the world of 1 ranks",
    ):
        validate_plan(plan, header, "p", world_size=1)


def test_memory_per_table_and_rank_counts_each_optimizers_state(mixed):
    """Hand-computed bytes: weights 4 B each, plus CowClip-Adam's two fp32 moments per weight and an
    int64 step per row (each column shard keeps its own steps), row-wise Adagrad's one float per
    row, nothing for SGD."""
    _, plan, path = mixed
    rep = plan_report.report(*plan_io.read_plan_file(path))
    per_table = {t["table"]: t["host_bytes"] for t in rep["tables"]}
    cowclip_shard = 1000 * 4 * 4 + 1000 * 4 * 8 + 1000 * 8  # 1000 x 4 columns on each rank
    adagrad_shard = 300 * 8 * 4 + 300 * 4  # 600 rows split over 2 ranks
    sgd = 100 * 8 * 4
    assert per_table == {"t_cowclip": 2 * cowclip_shard, "t_adagrad": 2 * adagrad_shard, "t_sgd": sgd}
    assert [r["host_bytes"] for r in rep["ranks"]] == [cowclip_shard + adagrad_shard, cowclip_shard + adagrad_shard + sgd]
    assert [r["hbm_bytes"] for r in rep["ranks"]] == [0, 0]  # CPU ranks
    assert {t["table"]: t["optimizer"] for t in rep["tables"]} == {
        "t_cowclip": "cowclip_adam",
        "t_adagrad": "rowwise_adagrad",
        "t_sgd": "sgd",
    }
    assert not rep["optimizer_unknown"]
    # the same placement on GPUs: everything in HBM
    _, header = plan_io.read_plan_file(path)
    rep = plan_report.report(plan, dict(header, compute_device="cuda"))
    assert sum(r["hbm_bytes"] for r in rep["ranks"]) == 2 * cowclip_shard + 2 * adagrad_shard + sgd


def test_optimizer_kind_from_sharder_fused_params_and_override():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    with torch.device("meta"):
        model = plan_models._dlrm(plan_models._ebc(plan_models.ROWS))  # untagged tables
    assert {t["optimizer_state"]["kind"] for t in plan_io.model_tables(model).values()} == {"sgd"}  # FBGEMM's default
    tables = plan_io.model_tables(model, fused_params={"optimizer": EmbOptimType.ADAM})
    assert tables["t_sgd"]["optimizer_state"] == {"kind": "adam", "bytes_per_weight": 8, "bytes_per_row": 0}
    tables = plan_io.model_tables(model, optimizer={"t_sgd": "cowclip_adam"})
    assert tables["t_sgd"]["optimizer_state"]["kind"] == "cowclip_adam" and tables["t_cowclip"]["optimizer_state"]["kind"] == "sgd"
    with pytest.raises(ValueError, match="unknown optimizer kind 'adamw'"):
        plan_io.model_tables(model, optimizer="adamw")
    # an optimizer with no known state layout: recorded as unknown, reports assume row-wise Adagrad and say so
    with torch.device("meta"):
        custom = plan_models.custom_optimizer_dlrm()
    assert {t["optimizer_state"] for t in plan_io.model_tables(custom).values()} == {None}


# -- the command line: recsys-plan validate/show and recsys train --------------------------------


def _run(*args: str, module: str = "recsys.plan_cli", cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS`, run in this process (tests/support/cli.py); the console commands
    themselves are run as processes in test_recsys_plan_tool.py and test_config_cli.py."""
    return run_main(module, *args, cwd=cwd)


def test_stock_dlrm_plan_validates_and_shows_with_or_without_model(tmp_path):
    """A plan made by torchrec's own planner for a stock DLRM, saved with save_plan: validate and
    show work with no model and with --model tests.support.plan_models:dlrm."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    with torch.device("meta"):
        model = plan_models.dlrm()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), batch_size=64).plan(
        model, [EmbeddingBagCollectionSharder()]
    )
    path = plan_io.save_plan(plan, tmp_path / "dlrm.json", model)
    for extra in ([], ["--model", "tests.support.plan_models:dlrm"]):
        r = _run("validate", str(path), *extra)
        assert r.returncode == 0 and r.stdout.startswith("valid: 3 tables, each placed once, on 2 ranks"), r.stdout + r.stderr
        r = _run("show", str(path), "--format", "json", *extra)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        copies = {t: 2 if ps.sharding_type == "data_parallel" else 1 for t, ps in plan.plan[EBC].items()}
        expected = sum(copies[t] * (n * 8 * 4 + n * 4) for t, n in plan_models.ROWS.items())  # weights + row-wise Adagrad
        assert sum(x["host_bytes"] for x in rep["ranks"]) == expected
    # the plan's tables are not another model's: the model's shapes are compared
    other = tmp_path / "other.json"
    d = json.loads(path.read_text())
    d["tables"]["t_sgd"]["num_embeddings"] = 99
    for p in d["modules"][EBC]["params"]["t_sgd"]["shards"] or []:  # none if data-parallel
        p["sizes"][0] = min(p["sizes"][0], 99 - p["offsets"][0])
    other.write_text(json.dumps(d))
    r = _run("validate", str(other), "--model", "tests.support.plan_models:dlrm")
    assert r.returncode == 1 and r.stdout.strip() == (
        f"invalid: {other}: key 'tables': plan is for another model (table t_sgd is [99, 8] (rows, dim) in the plan, [100, 8] in the model)"
    )
    for spec, msg in (
        ("tests.support.plan_models:nope", "module 'tests.support.plan_models' has no function 'nope'"),
        ("tests.no_such_module:f", "cannot import 'tests.no_such_module'"),
        ("tests.support.plan_models:not_a_model", "not_a_model() returned int, not an nn.Module"),
    ):
        r = _run("validate", str(path), "--model", spec)
        assert r.returncode == 2 and r.stderr.startswith(f"error: --model {spec}: {msg}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def smoke_plan(tmp_path_factory):
    """A valid plan for configs/experiments/smoke.yaml on its 2 ranks, made by recsys-plan."""
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    r = _run("make", "--config", SMOKE, "--world-size", "2", "--compute-device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


BROKEN_PLANS = {  # broken plans, on the smoke model's t_C1 (100 rows, dim 8)
    "diagonal_wise": (lambda p: p.update(sharding_type="diagonal_wise"), "'diagonal_wise' is not a torchrec sharding type"),
    "bogus_kernel": (lambda p: p.update(compute_kernel="bogus_kernel"), "'bogus_kernel' is not a torchrec compute kernel"),
    "sizes [7,4]": (
        lambda p: p.update(sharding_type="table_wise", compute_kernel="fused", ranks=[0], shards=[_shard([0, 0], [7, 4], 0)]),
        "a table_wise shard is the whole table [100, 8] (rows, dim), got offsets [0, 0], sizes [7, 4]",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_PLANS))
def test_broken_plans_fail_validate_show_and_train_before_workers_start(smoke_plan, tmp_path, case):
    mutate, needle = BROKEN_PLANS[case]
    d = json.loads(smoke_plan.read_text())
    (module,) = [m for m in d["modules"] if "t_C1" in d["modules"][m]["params"]]
    mutate(d["modules"][module]["params"]["t_C1"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    prefix = f"{bad}: key 'modules.{module}.t_C1."

    r = _run("validate", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith(f"invalid: {prefix}") and needle in r.stdout and len(r.stdout.strip().splitlines()) == 1, r.stdout
    r = _run("show", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error: {prefix}") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

    run_dir = tmp_path / "run"
    r = _run("train", "--config", SMOKE, f"plan={bad}", f"run_dir={run_dir}", "train.max_steps=2", module="recsys.cli")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {prefix}") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()  # no worker ran


def test_torchrec_planner_out_of_memory_names_need_shortfall_and_largest_tables():
    """torchrec's planner alone says "insufficient storage"; ours adds the figures."""
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder
    from torchrec.distributed.planner.types import PlannerError

    from recsys.config import ShardingConfig
    from sharding.planner.build import build_planner

    with torch.device("meta"):
        model = plan_models.mixed_dlrm()
    planner = build_planner(ShardingConfig(sharding_types=["table_wise"]), model, 2, 2, "cpu", 64, ddr_bytes=40 * 1024)
    with pytest.raises(PlannerError) as e:  # the CowClip sharder: the model has a CowClip-tagged table
        planner.plan(model, [CowClipEmbeddingBagCollectionSharder()])
    msg = str(e.value)
    # weights + state, by hand: CowClip-Adam 1000 x 8 x (4 + 8) + 1000 x 8, row-wise Adagrad 600 x (8 x 4 + 4), SGD 100 x 8 x 4
    cowclip, adagrad, sgd = 1000 * 8 * 12 + 1000 * 8, 600 * (8 * 4 + 4), 100 * 8 * 4
    need, usable = cowclip + adagrad + sgd, 2 * 40 * 1024 * 0.85
    assert "\n" not in msg
    assert msg.startswith(
        f"model does not fit 2 ranks (cpu): embeddings need {need / 1024:.2f} KiB (weights + optimizer state), "
        f"the ranks hold 0.00 KiB HBM + 40.00 KiB host memory each, {usable / 1024:.2f} KiB in all after torchrec's 15% reserve: "
        f"short by {(need - usable) / 1024:.2f} KiB; largest tables: t_cowclip {cowclip / 1024:.2f} KiB (1,000 x 8, cowclip_adam), "
        f"t_adagrad {adagrad / 1024:.2f} KiB (600 x 8, rowwise_adagrad), t_sgd {sgd / 1024:.2f} KiB (100 x 8, sgd); "
        "to fit: about 4 ranks like these"
    ), msg  # ceil(need / (40 KiB x 0.85))
    assert "planner said: " in msg


@pytest.mark.parametrize("planner", ["torchrec", "topology"])
def test_hbm_below_torchrecs_reserve_is_said_as_such_with_the_given_capacity(planner):
    """16 KiB of HBM: torchrec's reserve (15%, dense modules, KJT buffers) leaves negative HBM, so
    no table fits whatever its size; the line says that, with the HBM the user gave (not the
    topology's own 80 GiB), in binary units that show a small need, and torchrec's words whole."""
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder

    from recsys.config import ShardingConfig
    from sharding.planner.build import build_planner

    with torch.device("meta"):
        model = plan_models.mixed_dlrm()
    cfg = ShardingConfig(planner=planner, topology="dgx-a100" if planner == "topology" else "")
    built = build_planner(cfg, model, 8, 8, "cuda", 64, hbm_bytes=16 * 1024)
    with pytest.raises(Exception) as e:
        built.plan(model, [CowClipEmbeddingBagCollectionSharder()])
    msg = str(e.value)
    assert "\n" not in msg and "16.00 KiB HBM" in msg and "80" not in msg.split("planner said")[0], msg
    assert "less than what torchrec reserves before placing any table" in msg
    assert "enough in all" not in msg and "0.0 GiB" not in msg
    assert msg.endswith("Hence it is not possible to find a valid sharding plan."), msg


def test_make_for_a_model_factory_records_its_optimizers(tmp_path):
    """`recsys-plan make --model pkg.mod:factory`: a user's model, no experiment config."""
    out = tmp_path / "m.json"
    r = _run(
        "make",
        "--model",
        "tests.support.plan_models:mixed_dlrm",
        "--world-size",
        "2",
        "--compute-device",
        "cpu",
        "--batch-size",
        "256",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert {n: t["optimizer_state"]["kind"] for n, t in d["tables"].items()} == {
        "t_cowclip": "cowclip_adam",
        "t_adagrad": "rowwise_adagrad",
        "t_sgd": "sgd",
    }
    assert set(d["modules"]) == {EBC} and d["world_size"] == 2
    r = _run("validate", str(out), "--model", "tests.support.plan_models:mixed_dlrm")
    assert r.returncode == 0 and r.stdout.startswith("valid: 3 tables"), r.stdout + r.stderr
    r = _run("make", "--model", "tests.support.plan_models:dlrm", "--out", str(tmp_path / "x.json"), "--set", "train.batch_size=8")
    assert r.returncode == 2 and "--set and --data-sample need an experiment config" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_cowclip_tag_matches_the_kernels():
    """sharding/ never imports recsys/: the CowClip fused-param value is duplicated; keep them equal."""
    from recsys.optim.cowclip.hyper import COWCLIP_ADAM
    from sharding.optimizer_state import COWCLIP_ADAM_TAG

    assert COWCLIP_ADAM_TAG == COWCLIP_ADAM
