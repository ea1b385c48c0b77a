"""Headless Chromium (Playwright, the Debian package's binary) renders the live dashboard of a
2-rank training run: charts show data points, an alert can be acknowledged, a screenshot is kept."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from _monitor_run import TrainingRun

from torsh_distributed.testing import find_free_port

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHARTS = ("loss", "throughput", "breakdown", "ranks", "memory", "comm", "energy")


@pytest.mark.slow
def test_dashboard_in_headless_chromium(tmp_path: Path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra) not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed: run `make test` as root (installs it) or "
                    "apt-get install chromium")
    alerts = tmp_path / "alerts.json"
    alerts.write_text(json.dumps({"rules": [
        {"type": "threshold", "name": "step-time-budget", "metric": "step_time_max",
         "op": ">", "threshold": 1e-4, "severity": "critical", "cooldown_s": 3600},
    ]}))
    port = find_free_port()
    run = TrainingRun(
        ["--max-steps", "3000", "--monitor-every", "2", "--dashboard-port", str(port),
         "--alerts", str(alerts), "--comm-algorithm", "ring", "--trace", str(tmp_path / "trace.json")],
        tmp_path / "train.log",
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        run.wait_http(url)
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                tempfile.mkdtemp(prefix="torsh-chromium-", dir=tmp_path),
                executable_path=CHROMIUM, headless=True, args=ARGS,
                viewport={"width": 1280, "height": 1100},
            )
            try:
                page = context.new_page()
                external: list[str] = []
                page.on("request", lambda r: None if r.url.startswith(url) else external.append(r.url))
                page.goto(url)
                # Several polls, each with more points: the page updates while training runs.
                page.wait_for_function(
                    "() => Number(document.querySelector('#chart-loss').dataset.points || 0) >= 3",
                    timeout=90_000,
                )
                first = int(page.eval_on_selector("#chart-loss", "c => c.dataset.points"))
                page.wait_for_function(
                    f"() => Number(document.querySelector('#chart-loss').dataset.points) > {first}",
                    timeout=60_000,
                )
                points = {c: int(page.eval_on_selector(f"#chart-{c}", "c => c.dataset.points"))
                          for c in CHARTS}
                assert all(n > 0 for n in points.values()), points
                assert points["ranks"] == 2  # one bar per rank
                assert page.text_content("#status") == "live"
                assert "slowest rank" in page.text_content("#slowest")
                assert "g CO2e" in page.text_content("#energy-note")  # the estimate's carbon, live
                # The active alert is listed and can be acknowledged from the page.
                page.wait_for_selector("#alerts button", timeout=30_000)
                assert "step-time-budget" in page.text_content("#alerts")
                page.click("#alerts button")
                page.wait_for_function(
                    "() => document.querySelector('#alerts').textContent.includes('acknowledged')",
                    timeout=60_000,
                )
                ARTIFACTS.mkdir(exist_ok=True)
                shot = ARTIFACTS / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                assert external == [], f"the page fetched from elsewhere: {external}"
            finally:
                context.close()
    finally:
        run.stop()
