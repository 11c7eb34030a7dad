"""The drop-in API in a stock TorchRec pipeline (docs/dropin.md): torchrec's DLRM trained by a
TrainPipelineSparseDist loop that steps only its non-fused optimizer, with the documented lines
for the planner, the CowClip sharder and the k-step merger (tests/support/dropin_worker.py).

Fast: the doc's lines are the lines the worker runs. Slow: 2 gloo ranks on one host (the sharding
DMP built is the planner's plan; every table changes), and 2 simulated hosts (two torchrun
launches joined on loopback, 1 and 2 ranks each) merged every 2 steps and at the last step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys.training.distributed import free_port
from tests.support.processes import start_workers
from tests.support.simulated_hosts import run_agents

REPO = Path(__file__).resolve().parents[3]
# RECSYS_TEST_INSTALLED=1: test the installed distribution (a wheel; tools/ci/stack_tier.sh), with its
# compiled CowClip op, instead of this checkout
INSTALLED = os.environ.get("RECSYS_TEST_INSTALLED", "") not in ("", "0")
WORKER = REPO / "tests" / "support" / "dropin_worker.py"
DOC = REPO / "docs" / "dropin.md"


def doc_lines() -> list[str]:
    """The code lines of the doc's blocks marked ``<!-- dropin:lines -->``."""
    text = DOC.read_text()
    blocks = re.findall(r"<!-- dropin:lines -->\s*```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{DOC}: no ```python block after <!-- dropin:lines -->"
    lines = [ln.strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


# What torchrec's examples/golden_training/train_dlrm.py defines where the doc's block goes (in its
# train(), after train_model is built) and in its loop: the block may read these and nothing else
# it does not define itself (pasted into the script, it must not stop with a NameError).
TRAIN_DLRM_NAMES = {
    "os",
    "torch",
    "dist",
    "DistributedModelParallel",
    "num_embeddings",
    "embedding_dim",
    "learning_rate",
    "rank",
    "device",
    "backend",
    "eb_configs",
    "dlrm_model",
    "train_model",
    "non_fused_optimizer",
    "train_pipeline",
    "train_iterator",
}


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_blocks_read_only_names_train_dlrm_defines():
    import ast
    import builtins

    for block in doc_blocks():
        tree = ast.parse(block)
        defined = set(TRAIN_DLRM_NAMES) | set(dir(builtins))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert not read - defined, f"{DOC.name}: a block reads names train_dlrm.py does not define: {read - defined}"


def test_doc_lines_are_the_tested_lines():
    worker = {ln.strip() for ln in WORKER.read_text().splitlines()}
    lines = doc_lines()
    missing = [ln for ln in lines if ln not in worker]
    assert not missing, f"lines of {DOC.name} the test does not run: {missing}"
    joined = "\n".join(lines)
    for name in (
        "TopologyAwarePlanner(",
        "CowClipEmbeddingBagCollectionSharder()",
        "tag_cowclip_adam(",
        "KStepMergeHook(",
        "merger.step(",
        "save_plan(",
        "collective_plan(",
    ):
        assert name in joined, name


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if INSTALLED:
        return env
    # the CowClip C++ op is covered by tests/integration/cowclip/kernels/test_cpp_op.py; the reference keeps this
    # test free of a first-use build on every new checkout
    env["RECSYS_NO_CPP"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _results(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_dropin_two_ranks_follow_the_plan_and_train(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER), "single", str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = _results(tmp_path, 2)
    for r in res:
        assert r["hosts"] == 1 and r["host_world"] == 2
        assert r["built"] == r["plan"]  # DMP's ShardedTensors are laid out as the planner said
        assert r["merges"] == 0
    assert res[0]["plan"] == res[1]["plan"]
    types = res[0]["types"]
    assert types == {f"t_cat_{i}": ("row_wise", "table_wise", "column_wise")[i % 3] for i in range(4)}
    ranks = {t: {sh[2] for sh in v} for t, v in res[0]["plan"].items()}
    assert all(ranks[t] == {0, 1} for t in types if types[t] == "row_wise")
    # every table moved (its rows are on one rank or split over both), with only the dense
    # optimizer given to the pipeline: CowClip updates in backward
    moved = {t: max(r["table_delta"].get(t, 0.0) for r in res) for t in types}
    assert all(d > 0 for d in moved.values()), moved
    if (tmp_path / "plan.json").exists():  # save_plan(plan, path, model=...): the plan-file branch's signature
        from sharding import load_plan

        loaded = load_plan(tmp_path / "plan.json")
        shards = {
            t: sorted((list(s.shard_offsets), list(s.shard_sizes), s.placement.rank()) for s in ps.sharding_spec.shards)
            for m in loaded.plan.values()
            for t, ps in m.items()
        }
        assert json.loads(json.dumps(shards)) == res[0]["plan"]
        # written after DMP, as the doc does, it equals the file written before DMP: tables, shapes,
        # CowClip-Adam state and the planner's batch read from the sharded modules
        after, before = (json.loads((tmp_path / n).read_text()) for n in ("plan.json", "plan_before_dmp.json"))
        assert after == before
        assert {n: (t["num_embeddings"], t["embedding_dim"], t["optimizer_state"]["kind"]) for n, t in after["tables"].items()} == {
            f"t_cat_{i}": (200, 8, "cowclip_adam") for i in range(4)
        }
        assert after["meta"]["batch_size_per_rank"] == 16 and after["meta"]["topology"].startswith("cpu-gloo")


@pytest.mark.parametrize("per_host", [1, 2])
def test_dropin_two_hosts_merge_to_the_mean(tmp_path, per_host):
    run_agents(2, per_host, tmp_path.name, [str(WORKER), "merge", str(tmp_path)], cwd=tmp_path, env=_env(), timeout=900)
    res = _results(tmp_path, 2 * per_host)
    for r in res:
        assert r["hosts"] == 2 and r["host_world"] == per_host
        assert r["built"] == r["plan"]  # DMP built the plan the planner gave this host
        host = r["rank"] // per_host  # one plan for every host, on the host's own global ranks
        shifted = {t: [[o, s, rk - host * per_host] for o, s, rk in v] for t, v in r["plan"].items()}
        assert shifted == res[0]["plan"]
        # 3 steps, every_k=2: a merge at step 2 and the final one at step 3 (total_steps)
        assert [c["step"] for c in r["checks"]] == [2, 3] and r["merges"] == 2
        for c in r["checks"]:
            assert c["tensors"] >= 4 + 2  # 4 tables + the dense layers
            assert c["max_move_by_merge"] > 1e-4  # the hosts had diverged: merging moved something
            assert c["max_err_vs_mean"] < 1e-6  # == mean of the pre-merge replicas
            assert c["max_spread_after"] == 0.0  # bitwise equal on both hosts
    tables = res[0]["types"]
    assert all(max(r["table_delta"].get(t, 0.0) for r in res) > 0 for t in tables)


# -- KStepMergeHook on a plain model: 2 processes = 2 hosts of 1 rank (fast) ----------------------


def _hook_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROUP_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from recsys import KStepMergeHook

    def run(hook, steps, use_with):
        torch.manual_seed(1 + rank)  # the hosts start apart
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        weights = []
        steps_done = []

        def train():
            for s in range(steps):
                opt.zero_grad()
                model(torch.full((4, 3), float(rank + s))).square().mean().backward()
                opt.step()
                hook.step(model, opt)
                steps_done.append(hook.steps)
            weights.append(model.weight.detach().clone())

        if use_with:
            with hook:
                train()
        else:
            train()
        return model, opt, weights[0]

    results = {}
    # hosts from torchrun's GROUP_WORLD_SIZE; total_steps: merges at 2, 4 and the last step 5
    hook = KStepMergeHook(every_k=2, total_steps=5)
    model, opt, _ = run(hook, 5, use_with=False)
    w = model.weight.detach().clone()
    other = w.clone()
    dist.broadcast(other, src=0)
    results["total_steps"] = {
        "hosts": hook.hosts,
        "env_world": hook.env.world_size,
        "merges": hook.merges,
        "equal": torch.equal(other, w),
        "finish_again": hook.finish(),
    }
    try:
        hook.step(torch.nn.Linear(3, 2), opt)
    except ValueError as e:
        results["other_model"] = str(e)
    # a `with` block merges the steps left at its end (3 steps, k=2: at 2 and at the exit)
    hook = KStepMergeHook(every_k=2, hosts=2)
    model, _, before_exit = run(hook, 3, use_with=True)
    w = model.weight.detach().clone()
    other = w.clone()
    dist.broadcast(other, src=0)
    gathered = [torch.empty_like(before_exit) for _ in range(2)]
    dist.all_gather(gathered, before_exit)
    results["with"] = {
        "merges": hook.merges,
        "equal": torch.equal(other, w),
        "mean_err": float((w - (gathered[0] + gathered[1]) / 2).abs().max()),
        "apart_before": float((gathered[0] - gathered[1]).abs().max()),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_merge_hook_counts_steps_merges_at_k_and_at_the_end(tmp_path):
    out = tmp_path / "out.json"
    start_workers(_hook_worker, (free_port(), str(out)), 2)
    res = json.loads(out.read_text())
    t = res["total_steps"]
    assert (t["hosts"], t["env_world"], t["merges"], t["equal"], t["finish_again"]) == (2, 1, 3, True, False)
    assert res["other_model"] == "KStepMergeHook.step: called with another model or optimizer than at the first step"
    w = res["with"]
    assert w["merges"] == 2 and w["equal"] and w["apart_before"] > 1e-3 and w["mean_err"] < 1e-7


def test_merge_hook_needs_a_process_group():
    import torch.distributed as dist

    from recsys import KStepMergeHook

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"^KStepMergeHook: call torch.distributed.init_process_group\(\) first$"):
        KStepMergeHook(every_k=4)
