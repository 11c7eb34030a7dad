"""The check every fused CowClip-Adam multi-table update is held to, whichever backend runs it
(the C++ op, the Triton kernel): its flat weight, moment and row-step buffers against the
torch-ops reference's, and the rows no table of the batch touched left bit-identical."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def assert_update_matches(
    got: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    row_dims: torch.Tensor,
    stats_got: torch.Tensor,
    stats_want: torch.Tensor,
    exact_clipped: bool = False,
) -> None:
    """``got`` / ``want`` / ``before``: (weights, m1, m2, row_step) after the kernel, after the
    reference, and before either; ``row_dims``: each row's width in the flat buffers; stats:
    (rows updated, rows clipped) per table. A row exactly at the clip threshold may round either
    way, so the clipped count may differ by one unless ``exact_clipped``."""
    (w, m1, m2, rs), (w_r, m1_r, m2_r, rs_r) = [x.cpu() for x in got], want
    torch.testing.assert_close(w, w_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m1, m1_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m2, m2_r, rtol=1e-5, atol=1e-9)
    assert torch.equal(rs, rs_r)
    assert torch.equal(stats_got[:, 0], stats_want[:, 0])
    if exact_clipped:
        assert torch.equal(stats_got[:, 1], stats_want[:, 1])
    else:
        assert (stats_got[:, 1] - stats_want[:, 1]).abs().max() <= 1
    absent = torch.repeat_interleave(rs == before[3], row_dims)
    for new, old in zip((w, m1, m2), before[:3]):
        assert torch.equal(new[absent], old[absent])
