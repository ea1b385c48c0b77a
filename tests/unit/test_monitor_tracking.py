"""Experiment tracking in one process: the engine's TensorBoard events read back with
TensorBoard's own reader (every step's loss, the summary, a failed run's steps), an MLflow run in
a SQLite store, and the refusals (settings, missing extra, unusable locations). The MLflow
server is tests/integration/test_mlflow_server.py; rank 0 alone writing is
tests/distributed/test_tracking_ranks.py."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.monitor.config import MonitorConfig
from torsh_distributed.testing import find_free_port

pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
pytest.importorskip("mlflow", reason="the tracking extra is not installed")

STEPS = 7


def _engine(tmp_path: Path, loss_fn: Any = None, **monitor: Any) -> Any:
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.testing import models as M

    config = EngineConfig(
        max_steps=STEPS, batch_size=16, eval_batches=1, eval_every=4, progress=False,
        optim=OptimConfig(lr=1e-2, warmup_steps=0), summary_json=str(tmp_path / "summary.json"),
        monitor=MonitorConfig(every=3, **monitor),
    )
    extra = {"loss_fn": loss_fn} if loss_fn is not None else {}
    return Engine(M.mlp, dataset=M.classification_data(), val_dataset=M.classification_data(seed=1),
                  config=config, **extra)


def _events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc: Any, tag: str) -> str:
    return acc.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()  # add_text's tag


def test_tensorboard_events_hold_every_step_and_the_summary(tmp_path: Path):
    result = _engine(tmp_path, tensorboard=str(tmp_path / "tb"), run_name="mlp").fit()
    acc = _events(tmp_path / "tb" / "mlp")  # --run-name: a subdirectory, one TensorBoard run
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)  # float32 events
    assert [e.step for e in acc.Scalars("train/lr")] == list(range(1, STEPS + 1))
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")][-1] == (STEPS, pytest.approx(result.val_loss))
    assert [e.step for e in acc.Scalars("val/loss")] == [4, STEPS]
    assert [e.step for e in acc.Scalars("monitor/step_time_max")] == [3, 6, STEPS]  # every 3 + the last
    summary = {tag: acc.Scalars(tag)[-1] for tag in acc.Tags()["scalars"] if tag.startswith("summary/")}
    assert summary["summary/final_loss"].value == pytest.approx(result.final_loss, rel=1e-6)
    assert summary["summary/val_loss"].value == pytest.approx(result.val_loss, rel=1e-6)
    assert summary["summary/steps"].value == STEPS and summary["summary/final_loss"].step == STEPS
    assert any(k.startswith("summary/monitor.") for k in summary)  # the report, under the summary
    assert "| optim.lr | 0.01 |" in _text(acc, "params")
    assert '"final_loss"' in _text(acc, "summary")
    assert _text(acc, "status") == "FINISHED"


def _failing_loss(fail_at: int) -> Any:
    import torch.nn.functional as F

    calls = {"n": 0}

    def loss(output: Any, target: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("injected failure")
        return F.cross_entropy(output, target)

    return loss


def test_a_failed_run_keeps_its_steps_and_says_failed(tmp_path: Path):
    engine = _engine(tmp_path, loss_fn=_failing_loss(5), tensorboard=str(tmp_path / "tb"))
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.fit()
    acc = _events(tmp_path / "tb")
    # steps 1-4 done (the aggregation at 3, then step 4 flushed by close), step 5 raised
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert _text(acc, "status") == "FAILED"


def test_mlflow_run_in_a_sqlite_store(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = _engine(tmp_path, mlflow=uri, experiment="unit", run_name="mlp").fit()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert run.info.run_name == "mlp" and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.01" and run.data.params["max_steps"] == str(STEPS)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (i + 1, pytest.approx(v)) for i, v in enumerate(result.losses)
    ]
    assert run.data.metrics["summary/final_loss"] == pytest.approx(result.final_loss)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json"}
    # the artefacts sit beside the database, not in ./mlruns of the directory the run started in
    assert (tmp_path / "mlartifacts").is_dir() and not Path("mlruns").exists()


def test_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"--experiment e\) names an MLflow experiment: give --mlflow"):
        MonitorConfig(experiment="e", tensorboard="tb")
    with pytest.raises(ValueError, match=r"--run-name r\) names a tracked run"):
        MonitorConfig(run_name="r")
    with pytest.raises(ValueError, match="one directory name under --tensorboard"):
        MonitorConfig(tensorboard="tb", run_name="a/b")
    assert MonitorConfig(tensorboard="tb").active and MonitorConfig(mlflow="sqlite:///x.db").active


def test_a_missing_extra_is_named():
    from torsh_distributed.monitor.tracking import check_installed

    with pytest.raises(ValueError) as info:
        check_installed("torsh_no_such_module", "monitor.mlflow (--mlflow)")
    assert str(info.value) == (
        "monitor.mlflow (--mlflow) needs the torsh_no_such_module package, which is not installed: "
        "pip install 'torsh-distributed[tracking]'"
    )


def test_unusable_locations_fail_before_the_first_step(tmp_path: Path):
    from torsh_distributed.monitor.tracking import MLflowSink, TensorBoardSink

    with pytest.raises(ValueError, match=r"MLflow tracking URI 'nosuch://x' is not usable"):
        MLflowSink("nosuch://x").start()
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"'http://127.0.0.1:{(port := find_free_port())}' is not usable"):
        MLflowSink(f"http://127.0.0.1:{port}").start()
    assert time.monotonic() - start < 30  # not MLflow's minutes of retries
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="TensorBoard log_dir .* cannot be created"):
        TensorBoardSink(tmp_path / "file" / "tb").start()
    engine = _engine(tmp_path, mlflow="nosuch://x")
    with pytest.raises(ValueError, match="not usable"):
        engine.fit()
    assert not (tmp_path / "summary.json").exists()


def test_params_are_flat_text_without_passwords():
    from torsh_distributed.monitor.tracking import params_text

    assert params_text({"monitor": {"mlflow": "https://bob:s3cret@mlflow.example:5000"}, "optim": {"lr": 0.01},
                        "layout": [1, 2], "shuffle": True}) == {
        "monitor.mlflow": "https://bob:***@mlflow.example:5000", "optim.lr": "0.01", "layout": "[1, 2]",
        "shuffle": "true",
    }


def test_mlflow_fails_fast_only_where_the_user_set_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torsh_distributed.monitor import tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "99")  # the user's own: kept
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    with tracking._fail_fast():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"
