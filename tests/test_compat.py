"""sharding/compat.py: one test per version branch (the stacks themselves run in CI's stack tiers)."""

from __future__ import annotations

import logging

import pytest

from sharding import compat

FALSE_WARNING = """
            \033[33m
            _fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;
            cannot determine compatibility with PyTorch 2.11.0+cu130
            \033[0m
            """


def _record(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("root", level, __file__, 1, msg, None, None)


@pytest.mark.parametrize("torch_version, dropped", [((2, 11, 0), True), ((2, 12, 0), False), ((2, 13, 0), False)])
def test_fbgemm_16_false_warning_dropped_only_with_torch_211(monkeypatch, torch_version, dropped):
    monkeypatch.setattr(compat, "torch_version", lambda: torch_version)
    f = compat.FbgemmCompatTableFilter()
    assert f.filter(_record(FALSE_WARNING)) is (not dropped)
    # FBGEMM's other warnings (e.g. a real mismatch) and other loggers' messages pass
    assert f.filter(_record("FBGEMM_GPU version is 1.6.0, which is not guaranteed to be compatible"))
    assert f.filter(_record(FALSE_WARNING.replace("1.6.0", "1.9.0")))
    assert f.filter(_record(FALSE_WARNING, logging.ERROR))


def test_filter_on_the_root_logger_silences_logging_warning(monkeypatch, capsys):
    """FBGEMM calls logging.warning(...) (the root logger): the installed filter sees it."""
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 11, 0))
    compat.install_log_filters()
    compat.install_log_filters()  # idempotent
    root = logging.getLogger()
    assert sum(isinstance(f, compat.FbgemmCompatTableFilter) for f in root.filters) == 1
    handler = logging.StreamHandler()  # stderr, as logging's last resort would print
    root.addHandler(handler)
    try:
        logging.warning(FALSE_WARNING)
        logging.warning("something else")
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert "has no entry" not in err and "something else" in err


def test_versions_are_read_from_metadata():
    import torch
    import torchrec

    assert compat._parse("2.11.0+cu130") == (2, 11, 0) and compat._parse("1.9") == (1, 9, 0)
    assert compat.torch_version() == compat._parse(torch.__version__)
    assert compat.torchrec_version() == compat._parse(torchrec.__version__)
    tv, fv = compat.torch_version(), compat.fbgemm_version()
    assert fv is not None and (fv[0], fv[1] + 5) == (tv[0] - 1, tv[1])  # FBGEMM 1.x pairs with torch 2.(x+5)
    assert compat.distribution_version("no-such-distribution") is None
