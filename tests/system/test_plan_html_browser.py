"""The HTML plan report (tests/integration/sharding/test_plan_html.py builds it) rendered by headless Chromium
(Debian's `chromium`, which `.ci/run` installs): a screenshot of the page, not a blank one."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest

from tests.integration.sharding.test_plan_html import REPO, report16  # noqa: F401  (report16: the module-scoped fixture)

CHROMIUM = Path("/usr/bin/chromium")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_screenshot_in_headless_chromium(report16, tmp_path):  # noqa: F811 (the fixture imported above)
    if not CHROMIUM.exists():
        if os.environ.get("RECSYS_BROWSER"):
            pytest.fail(f"RECSYS_BROWSER is set but {CHROMIUM} is missing (apt-get install -y --no-install-recommends chromium)")
        pytest.skip(f"{CHROMIUM} not installed (set RECSYS_BROWSER=1 to make this a failure)")
    _, html_file = report16
    png = tmp_path / "report.png"
    r = subprocess.run(
        ["bash", str(REPO / "tools" / "ci" / "chromium_screenshot.sh"), str(html_file), str(png), "1280,2000"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    width, height = _png_size(png)
    assert width >= 1280 and height >= 1000
    assert png.stat().st_size > 20_000  # a blank page compresses to a few KB
    # and the script fails when it cannot make one
    bad = subprocess.run(
        ["bash", str(REPO / "tools" / "ci" / "chromium_screenshot.sh"), str(tmp_path / "none.html"), str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and not (tmp_path / "x.png").exists()
