"""The outer step of a k-step merge: DiLoCo's Nesterov outer optimizer and bf16 deltas with error
feedback (docs/kstep.md). Separate from ``merger.py``, which decides what is merged and moves the
bytes; this module holds the per-tensor state a merge carries from one merge to the next and the
arithmetic on it.

State per merged parameter tensor (a ``Slot``): the anchor θ₀, the model as it was right after the
last merge (the same on every replica); with ``kind="nesterov"`` the outer momentum m (the same on
every replica: it is built from replicated values only); with ``compress="bf16"`` this replica's
residual e (its own, kept locally). A merge of a flat buffer of this replica's values θ:

- the average θ̄: the plain average of θ over the replicas, or, with bf16 deltas, θ₀ plus the
  average of d = (θ − θ₀) + e sent in bf16, with e ← d − bf16(d) (what bf16 dropped is sent at
  the next merge, so the sum of what a replica sent follows the sum of its true deltas to one
  rounding, with no drift);
- the outer step (DiLoCo, arXiv 2311.08105): Δ = θ₀ − θ̄, m ← μ·m + Δ, θ ← θ₀ − η·(Δ + μ·m); with
  ``kind="average"`` θ ← θ̄;
- anchor ← θ.

η = 1, μ = 0 is plain averaging (to float rounding). The first merge of a tensor has no anchor: it
averages plainly (fp32) and takes its result as the anchor, so nothing assumes that the replicas
started equal. Embedding shards merged by rows (``rows`` of a part) take the step on those rows only,
their momentum and residual rows too (lazy, as sparse optimizers are); the other rows keep their
value, momentum and residual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

log = logging.getLogger(__name__)

OuterKind = Literal["average", "nesterov"]
Compress = Literal["none", "bf16"]
Reduce = Callable[[Tensor], None]  # an in-place collective over the replica group


@dataclass
class Slot:
    """One merged tensor's state, shaped like the tensor (a hierarchical slice: like the slice)."""

    anchor: Tensor
    momentum: Tensor | None = None
    residual: Tensor | None = None


@dataclass
class Part:
    """One tensor of a flat merge buffer: its state key, the tensor (full shape, the model's own
    storage or a slice buffer) and the rows of it in the buffer (None: all of it)."""

    key: str
    tensor: Tensor
    rows: Tensor | None = None


class OuterOptimizer:
    """The anchors, outer momentum and bf16 residuals of one replica (module docstring)."""

    def __init__(self, kind: OuterKind, lr: float, momentum: float, compress: Compress, hosts: int) -> None:
        check_outer(kind, lr, momentum, compress)
        self.kind = kind
        self.lr = lr
        self.momentum = momentum
        self.compress = compress
        self.hosts = hosts
        self.slots: dict[str, Slot] = {}

    @property
    def active(self) -> bool:
        """False for plain averaging of fp32 values: the merger keeps no state at all."""
        return self.kind != "average" or self.compress != "none"

    def merge(self, local: Tensor, parts: list[Part], average: Reduce, total: Reduce) -> int:
        """``local``: this replica's values of ``parts``, packed (``pack``); on return the merged
        model's values, which the caller writes back. ``average`` / ``total``: in-place mean /
        sum over the replicas. Returns the bytes this replica put into the collective."""
        slots = [self.slots.get(p.key) for p in parts]
        if any(s is None or s.anchor.shape != p.tensor.shape for s, p in zip(slots, parts)):
            average(local)  # no anchor yet: plain average, whose result becomes the anchor
            for p in parts:
                self.slots[p.key] = Slot(p.tensor.detach().clone())
            self._unpack_into(local, parts, "anchor")
            return local.numel() * local.element_size()
        anchor = pack([s.anchor for s in slots], parts)  # type: ignore[union-attr]
        if self.compress == "bf16" and local.dtype == torch.float32:
            residual = pack([self._state(s, p, "residual") for s, p in zip(slots, parts)], parts)  # type: ignore[arg-type]
            delta = local - anchor + residual
            sent = delta.to(torch.bfloat16)
            self._unpack_into(delta - sent.float(), parts, "residual")
            total(sent)
            mean = anchor + sent.float() / self.hosts
            nbytes = sent.numel() * sent.element_size()
        else:
            average(local)
            mean, nbytes = local, local.numel() * local.element_size()
        if self.kind == "nesterov":
            m = pack([self._state(s, p, "momentum") for s, p in zip(slots, parts)], parts)  # type: ignore[arg-type]
            new = nesterov_step(anchor, mean, m, self.lr, self.momentum)
            self._unpack_into(m, parts, "momentum")
        else:
            new = mean
        local.copy_(new)
        self._unpack_into(local, parts, "anchor")
        return nbytes

    def refresh_anchor(self, key: str, tensor: Tensor) -> None:
        """The anchor of ``key`` becomes ``tensor`` as it is now: for tables whose absent rows move
        at the merge by the same catch-up on every host, so the anchor stays the model as it was
        right after the merge, catch-up included."""
        slot = self.slots.get(key)
        if slot is not None and slot.anchor.shape == tensor.shape:
            slot.anchor.copy_(tensor)

    def set_anchor(self, key: str, tensor: Tensor) -> None:
        """The anchor of ``key`` is ``tensor`` as it is now (a resume: the model a merge left)."""
        slot = self.slots.get(key)
        if slot is None or slot.anchor.shape != tensor.shape:
            self.slots[key] = Slot(tensor.detach().clone())
        else:
            slot.anchor.copy_(tensor)

    def _state(self, slot: Slot, part: Part, name: str) -> Tensor:
        value = getattr(slot, name)
        if value is None:
            value = torch.zeros(part.tensor.shape, dtype=torch.float32, device=part.tensor.device)
            setattr(slot, name, value)
        return value

    def _unpack_into(self, flat: Tensor, parts: list[Part], name: str) -> None:
        unpack(flat, [getattr(self.slots[p.key], name) for p in parts], parts)

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Momentum and residual per key (the anchors are the model a checkpoint holds)."""
        out: dict[str, dict[str, Tensor]] = {"momentum": {}, "residual": {}}
        for key, slot in self.slots.items():
            for name in out:
                value = getattr(slot, name)
                if value is not None:
                    out[name][key] = value.detach().clone()
        return out

    def resume(self, anchors: list[tuple[str, Tensor]], state: dict[str, dict[str, Tensor]] | None) -> None:
        """After a checkpoint taken at a merge was loaded: the anchors are the model now (``anchors``:
        (key, tensor)), momentum and residuals come from ``state``; each loss is logged."""
        if not self.active:
            log.warning("k-step merge: the checkpoint's outer momentum / bf16 residuals are not used (plain averaging)")
            return
        for key, tensor in anchors:
            self.set_anchor(key, tensor)
        if state is None:
            log.warning("k-step merge: the checkpoint has no outer state: outer momentum and bf16 residuals start from zero")
        self.load_state_dict(state or {})

    def load_state_dict(self, state: dict[str, dict[str, Tensor]]) -> None:
        """Momentum and residual for the slots whose anchors ``set_anchor`` just took from the
        loaded model. Saved state that does not fit these slots (another plan, another number
        of ranks per host) is not used: all of it restarts from zero, with one warning."""
        saved = {name: state.get(name, {}) for name in ("momentum", "residual")}
        misfit = [
            f"{name} {key}"
            for name, values in saved.items()
            for key, value in values.items()
            if key not in self.slots or tuple(value.shape) != tuple(self.slots[key].anchor.shape)
        ]
        if misfit:
            log.warning(
                "k-step merge: the checkpoint's outer state does not fit this plan (%d of %d tensors, e.g. %s): "
                "outer momentum and bf16 residuals restart from zero",
                len(misfit),
                sum(len(v) for v in saved.values()),
                misfit[0],
            )
            saved = {"momentum": {}, "residual": {}}
        for slot in self.slots.values():
            slot.momentum = slot.residual = None
        for name, values in saved.items():
            for key, value in values.items():
                slot = self.slots[key]
                setattr(slot, name, value.to(device=slot.anchor.device, dtype=torch.float32).clone())


def nesterov_step(anchor: Tensor, mean: Tensor, m: Tensor, lr: float, mu: float) -> Tensor:
    """DiLoCo's outer Nesterov step on flat buffers: Δ = θ₀ − θ̄, m ← μ·m + Δ (in place),
    returns θ₀ − η·(Δ + μ·m)."""
    delta = anchor - mean
    m.mul_(mu).add_(delta)
    return anchor - lr * (delta + mu * m)


def pack(tensors: list[Tensor], parts: list[Part]) -> Tensor:
    """The values of ``tensors`` (one per part, full shape) at the parts' rows, flat, fp32 when a
    tensor is of a lower precision."""
    out = []
    for t, p in zip(tensors, parts):
        v = t if p.rows is None else t.index_select(0, p.rows)
        out.append(v.reshape(-1).to(torch.promote_types(t.dtype, torch.float32)))
    return torch.cat(out)


def unpack(flat: Tensor, tensors: list[Tensor], parts: list[Part]) -> None:
    """Writes ``flat`` (packed as ``pack`` does) into ``tensors`` at the parts' rows."""
    offset = 0
    for t, p in zip(tensors, parts):
        if p.rows is None:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
        else:
            n = p.rows.numel() * (t.numel() // max(t.shape[0], 1))
            t.index_copy_(0, p.rows, flat[offset : offset + n].view(p.rows.numel(), *t.shape[1:]).to(t.dtype))
        offset += n


def check_outer(kind: str, lr: float, momentum: float, compress: str) -> None:
    """The outer optimizer's arguments, one ValueError naming the argument."""
    if kind not in ("average", "nesterov"):
        raise ValueError(f"outer must be average or nesterov, got {kind!r}")
    if compress not in ("none", "bf16"):
        raise ValueError(f"compress must be none or bf16, got {compress!r}")
    if not lr > 0:
        raise ValueError(f"outer_lr must be positive, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {momentum}")
