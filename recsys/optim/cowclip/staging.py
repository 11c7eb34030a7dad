"""What a CowClip backward hands on: the rows a deferred backward stages for the cross-rank
exchange (``StagedRows``), the touched/clipped counters for logging (``UpdateStats``), and the
pooled output gradient turned back into per-bag gradients (mean pooling, unpooled lookups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StagedRows:
    """What the deferred backward leaves for the exchange: one local table shard's batch rows."""

    table: int  # local table index in the TBE
    rows: Tensor  # [U] int64, sorted local row ids
    grads: Tensor  # [U, local_cols] (L2 term already added for column shards)
    counts: Tensor  # [U] int64 distinct samples


@dataclass
class UpdateStats:
    """Rows touched and clipped since the last ``take`` (for logging; summed over tables).

    Counts that a kernel returns as a device tensor are added on the device (``add_counts``) and
    read when the fields are: a training step does not wait for the GPU to learn them."""

    calls: int = 0
    _unique: int = 0
    _clipped: int = 0
    _pending: Tensor | None = None  # [2] int64 on the kernel's device, not yet read

    def add(self, unique: int, clipped: int) -> None:
        self._unique += unique
        self._clipped += clipped
        self.calls += 1

    def add_counts(self, per_feature: Tensor) -> None:
        """``per_feature`` [F, 2] (unique rows, clipped rows), on any device."""
        total = per_feature.sum(0)
        self._pending = total if self._pending is None else self._pending + total
        self.calls += 1

    def _fold(self) -> None:
        if self._pending is not None:
            u, c = self._pending.tolist()
            self._unique += int(u)
            self._clipped += int(c)
            self._pending = None

    @property
    def unique_rows(self) -> int:
        self._fold()
        return self._unique

    @property
    def clipped_rows(self) -> int:
        self._fold()
        return self._clipped

    def take(self) -> tuple[int, int]:
        """(unique rows, clipped rows) since the last ``take``; resets the counters."""
        self._fold()
        out = (self._unique, self._clipped)
        self._unique = self._clipped = self.calls = 0
        return out


def mean_pooling_weights(offsets: Tensor, n: int, psw: Tensor | None = None) -> Tensor:
    """Per-occurrence weights that make a SUM bag a MEAN one: ``1 / len(bag)`` (times ``psw``)."""
    lengths = offsets[1:] - offsets[:-1]
    inv = 1.0 / lengths.clamp(min=1).to(torch.float32)
    w = torch.repeat_interleave(inv, lengths, output_size=n)
    return w if psw is None else w * psw.to(torch.float32)


def unpooled_as_bags(grad_out: Tensor, offsets: Tensor, num_features: int) -> tuple[Tensor, Tensor]:
    """An unpooled lookup's gradient ([ids, D], one row per id, feature-major as FBGEMM returns
    it) in the pooled layout every update path reads: each id its own bag of one, so the batch's
    row gradient (sum over the id's occurrences) and count (its occurrences) are what the pooled
    kernels compute. Features hold different numbers of ids, the pooled layout one bag count B
    for all: feature f fills bags 0..n_f-1 and leaves the rest empty (B = max n_f; the zero
    padding costs (B*F - ids) * D floats, none when one feature is looked up)."""
    F = num_features
    B = (offsets.numel() - 1) // F if F else 0
    D = grad_out.shape[1] if grad_out.dim() == 2 else 0
    bounds = offsets[::B].long() if B > 0 else offsets.new_zeros(F + 1, dtype=torch.long)
    n = bounds[1:] - bounds[:-1]  # ids per feature
    nb = int(n.max()) if F else 0
    j = torch.arange(nb + 1, device=offsets.device)
    # bag j of feature f starts at id min(j, n_f) of the feature
    bag_offsets = (bounds[:-1, None] + torch.minimum(j[None, :nb], n[:, None])).reshape(-1)
    bag_offsets = torch.cat([bag_offsets, bounds[-1:]]).to(offsets.dtype)
    bags = grad_out.new_zeros(nb, F * D)
    for f in range(F):
        lo, hi = int(bounds[f]), int(bounds[f + 1])
        bags[: hi - lo, f * D : (f + 1) * D] = grad_out[lo:hi]
    return bags, bag_offsets
