"""Per-round and per-client metrics of a federated run: Prometheus gauges and the live dashboard.

The ServerApp (on the SuperLink's host) calls :meth:`RoundMonitor.round` after every round. With
``monitor_port`` it serves Prometheus's exposition on 127.0.0.1 (the ``torsh_federated_*`` gauges
below, labelled ``job`` and, per client, ``client``); with ``dashboard_port`` the toolkit's
dashboard (:class:`~torsh_distributed.monitor.server.DashboardServer`) shows loss per round, bytes
per round, round time and each client's training time. Both bind loopback: they have no
authentication.
"""

from __future__ import annotations

import math
import time
from typing import Any

__all__ = ["RoundMonitor"]


class RoundMonitor:
    """Publishes each round's record (see :class:`~torsh_distributed.federated.server.RoundLoop`).

    Args:
        job: The ``job`` label and the dashboard's title.
        rounds: Rounds of the run (the dashboard's progress).
        clients: Clients of the run.
        metrics_port: Serve Prometheus metrics on 127.0.0.1:PORT (0 = off).
        dashboard_port: Serve the dashboard on 127.0.0.1:PORT (0 = off).
    """

    def __init__(self, *, job: str, rounds: int, clients: int, metrics_port: int = 0, dashboard_port: int = 0) -> None:
        self.job, self.rounds, self.clients = job, rounds, clients
        self.registry: Any = None
        self._prom: Any = None
        self._dashboard: Any = None
        self._history: dict[str, list[float]] = {}
        if metrics_port:
            self._start_prometheus(metrics_port)
        if dashboard_port:
            from torsh_distributed.monitor.server import DashboardServer

            self._dashboard = DashboardServer(host="127.0.0.1", port=dashboard_port)

    def _start_prometheus(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        r = self.registry = CollectorRegistry()
        job = ["job"]
        client = ["job", "client"]
        self.g = {
            "round": Gauge("torsh_federated_round", "Last completed round.", job, registry=r),
            "loss": Gauge("torsh_federated_loss", "Loss of the global model after the round.", job, registry=r),
            "accuracy": Gauge("torsh_federated_accuracy", "Accuracy of the global model (when measured).", job, registry=r),
            "answered": Gauge("torsh_federated_clients_answered", "Clients whose update arrived by the deadline.", job, registry=r),
            "dropped": Gauge("torsh_federated_clients_dropped", "Sampled clients without an update.", job, registry=r),
            "bytes": Gauge("torsh_federated_bytes", "Bytes of the round's model and updates.", ["job", "direction"], registry=r),
            "seconds": Gauge("torsh_federated_round_seconds", "Wall time of the round.", job, registry=r),
            "epsilon": Gauge("torsh_federated_epsilon", "Differential privacy spent so far.", job, registry=r),
            "client_loss": Gauge("torsh_federated_client_loss", "Client's mean training loss in the round.", client, registry=r),
            "client_seconds": Gauge("torsh_federated_client_seconds", "Client's local training time.", client, registry=r),
            "client_examples": Gauge("torsh_federated_client_examples", "Client's sample count.", client, registry=r),
            "client_bytes": Gauge("torsh_federated_client_bytes", "Bytes of the client's update.", client, registry=r),
        }
        try:
            self._prom, _ = start_http_server(port, addr="127.0.0.1", registry=r)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve federated metrics on 127.0.0.1:{port} ({exc.strerror})") from exc

    def round(self, record: dict[str, Any]) -> None:
        """Publish one round's record."""
        if self.registry is not None:
            g, job = self.g, self.job
            g["round"].labels(job).set(record["round"])
            if math.isfinite(record["loss"]):
                g["loss"].labels(job).set(record["loss"])
            if "accuracy" in record:
                g["accuracy"].labels(job).set(record["accuracy"])
            g["answered"].labels(job).set(record["answered"])
            g["dropped"].labels(job).set(record["dropped"])
            for direction in ("down", "up"):
                g["bytes"].labels(job, direction).set(record["bytes"][direction])
            g["seconds"].labels(job).set(record["seconds"])
            if "epsilon" in record:
                g["epsilon"].labels(job).set(record["epsilon"])
            for c in record["clients"]:
                labels = (job, str(c["partition_id"]))
                g["client_loss"].labels(*labels).set(c["loss"])
                g["client_seconds"].labels(*labels).set(c["seconds"])
                g["client_examples"].labels(*labels).set(c["examples"])
                g["client_bytes"].labels(*labels).set(c["bytes"])
        if self._dashboard is not None:
            self._publish(record, done=record["round"] >= self.rounds)

    def text(self) -> str:
        """The Prometheus exposition text (empty without ``metrics_port``)."""
        if self.registry is None:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def _publish(self, record: dict[str, Any], *, done: bool) -> None:
        point = {
            "step": record["round"],
            "loss": record["loss"],
            "tokens_per_s": record["bytes"]["total"] / 1e6,  # shown as "MB per round"
            "step_time": record["seconds"],
        }
        for key, value in point.items():
            self._history.setdefault(key, []).append(value)
        clients = sorted(record["clients"], key=lambda c: c["seconds"])
        state = {
            "job": self.job,
            "world_size": self.clients,
            "max_steps": self.rounds,
            "step": record["round"],
            "done": done,
            "updated": time.time(),
            "unit": "round",
            "rank_label": "client",
            "throughput_label": "MB per round",
            "ranks": [{"rank": c["partition_id"], "busy": c["seconds"], "step_time": c["seconds"]} for c in record["clients"]],
            "slowest_rank": clients[-1]["partition_id"] if clients else None,
            "imbalance": (clients[-1]["seconds"] / clients[len(clients) // 2]["seconds"]) if clients and clients[len(clients) // 2]["seconds"] else None,
            "alerts": [],
            "alert_stats": {},
            "anomalies": [],
            "history": {k: [v if math.isfinite(v) else None for v in vs] for k, vs in self._history.items()},
        }
        self._dashboard.publish(state)

    @property
    def dashboard_url(self) -> str:
        return self._dashboard.url if self._dashboard is not None else ""

    def close(self) -> None:
        if self._prom is not None:
            self._prom.shutdown()
            self._prom = None
        if self._dashboard is not None:
            self._dashboard.close()
            self._dashboard = None
