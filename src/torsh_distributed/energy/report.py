"""The energy and carbon report of a finished run, from its ``--summary-json`` file.

:func:`find_summary` takes the JSON file or a run directory (the newest ``*.json`` in it that has
an ``energy`` block), :func:`format_report` prints the job's figures and one row per rank, and
:func:`plot_report` draws every rank's power over time and its energy (needs matplotlib).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["find_summary", "format_report", "load_summary", "plot_report"]


def find_summary(path: str | Path) -> Path:
    """The summary JSON ``path`` names: the file itself, or the newest in a directory that
    holds an ``energy`` block.

    Raises:
        FileNotFoundError: ``path`` does not exist, or the directory has no such file.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist (give a run directory or a --summary-json file)")
    found = []
    for candidate in path.rglob("*.json"):
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "energy" in data:
            found.append(candidate)
    if not found:
        raise FileNotFoundError(
            f"no summary with an energy block under {path} (train with --summary-json FILE)"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def load_summary(path: Path) -> dict[str, Any]:
    """The summary's dict; ``ValueError`` naming the file when it is not a run summary."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or "energy" not in data:
        raise ValueError(f"{path}: not a run summary with an energy block (torsh-dist train --summary-json)")
    if not data["energy"]:
        raise ValueError(f"{path}: the run had energy metering off (--energy.meter off)")
    return data


def _num(value: Any, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def format_report(data: dict[str, Any], *, path: str | Path = "") -> str:
    """The job's energy and carbon, then a table of the ranks."""
    energy, carbon = data["energy"], data.get("carbon") or {}
    lines = [
        f"energy report{f' of {path}' if path else ''}",
        f"  energy:  {_num(energy['joules'])} J ({energy['source']}, meter {energy['meter']}) over "
        f"{energy['steps']} steps in {_num(energy.get('seconds'))} s; "
        f"{_num(energy.get('average_power_w'))} W on average",
        f"  per step {_num(energy['joules_per_step'])} J"
        + (f", per sample {_num(energy['joules_per_sample'])} J" if "joules_per_sample" in energy else "")
        + (f", per token {_num(energy['joules_per_token'])} J" if "joules_per_token" in energy else ""),
        f"  meter:   {energy.get('detail', '')}; {energy.get('why', '')}",
    ]
    if energy.get("phases"):
        lines.insert(3, "  phases:  " + ", ".join(f"{n} {_num(j)} J" for n, j in energy["phases"].items())
                     + " (evaluations and checkpoint saves in the loop; the rest is train)")
    if carbon:
        lines.append(
            f"  carbon:  {_num(carbon['grams'])} g CO2e at {_num(carbon.get('intensity_g_per_kwh'))} "
            f"g/kWh ({carbon['intensity_source']}: {carbon.get('intensity_detail', '')})"
        )
        if carbon.get("seconds_outside_series"):
            lines.append(
                f"  note:    {carbon['seconds_outside_series']:.0f} s of the run lie outside the "
                "intensity series (its edge values were used)"
            )
    lines.extend(_decisions(carbon))
    lines.extend(_power_lines(energy.get("power_limit")))
    if energy.get("excluded"):
        ex = energy["excluded"]
        lines.append(f"  excluded: ranks {ex['ranks']} ({_num(ex['estimated_joules'])} J estimated): {ex['why']}")
    grams = {r["rank"]: r["grams"] for r in carbon.get("ranks", [])}
    header = ("rank", "meter", "source", "scope", "joules", "J/step", "avg W", "grams")
    rows = [
        (
            str(r["rank"]), r["meter"], r["source"], r["scope"], _num(r["joules"]),
            _num(r["joules"] / r["steps"] if r["steps"] else None), _num(r["average_power_w"]),
            _num(grams.get(r["rank"])),
        )
        for r in energy.get("ranks", [])
    ]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    lines.append("")
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    if any(r["scope"] == "host" for r in energy.get("ranks", [])):
        lines.append("(host-scoped counters are shared by the ranks of a host: the job counts each once)")
    return "\n".join(lines)


def _power_lines(power: dict[str, Any] | None) -> list[str]:
    """The GPU power-limit decision (``--energy.power-limit``) and, for a search, its table."""
    if not power:
        return []
    if not power.get("applied"):
        return [f"  power:   limit unchanged ({power.get('why', '')})"]
    line = f"  power:   GPU limit {_num(power['limit_w'])} W ({power['mode']}; was {_num(power.get('original_w'))} W)"
    if power["mode"] != "search":
        return [line]
    lines = [
        line + f": {_num(100 * power['energy_saved'], '.1f')} % less energy per step, "
        f"{_num(100 * power['time_added'], '.1f')} % more time than at {_num(power['candidates'][0]['limit_w'])} W "
        f"(eta {power['tradeoff']:g}, {power['steps_per_limit']} steps per limit)",
        "    " + "  ".join(h.rjust(9) for h in ("limit W", "J/step", "s/step", "cost")),
    ]
    for c in power["candidates"]:
        cells = (_num(c["limit_w"]), _num(c["joules_per_step"]), _num(c["seconds_per_step"]), _num(c["cost"]))
        lines.append("    " + "  ".join(v.rjust(9) for v in cells) + ("  <- chosen" if c["limit_w"] == power["limit_w"] else ""))
    return lines


def _decisions(carbon: dict[str, Any]) -> list[str]:
    """Time shifting's pauses and carbon scaling's segments, when the run had them."""
    from torsh_distributed.energy.shift import clock_text

    lines = []
    if isinstance(carbon.get("pauses"), list):
        met = carbon.get("met_deadline")
        lines.append(
            f"  shifting: {len(carbon['pauses'])} pause(s), {_num(carbon.get('paused_s'), '.1f')} s "
            f"paused while above {_num(carbon.get('max_intensity_g_per_kwh'), 'g')} g/kWh"
            + (f"; deadline {carbon['deadline']} {'met' if met else 'missed'}" if carbon.get("deadline") else "")
        )
        lines.extend(
            f"    step {p['step']}: paused {p['seconds']:.1f} s from {clock_text(p['start'])} at "
            f"{_num(p.get('intensity'), 'g')} g/kWh"
            for p in carbon["pauses"]
        )
    scaling = carbon.get("scaling")
    if isinstance(scaling, dict):
        lines.append(
            f"  scaling:  {scaling['min_world_size']} to {scaling['max_world_size']} workers, "
            f"{scaling['restarts']} restart(s); all segments: {_num(scaling.get('joules'))} J, "
            f"{_num(scaling.get('grams'))} g CO2e, {scaling['steps']} steps in "
            f"{_num(scaling.get('wall_s'), '.1f')} s (the figures above are the last segment's)"
        )
        header = ("segment", "launched", "steps", "workers", "g/kWh", "joules", "grams")
        rows = [
            (str(seg["index"]), clock_text(seg["launched_unix_s"]), f"{seg['start_step']}-{seg['end_step']}",
             str(seg["world_size"]), _num(seg.get("intensity"), "g"), _num(seg.get("joules")),
             _num(seg.get("grams")))
            for seg in scaling["segments"]
        ]
        widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
        lines.append("    " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        lines.extend("    " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return lines


def plot_report(data: dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Every rank's average power between readings, and its energy, as one image.

    Raises:
        ValueError: matplotlib is missing, or an unsupported suffix.
    """
    from torsh_distributed.monitor.plot import FORMATS, check_available

    check_available("torsh-dist energy report --plot")
    path = Path(path)
    if not path.name.lower().endswith(FORMATS):
        raise ValueError(f"--plot must end in {', '.join(FORMATS)}, got {str(path)!r}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    energy = data["energy"]
    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    power, bars = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for r in energy["ranks"]:
        trace = r.get("trace") or []
        xs, ws = [], []
        for (t0, j0), (t1, j1) in zip(trace, trace[1:], strict=False):
            if t1 > t0:
                xs += [t0, t1]
                ws += [(j1 - j0) / (t1 - t0)] * 2
        power.plot(xs, ws, label=f"rank {r['rank']} ({r['meter']})")
    power.set_xlabel("seconds since the first step")
    power.set_ylabel(f"power (W, {energy['source']})")
    power.legend(fontsize="small")
    ranks = [r["rank"] for r in energy["ranks"]]
    bars.bar([str(k) for k in ranks], [r["joules"] for r in energy["ranks"]])
    bars.set_xlabel("rank")
    bars.set_ylabel(f"energy (J, {energy['source']})")
    carbon = data.get("carbon") or {}
    fig.suptitle(
        title or f"{energy['joules']:.4g} J, {carbon.get('grams', float('nan')):.4g} g CO2e "
        f"({carbon.get('intensity_source', '-')})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp)
    tmp.replace(path)
    return path
