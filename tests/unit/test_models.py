"""Model shapes and arithmetic, checked against independent computations (no sharding here:
tables on CPU so the models run as plain modules)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.config import ModelConfig
from recsys.models.ctr import build_model

NAMES = ["a", "b", "c"]
CARDS = [7, 11, 13]
CPU = torch.device("cpu")


def _kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    """[B, F] ids (-1 = missing) -> KJT with one id per present field."""
    valid = (ids >= 0).T
    return KeyedJaggedTensor.from_lengths_sync(NAMES, ids.T[valid], valid.reshape(-1).int())


def _model(name: str, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(name=name, embedding_dim=8, dnn=[16, 8], cross_layers=2, **kw)
    return build_model(cfg, NAMES, CARDS, 4, CPU, emb_device=CPU)


@pytest.mark.parametrize("name", ["deepfm", "wide_deep", "dcn", "dcnv2"])
def test_forward_shape_and_dense_input_width(name):
    m = _model(name)
    ids = torch.tensor([[0, 1, 2], [6, -1, 12], [3, 3, 3], [-1, -1, -1], [1, 2, 3]])
    out = m(torch.randn(5, 4), _kjt(ids))
    assert out.shape == (5,)
    assert m.in_features == 4 + 3 * 8
    assert torch.isfinite(out).all()


def test_deepfm_is_linear_plus_fm_plus_dnn():
    """DeepFM's logit equals an explicit first-order sum + pairwise dot products + the tower."""
    m = _model("deepfm")
    with torch.no_grad():
        for t in m.wide.embedding_bags.values():
            t.weight.uniform_(-1, 1)
        m.dense_linear.weight.uniform_(-1, 1)
    ids = torch.tensor([[0, 1, 2], [6, 10, 12], [3, 3, 3]])
    dense = torch.randn(3, 4)
    got = m(dense, _kjt(ids))
    tables = [m.embeddings.embedding_bags[f"t_{n}"].weight for n in NAMES]
    wide = [m.wide.embedding_bags[f"w_{n}"].weight for n in NAMES]
    for i in range(3):
        e = [tables[f][ids[i, f]] for f in range(3)]
        linear = sum(wide[f][ids[i, f]].mean() for f in range(3)) + m.dense_linear(dense[i]).squeeze()
        fm = sum(torch.dot(e[f], e[g]) for f, g in itertools.combinations(range(3), 2))
        tower = m.head(m.dnn(torch.cat([dense[i]] + e)[None])).squeeze()
        torch.testing.assert_close(got[i], linear + fm + tower, rtol=1e-5, atol=1e-5)


def test_missing_field_contributes_nothing():
    """A missing id is an empty bag: zero embedding, no first-order weight."""
    m = _model("wide_deep")
    with torch.no_grad():
        for t in m.wide.embedding_bags.values():
            t.weight.fill_(1.0)
    dense = torch.zeros(1, 4)
    full = m._wide_logit(dense, m.sparse(dense, _kjt(torch.tensor([[1, 2, 3]])))[1])
    missing = m._wide_logit(dense, m.sparse(dense, _kjt(torch.tensor([[1, -1, 3]])))[1])
    assert float(full) == pytest.approx(3.0) and float(missing) == pytest.approx(2.0)


def test_linear_parts_start_at_zero_and_tables_use_init_std():
    m = build_model(ModelConfig(embedding_init_std=0.01), ["x"], [20000], 13, CPU, emb_device=CPU)
    assert float(m.wide.embedding_bags["w_x"].weight.abs().max()) == 0.0
    assert float(m.dense_linear.weight.abs().max()) == 0.0
    cfgs = {c.name: c for c in m.embeddings.embedding_bag_configs()}
    c = cfgs["t_x"]
    # uniform on [-s*sqrt(3), s*sqrt(3)] has standard deviation s
    assert (c.weight_init_max - c.weight_init_min) / 12**0.5 == pytest.approx(0.01)


def test_dcnv2_low_rank_has_fewer_parameters():
    full = sum(p.numel() for p in _model("dcnv2").cross.parameters())
    low = sum(p.numel() for p in _model("dcnv2", cross_low_rank=4).cross.parameters())
    n = 4 + 3 * 8
    assert full == 2 * (n * n + n)
    assert low < full


def test_table_rows_factor_sizes_tables_beyond_the_ids():
    """model.table_rows_factor=3: every table has 3x its feature's cardinality in rows (the ids
    stay below the cardinality); the config refuses 0 in one line."""
    from recsys.config import ConfigError, load_config

    model = build_model(ModelConfig(name="deepfm", dnn=[8], table_rows_factor=3), ["a", "b"], [10, 7], 2, torch.device("cpu"))
    rows = sorted(c.num_embeddings for m in model.modules() if hasattr(m, "embedding_bag_configs") for c in m.embedding_bag_configs())
    assert rows and set(rows) == {21, 30}, rows
    with pytest.raises(ConfigError, match="key 'model.table_rows_factor': must be >= 1"):
        load_config(None, ["model.table_rows_factor=0"])
