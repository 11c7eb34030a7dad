"""`recsys-plan` (recsys/plan_cli.py) called in this process: make, show, diff and validate on the
smoke model over 2 CPU ranks. Exit codes: 0 ok, 1 `validate` found problems (one `invalid:` line
each), 2 bad input (one `error:` line on stderr, no output file written)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from recsys.plan_cli import build_parser, main

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
SMOKE_VALUES = yaml.safe_load(SMOKE.read_text())
FIELDS = len(SMOKE_VALUES["data"]["cardinalities"])  # 26 embedding tables, and as many wide (4 columns) ones


@pytest.fixture(autouse=True)
def _logging_back():
    """main() turns logging below ERROR off for its own process; the tests' process gets it back."""
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """One plan of the smoke model for 2 CPU ranks, made once for the module's tests."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    try:
        assert main(["make", "--config", str(SMOKE), "--world-size", "2", "--compute-device", "cpu", "--out", str(out)]) == 0
    finally:
        logging.disable(logging.NOTSET)
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_make_writes_the_plan_of_every_table_for_the_world(tmp_path, capsys):
    out = tmp_path / "p.json"
    code, stdout, err = _run(capsys, "make", "--config", str(SMOKE), "--world-size", "2", "--compute-device", "cpu", "--out", str(out))
    assert (code, stdout, err) == (0, f"wrote {out}: {2 * FIELDS} tables on 2 ranks\n", "")
    saved = json.loads(out.read_text())
    assert (saved["world_size"], saved["compute_device"]) == (2, "cpu")
    assert saved["meta"]["batch_size_per_rank"] == SMOKE_VALUES["train"]["batch_size"] // 2
    dim = SMOKE_VALUES["model"]["embedding_dim"]
    sizes = {name: p["shards"][0]["sizes"] for m in saved["modules"].values() for name, p in m["params"].items()}
    for i, rows in enumerate(SMOKE_VALUES["data"]["cardinalities"]):
        assert sizes[f"t_C{i + 1}"] == [rows, dim] and sizes[f"w_C{i + 1}"] == [rows, 4]
    ranks = sorted(r for m in saved["modules"].values() for p in m["params"].values() for r in p["ranks"])
    assert set(ranks) <= {0, 1} and len(ranks) == 2 * FIELDS  # table-wise: each table on one rank


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "3", "--local-world-size", "2"], "--world-size 3 is not a positive multiple of --local-world-size 2"),
        (["--world-size", "2", "--batch-size", "1"], "--batch-size: fewer samples than ranks (2)"),
        (["--world-size", "2", "--hbm-gb", "-1"], "--hbm-gb -1: expected a size in GiB > 0 (leave it out for the default)"),
        (["--world-size", "2", "--ddr-gb", "nan"], "--ddr-gb nan: expected a size in GiB > 0 (leave it out for the default)"),
        (["--world-size", "2", "--set", "model.name=fm"],
         "override 'model.name=fm': key 'model.name': expected one of deepfm, wide_deep, dcn, dcnv2, got 'fm'"),
        (["--world-size", "2", "--data-sample", "synthetic:100", "--target-hit-rate", "1.5"],
         "--target-hit-rate: expected a number in (0, 1], got 1.5"),
        (["--world-size", "2", "--topology", "cpu-gloo"], "topology cpu-gloo is for cpu, the run is on cuda"),
    ],
)  # fmt: skip
def test_make_refuses_bad_input_in_one_line_and_leaves_the_old_file(tmp_path, capsys, argv, message):
    out = tmp_path / "p.json"
    out.write_text("the previous plan\n")
    code, stdout, err = _run(capsys, "make", "--config", str(SMOKE), *argv, "--out", str(out))
    assert (code, stdout, err) == (2, "", f"error: {message}\n")
    assert out.read_text() == "the previous plan\n"


def test_make_into_a_directory_is_refused(tmp_path, capsys):
    code, _, err = _run(capsys, "make", "--config", str(SMOKE), "--world-size", "2", "--compute-device", "cpu", "--out", str(tmp_path))
    assert (code, err) == (2, f"error: --out {tmp_path} is a directory; give a file name, e.g. {tmp_path / 'plan.json'}\n")
    assert list(tmp_path.iterdir()) == []


def test_validate(plan, capsys):
    assert _run(capsys, "validate", str(plan)) == (0, f"valid: {2 * FIELDS} tables, each placed once, on 2 ranks\n", "")
    assert _run(capsys, "validate", str(plan), "--config", str(SMOKE)) == (
        0,
        f"valid: {2 * FIELDS} tables, each placed once, on 2 ranks\n",
        "",
    )
    code, out, _ = _run(capsys, "validate", str(plan), "--world-size", "4")
    assert (code, out) == (1, f"invalid: {plan}: key 'world_size': plan is for 2 ranks, this job has 4\n")
    code, out, _ = _run(capsys, "validate", str(plan), "--model", str(SMOKE), "--set", "model.embedding_dim=16")
    rows = SMOKE_VALUES["data"]["cardinalities"][0]
    dim = SMOKE_VALUES["model"]["embedding_dim"]
    assert (code, out) == (
        1,
        f"invalid: {plan}: key 'tables': plan is for another model (table t_C1 is [{rows}, {dim}] (rows, dim) in the plan, "
        f"[{rows}, 16] in the model)\n",
    )


def test_validate_checks_memory_against_the_given_capacity(plan, capsys):
    """Each rank holds 26 tables (~0.4 MB of rows and optimizer state): more than 0.0003 GiB."""
    code, out, _ = _run(capsys, "validate", str(plan), "--ddr-gb", "0.0003")
    assert code == 1
    assert out == "".join(f"invalid: {plan}: rank {r}: host memory 0.00 GB > 0.0003 GB\n" for r in (0, 1))
    assert _run(capsys, "validate", str(plan), "--ddr-gb", "1")[0] == 0
    assert _run(capsys, "validate", str(plan), "--hbm-gb", "-2")[1:] == (
        "",
        "error: --hbm-gb -2: expected a size in GiB > 0 (leave it out for the default)\n",
    )


def test_show_text_and_json(plan, capsys, tmp_path):
    code, out, _ = _run(capsys, "show", str(plan))
    lines = out.splitlines()
    assert code == 0 and lines[0] == "plan for 2 ranks (cpu)"
    assert sum(1 for line in lines if line.split()[:1] and line.split()[0][:2] in ("t_", "w_")) == 2 * FIELDS
    assert lines[-1].startswith("largest: rank ")
    report = tmp_path / "r.json"
    assert _run(capsys, "show", str(plan), "--format", "json", "--out", str(report)) == (0, "", "")
    rep = json.loads(report.read_text())
    assert rep["world_size"] == 2 and len(rep["tables"]) == 2 * FIELDS
    assert sum(r["tables"] for r in rep["ranks"]) == 2 * FIELDS


def test_show_on_a_topology_models_the_step_at_the_plan_batch(plan, capsys):
    code, out, _ = _run(capsys, "show", str(plan), "--topology", "cpu-gloo")
    batch = SMOKE_VALUES["train"]["batch_size"] // 2
    assert code == 0 and f"on cpu-gloo, batch {batch} per rank" in out and "assumed" not in out
    code, out, _ = _run(capsys, "show", str(plan), "--topology", "cpu-gloo", "--batch-size", "64")
    assert code == 0 and "on cpu-gloo, batch 64 per rank" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--format", "html"], "--format html needs --out FILE.html"),
        (["--topology", "dgx-a100"], "--topology dgx-a100: 8 ranks, the plan has 2"),
        (["--topology", "cpu-gloo", "--batch-size", "-5"], "--batch-size -5: expected a positive number of samples per rank"),
    ],
)
def test_show_refuses_bad_input(plan, capsys, argv, message):
    assert _run(capsys, "show", str(plan), *argv) == (2, "", f"error: {message}\n")


def test_diff(plan, capsys):
    code, out, _ = _run(capsys, "diff", str(plan), str(plan))
    assert code == 0 and out.splitlines() == [
        "no table changed",
        "memory per rank (b - a):",
        "  rank 0: HBM +0.0 MB, host +0.0 MB",
        "  rank 1: HBM +0.0 MB, host +0.0 MB",
    ]
    code, out, _ = _run(capsys, "diff", str(plan), str(plan), "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["changes"] == [] and [r["host_bytes_delta"] for r in d["ranks"]] == [0, 0]
    assert _run(capsys, "diff", str(plan), str(plan), "--topology", "dgx-a100") == (
        2,
        "",
        "error: --topology dgx-a100: 8 ranks, the plan has 2\n",
    )


@pytest.mark.parametrize("command", ["show", "validate", "diff"])
def test_a_file_that_is_not_a_plan(tmp_path, capsys, command):
    other = tmp_path / "other.json"
    other.write_text("{}")
    argv = [command, str(other)] + ([str(other)] if command == "diff" else [])
    assert _run(capsys, *argv) == (2, "", f"error: {other}: not a sharding plan file (key 'format' is not 'recsys-sharding-plan')\n")
    missing = tmp_path / "none.json"
    assert _run(capsys, "show", str(missing)) == (2, "", f"error: {missing}: no such plan file\n")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(["merge", "a.json"])
    assert "invalid choice: 'merge'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^2$"):
        main(["make", "--world-size", "2"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("the following arguments are required: --config/--model, --out")


def test_model_and_config_are_one_option():
    parser = build_parser()
    assert parser.parse_args(["make", "--model", "m:f", "--out", "p.json"]).config == "m:f"
    assert parser.parse_args(["show", "p.json", "--config", "x.yaml"]).config == "x.yaml"
    args = parser.parse_args(["validate", "p.json", "--set", "a=1", "--set", "b=2"])
    assert (args.config, args.overrides, args.world_size) == (None, ["a=1", "b=2"], 0)
