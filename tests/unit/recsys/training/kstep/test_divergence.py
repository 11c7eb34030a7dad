"""The replicas' bit fingerprint (recsys/training/kstep/divergence.py); the cross-host check
itself runs in tests/integration/training/test_kstep_merge.py (every k-step run reports it)."""

from __future__ import annotations

import torch

from recsys.training.kstep.divergence import fingerprint


def test_thefingerprint_of_a_float_by_hand():
    # 1.0f is 0x3F800000: little-endian 16-bit words 0x0000, 0x3F80 (16256) at positions 0 and 1
    assert fingerprint(torch.tensor([1.0])) == (1, 16256, 16256 * 2, 16256 * ((1 * 40503) % 65536))
    t = torch.randn(1000)
    assert fingerprint(t) == fingerprint(t.clone())
    moved = t.clone()
    moved[500] = torch.nextafter(moved[500], torch.tensor(float("inf")))
    assert fingerprint(moved) != fingerprint(t)
