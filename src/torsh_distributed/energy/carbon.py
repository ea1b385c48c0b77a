"""Carbon: grams CO2e = energy (kWh) x grid intensity (gCO2e/kWh), integrated over the run.

The intensity is a constant (``--carbon.intensity G``), a region's annual average (``--carbon.region
DEU``, see :mod:`~torsh_distributed.energy._regions`), or a time series the user gives
(``--carbon.series FILE``): a CSV of ``timestamp, gCO2/kWh`` rows, Electricity Maps' history JSON
(``{"history": [{"datetime", "carbonIntensity"}]}`` or a bare list), or the UK National Grid
carbon-intensity API's ``{"data": [{"from", "to", "intensity": {"actual", "forecast"}}]}``. A
series is a step function: each value holds from its timestamp to the next (or over its own
``from``/``to``). The energy between two meter readings is spread evenly over their interval,
so ``grams = sum_i (dE_i / dt_i) * integral of I(t) over [t_{i-1}, t_i] / 3.6e6``.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from torsh_distributed.energy._regions import REGION_INTENSITY, REGION_SOURCE, WORLD

__all__ = [
    "ConstantIntensity",
    "Intensity",
    "IntensitySeries",
    "J_PER_KWH",
    "grams_of_trace",
    "load_series",
    "region_intensity",
]

J_PER_KWH = 3.6e6


class Intensity(Protocol):
    """Grid carbon intensity over time, in gCO2e/kWh."""

    source: str
    """``constant``, ``series``, ``region`` or ``default`` (the summary's ``intensity_source``)."""
    detail: str
    """Where the figure comes from, in one line."""

    def integral(self, start: float, end: float) -> tuple[float, float]:
        """``(integral of I(t) dt over [start, end] in g/kWh x s, seconds outside the data)``."""
        ...

    def at(self, t: float) -> float:
        """The intensity at unix time ``t``."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantIntensity:
    """The same intensity at every instant."""

    value: float
    source: str = "constant"
    detail: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise ValueError(f"carbon intensity must be a finite number >= 0 gCO2/kWh, got {self.value}")

    def integral(self, start: float, end: float) -> tuple[float, float]:
        return self.value * (end - start), 0.0

    def at(self, t: float) -> float:
        return self.value


def region_intensity(code: str) -> ConstantIntensity:
    """A region's annual average; ``WORLD`` (or ``""``) is the default when nothing is given.

    Raises:
        ValueError: an unknown code (the message lists the known ones).
    """
    key = (code or WORLD).upper()
    if key not in REGION_INTENSITY:
        raise ValueError(
            f"carbon.region {code!r} is not in the table; known: {', '.join(sorted(REGION_INTENSITY))} "
            "(or give --carbon.intensity G or --carbon.series FILE)"
        )
    name, value = REGION_INTENSITY[key]
    source = "default" if not code else "region"
    return ConstantIntensity(value, source=source, detail=f"{key} {name}: {value:g} g/kWh ({REGION_SOURCE})")


@dataclass(frozen=True, slots=True)
class IntensitySeries:
    """A step function of intensity: ``values[i]`` holds over ``[starts[i], ends[i])``; slots are
    sorted and contiguous (checked by :func:`load_series`)."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    values: tuple[float, ...]
    source: str = "series"
    detail: str = ""

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.values[min(max(i, 0), len(self.values) - 1)]

    def integral(self, start: float, end: float) -> tuple[float, float]:
        """Exact integral of the step function; outside the series the edge values hold (and
        those seconds are returned, for the summary)."""
        if end <= start:
            return 0.0, 0.0
        total = outside = 0.0
        first, last = self.starts[0], self.ends[-1]
        if start < first:
            cut = min(end, first)
            total += self.values[0] * (cut - start)
            outside += cut - start
        if end > last:
            cut = max(start, last)
            total += self.values[-1] * (end - cut)
            outside += end - cut
        lo, hi = max(start, first), min(end, last)
        if lo < hi:
            i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
            while i < len(self.values) and self.starts[i] < hi:
                overlap = min(hi, self.ends[i]) - max(lo, self.starts[i])
                if overlap > 0:
                    total += self.values[i] * overlap
                i += 1
        return total, outside


def grams_of_trace(times: list[float], joules: list[float], intensity: Intensity) -> tuple[float, float]:
    """Grams CO2e of a cumulative energy trace (``joules[i]`` at unix time ``times[i]``) and the
    seconds of it outside the intensity's data."""
    grams = outside = 0.0
    for i in range(1, len(times)):
        energy = joules[i] - joules[i - 1]
        dt = times[i] - times[i - 1]
        if dt <= 0:
            grams += energy * intensity.at(times[i]) / J_PER_KWH
            continue
        area, out = intensity.integral(times[i - 1], times[i])
        grams += energy / dt * area / J_PER_KWH
        outside += out
    return grams, outside


# --- parsing --------------------------------------------------------------------------------

_TIME_KEYS = ("datetime", "timestamp", "time", "date", "from")
_VALUE_KEYS = ("carbonintensity", "carbon_intensity", "intensity", "gco2/kwh", "gco2eq/kwh", "value")


def _timestamp(text: Any, where: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: no timestamp (got {text!r})")
    raw = text.strip()
    try:
        return float(raw)
    except ValueError:
        pass
    iso = raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"{where}: timestamp {raw!r} is not ISO 8601 or unix seconds") from None
    if moment.tzinfo is None:  # documented: naive times are UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _intensity(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: intensity {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: intensity {value!r} must be a finite number >= 0 gCO2/kWh")
    return number


def _pick(keys: list[str], wanted: tuple[str, ...]) -> str | None:
    """The first key equal to a wanted name (in order), else the first containing one."""
    lowered = {k.lower().replace(" ", ""): k for k in keys}
    for want in wanted:
        if want in lowered:
            return lowered[want]
    for want in wanted:
        for low, key in lowered.items():
            if len(want) > 5 and want in low:
                return key
    return None


_CSV_VALUE_NAMES = (
    "carbonintensity",
    "carbon_intensity",
    "intensity",
    "gco2/kwh",
    "gco2eq/kwh",
    "gco2e/kwh",
    "gco2",
    "value",
)
"""Header names of the intensity column, best first (any name containing one of the longer
ones counts: Electricity Maps' ``Carbon Intensity gCO2eq/kWh (direct)``)."""


def _rows_csv(path: Path, text: str) -> tuple[list[tuple[str, Any, Any]], str]:
    rows = [r for r in csv.reader(io.StringIO(text, newline="")) if r and any(c.strip() for c in r)]
    if not rows:
        raise ValueError(f"{path}: empty carbon-intensity series")
    header = [c.strip() for c in rows[0]]
    try:  # a header row has no numeric second column
        float(header[1]) if len(header) > 1 else None
        has_header = False
    except ValueError:
        has_header = True
    tcol, vcol = 0, 1
    column = "column 2"
    if has_header:
        tname = _pick(header, ("datetime", "timestamp", "time", "date"))
        vname = _pick(header, _CSV_VALUE_NAMES)
        if vname is None:  # another column (a renewable share, a price) must not be priced as gCO2
            raise ValueError(
                f"{path}: the header names no carbon-intensity column (columns found: "
                f"{', '.join(repr(c) for c in header)}; expected one named like 'carbon_intensity', "
                "'intensity' or 'gCO2/kWh', or no header: timestamp, gCO2/kWh rows)"
            )
        tcol = header.index(tname) if tname else 0
        vcol = header.index(vname)
        column = f"column {header[vcol]!r}"
    out = []
    for n, row in enumerate(rows[1:] if has_header else rows, start=2 if has_header else 1):
        where = f"{path}: row {n}"
        if len(row) <= max(tcol, vcol):
            raise ValueError(f"{where}: expected at least {max(tcol, vcol) + 1} columns, got {len(row)}")
        out.append((where, row[tcol], row[vcol]))
    return out, column


def _rows_json(path: Path, data: Any) -> tuple[list[tuple[str, Any, Any, Any]], str]:
    """``(where, start, end or None, value)`` of each entry of a JSON feed."""
    if isinstance(data, dict) and isinstance(data.get("data"), list):  # UK National Grid API
        out = []
        for i, item in enumerate(data["data"]):
            where = f"{path}: data[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("intensity"), dict):
                raise ValueError(f"{where}: expected {{'from', 'to', 'intensity': {{'actual', 'forecast'}}}}")
            value = item["intensity"].get("actual")
            if value is None:
                value = item["intensity"].get("forecast")
            out.append((where, item.get("from"), item.get("to"), value))
        return out, "UK carbon-intensity API (actual, else forecast)"
    items = data.get("history") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(
            f"{path}: expected a list of {{'datetime', 'carbonIntensity'}}, Electricity Maps' "
            "{'history': [...]} or the UK API's {'data': [...]}"
        )
    out = []
    for i, item in enumerate(items):
        where = f"{path}: entry {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object, got {type(item).__name__}")
        tkey = _pick(list(item), _TIME_KEYS)
        vkey = _pick(list(item), _VALUE_KEYS)
        if tkey is None or vkey is None:
            raise ValueError(f"{where}: needs a datetime/timestamp and a carbonIntensity/intensity key, has {sorted(item)}")
        out.append((where, item[tkey], item.get("to"), item[vkey]))
    return out, "JSON list"


def load_series(path: str | Path) -> IntensitySeries:
    """Parse and check a carbon-intensity series (see the module doc for the shapes).

    Raises:
        ValueError: one line naming the file and row: an unreadable file, an unparsable row, a
            negative or missing intensity, timestamps not strictly increasing, or a gap (a
            spacing over 1.5x the series' shortest one, or a ``from`` after the previous ``to``).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"carbon.series: {path} is not a file")
    try:  # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            "save the series as UTF-8"
        ) from None
    rows: list[tuple[str, Any, Any, Any]]
    if path.suffix.lower() == ".json" or text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        rows, shape = _rows_json(path, data)
    else:
        csv_rows, shape = _rows_csv(path, text)
        rows = [(w, t, None, v) for w, t, v in csv_rows]
    if not rows:
        raise ValueError(f"{path}: empty carbon-intensity series")
    starts, ends, values = [], [], []
    for where, start, end, value in rows:
        starts.append(_timestamp(start, where))
        ends.append(_timestamp(end, where) if end is not None else math.nan)
        values.append(_intensity(value, where))
    wheres = [r[0] for r in rows]
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise ValueError(
                f"{wheres[i]}: timestamps must increase strictly ({rows[i][1]!r} after {rows[i - 1][1]!r})"
            )
    explicit = not any(math.isnan(e) for e in ends)
    if explicit:
        for i in range(len(starts)):
            if ends[i] <= starts[i]:
                raise ValueError(f"{wheres[i]}: 'to' {rows[i][2]!r} is not after 'from' {rows[i][1]!r}")
            if i and starts[i] > ends[i - 1]:
                raise ValueError(
                    f"{wheres[i]}: gap of {starts[i] - ends[i - 1]:g} s before this slot (previous "
                    f"'to' {rows[i - 1][2]!r}, this 'from' {rows[i][1]!r})"
                )
            if i and starts[i] < ends[i - 1]:
                raise ValueError(f"{wheres[i]}: overlaps the previous slot (its 'to' is {rows[i - 1][2]!r})")
    else:
        if len(starts) < 2:
            raise ValueError(f"{path}: a series needs at least 2 timestamped rows (1 given): use --carbon.intensity")
        steps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        step = min(steps)  # the slot length; anything longer than 1.5 slots is a gap
        for i, gap in enumerate(steps, start=1):
            if gap > 1.5 * step:
                raise ValueError(
                    f"{wheres[i]}: gap of {gap:g} s since the previous row (the series' step is "
                    f"{step:g} s); fill the missing slots"
                )
        ends = starts[1:] + [starts[-1] + step]
    return IntensitySeries(
        starts=tuple(starts),
        ends=tuple(ends),
        values=tuple(values),
        detail=f"{path} ({len(values)} slots; {shape})",
    )
