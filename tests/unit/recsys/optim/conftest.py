"""The one process group the optimizer unit tests may use: gloo, world size 1, in this process.

The cross-rank CowClip steps take a process group; over a world of one they run the real
torch.distributed calls without a second rank. The group is destroyed after each test (unless the
test shut it down itself), so no test sees another's.
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
