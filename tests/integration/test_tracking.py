"""Experiment tracking end to end: a real ``mlflow server`` (SQLite store and artefacts in
tmp_path, loopback, a free port) receiving a ``torsh-dist train`` run; a 2-rank run where rank 0
alone writes; an unreachable server refused before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from torsh_distributed.monitor.sinks import json_safe
from torsh_distributed.testing import find_free_port
from torsh_distributed.testing.cli import run_cli

pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
pytest.importorskip("mlflow", reason="the tracking extra is not installed")

TINY = ["--preset", "tiny", "--data.max-bytes", "200000", "--batch-size", "8", "--eval-batches", "1",
        "--progress", "false", "--monitor-every", "2"]
STEPS = 6


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = run_cli(["train", *TINY, *args], timeout=timeout)  # a warm process
    return proc


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class _Server:
    """``mlflow server`` on 127.0.0.1 (SQLite backend, served artefacts, both in a temporary
    directory), started as soon as this module's first test runs: its start-up (imports, the
    store's migrations, a uvicorn worker: 15-20 s quiet, over a minute on a loaded 2-core host)
    overlaps the other tests, and the server test, last in the file, waits for ``/health``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"http://127.0.0.1:{find_free_port()}"
        self.log = (root / "mlflow-server.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait(self, deadline_s: float) -> str:
        deadline = time.monotonic() + deadline_s
        while not _healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                pytest.fail(f"mlflow server did not come up: {(self.root / 'mlflow-server.log').read_text()[-2000:]}")
            time.sleep(0.3)
        return self.url

    def stop(self) -> None:
        self.proc.terminate()  # uvicorn's parent stops its worker on SIGTERM
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module", autouse=True)
def _server_starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    server = _Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mlflow_server(_server_starting: _Server) -> str:
    """The server's URL once ``/health`` answers (deadline: 4 minutes, for a loaded host)."""
    return _server_starting.wait(240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_only_rank0_writes(tmp_path: Path):
    # TensorBoard only: the gate is the monitor's (trackers are built and started on rank 0 alone,
    # whatever their kind), and MLflow's imports and store set-up would double this test's time.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = _train("--nproc-per-node", "2", "--max-steps", "4", "--tensorboard", str(tmp_path / "tb"),
                  "--summary-json", str(tmp_path / "summary.json"), timeout=270)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one writer: rank 1 opened nothing
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]  # once per step, not per rank
    assert acc.Scalars("summary/world_size")[-1].value == 2
    assert acc.Scalars("summary/final_loss")[-1].value == pytest.approx(
        json.loads((tmp_path / "summary.json").read_text())["final_loss"], rel=1e-6)


@pytest.mark.timeout(120)
def test_unreachable_mlflow_is_refused_before_any_rank_starts(tmp_path: Path):
    port = find_free_port()
    start = time.monotonic()
    proc = _train("--nproc-per-node", "2", "--mlflow", f"http://127.0.0.1:{port}", timeout=100)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"torsh-dist train: error: --mlflow: MLflow tracking URI 'http://127.0.0.1:{port}' "
                           "is not usable: "), last
    assert "[rank" not in proc.stdout + proc.stderr and time.monotonic() - start < 90


@pytest.mark.timeout(500)
def test_mlflow_server_receives_params_steps_summary_and_artefacts(tmp_path: Path, mlflow_server: str):
    from mlflow.tracking import MlflowClient

    summary_path = tmp_path / "summary.json"
    proc = _train("--max-steps", str(STEPS), "--mlflow", mlflow_server, "--experiment", "torsh-it",
                  "--run-name", "tiny", "--summary-json", str(summary_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("torsh-it")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.n_layer"] == "2" and params["batch_size"] == "8" and params["run.world_size"] == "1"
    assert params["monitor.mlflow"] == mlflow_server
    loss = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == list(range(1, STEPS + 1))
    assert loss[0].value == pytest.approx(summary["initial_loss"])
    assert sum(m.value for m in loss) / STEPS == pytest.approx(summary["final_loss"])  # mean of the last <=10
    assert [m.step for m in client.get_metric_history(run.info.run_id, "monitor/step_time_max")] == [2, 4, 6]
    metrics = run.data.metrics
    assert metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert metrics["summary/val_loss"] == pytest.approx(summary["val_loss"])
    assert metrics["val/loss"] == pytest.approx(summary["val_loss"])
    artefacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artefacts == {"summary.json"}, artefacts
    local = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text()) == json_safe(summary)  # --summary-json's content, NaN as null
