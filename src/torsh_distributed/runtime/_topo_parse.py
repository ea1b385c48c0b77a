"""Parse the text of ``nvidia-smi topo -m``: GPU-GPU and GPU-NIC links, CPU and NUMA affinity.

The matrix has one header line (``GPU0 GPU1 ... NIC0 ... CPU Affinity  NUMA Affinity  GPU NUMA ID``),
one row per GPU and NIC, a ``Legend:`` block and, since driver 515 or so, a ``NIC Legend:``
(``NIC0: mlx5_0``). Older drivers name the NIC columns by device (``mlx5_0``) and print no NIC
legend. Cells are separated by tabs or by runs of spaces depending on the driver and on who pasted
it, and the header is sometimes underlined with ANSI escapes: all three are accepted. Anything else
is refused with ``FILE:LINE`` so that a wrong file is never half-read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LINK_RANK", "TopoMatrix", "TopoParseError", "link_rank", "parse_topo", "read_topo"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LINK = re.compile(r"^(X|SYS|SOC|NODE|PHB|PXB|PIX|NV\d+)$")
_TAILS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_LEGEND_ROW = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")

LINK_RANK = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
"""PCIe distance between a GPU and a NIC, nearest first (NCCL's PATH_PIX ... PATH_SYS);
``SOC`` is the pre-2018 name of ``SYS``."""


class TopoParseError(ValueError):
    """A ``nvidia-smi topo -m`` text that cannot be read; the message names the file and line."""


def link_rank(link: str) -> int:
    """Distance rank of a GPU-NIC link (1 = same PCIe switch ... 5 = other CPU socket)."""
    return LINK_RANK.get(link, 6)


@dataclass(frozen=True, slots=True)
class TopoMatrix:
    """What ``nvidia-smi topo -m`` says about one machine."""

    gpus: tuple[str, ...]
    """GPU column names in order (``GPU0`` ...)."""
    nics: tuple[str, ...]
    """NIC device names in column order, resolved through the NIC legend (``mlx5_0`` ...)."""
    gpu_links: dict[tuple[str, str], str] = field(default_factory=dict)
    """(GPU, GPU) -> link code (``NV12``, ``SYS`` ...), both orders."""
    nic_links: dict[tuple[str, str], str] = field(default_factory=dict)
    """(GPU, NIC device) -> link code (``PIX`` ... ``SYS``)."""
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    """GPU -> its CPU list as printed (``0-47,96-143``); absent when the column is ``N/A``."""
    numa_node: dict[str, int] = field(default_factory=dict)
    """GPU -> its NUMA node; absent when ``N/A``."""
    source: str = "<text>"
    """Where the text came from (a path, or ``nvidia-smi topo -m``)."""


def read_topo(path: str | Path) -> TopoMatrix:
    """Parse the ``nvidia-smi topo -m`` output saved in ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise FileNotFoundError(f"cannot read the topology file {path}: {exc.strerror}") from None
    return parse_topo(text, source=str(path))


def _cells(line: str) -> list[str]:
    """Split a matrix row on any whitespace: no cell (link, CPU list, NUMA id) holds a space."""
    return line.split()


def _header_labels(line: str) -> tuple[list[str], list[str]] | None:
    """(device columns, tail columns) of a header line, or None if this is not the header."""
    clean = line.strip()
    if not re.match(r"^GPU0\b", clean):
        return None
    tails = [t for t in _TAILS if t in clean]
    for tail in _TAILS:
        clean = clean.replace(tail, " ")
    return clean.split(), tails


def parse_topo(text: str, *, source: str = "<text>") -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` text (see the module docstring for the accepted forms)."""
    lines = _ANSI.sub("", text).splitlines()
    header_at = None
    for number, line in enumerate(lines):
        parsed = _header_labels(line)
        if parsed is not None:
            header_at, (columns, tails) = number, parsed
            break
    if header_at is None:
        raise TopoParseError(
            f"{source}: no 'GPU0 ...' header line: not the output of `nvidia-smi topo -m`"
        )
    for label in columns:
        if not re.match(r"^[A-Za-z][\w.-]*$", label):
            raise TopoParseError(f"{source}:{header_at + 1}: bad column label {label!r}")
    gpus = [c for c in columns if re.match(r"^GPU\d+$", c)]
    nic_columns = [c for c in columns if c not in gpus]

    legend: dict[str, str] = {}
    rows: dict[str, tuple[int, list[str]]] = {}
    in_legend = False
    for number in range(header_at + 1, len(lines)):
        line = lines[number]
        if not line.strip():
            continue
        stripped = line.strip()
        if stripped.startswith("Legend:"):
            in_legend = True
            continue
        if stripped.startswith("NIC Legend:"):
            in_legend = True
            continue
        match = _LEGEND_ROW.match(line)
        if in_legend and match:
            legend[match.group(1)] = match.group(2)
            continue
        if in_legend:
            continue  # the link-code legend (X = Self ...) and whatever the paste added after it
        cells = _cells(line)
        name = cells[0]
        if name not in columns:
            raise TopoParseError(
                f"{source}:{number + 1}: row {name!r} is not one of the header's columns "
                f"({', '.join(columns)})"
            )
        values = cells[1:]
        expected = len(columns) + (len(tails) if name in gpus else 0)
        if len(values) != expected:
            what = f"{len(columns)} device columns" + (
                f" and {len(tails)} affinity columns" if name in gpus and tails else "")
            raise TopoParseError(
                f"{source}:{number + 1}: row {name} has {len(values)} cells, the header has {what}"
            )
        for value in values[: len(columns)]:
            if not _LINK.match(value):
                raise TopoParseError(
                    f"{source}:{number + 1}: unknown link {value!r} in row {name} "
                    "(expected X, NV#, PIX, PXB, PHB, NODE or SYS)"
                )
        rows[name] = (number + 1, values)

    missing = [g for g in gpus if g not in rows]
    if missing:
        raise TopoParseError(f"{source}: no row for {', '.join(missing)}")
    nic_name = {c: legend.get(c, c) for c in nic_columns}
    unnamed = [c for c in nic_columns if re.match(r"^NIC\d+$", c) and c not in legend]
    if unnamed:
        raise TopoParseError(
            f"{source}: {', '.join(unnamed)} not named in a 'NIC Legend:' block (NIC0: mlx5_0)"
        )

    gpu_links: dict[tuple[str, str], str] = {}
    nic_links: dict[tuple[str, str], str] = {}
    cpu_affinity: dict[str, str] = {}
    numa_node: dict[str, int] = {}
    for gpu in gpus:
        line_number, values = rows[gpu]
        for column, value in zip(columns, values, strict=False):
            if column in gpus:
                if (column == gpu) != (value == "X"):
                    raise TopoParseError(
                        f"{source}:{line_number}: {gpu} to {column} is {value!r}: 'X' must be "
                        "on the diagonal and only there"
                    )
                if column != gpu:
                    gpu_links[(gpu, column)] = value
            else:
                nic_links[(gpu, nic_name[column])] = value
        extra = dict(zip(tails, values[len(columns):], strict=False))
        cpus = extra.get("CPU Affinity", "N/A")
        if cpus != "N/A":
            if not re.match(r"^\d+(-\d+)?(,\d+(-\d+)?)*$", cpus):
                raise TopoParseError(f"{source}:{line_number}: bad CPU affinity {cpus!r} for {gpu}")
            cpu_affinity[gpu] = cpus
        numa = extra.get("NUMA Affinity", "N/A")
        if numa != "N/A":
            if not numa.isdigit():
                raise TopoParseError(f"{source}:{line_number}: bad NUMA affinity {numa!r} for {gpu}")
            numa_node[gpu] = int(numa)
    return TopoMatrix(
        gpus=tuple(gpus),
        nics=tuple(nic_name[c] for c in nic_columns),
        gpu_links=gpu_links,
        nic_links=nic_links,
        cpu_affinity=cpu_affinity,
        numa_node=numa_node,
        source=source,
    )
