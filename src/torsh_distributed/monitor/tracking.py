"""Experiment tracking: a run's parameters, per-step metrics, summary and artefacts in
TensorBoard event files and MLflow runs.

Two :class:`~torsh_distributed.monitor.sinks.RunTracker` s (``MetricsSink`` s that also record
the run around the aggregations):

* :class:`TensorBoardSink` writes event files with torch's ``SummaryWriter``;
* :class:`MLflowSink` logs one MLflow run through ``mlflow.tracking.MlflowClient`` (any
  tracking URI: an ``http(s)://`` server, ``sqlite:///runs.db``, ``databricks``...).

What they record, under the same names in both:

* ``train/loss``, ``train/lr``, ``train/grad_norm`` at every step: the loss rank 0 handed the
  monitor (the engine's is the job's mean), the learning rate, the gradient norm;
* ``val/loss`` at each of the engine's evaluations;
* ``monitor/<key>`` every ``monitor.every`` steps: :meth:`Aggregate.flat` (step time, phases,
  throughput, memory, imbalance, custom metrics...) and the active alerts;
* ``summary/<key>`` at the last step: the numbers of the run's summary, nested keys dotted
  (``summary/energy.joules``);

plus the parameters (MLflow params; a TensorBoard text table), the whole summary as
``summary.json`` (an MLflow artefact; TensorBoard text) and files named by the caller (the
loss-curve plot, the report JSON, the merged trace) as MLflow artefacts. Non-finite values are
left out (NaN gradient norm with clipping off).

The libraries are imported when a sink starts, never by this module: ``torsh-dist --help`` and
configs stay light. Both are the ``tracking`` extra (``pip install
'torsh-distributed[tracking]'``).

Only rank 0 records: the :class:`~torsh_distributed.monitor.step.StepMonitor` starts and feeds
its trackers on rank 0 alone, so the same sink object can be given to every rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torsh_distributed._checks import check_writable_dir
from torsh_distributed.runtime.env import environ_set

if TYPE_CHECKING:
    from torsh_distributed.monitor.anomaly import Anomaly
    from torsh_distributed.monitor.config import MonitorConfig
    from torsh_distributed.monitor.metrics import Aggregate

__all__ = [
    "EXTRA",
    "MLflowSink",
    "TensorBoardSink",
    "build_trackers",
    "check_installed",
    "check_tracking",
    "flatten",
    "params_text",
    "scalars",
]

EXTRA = "pip install 'torsh-distributed[tracking]'"
"""How to install what the trackers need."""

_MLFLOW_BATCH = 1000  # metrics per log_batch request (the REST API's limit)
_MLFLOW_PARAMS = 100  # params per log_batch request
_MLFLOW_PARAM_CHARS = 6000  # longest param value MLflow stores
_BAD_KEY = re.compile(r"[^\w\-./: ]")  # what MLflow's name check refuses
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):[^/@\s]*@")


def check_installed(module: str, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the extra when ``module`` cannot be imported
    (found without importing it: a config check costs nothing)."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs the {module} package, which is not installed: {EXTRA}")


def flatten(data: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``); other
    values, lists included, are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{name}."))
        else:
            out[name] = value
    return out


def _redacted(value: Any) -> Any:
    """``value`` with the password of any ``scheme://user:password@host`` URI in it replaced:
    parameters are readable by everyone who can read the run."""
    return _USERINFO.sub(r"\1:***@", value) if isinstance(value, str) else value


def params_text(params: Mapping[str, Any]) -> dict[str, str]:
    """``params`` flattened, each value as text (strings as they are, others as JSON),
    credentials in URIs redacted."""
    return {
        key: _redacted(value if isinstance(value, str) else json.dumps(value, default=str))
        for key, value in flatten(params).items()
    }


def scalars(data: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``data`` (flattened), as floats; booleans, strings, lists and
    NaN/infinities are left out."""
    out: dict[str, float] = {}
    for key, value in flatten(data).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def _json_text(data: Mapping[str, Any]) -> str:
    from torsh_distributed.monitor.sinks import json_safe

    return json.dumps(json_safe(dict(data)), indent=2, sort_keys=True, default=str)


class TensorBoardSink:
    """Writes the run as TensorBoard event files (``tensorboard --logdir DIR``).

    Scalars per step and per aggregation, the summary's numbers as ``summary/<key>`` scalars at
    the last step, the parameters and the summary as text (TensorBoard's Text tab). The writer
    flushes after every aggregation and summary, so a killed job loses at most the steps since
    the last aggregation; :meth:`close` flushes the rest.

    Args:
        log_dir: Directory of the event files (created); TensorBoard shows each directory under
            its ``--logdir`` as a run, so give each run its own (``runs/tb/<name>``).
    """

    def __init__(self, log_dir: str | Path) -> None:
        if not str(log_dir):
            raise ValueError("TensorBoardSink log_dir must be a non-empty directory path")
        check_installed("tensorboard", "TensorBoardSink")
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._closed = False

    def start(self) -> None:
        """Open the event file (rank 0, when the monitor starts); idempotent.

        Raises:
            ValueError: the directory cannot be created or written.
        """
        if self._writer is not None:
            return
        check_writable_dir(self.log_dir, "TensorBoard log_dir")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def _scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            self.start()
        if not values:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event holding every value of the step: add_scalar's event per value cost ~0.25 ms
        # each on a loaded 2-core host (~90 values per aggregation). The same call add_scalar
        # ends in; readers see the same scalars.
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer._get_file_writer().add_summary(summary, step, time.time())  # noqa: SLF001

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The parameters as one markdown table (TensorBoard's Text tab, tag ``params``;
        passwords in URIs redacted)."""
        if self._writer is None:
            self.start()
        rows = "\n".join(f"| {k} | {v} |" for k, v in params_text(params).items())
        self._writer.add_text("params", f"| parameter | value |\n|---|---|\n{rows}", global_step=0)
        self._writer.flush()

    def log_steps(self, records: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Scalars of several steps (``(step, {name: value})``)."""
        for step, values in records:
            self._scalars(values, step)

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        """One aggregation as ``monitor/<key>`` scalars, then a flush."""
        flat = {f"monitor/{k}": v for k, v in scalars(agg.flat()).items() if k != "step"}
        flat.update({f"monitor/alerts_{k}": float(n) for k, n in alerts_by_severity.items()})
        flat["monitor/anomalies"] = float(len(anomalies))
        self._scalars(flat, agg.step)
        self._writer.flush()

    def log_summary(
        self, summary: Mapping[str, Any], *, step: int, name: str = "summary", artifacts: Sequence[str | Path] = ()
    ) -> None:
        """The summary's numbers as ``<name>/<key>`` scalars at ``step`` and the whole of it as
        text; ``artifacts`` are named in that text (TensorBoard stores no files)."""
        self._scalars({f"{name}/{k}": v for k, v in scalars(summary).items()}, step)
        text = f"```json\n{_json_text(summary)}\n```"
        files = [str(p) for p in artifacts if Path(p).is_file()]
        if files:
            text += "\n\nfiles: " + ", ".join(f"`{f}`" for f in files)
        self._writer.add_text(name, text, global_step=step)
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        """Record the status (``FAILED`` when the run raised), flush and close (idempotent)."""
        if self._writer is None or self._closed:
            return
        self._closed = True
        self._writer.add_text("status", "FAILED" if failed else "FINISHED")
        self._writer.close()  # flushes what is queued


class MLflowSink:
    """Logs the run as one MLflow run: params, per-step metrics, summary, artefacts.

    The run is created by :meth:`start` (rank 0, when the monitor starts, so an unreachable
    server or an unknown URI scheme fails before the first step, within seconds) and ended by
    :meth:`close` as ``FINISHED``, or ``FAILED`` when training raised. Metrics go out
    asynchronously (MLflow's own logging thread), the batches of at most two aggregation windows
    in flight: training does not wait on the network, an error of a batch surfaces one
    aggregation later, and :meth:`close` waits for all of them. Params and artefacts are logged
    synchronously. Characters MLflow refuses in a metric name (it takes letters, digits and
    ``_ - . / :`` and spaces) become ``_``.

    Args:
        tracking_uri: Where the run goes: ``http://host:5000`` (an ``mlflow server``),
            ``sqlite:///path.db``, ``databricks``, ...
        experiment: Experiment name, created when missing; empty = MLflow's default
            experiment.
        run_name: The run's name; empty = one MLflow makes up.
        tags: Tags of the run (strings).
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str = "",
        run_name: str = "",
        tags: Mapping[str, str] | None = None,
    ) -> None:
        if not tracking_uri.strip():
            raise ValueError("MLflowSink tracking_uri must be non-empty (http://host:port, sqlite:///file.db, ...)")
        check_installed("mlflow", "MLflowSink")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None
        self._inflight: list[Any] = []  # RunOperations since the last aggregation
        self._previous: list[Any] = []  # those of the aggregation before
        self._ended = False

    def start(self) -> None:
        """Create the run (idempotent).

        Raises:
            ValueError: the tracking URI is not usable (unknown scheme, server unreachable, a
                deleted experiment of that name), with MLflow's reason.
        """
        if self.run_id is not None:
            return
        self._client, experiment_id = open_mlflow(self.tracking_uri, self.experiment)
        with _fail_fast():
            run = self._client.create_run(
                experiment_id, run_name=self.run_name or None, tags={"torsh.source": "torsh-distributed", **self.tags}
            )
        self.run_id = run.info.run_id

    def _log(self, metrics: Sequence[Any]) -> None:
        if self.run_id is None:
            self.start()
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            op = self._client.log_batch(self.run_id, metrics=list(metrics[i : i + _MLFLOW_BATCH]), synchronous=False)
            if op is not None:
                self._inflight.append(op)

    def _wait(self, *, all_: bool = True) -> None:
        """Wait for the previous aggregation's batches (all batches with ``all_``); raises a
        batch's error."""
        ops, self._previous = self._previous, []
        if all_:
            ops, self._inflight = ops + self._inflight, []
        for op in ops:
            op.wait()

    @staticmethod
    def _metrics(records: Sequence[tuple[int, Mapping[str, float]]]) -> list[Any]:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        return [
            Metric(_BAD_KEY.sub("_", key), value, now, step) for step, values in records for key, value in values.items()
        ]

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The parameters (flattened, values as text cut at MLflow's 6000 characters, passwords
        in URIs redacted)."""
        if self.run_id is None:
            self.start()
        from mlflow.entities import Param

        items = [Param(_BAD_KEY.sub("_", k), v[:_MLFLOW_PARAM_CHARS]) for k, v in params_text(params).items()]
        for i in range(0, len(items), _MLFLOW_PARAMS):
            self._client.log_batch(self.run_id, params=items[i : i + _MLFLOW_PARAMS])

    def log_steps(self, records: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Metrics of several steps (``(step, {name: value})``)."""
        if records:
            self._log(self._metrics(records))

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        """One aggregation as ``monitor/<key>`` metrics at its step."""
        flat = {f"monitor/{k}": v for k, v in scalars(agg.flat()).items() if k != "step"}
        flat.update({f"monitor/alerts_{k}": float(n) for k, n in alerts_by_severity.items()})
        flat["monitor/anomalies"] = float(len(anomalies))
        self._wait(all_=False)  # sent a window ago: normally done, so this does not block
        self._log(self._metrics([(agg.step, flat)]))
        self._previous, self._inflight = self._inflight, []

    def log_summary(
        self, summary: Mapping[str, Any], *, step: int, name: str = "summary", artifacts: Sequence[str | Path] = ()
    ) -> None:
        """The summary's numbers as ``<name>/<key>`` metrics at ``step``, the whole of it as the
        artefact ``<name>.json``, and each existing file of ``artifacts``."""
        self._log(self._metrics([(step, {f"{name}/{k}": v for k, v in scalars(summary).items()})]))
        self._wait()
        with tempfile.TemporaryDirectory(prefix="torsh-mlflow-") as tmp:
            path = Path(tmp) / f"{name}.json"
            path.write_text(_json_text(summary) + "\n")
            self._client.log_artifact(self.run_id, str(path))
        for file in artifacts:
            if Path(file).is_file():
                self._client.log_artifact(self.run_id, str(file))

    def close(self, *, failed: bool = False) -> None:
        """Wait for the metrics in flight, then end the run (idempotent)."""
        if self.run_id is None or self._ended:
            return
        self._ended = True
        try:
            self._wait()
        finally:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


@contextlib.contextmanager
def _fail_fast() -> Iterator[None]:
    """MLflow retries an unreachable server for minutes (7 tries, exponential back-off); a run
    being set up should fail in seconds. Settings the user exported are kept."""
    fast = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
    with environ_set({name: value for name, value in fast.items() if name not in os.environ}):
        yield


def open_mlflow(tracking_uri: str, experiment: str) -> tuple[Any, str]:
    """An ``MlflowClient`` of ``tracking_uri`` and the id of ``experiment`` (created when
    missing; ``""``: the default experiment), failing fast.

    Raises:
        ValueError: the URI, the server or the experiment is not usable, with MLflow's reason.
    """
    from mlflow.tracking import MlflowClient

    try:
        with _fail_fast():
            client = MlflowClient(tracking_uri=tracking_uri)
            if not experiment:
                return client, client.get_experiment_by_name("Default").experiment_id
            found = client.get_experiment_by_name(experiment)
            if found is None:
                return client, client.create_experiment(experiment, artifact_location=_artifact_root(tracking_uri))
            if found.lifecycle_stage != "active":
                raise ValueError(
                    f"MLflow experiment {experiment!r} is deleted at {tracking_uri}: restore it or "
                    "pick another name"
                )
            return client, found.experiment_id
    except ValueError:
        raise
    except Exception as exc:  # MlflowException, requests' ConnectionError, an unknown scheme...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"MLflow tracking URI {tracking_uri!r} is not usable: {reason}") from exc


def _artifact_root(tracking_uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artefacts: ``mlartifacts/`` beside the
    database (MLflow's default is ``./mlruns`` of whatever directory the run started in);
    ``None``: the store's own default (a server decides for itself)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return (Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts").as_uri()


def tensorboard_dir(config: MonitorConfig) -> Path:
    """Where ``config``'s TensorBoard events go: ``tensorboard/run_name`` or ``tensorboard``."""
    base = Path(config.tensorboard)
    return base / config.run_name if config.run_name else base


def check_tracking(config: MonitorConfig) -> None:
    """Check the tracking targets of ``config`` the way rank 0 will open them (the directory is
    created, the MLflow store is contacted and the experiment resolved), so that
    ``torsh-dist train`` refuses a bad one before any rank starts.

    Raises:
        ValueError: an unwritable directory or an unusable tracking URI.
    """
    precheck_tracking(config)
    if config.mlflow:
        try:
            open_mlflow(config.mlflow, config.experiment)
        except ValueError as exc:
            raise ValueError(f"--mlflow: {exc}") from None


def precheck_tracking(config: MonitorConfig) -> None:
    """The checks of :func:`check_tracking` that import nothing and start no thread: the
    TensorBoard directory is writable, an ``http(s)`` MLflow server accepts a connection.
    ``torsh-dist train`` runs them before it imports torch, :func:`check_tracking` after (MLflow's
    client starts threads, and the command forks its workers' forkserver from a process without).

    Raises:
        ValueError: an unwritable directory or an unreachable tracking server.
    """
    if config.tensorboard:
        check_writable_dir(tensorboard_dir(config), "--tensorboard")
    if config.mlflow:
        try:
            _connectable(config.mlflow)
        except ValueError as exc:
            raise ValueError(f"--mlflow: {exc}") from None


def _connectable(tracking_uri: str) -> None:
    """For an ``http(s)://`` tracking URI: a TCP connection to its host and port opens within
    5 s (``ValueError`` with the reason otherwise). MLflow itself takes seconds to import and
    retries a refused connection with back-off; this answers a mistyped port at once."""
    from urllib.parse import urlsplit

    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    import socket

    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port that is not a number
        raise ValueError(f"MLflow tracking URI {tracking_uri!r} is not usable: {exc}") from None
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as exc:
        raise ValueError(
            f"MLflow tracking URI {tracking_uri!r} is not usable: cannot connect to "
            f"{parts.hostname}:{port}: {exc.strerror or exc}"
        ) from None


def build_trackers(config: MonitorConfig) -> list[TensorBoardSink | MLflowSink]:
    """The trackers ``config`` asks for (not started)."""
    trackers: list[TensorBoardSink | MLflowSink] = []
    if config.tensorboard:
        trackers.append(TensorBoardSink(tensorboard_dir(config)))
    if config.mlflow:
        trackers.append(MLflowSink(config.mlflow, experiment=config.experiment, run_name=config.run_name))
    return trackers
