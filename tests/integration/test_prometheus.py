"""A real Prometheus server (Debian package, loopback) scrapes a 2-rank training run."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from _monitor_run import TrainingRun

from torsh_distributed.testing import find_free_port

pytest.importorskip("prometheus_client", reason="the monitor extra (prometheus_client) is not installed")
JOB = "torsh-it"


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _start_prometheus(tmp_path: Path, target_port: int) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed: run `make test` as root (installs it) or "
                    "apt-get install prometheus")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: torsh\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = find_free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    return proc, port


@pytest.mark.slow
def test_prometheus_scrapes_step_time_of_both_ranks(tmp_path: Path):
    metrics_port = find_free_port()
    # Prometheus starts first and scrapes the target once it is up: both start-ups overlap.
    prometheus, prom_port = _start_prometheus(tmp_path, metrics_port)
    run = TrainingRun(
        ["--max-steps", "3000", "--monitor-every", "2", "--metrics-port", str(metrics_port),
         "--metrics-job", JOB],
        tmp_path / "train.log", slow_rank="1:0.03",
    )
    try:
        run.wait_http(f"http://127.0.0.1:{metrics_port}/metrics")
        deadline = time.monotonic() + 90
        ranks: dict[str, float] = {}
        scrapes = 0
        # The slowest rank is judged per monitor window (2 steps): a window in which the host
        # descheduled rank 0 for longer than rank 1's 60 ms of sleep names rank 0, so the test
        # reads the gauge over several scrapes, not one.
        slowest_rank = f'torsh_slowest_rank{{job="{JOB}"}}'
        while time.monotonic() < deadline:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                result = _query(prom_port, f'torsh_step_time_seconds{{job="{JOB}"}}')
                counted = _query(prom_port, f"count_over_time({slowest_rank}[1m])")
            except OSError:
                result, counted = [], []  # Prometheus still starting
            ranks = {r["metric"]["rank"]: float(r["value"][1]) for r in result}
            scrapes = int(float(counted[0]["value"][1])) if counted else 0
            if set(ranks) == {"0", "1"} and scrapes >= 7:
                break
            time.sleep(1)
        assert set(ranks) == {"0", "1"}, f"step-time series seen: {ranks}\n{run.output()}"
        assert all(v > 0 for v in ranks.values())
        assert scrapes >= 7, f"{scrapes} scrapes of the slowest rank in 90 s"
        share = float(_query(prom_port, f"avg_over_time({slowest_rank}[1m])")[0]["value"][1])
        assert share > 0.5, f"the slowed rank 1 is the slowest in only {share:.0%} of {scrapes} scrapes"
        phases = _query(prom_port, f'torsh_step_phase_seconds{{job="{JOB}",rank="1",phase="data"}}')
        assert phases and float(phases[0]["value"][1]) > 0.02  # rank 1 sleeps 30 ms there
        assert _query(prom_port, 'up{job="torsh"}')[0]["value"][1] == "1"
        # The progress bar (a line every 2 s in a log file) names the slowest rank too.
        deadline = time.monotonic() + 30
        while "slowest=r1" not in run.output() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        run.stop()
        prometheus.terminate()
        try:
            prometheus.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
    assert "slowest=r1" in run.output(), "the progress bar shows the slowest rank"
