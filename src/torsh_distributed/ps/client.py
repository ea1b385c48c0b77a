"""The worker's side: ``push(keys, grads)`` and ``pull(keys) -> (values, versions)``.

A key is a dense parameter's name (``str``) or :class:`Rows` (some rows of an embedding table).
Every push goes to every server (an empty one where the worker has nothing for it) because a
push is also the worker's clock tick: push number c ends the worker's step c.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.ps import _shard, _transport, server
from torsh_distributed.ps._snapshot import write_json
from torsh_distributed.ps.config import PSConfig

__all__ = ["Rows", "PullResult", "PSClient", "percentile"]


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows ``ids`` (global row ids, int64) of the sparse table ``table``."""

    table: str
    ids: torch.Tensor


Key = str | Rows


@dataclass(slots=True)
class PullResult:
    """Values and versions in the order of the keys pulled: a dense key's version is an ``int``
    (updates applied to it), a :class:`Rows` key's a tensor of per-row versions."""

    values: list[torch.Tensor]
    versions: list[int | torch.Tensor]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


class PSClient:
    """One worker's connection to the servers (the RPC group must already be joined).

    Args:
        worker: This worker's index (``0 .. num_workers-1``).
        num_workers: Workers in the job (the default push weight is ``1 / num_workers``).
        config: The job's :class:`PSConfig`.
        tables: Specs of the sparse tables (to route rows).
        clip_norm: Clip each push by its global L2 norm (0 = off); see ``ServerOptimConfig``.
    """

    def __init__(self, worker: int, *, num_workers: int, config: PSConfig,
                 tables: dict[str, _shard.TableSpec] | None = None, clip_norm: float = 0.0) -> None:
        self.worker = worker
        self.num_workers = num_workers
        self.config = config
        self.tables = dict(tables or {})
        self.clip_norm = clip_norm
        self.clock = 0
        self.push_s: list[float] = []
        self.pull_s: list[float] = []
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.rows_pushed = 0
        self.rows_pulled = 0
        self._servers = [_transport.server_name(k) for k in range(config.num_servers)]
        self._progress = (Path(config.snapshot_dir) / f"worker-{worker}.json") if config.snapshot_dir else None

    def _call_all(self, fn: Any, per_server: list[tuple[Any, ...]]) -> list[Any]:
        futures = [
            _transport.call_async(name, fn, self.config.token, *args, timeout=self.config.timeout_s)
            for name, args in zip(self._servers, per_server, strict=True)
        ]
        return [f.wait() for f in futures]

    def register(self, dense: dict[str, torch.Tensor], tables: dict[str, torch.Tensor]) -> None:
        """Install initial values on the servers (one worker does it; servers restored from a
        snapshot keep theirs). ``tables`` are whole tables, split by row here."""
        n = self.config.num_servers
        per: list[tuple[Any, ...]] = []
        for k in range(n):
            mine = {key: t.detach() for key, t in dense.items() if _shard.server_of_key(key, n) == k}
            rows = {name: (self.tables[name], t.detach()[_shard.global_rows(self.tables[name], k, n)])
                    for name, t in tables.items()}
            per.append((mine, rows))
        self._call_all(server.rpc_register, per)

    def resume(self) -> int:
        """Tell the servers how far this worker got before a restart (its progress file) and
        continue from the earliest clock any of them kept. Returns that clock (0 on a fresh run)."""
        acked = 0
        if self._progress is not None and self._progress.is_file():
            import json

            acked = int(json.loads(self._progress.read_text())["clock"])
        clocks = self._call_all(server.rpc_resume, [(self.worker, acked)] * len(self._servers))
        self.clock = min(clocks)
        return self.clock

    def pull(self, keys: Sequence[Key], *, final: bool = False) -> PullResult:
        """Values and versions of ``keys``; waits as the consistency mode requires (``final``:
        a read after training that neither waits nor counts as a pull)."""
        n = self.config.num_servers
        dense_of: list[list[str]] = [[] for _ in range(n)]
        rows_of: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for key in keys:
            if isinstance(key, str):
                dense_of[_shard.server_of_key(key, n)].append(key)
            else:
                for k, pos in enumerate(_shard.split_rows(key.ids, self.tables[key.table], n)):
                    if pos.numel():
                        rows_of[k][key.table] = key.ids[pos]
        clock = -1 if final else self.clock
        start = time.perf_counter()
        replies = self._call_all(server.rpc_pull, [(self.worker, clock, dense_of[k], rows_of[k]) for k in range(n)])
        if not final:
            self.pull_s.append(time.perf_counter() - start)
        values: list[torch.Tensor] = []
        versions: list[int | torch.Tensor] = []
        for key in keys:
            if isinstance(key, str):
                vals, _, vers, _ = replies[_shard.server_of_key(key, n)]
                values.append(vals[key])
                versions.append(vers[key])
            else:
                spec = self.tables[key.table]
                out = torch.empty(key.ids.numel(), spec.dim)
                ver = torch.zeros(key.ids.numel(), dtype=torch.int64)
                for k, pos in enumerate(_shard.split_rows(key.ids, spec, n)):
                    if pos.numel():
                        _, rvals, _, rvers = replies[k]
                        out = out.to(rvals[key.table].dtype)
                        out[pos] = rvals[key.table]
                        ver[pos] = rvers[key.table]
                values.append(out)
                versions.append(ver)
        if not final:
            self.bytes_pulled += sum(v.numel() * v.element_size() for v in values)
            self.rows_pulled += sum(int(k.ids.numel()) for k in keys if isinstance(k, Rows))
        return PullResult(values, versions)

    def push(self, keys: Sequence[Key], grads: Sequence[torch.Tensor], *, weight: float | None = None) -> None:
        """Send this step's gradients (``grads[i]`` for ``keys[i]``; a :class:`Rows` gradient is
        ``[len(ids), dim]``, duplicates summed) and advance the clock. ``weight`` (default
        ``1 / num_workers``) is this worker's share of the step: the weights of one clock should
        sum to 1 (e.g. its fraction of the global batch)."""
        if len(keys) != len(grads):
            raise ValueError(f"push: {len(keys)} keys but {len(grads)} gradients")
        scale = 1.0 / self.num_workers if weight is None else weight
        if self.clip_norm:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach(), 2.0) for g in grads]), 2.0
            )
            scale *= float(torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0))
        n = self.config.num_servers
        dense_of: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        rows_of: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(n)]
        sent = 0
        for key, grad in zip(keys, grads, strict=True):
            grad = grad.detach()
            if isinstance(key, str):
                dense_of[_shard.server_of_key(key, n)][key] = grad
                sent += grad.numel() * grad.element_size()
                continue
            ids, inverse = torch.unique(key.ids, return_inverse=True)
            summed = torch.zeros(len(ids), grad.shape[1], dtype=grad.dtype).index_add_(0, inverse, grad)
            self.rows_pushed += int(ids.numel())
            sent += ids.numel() * ids.element_size() + summed.numel() * summed.element_size()
            for k, pos in enumerate(_shard.split_rows(ids, self.tables[key.table], n)):
                if pos.numel():
                    rows_of[k][key.table] = (ids[pos], summed[pos])
        start = time.perf_counter()
        self._call_all(server.rpc_push, [(self.worker, self.clock, dense_of[k], rows_of[k], scale) for k in range(n)])
        self.push_s.append(time.perf_counter() - start)
        self.bytes_pushed += sent
        self.clock += 1
        if self._progress is not None:
            write_json(self._progress, {"clock": self.clock}, sync=False)

    def report(self) -> dict[str, Any]:
        """This worker's counters (latencies in ms)."""
        return {
            "worker": self.worker,
            "clock": self.clock,
            "push_ms_p50": 1e3 * percentile(self.push_s, 50),
            "push_ms_p99": 1e3 * percentile(self.push_s, 99),
            "pull_ms_p50": 1e3 * percentile(self.pull_s, 50),
            "pull_ms_p99": 1e3 * percentile(self.pull_s, 99),
            "push_s": list(self.push_s),
            "pull_s": list(self.pull_s),
            "bytes_pushed": self.bytes_pushed,
            "bytes_pulled": self.bytes_pulled,
            "rows_pushed": self.rows_pushed,
            "rows_pulled": self.rows_pulled,
        }

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        """Tell every server this worker is done (with its report)."""
        report = {**self.report(), **(extra or {})}
        self._call_all(server.rpc_finish, [(self.worker, report)] * len(self._servers))

    def stats(self) -> list[dict[str, Any]]:
        """Every server's counters, once all workers have finished."""
        return self._call_all(server.rpc_stats, [()] * len(self._servers))
