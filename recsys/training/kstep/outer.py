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

Lazy anchors: a shard merged by its touched rows keeps no copy of itself. Every row this replica
did not change since the last merge still holds the value that merge left, its anchor; a row it
changed had that value when it first changed, which the caller records then (``Part.before``:
``TouchedRows`` copies a row in the kernel's forward, before its first update). Its momentum and
residual are kept for the rows merged so far (``recsys.training.kstep.row_state``). So the state
grows with the rows merged, not with the tables: at Criteo's raw sizes a dense anchor and
residual per shard (2.2 GB a rank) did not fit four ranks on one 23.5 GB machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from recsys.training.kstep.row_state import MergedRows, Saved, fits

log = logging.getLogger(__name__)

OuterKind = Literal["average", "nesterov"]
Compress = Literal["none", "bf16"]
Reduce = Callable[[Tensor], None]  # an in-place collective over the replica group


@dataclass
class Slot:
    """One merged tensor's state. Dense: ``anchor`` shaped like the tensor (a hierarchical slice:
    like the slice), ``momentum`` / ``residual`` when first used. Lazy (``rows`` set, module
    docstring): no anchor, momentum and residual per merged row."""

    shape: torch.Size
    anchor: Tensor | None = None
    momentum: Tensor | None = None
    residual: Tensor | None = None
    rows: MergedRows | None = None


@dataclass
class Part:
    """One tensor of a flat merge buffer: its state key, the tensor (full shape, the model's own
    storage or a slice buffer), the rows of it in the buffer (None: all of it, sorted otherwise)
    and, for a tensor whose anchor is lazy, ``before``: the rows this replica changed since the
    last merge (sorted, each among ``rows``) and their values before they changed."""

    key: str
    tensor: Tensor
    rows: Tensor | None = None
    before: tuple[Tensor, Tensor] | None = None

    def row_ids(self) -> Tensor:
        return self.rows if self.rows is not None else torch.arange(self.tensor.shape[0], device=self.tensor.device)


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
        if any(s is None or s.shape != p.tensor.shape or (s.rows is None) != (p.before is None) for s, p in zip(slots, parts)):
            average(local)  # no anchor yet: plain average, whose result becomes the anchor
            for p in parts:
                lazy = p.before is not None
                anchor = None if lazy else p.tensor.detach().clone()
                self.slots[p.key] = Slot(p.tensor.shape, anchor, rows=MergedRows(p.tensor.shape, p.tensor.device) if lazy else None)
            self._store(local, parts, "anchor")
            return local.numel() * local.element_size()
        anchor = _cat([_anchor_of(s, p) for s, p in zip(slots, parts)])  # type: ignore[arg-type]
        if self.compress == "bf16" and local.dtype == torch.float32:
            delta = local - anchor + self._gather(parts, "residual")
            sent = delta.to(torch.bfloat16)
            self._store(delta - sent.float(), parts, "residual")
            total(sent)
            mean = anchor + sent.float() / self.hosts
            nbytes = sent.numel() * sent.element_size()
        else:
            average(local)
            mean, nbytes = local, local.numel() * local.element_size()
        if self.kind == "nesterov":
            m = self._gather(parts, "momentum")
            new = nesterov_step(anchor, mean, m, self.lr, self.momentum)
            self._store(m, parts, "momentum")
        else:
            new = mean
        local.copy_(new)
        self._store(local, parts, "anchor")
        return nbytes

    def state_bytes(self) -> int:
        """Bytes of the state this replica keeps between merges (anchors, momentum, residuals)."""
        total = 0
        for slot in self.slots.values():
            for t in (slot.anchor, slot.momentum, slot.residual):
                total += 0 if t is None else t.numel() * t.element_size()
            total += 0 if slot.rows is None else slot.rows.nbytes()
        return total

    def refresh_anchor(self, key: str, tensor: Tensor) -> None:
        """The anchor of ``key`` becomes ``tensor`` as it is now: for tables whose absent rows move
        at the merge by the same catch-up on every host, so the anchor stays the model as it was
        right after the merge, catch-up included (such tables keep dense anchors)."""
        slot = self.slots.get(key)
        if slot is not None and slot.anchor is not None and slot.shape == tensor.shape:
            slot.anchor.copy_(tensor)

    def set_anchor(self, key: str, tensor: Tensor, lazy: bool = False) -> None:
        """The anchor of ``key`` is ``tensor`` as it is now (a resume: the model a merge left);
        ``lazy``: the tensor is a shard merged by its touched rows (module docstring)."""
        slot = self.slots.get(key)
        if slot is None or slot.shape != tensor.shape or (slot.rows is not None) != lazy:
            rows = MergedRows(tensor.shape, tensor.device) if lazy else None
            self.slots[key] = Slot(tensor.shape, None if lazy else tensor.detach().clone(), rows=rows)
        elif slot.anchor is not None:
            slot.anchor.copy_(tensor)

    def _gather(self, parts: list[Part], name: str) -> Tensor:
        """``momentum`` or ``residual`` of the parts' rows, flat fp32 (zero where never set)."""
        out = []
        for p in parts:
            slot = self.slots[p.key]
            if slot.rows is not None:
                out.append(slot.rows.get(name, p.row_ids()).reshape(-1))
            else:
                value = getattr(slot, name)
                if value is None:
                    value = torch.zeros(slot.shape, dtype=torch.float32, device=p.tensor.device)
                    setattr(slot, name, value)
                out.append(pack([value], [p]))
        return _cat(out)

    def _store(self, flat: Tensor, parts: list[Part], name: str) -> None:
        """Writes ``flat`` (packed as ``pack`` does) as the parts' ``name``; a lazy slot's anchor is
        the merged model itself, so nothing is stored for it."""
        offset = 0
        for p in parts:
            slot = self.slots[p.key]
            n = _packed_numel(p)
            chunk = flat[offset : offset + n]
            offset += n
            if slot.rows is not None:
                if name != "anchor":
                    slot.rows.put(name, p.row_ids(), chunk)
                continue
            if getattr(slot, name) is None:
                setattr(slot, name, torch.zeros(slot.shape, dtype=torch.float32, device=p.tensor.device))
            unpack(chunk, [getattr(slot, name)], [p])

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Tensor | Saved]]:
        """Momentum and residual per key (the anchors are the model a checkpoint holds); a lazy
        slot's as its merged rows and their values."""
        out: dict[str, dict[str, Tensor | Saved]] = {"momentum": {}, "residual": {}}
        for key, slot in self.slots.items():
            for name in out:
                value = slot.rows.saved(name) if slot.rows is not None else getattr(slot, name)
                if isinstance(value, Tensor):
                    value = value.detach().clone()
                if value is not None:
                    out[name][key] = value
        return out

    def resume(self, anchors: list[tuple[str, Tensor, bool]], state: dict[str, dict[str, Tensor | Saved]] | None) -> None:
        """After a checkpoint taken at a merge was loaded: the anchors are the model now (``anchors``:
        (key, tensor, lazy)), momentum and residuals come from ``state``; each loss is logged."""
        if not self.active:
            log.warning("k-step merge: the checkpoint's outer momentum / bf16 residuals are not used (plain averaging)")
            return
        for key, tensor, lazy in anchors:
            self.set_anchor(key, tensor, lazy)
        if state is None:
            log.warning("k-step merge: the checkpoint has no outer state: outer momentum and bf16 residuals start from zero")
        self.load_state_dict(state or {})

    def load_state_dict(self, state: dict[str, dict[str, Tensor | Saved]]) -> None:
        """Momentum and residual for the slots whose anchors ``set_anchor`` just took from the
        loaded model (dense or per merged row, whichever the checkpoint has). Saved state that
        does not fit these slots (another plan, another number of ranks per host) is not used:
        all of it restarts from zero, with one warning."""
        saved = {name: state.get(name, {}) for name in ("momentum", "residual")}
        misfit = [
            f"{name} {key}"
            for name, values in saved.items()
            for key, value in values.items()
            if key not in self.slots or not fits(self.slots[key].shape, value)
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
            if slot.rows is not None:
                slot.rows = MergedRows(slot.shape, slot.rows.position.device)
        for name, values in saved.items():
            for key, value in values.items():
                slot = self.slots[key]
                if slot.rows is not None:
                    slot.rows.load(name, value)
                    continue
                assert slot.anchor is not None
                device = slot.anchor.device
                if isinstance(value, Tensor):
                    setattr(slot, name, value.to(device=device, dtype=torch.float32).clone())
                    continue
                dense = torch.zeros(slot.shape, dtype=torch.float32, device=device)
                dense[value["rows"].to(device, torch.long)] = value["values"].to(device, torch.float32)
                setattr(slot, name, dense)


def _anchor_of(slot: Slot, part: Part) -> Tensor:
    """The anchor of a part's rows, flat fp32: a dense slot's, or a lazy slot's (module docstring):
    the tensor's values with the rows this replica changed since the last merge as they were."""
    if slot.rows is None:
        assert slot.anchor is not None
        return pack([slot.anchor], [part])
    assert part.before is not None
    rows = part.row_ids()
    base = pack([part.tensor], [part]).view(rows.numel(), -1)
    if base.untyped_storage().data_ptr() == part.tensor.untyped_storage().data_ptr():  # a view of the model: copy
        base = base.clone()
    changed, values = part.before
    if changed.numel():
        at = torch.searchsorted(rows, changed) if part.rows is not None else changed
        if int(at.max()) >= rows.numel() or not torch.equal(rows[at], changed):
            raise RuntimeError(f"k-step merge: rows of {part.key} this replica changed since the last merge are not among the rows merged")
        base[at] = values.reshape(changed.numel(), -1).to(base.dtype)
    return base.reshape(-1)


def _packed_numel(part: Part) -> int:
    t = part.tensor
    return t.numel() if part.rows is None else part.rows.numel() * (t.numel() // max(t.shape[0], 1))


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
    return _cat(out)


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
