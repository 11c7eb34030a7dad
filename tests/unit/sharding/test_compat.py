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


@pytest.mark.parametrize(
    "fbgemm, torch_version, dropped",
    [
        ("1.6.0", (2, 11, 0), True),
        ("1.6.0", (2, 12, 0), False),
        ("1.6.0", (2, 13, 0), False),
        ("1.7.0", (2, 12, 0), True),
        ("1.7.0", (2, 11, 0), False),
    ],
)
def test_fbgemm_false_warning_dropped_only_for_its_own_torch(monkeypatch, fbgemm, torch_version, dropped):
    monkeypatch.setattr(compat, "torch_version", lambda: torch_version)
    f = compat.FbgemmCompatTableFilter()
    assert f.filter(_record(FALSE_WARNING.replace("1.6.0", fbgemm))) is (not dropped)
    # FBGEMM's other warnings (e.g. a real mismatch) and other loggers' messages pass
    assert f.filter(_record("FBGEMM_GPU version is 1.6.0, which is not guaranteed to be compatible"))
    assert f.filter(_record(FALSE_WARNING.replace("1.6.0", "1.9.0")))
    assert f.filter(_record(FALSE_WARNING, logging.ERROR))


def test_filter_on_the_root_logger_silences_logging_warning(monkeypatch):
    """FBGEMM calls logging.warning(...) (the root logger): the installed filter sees it."""
    import io

    monkeypatch.setattr(compat, "torch_version", lambda: (2, 11, 0))
    compat.install_log_filters()
    compat.install_log_filters()  # idempotent
    root = logging.getLogger()
    assert sum(isinstance(f, compat.FbgemmCompatTableFilter) for f in root.filters) == 1
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root.addHandler(handler)
    old_disable = logging.root.manager.disable
    logging.disable(logging.NOTSET)  # other planner tests silence logging process-wide
    try:
        logging.warning(FALSE_WARNING)
        logging.warning("something else")
    finally:
        logging.disable(old_disable)
        root.removeHandler(handler)
    assert "has no entry" not in out.getvalue() and "something else" in out.getvalue()


def test_versions_are_read_from_metadata():
    import torch
    import torchrec

    assert compat._parse("2.11.0+cu130") == (2, 11, 0) and compat._parse("1.9") == (1, 9, 0)
    assert compat.torch_version() == compat._parse(torch.__version__)
    assert compat.torchrec_version() == compat._parse(torchrec.__version__)
    tv, fv = compat.torch_version(), compat.fbgemm_version()
    assert fv is not None and (fv[0], fv[1] + 5) == (tv[0] - 1, tv[1])  # FBGEMM 1.x pairs with torch 2.(x+5)
    assert compat.distribution_version("no-such-distribution") is None


@pytest.mark.parametrize("fbgemm", [(1, 6, 0), (1, 9, 0)])
def test_fbgemm_cowclip_types_from_either_module(monkeypatch, fbgemm):
    """FBGEMM < 1.7 has them in split_table_batched_embeddings_ops_training only; later releases in
    tbe.config.optimizer_config (and re-exported from the old module, so both branches run here)."""
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as old_home

    real = compat.fbgemm_version()
    if fbgemm >= (1, 7, 0) and real < (1, 7, 0):
        pytest.skip(f"FBGEMM {real} has no fbgemm_gpu.tbe.config")
    monkeypatch.setattr(compat, "fbgemm_version", lambda: fbgemm)
    counter, cowclip, decay = compat.fbgemm_cowclip_types()
    assert (counter, cowclip, decay) == (old_home.CounterWeightDecayMode, old_home.CowClipDefinition, old_home.WeightDecayMode)
    assert decay.COWCLIP is old_home.WeightDecayMode.COWCLIP


class _Storage:
    def __init__(self):
        self.hbm, self.ddr, self.ssd = 85 << 30, 128 << 30, 2 << 40  # torchrec's defaults, as 1.6 fills them


class _Device:
    def __init__(self):
        self.storage = _Storage()


class _Topology:
    def __init__(self):
        self.devices = [_Device(), _Device()]


@pytest.mark.parametrize("torchrec, zeroed", [((1, 6, 1), True), ((1, 7, 0), False), ((1, 9, 2), False)])
def test_zero_capacities_kept_on_old_torchrec(monkeypatch, torchrec, zeroed):
    monkeypatch.setattr(compat, "torchrec_version", lambda: torchrec)
    topo = compat.keep_zero_capacities(_Topology(), hbm=None, ddr=64 << 30, ssd=0)
    for d in topo.devices:
        assert d.storage.ssd == (0 if zeroed else 2 << 40)
        assert (d.storage.hbm, d.storage.ddr) == (85 << 30, 128 << 30)  # only the zeros are touched


def test_zero_ssd_on_the_installed_torchrec_is_no_ssd():
    """End to end with the installed torchrec: a cluster without SSD gives ranks no SSD capacity."""
    from sharding.topology.topology_file import load_topology
    from sharding.planner.job_topology import torchrec_topology

    topo = torchrec_topology(load_topology("cpu-gloo"))
    assert [d.storage.ssd for d in topo.devices] == [0, 0]


@pytest.mark.parametrize("torchrec, attr", [((1, 6, 1), "_sharder_map"), ((1, 8, 0), "_sharder_data_map")])
def test_estimator_sharders(monkeypatch, torchrec, attr):
    class Enumerator:
        _sharder_map = {"ebc": "sharder"}
        _sharder_data_map = {"ebc": "sharder data"}

    monkeypatch.setattr(compat, "torchrec_version", lambda: torchrec)
    assert compat.estimator_sharders(Enumerator()) is getattr(Enumerator, attr)


def test_ddp_wrap_skipping_returns_skipped_lookups_unwrapped_and_restores_ddp():
    import torch
    import torchrec.distributed.embeddingbag as ebc_module

    ddp = ebc_module.DistributedDataParallel
    skipped, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with compat.ddp_wrap_skipping(lambda m: m is skipped):
        assert ebc_module.DistributedDataParallel is not ddp
        assert issubclass(ebc_module.DistributedDataParallel, ddp)
        assert ebc_module.DistributedDataParallel(module=skipped, process_group=None) is skipped
        with pytest.raises((RuntimeError, ValueError, AssertionError), match="process group"):  # a real DDP: needs a process group
            ebc_module.DistributedDataParallel(module=other, process_group=None)
    assert ebc_module.DistributedDataParallel is ddp


def test_sebc_dp_wrap_flag_matches_the_installed_torchrec():
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    assert compat.SEBC_WRAPS_DP_IN_INIT == (compat.torchrec_version()[:2] < (1, 7))
    assert compat.SEBC_WRAPS_DP_IN_INIT == (not hasattr(ShardedEmbeddingBagCollection, "init_data_parallel"))
