"""The NVLink domain of a GB200 NVL72 in the planner and its cost model: table-row-wise groups
follow the domain, and the all-to-all is charged only off the group."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from sharding.topology.topology_dump import dump_topology
from sharding.topology.topology_file import load_topology

GBs = 1e9


def load_topology_text(text: str, name: str):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"{name}.yaml"
        p.write_text(text)
        return load_topology(p)


@pytest.mark.parametrize("domain_hosts", [18, 9])
def test_table_row_wise_groups_follow_the_nvlink_domain(domain_hosts):
    """On an NVL72 (one domain of 18 trays, or two of 9) a table-row-wise table is cut over one
    domain's ranks (72 or 36 shards, as torchrec's pod_size makes it) and placed on them; its
    cross-group all-to-all is charged only between domains."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import ParameterConstraints

    from sharding.planner.topology_planner import TopologyAwarePlanner

    text = dump_topology(load_topology("gb200-nvl72")).replace("nvlink_domain_hosts: 18", f"nvlink_domain_hosts: {domain_hosts}")
    t = load_topology_text(text, "nvl")
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=2_000_000, feature_names=[f"f{i}"]) for i in range(3)],
        device=torch.device("meta"),
    )
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_row_wise"]) for i in range(3)}
    planner = TopologyAwarePlanner(t, batch_size=512, constraints=cons)
    plan = planner.plan(ebc, [planner_sharder()])
    group = 4 * domain_hosts
    for name, ps in plan.plan[""].items():
        ranks = sorted(int(p.placement.rank()) for p in ps.sharding_spec.shards)
        assert ps.sharding_type == "table_row_wise" and len(ranks) == group, (name, len(ranks))
        assert ranks == list(range(ranks[0], ranks[0] + group)) and ranks[0] % group == 0
    off = planner.cost_model.links.out_off_inv  # peers "off" a rank's group: other domains' only
    assert (float(off.sum()) == 0.0) == (domain_hosts == 18)
    assert planner.cost_model.twrw_groups[0] == tuple(range(group))


def planner_sharder():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()


def test_a_host_group_inside_a_larger_domain_still_pays_its_all_to_all():
    """A table-row-wise group smaller than the NVLink domain (one tray, as a plan made without
    pod_size has it) sends its slices to the other 68 GPUs: charged on their NVLink ports; the
    whole-domain group has no peer outside and pays no all-to-all."""
    from sharding.planner.cost.model import TopologyCostModel

    m = TopologyCostModel(load_topology("gb200-nvl72"), 512)
    out, inn = m.off_group_inv((0, 1, 2, 3), 0)
    port = m.links.names.index("gb200-tray-0#0/gpu0.nvlink>out")
    assert out[port] == pytest.approx(68 / (900 * GBs)) and inn.sum() > 0
    whole, _ = m.off_group_inv(tuple(range(72)), 0)
    assert float(whole.sum()) == 0.0
