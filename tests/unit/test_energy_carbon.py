"""Carbon: the intensity feeds' shapes, one clear line for each kind of bad input, and grams equal
to an integral computed independently here for a given series and energy trace."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from torsh_distributed.energy import (
    CarbonConfig,
    ConstantIntensity,
    grams_of_trace,
    load_series,
    region_intensity,
)

T0 = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc).timestamp()


def _uk(path: Path, slots: list[tuple[str, str, float | None, float | None]]) -> Path:
    data = {"data": [{"from": f, "to": t, "intensity": {"forecast": fc, "actual": ac, "index": "moderate"}}
                     for f, t, fc, ac in slots]}
    path.write_text(json.dumps(data))
    return path


def test_uk_national_grid_shape_uses_actual_else_forecast(tmp_path: Path):
    series = load_series(_uk(tmp_path / "uk.json", [
        ("2024-03-01T12:00Z", "2024-03-01T12:30Z", 200, 210),
        ("2024-03-01T12:30Z", "2024-03-01T13:00Z", 180, None),
    ]))
    assert series.values == (210.0, 180.0)
    assert series.starts == (T0, T0 + 1800) and series.ends == (T0 + 1800, T0 + 3600)
    assert series.source == "series" and "2 slots" in series.detail


def test_electricity_maps_history_and_a_bare_list(tmp_path: Path):
    history = {"zone": "DE", "history": [
        {"zone": "DE", "carbonIntensity": 302, "datetime": "2024-03-01T12:00:00.000Z", "isEstimated": False},
        {"zone": "DE", "carbonIntensity": 296, "datetime": "2024-03-01T13:00:00.000Z", "isEstimated": False},
    ]}
    (tmp_path / "em.json").write_text(json.dumps(history))
    series = load_series(tmp_path / "em.json")
    assert series.values == (302.0, 296.0) and series.ends == (T0 + 3600, T0 + 7200)
    (tmp_path / "list.json").write_text(json.dumps([{"timestamp": T0, "intensity": 5}, {"timestamp": T0 + 60, "intensity": 7}]))
    assert load_series(tmp_path / "list.json").ends == (T0 + 60, T0 + 120)


def test_csv_with_and_without_a_header(tmp_path: Path):
    (tmp_path / "a.csv").write_text("timestamp,gCO2/kWh\n2024-03-01T12:00:00Z,100\n2024-03-01T12:00:10Z,300\n")
    series = load_series(tmp_path / "a.csv")
    assert series.starts == (T0, T0 + 10) and series.values == (100.0, 300.0)
    (tmp_path / "b.csv").write_text(f"{T0},1.5\n{T0 + 5},2.5\n{T0 + 10},3.5\n")
    assert load_series(tmp_path / "b.csv").values == (1.5, 2.5, 3.5)
    # Electricity Maps' CSV download: the intensity column found by name, not position
    (tmp_path / "em.csv").write_text(
        "Datetime (UTC),Country,Carbon Intensity gCO₂eq/kWh (direct),Low Carbon Percentage\n"
        "2024-03-01 12:00:00,Germany,380,50\n2024-03-01 13:00:00,Germany,360,52\n"
    )
    series = load_series(tmp_path / "em.csv")
    assert series.values == (380.0, 360.0) and series.starts[0] == T0  # naive times are UTC


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n2024-03-01T12:10Z,100\n2024-03-01T12:40Z,100\n",
         r"bad.csv: row 4: gap of 1800 s since the previous row \(the series' step is 600 s\)"),
        ("timestamp,intensity\n2024-03-01T12:10Z,100\n2024-03-01T12:00Z,100\n",
         r"bad.csv: row 3: timestamps must increase strictly"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n2024-03-01T12:00Z,100\n",
         r"bad.csv: row 3: timestamps must increase strictly"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\nyesterday,100\n",
         r"bad.csv: row 3: timestamp 'yesterday' is not ISO 8601 or unix seconds"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n2024-03-01T12:10Z,lots\n",
         r"bad.csv: row 3: intensity 'lots' is not a number"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n2024-03-01T12:10Z,-4\n",
         r"bad.csv: row 3: intensity '-4' must be a finite number >= 0"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n2024-03-01T12:10Z\n",
         r"bad.csv: row 3: expected at least 2 columns, got 1"),
        ("timestamp,intensity\n2024-03-01T12:00Z,100\n", r"a series needs at least 2 timestamped rows"),
        ("", r"bad.csv: empty carbon-intensity series"),
    ],
)
def test_bad_csv_gets_one_line_naming_file_and_row(tmp_path: Path, text: str, message: str):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_series(tmp_path / "bad.csv")
    with pytest.raises(ValueError, match=message):  # the config refuses it at construction
        CarbonConfig(series=str(tmp_path / "bad.csv"))


def test_a_header_without_an_intensity_column_is_refused_naming_the_columns(tmp_path: Path):
    # a renewable share in column 2 was priced as gCO2/kWh
    (tmp_path / "share.csv").write_text("datetime,renewable_share\n2024-03-01T12:00Z,62\n2024-03-01T12:10Z,64\n")
    with pytest.raises(ValueError, match=r"share.csv: the header names no carbon-intensity column \(columns found: 'datetime', 'renewable_share'"):
        load_series(tmp_path / "share.csv")
    with pytest.raises(ValueError, match=r"share.csv: the header names no carbon-intensity column"):
        CarbonConfig(series=str(tmp_path / "share.csv"))
    # named by any of its usual names, in any column; a byte-order mark is not part of a name
    (tmp_path / "ok.csv").write_text("\ufeffdatetime,renewable_share,carbon_intensity\n2024-03-01T12:00Z,62,300\n2024-03-01T12:10Z,64,280\n",
                                     encoding="utf-8")
    assert load_series(tmp_path / "ok.csv").values == (300.0, 280.0)


def test_a_series_that_is_not_utf8_names_the_file(tmp_path: Path):
    (tmp_path / "latin1.csv").write_bytes("datetime,intensité gCO2/kWh\n2024-03-01T12:00Z,300\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv: not UTF-8 text \(byte 0xe9 at offset 17\): save the series as UTF-8"):
        load_series(tmp_path / "latin1.csv")


def test_bad_json_feeds(tmp_path: Path):
    gap = _uk(tmp_path / "gap.json", [("2024-03-01T12:00Z", "2024-03-01T12:30Z", 1, 1),
                                      ("2024-03-01T13:00Z", "2024-03-01T13:30Z", 1, 1)])
    with pytest.raises(ValueError, match=r"gap.json: data\[1\]: gap of 1800 s before this slot"):
        load_series(gap)
    overlap = _uk(tmp_path / "o.json", [("2024-03-01T12:00Z", "2024-03-01T12:30Z", 1, 1),
                                        ("2024-03-01T12:20Z", "2024-03-01T12:50Z", 1, 1)])
    with pytest.raises(ValueError, match=r"o.json: data\[1\]: overlaps the previous slot"):
        load_series(overlap)
    empty = _uk(tmp_path / "n.json", [("2024-03-01T12:00Z", "2024-03-01T12:30Z", None, None)])
    with pytest.raises(ValueError, match=r"n.json: data\[0\]: intensity None is not a number"):
        load_series(empty)
    (tmp_path / "k.json").write_text(json.dumps([{"when": 1, "intensity": 2}]))
    with pytest.raises(ValueError, match=r"k.json: entry 0: needs a datetime/timestamp and a carbonIntensity/intensity key"):
        load_series(tmp_path / "k.json")
    (tmp_path / "j.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"j.json: not valid JSON \(line 1"):
        load_series(tmp_path / "j.json")
    with pytest.raises(ValueError, match="is not a file"):
        load_series(tmp_path / "missing.csv")


def _independent_grams(times, joules, slots, *, dt=0.05):
    """Midpoint sum of power(t) x intensity(t) over offsets from T0: exact when every boundary
    is on the dt grid."""
    rel = [t - T0 for t in times]
    slots = [(a - T0, b - T0, v) for a, b, v in slots]
    total = 0.0
    for k in range(round((rel[-1] - rel[0]) / dt)):
        mid = rel[0] + (k + 0.5) * dt
        seg = next(i for i in range(1, len(rel)) if rel[i - 1] <= mid < rel[i])
        power = (joules[seg] - joules[seg - 1]) / (rel[seg] - rel[seg - 1])
        value = next(v for a, b, v in slots if a <= mid < b)
        total += power * value * dt
    return total / 3.6e6


def test_grams_equal_an_independent_integral(tmp_path: Path):
    # slots of 10 s (compressed time); the trace crosses slot boundaries at uneven power
    slots = [(T0, T0 + 10, 100.0), (T0 + 10, T0 + 20, 400.0), (T0 + 20, T0 + 30, 50.0), (T0 + 30, T0 + 40, 250.0)]
    rows = "\n".join(f"{datetime.fromtimestamp(a, timezone.utc).isoformat()},{v}" for a, _, v in slots)
    (tmp_path / "s.csv").write_text("datetime,carbon_intensity\n" + rows + "\n")
    series = load_series(tmp_path / "s.csv")
    times = [T0 + 2.0, T0 + 7.5, T0 + 13.25, T0 + 14.0, T0 + 29.5, T0 + 36.0]
    joules = [0.0, 550.0, 700.0, 2200.0, 2250.0, 9000.0]
    grams, outside = grams_of_trace(times, joules, series)
    expected = _independent_grams(times, joules, slots)
    assert grams == pytest.approx(expected, rel=1e-9) and outside == 0.0
    # a constant: kWh x g/kWh
    assert grams_of_trace(times, joules, ConstantIntensity(300.0))[0] == pytest.approx(9000 / 3.6e6 * 300)
    # past the series' end the last value holds, and those seconds are reported
    grams, outside = grams_of_trace([T0 + 35, T0 + 45], [0.0, 1000.0], series)
    assert outside == pytest.approx(5.0) and grams == pytest.approx(1000 / 3.6e6 * 250)


def test_region_table_and_config_choices():
    assert region_intensity("fra").value == pytest.approx(56.039)
    default = region_intensity("")
    assert default.source == "default" and default.value == 475.0 and "IEA 2019" in default.detail
    assert CarbonConfig().resolve().source == "default"
    assert CarbonConfig(region="DEU").resolve().source == "region"
    assert CarbonConfig(intensity=300).resolve().value == 300
    with pytest.raises(ValueError, match="carbon.region 'XX' is not in the table; known: AUS"):
        CarbonConfig(region="XX")
    with pytest.raises(ValueError, match=r"give one of --carbon.intensity, --carbon.series, --carbon.region, got \['intensity', 'region'\]"):
        CarbonConfig(intensity=300, region="DEU")
    with pytest.raises(ValueError, match="carbon.intensity must be >= 0"):
        CarbonConfig(intensity=-1)
