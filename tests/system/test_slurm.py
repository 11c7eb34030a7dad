"""The train component on a real (single-node, localhost) Slurm cluster, submitted through
torchx's Python API. Needs a running cluster: `tools/ci/slurm_local.sh start` (root; .ci/run does
it) and RECSYS_SLURM=1; skipped otherwise.

torchx's own status call (`squeue --json`) fails on Debian's Slurm 22.05 (KeyError
'job_resources'), and `sacct` needs accounting, so the tests poll `scontrol show job -o ID`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("RECSYS_SLURM") != "1",
        reason="needs a local Slurm cluster: run `tools/ci/slurm_local.sh start` and set RECSYS_SLURM=1",
    ),
]

REPO = Path(__file__).resolve().parents[2]
COMPONENT = str(REPO / "torchx_components" / "launch.py") + ":train"
SMOKE = str(REPO / "configs" / "experiments" / "smoke.yaml")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _submit(submit_dir: Path, args: list[str]) -> str:
    """Submits the train component with torchx's runner from `submit_dir` (the job's working
    directory, where Slurm writes slurm-<id>-trainer-0.out/.err); returns the Slurm job id."""
    from torchx.runner import get_runner
    from torchx.specs import parse_app_handle

    submit_dir.mkdir(parents=True, exist_ok=True)
    old = os.getcwd()
    os.chdir(submit_dir)
    try:
        with get_runner() as runner:
            handle = runner.run_component(
                COMPONENT,
                ["--config", SMOKE, "--nproc_per_node", "2", "--cpu", "2", "--memMB", "4096", *args],
                "slurm",
                cfg={"partition": "debug", "time": "15"},
            )
    finally:
        os.chdir(old)
    return parse_app_handle(handle).app_id


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    fields = {}
    for tok in out.splitlines()[0].split():
        k, _, v = tok.partition("=")
        fields.setdefault(k, v)
    return fields


def _logs(submit_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(submit_dir.glob("slurm-*")))


def _wait(job_id: str, submit_dir: Path, timeout: float = 240, until=lambda j: j["JobState"] in FINAL) -> dict[str, str]:
    t0 = time.time()
    while True:
        j = _job(job_id)
        if until(j):
            return j
        if j["JobState"] in FINAL or time.time() - t0 > timeout:
            raise AssertionError(f"job {job_id}: {j['JobState']} after {time.time() - t0:.0f} s\n{_logs(submit_dir)}")
        time.sleep(1)


def test_train_component_runs_on_slurm(tmp_path):
    run_dir, submit = tmp_path / "run", tmp_path / "submit"
    job_id = _submit(submit, ["train.max_steps=40", "train.log_every=10", f"run_dir={run_dir}"])
    j = _wait(job_id, submit)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, _logs(submit))
    assert j["JobName"] == "trainer-0" and j["WorkDir"] == str(submit)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 40, s
    train = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x["kind"] == "train"][-1] == 40
    assert (submit / f"slurm-{job_id}-trainer-0.err").is_file()


def test_requeued_job_resumes_from_last_checkpoint(tmp_path):
    """Preemption: `scontrol requeue` kills the running job and puts it back in the queue; the
    requeued job (resume=true is the component's default) continues from the newest checkpoint."""
    run_dir, submit = tmp_path / "run", tmp_path / "submit"
    steps = 600
    job_id = _submit(
        submit,
        [
            f"train.max_steps={steps}",
            "train.epochs=10",
            "checkpoint.every_steps=20",
            "checkpoint.keep=100",
            "train.log_every=20",
            f"run_dir={run_dir}",
        ],
    )
    first = run_dir / "checkpoints" / "step_000000020" / "COMMITTED"
    t0 = time.time()
    while not first.exists():
        j = _job(job_id)
        assert j["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (j, _logs(submit))
        assert time.time() - t0 < 180, f"no checkpoint after 180 s\n{_logs(submit)}"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    # Slurm holds a requeued job back (BeginTime = requeue + AuthInfo cred_expire, 120 s by
    # default): once it is back in the queue, let it start now
    t1 = time.time()
    _wait(job_id, submit, timeout=60, until=lambda j: j["JobState"] == "PENDING" and int(j["Restarts"]) > 0)
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)
    print(f"requeued job {job_id} pending again after {time.time() - t1:.1f} s")
    j = _wait(job_id, submit, timeout=300)
    print(f"requeued job {job_id} done {time.time() - t1:.1f} s after the requeue")
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, _logs(submit))
    assert int(j["Restarts"]) == 1, j
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == steps and s["resumed_from"], s
    resumed_at = int(Path(s["resumed_from"]).name.split("_")[1])
    assert 20 <= resumed_at < steps, s
    # the metrics log reads like one uninterrupted run: each train step logged once
    logged = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if json.loads(ln)["kind"] == "train"]
    assert logged == sorted(set(logged)) and logged[-1] == steps, logged


def test_preprocess_component_fans_out_as_slurm_tasks_and_joins(tmp_path):
    """`recsys.preprocess --procs_per_task 2` on Slurm: one job, two task processes, each
    preprocessing its files into a part; the joined dataset equals a single-process
    preprocessing of the same files. (More tasks are more replicas, i.e. heterogeneous job
    components, which Slurm 22.05 puts on different nodes: this cluster has one.)"""
    import numpy as np
    from torchx.runner import get_runner
    from torchx.specs import parse_app_handle

    from recsys.config import load_config
    from recsys.data.shard_reader import ShardedDataset
    from recsys.data.source import prepare_data
    from tests.integration.data.test_preprocess_fanout import _criteo_lines

    raw, fan, submit = tmp_path / "raw", tmp_path / "fan", tmp_path / "submit"
    raw.mkdir()
    submit.mkdir()
    rng = np.random.default_rng(3)
    for i, n in enumerate([500, 300, 450, 200]):
        (raw / f"day_{i}.tsv").write_text("".join(_criteo_lines(rng, n)))
    data = ["data.source=criteo", f"data.path={raw}", "train.batch_size=128"]
    old = os.getcwd()
    os.chdir(submit)
    try:
        with get_runner() as runner:
            handle = runner.run_component(
                str(REPO / "torchx_components" / "launch.py") + ":preprocess",
                [
                    "--config",
                    SMOKE,
                    "--tasks",
                    "1",
                    "--procs_per_task",
                    "2",
                    "--cpu",
                    "2",
                    "--memMB",
                    "2048",
                    *data,
                    f"data.cache_dir={fan}",
                ],
                "slurm",
                cfg={"partition": "debug", "time": "15"},
            )
    finally:
        os.chdir(old)
    job_id = parse_app_handle(handle).app_id
    t0 = time.time()
    while True:  # every component of the job (one per task) in a final state
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
        states = [dict(t.partition("=")[::2] for t in line.split() if "=" in t) for line in out.splitlines() if line]
        if all(s["JobState"] in FINAL for s in states):
            break
        assert time.time() - t0 < 300, (states, _logs(submit))
        time.sleep(1)
    assert len(states) == 1 and states[0]["JobState"] == "COMPLETED", (states, _logs(submit))
    assert states[0]["JobName"] == "preprocess-0"
    out = (submit / f"slurm-{job_id}-preprocess-0.out").read_text()
    assert f"task 0 of 1 (parts 0-1 of 2): {fan} holds 1450 rows in 2 shards" in out, _logs(submit)
    manifest = json.loads((fan / "manifest.json").read_text())
    assert manifest["created_by"] == "recsys.data.preprocess.fanout.join_parts (2 parts)"
    ref = prepare_data(load_config(SMOKE, [*data, f"data.cache_dir={tmp_path / 'single'}"]))
    assert manifest["cache_key"] == ref["cache_key"] and manifest["num_rows"] == ref["num_rows"] == 1450
    a, b = ShardedDataset.open(fan), ShardedDataset.open(tmp_path / "single")
    for x, y in zip(a.read(0, a.num_rows), b.read(0, b.num_rows)):
        np.testing.assert_array_equal(x, y)


def test_preprocess_as_a_plain_slurm_array(tmp_path):
    """`sbatch --array=0-2` running `recsys preprocess` (no TorchX): each array task takes its
    number from SLURM_ARRAY_TASK_ID/COUNT; array tasks are separate jobs, so they share this one
    node; the last to finish joins, and the dataset equals a single-process preprocessing."""
    import numpy as np

    from recsys.config import load_config
    from recsys.data.shard_reader import ShardedDataset
    from recsys.data.source import prepare_data
    from tests.integration.data.test_preprocess_fanout import _criteo_lines

    raw, fan = tmp_path / "raw", tmp_path / "fan"
    raw.mkdir()
    rng = np.random.default_rng(5)
    for i, n in enumerate([300, 500, 200, 400]):
        (raw / f"day_{i}.tsv").write_text("".join(_criteo_lines(rng, n)))
    data = ["data.source=criteo", f"data.path={raw}", "train.batch_size=128"]
    script = tmp_path / "array.sh"
    script.write_text(
        f"#!/bin/bash\nexec {sys.executable} -m recsys.cli preprocess --config {SMOKE} " + " ".join(data) + f" data.cache_dir={fan}\n"
    )
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-2",
            "--partition=debug",
            "--time=10",
            "--cpus-per-task=1",
            "--mem=1500",
            f"--chdir={tmp_path}",
            f"--output={tmp_path}/array-%a.out",
            f"--export=ALL,PYTHONPATH={REPO}",
            str(script),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = r.stdout.strip().split(";")[0]
    t0 = time.time()
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        states = [dict(t.partition("=")[::2] for t in line.split() if "=" in t) for line in out.splitlines() if line]
        if states and len(states) == 3 and all(s["JobState"] in FINAL for s in states):
            break
        assert time.time() - t0 < 300, (states, [p.read_text()[-1500:] for p in tmp_path.glob("array-*.out")])
        time.sleep(1)
    logs = {p.name: p.read_text() for p in tmp_path.glob("array-*.out")}
    assert all(s["JobState"] == "COMPLETED" for s in states), (states, logs)
    lines = sorted(ln for text in logs.values() for ln in text.splitlines() if ln.startswith("task "))
    assert len(lines) == 3 and sum(f"{fan} holds 1400 rows" in ln for ln in lines) == 1, lines
    ref = prepare_data(load_config(SMOKE, [*data, f"data.cache_dir={tmp_path / 'single'}"]))
    a, b = ShardedDataset.open(fan), ShardedDataset.open(tmp_path / "single")
    assert a.manifest["cache_key"] == ref["cache_key"] and a.manifest["created_by"].endswith("(3 parts)")
    for x, y in zip(a.read(0, a.num_rows), b.read(0, b.num_rows)):
        np.testing.assert_array_equal(x, y)
