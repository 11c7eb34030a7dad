"""Progress lines: samples/s over the window since the last line with evals and checkpoints
left out, elapsed time and ETA, on a clock the test moves by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import recsys.training.progress as progress
from recsys.training.progress import Progress, _hms


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=c))
    return c


@pytest.mark.parametrize("seconds, text", [(0, "00:00"), (59.9, "00:59"), (61, "01:01"), (3599, "59:59"), (3661, "1:01:01"), (-5, "00:00")])
def test_hms(seconds, text):
    assert _hms(seconds) == text


def test_rate_eta_and_pauses(clock):
    p = Progress(total_steps=100, start_step=20, global_batch=512)
    clock.now += 10.0
    with p.pause():  # an eval of 4 s inside the window
        clock.now += 4.0
    clock.now += 6.0
    stats = p.update(30)
    # 10 steps of 512 samples in 20 s, 4 of them paused; ETA from all 20 s: 2 s/step for 70 steps
    assert stats["samples_per_s"] == pytest.approx(10 * 512 / 16.0)
    assert stats["elapsed_s"] == pytest.approx(20.0)
    assert stats["eta_s"] == pytest.approx(20.0 / 10 * 70)
    assert p.train_s() == pytest.approx(16.0)
    clock.now += 5.0  # the next window starts after the last update, without the earlier pause
    stats = p.update(35)
    assert stats["samples_per_s"] == pytest.approx(5 * 512 / 5.0)
    assert p.train_s() == pytest.approx(21.0)


def test_no_step_done_has_no_eta(clock):
    p = Progress(total_steps=10, start_step=4, global_batch=8)
    clock.now += 1.0
    assert math.isnan(p.update(4)["eta_s"])


def test_the_line(clock):
    p = Progress(total_steps=200, start_step=0, global_batch=512)
    stats = {"samples_per_s": 12345.6, "elapsed_s": 75.0, "eta_s": 3725.0}
    assert p.line(50, 0.25, 0.456789, stats) == "step 50/200 (25%) epoch 0.25 loss 0.4568 12,346 samples/s elapsed 01:15 ETA 1:02:05"
    stats.update(eta_s=float("nan"), clipped_row_fraction=0.01234)
    assert p.line(50, 0.25, 0.5, stats) == (
        "step 50/200 (25%) epoch 0.25 loss 0.5000 12,346 samples/s elapsed 01:15 ETA ? clipped 1.23% of rows"
    )
