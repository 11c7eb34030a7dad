"""Model shapes and arithmetic (recsys/models/ctr.py), checked against independent computations
(no sharding here: tables on CPU so the models run as plain modules)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

from recsys.config import ModelConfig
from recsys.models.ctr import TrainModule, build_model, deep_tower, factorization_machine, in_feature_order
from tests.support.models import CARDS, CPU, NAMES, kjt


def _model(name: str, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(name=name, embedding_dim=8, dnn=[16, 8], cross_layers=2, **kw)
    return build_model(cfg, NAMES, CARDS, 4, CPU, emb_device=CPU)


@pytest.mark.parametrize("name", ["deepfm", "wide_deep", "dcn", "dcnv2"])
def test_forward_shape_and_dense_input_width(name):
    m = _model(name)
    ids = torch.tensor([[0, 1, 2], [6, -1, 12], [3, 3, 3], [-1, -1, -1], [1, 2, 3]])
    out = m(torch.randn(5, 4), kjt(ids))
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
    got = m(dense, kjt(ids))
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
    full = m._wide_logit(dense, m.sparse(dense, kjt(torch.tensor([[1, 2, 3]])))[1])
    missing = m._wide_logit(dense, m.sparse(dense, kjt(torch.tensor([[1, -1, 3]])))[1])
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


def test_fm_term_is_half_of_square_of_sum_minus_sum_of_squares():
    """The FM identity sum_{f<g} <v_f, v_g> = 1/2 sum_d ((sum_f v_fd)^2 - sum_f v_fd^2), written out
    per sample and dimension here; torchrec's FactorizationMachine would also multiply different
    dimensions with each other."""
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    expected = torch.zeros(4, dtype=torch.float64)
    for b in range(4):
        for d in range(3):
            column = [float(emb[b, f, d]) for f in range(5)]
            expected[b] += 0.5 * (sum(column) ** 2 - sum(v * v for v in column))
    torch.testing.assert_close(factorization_machine(emb), expected)
    pairs = torch.stack([sum(torch.dot(emb[b, f], emb[b, h]) for f, h in itertools.combinations(range(5), 2)) for b in range(4)])
    torch.testing.assert_close(factorization_machine(emb), pairs)


def _embedded_input(m, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[dense, e_a, e_b, e_c] per sample, read from the tables directly."""
    tables = [m.embeddings.embedding_bags[f"t_{n}"].weight for n in NAMES]
    return torch.stack([torch.cat([dense[i]] + [tables[f][ids[i, f]] for f in range(len(NAMES))]) for i in range(len(ids))])


def test_dcn_cross_layers_follow_the_vector_cross_formula():
    """DCN (v1): x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l, and the logit is the head on
    [cross(x), dnn(x)]."""
    m = _model("dcn")
    with torch.no_grad():
        for b in m.cross.bias:
            b.uniform_(-0.5, 0.5)
    ids = torch.tensor([[0, 1, 2], [6, 10, 12]])
    dense = torch.randn(2, 4)
    x = _embedded_input(m, dense, ids)
    for i in range(2):
        x0 = x_l = x[i]
        for w, b in zip(m.cross.kernels, m.cross.bias):
            x_l = x0 * torch.dot(x_l, w.reshape(-1)) + b.reshape(-1) + x_l
        torch.testing.assert_close(m.cross(x[i : i + 1])[0], x_l, rtol=1e-5, atol=1e-6)
        logit = m.head(torch.cat([x_l, m.dnn(x[i : i + 1])[0]])).squeeze()
        torch.testing.assert_close(m(dense, kjt(ids))[i], logit, rtol=1e-5, atol=1e-5)


def test_dcnv2_cross_layers_follow_the_matrix_and_low_rank_formulas():
    """DCNv2: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l; low rank: W_l = U_l V_l (n x r times r x n)."""
    x = torch.randn(3, 4 + 3 * 8)
    full = _model("dcnv2").cross
    low = _model("dcnv2", cross_low_rank=4).cross
    with torch.no_grad():
        for b in [*full.bias, *low.bias]:
            b.uniform_(-0.5, 0.5)
    for i in range(3):
        x0 = x_l = x[i]
        for w, b in zip(full.kernels, full.bias):
            x_l = x0 * (w @ x_l + b.reshape(-1)) + x_l
        torch.testing.assert_close(full(x[i : i + 1])[0], x_l, rtol=1e-5, atol=1e-5)
        x_l = x0
        for u, v, b in zip(low.W_kernels, low.V_kernels, low.bias):
            assert v.shape == (4, 4 + 3 * 8) and u.shape == (4 + 3 * 8, 4)
            x_l = x0 * (u @ (v @ x_l) + b.reshape(-1)) + x_l
        torch.testing.assert_close(low(x[i : i + 1])[0], x_l, rtol=1e-5, atol=1e-5)


def test_embeddings_reach_the_dense_layers_in_the_model_feature_order():
    """A sharded collection returns its KeyedTensor in its shardings' order; the dense layers still
    see the model's own feature order."""
    a, b = torch.arange(6.0).reshape(2, 3), 100 + torch.arange(4.0).reshape(2, 2)
    shuffled = KeyedTensor(keys=["b", "a"], length_per_key=[2, 3], values=torch.cat([b, a], dim=1))
    assert torch.equal(in_feature_order(shuffled, ["a", "b"]), torch.cat([a, b], dim=1))
    ordered = KeyedTensor(keys=["a", "b"], length_per_key=[3, 2], values=torch.cat([a, b], dim=1))
    assert torch.equal(in_feature_order(ordered, ["a", "b"]), torch.cat([a, b], dim=1))


def test_tower_with_dropout_is_linear_relu_per_layer_and_drops_only_in_training():
    torch.manual_seed(0)
    tower = deep_tower(6, ModelConfig(dnn=[5, 3], dropout=0.5), CPU)
    linears = [m for m in tower if isinstance(m, torch.nn.Linear)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(6, 5), (5, 3)]
    x = torch.randn(4, 6)
    expected = x
    for lin in linears:
        expected = torch.clamp(expected @ lin.weight.T + lin.bias, min=0.0)
    tower.eval()
    torch.testing.assert_close(tower(x), expected)
    tower.train()
    torch.manual_seed(1)
    dropped = tower(torch.ones(256, 6))
    assert 0 < int((dropped == 0).sum()) < dropped.numel()  # some units dropped, not all


def test_unknown_model_name_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"^unknown model 'fm'$"):
        build_model(ModelConfig(name="fm"), NAMES, CARDS, 4, CPU, emb_device=CPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^model.table_rows_factor must be >= 1, got 0$"):
        build_model(ModelConfig(table_rows_factor=0), NAMES, CARDS, 4, CPU, emb_device=CPU)
    with pytest.raises(ValueError, match=r"^micro_batch_rows must be >= 0, got -2$"):
        TrainModule(_model("deepfm"), -2)


def test_train_module_loss_is_the_mean_binary_cross_entropy_of_the_logits():
    """batch -> (loss, (loss, logits, labels)); the loss written out as -mean(y log p + (1-y) log(1-p))."""
    from types import SimpleNamespace

    m = _model("wide_deep")
    ids = torch.tensor([[0, 1, 2], [6, 10, 12], [3, -1, 3], [1, 1, 1]])
    batch = SimpleNamespace(dense_features=torch.randn(4, 4), sparse_features=kjt(ids), labels=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    loss, (detached, logits, labels) = TrainModule(m, 0)(batch)
    p = torch.sigmoid(m(batch.dense_features, batch.sparse_features))
    y = batch.labels
    expected = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert loss.requires_grad and not detached.requires_grad and float(detached) == float(loss)
    assert labels is batch.labels
