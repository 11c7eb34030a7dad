"""recsys/library_warnings.py: the trainer and recsys-plan hide exactly the library warnings they
name, each still raised by the installed torch/torchrec, and show every other warning."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torchrec

from recsys.library_warnings import KNOWN_LIBRARY_WARNINGS, quiet_known_library_warnings

# A sentence from each warning as the libraries print it (torch 2.13 / torchrec 1.8).
PRINTED = [
    "HeuristicalStorageReservation is known to cause issues, particularly during dry run where it over-estimates dense tensor size.",
    "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.",
    "Please use DTensor instead and we are deprecating ShardedTensor.",
]


def _shown(message: str, category: type[Warning]) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_library_warnings()
        warnings.warn(message, category, stacklevel=1)
    return bool(caught)


@pytest.mark.parametrize("message", PRINTED)
def test_each_named_warning_is_hidden(message):
    assert not _shown(message, FutureWarning)


@pytest.mark.parametrize(
    "message, category",
    [
        ("some new deprecation after an upgrade", FutureWarning),
        (PRINTED[0], UserWarning),  # the same words in another category are not the known warning
        ("TensorBoard could not write its events", UserWarning),
    ],
)
def test_every_other_warning_is_shown(message, category):
    assert _shown(message, category)


def test_each_named_warning_is_still_in_the_installed_libraries():
    """A filter for a warning no library raises any more would hide nothing but stay forever."""
    torch_dir = Path(torch.__file__).parent
    sources = [Path(torchrec.__file__).parent, torch_dir / "distributed", torch_dir / "nn" / "parallel"]
    text = "\n".join(p.read_text(errors="replace") for root in sources for p in root.rglob("*.py"))
    for _category, message, why in KNOWN_LIBRARY_WARNINGS:
        assert why
        assert re.search(message, text), f"no installed torch/torchrec source raises {message!r} any more: drop it"
