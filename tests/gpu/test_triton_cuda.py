"""Our Triton CowClip-Adam kernel compiled for real on the GPU, against the torch reference (the
whole of the Triton and dispatch tests in tests/integration/cowclip/kernels/, which run on CUDA tensors when a device is
visible and under the interpreter elsewhere) and, inside ``CowClipAdamTBE``, against the C++ op on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    f"tests/integration/cowclip/kernels/{name}.py"
    for name in ("test_triton_update", "test_triton_catchup", "test_triton_catchup_kernel", "test_dispatch")
]


def test_triton_kernel_suite_compiled_on_cuda(tmp_path):
    """Every test of ``KERNEL_TESTS``, in a process that imports triton in compiled
    mode (no TRITON_INTERPRET), so its kernel tests run on CUDA tensors: none may be skipped."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert "skipped" not in out.stdout.lower(), tail
    assert " passed" in out.stdout, tail


def _tbe(device: torch.device):
    from recsys.optim.cowclip.tbe import CowClipAdamTBE
    from recsys.optim.cowclip.hyper import CowClipHyper

    hp = CowClipHyper(learning_rate=0.05, l2=1e-3, cowclip_zeta=0.05, update_scope="batch")  # the update op alone
    specs = [(500, 16), (40, 8), (3000, 32)]
    return CowClipAdamTBE(specs, [2, 0, 1], hp, full_dims=[d for _, d in specs], mode="inline", device=device)


def test_cowclip_tbe_on_cuda_matches_the_cpu_op():
    """Three tables in one TBE, weighted multi-hot bags with repeats, 6 steps: the CUDA TBE
    (FBGEMM's dense CUDA forward, the Triton update in backward) against the same TBE on CPU
    (FBGEMM's CPU forward, the C++ op)."""
    import recsys.optim.cowclip.kernels.triton_update as ctr
    from recsys.optim.cowclip.kernels.cpp_op import fused_available

    assert fused_available(), "the C++ CowClip op did not load: nothing to compare against"
    cpu, cuda = _tbe(torch.device("cpu")), _tbe(torch.device("cuda"))
    with torch.no_grad():  # the same start (FBGEMM draws the initial weights on each device)
        for name in ("weights", "momentum1", "momentum2", "row_step"):
            getattr(cuda, name).copy_(getattr(cpu, name))
    gen = torch.Generator().manual_seed(3)
    B, F = 128, 3
    for _ in range(6):
        lengths = torch.randint(0, 6, (F * B,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        ids = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)  # the smallest table's rows: repeats
        psw = torch.rand(ids.numel(), generator=gen) + 0.5
        grad = torch.randn(B, 32 + 16 + 8, generator=gen) * 0.1  # features read tables 2, 0, 1
        for tbe, dev in ((cpu, "cpu"), (cuda, "cuda")):
            out = tbe(ids.to(dev), offsets.to(dev), psw.to(dev))
            out.backward(grad.to(dev))
    assert cuda._tables_op is ctr.triton_cowclip_adam_tables
    assert cuda.stats.unique_rows == cpu.stats.unique_rows and cuda.stats.clipped_rows == cpu.stats.clipped_rows
    assert torch.equal(cuda.row_step.cpu(), cpu.row_step)
    # Adam divides each coordinate by sqrt(v): where a coordinate's gradient nearly cancels over
    # its occurrences, the CUDA kernel (FMA, its summation) and the CPU op round that sum apart and
    # the normalised step carries it. Bound: 1e-4 of the learning rate per step and element, 3e-5
    # here (measured on an H100, 6 steps at lr 0.05: 2.9e-6 at most, 184 of 104,320 weights above
    # 1e-6; a wrong count, weight or row moves weights by ~lr).
    # The moments are not normalised: they agree to float32 rounding.
    torch.testing.assert_close(cuda.weights.cpu(), cpu.weights, rtol=1e-5, atol=6 * 1e-4 * 0.05, msg=lambda m: f"weights: {m}")
    torch.testing.assert_close(cuda.momentum1.cpu(), cpu.momentum1, rtol=1e-5, atol=1e-6, msg=lambda m: f"momentum1: {m}")
    torch.testing.assert_close(cuda.momentum2.cpu(), cpu.momentum2, rtol=1e-5, atol=1e-9, msg=lambda m: f"momentum2: {m}")
    assert int(cpu.row_step.sum()) > 0
