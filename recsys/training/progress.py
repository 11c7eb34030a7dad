"""Progress lines for long runs: step, samples/s over the last window, elapsed time and ETA."""

from __future__ import annotations

import time


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    def __init__(self, total_steps: int, start_step: int, global_batch: int) -> None:
        self.total = total_steps
        self.batch = global_batch
        self.t0 = self.t_last = time.perf_counter()
        self.step0 = self.step_last = start_step
        self.pause_total = 0.0  # paused since the last update (this window)
        self.paused_s = 0.0  # paused since the start (evals, checkpoints)

    def pause(self) -> "_Pause":
        """Time spent inside (evaluation, checkpoints) is not counted as training time."""
        return _Pause(self)

    def train_s(self) -> float:
        """Seconds of training since the start, pauses (evals, checkpoints) not counted: the time
        axis of a metric curve that should not depend on how often one evaluates."""
        return time.perf_counter() - self.t0 - self.paused_s

    def update(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        window = max(now - self.t_last - self.pause_total, 1e-9)
        rate = (step - self.step_last) * self.batch / window
        self.t_last, self.step_last, self.pause_total = now, step, 0.0
        elapsed = now - self.t0
        done = step - self.step0
        eta = elapsed / done * (self.total - step) if done else float("nan")
        return {"samples_per_s": rate, "elapsed_s": elapsed, "eta_s": eta}

    def line(self, step: int, epoch: float, loss: float, stats: dict[str, float]) -> str:
        pct = 100.0 * step / self.total
        return (
            f"step {step}/{self.total} ({pct:.0f}%) epoch {epoch:.2f} loss {loss:.4f} "
            f"{stats['samples_per_s']:,.0f} samples/s elapsed {_hms(stats['elapsed_s'])} "
            f"ETA {_hms(stats['eta_s']) if stats['eta_s'] == stats['eta_s'] else '?'}"
            + (f" clipped {100 * stats['clipped_row_fraction']:.2f}% of rows" if "clipped_row_fraction" in stats else "")
        )


class _Pause:
    def __init__(self, p: Progress) -> None:
        self.p = p

    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self.t
        self.p.pause_total += dt
        self.p.paused_s += dt
