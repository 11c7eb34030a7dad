"""Loads the CowClip C++ op the way a training process does and compares three steps of it with
the torch-ops reference. Run as a script against an installed distribution (tests/integration/packaging/test_wheel.py,
tools/ci/stack_tier.sh); prints ``MODULE <recsys.__file__>``, ``REASON <where the op came from>`` and
``MATCH``, and exits non-zero on a mismatch."""

import sys

import torch

import recsys
import recsys.optim.cowclip.kernels.cpp_op as ck
from recsys.optim.cowclip.reference import CowClipAdamState, cowclip_adam_step

print("MODULE", recsys.__file__)
ck.load_extension(require=True)
print("REASON", ck.fallback_reason())
g = torch.Generator().manual_seed(0)
w = torch.randn(50, 12, generator=g) * 0.02
idx = torch.randint(0, 50, (40,), generator=g)
off = torch.arange(0, 41, 4)
go = torch.randn(10, 12, generator=g) * 0.05
w_f, w_r = w.clone(), w.clone()
s_f, s_r = CowClipAdamState.zeros_like(w), CowClipAdamState.zeros_like(w)
for _ in range(3):
    ck.fused_cowclip_adam_step(w_f, s_f, idx, off, go, lr=1e-2)
    cowclip_adam_step(w_r, s_r, idx, off, go, lr=1e-2, update_scope="batch", l2_scope="batch", bias_correction="row")
torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-6)
assert not torch.equal(w_f, w)
print("MATCH", f"(torch {torch.__version__}, python {sys.version.split()[0]})")
