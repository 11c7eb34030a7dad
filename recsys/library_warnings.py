"""The library warnings that the trainer and ``recsys-plan`` do not print, each named by its message.

torchrec and torch.distributed raise these about their own internals on every run (and on every
rank): a user can do nothing about them. Everything else, including a warning that a new release
adds, is shown.
"""

from __future__ import annotations

import warnings

KNOWN_LIBRARY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        r"HeuristicalStorageReservation is known to cause issues",
        "torchrec's planner about its own default reservation, which the planner's fit checks assume",
    ),
    (FutureWarning, r"`broadcast_buffers` is deprecated", "torch's DDP, about the argument torchrec's DMP passes it"),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "torchrec's sharded tables are ShardedTensors: DCP says so at every save and load",
    ),
)


def quiet_known_library_warnings() -> None:
    for category, message, _why in KNOWN_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
