"""Where the cross-rank aggregations go: the :class:`MetricsSink` protocol and :class:`JsonlSink`.

A :class:`~torsh_distributed.monitor.step.StepMonitor` gathers every rank's window into one
:class:`~torsh_distributed.monitor.metrics.Aggregate` every ``monitor.every`` steps. On rank 0 it
then evaluates the alert rules and hands the aggregation to each sink; at the end of the run it
closes them. The Prometheus exporter and the live dashboard are sinks the monitor builds from its
config; users add their own with ``StepMonitor(config, sinks=[...])``::

    class PrintSink:
        def update(self, agg, *, alerts_by_severity, anomalies):
            print(agg.step, agg.flat()["step_time_max"], agg.flat().get("custom.accuracy_mean"))

        def close(self):
            pass
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from torsh_distributed.monitor.anomaly import Anomaly
from torsh_distributed.monitor.metrics import Aggregate

__all__ = ["MetricsSink", "RunTracker", "JsonlSink", "json_safe"]


@runtime_checkable
class MetricsSink(Protocol):
    """Receives each cross-rank aggregation on rank 0, then is closed once.

    The monitor calls :meth:`update` on rank 0 only, in the training thread, right after the
    aggregation's collective and the alert rules: a slow sink slows training (hand heavy work to
    a thread), and an exception from it propagates into the training loop on rank 0 (catch inside
    the sink if it is best-effort). :meth:`close` is called on every rank by ``finish()`` or
    ``close()``: the monitor owns the sinks it is given.
    """

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        """One aggregation.

        Args:
            agg: Every rank's window means (``agg.ranks``) and the statistics across ranks
                (``agg.flat()``: ``step_time_max``, ``loss``, ``custom.<name>_mean``...).
            alerts_by_severity: Active alerts after this aggregation's evaluation, counted per
                severity (``info``, ``warning``, ``critical``; all three keys present).
            anomalies: The anomalies the z-score detector found in this aggregation (often none).
        """
        ...

    def close(self) -> None:
        """Flush and release resources (files, sockets, threads); called once at the end."""
        ...


@runtime_checkable
class RunTracker(MetricsSink, Protocol):
    """A sink that records a whole run (an experiment tracker): started before the first step,
    given the parameters, every step's scalars, the summary and artefacts, then ended.

    The monitor calls every method on rank 0 only, in the training thread: :meth:`start` when
    it is built (so a bad location fails before training), :meth:`log_steps` at each
    aggregation with the steps since the previous one (before :meth:`update`), and
    ``close(failed=True)`` when the run raised. :class:`~torsh_distributed.monitor.tracking.
    TensorBoardSink` and :class:`~torsh_distributed.monitor.tracking.MLflowSink` implement it.
    """

    def start(self) -> None:
        """Open the run (idempotent); raise ``ValueError`` when its location is not usable."""
        ...

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's parameters (nested mappings allowed), once."""
        ...

    def log_steps(self, records: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Scalars of several steps: ``(step, {name: value})``, finite values only."""
        ...

    def log_summary(
        self, summary: Mapping[str, Any], *, step: int, name: str = "summary", artifacts: Sequence[str | Path] = ()
    ) -> None:
        """The run's summary (nested; its numbers become ``<name>/<key>`` at ``step``) and files
        to keep with the run (those that do not exist are skipped)."""
        ...

    def close(self, *, failed: bool = False) -> None:
        """Flush everything and end the run, as failed when ``failed``; idempotent."""
        ...


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that ``json.dumps(..., allow_nan=False)`` accepts: NaN and infinities
    become ``None`` (JSON ``null``), tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


class JsonlSink:
    """Appends one JSON object per aggregation to a file (JSON Lines), for scripts and notebooks.

    Each line is ``{"time": <unix seconds>, "step": <int>, <Aggregate.flat() keys>...,
    "alerts_by_severity": {...}, "anomalies": [...]}`` plus ``"ranks"`` (every rank's row) when
    ``per_rank`` is set. NaN and infinities are written as ``null``. Each line is one ``write``
    followed by a flush, on a file opened in append mode: a reader tailing the file, or a crash,
    sees whole lines (only the very last one can be cut short by a crash mid-write), and a
    resumed run appends to the same file.

    The file is opened at the first update, so the same sink can be passed on every rank (only
    rank 0 writes; the others never create the file).

    Args:
        path: File to append to; its parent directories are created.
        per_rank: Also write every rank's row (``world_size`` times longer lines).
    """

    def __init__(self, path: str | Path, *, per_rank: bool = False) -> None:
        if not str(path):
            raise ValueError("JsonlSink path must be a non-empty file path")
        self.path = Path(path)
        self.per_rank = per_rank
        self._file: IO[str] | None = None

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        """Append the line of this aggregation."""
        record: dict[str, Any] = {"time": time.time(), **agg.flat(), "step": agg.step}
        record["alerts_by_severity"] = dict(alerts_by_severity)
        record["anomalies"] = [a.to_dict() for a in anomalies]
        if self.per_rank:
            record["ranks"] = agg.ranks
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
