"""The one dispatch point of the CowClip-Adam kernels: which backend runs an operation on a
device, and the one place a table group's hyperparameters become the kernels' arguments.

Two operations, three backends:

| operation | CPU | CUDA | elsewhere, or the backend missing |
|---|---|---|---|
| update (the batch's rows: L2, clip, Adam) | C++ op (`cpp_op.py`) | Triton (`triton_update.py`) | torch reference (`reference.py`) |
| catch-up (rows absent for n steps) | C++ op | Triton (`triton_catchup.py`) | torch (`catchup.py`) |

The kernels keep explicit keyword arguments (``lr``, ``betas``, ``eps``, ``r``, ``l2``,
``eps_mode``, ``growth``) so each can be called and tested on its own; ``update_kwargs`` and
``catchup_kwargs`` derive them from ``CowClipHyper`` (recsys/optim/cowclip/tbe.py) so that the
table-batched module passes one group's settings the same way to whichever backend runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

if TYPE_CHECKING:
    from recsys.optim.cowclip.reference import CowClipStats
    from recsys.optim.cowclip.hyper import CowClipHyper

CatchupBackend = Literal["fused", "triton", "torch"]


def update_kwargs(hyper: "CowClipHyper", lr: float) -> dict[str, Any]:
    """The update kernels' hyperparameter arguments for a table group (``lr``: its current rate)."""
    betas = (hyper.beta1, hyper.beta2)
    return {"lr": lr, "betas": betas, "eps": hyper.eps, "r": hyper.cowclip_r, "l2": hyper.l2, "eps_mode": hyper.eps_mode}


def catchup_kwargs(hyper: "CowClipHyper", lr: float, growth: float) -> dict[str, Any]:
    """The catch-up kernels' arguments: the update's without the clip (an absent row has no
    gradient to clip), with the block schedule's ``growth``."""
    betas = (hyper.beta1, hyper.beta2)
    return {"lr": lr, "betas": betas, "eps": hyper.eps, "l2": hyper.l2, "eps_mode": hyper.eps_mode, "growth": growth}


def tables_update_op(device: torch.device | str) -> Callable[..., torch.Tensor] | None:
    """The multi-table update op for tensors on ``device``: CUDA -> ``triton_cowclip_adam_tables``
    (if triton is installed), CPU -> the C++ op ``fused_cowclip_adam_tables`` (if it builds).
    ``None``: no fused op there; the caller runs ``table_update_op`` per table."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from recsys.optim.cowclip.kernels.triton_update import triton_available, triton_cowclip_adam_tables

        return triton_cowclip_adam_tables if triton_available(dev) else None
    if dev.type == "cpu":
        from recsys.optim.cowclip.kernels.cpp_op import fused_available, fused_cowclip_adam_tables

        return fused_cowclip_adam_tables if fused_available() else None
    return None


def table_update_op(device: torch.device | str) -> Callable[..., "CowClipStats"]:
    """The one-table update op for ``device``: the Triton kernel on CUDA when triton is installed,
    else ``fused_cowclip_adam_step`` (the C++ op on CPU, the torch reference elsewhere)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from recsys.optim.cowclip.kernels.triton_update import triton_available, triton_cowclip_adam_step

        if triton_available(dev):
            return triton_cowclip_adam_step
    from recsys.optim.cowclip.kernels.cpp_op import fused_cowclip_adam_step

    return fused_cowclip_adam_step


def catchup_backend(device: torch.device | str) -> CatchupBackend:
    """Which catch-up runs on ``device``: ``fused`` (the C++ op, CPU), ``triton`` (CUDA) or
    ``torch`` (the reference's block scheme in torch ops)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        from recsys.optim.cowclip.kernels.cpp_op import fused_available

        if fused_available():
            return "fused"
    if dev.type == "cuda":
        from recsys.optim.cowclip.kernels.triton_update import triton_available

        if triton_available(dev):
            return "triton"
    return "torch"
