"""`recsys-plan` on known plans: memory figures against an independent computation, diffs,
validation exit codes, and error paths that write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "configs" / "experiments" / "demo.yaml")
RAW = ("--set", "data.cardinalities=criteo_kaggle_raw")
RAW_SIZES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip


def tool(*args: str) -> subprocess.CompletedProcess:
    """`recsys-plan ARGS`, run in this process (tests/support/cli.py)."""
    return run_main("recsys.plan_cli", *args, cwd=REPO)


def console(*args: str) -> subprocess.CompletedProcess:
    """`recsys-plan ARGS` as a process of its own: the exit status and stderr a shell sees."""
    return subprocess.run([sys.executable, "-m", "recsys.plan_cli", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    roomy, tight = d / "roomy.json", d / "tight.json"
    r = tool("make", "--config", DEMO, "--world-size", "8", "--hbm-gb", "16", "--out", str(roomy), *RAW)
    assert r.returncode == 0, r.stderr
    r = tool("make", "--config", DEMO, "--world-size", "8", "--hbm-gb", "0.25", "--out", str(tight), *RAW)
    assert r.returncode == 0, r.stderr
    return roomy, tight


def test_show_json_memory_matches_independent_sum(plans):
    roomy, tight = plans
    rep = json.loads(tool("show", str(roomy), "--format", "json").stdout)
    assert len(rep["tables"]) == 52 and rep["world_size"] == 8
    # everything in HBM: weights (4 B) + one row-wise Adagrad float per row, for dims 16 and 4
    expected = sum(n * (16 * 4 + 4) + n * (4 * 4 + 4) for n in RAW_SIZES)
    assert sum(r["hbm_bytes"] for r in rep["ranks"]) == expected
    assert sum(r["host_bytes"] for r in rep["ranks"]) == 0
    text = tool("show", str(roomy)).stdout
    assert "t_C3" in text and "largest: rank" in text


def test_tight_hbm_offloads_to_host_and_diff_reports_it(plans):
    roomy, tight = plans
    rep = json.loads(tool("show", str(tight), "--format", "json").stdout)
    kernels = {t["compute_kernel"] for t in rep["tables"]}
    assert kernels & {"fused_uvm", "fused_uvm_caching"}
    assert all(r["hbm_bytes"] <= 0.25 * 1024**3 for r in rep["ranks"])
    assert sum(r["host_bytes"] for r in rep["ranks"]) > 0
    d = json.loads(tool("diff", str(roomy), str(tight), "--format", "json").stdout)
    moved = {c["table"] for c in d["changes"] if "compute_kernel" in c}
    offloaded = {t["table"] for t in rep["tables"] if t["compute_kernel"].startswith("fused_uvm")}
    assert offloaded <= moved
    hbm_delta = sum(r["hbm_bytes_delta"] for r in d["ranks"])
    assert hbm_delta < 0
    assert "table(s) changed" in tool("diff", str(roomy), str(tight)).stdout
    assert tool("diff", str(roomy), str(roomy)).stdout.startswith("no table changed")


def test_validate_exit_codes(plans):
    roomy, _ = plans
    ok = tool("validate", str(roomy), "--config", DEMO, *RAW)
    assert ok.returncode == 0 and ok.stdout.startswith("valid: 52 tables")
    alone = tool("validate", str(roomy))  # no model: the plan file records its tables
    assert alone.returncode == 0 and alone.stdout.startswith("valid: 52 tables"), alone.stdout + alone.stderr
    small = tool("validate", str(roomy), "--config", DEMO, "--hbm-gb", "0.1", *RAW)
    assert small.returncode == 1 and "HBM" in small.stdout and "> 0.1 GB" in small.stdout
    other = tool("validate", str(roomy), "--config", DEMO)  # filtered sizes: another model
    assert other.returncode == 1 and "plan is for another model" in other.stdout
    world = tool("validate", str(roomy), "--config", DEMO, "--world-size", "4", *RAW)
    assert world.returncode == 1 and "plan is for 8 ranks, this job has 4" in world.stdout


def test_bad_input_is_one_line_exit_2_and_writes_nothing(plans, tmp_path):
    roomy, _ = plans
    bad = tmp_path / "bad.json"
    bad.write_text(roomy.read_text()[:200])  # truncated
    out = tmp_path / "report.txt"
    for args in (
        ["show", str(bad), "--out", str(out)],
        ["show", str(tmp_path / "none.json")],
        ["diff", str(roomy), str(bad), "--out", str(out)],
    ):
        r = (console if args[0] == "diff" else tool)(*args)
        assert r.returncode == 2, args
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
        assert not out.exists()
    r = tool("make", "--config", DEMO, "--world-size", "8", "--local-world-size", "3", "--out", str(out))
    assert r.returncode == 2 and "multiple of --local-world-size" in r.stderr and not out.exists()
    r = tool("make", "--config", DEMO, "--out", str(out), "--set", "model.nmae=x")
    assert r.returncode == 2 and "unknown key 'model.nmae'" in r.stderr and not out.exists()


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_make_names_the_option_the_user_gave_and_refuses_impossible_sizes(tmp_path):
    out = tmp_path / "p.json"
    assert (
        _one_line(tool("make", "--config", DEMO, "--world-size", "2", "--hbm-gb", "-1", "--out", str(out)))
        == "error: --hbm-gb -1: expected a size in GiB > 0 (leave it out for the default)"
    )
    assert (
        _one_line(tool("validate", str(out), "--ddr-gb", "-3"))
        == "error: --ddr-gb -3: expected a size in GiB > 0 (leave it out for the default)"
    )
    # no --local-world-size given: the topology's hosts are what the world size must fill
    assert _one_line(
        tool("make", "--config", DEMO, "--topology", "workstation-4gpu-nvlink-pairs", "--world-size", "2", "--out", str(out))
    ) == (
        "error: --world-size 2 does not fill whole hosts of topology workstation-4gpu-nvlink-pairs (4 ranks per host): "
        "give a multiple of 4, or a topology with 2 GPUs per host"
    )
    assert not out.exists()


def test_make_out_that_cannot_be_written_is_one_line_and_keeps_the_old_file(tmp_path):
    assert (
        _one_line(tool("make", "--config", DEMO, "--world-size", "2", "--out", str(tmp_path)))
        == f"error: --out {tmp_path} is a directory; give a file name, e.g. {tmp_path / 'plan.json'}"
    )
    top = Path(tempfile.mkdtemp())  # outside pytest's root-only tmp tree, so nobody can reach it
    top.chmod(0o755)
    ro = top / "ro"
    ro.mkdir()
    (ro / "plan.json").write_text("old")
    ro.chmod(0o555)
    as_nobody = os.geteuid() == 0  # root writes into a read-only directory: run the tool as nobody
    if as_nobody and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory stays writable")
    cmd = [sys.executable, "-m", "recsys.plan_cli", "make", "--config", DEMO, "--world-size", "2", "--out", str(ro / "plan.json")]
    if as_nobody:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert _one_line(r) == (f"error: cannot write --out {ro / 'plan.json'}: Permission denied; the previous file is unchanged")
        assert (ro / "plan.json").read_text() == "old" and sorted(p.name for p in ro.iterdir()) == ["plan.json"]
    finally:
        ro.chmod(0o755)
        shutil.rmtree(top)


SHARED_TOPO = REPO.parent / "shared" / "data" / "topo" / "8x-h100-sxm-nv18-no-nic.txt"


@pytest.mark.skipif(not SHARED_TOPO.exists(), reason="shared data not present")
def test_make_with_topology_from_nvidia_smi_text(tmp_path):
    """`make --topology topo.txt`: the nvidia-smi matrix is imported (capacities from the --gpu
    model's preset), kept next to the plan, and the topology-aware planner plans for its 8 GPUs;
    without a model or capacities it stops with one line instead of assuming an A100."""
    r = tool("make", "--config", DEMO, "--topology", str(SHARED_TOPO), "--out", str(tmp_path / "n.json"))
    assert r.returncode == 2 and "no GPU model: name it with --gpu" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "n.json").exists()
    out = tmp_path / "p.json"
    r = tool("make", "--config", DEMO, "--topology", str(SHARED_TOPO), "--gpu", "h100-sxm", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "hbm_gb: 80, hbm_bw_gb_s: 3350" in (tmp_path / "p.topology.yaml").read_text()
    plan = json.loads(out.read_text())
    assert plan["world_size"] == 8 and plan["meta"]["planner"] == "topology"
    imported = tmp_path / "p.topology.yaml"
    assert plan["meta"]["topology"] == str(imported) and imported.is_file()
    shown = tool("show", str(out), "--topology", str(imported))
    assert shown.returncode == 0 and "(slowest rank " in shown.stdout and "traffic by link kind" in shown.stdout
    bad = tmp_path / "bad.txt"
    bad.write_text(SHARED_TOPO.read_text().replace("NV18", "NVX", 1))
    r = tool("make", "--config", DEMO, "--topology", str(bad), "--out", str(tmp_path / "q.json"))
    assert r.returncode == 2 and "unknown token 'NVX'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.json").exists()


def test_diff_with_topology_reports_modeled_time_deltas(plans):
    roomy, tight = plans
    d = json.loads(tool("diff", str(roomy), str(tight), "--topology", "dgx-a100", "--format", "json").stdout)
    per_plan, steps = [], []
    for p in (roomy, tight):
        shown = json.loads(tool("show", str(p), "--topology", "dgx-a100", "--format", "json").stdout)
        per_plan.append([x / 1e3 for x in shown["modeled_step"]["rank_time_ms"]])  # the planner's model
        steps.append(shown["modeled_step"]["step_time_ms"] / 1e3)
    for r in d["ranks"]:
        assert r["modeled_s_delta"] == pytest.approx(per_plan[1][r["rank"]] - per_plan[0][r["rank"]], abs=2e-7)  # ms rounded to 4 places
    assert d["modeled_step_s"] == pytest.approx(steps)
    assert steps[0] >= max(per_plan[0])  # the step: the slowest rank's work or more (the busiest links)
    r = tool("diff", str(roomy), str(tight), "--topology", "dgx-a100-2host")
    assert r.returncode == 2 and "16 ranks, the plan has 8" in r.stderr


BIG_FEATURES = ["C3", "C4", "C12", "C16", "C21"]  # the raw Kaggle tables of 2M-10M rows


def _kernels_and_lfs(path: Path) -> dict[str, tuple[str, float | None]]:
    d = json.loads(path.read_text())
    return {
        t: (ps["compute_kernel"], (ps["cache_params"] or {}).get("load_factor"))
        for m in d["modules"].values()
        for t, ps in m["params"].items()
    }


def test_make_with_data_sample_sizes_uvm_caches(tmp_path):
    """HBM too short for the big tables (0.25 GB per GPU): with a skewed id histogram their UVM
    caches get the smallest load factor reaching 95% hits (0.01); with a uniform one (hit rate ==
    load factor) the load factor stays at the cap (0.8); `--model` works as `--config`."""
    skew, uni = tmp_path / "skew.json", tmp_path / "uni.json"
    skew.write_text(
        json.dumps(
            {
                "format": "recsys-id-histogram",
                "version": 1,
                "tables": {f: {"counts": [int(1e6 / r) + 2 for r in range(1, 20001)]} for f in BIG_FEATURES},
            }
        )
    )
    uni.write_text(json.dumps({f: {"counts": [1] * 50000} for f in BIG_FEATURES}))
    got = {}
    for name, sample in (("skew", skew), ("uni", uni)):
        out = tmp_path / f"{name}.json"
        r = tool(
            "make",
            "--model",
            DEMO,
            "--topology",
            "pcie-8gpu-2socket",
            "--hbm-gb",
            "0.25",
            "--out",
            str(out),
            "--data-sample",
            str(sample),
            *RAW,
        )
        assert r.returncode == 0, r.stderr
        got[name] = _kernels_and_lfs(out)
        meta = json.loads(out.read_text())["meta"]
        assert meta["data_sample"] == str(sample) and meta["target_hit_rate"] == 0.95
        assert set(meta["cache_sizing"]) == {f"{p}_{f}" for p in ("t", "w") for f in BIG_FEATURES}
        assert meta["cache_sizing"]["t_C3"]["target_load_factor"] == (0.01 if name == "skew" else 0.8)
    cached = [t for t, (k, _) in got["skew"].items() if k == "fused_uvm_caching"]
    assert cached, got["skew"]
    for t in cached:
        assert t[2:] in BIG_FEATURES
        assert got["skew"][t][1] == 0.01  # 20K hot ids hold every lookup: 1% of rows is plenty
        assert got["uni"][t][1] == 0.8 or got["uni"][t][0] != "fused_uvm_caching"
        assert got["uni"][t][1] > got["skew"][t][1]
    ok = tool("validate", str(tmp_path / "skew.json"), "--model", DEMO, "--hbm-gb", "0.25", *RAW)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_bad_data_sample_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "p.json"
    bad = tmp_path / "hist.json"
    bad.write_text(json.dumps({"tables": {"t_C3": {"counts": [3, 2, -1]}}}))
    for sample, expect in (
        (bad, f"{bad}: key 'tables.t_C3.counts[2]'"),
        (tmp_path / "none.json", "no such file"),
        ("synthetic:0", "positive row count"),
    ):
        r = tool("make", "--config", DEMO, "--topology", "dgx-a100", "--out", str(out), "--data-sample", str(sample))
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ") and expect in r.stderr, r.stderr
        assert not out.exists()


def test_cowclip_plan_memory_counts_two_moments_and_a_step_per_row(tmp_path):
    """A CowClip-Adam plan (`show` must not assume row-wise Adagrad for every table): each shard
    holds 4 B weights + two 4 B moments per weight + an 8 B step per row, counted from the file
    alone (no config), on CPU ranks all in host memory."""
    out = tmp_path / "cowclip.json"
    r = tool(
        "make", "--config", DEMO, "--world-size", "2", "--compute-device", "cpu", "--out", str(out), "--set", "optim.embedding=cowclip_adam"
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert {t["optimizer_state"]["kind"] for t in d["tables"].values()} == {"cowclip_adam"}
    expected = [0, 0]
    for m in d["modules"].values():
        for name, ps in m["params"].items():
            t = d["tables"][name]
            shards = ps["shards"] or [
                {"sizes": [t["num_embeddings"], t["embedding_dim"]], "placement": f"rank:{r}/cpu"} for r in ps["ranks"]
            ]
            for sh in shards:
                rows, cols = sh["sizes"]
                expected[int(sh["placement"].split("/")[0][5:])] += rows * cols * (4 + 8) + rows * 8
    rep = json.loads(tool("show", str(out), "--format", "json").stdout)
    assert [x["host_bytes"] for x in rep["ranks"]] == expected
    assert {t["optimizer"] for t in rep["tables"]} == {"cowclip_adam"}


def test_diff_of_plans_for_different_setups_says_so_and_shows_shapes(plans, tmp_path):
    """A CPU plan of small tables against a CUDA plan of raw-size ones: the setups and the table
    shapes differ, and the diff says so before any placement change."""
    roomy, _ = plans
    small = tmp_path / "small.json"
    r = tool(
        "make",
        "--config",
        str(REPO / "configs" / "experiments" / "smoke.yaml"),
        "--world-size",
        "8",
        "--compute-device",
        "cpu",
        "--out",
        str(small),
    )
    assert r.returncode == 0, r.stderr
    r = tool("diff", str(small), str(roomy))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "the plans are for different setups: compute_device cpu -> cuda, batch_size_per_rank 64 -> 512"
    c12 = next(ln for ln in lines if ln.startswith("  t_C12 "))
    assert "shape: 2,000 x 8 -> 8,351,593 x 16" in c12, c12
    d = json.loads(tool("diff", str(small), str(roomy), "--format", "json").stdout)
    assert d["plans"] == {"compute_device": ["cpu", "cuda"], "batch_size_per_rank": [64, 512]}
