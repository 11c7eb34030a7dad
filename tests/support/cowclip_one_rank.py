"""Two CowClip-Adam tables of 8 rows x 8 sharded by the CowClip sharder on a gloo world of one
(the ``gloo_world_of_one`` fixture of tests/unit/recsys/conftest.py): the set-up the one-process
tests of the sharder, the embedding kernel and the lookups share. 8 columns, because torchrec
cuts column shards of 4 columns or more; weights from ``initial`` so a test can follow them by hand."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan

from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder, tag_cowclip_adam

NAMES = ("a", "b")
ROWS, DIM = 8, 8
LR, L2, ZETA = 0.1, 0.01, 0.05
Plans = dict[str, Callable[[], ParameterSharding]]


def initial(name: str) -> torch.Tensor:
    """Table ``name``'s starting weights, uniform in [-0.1, 0.1), the same in every test."""
    return torch.rand(ROWS, DIM, generator=torch.Generator().manual_seed(NAMES.index(name) + 1)) * 0.2 - 0.1


def tagged_ebc(tagged: tuple[str, ...] = NAMES, *, weighted: bool = False, update_scope: str = "batch") -> EmbeddingBagCollection:
    """The two tables on the meta device (feature ``f_<name>`` each), ``tagged`` ones CowClip-Adam."""
    tables = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{n}"]) for n in NAMES]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("meta"))
    for n in tagged:
        tag_cowclip_adam([ebc.embedding_bags[n].weight], lr=LR, l2=L2, cowclip_zeta=ZETA, update_scope=update_scope)
    return ebc


def sharded(ebc: EmbeddingBagCollection, plans: Plans) -> DistributedModelParallel:
    """``ebc`` under DMP with the CowClip sharder, table ``n`` placed by ``plans[n]()``."""
    sharder = CowClipEmbeddingBagCollectionSharder()
    per_param = {n: plans[n]() for n in NAMES}
    plan = construct_module_sharding_plan(ebc, per_param, local_size=1, world_size=1, device_type="cpu", sharder=sharder)
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    return DistributedModelParallel(ebc, env=env, plan=ShardingPlan({"": plan}), sharders=[sharder], device=torch.device("cpu"))


def tables(dmp: DistributedModelParallel, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every table assembled from this rank's shards (all of them, in a world of one); with
    ``full``, first writes it into them."""
    out = {}
    for key, v in dmp.state_dict().items():
        n = key.split(".")[-2]
        if not hasattr(v, "local_shards"):  # a data-parallel table: a plain tensor
            if full is not None:
                v.copy_(full[n])
            out[n] = v.clone()
            continue
        table = torch.full((ROWS, DIM), float("nan"))
        for s in v.local_shards():
            r0, c0 = s.metadata.shard_offsets
            piece = (slice(r0, r0 + s.tensor.shape[0]), slice(c0, c0 + s.tensor.shape[1]))
            if full is not None:
                s.tensor.copy_(full[n][piece])
            table[piece] = s.tensor
        out[n] = table
    return out


def initial_dmp(plans: Plans, *, weighted: bool = False, update_scope: str = "batch") -> DistributedModelParallel:
    """Both tables tagged and sharded by ``plans``, their weights set to ``initial``."""
    dmp = sharded(tagged_ebc(weighted=weighted, update_scope=update_scope), plans)
    tables(dmp, {n: initial(n) for n in NAMES})
    return dmp
