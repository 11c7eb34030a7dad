"""Experiment: does CowClip keep AUC when the batch grows, where sqrt / linear scaling do not?

DeepFM on generated Criteo-like data, the same number of epochs at every batch size, arms:

  a      CowClip-Adam + the CowClip scaling rule (embedding lr x1, L2 x s, dense lr x sqrt(s), dense
         warmup over the first epoch), L2 on the batch's rows (lazy, the default)
  a_all  as a, L2 (and Adam) on every row every step: the reference's dense semantics
  b      no clipping (lazy Adam) + sqrt scaling (every lr x sqrt(s))
  c      no clipping (lazy Adam) + linear scaling (every lr x s)

Every run is a real training job (`python -m recsys.cli train`, torchrun, gloo, DMP, our fused
kernel). At the base batch the rules coincide, so b and c share one run there. Writes
the table into `docs/large_batch.md` (between its results markers) and `docs/large_batch.png`
(AUC vs batch) unless --no-docs; the
last stdout line is one JSON object with the headline figures.

    .venv/bin/python tools/exp_large_batch.py                 # configs/experiments/large_batch.yaml
    .venv/bin/python tools/exp_large_batch.py --quick         # tiny, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "experiments" / "large_batch.yaml"

ARMS = {
    "a": ["optim.embedding=cowclip_adam", "optim.scale_rule=cowclip"],
    "a_all": ["optim.embedding=cowclip_adam", "optim.scale_rule=cowclip", "optim.embedding_l2_scope=all"],
    "b": ["optim.embedding=adam", "optim.scale_rule=sqrt"],
    "c": ["optim.embedding=adam", "optim.scale_rule=linear"],
}
LABELS = {
    "a": "CowClip + CowClip rule",
    "a_all": "CowClip + rule, L2 on all rows",
    "b": "no clip + sqrt rule",
    "c": "no clip + linear rule",
}


def _run(config: Path, overrides: list[str], run_dir: Path, log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(config), f"run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        r = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise SystemExit(f"run failed ({' '.join(overrides)}), log {log_path}:\n{tail}")
    s = json.loads((run_dir / "summary.json").read_text())
    s["wall_s"] = wall
    (run_dir / "exp_wall_s.txt").write_text(f"{wall}\n")
    return s


def _plot(results: list[dict], base: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm in ARMS:
        pts = sorted((r["batch"], r["auc"]) for r in results if r["arm"] == arm)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS[arm])
    oracle = [r["oracle_auc"] for r in results]
    if oracle:
        ax.axhline(sum(oracle) / len(oracle), color="grey", ls=":", label="oracle (teacher) AUC")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel("eval AUC")
    ax.set_title(f"DeepFM, generated Criteo-like data, same epochs (base batch {base})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _table(results: list[dict], base: int) -> str:
    base_auc = {r["arm"]: r["auc"] for r in results if r["batch"] == base}
    lines = [
        "| batch | arm | AUC | vs batch-" + str(base) + " | oracle AUC | logloss | steps | train s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["batch"], list(ARMS).index(r["arm"]))):
        ref = base_auc.get(r["arm"], base_auc.get("b" if r["arm"] == "c" else r["arm"]))
        delta = f"{r['auc'] - ref:+.4f}" if ref is not None else "-"
        lines.append(
            f"| {r['batch']} | {r['arm']} ({LABELS[r['arm']]}) | {r['auc']:.4f} | {delta} | {r['oracle_auc']:.4f} | "
            f"{r['logloss']:.4f} | {r['steps']} | {r['train_wall_s_this_run']:.0f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG, help="base experiment YAML (hyperparameters for --base-batch)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 8192, 65536])
    ap.add_argument("--base-batch", type=int, default=1024)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "exp_large_batch")
    ap.add_argument("--docs", type=Path, default=REPO / "docs", help="where large_batch.md/.png go")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep runs that already finished in --out")
    ap.add_argument("--quick", action="store_true", help="tiny data and batches: a smoke test of the tool")
    a = ap.parse_args(argv)
    extra = list(a.set)
    batches = sorted(a.batches)
    if a.quick:
        extra = ["data.train_rows=40000", "data.eval_rows=8192", "model.dnn=[32]", "train.eval_batch_size=4096", *extra]
        batches, a.base_batch = [256, 2048], 256
    if a.base_batch not in batches:
        raise SystemExit(f"--base-batch {a.base_batch} must be one of --batches {batches}")
    a.out.mkdir(parents=True, exist_ok=True)

    plan = []
    for b in batches:
        for arm in a.arms:
            if b == a.base_batch and arm == "c" and "b" in a.arms:
                continue  # at the base batch the sqrt and linear rules are the same run
            plan.append((b, arm))
    results: list[dict] = []
    t_start = time.perf_counter()
    for i, (b, arm) in enumerate(plan):
        overrides = [f"train.batch_size={b}", f"optim.scale_from_batch={a.base_batch}", *ARMS[arm], *extra]
        name = f"b{b}_{arm}"
        done = time.perf_counter() - t_start
        eta = f", ETA {done / i * (len(plan) - i) / 60:.1f} min" if i else ""
        print(f"[{i + 1}/{len(plan)}] batch {b} arm {arm} ({LABELS[arm]}){eta}", flush=True)
        done_summary = a.out / name / "summary.json"
        if a.reuse and done_summary.is_file():  # a finished run of an interrupted experiment
            s = json.loads(done_summary.read_text())
            wall_file = a.out / name / "exp_wall_s.txt"
            s["wall_s"] = float(wall_file.read_text()) if wall_file.is_file() else s["train_wall_s_this_run"]
            print("    (reused)", flush=True)
        else:
            s = _run(a.config, overrides, a.out / name, a.out / f"{name}.log")
        s.update(batch=b, arm=arm)
        results.append(s)
        print(f"    auc {s['auc']:.4f} (oracle {s['oracle_auc']:.4f}) logloss {s['logloss']:.4f} "
              f"{s['samples_per_s_this_run']:,.0f} samples/s, {s['wall_s']:.0f} s", flush=True)
        if b == a.base_batch and arm == "b" and "c" in a.arms:
            results.append(dict(s, arm="c"))
    (a.out / "results.json").write_text(json.dumps(results, indent=1))

    table = _table(results, a.base_batch)
    print(table)
    if not a.no_docs:
        a.docs.mkdir(parents=True, exist_ok=True)
        _plot(results, a.base_batch, a.docs / "large_batch.png")
        doc = a.docs / "large_batch.md"  # the table between the results markers
        start, end = "<!-- results:start -->\n", "\n<!-- results:end -->"
        text = doc.read_text() if doc.is_file() else f"# Large-batch experiment\n\n{start}{end}\n"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            doc.write_text(head + start + table + end + rest.split(end, 1)[1])
    auc = {f"{r['arm']}@{r['batch']}": round(r["auc"], 5) for r in results}
    base = {r["arm"]: r["auc"] for r in results if r["batch"] == a.base_batch}
    top = max(batches)
    drop = {arm: round(r["auc"] - base[arm], 5) for r in results for arm in [r["arm"]]
            if r["batch"] == top and arm in base}
    headline = {
        "base_batch": a.base_batch,
        "max_batch": top,
        "auc": auc,
        "auc_change_at_max_batch": drop,
        "cowclip_within_0.001": (abs(drop["a"]) <= 0.001 or drop["a"] > 0) if "a" in drop else None,
        "load_average": os.getloadavg()[0],
        "total_wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
