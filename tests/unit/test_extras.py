"""Optional dependencies are extras: a run that asks for what a missing extra provides stops at
config time with one line naming the extra, and runs without it when told to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from recsys.config import ConfigError, check_training_extras, load_config
from recsys.extras import MissingExtraError, missing_extra, require
from recsys.training.metrics import MetricsWriter

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "experiments" / "smoke.yaml"


def _hide(monkeypatch, module: str) -> None:
    """Make `module` unimportable for this test (find_spec then fails as for a missing package)."""
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    "key, module, what", [("tensorboard", "tensorboard", "writing TensorBoard events"), ("curves", "matplotlib", "drawing curves.png")]
)
def test_missing_viz_extra_is_one_line_naming_the_extra(monkeypatch, tmp_path, key, module, what):
    _hide(monkeypatch, module)
    cfg = load_config(SMOKE, [f"run_dir={tmp_path / 'run'}"])  # planning, preprocessing: no extra needed
    with pytest.raises(ConfigError) as e:
        check_training_extras(cfg, str(SMOKE))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        f"{SMOKE}: key 'train.{key}': {what} needs the '{module}' package, which is not installed: "
        f"pip install 'torchrec-cowclip-trainer[viz]' (or set train.{key}=false)"
    )
    # told to do without it, the run may start
    cfg = load_config(SMOKE, [f"run_dir={tmp_path / 'run'}", f"train.{key}=false"])
    check_training_extras(cfg, str(SMOKE))
    assert getattr(cfg.train, key) is False


def test_require_and_missing_extra(monkeypatch):
    assert missing_extra("x", "json", "viz") is None  # installed: nothing to say
    _hide(monkeypatch, "torchx")
    line = missing_extra("the TorchX launcher", "torchx", "launch")
    assert line == (
        "the TorchX launcher needs the 'torchx' package, which is not installed: pip install 'torchrec-cowclip-trainer[launch]'"
    )
    with pytest.raises(MissingExtraError, match=r"\[launch\]'$"):
        require("the TorchX launcher", "torchx", "launch")
    assert isinstance(MissingExtraError("x"), ImportError)


def test_metrics_writer_without_tensorboard_writes_jsonl_only(monkeypatch, tmp_path):
    _hide(monkeypatch, "tensorboard")  # would fail if the writer imported it
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    w.log({"kind": "train", "step": 3, "loss": 0.5})
    w.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"kind": "train", "step": 3, "loss": 0.5}]
    assert not (tmp_path / "tb").exists()
