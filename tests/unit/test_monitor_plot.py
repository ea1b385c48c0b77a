"""The loss-curve image of ``--plot``: written whole, validation points optional, bad input named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from torsh_distributed.monitor.config import MonitorConfig
from torsh_distributed.monitor.plot import plot_loss_curve

LOSSES = [5.5 - 0.1 * i for i in range(30)]


def test_png_with_and_without_validation_points(tmp_path: Path):
    with_val = plot_loss_curve(tmp_path / "a" / "curve.png", losses=LOSSES,
                               val_points=[(10, 4.8), (20, math.nan), (30, 2.9)], title="run")
    without = plot_loss_curve(tmp_path / "b.png", losses=LOSSES)
    for path in (with_val, without):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert with_val.read_bytes() != without.read_bytes()  # the validation points are drawn
    svg = plot_loss_curve(tmp_path / "c.svg", losses=LOSSES)
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b.png", "c.svg", "curve.png"]


def test_bad_input_is_named(tmp_path: Path):
    with pytest.raises(ValueError, match=r"must end in .png, .svg, .pdf, got 'c.jpg'"):
        plot_loss_curve(tmp_path / "c.jpg", losses=LOSSES)
    with pytest.raises(ValueError, match="no training losses to plot"):
        plot_loss_curve(tmp_path / "c.png", losses=[])
    with pytest.raises(ValueError, match=r"monitor.plot \(--plot\) must end in"):
        MonitorConfig(plot="loss.jpeg")
    assert not MonitorConfig(plot="out/loss.png").active  # plotting alone turns no monitor on
