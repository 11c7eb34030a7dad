"""The dispatch point of the CowClip kernels (recsys/optim/cowclip/kernels/dispatch.py): which backend
runs an update or a catch-up on a device (Triton on CUDA, the C++ op on CPU, the torch reference
elsewhere), also in a CPU install without triton, and a table group's hyperparameters as the
kernels' keyword arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import recsys.optim.cowclip.kernels.triton_update as ctr
from recsys.optim.cowclip.hyper import CowClipHyper
from recsys.optim.cowclip.kernels.dispatch import catchup_kwargs, update_kwargs
from tests.support.processes import fresh_python

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REPO = Path(__file__).resolve().parents[4]


def test_kernel_arguments_from_the_group_hyperparameters():
    """Every kernel argument comes from its ``CowClipHyper`` field (betas as a pair), ``lr`` from the
    caller (a schedule's current rate, not ``learning_rate``); the catch-up has no ``r`` (nothing to
    clip) and takes ``growth``."""
    hp = CowClipHyper(learning_rate=9.0, beta1=0.8, beta2=0.95, eps=1e-7, eps_mode="keras", cowclip_r=2.5, cowclip_zeta=0.3, l2=0.01)
    assert update_kwargs(hp, 0.125) == {"lr": 0.125, "betas": (0.8, 0.95), "eps": 1e-7, "r": 2.5, "l2": 0.01, "eps_mode": "keras"}
    assert catchup_kwargs(hp, 0.25, 3.0) == {"lr": 0.25, "betas": (0.8, 0.95), "eps": 1e-7, "l2": 0.01, "eps_mode": "keras", "growth": 3.0}


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_by_device():
    from recsys.optim.cowclip.kernels import cpp_op, dispatch

    assert dispatch.tables_update_op("cuda") is ctr.triton_cowclip_adam_tables
    assert dispatch.table_update_op("cuda") is ctr.triton_cowclip_adam_step
    assert dispatch.catchup_backend("cuda") == "triton"
    assert dispatch.tables_update_op("meta") is None and dispatch.catchup_backend("meta") == "torch"
    assert dispatch.table_update_op("meta") is cpp_op.fused_cowclip_adam_step  # which falls back to the reference
    fused = cpp_op.fused_available()
    assert dispatch.tables_update_op("cpu") is (cpp_op.fused_cowclip_adam_tables if fused else None)
    assert dispatch.catchup_backend("cpu") == ("fused" if fused else "torch")
    assert ctr.triton_available("cpu") == (DEV.type == "cpu")  # the interpreter: only where conftest.py asked


def test_cpu_install_without_triton_keeps_working():
    """With triton unimportable the module imports, reports no Triton kernel and dispatches CUDA
    tensors to the per-table path (None) and one-table calls to ``fused_cowclip_adam_step``."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import recsys.optim.cowclip.kernels.triton_update as c, recsys.optim.cowclip.kernels.cpp_op as k\n"
        "import recsys.optim.cowclip.kernels.dispatch as d\n"
        "assert not c.triton_available() and not c.triton_available('cuda')\n"
        "assert d.tables_update_op('cuda') is None and d.catchup_backend('cuda') == 'torch'\n"
        "assert d.table_update_op('cuda') is k.fused_cowclip_adam_step\n"
        "print('ok')\n"
    )
    out = fresh_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
