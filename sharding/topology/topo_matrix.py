"""Read the text of ``nvidia-smi topo -m`` into a :class:`TopoMatrix` (no interpretation).

What the command prints, and what real pastes of it look like:

- a header row: ``GPU0..N``, NICs (``NIC0..``, or ``mlx5_0..`` from older drivers), then any of
  ``CPU Affinity``, ``NUMA Affinity``, ``GPU NUMA ID``;
- one row per device: its matrix cells (``X`` on the diagonal, ``NV#``, ``PIX``, ``PXB``,
  ``PHB``, ``NODE``, ``SYS``; ``SOC`` from old drivers is ``SYS``), then its affinity values. NIC
  rows usually stop after the matrix. nvidia-smi separates cells with tabs; pasted copies have
  them turned into spaces (column-aligned), sometimes trailing spaces, CRLF line ends;
- an affinity cell can be empty (VMs and containers print no CPU affinity): with spaces, an empty
  cell is invisible, so which column a value belongs to is read from its position under the
  header (tabs expanded to 8-column stops, as a terminal shows them); values are read in order
  when every column has one;
- ``Legend:`` and ``NIC Legend:`` blocks (``NIC0: mlx5_0``), often cut short or missing.

A GPU model is not part of the output. Lines of ``nvidia-smi -L`` (``GPU 0: NVIDIA A100-SXM4-80GB
(UUID: ...)``) or of ``nvidia-smi --query-gpu=name --format=csv,noheader`` appended to the same
file are kept in :attr:`TopoMatrix.gpu_models` for the importer to look up.

Every problem is a one-line :class:`TopologyError` naming the source and the line (and the 1-based
character column of the cell, counted in the line as written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sharding.topology.gpu_presets import UnknownGpuError, find_preset
from sharding.topology.cluster import TopologyError

PCIE_TOKENS = ("PIX", "PXB", "PHB", "NODE", "SYS")
AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
NV = re.compile(r"NV(\d+)$")
GPU = re.compile(r"GPU(\d+)$")
_HEADER_TOKEN = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID|\S+")
_EXTRA_TOKEN = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID|\S+(?: \S+)*")
_VALUE = re.compile(r"[\d,\-]+|N/A")  # what an affinity cell holds, never a matrix cell
_LIST_L = re.compile(r"\s*GPU\s+(\d+):\s+(.+?)\s+\(UUID:")
_TOLERANCE = 2  # a value may start this many characters left of its header (" X " cells do)


@dataclass(frozen=True)
class TopoMatrix:
    """The parsed matrix: device names (as in the header), cells, affinity columns, GPU models."""

    devices: tuple[str, ...]  # header names, e.g. GPU0.., NIC0.. / mlx5_0..
    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    cells: dict[tuple[str, str], str]  # (row, col) -> X / NV# / PIX / ... (SOC read as SYS)
    cpu_affinity: dict[str, str]
    numa_affinity: dict[str, str]
    nic_legend: dict[str, str]  # NIC0 -> mlx5_0
    # GPU index -> (model name, line): from `nvidia-smi -L` lines, or name lines in GPU order
    gpu_models: dict[int, tuple[str, int]] = field(default_factory=dict)


def _tokens(line: str) -> list[tuple[int, str]]:
    return [(m.start(), m.group()) for m in re.finditer(r"\S+", line)]


def _clean(line: str) -> str:
    return line.replace("\xa0", " ").rstrip("\r")


def _header(line: str, source: str, ln_no: int) -> tuple[list[str], list[str], list[int]]:
    """Device names, extra column names and the extra columns' start positions (tabs expanded)."""
    wide = line.expandtabs(8)
    devices: list[str] = []
    extra: list[str] = []
    starts: list[int] = []
    pos = 0
    while True:
        m = (_EXTRA_TOKEN if extra else _HEADER_TOKEN).search(wide, pos)
        if m is None:
            break
        name = re.sub(r"\s+", " ", m.group())
        if extra or name in AFFINITY_COLUMNS:
            extra.append(name)
            starts.append(m.start())
        else:
            devices.append(name)
        pos = m.end()
    if len(set(devices)) != len(devices):
        twice = next(d for d in devices if devices.count(d) > 1)
        raise TopologyError(f"{source}: line {ln_no}: device '{twice}' is named twice in the header")
    return devices, extra, starts


def _matrix_token(tok: str) -> str | None:
    t = "SYS" if tok == "SOC" else tok
    if t in PCIE_TOKENS or t == "X":
        return t
    m = NV.match(t)
    return t if m and int(m.group(1)) > 0 else None


def parse_topo_matrix(text: str, source: str = "topo.txt") -> TopoMatrix:
    """Parses the output; ``source`` (a file name) starts every error message."""
    lines = [_clean(ln) for ln in text.splitlines()]
    header_at = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["GPU0"]), None)
    if header_at is None:
        raise TopologyError(f"{source}: no header row naming GPU0 (is this `nvidia-smi topo -m` output?)")
    devices, extra, starts = _header(lines[header_at], source, header_at + 1)
    gpus = tuple(d for d in devices if GPU.match(d))
    nics = tuple(d for d in devices if not GPU.match(d))
    n_dev = len(devices)

    cells: dict[tuple[str, str], str] = {}
    where: dict[tuple[str, str], int] = {}
    values: dict[str, dict[str, str]] = {c: {} for c in extra}
    legend: dict[str, str] = {}
    listed: dict[int, tuple[str, int]] = {}
    named: list[tuple[str, int]] = []
    seen_rows: set[str] = set()
    in_matrix, in_nic_legend = True, False

    def note_model(line: str, ln_no: int) -> bool:
        m = _LIST_L.match(line)
        if m:
            listed[int(m.group(1))] = (m.group(2).strip(), ln_no)
            return True
        try:
            if find_preset(line.strip()) is not None:
                named.append((line.strip(), ln_no))
                return True
        except UnknownGpuError:
            pass
        return False

    for ln_no, line in enumerate(lines[:header_at], start=1):
        note_model(line, ln_no)
    for ln_no, line in enumerate(lines[header_at + 1 :], start=header_at + 2):
        stripped = line.strip()
        if not stripped:
            in_matrix = in_matrix and not seen_rows
            continue
        if stripped.startswith("NIC Legend"):
            in_matrix, in_nic_legend = False, True
            continue
        if stripped.startswith("Legend"):
            in_matrix, in_nic_legend = False, False
            continue
        if note_model(line, ln_no):
            in_matrix = False
            continue
        if in_nic_legend:
            m = re.match(r"(\S+)\s*:\s*(\S+)$", stripped)
            if m:
                legend[m.group(1)] = m.group(2)
            continue
        if not in_matrix:
            continue
        raw, wide = _tokens(line), _tokens(line.expandtabs(8))
        name = raw[0][1]
        if name not in devices:
            raise TopologyError(f"{source}: line {ln_no}, column {raw[0][0] + 1}: unknown row '{name}' (header names {', '.join(devices)})")
        if name in seen_rows:
            raise TopologyError(f"{source}: line {ln_no}: row '{name}' appears twice")
        seen_rows.add(name)
        rest = list(zip(raw[1:], wide[1:]))
        m_cells = 0
        while m_cells < len(rest) and not _VALUE.fullmatch(rest[m_cells][0][1]):
            m_cells += 1
        for ((col, tok), _), other in zip(rest[:m_cells], devices):
            tok_n = _matrix_token(tok)
            if tok_n is None:
                raise TopologyError(f"{source}: line {ln_no}, column {col + 1}: unknown token '{tok}' ({name} to {other})")
        if m_cells != n_dev:
            raise TopologyError(
                f"{source}: line {ln_no}: {m_cells} matrix cells after '{name}', expected {n_dev} (one per device in the header)"
            )
        for ((col, tok), _), other in zip(rest[:n_dev], devices):
            tok_n = _matrix_token(tok)
            if (tok_n == "X") != (other == name):
                want = "'X' only on the diagonal" if tok_n == "X" else "'X' on the diagonal"
                raise TopologyError(f"{source}: line {ln_no}, column {col + 1}: got '{tok}' for {name} to {other}, expected {want}")
            back = cells.get((other, name))
            if back is not None and back != tok_n:
                raise TopologyError(
                    f"{source}: line {ln_no}, column {col + 1}: {name} to {other} is '{tok}' but {other} to {name} "
                    f"(line {where[(other, name)]}) is '{back}'"
                )
            cells[(name, other)] = tok_n
            where[(name, other)] = ln_no
        for key, val in _place_values(rest[n_dev:], extra, starts, source, ln_no, name).items():
            values[key][name] = val
    missing = [d for d in devices if d not in seen_rows]
    if missing:
        raise TopologyError(f"{source}: no row for {missing[0]} (the header names {n_dev} devices)")
    models = _gpu_models(listed, named, len(gpus), source)
    return TopoMatrix(tuple(devices), gpus, nics, cells, values.get("CPU Affinity", {}), values.get("NUMA Affinity", {}), legend, models)


def _place_values(
    rest: list[tuple[tuple[int, str], tuple[int, str]]],
    extra: list[str],
    starts: list[int],
    source: str,
    ln_no: int,
    name: str,
) -> dict[str, str]:
    """Which affinity column each value after the matrix belongs to: in order when every column has
    a value, else by the column it starts under (an empty cell leaves no trace between spaces)."""
    if len(rest) > len(extra):
        cols = f" ({', '.join(extra)})" if extra else ""
        raise TopologyError(f"{source}: line {ln_no}: {len(rest)} values after the matrix of '{name}', expected at most {len(extra)}{cols}")
    if len(rest) == len(extra):
        return {key: tok for ((_, tok), _), key in zip(rest, extra)}
    out: dict[str, str] = {}
    last = -1
    for (col, tok), (pos, _) in rest:
        j = max((i for i, s in enumerate(starts) if s <= pos + _TOLERANCE), default=0)
        if j <= last:
            raise TopologyError(
                f"{source}: line {ln_no}, column {col + 1}: cannot tell which column '{tok}' is under "
                f"({', '.join(extra)}); align it under its header"
            )
        out[extra[j]] = tok
        last = j
    return out


def _gpu_models(listed: dict[int, tuple[str, int]], named: list[tuple[str, int]], n_gpus: int, source: str) -> dict[int, tuple[str, int]]:
    """GPU index -> (model, line) from `nvidia-smi -L` lines, else from bare model-name lines (one
    for all GPUs, or one per GPU in order)."""
    if listed:
        bad = [i for i in listed if i >= n_gpus]
        if bad:
            raise TopologyError(f"{source}: line {listed[bad[0]][1]}: names GPU {bad[0]} but the matrix has {n_gpus} GPUs")
        if len(listed) != n_gpus:
            lost = next(i for i in range(n_gpus) if i not in listed)
            raise TopologyError(
                f"{source}: the `nvidia-smi -L` lines name {len(listed)} GPUs, the matrix has {n_gpus} (no line for GPU {lost})"
            )
        return dict(listed)
    if not named:
        return {}
    if len(named) == n_gpus:
        return dict(enumerate(named))
    if len({n for n, _ in named}) == 1:
        return {i: named[0] for i in range(n_gpus)}
    raise TopologyError(f"{source}: line {named[0][1]}: {len(named)} GPU model lines for {n_gpus} GPUs (give one, or one per GPU in order)")
