"""Constants shared by the planner, the cost model and the plan reports (one place, so the model
the planner optimises and the numbers the reports print cannot drift apart)."""

from __future__ import annotations

# torchrec sharding types whose output dist is an all-to-all (an owner per shard)
A2A_TYPES = ("table_wise", "column_wise", "table_column_wise")
# sharding types placed one shard per rank of a group (torchrec's uniform proposals)
UNIFORM_TYPES = ("row_wise", "data_parallel")
# model-parallel types (the default: a data-parallel table's gradient goes through DDP and the
# dense optimizer, not the table's fused optimizer)
MODEL_PARALLEL_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
UVM_KERNELS = ("fused_uvm", "fused_uvm_caching")
# FBGEMM's SSD kernel (torchrec's key_value): rows on the host's SSD, an HBM cache of hot rows
SSD_KERNELS = ("key_value",)

BYTES_PER_WEIGHT = 4  # fp32 weights
ID_BYTES = 8  # int64 ids in the input dist
LENGTH_BYTES = 4  # int32 lengths, one per bag

# torchrec's cache load factor when a plan leaves it unset
DEFAULT_LOAD_FACTOR = 0.2
# the planner never grows a UVM cache past this share of the table's rows
MAX_CACHE_LOAD_FACTOR = 0.8
# HBM cache of a key_value table when the plan starts (the user's load factor wins): small, so
# that a table too large for HBM and host memory fits; the planner then grows it into free HBM
KEY_VALUE_START_LOAD_FACTOR = 0.01
