"""Training curves as a picture: eval AUC against the oracle, train loss, throughput.

Written at the end of every run (`<run_dir>/curves.png`) and by `tools/experiments/plot_run.py`.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = load_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    if evals:
        steps = [r["step"] for r in evals]
        ax.plot(steps, [_num(r["auc"]) for r in evals], "o-", label="model")  # undefined AUC: a gap
        if "oracle_auc" in evals[0]:
            ax.plot(steps, [_num(r["oracle_auc"]) for r in evals], "--", color="gray", label="oracle (teacher)")
        ax.legend()
    ax.set(title="eval AUC", xlabel="step")
    axes[1].plot([r["step"] for r in train], [_num(r["loss"]) for r in train])
    if evals:
        axes[1].plot([r["step"] for r in evals], [r["logloss"] for r in evals], "o-", label="eval logloss")
        axes[1].legend()
    axes[1].set(title="train loss (window mean)", xlabel="step")
    axes[2].plot([r["step"] for r in train], [r["samples_per_s"] for r in train])
    axes[2].set(title="throughput (samples/s, all ranks)", xlabel="step", ylim=(0, None))
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out


def _num(value: float | None) -> float:
    """A metrics.jsonl value for plotting: null (undefined, or non-finite) becomes NaN, a gap."""
    return float("nan") if value is None else value
