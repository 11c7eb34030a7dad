"""Reading the text of ``nvidia-smi topo -m`` (sharding/topology/topo_matrix.py): header, cells,
affinity columns, legends and appended GPU model lines, and the one-line error, with the line and
the column, for broken input (fast: no torch)."""

from __future__ import annotations

import pytest

from sharding.topology.cluster import TopologyError
from sharding.topology.topo_matrix import parse_topo_matrix

SMALL = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-7\t0\nGPU1\tNV4\t X \t0-7\t0\n"

# two GPUs and two NICs as older drivers print them (SOC, no NUMA column), with the legends
WITH_NICS = """\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity
GPU0\t X \tSOC\tPIX\tSOC\t0-15
GPU1\tSOC\t X \tSOC\tPHB\t16-31
NIC0\tPIX\tSOC\t X \tSOC
NIC1\tSOC\tPHB\tSOC\t X

Legend:

  X    = Self
  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""


def test_cells_affinities_and_legend():
    mx = parse_topo_matrix(WITH_NICS, "old.txt")
    assert mx.devices == ("GPU0", "GPU1", "NIC0", "NIC1")
    assert (mx.gpus, mx.nics) == (("GPU0", "GPU1"), ("NIC0", "NIC1"))
    assert mx.cells[("GPU0", "GPU1")] == "SYS" and mx.cells[("GPU1", "GPU0")] == "SYS"  # SOC is SYS
    assert mx.cells[("GPU0", "NIC0")] == "PIX" and mx.cells[("NIC1", "GPU1")] == "PHB" and mx.cells[("NIC0", "NIC0")] == "X"
    assert len(mx.cells) == 16
    assert mx.cpu_affinity == {"GPU0": "0-15", "GPU1": "16-31"} and mx.numa_affinity == {}
    assert mx.nic_legend == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert mx.gpu_models == {}


def test_spaces_and_crlf_read_as_tabs():
    spaced = SMALL.replace("\t", "    ").replace("\n", "\r\n")
    a, b = parse_topo_matrix(SMALL), parse_topo_matrix(spaced)
    assert a == b
    assert a.cells == {("GPU0", "GPU0"): "X", ("GPU0", "GPU1"): "NV4", ("GPU1", "GPU0"): "NV4", ("GPU1", "GPU1"): "X"}
    assert a.cpu_affinity == {"GPU0": "0-7", "GPU1": "0-7"} and a.numa_affinity == {"GPU0": "0", "GPU1": "0"}


def test_gpu_models_from_nvidia_smi_L_or_name_lines():
    listed = parse_topo_matrix(SMALL + "\nGPU 0: NVIDIA L40S (UUID: GPU-a)\nGPU 1: NVIDIA H100 PCIe (UUID: GPU-b)\n")
    assert listed.gpu_models == {0: ("NVIDIA L40S", 5), 1: ("NVIDIA H100 PCIe", 6)}
    one_name = parse_topo_matrix(SMALL + "\nname\nNVIDIA L40S\n")  # one line for all GPUs
    assert one_name.gpu_models == {0: ("NVIDIA L40S", 6), 1: ("NVIDIA L40S", 6)}
    per_gpu = parse_topo_matrix(SMALL + "NVIDIA L40S\nTesla T4\n")
    assert per_gpu.gpu_models == {0: ("NVIDIA L40S", 4), 1: ("Tesla T4", 5)}
    before = parse_topo_matrix("GPU 1: Tesla T4 (UUID: b)\nGPU 0: Tesla T4 (UUID: a)\n" + SMALL)  # lines above the matrix too
    assert before.gpu_models == {1: ("Tesla T4", 1), 0: ("Tesla T4", 2)}
    # a line that fits several presets names no model
    assert parse_topo_matrix(SMALL + "\nA100\n").gpu_models == {}


@pytest.mark.parametrize(
    "text, needle",
    [
        (SMALL.replace("NV4\t0-7", "NVX\t0-7", 1), "topo.txt: line 2, column 10: unknown token 'NVX' (GPU0 to GPU1)"),
        (
            SMALL.replace("\t", "    ").replace("NV4    0-7", "NVX    0-7", 1),
            "topo.txt: line 2, column 16: unknown token 'NVX' (GPU0 to GPU1)",
        ),
        (
            SMALL.replace("GPU1\tNV4\t X \t0-7\t0", "GPU1\tNV4\t0-7\t0"),
            "topo.txt: line 3: 1 matrix cells after 'GPU1', expected 2 (one per device in the header)",
        ),
        (SMALL.replace("GPU1\tNV4\t X ", "GPU1\tNV4\t X \tSYS"), "topo.txt: line 3: 3 matrix cells after 'GPU1', expected 2"),
        (SMALL.replace("GPU1\tNV4", "GPU1\tPIX"), "topo.txt: line 3, column 6: GPU1 to GPU0 is 'PIX' but GPU0 to GPU1 (line 2) is 'NV4'"),
        (
            SMALL.replace("GPU1\tNV4\t X ", "GPU1\tX\t X "),
            "topo.txt: line 3, column 6: got 'X' for GPU1 to GPU0, expected 'X' only on the diagonal",
        ),
        (SMALL.replace("GPU1\tNV4\t X ", "GPU9\tNV4\t X "), "topo.txt: line 3, column 1: unknown row 'GPU9' (header names GPU0, GPU1)"),
        (
            SMALL.replace("\t0-7\t0\nGPU1", "\t0-7\t0\t1\t5\nGPU1"),
            "topo.txt: line 2: 4 values after the matrix of 'GPU0', expected at most 2 (CPU Affinity, NUMA Affinity)",
        ),
        (SMALL.replace("\tGPU1\t", "\tGPU0\t", 1), "topo.txt: line 1: device 'GPU0' is named twice in the header"),
        ("hello\n", "topo.txt: no header row naming GPU0 (is this `nvidia-smi topo -m` output?)"),
        (SMALL.split("GPU1\tNV4")[0], "topo.txt: no row for GPU1 (the header names 2 devices)"),
        (SMALL + SMALL.splitlines()[2] + "\n", "topo.txt: line 4: row 'GPU1' appears twice"),
        (
            SMALL + "\nGPU 0: NVIDIA L40S (UUID: a)\nGPU 5: NVIDIA L40S (UUID: b)\n",
            "topo.txt: line 6: names GPU 5 but the matrix has 2 GPUs",
        ),
        (
            SMALL + "\nGPU 0: NVIDIA L40S (UUID: a)\n",
            "topo.txt: the `nvidia-smi -L` lines name 1 GPUs, the matrix has 2 (no line for GPU 1)",
        ),
        (SMALL + "\nNVIDIA L40S\nNVIDIA L40S\nNVIDIA T4\n", "topo.txt: line 5: 3 GPU model lines for 2 GPUs"),
    ],
)
def test_bad_topo_text(text, needle):
    with pytest.raises(TopologyError) as e:
        parse_topo_matrix(text, "topo.txt")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(needle), msg


def test_value_under_no_clear_column():
    head = "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
    # two values both under 'CPU Affinity', the third cell empty: which is which cannot be told
    text = head + "GPU0     X      NV4     0-7 1\nGPU1    NV4      X      0-7     0\n"
    with pytest.raises(TopologyError) as e:
        parse_topo_matrix(text, "topo.txt")
    assert str(e.value) == (
        "topo.txt: line 2, column 29: cannot tell which column '1' is under (CPU Affinity, NUMA Affinity, GPU NUMA ID); "
        "align it under its header"
    )


def test_values_are_placed_by_the_column_they_start_under():
    """An empty CPU Affinity cell between spaces leaves no trace: the NUMA value is known by where
    it starts (under its header), not by its order."""
    head = "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
    gpu0 = "GPU0     X      NV4".ljust(40) + "1".ljust(16) + "N/A"  # under NUMA Affinity and GPU NUMA ID
    gpu1 = "GPU1    NV4      X      0-7".ljust(40) + "0"  # under CPU and NUMA Affinity
    text = head + gpu0 + "\n" + gpu1 + "\n"
    mx = parse_topo_matrix(text, "vm.txt")
    assert mx.cpu_affinity == {"GPU1": "0-7"} and mx.numa_affinity == {"GPU0": "1", "GPU1": "0"}
