"""RAPL package and DRAM energy through Linux's powercap interface.

The kernel exposes one zone per package, ``<root>/intel-rapl:N`` (``name`` ``package-N``), with
sub-zones ``intel-rapl:N:M`` (``core``, ``uncore``, ``dram``); AMD processors use the same tree.
Each zone has ``energy_uj``, a counter in microjoules that wraps to 0 after
``max_energy_range_uj``. A package counts its cores and uncore, not its DRAM, so the host's energy
is the sum of the packages and the DRAM sub-zones (``psys``, the whole platform on some laptops,
would count them twice and is left out). Since Linux 5.10 ``energy_uj`` is readable by root only
(the PLATYPUS side channel): then the meter is unavailable and says so.
See https://docs.kernel.org/power/powercap/powercap.html.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from torsh_distributed.energy.meters import MeterUnavailableError

__all__ = ["RaplMeter", "RaplZone", "find_zones"]


@dataclass(slots=True)
class RaplZone:
    """One counter: its directory, its name, the range after which it wraps, its last value."""

    path: Path
    name: str
    max_range_uj: int
    last_uj: int = 0
    total_uj: int = 0
    """Energy since the meter opened, wraps unfolded."""

    def read_uj(self) -> int:
        return int((self.path / "energy_uj").read_text().strip())

    def advance(self) -> None:
        """Add the energy since the last read; a value below the last one has wrapped once.

        A reader must come back within one wrap period (minutes at full power: the package
        range is ~262 kJ on common Intel parts); the tracker reads every ``--energy.interval``.
        """
        now = self.read_uj()
        delta = now - self.last_uj
        if delta < 0:
            delta += self.max_range_uj
        self.total_uj += delta
        self.last_uj = now


def find_zones(root: str | Path) -> list[RaplZone]:
    """The package zones and their DRAM sub-zones under ``root``, each read once.

    Raises:
        MeterUnavailableError: no RAPL zone, no package zone, or a counter that cannot be read
            (the reason names the file: permission denied is the common case).
    """
    root = Path(root)
    if not root.is_dir():
        raise MeterUnavailableError(f"{root} does not exist (no powercap interface on this host)")
    zones: list[RaplZone] = []
    dirs = sorted(p for p in root.iterdir() if p.name.startswith("intel-rapl:"))
    if not dirs:
        raise MeterUnavailableError(f"no intel-rapl:* zone under {root} (no RAPL on this CPU/VM)")
    for path in dirs:
        depth = path.name.count(":")
        try:
            name = (path / "name").read_text().strip()
        except OSError as exc:
            raise MeterUnavailableError(f"cannot read {path / 'name'}: {exc.strerror}") from None
        if not (depth == 1 and name.startswith("package")) and not (depth == 2 and name == "dram"):
            continue  # core/uncore are inside their package; psys would count everything twice
        try:
            max_range = int((path / "max_energy_range_uj").read_text().strip())
            zone = RaplZone(path=path, name=name, max_range_uj=max_range)
            zone.last_uj = zone.read_uj()
        except PermissionError:
            raise MeterUnavailableError(
                f"permission denied reading {path / 'energy_uj'} (root-only since Linux 5.10; "
                "run as root or grant read access to the energy_uj files)"
            ) from None
        except (OSError, ValueError) as exc:
            raise MeterUnavailableError(f"cannot read the counter of {path}: {exc}") from None
        zones.append(zone)
    if not any(z.name.startswith("package") for z in zones):
        raise MeterUnavailableError(f"no package zone under {root} (only {[p.name for p in dirs]})")
    return zones


class RaplMeter:
    """Host energy (packages + DRAM) from RAPL counters; see the module doc.

    Args:
        root: The powercap directory; tests give a fake tree in the kernel's format.
    """

    name = "rapl"
    source = "measured"
    scope = "host"

    def __init__(self, root: str | Path = "/sys/class/powercap") -> None:
        self.zones = find_zones(root)
        self.scope_key = socket.gethostname()
        names = [z.name for z in self.zones]
        missing = "" if "dram" in names else " (no DRAM domain on this host: packages only)"
        self.detail = f"RAPL {', '.join(names)} under {root}{missing}"

    def read(self) -> float:
        """Joules of every zone since the meter opened."""
        for zone in self.zones:
            zone.advance()
        return sum(z.total_uj for z in self.zones) * 1e-6
