"""GPU capacities by model name (sharding/topology/gpu_presets.py): names as nvidia-smi prints them
or short, and a name that fits several presets refused, never guessed."""

from __future__ import annotations

import pytest

from sharding.topology.gpu_presets import PRESETS, UnknownGpuError, find_preset, normalize, preset_names


def test_presets_are_distinct_and_named_as_nvidia_smi_prints():
    keys = {}
    for p in PRESETS:
        for alias in (p.name, *p.aliases):
            assert keys.setdefault(normalize(alias), p.name) == p.name, alias
    printed = {  # nvidia-smi --query-gpu=name as printed on these GPUs -> (GB, GB/s), spec sheets
        "NVIDIA A100-SXM4-40GB": (40, 1555),
        "NVIDIA A100-SXM4-80GB": (80, 2039),
        "NVIDIA A100-PCIE-40GB": (40, 1555),
        "NVIDIA A100 80GB PCIe": (80, 1935),
        "NVIDIA H100 80GB HBM3": (80, 3350),
        "NVIDIA H100 PCIe": (80, 2000),
        "NVIDIA H200": (141, 4800),
        "NVIDIA GB200": (186, 8000),
        "NVIDIA L40S": (48, 864),
        "NVIDIA RTX A6000": (48, 768),
        "NVIDIA GeForce RTX 3090": (24, 936),
        "NVIDIA GeForce RTX 4090": (24, 1008),
        "NVIDIA GeForce RTX 5090": (32, 1792),
        "Tesla V100-SXM2-16GB": (16, 900),
        "Tesla V100-SXM2-32GB": (32, 900),
        "Tesla V100-PCIE-32GB": (32, 900),
        "Tesla P100-SXM2-16GB": (16, 732),
        "Tesla P100-PCIE-12GB": (12, 549),
        "Tesla T4": (16, 320),
    }
    for name, (gb, bw) in printed.items():
        p = find_preset(name)
        assert p is not None and (p.hbm_gb, p.hbm_bw_gb_s) == (gb, bw), name


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA A100-SXM4-80GB", "a100sxm480gb"),
        ("Tesla V100-SXM2-32GB", "v100sxm232gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Quadro RTX 8000", "rtx8000"),
        ("  a100_80gb (sxm) ", "a10080gbsxm"),
        ("NVIDIA", ""),
    ],
)
def test_normalize_drops_case_vendor_words_and_punctuation(name, key):
    assert normalize(name) == key


@pytest.mark.parametrize(
    "name, preset",
    [
        ("a100-80gb-sxm", "A100-SXM4-80GB"),
        ("h100-sxm", "H100-SXM5-80GB"),
        ("rtx4090", "RTX 4090"),
        ("GEFORCE RTX 3090", "RTX 3090"),
        ("a6000", "RTX A6000"),
        ("t4", "T4"),
        ("gb200 nvl72", "GB200"),
    ],
)
def test_short_names_and_aliases(name, preset):
    assert find_preset(name).name == preset


@pytest.mark.parametrize("name", ["L4", "MI300X", "", "NVIDIA", "B200"])
def test_unknown_names_are_none(name):
    """``L4`` begins only ``L40S``: unknown, not that preset."""
    assert find_preset(name) is None


@pytest.mark.parametrize(
    "name, candidates",
    [
        ("A100", "A100-SXM4-40GB, A100-SXM4-80GB, A100-PCIE-40GB, A100-PCIE-80GB"),
        ("Tesla V100", "V100-SXM2-16GB, V100-SXM2-32GB, V100-PCIE-16GB, V100-PCIE-32GB"),
        ("p100 pcie", "P100-PCIE-16GB, P100-PCIE-12GB"),
    ],
)
def test_a_name_fitting_several_presets_is_refused_in_preset_order(name, candidates):
    with pytest.raises(UnknownGpuError) as e:
        find_preset(name)
    assert str(e.value) == f"GPU model '{name}' fits several presets: {candidates}; name one"  # one line, no KeyError quotes


def test_preset_names_follow_the_table():
    names = preset_names()
    assert names == [p.name for p in PRESETS] and len(set(names)) == len(names)
    assert names[:2] == ["A100-SXM4-40GB", "A100-SXM4-80GB"] and names[-1] == "T4"
    no_nvlink = {p.name for p in PRESETS if p.nvlink_link_gb_s == 0}
    assert {"L40S", "RTX 4090", "T4"} <= no_nvlink and "RTX 3090" not in no_nvlink
