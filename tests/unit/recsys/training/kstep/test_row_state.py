"""Per-row outer state kept for the rows merges have merged (recsys/training/kstep/row_state.py):
against a dense table written alongside, over many random puts; the checkpoint round trip in both
forms (merged rows, a dense tensor); and what does not fit a shard."""

from __future__ import annotations

import torch

from recsys.training.kstep.row_state import MergedRows, fits


def test_puts_and_gets_equal_a_dense_table_and_unset_rows_read_zero():
    g = torch.Generator().manual_seed(0)
    store = MergedRows((5000, 3))
    dense = {"momentum": torch.zeros(5000, 3), "residual": torch.zeros(5000, 3)}
    ever: set[int] = set()
    for i in range(60):
        rows = torch.randperm(5000, generator=g)[: int(torch.randint(1, 200, (1,), generator=g))]
        if i % 2:
            rows = rows.sort().values
        name = "momentum" if i % 3 else "residual"
        values = torch.randn(rows.numel(), 3, generator=g)
        store.put(name, rows, values)
        dense[name][rows] = values
        ever.update(rows.tolist())
        probe = torch.randint(0, 5000, (300,), generator=g)
        for n in dense:
            assert torch.equal(store.get(n, probe), dense[n][probe]), (i, n)
    assert store.count == len(ever)
    assert set(store.stored_rows().tolist()) == ever
    assert store.rows.numel() <= max(2 * (len(ever) + 1), 64)  # capacity at most doubles past what is used
    full = MergedRows((100, 3))
    full.put("momentum", torch.arange(70), torch.ones(70, 3))
    full.put("momentum", torch.arange(70, 100), torch.ones(30, 3))
    assert full.rows.numel() == 101 and full.values["momentum"].shape == (101, 3)  # the shard's rows and the zero row
    assert int((store.position > 0).sum()) == len(ever)


def test_a_name_never_put_reads_zero_on_rows_another_name_holds():
    store = MergedRows((10, 2))
    store.put("momentum", torch.tensor([3, 7]), torch.ones(2, 2))
    assert store.get("residual", torch.tensor([3, 7])).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    store.put("residual", torch.tensor([7]), torch.full((1, 2), 2.0))
    assert store.get("residual", torch.tensor([3, 7, 9])).tolist() == [[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
    assert store.saved("momentum")["rows"].tolist() == [3, 7] and store.saved("other") is None


def test_saved_rows_and_a_dense_tensor_load_into_the_same_state():
    g = torch.Generator().manual_seed(1)
    a = MergedRows((100, 4))
    rows = torch.tensor([90, 2, 41, 7])
    values = torch.randn(4, 4, generator=g)
    a.put("residual", rows, values)
    b = MergedRows((100, 4))
    b.load("residual", a.saved("residual"))
    dense = torch.zeros(100, 4)
    dense[rows] = values
    c = MergedRows((100, 4))
    c.load("residual", dense)
    every = torch.arange(100)
    assert torch.equal(b.get("residual", every), dense) and torch.equal(c.get("residual", every), dense)
    assert c.count == 4  # only the non-zero rows of the dense tensor are kept


def test_fits_only_state_of_the_shards_shape():
    ok = {"rows": torch.tensor([0, 9]), "values": torch.zeros(2, 4)}
    assert fits((10, 4), ok) and fits((10, 4), torch.zeros(10, 4))
    assert not fits((10, 4), torch.zeros(11, 4))
    assert not fits((10, 4), {"rows": torch.tensor([0, 10]), "values": torch.zeros(2, 4)})  # a row past the shard
    assert not fits((10, 4), {"rows": torch.tensor([0, 9]), "values": torch.zeros(2, 5)})  # another width
    assert not fits((10, 4), {"rows": torch.tensor([0]), "values": torch.zeros(2, 4)})
    assert not fits((10, 4), {"values": torch.zeros(2, 4)})
    assert not fits((10, 4), [torch.zeros(10, 4)]) and not fits((10, 4), None)  # not a tensor or saved rows
