"""torchrec's examples/golden_training/train_dlrm.py, on CPU/gloo, with the lines of docs/dropin.md.

Run by tests/integration/training/test_dropin_pipeline.py under torchrun; every line of the doc's code block marked
``dropin:lines`` must appear here verbatim (test_doc_lines_are_the_tested_lines). What is not in
the doc is the test's own checking: the plan DMP built, the tables that moved, the merge against
an independent mean. Results go to ``<out>/rank<R>.json``.

    torchrun --nproc_per_node 2 tests/support/dropin_worker.py single OUT
    torchrun --nnodes 2 --nproc_per_node 1|2 ... tests/support/dropin_worker.py merge OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys import CowClipEmbeddingBagCollectionSharder, KStepMergeHook, tag_cowclip_adam
from sharding import TopologyAwarePlanner, save_plan

CAT = [f"cat_{i}" for i in range(4)]
NUM_DENSE = 4
NUM_EMBEDDINGS = 200
EMBEDDING_DIM = 8


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's copy of every floating tensor of the model's state (local shards of tables)."""
    out = {}
    for name, value in model.state_dict().items():
        ts = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        for i, t in enumerate(ts):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                out[f"{name}#{i}"] = t.detach().clone()
    return out


def placements(model: torch.nn.Module) -> dict[str, list]:
    """Table -> (offsets, sizes, rank) of every shard, as DMP built them (ShardedTensor metadata)."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "metadata") and "embedding_bags" in name:
            table = name.split(".")[-2]
            out[table] = sorted((list(m.shard_offsets), list(m.shard_sizes), m.placement.rank())
                                for m in value.metadata().shards_metadata)
    return out


def planned(plan) -> dict[str, list]:
    out = {}
    for mplan in plan.plan.values():
        for table, ps in mplan.items():
            out[table] = sorted((list(s.shard_offsets), list(s.shard_sizes), s.placement.rank())
                                for s in ps.sharding_spec.shards)
    return out


def main(mode: str, out: Path, iterations: int = 3, batch: int = 16, learning_rate: float = 0.05) -> None:
    """train_dlrm.py's ``train()`` on CPU/gloo with small sizes: the same names (``device``,
    ``learning_rate``, ``eb_configs``, ``train_model``, ``model``, ``non_fused_optimizer``,
    ``train_pipeline``, ``train_iterator``), the doc's block where the script builds its tag,
    sharder and DMP, and the doc's loop lines in its loop."""
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(1 + (rank if mode == "merge" else 0))  # merge: each host starts differently
    out = out.resolve()
    os.chdir(out)  # the doc's save_plan writes plan.json into the working directory

    eb_configs = [
        EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=EMBEDDING_DIM, num_embeddings=NUM_EMBEDDINGS,
                           feature_names=[feature_name])
        for feature_name in CAT
    ]
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[16, EMBEDDING_DIM],
        over_arch_layer_sizes=[16, 1],
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm_model)

    # ---- the doc's block (docs/dropin.md), line for line; the test's own lines are marked
    batch_size, num_iterations = 32, int(1e4)  # train_dlrm.py's dataset batch and loop length
    batch_size, num_iterations = batch, iterations  # test: a small run
    constraints = None  # or torchrec ParameterConstraints per table, below
    # test: one table of each kind row-wise, table-wise and column-wise (the doc's second block)
    constraints = {t.name: ParameterConstraints(sharding_types=[("row_wise", "table_wise", "column_wise")[i % 3]])
                   for i, t in enumerate(eb_configs)}
    merger = KStepMergeHook(every_k=2, total_steps=num_iterations)
    tag_cowclip_adam(train_model.model.sparse_arch.parameters(), lr=learning_rate)
    sharders = [CowClipEmbeddingBagCollectionSharder()]
    planner = TopologyAwarePlanner("cpu-gloo", batch_size=batch_size, constraints=constraints, hosts=merger.hosts)
    plan = planner.collective_plan(train_model, sharders)
    if rank == 0:  # test: the same file written before DMP, to compare with the doc's (after it)
        save_plan(plan, out / "plan_before_dmp.json", model=train_model, planner=planner)
    model = DistributedModelParallel(module=train_model, device=device, sharders=sharders, plan=plan, env=merger.env)
    if dist.get_rank() == 0:
        save_plan(plan, "plan.json", model=train_model, planner=planner)
    # ---- end of the doc's block (its loop lines are in the loop below)

    non_fused_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    train_pipeline = TrainPipelineSparseDist(model, non_fused_optimizer, device)
    dataset = RandomRecDataset(keys=CAT, batch_size=batch_size, hash_size=NUM_EMBEDDINGS, ids_per_feature=2,
                               num_dense=NUM_DENSE, manual_seed=100 + rank)
    train_iterator = iter(dataset)

    result: dict = {"rank": rank, "hosts": merger.hosts, "host_world": dist.get_world_size(merger.pg),
                    "plan": planned(plan), "built": placements(model),
                    "types": {t: ps.sharding_type for m in plan.plan.values() for t, ps in m.items()}}
    start = local_tensors(model)
    checks = []
    for _ in range(num_iterations):
        train_pipeline.progress(train_iterator)
        before, merges = local_tensors(model), merger.merges
        merger.step(model, non_fused_optimizer)
        if merger.merges > merges:  # independent check: every tensor == the mean of the hosts' pre-merge copies
            after = local_tensors(model)
            worst_mean, worst_spread = 0.0, 0.0
            replicas = merger.groups.replica_pg  # the ranks holding the same shard on every host
            n = dist.get_world_size(replicas)
            for key, t in before.items():
                copies = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(copies, t, group=replicas)
                mean = torch.stack([c.double() for c in copies]).mean(0)
                worst_mean = max(worst_mean, float((after[key].double() - mean).abs().max()))
                spread = [torch.empty_like(after[key]) for _ in range(n)]
                dist.all_gather(spread, after[key], group=replicas)
                worst_spread = max(worst_spread, max(float((s - after[key]).abs().max()) for s in spread))
            pre_spread = max(float((before[k] - after[k]).abs().max()) for k in before)
            checks.append({"step": merger.steps, "max_err_vs_mean": worst_mean, "max_spread_after": worst_spread,
                           "max_move_by_merge": pre_spread, "tensors": len(before)})
    end = local_tensors(model)
    result["checks"] = checks
    result["merges"] = merger.merges
    result["table_delta"] = {}
    for key, t in start.items():
        if "embedding_bags" in key:
            table = key.split(".")[-2]
            result["table_delta"][table] = max(result["table_delta"].get(table, 0.0), float((end[key] - t).abs().max()))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
