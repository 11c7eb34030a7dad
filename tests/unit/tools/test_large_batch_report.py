"""`tools/experiments/large_batch.py --report`: the dated record of a grid that is still running (or was
stopped), from the runs finished so far, without training anything. The tool writes only under
--out and --bench, here both in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

from tools.experiments import large_batch as exp

DATE = "2026-01-02"  # --date of every report here: the record's name does not depend on the day the tests run


def _record(bench: Path, marker: str = "quick", date: str = DATE) -> tuple[Path, Path, Path]:
    """Where a report writes its record: the markdown, the results JSON and the plot."""
    name = f"{date}-large-batch-{marker}"
    return bench / f"{name}.md", bench / "results" / f"{name}.json", bench / "results" / f"{name}.png"


def _fake_run(out: Path, name: str, auc: float, evals: list[tuple[int, float, float]], clipped: float) -> None:
    """A finished run's files as the trainer writes them: summary.json and metrics.jsonl (train
    records with elapsed_s and the clipped share; an eval record per epoch)."""
    d = out / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(
        json.dumps(
            {
                "steps": evals[-1][0],
                "auc": auc,
                "logloss": 0.45,
                "oracle_auc": 0.80,
                "samples_per_s_this_run": 1000.0,
                "train_wall_s_this_run": 12.0,
            }
        )
    )
    lines = []
    for i, (step, epoch, eval_auc) in enumerate(evals):
        lines.append({"kind": "train", "step": step, "epoch": epoch, "elapsed_s": 10.0 * (i + 1), "clipped_row_fraction": clipped})
        lines.append({"kind": "eval", "step": step, "epoch": epoch, "auc": eval_auc, "logloss": 0.45})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (d / "exp_wall_s.txt").write_text("30.5\n")


def _report(out: Path, bench: Path, *args: str) -> None:
    """``exp_large_batch.py --report`` on the runs under ``out``, its record under ``bench``."""
    exp.main(["--report", "--out", str(out), "--bench", str(bench), "--date", DATE, *args])


def test_report_writes_the_finished_runs_and_says_how_many_are_missing(tmp_path, capsys):
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    # --quick plans batches 256 and 2048; with arms cowclip, sqrt, linear that is 5 runs (linear
    # shares sqrt's run at the base batch). Three have finished:
    _fake_run(out, "b256_cowclip", 0.7900, [(10, 1.0, 0.7850), (20, 2.0, 0.7900)], 0.01)
    _fake_run(out, "b256_sqrt", 0.7800, [(10, 1.0, 0.7700), (20, 2.0, 0.7800)], 0.0)
    _fake_run(out, "b2048_cowclip", 0.7880, [(1, 1.0, 0.7910), (2, 2.0, 0.7880)], 0.02)
    _report(out, bench, "--quick", "--arms", "cowclip", "sqrt", "linear")
    assert not (out / "b2048_sqrt").exists() and not (out / "b2048_linear").exists()  # nothing was trained

    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (head["runs_finished"], head["runs_planned"]) == (3, 5)
    md_path, json_path, png_path = _record(bench)
    res = json.loads(json_path.read_text())
    assert (res["runs_finished"], res["runs_planned"]) == (3, 5)
    runs = {(r["batch"], r["arm"]): r for r in res["runs"]}
    assert set(runs) == {(256, "cowclip"), (256, "sqrt"), (256, "linear"), (2048, "cowclip")}
    big = runs[(2048, "cowclip")]
    assert abs(big["auc_vs_base"] - (0.7880 - 0.7900)) < 1e-12
    assert abs(big["best_auc_vs_base"] - (0.7910 - 0.7900)) < 1e-12  # the epoch-1 eval beat the base's final AUC
    assert big["train_s_to_base_auc"] == 10.0  # elapsed at that eval
    assert big["clipped_share_per_epoch"] == [0.02, 0.02]
    assert runs[(256, "linear")]["auc"] == runs[(256, "sqrt")]["auc"]
    assert res["targets"] == {}  # targets are for batches of 64K and more: none claimed from these

    md = md_path.read_text()
    assert md.startswith(f"# {DATE}: large-batch grid `quick`")
    assert "**Partial: 3 of the 5 planned runs have finished**" in md
    assert md.count("| 2048 | cowclip") == 1 and "| 2048 | sqrt" not in md
    assert f"](results/{json_path.name})" in md and f"](results/{png_path.name})" in md
    assert png_path.stat().st_size > 10_000
    # nothing outside --out and --bench
    assert {p.relative_to(tmp_path).parts[0] for p in tmp_path.iterdir()} == {"runs", "benchmarks"}
    assert sorted(p.name for p in bench.rglob("*") if p.is_file()) == sorted([md_path.name, json_path.name, png_path.name])


def test_report_of_a_complete_grid_has_no_partial_note(tmp_path, capsys):
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_cowclip", 0.79, [(10, 1.0, 0.79)], 0.0)
    _fake_run(out, "b2048_cowclip", 0.78, [(1, 1.0, 0.78)], 0.0)
    _report(out, bench, "--quick", "--arms", "cowclip")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (head["runs_finished"], head["runs_planned"]) == (2, 2)
    assert "Partial" not in _record(bench)[0].read_text()

    # --no-record (alias --no-docs): the table on stdout only, nothing under --bench
    other = tmp_path / "other"
    exp.main(["--quick", "--report", "--out", str(out), "--bench", str(other), "--arms", "cowclip", "--no-docs"])
    assert "| 2048 | cowclip" in capsys.readouterr().out and not other.exists()


def test_arms_that_share_the_base_run_train_the_same_job_there():
    """No clip + rule, sqrt and linear differ only in their scaling rule; at the base batch each
    rule's factors are 1 and the warm-up is the same, so their effective configs must be equal
    (else sharing one run would report a wrong baseline for two arms)."""
    import dataclasses

    from recsys.config import load_config
    from recsys.optim.scaling import effective_optim

    def effective(arm: str, batch: int):
        cfg = load_config(exp.CONFIG, [f"train.batch_size={batch}", "optim.scale_from_batch=1024", *exp.ARMS[arm]])
        optim, warmup = effective_optim(cfg.optim, batch, 1000)
        return dataclasses.replace(optim, scale_rule="-"), warmup

    for group in exp.SAME_AT_BASE_GROUPS:
        assert len({repr(effective(a, 1024)) for a in group}) == 1
        assert len({repr(effective(a, 65536)) for a in group}) == len(group)  # and they do differ above it


def test_the_paper_grid_plans_each_base_run_once_and_the_decisive_cells_first():
    plan = exp.plan_runs([0], [1024, 8192, 65536, 131072], exp.DEFAULT_ARMS, 1024)
    assert len(plan) == 4 * len(exp.DEFAULT_ARMS) - 2  # sqrt and linear share no clip + rule's 1K run
    assert len(set(plan)) == len(plan)
    assert (0, 1024, "sqrt") not in plan and (0, 1024, "noclip_rule") in plan
    decisive = {(0, b, a) for b in (65536, 131072) for a in ("cowclip", "sqrt")}
    first = plan[: 2 + len(decisive)]
    assert set(first) == decisive | {(0, 1024, "cowclip"), (0, 1024, "noclip_rule")}  # sqrt's base run
    assert first.index((0, 131072, "cowclip")) < first.index((0, 65536, "cowclip"))
    then = {(0, b, a) for b in (65536, 131072) for a in ("cowclip_lazy", "noclip_rule", "linear")}
    then.add((0, 1024, "cowclip_lazy"))  # the lazy semantics' own base run
    assert set(plan[len(first) : len(first) + len(then)]) == then
    # without no clip + rule in the grid, sqrt runs its own base run and linear shares it
    assert exp.plan_runs([0], [1024, 65536], ["sqrt", "linear"], 1024) == [(0, 1024, "sqrt"), (0, 65536, "sqrt"), (0, 65536, "linear")]


def test_report_gives_sqrt_and_linear_the_no_clip_rule_base_run(tmp_path, capsys):
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_noclip_rule", 0.7900, [(10, 1.0, 0.7900)], 0.0)
    _fake_run(out, "b2048_sqrt", 0.7850, [(1, 1.0, 0.7850)], 0.0)
    _report(out, bench, "--quick", "--arms", "noclip_rule", "sqrt", "linear")
    res = json.loads(_record(bench)[1].read_text())
    runs = {(r["batch"], r["arm"]): r for r in res["runs"]}
    assert runs[(256, "sqrt")]["auc"] == runs[(256, "linear")]["auc"] == 0.7900
    assert abs(runs[(2048, "sqrt")]["auc_vs_base"] - (0.7850 - 0.7900)) < 1e-12
    assert (res["runs_finished"], res["runs_planned"]) == (2, 4)  # noclip_rule@256, and the three arms at 2048


def test_a_second_seed_repeats_only_the_decisive_cells_before_the_8k_cells():
    seed0 = exp.plan_runs([0], [1024, 8192, 65536, 131072], exp.DEFAULT_ARMS, 1024)
    plan = exp.plan_runs([0, 1], [1024, 8192, 65536, 131072], exp.DEFAULT_ARMS, 1024, ["cowclip", "noclip_rule", "sqrt"])
    again = [r for r in plan if r[0] == 1]
    assert set(again) == {(1, b, a) for b in (1024, 65536, 131072) for a in ("cowclip", "noclip_rule")} | {
        (1, 65536, "sqrt"),
        (1, 131072, "sqrt"),
    }  # sqrt's 1K run is no clip + rule's
    # the second seed: the targets' batches first (largest first), its 1K runs last
    assert again == [
        (1, 131072, "cowclip"),
        (1, 131072, "noclip_rule"),
        (1, 131072, "sqrt"),
        (1, 65536, "cowclip"),
        (1, 65536, "noclip_rule"),
        (1, 65536, "sqrt"),
        (1, 1024, "cowclip"),
        (1, 1024, "noclip_rule"),
    ]
    assert [r for r in plan if r[0] == 0] == seed0  # the first seed keeps its order
    # the first seed: the decisive arms at the targets' batches, then no clip + rule there (the
    # clip's share), then the lazy semantics (the default), then linear, then 8K
    assert seed0[:13] == [
        (0, 1024, "cowclip"),
        (0, 1024, "noclip_rule"),
        (0, 131072, "cowclip"),
        (0, 131072, "sqrt"),
        (0, 65536, "cowclip"),
        (0, 65536, "sqrt"),
        (0, 131072, "noclip_rule"),
        (0, 65536, "noclip_rule"),
        (0, 1024, "cowclip_lazy"),
        (0, 131072, "cowclip_lazy"),
        (0, 65536, "cowclip_lazy"),
        (0, 131072, "linear"),
        (0, 65536, "linear"),
    ]
    assert max(plan.index(r) for r in seed0[:13]) < min(plan.index(r) for r in again)
    first_8k = min(i for i, r in enumerate(plan) if r[1] == 8192)
    assert max(plan.index(r) for r in again) < first_8k
    # every repeat shares one tier: linear (a later tier in the first seed) runs with its batch
    linear = [
        r for r in exp.plan_runs([0, 1], [1024, 65536, 131072], exp.DEFAULT_ARMS, 1024, ["cowclip", "noclip_rule", "linear"]) if r[0] == 1
    ]
    assert linear == [
        (1, 131072, "cowclip"),
        (1, 131072, "noclip_rule"),
        (1, 131072, "linear"),
        (1, 65536, "cowclip"),
        (1, 65536, "noclip_rule"),
        (1, 65536, "linear"),
        (1, 1024, "cowclip"),
        (1, 1024, "noclip_rule"),
    ]
    assert exp.plan_runs([0, 1], [1024, 65536], ["cowclip"], 1024, None) == [
        (0, 1024, "cowclip"),
        (0, 65536, "cowclip"),
        (1, 65536, "cowclip"),
        (1, 1024, "cowclip"),
    ]


def test_a_resumed_run_reports_its_whole_training_time(tmp_path, capsys):
    """The trainer's clock restarts when a run resumes; the report adds the pieces (and gives no wall
    time: the tool could not time a piece that a stopped grid cut off)."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_cowclip", 0.79, [(10, 1.0, 0.785), (20, 2.0, 0.79)], 0.0)
    d = out / "b2048_cowclip"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(
        json.dumps(
            {"steps": 3, "auc": 0.791, "logloss": 0.45, "oracle_auc": 0.80, "samples_per_s_this_run": 1000.0, "train_wall_s_this_run": 7.0}
        )
    )
    recs = [
        {"kind": "train", "step": 1, "epoch": 1.0, "elapsed_s": 100.0},
        {"kind": "eval", "step": 1, "epoch": 1.0, "auc": 0.780, "logloss": 0.46},
        {"kind": "train", "step": 2, "epoch": 2.0, "elapsed_s": 4.0},  # resumed after epoch 1
        {"kind": "eval", "step": 2, "epoch": 2.0, "auc": 0.790, "logloss": 0.45},
        {"kind": "train", "step": 3, "epoch": 3.0, "elapsed_s": 7.0},
        {"kind": "eval", "step": 3, "epoch": 3.0, "auc": 0.791, "logloss": 0.45},
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in recs) + "\n")
    (d / "exp_wall_s.txt").write_text("9.0\n")  # the last piece only
    _report(out, bench, "--quick", "--arms", "cowclip")
    res = json.loads(_record(bench)[1].read_text())
    big = next(r for r in res["runs"] if r["batch"] == 2048)
    assert (big["train_s"], big["pieces"], big["wall_s"]) == (107.0, 2, None)
    assert big["train_s_to_base_auc"] == 104.0  # epoch 2 reached the base's 0.79: 100 s + 4 s
    assert [e["train_s"] for e in big["evals"]] == [100.0, 104.0, 107.0]
    assert "| 107 | 104 | - (2 pieces) |" in _record(bench)[0].read_text()


def test_the_report_compares_the_two_semantics_at_each_batch(tmp_path, capsys):
    """The final AUC of the reference semantics minus the lazy ones' at every batch where both ran
    (what the default scope follows), whatever each arm's own base run gave."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_cowclip", 0.7950, [(10, 1.0, 0.7950)], 0.01)
    _fake_run(out, "b256_cowclip_lazy", 0.7850, [(10, 1.0, 0.7850)], 0.0)
    _fake_run(out, "b2048_cowclip", 0.7960, [(1, 1.0, 0.7960)], 0.01)
    _fake_run(out, "b2048_cowclip_lazy", 0.7945, [(1, 1.0, 0.7945)], 0.0)
    _report(out, bench, "--quick", "--arms", "cowclip", "cowclip_lazy")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    diff = head["reference_minus_lazy"]
    assert set(diff) == {"@256", "@2048"}
    assert abs(diff["@256"] - 0.0100) < 1e-9 and abs(diff["@2048"] - 0.0015) < 1e-9
    runs = {(r["batch"], r["arm"]): r for r in json.loads(_record(bench)[1].read_text())["runs"]}
    assert abs(runs[(2048, "cowclip_lazy")]["auc_vs_base"] - 0.0095) < 1e-9  # against its own 256 run, not the reference's


def test_the_clip_contribution_is_cowclip_minus_no_clip_at_the_same_batch(tmp_path, capsys):
    """Not the difference of the two arms' gains over their own 1K runs: the clip's worth at the
    1K base (here 0.0010) must not be subtracted from its worth at the large batch."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b1024_cowclip", 0.7960, [(10, 1.0, 0.7960)], 0.05)
    _fake_run(out, "b1024_noclip_rule", 0.7950, [(10, 1.0, 0.7950)], 0.0)
    _fake_run(out, "b65536_cowclip", 0.7955, [(1, 1.0, 0.7955)], 0.02)
    _fake_run(out, "b65536_noclip_rule", 0.7940, [(1, 1.0, 0.7940)], 0.0)
    _report(out, bench, "--arms", "cowclip", "noclip_rule", "--batches", "1024", "65536", "--seeds", "0")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(head["targets"]["clip_contribution@65536"] - 0.0015) < 1e-9
    # and at every batch both arms ran, the base included (there the runs differ by the clip alone too)
    assert set(head["clip_contribution"]) == {"@1024", "@65536"}
    assert abs(head["clip_contribution"]["@1024"] - 0.0010) < 1e-9
    assert abs(head["clip_contribution"]["@65536"] - 0.0015) < 1e-9


def test_a_fresh_clone_reuses_the_runs_the_committed_results_json_records(tmp_path, capsys):
    """runs/ is not in git: on a fresh clone the finished runs' directories are gone, and --reuse
    must take them from the newest committed results JSON of the same marker under --bench
    (benchmarks/results/<date>-large-batch-<marker>.json) instead of retraining them; a JSON
    written for other overrides must not be taken, and an older dated record is never rewritten."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_cowclip", 0.7900, [(10, 1.0, 0.7850), (20, 2.0, 0.7900)], 0.01)
    _fake_run(out, "b2048_cowclip", 0.7880, [(1, 1.0, 0.7910), (2, 2.0, 0.7880)], 0.02)
    argv = ["--quick", "--out", str(out), "--bench", str(bench), "--arms", "cowclip"]
    exp.main([*argv, "--report", "--date", "2026-01-01"])
    old_md, old_json, _ = _record(bench, date="2026-01-01")
    first, first_md = json.loads(old_json.read_text()), old_md.read_text()
    capsys.readouterr()

    import shutil

    shutil.rmtree(out)  # a fresh clone: no run directories
    exp.main([*argv, "--reuse", "--date", DATE])  # every planned run is recorded: nothing to train
    log = capsys.readouterr().out
    assert log.count(f"(reused from {old_json}") == 2 and not out.joinpath("b2048_cowclip").exists()
    again = json.loads(_record(bench)[1].read_text())
    assert again["runs"] == first["runs"] and (again["runs_finished"], again["runs_planned"]) == (2, 2)
    assert old_md.read_text() == first_md and json.loads(old_json.read_text()) == first  # the older record stays as it was

    exp.main([*argv, "--report", "--date", DATE, "--set", "train.epochs=3"])  # other overrides: the record is not theirs
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (head["runs_finished"], head["runs_planned"]) == (0, 2)

    # the newest record (DATE) is the other overrides' after that report: a later report takes the newest one that is theirs
    exp.main([*argv, "--report", "--date", "2026-01-03"])
    log = capsys.readouterr().out
    assert log.count(f"(reused from {old_json}") == 2
    assert json.loads(log.strip().splitlines()[-1])["runs_finished"] == 2


def test_the_seed_spread_of_a_cell_is_the_range_of_its_seeds_final_aucs(tmp_path, capsys):
    """What a second seed moves a cell is the yardstick of a 0.001 difference: the max minus the min
    of the cell's final AUCs over seeds, only for cells with more than one seed, and a run shared
    at the base batch counted once."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b1024_cowclip", 0.7960, [(10, 1.0, 0.7960)], 0.05)
    _fake_run(out, "b1024_noclip_rule", 0.7950, [(10, 1.0, 0.7950)], 0.0)
    _fake_run(out, "b65536_cowclip", 0.7955, [(1, 1.0, 0.7955)], 0.02)
    _fake_run(out, "b65536_cowclip_s1", 0.7948, [(1, 1.0, 0.7948)], 0.02)
    _fake_run(out, "b65536_noclip_rule", 0.7940, [(1, 1.0, 0.7940)], 0.0)
    _report(out, bench, "--arms", "cowclip", "noclip_rule", "linear", "--batches", "1024", "65536", "--seeds", "0", "1")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(head["seed_spread"]) == {"cowclip@65536"}
    assert abs(head["seed_spread"]["cowclip@65536"] - 0.0007) < 1e-9


def test_arm_differences_pair_the_seeds_that_ran_both_arms(tmp_path, capsys):
    """While a second seed has run CowClip and not yet no clip + rule (or the lazy semantics), the
    clip's contribution and reference minus lazy must not take seed 1's CowClip against seed 0's
    other arm: a seed's shift would pass for the clip's worth."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b1024_cowclip", 0.7960, [(10, 1.0, 0.7960)], 0.05)
    _fake_run(out, "b1024_noclip_rule", 0.7950, [(10, 1.0, 0.7950)], 0.0)
    _fake_run(out, "b65536_cowclip", 0.7955, [(1, 1.0, 0.7955)], 0.02)
    _fake_run(out, "b65536_cowclip_s1", 0.7935, [(1, 1.0, 0.7935)], 0.02)  # seed 1 sits 0.002 lower
    _fake_run(out, "b65536_noclip_rule", 0.7950, [(1, 1.0, 0.7950)], 0.0)
    _fake_run(out, "b65536_cowclip_lazy", 0.7900, [(1, 1.0, 0.7900)], 0.0)
    argv = [
        "--report",
        "--out",
        str(out),
        "--bench",
        str(bench),
        "--date",
        DATE,
        "--arms",
        "cowclip",
        "cowclip_lazy",
        "noclip_rule",
        "--batches",
        "1024",
        "65536",
        "--seeds",
        "0",
        "1",
    ]
    exp.main(argv)
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(head["targets"]["clip_contribution@65536"] - 0.0005) < 1e-9  # seed 0 alone, not 0.7945 - 0.7950
    assert abs(head["reference_minus_lazy"]["@65536"] - 0.0055) < 1e-9

    _fake_run(out, "b65536_noclip_rule_s1", 0.7925, [(1, 1.0, 0.7925)], 0.0)
    exp.main(argv)
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(head["targets"]["clip_contribution@65536"] - 0.00075) < 1e-9  # mean of +0.0005 and +0.0010


def test_only_trains_the_named_cells_and_still_reports_every_finished_run(tmp_path, capsys, monkeypatch):
    """--only picks the planned cells to train (one that fits the time a machine has left), and the
    record still covers the whole plan: finished runs reused, the others left out, not dropped from the
    JSON's plan count. The trainer is replaced by a recorder here: what is tested is which cells the
    tool asks it for (the trainer's own runs are the other tests' and the grid's)."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b256_cowclip", 0.7900, [(10, 1.0, 0.7850), (20, 2.0, 0.7900)], 0.01)
    trained = []

    def fake_run(config, overrides, run_dir, log_path, resume):
        trained.append(run_dir.name)
        _fake_run(out, run_dir.name, 0.7890, [(1, 1.0, 0.7890)], 0.0)
        return exp._load(run_dir)

    monkeypatch.setattr(exp, "_run", fake_run)
    argv = ["--quick", "--reuse", "--out", str(out), "--bench", str(bench), "--date", DATE, "--arms", "cowclip", "sqrt"]
    exp.main([*argv, "--only", "2048:sqrt"])
    assert trained == ["b2048_sqrt"]  # not b256_sqrt nor b2048_cowclip, though both are unfinished
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (head["runs_finished"], head["runs_planned"]) == (2, 4)

    exp.main([*argv, "--only", "2048:sqrt:0", "256:cowclip"])  # both finished now: nothing to train
    assert trained == ["b2048_sqrt"]
    capsys.readouterr()
    for bad, says in (
        ("4096:cowclip", "not a planned run"),
        ("2048:cowclip:1", "not a planned run"),
        ("2048", "expected BATCH:ARM[:SEED]"),
        ("big:cowclip", "expected BATCH:ARM[:SEED]"),
    ):
        try:
            exp.main([*argv, "--only", bad])
        except SystemExit as e:
            assert says in str(e) and bad in str(e)
        else:
            raise AssertionError(f"--only {bad} was accepted")


def test_targets_by_seed_judge_each_seed_against_its_own_base_and_each_rule_alone(tmp_path, capsys):
    """A rule that diverges on one seed and not on the other fails the verdict on that other seed,
    which the mean over seeds hides; sqrt and linear each get a verdict, and a seed without a run
    gets None, not a pass."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b1024_cowclip", 0.7960, [(10, 1.0, 0.7960)], 0.05)
    _fake_run(out, "b1024_noclip_rule", 0.7950, [(10, 1.0, 0.7950)], 0.0)  # sqrt's and linear's base too
    _fake_run(out, "b1024_cowclip_s1", 0.7964, [(10, 1.0, 0.7964)], 0.05)
    _fake_run(out, "b1024_noclip_rule_s1", 0.7956, [(10, 1.0, 0.7956)], 0.0)
    _fake_run(out, "b131072_cowclip", 0.7962, [(1, 1.0, 0.7962)], 0.0)  # +0.0002
    _fake_run(out, "b131072_cowclip_s1", 0.7950, [(1, 1.0, 0.7950)], 0.0)  # -0.0014: outside 0.001
    _fake_run(out, "b131072_sqrt", 0.7750, [(1, 1.0, 0.7750)], 0.0)  # -0.0200
    _fake_run(out, "b131072_linear", 0.7790, [(1, 1.0, 0.7790)], 0.0)  # -0.0160 (diverged)
    _fake_run(out, "b131072_linear_s1", 0.7970, [(1, 1.0, 0.7970)], 0.0)  # +0.0014 against its own base
    _report(out, bench, "--arms", "cowclip", "noclip_rule", "sqrt", "linear", "--batches", "1024", "131072", "--seeds", "0", "1")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by_seed = head["targets_by_seed"]
    assert by_seed["0"] == {
        "cowclip_within_0.001@131072": True,
        "sqrt_loses_2x_cowclip@131072": True,
        "linear_loses_2x_cowclip@131072": True,
    }
    # seed 1: CowClip lost 0.0014, so linear must lose more than 0.0028 to pass; it gained; no sqrt run
    assert by_seed["1"] == {
        "cowclip_within_0.001@131072": False,
        "sqrt_loses_2x_cowclip@131072": None,
        "linear_loses_2x_cowclip@131072": False,
    }
    # the mean over seeds passes linear (-0.0073 against CowClip's -0.0006): what by_seed is there for
    assert head["targets"]["sqrt_linear_lose_2x_cowclip@131072"] is True
    assert json.loads(_record(bench, "paper")[1].read_text())["targets_by_seed"] == by_seed


def test_the_lr_arm_is_compared_with_cowclip_at_the_same_batch_and_stays_out_of_the_verdicts(tmp_path, capsys):
    """``lr1e-3_minus_paper_lr``: CowClip at embedding lr 1e-3 minus CowClip at the paper's lr, at
    each batch both ran; the lr arm's own gain over its 1K run is in ``auc_vs_base`` and never
    stands in for CowClip in the targets (here it would turn a failed verdict into a pass)."""
    out, bench = tmp_path / "runs", tmp_path / "benchmarks"
    _fake_run(out, "b1024_cowclip", 0.7958, [(10, 1.0, 0.7958)], 0.05)
    _fake_run(out, "b1024_cowclip_lr1e-3", 0.7970, [(10, 1.0, 0.7970)], 0.06)
    _fake_run(out, "b65536_cowclip", 0.7930, [(1, 1.0, 0.7930)], 0.02)  # -0.0028: fails the 0.001 target
    _fake_run(out, "b65536_cowclip_lr1e-3", 0.7975, [(1, 1.0, 0.7975)], 0.02)  # +0.0005 over its own base
    _report(out, bench, "--arms", "cowclip", "cowclip_lr1e-3", "--batches", "1024", "65536", "--seeds", "0")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    diff = head["lr1e-3_minus_paper_lr"]
    assert set(diff) == {"@1024", "@65536"}
    assert abs(diff["@1024"] - 0.0012) < 1e-9 and abs(diff["@65536"] - 0.0045) < 1e-9
    assert abs(head["auc_vs_base"]["cowclip_lr1e-3@65536"] - 0.0005) < 1e-9
    assert head["targets"]["cowclip_within_0.001@65536"] is False
    assert head["targets_by_seed"]["0"]["cowclip_within_0.001@65536"] is False
