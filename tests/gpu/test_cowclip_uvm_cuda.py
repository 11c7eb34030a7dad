"""CowClip tables in host memory on a GPU, the round trip (tests/support/cowclip_uvm_dmp.py): a DMP over
NCCL whose plan puts CowClip tables in ``fused_uvm`` (table-wise, row-wise, column-wise; one
with ``uvm_host_mapped``) next to one in ``fused`` (HBM). Weights, both moments and ``row_step``
of the UVM tables are unified memory (``torch.ops.fbgemm.is_uvm_tensor``), the HBM table's are
not, training matches the per-table formula on CPU, and a DCP checkpoint restored into a fresh
model (whose state is in host memory again) replays the remaining steps to the same weights.
The same run on CPU with gloo is in tests/integration/cowclip/test_cowclip_uvm.py."""

from __future__ import annotations

import pytest
import torch

from gpu_util import spawn_nccl


def _worker(rank: int, world: int, out: str) -> None:
    from tests.support import cowclip_uvm_dmp

    cowclip_uvm_dmp.run(rank, world, out, torch.device("cuda", rank))


@pytest.mark.parametrize("world", [1, 2])
def test_cowclip_uvm_tables_train_checkpoint_and_resume(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    from tests.support import cowclip_uvm_dmp

    spawn_nccl(_worker, world, str(tmp_path))
    # the Triton kernel (FMA, its own summation order) against the torch formula on CPU: Adam
    # divides each coordinate by sqrt(v), so where a coordinate's gradient nearly cancels, the
    # rounding of that sum reaches the weight: bound 1e-4 of the learning rate per step (tests/gpu/
    # test_triton_cuda.py; measured on an H100: 1.15e-6 at most, bound 1e-5). The resumed run must
    # still equal the straight one bit for bit.
    cowclip_uvm_dmp.check(tmp_path, world, uvm=True, atol=1e-4 * cowclip_uvm_dmp.cs.LR * cowclip_uvm_dmp.STEPS)
