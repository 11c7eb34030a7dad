"""K-step merges with an outer optimizer (DiLoCo's Nesterov step) and bf16 deltas with error
feedback (recsys/training/kstep/outer.py; docs/kstep.md), over real replicas.

Fast: config checks; the merger on a plain model in 2 gloo processes (2 hosts of 1 rank) against an
independent recomputation of every merge from both replicas' pre-merge values; the hierarchical
route (2 hosts of 2 ranks) bitwise equal to the flat one; a resume between merges equal to the
uninterrupted run, and a resume onto other shapes saying so. Slow: two simulated hosts with
torchrun on the DeepFM smoke config, embedding rows merged lazily."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsys.config import ConfigError, load_config
from recsys.training.distributed import free_port
from tests.support.processes import start_workers
from tests.support.simulated_hosts import flat_checkpoint, train_on_hosts

REPO = Path(__file__).resolve().parents[3]
SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
LR, MU = 0.7, 0.9


def test_config_keys_and_bad_values_name_the_key():
    cfg = load_config(SMOKE, ["train.merge_every=4", "train.merge_outer=nesterov", "train.merge_compress=bf16"])
    t = cfg.train
    assert (t.merge_outer, t.merge_outer_lr, t.merge_outer_momentum, t.merge_compress) == ("nesterov", 0.7, 0.9, "bf16")
    assert load_config(SMOKE).train.merge_outer == "average" and load_config(SMOKE).train.merge_compress == "none"
    for overrides, message in (
        (["train.merge_every=4", "train.merge_outer=adam"], r"key 'train\.merge_outer': expected one of average, nesterov, got 'adam'$"),
        (["train.merge_every=4", "train.merge_compress=fp8"], r"key 'train\.merge_compress': expected one of none, bf16, got 'fp8'$"),
        (
            ["train.merge_every=4", "train.merge_outer_lr=0"],
            r"key 'train\.merge_outer_lr': 0(\.0)? must be positive \(1 with momentum 0: plain averaging\)$",
        ),
        (["train.merge_every=4", "train.merge_outer_momentum=1.0"], r"key 'train\.merge_outer_momentum': 1\.0 must be in \[0, 1\)$"),
        (["train.merge_outer=nesterov"], r"key 'train\.merge_outer': only meaningful with train\.merge_every > 0$"),
        (["train.merge_compress=bf16"], r"key 'train\.merge_compress': only meaningful with train\.merge_every > 0$"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            load_config(SMOKE, overrides)
        assert "\n" not in str(err.value)


# -- the merger on a plain model ----------------------------------------------------------------


def _model(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _moments(model, opt) -> torch.Tensor:
    return _flat(opt.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq"))


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _recompute_worker(rank: int, port: int, out: str, steps: int) -> None:
    """Each merge against an independent recomputation from both replicas' pre-merge values."""
    _init(rank, 2, port)
    from recsys.training.kstep.host_groups import build_host_groups
    from recsys.training.kstep.merger import KStepMerger

    groups = build_host_groups(2)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(steps, 2, 8, 4, generator=g), torch.randn(steps, 2, 8, 1, generator=g)
    results = {}
    for outer, compress in (("nesterov", "bf16"), ("nesterov", "none"), ("average", "bf16")):
        model, opt = _model()
        merger = KStepMerger(model, opt, groups.replica_pg, 2, merge_moments=True, outer=outer, compress=compress)
        anchor, m, residual = None, None, [None, None]  # the recomputation's state
        merges = []
        for s in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[s, rank]), ys[s, rank]).backward()
            opt.step()
            if not merger.should_merge(s + 1):
                continue
            mine = torch.cat([_flat(model.parameters()), _moments(model, opt)])
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine)
            n = mine.numel() // 3
            p = [b[:n] for b in both]
            mean_moments = (both[0][n:] + both[1][n:]) / 2
            if anchor is None:
                want = (p[0] + p[1]) / 2
                m, residual = torch.zeros(n), [torch.zeros(n), torch.zeros(n)]
            else:
                if compress == "bf16":
                    q = []
                    for i in range(2):
                        d = p[i] - anchor + residual[i]
                        q.append(d.to(torch.bfloat16))
                        residual[i] = d - q[i].float()
                    mean = anchor + (q[0].float() + q[1].float()).to(torch.bfloat16).float() / 2  # gloo sums in bf16
                else:
                    mean = (p[0] + p[1]) / 2
                if outer == "nesterov":
                    delta = anchor - mean
                    m = MU * m + delta
                    want = anchor - LR * (delta + MU * m)
                else:
                    want = mean
            anchor = want.clone()
            merger.step(s + 1)
            got = _flat(model.parameters())
            merges.append(
                {
                    "param_diff": (got - want).abs().max().item(),
                    "moment_diff": (_moments(model, opt) - mean_moments).abs().max().item(),
                    "moved": (got - p[rank]).abs().max().item(),
                    "divergence": merger.max_divergence(),
                    "payload": merger.payload_bytes_per_merge,
                }
            )
        if compress == "bf16":
            slot = merger.outer.slots["t0"]
            merges[-1]["residual_diff"] = (slot.residual.reshape(-1) - residual[rank][: slot.residual.numel()]).abs().max().item()
        results[f"{outer}_{compress}"] = merges
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_merges_equal_an_independent_recomputation_and_replicas_stay_equal(tmp_path):
    out = tmp_path / "out.json"
    start_workers(_recompute_worker, (free_port(), str(out), 8), 2)
    n = 4 * 8 + 8 + 8 + 1
    for arm, merges in json.loads(out.read_text()).items():
        assert len(merges) == 4, arm
        for i, r in enumerate(merges):
            assert r["divergence"] == 0.0, (arm, i, r)
            assert r["param_diff"] <= 1e-6 and r["moment_diff"] == 0.0, (arm, i, r)
            assert r["moved"] > 1e-4, (arm, i, r)
            # the first merge averages fp32 values (no anchor yet); then the parameters go as bf16 deltas
            params = 2 * n if arm.endswith("bf16") and i > 0 else 4 * n
            assert r["payload"] == params + 4 * 2 * n, (arm, i, r)
        if arm.endswith("bf16"):
            assert merges[-1]["residual_diff"] <= 1e-6, arm


def _route_worker(rank: int, port: int, out: str, steps: int) -> None:
    _init(rank, 4, port)
    from recsys.training.kstep.host_groups import build_host_groups
    from recsys.training.kstep.merger import KStepMerger

    groups = build_host_groups(2)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(steps, 2, 8, 4, generator=g), torch.randn(steps, 2, 8, 1, generator=g)

    def train(route: str) -> tuple[torch.Tensor, KStepMerger]:
        model, opt = _model()
        kw = dict(outer="nesterov", compress="bf16", host_pg=groups.host_pg, route=route)
        merger = KStepMerger(model, opt, groups.replica_pg, 2, merge_moments=True, **kw)
        for s in range(steps):
            opt.zero_grad()  # both ranks of a host see the host's data, as under DDP
            torch.nn.functional.mse_loss(model(xs[s, groups.host]), ys[s, groups.host]).backward()
            opt.step()
            merger.step(s + 1)
        return torch.cat([_flat(model.parameters()), _moments(model, opt)]), merger

    flat, mf = train("flat")
    hier, mh = train("auto")
    every = [torch.empty_like(hier) for _ in range(4)]
    dist.all_gather(every, hier)
    result = {
        "equal": bool(torch.equal(flat, hier)),
        "all_ranks_equal": all(torch.equal(every[0], e) for e in every),
        "routes": [mf.route, mh.route],
        "payload": [mf.payload_bytes_per_merge, mh.payload_bytes_per_merge],
        "divergence": mh.max_divergence(),
        "slot_shapes": {k: list(v.anchor.shape) for k, v in mh.outer.slots.items()},
    }
    results = [None] * 4
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_hierarchical_route_takes_the_step_on_slices_and_equals_flat(tmp_path):
    """The outer step and the bf16 deltas on each rank's 1/R slice before the all-gather: the
    same model, bit for bit, as the flat route, on all 4 ranks, for half the parameter bytes."""
    out = tmp_path / "out.json"
    start_workers(_route_worker, (free_port(), str(out), 8), 4)
    n = 4 * 8 + 8 + 8 + 1
    for r in json.loads(out.read_text()):
        assert r["equal"] and r["all_ranks_equal"] and r["divergence"] == 0.0, r
        assert r["routes"] == ["flat", "hierarchical"], r
        assert r["payload"] == [2 * n + 4 * 2 * n, 2 * -(-n // 2) + 4 * n], r  # bf16 parameters, fp32 moments
        assert list(r["slot_shapes"].values()) == [[-(-n // 2)]], r  # one slice of the parameters' bucket


def _resume_worker(rank: int, port: int, out: str, steps: int) -> None:
    _init(rank, 2, port)
    from recsys.training.kstep.host_groups import build_host_groups
    from recsys.training.kstep.merger import KStepMerger

    groups = build_host_groups(2)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(steps, 2, 8, 4, generator=g), torch.randn(steps, 2, 8, 1, generator=g)
    kw = dict(merge_moments=False, outer="nesterov", compress="bf16")

    def run(model, opt, merger, first: int, last: int) -> None:
        for s in range(first, last):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[s, rank]), ys[s, rank]).backward()
            opt.step()
            merger.step(s + 1)

    model, opt = _model()
    merger = KStepMerger(model, opt, groups.replica_pg, 4, **kw)
    run(model, opt, merger, 0, steps)
    straight = _flat(model.parameters())
    # the same run stopped at the merge of step 8 (a checkpoint), resumed in a fresh process state
    model, opt = _model()
    merger = KStepMerger(model, opt, groups.replica_pg, 4, **kw)
    run(model, opt, merger, 0, 8)
    saved = (model.state_dict(), opt.state_dict(), merger.state_dict())
    model, opt = _model(seed=5)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    merger = KStepMerger(model, opt, groups.replica_pg, 4, **kw)
    merger.load_state_dict(saved[2])
    run(model, opt, merger, 8, steps)
    resumed = _flat(model.parameters())
    # the state loaded into another model (other shapes; the last bias, 1 element, fits): one warning, momentum from zero
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("recsys.training.kstep.outer").addHandler(handler)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    KStepMerger(other, torch.optim.Adam(other.parameters()), groups.replica_pg, 4, **kw).load_state_dict(saved[2])
    result = {
        "equal": bool(torch.equal(straight, resumed)),
        "saved_keys": sorted(saved[2]["outer"]["momentum"]),
        "merges": merger.merges,
        "warnings": seen,
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_resume_between_merges_equals_the_uninterrupted_run(tmp_path):
    out = tmp_path / "out.json"
    start_workers(_resume_worker, (free_port(), str(out), 14), 2)
    r = json.loads(out.read_text())
    assert r["equal"], r  # momentum and residuals saved, anchors taken from the loaded model
    assert r["saved_keys"] == ["t0", "t1", "t2", "t3"] and r["merges"] == 3, r
    assert r["warnings"] == [
        "k-step merge: the checkpoint's outer state does not fit this plan (6 of 8 tensors, e.g. momentum t0): "
        "outer momentum and bf16 residuals restart from zero"
    ], r


# -- two simulated hosts with torchrun: embedding rows ------------------------------------------


@pytest.mark.parametrize(
    "optim",
    [["optim.embedding=rowwise_adagrad"], ["optim.embedding=cowclip_adam", "optim.embedding_lr=0.002", "optim.embedding_l2=0.0001"]],
    ids=["rowwise_adagrad", "cowclip_catchup"],
)
def test_two_hosts_nesterov_bf16_touched_rows_keep_replicas_equal(tmp_path, optim):
    """DeepFM on two simulated hosts, Nesterov outer step with bf16 deltas, touched rows merged
    lazily (with CowClip's catch-up the absent rows move at each merge, equally on every host,
    and their anchor follows): the replicas end equal and the model learns."""

    common = ["train.max_steps=24", "train.log_every=8", "train.merge_every=4", "train.merge_moments=true", *optim]
    s = train_on_hosts(tmp_path / "run", 2, [*common, "train.merge_outer=nesterov", "train.merge_compress=bf16"])
    assert s["merges"] == 6 and s["replica_divergence"] == 0.0, s
    assert s["merge_rows"] == "touched" and 0 < s["rows_merged_last"] <= s["rows_tracked"], s
    assert s["auc"] > 0.6, s


def test_two_hosts_resume_between_merges_with_lazy_anchors_equals_the_uninterrupted_run(tmp_path):
    """Touched rows with lazy anchors (row-wise Adagrad: no copy of a table is kept; bf16
    residuals and outer momentum per merged row, saved as rows and values): the run resumed
    from the checkpoint of step 16 ends with the uninterrupted run's weights, bit for bit."""
    common = [
        "train.max_steps=24",
        "train.log_every=8",
        "train.merge_every=4",
        "checkpoint.every_steps=8",
        "optim.embedding=rowwise_adagrad",
        "train.merge_outer=nesterov",
        "train.merge_compress=bf16",
    ]
    straight = tmp_path / "straight"
    a = train_on_hosts(straight, 2, common)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000000024", "summary.json"))
    saved = torch.load(resumed / "checkpoints" / "step_000000016" / "rank0.pt", weights_only=True)["state"]["merger"]["outer"]
    lazy = [v for v in saved["residual"].values() if isinstance(v, dict)]
    assert lazy and all(v["rows"].numel() == v["values"].shape[0] > 0 for v in lazy)  # merged rows, not tables
    b = train_on_hosts(resumed, 2, [*common, "resume=true"])
    assert b["resumed_from"].endswith("step_000000016") and a["replica_divergence"] == b["replica_divergence"] == 0.0
    wa = flat_checkpoint(straight / "checkpoints" / "step_000000024", tmp_path / "a.pt")
    wb = flat_checkpoint(resumed / "checkpoints" / "step_000000024", tmp_path / "b.pt")
    assert wa.keys() == wb.keys() and any("embedding_bags" in k for k in wa)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    assert a["merge_outer_state_bytes"] > 0
