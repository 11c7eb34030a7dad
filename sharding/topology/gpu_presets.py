"""GPU capacities by model name, so that importing ``nvidia-smi topo -m`` needs no capacity flags
for a known GPU.

``nvidia-smi topo -m`` prints how devices connect, never which GPU they are. The model comes from
the user (``--gpu``), or from ``nvidia-smi -L`` / ``nvidia-smi --query-gpu=name --format=csv``
lines appended to the same file. Names are matched as ``nvidia-smi`` prints them
(``NVIDIA A100-SXM4-80GB``, ``Tesla V100-SXM2-32GB``, ``NVIDIA GeForce RTX 4090``) or in a short
form (``a100-80gb-sxm``, ``h100-sxm``, ``rtx4090``): case, the vendor words (NVIDIA, Tesla,
GeForce) and punctuation are ignored. A name that fits several presets (``A100``, ``V100``,
``H100``) is an error listing them, never a guess.

Figures are from the vendors' public spec sheets; each entry cites the figure it copies. Memory
is in GB as sold (the topology format reads "80 GB" as 80 GiB), bandwidths in GB/s (10**9 B/s).
``nvlink_link_gb_s`` is one NVLink link, one direction (the spec sheets quote all links, both
directions: 600 GB/s over 12 links = 25 GB/s per link per direction); ``pcie_gen`` the host link.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPreset:
    """One GPU model's capacities. ``nvlink_link_gb_s`` is 0 for GPUs without NVLink."""

    name: str  # canonical, as nvidia-smi prints it without the vendor word
    hbm_gb: float
    hbm_bw_gb_s: float
    pcie_gen: int | None  # None: not on the spec sheet here; the importer's default applies
    nvlink_link_gb_s: float = 0.0
    aliases: tuple[str, ...] = ()


PRESETS: tuple[GpuPreset, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (2021): "GPU Memory: 40GB HBM2 / 80GB HBM2e; GPU Memory
    # Bandwidth: 1,555GB/s (40GB) / 1,935GB/s (80GB PCIe) / 2,039GB/s (80GB SXM)"; "NVLink: 600GB/s"
    # (12 links, both directions -> 25 GB/s per link per direction), "PCIe Gen4: 64GB/s".
    GpuPreset("A100-SXM4-40GB", 40, 1555, 4, 25, ("a100 sxm 40gb", "a100 40gb sxm", "a100 sxm4 40gb")),
    GpuPreset("A100-SXM4-80GB", 80, 2039, 4, 25, ("a100 sxm 80gb", "a100 80gb sxm", "a100 80gb sxm4")),
    GpuPreset("A100-PCIE-40GB", 40, 1555, 4, 25, ("a100 pcie 40gb", "a100 40gb pcie")),
    GpuPreset("A100-PCIE-80GB", 80, 1935, 4, 25, ("a100 80gb pcie", "a100 pcie 80gb")),
    # NVIDIA H100 Tensor Core GPU datasheet: "GPU memory 80GB; GPU memory bandwidth 3.35TB/s (SXM) /
    # 2TB/s (PCIe)"; "Interconnect: NVLink 900GB/s (SXM: 18 links -> 25 GB/s per link per direction),
    # PCIe Gen5 128GB/s"; PCIe card: "NVLink 600GB/s" bridge.
    GpuPreset("H100-SXM5-80GB", 80, 3350, 5, 25, ("h100 80gb hbm3", "h100 sxm", "h100 sxm5", "h100 sxm 80gb")),
    GpuPreset("H100-PCIE-80GB", 80, 2000, 5, 25, ("h100 pcie", "h100 80gb pcie", "h100 pcie 80gb")),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): "GPU Memory 141GB; GPU Memory Bandwidth
    # 4.8TB/s; NVLink 900GB/s; PCIe Gen5 128GB/s".
    GpuPreset("H200", 141, 4800, 5, 25, ("h200 sxm", "h200 141gb hbm3e", "h200 sxm 141gb")),
    # NVIDIA GB200 NVL72 spec sheet: "GPU Memory | Bandwidth: up to 13.4TB HBM3e | 576TB/s" for 72
    # Blackwell GPUs -> 186 GB and 8 TB/s per GPU; "NVLink: 130TB/s" -> 1.8 TB/s per GPU (18 NVLink 5
    # links, both directions -> 50 GB/s per link per direction). The GPU reaches Grace over
    # NVLink-C2C, not PCIe: no PCIe generation here.
    GpuPreset("GB200", 186, 8000, None, 50, ("gb200 nvl72",)),
    # NVIDIA L40S datasheet: "GPU Memory 48GB GDDR6 with ECC; Memory Bandwidth 864GB/s; Interconnect
    # Interface PCIe Gen4 x16: 64GB/s bidirectional"; "NVLink Support: No".
    GpuPreset("L40S", 48, 864, 4, 0, ("l40s 48gb",)),
    # NVIDIA RTX A6000 datasheet: "GPU Memory 48 GB GDDR6 with ECC; Memory Bandwidth 768 GB/s;
    # NVLink: low profile bridges connect two RTX A6000 GPUs, 112.5 GB/s (bidirectional)"
    # (4 links -> 14.0625 GB/s per link per direction); "PCI Express 4.0 x16".
    GpuPreset("RTX A6000", 48, 768, 4, 14.0625, ("a6000", "rtx a6000 48gb")),
    # GeForce RTX 3090 specifications (nvidia.com): "24 GB GDDR6X, 384-bit, 19.5 Gbps" -> 936 GB/s;
    # "NVLink (SLI-Ready): Yes" (bridge 112.5 GB/s, as the A6000); PCIe 4.0.
    GpuPreset("RTX 3090", 24, 936, 4, 14.0625, ("rtx3090", "3090")),
    # GeForce RTX 4090 specifications: "24 GB GDDR6X"; 384-bit at 21 Gbps -> 1,008 GB/s; PCIe 4.0;
    # no NVLink.
    GpuPreset("RTX 4090", 24, 1008, 4, 0, ("rtx4090", "4090")),
    # GeForce RTX 5090 specifications: "32 GB GDDR7, 512-bit", 28 Gbps -> 1,792 GB/s; PCIe 5.0;
    # no NVLink.
    GpuPreset("RTX 5090", 32, 1792, 5, 0, ("rtx5090", "5090")),
    # NVIDIA Tesla V100 datasheet: "GPU Memory 32GB / 16GB HBM2; Memory Bandwidth 900GB/s (SXM2 and
    # PCIe)"; "Interconnect Bandwidth: NVLink 300GB/s (SXM2: 6 links -> 25 GB/s per link per
    # direction), PCIe 32GB/s" (Gen3).
    GpuPreset("V100-SXM2-16GB", 16, 900, 3, 25, ("v100 sxm2 16gb", "v100 16gb sxm2")),
    GpuPreset("V100-SXM2-32GB", 32, 900, 3, 25, ("v100 sxm2 32gb", "v100 32gb sxm2")),
    GpuPreset("V100-PCIE-16GB", 16, 900, 3, 0, ("v100 pcie 16gb", "v100 16gb pcie")),
    GpuPreset("V100-PCIE-32GB", 32, 900, 3, 0, ("v100 pcie 32gb", "v100 32gb pcie")),
    # NVIDIA Tesla P100 datasheet: SXM2 "16GB CoWoS HBM2 at 732 GB/s", "NVLink 160 GB/s" (4 links,
    # both directions -> 20 GB/s per link per direction); PCIe "16GB at 732 GB/s or 12GB at
    # 549 GB/s", "PCIe Gen3 32 GB/s".
    GpuPreset("P100-SXM2-16GB", 16, 732, 3, 20, ("p100 sxm2", "p100 sxm2 16gb")),
    GpuPreset("P100-PCIE-16GB", 16, 732, 3, 0, ("p100 pcie 16gb", "p100 16gb pcie")),
    GpuPreset("P100-PCIE-12GB", 12, 549, 3, 0, ("p100 pcie 12gb", "p100 12gb pcie")),
    # NVIDIA T4 datasheet: "GPU Memory 16 GB GDDR6; Memory Bandwidth 320+ GB/s; System Interface
    # x16 PCIe Gen3"; no NVLink.
    GpuPreset("T4", 16, 320, 3, 0, ("t4 16gb",)),
)

_VENDOR = re.compile(r"\b(nvidia|tesla|geforce|quadro)\b")


def normalize(name: str) -> str:
    """The matching key of a model name: lower case, vendor words and punctuation dropped."""
    return re.sub(r"[^a-z0-9]+", "", _VENDOR.sub(" ", name.lower()))


_BY_KEY: dict[str, GpuPreset] = {}
for _p in PRESETS:
    for _alias in (_p.name, *_p.aliases):
        _BY_KEY.setdefault(normalize(_alias), _p)


class UnknownGpuError(KeyError):
    """No preset, or several, for a model name; ``str()`` is a one-line message."""

    def __str__(self) -> str:
        return str(self.args[0])


def find_preset(name: str) -> GpuPreset | None:
    """The preset named ``name`` (exactly, after :func:`normalize`); None for an unknown name;
    UnknownGpuError when the name begins the names of several presets (``A100``: which memory,
    which form factor). A name that begins only one preset's name is unknown, not that preset:
    ``L4`` is not an ``L40S``."""
    key = normalize(name)
    if not key:
        return None
    if key in _BY_KEY:
        return _BY_KEY[key]
    candidates = sorted({p.name for k, p in _BY_KEY.items() if k.startswith(key)}, key=preset_names().index)
    if len(candidates) > 1:
        raise UnknownGpuError(f"GPU model '{name}' fits several presets: {', '.join(candidates)}; name one")
    return None


def preset_names() -> list[str]:
    return [p.name for p in PRESETS]
