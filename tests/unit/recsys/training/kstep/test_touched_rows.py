"""Which embedding rows moved since the last merge: the rows a kernel's input names, recorded per
local table by a forward pre-hook (on a stand-in with a torchrec kernel's interface), and their
union over replicas, in each of its two exchanges, against hand-written row lists."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recsys.training.kstep.touched_rows as touched_rows
from recsys.training.kstep.touched_rows import TouchedRows, Union, _pack, _unpack, embedding_kernels, union


class _Kernel(nn.Module):
    """A torchrec embedding kernel's interface: tables of one flat buffer, a feature -> table map."""

    def __init__(self, rows: list[int], feature_table_map: list[int], update_scope: str = "batch") -> None:
        super().__init__()
        self.weights = torch.zeros(sum(rows), 4)
        self.rows = rows
        self._feature_table_map = feature_table_map
        self.emb_module = SimpleNamespace(hyper=SimpleNamespace(update_scope=update_scope))

    def split_embedding_weights(self) -> list[torch.Tensor]:
        return list(self.weights.split(self.rows))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.weights.sum()


class _Sharded(nn.Module):
    """A sharded module holds its kernels in `_lookups` (data-parallel ones wrapped, `.module`)."""

    def __init__(self, *kernels: _Kernel) -> None:
        super().__init__()
        self.kernels = nn.ModuleList(kernels)
        self._lookups = [
            SimpleNamespace(_emb_modules=[kernels[0]]),
            SimpleNamespace(module=SimpleNamespace(_emb_modules=list(kernels[1:]))),
        ]


def _kjt(ids: dict[str, list[int]]) -> KeyedJaggedTensor:
    values = [v for vs in ids.values() for v in vs]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(ids), values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor([len(v) for v in ids.values()])
    )


def _rows(bitmap: torch.Tensor) -> list[int]:
    return bitmap.nonzero().flatten().tolist()


def test_the_kernels_of_the_sharded_modules_are_found():
    a, b = _Kernel([3], [0]), _Kernel([2], [0])
    assert embedding_kernels(nn.Sequential(_Sharded(a, b), nn.Linear(1, 1))) == [a, b]


def test_each_lookup_marks_its_rows_in_its_tables_bitmap():
    kernel = _Kernel([5, 8], feature_table_map=[0, 1, 1])  # features f0 -> table 0, f1 and f2 -> table 1
    other = _Kernel([6], feature_table_map=[0], update_scope="catchup")
    tracked = TouchedRows(_Sharded(kernel, other))
    t0, t1 = kernel.split_embedding_weights()
    kernel(_kjt({"f0": [4, 1, 4], "f1": [7], "f2": [0, 7, 2]}))
    kernel(_kjt({"f0": [], "f1": [], "f2": [5]}))
    other(_kjt({"g": []}))
    assert _rows(tracked.bitmap_of(t0)) == [1, 4]
    assert _rows(tracked.bitmap_of(t1)) == [0, 2, 5, 7]
    (o,) = other.split_embedding_weights()
    assert _rows(tracked.bitmap_of(o)) == []
    assert tracked.moves_when_absent == {o.data_ptr()}  # catch-up moves rows nobody looked up
    assert tracked.bitmap_of(t1[:3]) is None  # a view of other length is not the table
    tracked.reset()
    assert _rows(tracked.bitmap_of(t0)) == [] and _rows(tracked.bitmap_of(t1)) == []
    tracked.close()
    kernel(_kjt({"f0": [3], "f1": [], "f2": []}))
    assert _rows(tracked.bitmap_of(t0)) == []  # no longer recorded


def test_first_values_are_the_rows_before_their_first_lookup_since_the_reset():
    """A row's value is kept at its first lookup only: later updates (the kernel's backward,
    written here by hand) do not change what was kept; features sharing a table and ids repeated
    in a batch keep a row once; tables whose absent rows move, or not named, keep nothing."""
    kernel = _Kernel([5, 8], feature_table_map=[0, 1, 1])
    kernel.weights.copy_(torch.arange(13 * 4, dtype=torch.float32).view(13, 4))
    other = _Kernel([6], feature_table_map=[0], update_scope="catchup")
    tracked = TouchedRows(_Sharded(kernel, other))
    t0, t1 = kernel.split_embedding_weights()
    (o,) = other.split_embedding_weights()
    assert tracked.first_values(t0) is None  # not asked for
    tracked.keep_first_values([t1, o])
    assert tracked.first_values(o) is None and tracked.first_values(t0) is None
    start = t1.clone()
    kernel(_kjt({"f0": [4], "f1": [7, 2, 7], "f2": [2, 5]}))
    t1[[2, 5, 7]] += 100.0  # the update after the lookup
    kernel(_kjt({"f0": [], "f1": [5, 0], "f2": [7]}))
    t1[[0, 5, 7]] += 100.0
    rows, values = tracked.first_values(t1)
    assert rows.tolist() == [0, 2, 5, 7]
    assert torch.equal(values, start[[0, 2, 5, 7]])
    tracked.reset()
    rows, values = tracked.first_values(t1)
    assert rows.tolist() == [] and values.shape == (0, 4)
    kernel(_kjt({"f0": [], "f1": [2], "f2": []}))
    assert torch.equal(tracked.first_values(t1)[1], t1[[2]])  # after a reset: the value now


def test_tracking_started_late_is_incomplete_until_the_first_reset():
    tracked = TouchedRows(_Sharded(_Kernel([4], [0]), _Kernel([2], [0])), complete=False)
    assert not tracked.complete
    tracked.reset()
    assert tracked.complete


def test_pack_and_unpack_bits_little_end_first():
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    packed = _pack(mask)
    assert packed.tolist() == [1 + 4 + 8, 2]
    assert torch.equal(_unpack(packed, 11), mask)


def _bitmaps(*rows: tuple[int, list[int]]) -> list[torch.Tensor]:
    out = []
    for n, touched in rows:
        bm = torch.zeros(n, dtype=torch.bool)
        bm[touched] = True
        out.append(bm)
    return out


def test_alone_the_union_is_the_own_rows_without_an_exchange(gloo_world_of_one):
    bitmaps = _bitmaps((6, [1, 4]), (3, []))
    for pg in (None, dist.group.WORLD):
        u = union(bitmaps, pg)
        assert [r.tolist() for r in u.rows] == [[1, 4], []] and (u.exchange_bytes, u.mode) == (0, "none")


class _TwoReplicas:
    """The collectives of a replica group of two, the other replica's part written by hand."""

    ReduceOp = dist.ReduceOp

    def __init__(self, other_count: int, other_part: torch.Tensor) -> None:
        self.other_count, self.other_part = other_count, other_part
        self.gathered: list[torch.Tensor] = []

    def get_world_size(self, pg=None) -> int:
        return 2

    def all_reduce(self, t: torch.Tensor, op=None, group=None) -> None:
        assert op == dist.ReduceOp.MAX
        t.copy_(torch.maximum(t, torch.tensor([self.other_count])))  # MAX of the touched-row counts

    def all_gather(self, parts: list[torch.Tensor], mine: torch.Tensor, group=None) -> None:
        self.gathered.append(mine.clone())
        parts[0].copy_(mine)
        parts[1].copy_(self.other_part)


def test_few_rows_are_exchanged_as_row_lists(monkeypatch):
    # two tables of 100 and 60 rows: 160 bits are 20 bytes; 3 and 2 rows at 4 bytes each are less
    bitmaps = _bitmaps((100, [7, 50]), (60, [3]))
    other = torch.tensor([50, 99, 100 + 10], dtype=torch.int32)  # rows 50, 99 of table 0, row 10 of table 1
    fake = _TwoReplicas(other_count=3, other_part=other)
    monkeypatch.setattr(touched_rows, "dist", fake)
    u = union(bitmaps, pg="replicas")
    assert fake.gathered[0].tolist() == [7, 50, 103]  # ids offset by the table starts, padded to the longest list (3)
    assert [r.tolist() for r in u.rows] == [[7, 50, 99], [3, 10]]
    assert (u.exchange_bytes, u.mode) == (1 * 3 * 4 + 8, "ids")


def test_many_rows_are_exchanged_as_bitmaps(monkeypatch):
    bitmaps = _bitmaps((10, [0, 1, 2, 3]), (6, [5]))  # 16 bits: 2 bytes, fewer than 5 rows of 4 bytes
    other = torch.tensor([0b0010_0000, 0b0000_0100], dtype=torch.uint8)  # bits 5 and 10: row 5 of table 0, row 0 of table 1
    fake = _TwoReplicas(other_count=2, other_part=other)
    monkeypatch.setattr(touched_rows, "dist", fake)
    u = union(bitmaps, pg="replicas")
    assert fake.gathered[0].tolist() == [0b0000_1111, 0b1000_0000]  # rows 0-3, and bit 15: row 5 of table 1
    assert [r.tolist() for r in u.rows] == [[0, 1, 2, 3, 5], [0, 5]]
    assert u == Union(u.rows, 1 * 2 + 8, "bitmap")
