"""One parameter-server shard and the RPC entry points that reach it.

A server process holds the keys it owns (:mod:`~torsh_distributed.ps._shard`): dense tensors and
blocks of embedding rows, each with a version (updates applied so far), plus one clock per worker
(pushes applied from it). The consistency rule lives here:

- synchronous (``staleness == 0``): the pushes of clock c are summed and applied once, as their
  mean, when the last worker's arrives; a pull at clock c waits until every worker reached c;
- bounded staleness s (SSP): each push is applied on arrival, scaled by 1/num_workers; a pull at
  clock c waits while ``c - min(clocks) > s``;
- asynchronous (``-1``): nothing waits.

The observed staleness of each pull, ``c - min(clocks)`` when it is served, goes to a histogram.
A push whose clock is below the worker's (a replay after a restore) is acknowledged and dropped.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.ps import _shard
from torsh_distributed.ps._optim import ServerOptimizer
from torsh_distributed.ps._snapshot import read_latest, write_snapshot
from torsh_distributed.ps.config import PSConfig, ServerOptimConfig
from torsh_distributed.runtime.errors import DistributedTimeoutError

__all__ = ["ParameterShard", "serve_forever"]

_SHARD: ParameterShard | None = None  # this process's shard (a server process holds exactly one)

RowsPayload = dict[str, tuple[torch.Tensor, torch.Tensor]]


class ParameterShard:
    """The keys one server owns, their versions and optimizer state, and the workers' clocks.

    Args:
        index: This server's index (``0 .. num_servers-1``).
        num_workers: Workers pushing to it.
        config: Consistency, snapshot and security settings.
        optim: The update rule.
    """

    def __init__(self, index: int, *, num_workers: int, config: PSConfig, optim: ServerOptimConfig) -> None:
        self.index = index
        self.num_workers = num_workers
        self.config = config
        self.optim = ServerOptimizer(optim)
        self.dense: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.tables: dict[str, torch.Tensor] = {}
        self.row_versions: dict[str, torch.Tensor] = {}
        self.specs: dict[str, _shard.TableSpec] = {}
        self.clocks = [0] * num_workers
        self.applied = 0
        self.pending: dict[int, dict[str, Any]] = {}
        self.done: set[int] = set()
        self.reports: dict[int, dict[str, Any]] = {}
        self.initialized = False
        self.restored: dict[str, Any] | None = None
        self.lost_updates = 0
        self.staleness: Counter[int] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.rows_in = 0
        self.rows_out = 0
        self.snapshots = 0
        self.cond = threading.Condition()
        self.folder = Path(config.snapshot_dir) / f"server-{index}" if config.snapshot_dir else None
        if self.folder is not None:
            self._restore()

    # -- set-up -----------------------------------------------------------------------------
    def register(self, dense: dict[str, torch.Tensor], tables: dict[str, tuple[_shard.TableSpec, torch.Tensor]]) -> bool:
        """Install initial values (first caller wins; ignored after a restore). Returns whether
        they were installed."""
        with self.cond:
            if self.initialized:
                return False
            self.dense = {k: v.clone() for k, v in dense.items()}
            self.versions = dict.fromkeys(dense, 0)
            for name, (spec, rows) in tables.items():
                self.specs[name] = spec
                self.tables[name] = rows.clone()
                self.row_versions[name] = torch.zeros(rows.shape[0], dtype=torch.int64)
            self.initialized = True
            self.cond.notify_all()
            return True

    def resume(self, worker: int, acked: int) -> int:
        """A (re)started worker that had ``acked`` pushes acknowledged: count the ones this
        shard lost and return the worker's clock here."""
        with self.cond:
            self.lost_updates += max(0, acked - self.clocks[worker])
            return self.clocks[worker]

    # -- the protocol -----------------------------------------------------------------------
    def _wait(self, predicate: Any, what: str) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedTimeoutError(
                    f"server {self.index} waited {self.config.timeout_s:.0f} s for {what} "
                    f"(clocks {self.clocks}, done {sorted(self.done)})",
                    operation="ps." + what.split()[0],
                    fix="a worker is stuck or dead; raise PSConfig.timeout_s for slow workers",
                )
            self.cond.wait(timeout=left)

    def _slowest(self) -> int:
        live = [c for w, c in enumerate(self.clocks) if w not in self.done]
        return min(live) if live else max(self.clocks)

    def push(self, worker: int, clock: int, dense: dict[str, torch.Tensor], rows: RowsPayload, scale: float) -> bool:
        """Apply (or, in synchronous mode, accumulate) worker ``worker``'s push of ``clock``;
        gradients are multiplied by ``scale`` (the worker's weight times its clipping
        coefficient: the weights of one clock sum to 1, so a synchronous step applies the mean
        gradient of the global batch). Returns False
        for a dropped replay."""
        with self.cond:
            self.bytes_in += sum(g.numel() * g.element_size() for g in dense.values())
            self.bytes_in += sum(i.numel() * i.element_size() + g.numel() * g.element_size() for i, g in rows.values())
            self.rows_in += sum(int(i.numel()) for i, _ in rows.values())
            self._wait(lambda: self.initialized, "init")
            if clock < self.clocks[worker]:
                return False
            assert clock == self.clocks[worker], (worker, clock, self.clocks)
            self.clocks[worker] += 1  # before any snapshot this push triggers: it includes it
            if self.config.staleness == 0:
                self._accumulate(clock, dense, rows, scale)
            else:
                self._apply(dense, rows, scale)
                self.applied += 1
                self._maybe_snapshot()
            self.cond.notify_all()
            return True

    def _accumulate(self, clock: int, dense: dict[str, torch.Tensor], rows: RowsPayload, scale: float) -> None:
        slot = self.pending.setdefault(clock, {"count": 0, "dense": {}, "rows": {}})
        for key, grad in dense.items():
            acc = slot["dense"].get(key)
            slot["dense"][key] = grad * scale if acc is None else acc.add_(grad, alpha=scale)
        for name, (ids, grad) in rows.items():
            slot["rows"].setdefault(name, []).append((ids, grad * scale))
        slot["count"] += 1
        if slot["count"] == self.num_workers:
            del self.pending[clock]
            merged: RowsPayload = {}
            for name, parts in slot["rows"].items():
                ids = torch.cat([i for i, _ in parts])
                grads = torch.cat([g for _, g in parts])
                uniq, inverse = torch.unique(ids, return_inverse=True)
                summed = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
                merged[name] = (uniq, summed)
            self._apply(slot["dense"], merged, self._mean_clip(slot["dense"], merged))
            self.applied += 1
            self._maybe_snapshot()

    def _mean_clip(self, dense: dict[str, torch.Tensor], rows: RowsPayload) -> float:
        """``clip_mean`` with several workers: the coefficient that clips the step's mean
        gradient to ``clip_norm`` (``clip_grad_norm_``'s rule); this server holds all of it
        (``check_clip_mean``)."""
        cfg = self.optim.config
        if not (cfg.clip_mean and cfg.clip_norm and self.num_workers > 1):
            return 1.0
        grads = [*dense.values(), *(g for _, g in rows.values())]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        return float(torch.clamp(cfg.clip_norm / (norm + 1e-6), max=1.0))

    def _lr(self) -> float:
        """The learning rate of the update about to be applied (``ServerOptimConfig.lrs``)."""
        cfg = self.optim.config
        if not cfg.lrs:
            return cfg.lr
        step = self.applied if self.config.staleness == 0 else self.applied // self.num_workers
        return cfg.lrs[min(step, len(cfg.lrs) - 1)]

    def _apply(self, dense: dict[str, torch.Tensor], rows: RowsPayload, scale: float) -> None:
        lr = self._lr()
        for key, grad in dense.items():
            self.optim.update_dense(key, self.dense[key], grad * scale, lr=lr)
            self.versions[key] += 1
        for name, (ids, grad) in rows.items():
            if ids.numel() == 0:
                continue
            local = _shard.local_rows(ids, self.specs[name], self.config.num_servers)
            self.optim.update_rows(name, self.tables[name], local, grad * scale, lr=lr)
            self.row_versions[name][local] += 1

    def pull(self, worker: int, clock: int, keys: list[str], rows: dict[str, torch.Tensor]) -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int], dict[str, torch.Tensor]
    ]:
        """Values and versions of ``keys`` and of the given global ``rows`` per table, once the
        consistency rule allows a worker at ``clock`` to read."""
        s = self.config.staleness
        with self.cond:
            self._wait(lambda: self.initialized, "init")
            if clock < 0:  # a final read (evaluation): neither waits nor counts
                s = -1
            elif s >= 0:
                self._wait(lambda: clock - self._slowest() <= s, f"pull staleness <= {s}")
            if clock >= 0:
                self.staleness[max(0, clock - self._slowest())] += 1
            values = {k: self.dense[k].clone() for k in keys}
            versions = {k: self.versions[k] for k in keys}
            row_values, row_versions = {}, {}
            for name, ids in rows.items():
                local = _shard.local_rows(ids, self.specs[name], self.config.num_servers)
                row_values[name] = self.tables[name][local]
                row_versions[name] = self.row_versions[name][local]
            if clock >= 0:
                self.bytes_out += sum(v.numel() * v.element_size() for v in values.values())
                self.bytes_out += sum(v.numel() * v.element_size() for v in row_values.values())
                self.rows_out += sum(int(i.numel()) for i in rows.values())
        return values, row_values, versions, row_versions

    def finish(self, worker: int, report: dict[str, Any]) -> None:
        """Worker ``worker`` is done (``report``: its own counters, kept for the summary); the
        last one triggers a final snapshot."""
        with self.cond:
            self.done.add(worker)
            self.reports[worker] = report
            if len(self.done) == self.num_workers and self.folder is not None:
                self.snapshot()
            self.cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counters of this shard, once every worker has finished."""
        with self.cond:
            self._wait(lambda: len(self.done) == self.num_workers, "stats (all workers done)")
            return {
                "server": self.index,
                "applied": self.applied,
                "clocks": list(self.clocks),
                "staleness": dict(self.staleness),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "rows_in": self.rows_in,
                "rows_out": self.rows_out,
                "snapshots": self.snapshots,
                "restored": self.restored,
                "lost_updates": self.lost_updates,
                "workers": dict(self.reports),
                "keys": len(self.dense),
                "rows": {k: int(v.shape[0]) for k, v in self.tables.items()},
            }

    # -- snapshots --------------------------------------------------------------------------
    def _maybe_snapshot(self) -> None:
        every = self.config.snapshot_every
        if self.folder is not None and every and self.applied % every == 0:
            self.snapshot()

    def snapshot(self) -> None:
        """Write this shard atomically (call with the lock held)."""
        assert self.folder is not None
        tensors = {f"dense/{k}": v for k, v in self.dense.items()}
        tensors.update({f"table/{k}": v for k, v in self.tables.items()})
        tensors.update({f"rowver/{k}": v for k, v in self.row_versions.items()})
        tensors.update({f"optim/{k}": v for k, v in self.optim.state_dict().items()})
        meta = {
            "format": 1,
            "server": self.index,
            "num_servers": self.config.num_servers,
            "num_workers": self.num_workers,
            "staleness": self.config.staleness,
            "applied": self.applied,
            "clocks": self.clocks,
            "versions": self.versions,
            "specs": {k: [s.num_rows, s.dim, s.partition] for k, s in self.specs.items()},
            "time": time.time(),
        }
        self.snapshots += 1
        write_snapshot(self.folder, self.applied, tensors, meta)

    def _restore(self) -> None:
        assert self.folder is not None
        found = read_latest(self.folder)
        if found is None:
            return
        tensors, meta = found
        if meta["num_servers"] != self.config.num_servers or meta["num_workers"] != self.num_workers:
            raise ValueError(
                f"snapshot {self.folder} was written by {meta['num_servers']} servers / "
                f"{meta['num_workers']} workers, this job has {self.config.num_servers} / "
                f"{self.num_workers}: use a fresh snapshot_dir"
            )
        groups: dict[str, dict[str, torch.Tensor]] = {"dense": {}, "table": {}, "rowver": {}, "optim": {}}
        for name, tensor in tensors.items():
            kind, _, key = name.partition("/")
            groups[kind][key] = tensor
        self.dense, self.tables, self.row_versions = groups["dense"], groups["table"], groups["rowver"]
        self.optim.load_state_dict(groups["optim"])
        self.versions = {k: int(v) for k, v in meta["versions"].items()}
        self.specs = {k: _shard.TableSpec(num_rows=r, dim=d, partition=p) for k, (r, d, p) in meta["specs"].items()}
        self.clocks = list(meta["clocks"])
        self.applied = int(meta["applied"])
        self.initialized = True
        self.restored = {"applied": self.applied, "clocks": list(self.clocks), "time": meta["time"]}


# -- RPC entry points (module level: torch.distributed.rpc sends functions by name) ----------
def _shard_for(token: str) -> ParameterShard:
    shard = _SHARD
    if shard is None:
        raise RuntimeError("no parameter-server shard in this process")
    if shard.config.token and not hmac.compare_digest(token, shard.config.token):
        raise PermissionError("parameter server: wrong token")
    return shard


def rpc_register(token: str, dense: dict[str, torch.Tensor], tables: dict[str, tuple[_shard.TableSpec, torch.Tensor]]) -> bool:
    return _shard_for(token).register(dense, tables)


def rpc_resume(token: str, worker: int, acked: int) -> int:
    return _shard_for(token).resume(worker, acked)


def rpc_push(token: str, worker: int, clock: int, dense: dict[str, torch.Tensor], rows: RowsPayload, scale: float) -> bool:
    return _shard_for(token).push(worker, clock, dense, rows, scale)


def rpc_pull(token: str, worker: int, clock: int, keys: list[str], rows: dict[str, torch.Tensor]) -> Any:
    return _shard_for(token).pull(worker, clock, keys, rows)


def rpc_finish(token: str, worker: int, report: dict[str, Any]) -> None:
    _shard_for(token).finish(worker, report)


def rpc_stats(token: str) -> dict[str, Any]:
    return _shard_for(token).stats()


def serve_forever(index: int, *, rank: int, world_size: int, num_workers: int, config: PSConfig,
                  optim: ServerOptimConfig) -> ParameterShard:
    """Run server ``index`` in this process until every worker has left the RPC group."""
    from torsh_distributed.ps import _transport

    global _SHARD
    _SHARD = ParameterShard(index, num_workers=num_workers, config=config, optim=optim)
    _transport.init(_transport.server_name(index), rank=rank, world_size=world_size,
                    host=config.host, timeout_s=config.timeout_s, num_threads=config.num_threads)
    _transport.shutdown(graceful=True)
    shard, _SHARD = _SHARD, None
    return shard
