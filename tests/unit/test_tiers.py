"""tests/conftest.py: a test's tier is its directory, and the unit tier refuses to start processes."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest


def test_the_marker_is_the_directory(request):
    assert request.node.get_closest_marker("unit") is not None
    for other in ("integration", "system", "gpu"):
        assert request.node.get_closest_marker(other) is None


def test_a_unit_test_cannot_start_a_subprocess():
    with pytest.raises(AssertionError, match="starts a process: move it to tests/integration/"):
        subprocess.run(["true"], check=True)


def test_a_unit_test_cannot_start_a_multiprocessing_process():
    with pytest.raises(AssertionError, match="starts a process: move it to tests/integration/"):
        multiprocessing.get_context("spawn").Process(target=print).start()
