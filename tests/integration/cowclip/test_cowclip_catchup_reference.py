"""CowClip-Adam with ``update_scope="catchup"`` against an independent dense reference.

The reference below is written from the semantics of the paper's code (bytedance/LargeBatchCTR,
TensorFlow), not from this project's code: the loss is the batch mean of a logistic loss plus
``l2 * sum ||w||^2`` over every embedding row, so every row gets the gradient ``2 * l2 * w`` at
every step, also when absent from the batch; the per-row gradient is clipped to
``r * cnt * max(||w||, r * sqrt(D) * zeta)`` with ``cnt`` the number of samples holding the id
(1 for an absent row); a dense Adam (torch's eps placement) updates every row with the global step
in its bias corrections. float64 throughout.

The model: per table one id per sample (so a pooled bag is the row itself), a fixed projection of
the pooled embeddings to one logit, labels of a fixed draw. Ids follow a Zipf(1.2) law over the
rows, so most rows sit out long gaps between their occurrences and are brought forward by the
catch-up when next read.

What is asserted, per case of the grid lr x l2 x zeta (and, under real TorchRec sharding, per
sharding type on 1 and 2 ranks):

* the tables after training (every row caught up) are within ``W_ERR_LR`` lr of the reference;
* every gap of the reference run, caught up from the reference's own state: its weights within
  ``GAP_W_LR`` lr of the reference's, and the ``max(||w||, zeta')`` the next clip reads within 5%
  of the reference's, or within ``GAP_THR_LR`` lr of it (rows near 0, where 5% is less than the
  weights' own error).
"""

from __future__ import annotations

import math

import pytest
import torch

from recsys.optim.cowclip.tbe import CowClipAdamTBE
from recsys.optim.cowclip.hyper import CowClipHyper
from test_cowclip_catchup import _sh_local  # ((row, col) offset, tensor) of each local shard
from tests.support.processes import start_workers

TABLES = [(60, 16), (30, 8)]
B = 8
STEPS = 300
B1, B2, EPS = 0.9, 0.999, 1e-8
W_ERR_LR = 0.3
CHAOS = 1.5
GAP_W_LR = 0.25
THR_REL, GAP_THR_LR = 0.05, 0.07


def _batches(steps: int, tables, batch: int, seed: int = 0):
    """Per step: one id per sample and table (Zipf 1.2 over the rows), and the labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = []
        for n, _d in tables:
            p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.2
            ids.append(torch.multinomial(p / p.sum(), batch, replacement=True, generator=g))
        out.append((ids, (torch.rand(batch, generator=g) < 0.3).double()))
    return out


def _init(tables, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) * 0.05 for n, d in tables]


def _proj(tables):
    return [torch.randn(d, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64) for i, (_n, d) in enumerate(tables)]


def _pooled_grads(pooled, labels, proj, denom: int):
    """d(sum of logistic losses / denom) / d(pooled embeddings), per table."""
    z = sum(p @ q for p, q in zip(pooled, proj))
    dz = (torch.sigmoid(z) - labels) / denom
    return [dz[:, None] * q[None, :] for q in proj]


def tf_dense_reference(init, batches, tables, *, lr: float, l2: float, zeta: float, r: float = 1.0, history: bool = False):
    """The dense reference: returns the final tables and, with ``history``, (w, m, v) of every
    table after every step (index 0: the start; else None)."""
    proj = _proj(tables)
    w = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    hist = [([x.clone() for x in w], [x.clone() for x in m], [x.clone() for x in v])] if history else None
    for t, (ids, labels) in enumerate(batches, 1):
        pooled = [w[i][ids[i]] for i in range(len(tables))]
        grads = _pooled_grads(pooled, labels, proj, len(labels))
        for i, (n, d) in enumerate(tables):
            floor = r * math.sqrt(d) * zeta
            g = torch.zeros(n, d, dtype=torch.float64).index_add_(0, ids[i], grads[i]) + 2.0 * l2 * w[i]
            cnt = torch.bincount(ids[i], minlength=n).double().clamp(min=1.0)
            clip = r * cnt * w[i].norm(dim=1).clamp(min=floor)
            gn = g.norm(dim=1)
            g = g * torch.where(gn > clip, clip / gn, torch.ones_like(gn))[:, None]
            m[i] = B1 * m[i] + (1 - B1) * g
            v[i] = B2 * v[i] + (1 - B2) * g * g
            bc1, bc2 = 1 - B1**t, 1 - B2**t
            w[i] = w[i] - lr * (m[i] / bc1) / (v[i].sqrt() / math.sqrt(bc2) + EPS)
        if history:
            hist.append(([x.clone() for x in w], [x.clone() for x in m], [x.clone() for x in v]))
    return w, hist


def _train_tbe(init, batches, *, lr: float, l2: float, zeta: float):
    """The catch-up TBE (inline mode, the default kernel of this machine) on the same batches."""
    hp = CowClipHyper(learning_rate=lr, l2=l2, cowclip_r=1.0, cowclip_zeta=zeta, update_scope="catchup")
    tbe = CowClipAdamTBE(TABLES, [0, 1], hp, full_dims=[d for _, d in TABLES], mode="inline")
    tbe.weights.copy_(torch.cat([t.flatten() for t in init]).float())
    proj = _proj(TABLES)
    offsets = torch.arange(0, len(TABLES) * B + 1)
    for ids, labels in batches:
        out = tbe(torch.cat(ids), offsets)
        pooled, col = [], 0
        for _n, d in TABLES:
            pooled.append(out[:, col : col + d].detach().double())
            col += d
        out.backward(torch.cat(_pooled_grads(pooled, labels, proj, B), 1).float())
    tbe.catch_up_all()
    flat, tables, off = tbe.weights.detach().double(), [], 0
    for n, d in TABLES:
        tables.append(flat[off : off + n * d].view(n, d))
        off += n * d
    return tables


def _spread(init, batches, *, lr: float, l2: float, zeta: float, ref) -> float:
    """How far the reference's own final tables move (max, in lr) when its initial weights move by
    +-0.01 lr (fixed random signs): where this is large, the dynamics amplifies any small
    difference (the clip threshold is proportional to ||w||), and no approximation of it can end
    closer than about this."""
    g = torch.Generator().manual_seed(3)
    moved = [t + 0.01 * lr * (2.0 * torch.randint(0, 2, t.shape, generator=g).double() - 1.0) for t in init]
    out, _ = tf_dense_reference(moved, batches, TABLES, lr=lr, l2=l2, zeta=zeta)
    return max(float((a - b).abs().max()) for a, b in zip(out, ref)) / lr


@pytest.mark.parametrize("lr", [1e-4, 1e-3, 1e-2])
def test_catchup_stays_within_one_lr_of_the_dense_reference(lr):
    """300 steps, l2 in {1e-5, 1e-3, 1e-2}, zeta in {1e-5, 1e-2}, the default kernel: final tables
    within W_ERR_LR lr of the reference (measured: 0.04-0.14 lr), or, on at most one case, where
    the reference itself moves further than W_ERR_LR when its initial weights move by 0.01 lr,
    within CHAOS x that spread. Such a case is lr 1e-2, l2 1e-3, zeta 1e-5 (the clip threshold is
    proportional to ||w||, so that case amplifies any difference): on these batches the
    reference moves 1.35 lr and the catch-up ends 0.66 lr away."""
    batches, init = _batches(STEPS, TABLES, B), _init(TABLES)
    worst = []
    for l2 in (1e-5, 1e-3, 1e-2):
        for zeta in (1e-5, 1e-2):
            ref, _ = tf_dense_reference(init, batches, TABLES, lr=lr, l2=l2, zeta=zeta)
            got = _train_tbe(init, batches, lr=lr, l2=l2, zeta=zeta)
            err = max(float((a - b).abs().max()) for a, b in zip(got, ref)) / lr
            # every row moved, also those never read (L2 and the decaying moments): nothing skipped
            assert all(bool((a != b.float().double()).all()) for a, b in zip(got, init)), (l2, zeta)
            spread = _spread(init, batches, lr=lr, l2=l2, zeta=zeta, ref=ref) if err > W_ERR_LR else 0.0
            worst.append((l2, zeta, round(err, 3), round(spread, 3)))
    assert all(e <= W_ERR_LR or e <= CHAOS * sp for _l2, _z, e, sp in worst), worst
    assert sum(e > W_ERR_LR for _l2, _z, e, _sp in worst) <= 1, worst


@pytest.mark.parametrize("lr", [1e-4, 1e-3, 1e-2])
def test_each_gap_ends_where_the_reference_is_and_the_clip_reads_the_right_norm(lr):
    """Every gap of the reference run (a row absent from step s+1 to T-1, read at T), advanced by
    ``catch_up`` from the reference's own (w, m, v) at s: at T-1 its weights are within GAP_W_LR lr
    of the reference's (measured: 0.17 lr; 0.04 lr at lr 1e-4 and 1e-3), and max(||w||, zeta'),
    what the clip at T reads, within 5% of the reference's or, for rows near 0, within GAP_THR_LR
    lr (measured: 2 of 1,571 gaps beyond 5%, at lr 1e-2, l2 1e-2, zeta 1e-5: 1.22x, 0.054 lr).
    This isolates the catch-up from the amplification of the end-to-end test."""
    from recsys.optim.cowclip.catchup import catch_up

    batches, init = _batches(STEPS, TABLES, B), _init(TABLES)
    for l2 in (1e-5, 1e-3, 1e-2):
        for zeta in (1e-5, 1e-2):
            _w, hist = tf_dense_reference(init, batches, TABLES, lr=lr, l2=l2, zeta=zeta, history=True)
            for i, (n, d) in enumerate(TABLES):
                floor = math.sqrt(d) * zeta
                by_end: dict[int, list[tuple[int, int]]] = {}
                last = [0] * n
                for t, (ids, _labels) in enumerate(batches, 1):
                    for k in sorted(set(ids[i].tolist())):
                        if t - 1 - last[k] >= 2:
                            by_end.setdefault(t - 1, []).append((k, last[k]))
                        last[k] = t
                gaps = 0
                for end, rows in by_end.items():
                    ks = torch.tensor([k for k, _ in rows])
                    starts = torch.tensor([s for _, s in rows])
                    w0 = torch.stack([hist[s][0][i][k] for k, s in rows]).float()
                    m0 = torch.stack([hist[s][1][i][k] for k, s in rows]).float()
                    v0 = torch.stack([hist[s][2][i][k] for k, s in rows]).float()
                    w1, _m1, _v1 = catch_up(w0, m0, v0, starts, end, lr=lr, betas=(B1, B2), eps=EPS, eps_mode="torch", l2=l2)
                    want = hist[end][0][i][ks]
                    err = float((w1.double() - want).abs().max()) / lr
                    assert err <= GAP_W_LR, (l2, zeta, i, end, err)
                    got_n, want_n = w1.double().norm(dim=1).clamp(min=floor), want.norm(dim=1).clamp(min=floor)
                    diff = (got_n - want_n).abs()
                    bad = (diff > THR_REL * want_n) & (diff > GAP_THR_LR * lr)
                    assert not bool(bad.any()), (l2, zeta, i, end, (got_n / want_n)[bad], diff[bad] / lr)
                    gaps += len(rows)
                assert gaps > 400, gaps  # the grid has long gaps to test


# ---- under real TorchRec sharding ----------------------------------------------------------

SH_TABLES = {
    "t_tw": (60, 16, "table_wise"),
    "t_rw": (60, 16, "row_wise"),
    "t_twrw": (30, 8, "table_row_wise"),
    "t_cw": (60, 16, "column_wise"),
    "t_dp": (30, 8, "data_parallel"),
}
SH_SPECS = [(n, d) for n, d, _ in SH_TABLES.values()]
SH_CELLS = [(1e-2, 1e-5, 1e-5), (1e-3, 1e-3, 1e-5)]  # lr, l2, zeta
SH_STEPS = 200


def _sh_worker(rank: int, world: int, port: int, out: str) -> None:
    import os
    from pathlib import Path

    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from recsys.optim.cowclip.catchup import catch_up_all_tables
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        names, b = list(SH_TABLES), B // world
        gen = {
            "table_wise": lambda: table_wise(rank=0),
            "row_wise": lambda: row_wise(),
            "table_row_wise": lambda: table_row_wise(host_index=0),
            "column_wise": lambda: column_wise(ranks=list(range(world)) if world > 1 else [0, 0]),
            "data_parallel": lambda: data_parallel(),
        }
        proj = _proj(SH_SPECS)
        results = {}
        for lr, l2, zeta in SH_CELLS:
            ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[n]) for n, (r, d, _) in SH_TABLES.items()
                ],
                device=torch.device("meta"),
            )
            tag_cowclip_adam(
                [ebc.embedding_bags[n].weight for n in names], lr=lr, l2=l2, cowclip_r=1.0, cowclip_zeta=zeta, update_scope="catchup"
            )
            sharder = CowClipEmbeddingBagCollectionSharder()
            plan = construct_module_sharding_plan(
                ebc,
                {n: gen[t]() for n, (_r, _d, t) in SH_TABLES.items()},
                local_size=world,
                world_size=world,
                device_type="cpu",
                sharder=sharder,
            )
            dmp = DistributedModelParallel(
                ebc,
                env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                plan=ShardingPlan({"": plan}),
                sharders=[sharder],
                device=torch.device("cpu"),
            )
            init = _init(SH_SPECS)
            for key, v in dmp.state_dict().items():
                full = init[names.index(key.split(".")[-2])].float()
                for (r0, c0), t in _sh_local(v):
                    t.copy_(full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]])
            for ids, labels in _batches(SH_STEPS, SH_SPECS, B):
                mine = slice(rank * b, (rank + 1) * b)
                kjt = KeyedJaggedTensor(
                    keys=names, values=torch.cat([x[mine] for x in ids]), lengths=torch.ones(len(names) * b, dtype=torch.long)
                )
                kt = dmp(kjt)
                pooled = (kt.wait() if hasattr(kt, "wait") else kt).to_dict()
                z = sum(pooled[n] @ proj[j].float() for j, n in enumerate(names))
                torch.nn.functional.binary_cross_entropy_with_logits(z, labels[mine].float()).backward()
            catch_up_all_tables(dmp)
            results[(lr, l2, zeta)] = {k.split(".")[-2]: [(off, t.clone()) for off, t in _sh_local(v)] for k, v in dmp.state_dict().items()}
        torch.save(results, Path(out) / f"r{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_sharding_type_on_one_and_two_ranks_stays_within_one_lr_of_the_dense_reference(tmp_path):
    """Table-wise, row-wise, table-row-wise, column-wise and data-parallel CowClip tables (each
    rank's loss the mean over its samples: torchrec averages the ranks' gradients), 200 steps, the
    default kernel of this machine: 2 ranks equal 1 rank, and every table is within W_ERR_LR lr of
    the dense reference on the global batches (measured: 0.02-0.21 lr)."""
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    got = {}
    for world in (1, 2):
        (tmp_path / str(world)).mkdir()
        start_workers(_sh_worker, (world, port(), str(tmp_path / str(world))), world)
        full = {}
        for r in range(world):
            for cell, tables in torch.load(tmp_path / str(world) / f"r{r}.pt").items():
                for n, pieces in tables.items():
                    rows, d, _ = SH_TABLES[n]
                    t = full.setdefault((cell, n), torch.full((rows, d), float("nan")))
                    for (r0, c0), piece in pieces:
                        t[r0 : r0 + piece.shape[0], c0 : c0 + piece.shape[1]] = piece
        got[world] = full
    errs = []
    for lr, l2, zeta in SH_CELLS:
        ref, _ = tf_dense_reference(_init(SH_SPECS), _batches(SH_STEPS, SH_SPECS, B), SH_SPECS, lr=lr, l2=l2, zeta=zeta)
        for j, n in enumerate(SH_TABLES):
            one, two = got[1][((lr, l2, zeta), n)], got[2][((lr, l2, zeta), n)]
            assert not torch.isnan(two).any(), n
            torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-3 * lr, msg=f"2 ranks vs 1 rank: {n}")
            errs.append((lr, l2, zeta, n, round(float((two.double() - ref[j]).abs().max()) / lr, 3)))
    assert all(e <= W_ERR_LR for *_k, e in errs), errs
