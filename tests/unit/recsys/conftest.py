"""The one process group the unit tests of recsys may use (training, checkpoints, k-step merges,
the CowClip sharder and exchange): gloo, world size 1, in this process.

Collectives over a world of one run the real torch.distributed code paths (DCP's save and load,
all-reduce, all-gather of objects, subgroups, DMP's sharding) without a second rank; the group is destroyed after
each test (unless the test shut it down itself), so no test sees another's.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
