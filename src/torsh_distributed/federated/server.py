"""The server's round loop on a Flower ``Grid``: sample, send, wait until the deadline, aggregate
with a Flower strategy, evaluate, checkpoint, record.

Flower's ``Strategy.start`` runs all rounds in one call; this loop calls the same strategy's
``configure_train`` and ``aggregate_train`` itself so that after every round it can write a
checkpoint (round, global model, the strategy's server optimizer state, the privacy accountant,
the rounds so far) and a resumed server continues from it, and so that a round closes at
``round_timeout`` with whoever answered (if at least ``min_clients`` did). Replies carry the
client's metrics (``partition-id``, ``num-examples``, ``loss``, ``steps``, ``seconds``,
``straggler``); the summary JSON holds one entry per round.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.strategies import (
    build_strategy,
    load_strategy_state,
    strategy_state,
)
from torsh_distributed.federated.task import Task, evaluate
from torsh_distributed.runtime.busy import scaled_start_timeout

__all__ = ["RoundLoop", "ServerCheckpoint", "wait_for_clients"]

SUMMARY = "summary.json"
_CKPT = "server"
_FILES = ("model.pt", "strategy.pt")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_for_clients(grid: Any, count: int, *, timeout: float) -> int:
    """Block until ``count`` clients are connected; returns how many are.

    Raises:
        TimeoutError: fewer connected within ``timeout`` seconds (naming how many did).
    """
    deadline = time.monotonic() + timeout
    while True:
        connected = len(list(grid.get_node_ids()))
        if connected >= count:
            return connected
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {connected} of {count} clients connected within {timeout:.0f} s; "
                "see the supernode logs"
            )
        time.sleep(0.5)


@dataclass(slots=True)
class ServerState:
    """What a checkpoint holds."""

    round: int
    """Last completed round."""
    model: dict[str, torch.Tensor] = field(repr=False)
    strategy: dict[str, Any] = field(default_factory=dict, repr=False)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-able state of other components (the privacy accountant)."""


class ServerCheckpoint:
    """``run_dir/server/round_NNNNN/`` directories, written whole then renamed (a killed save
    leaves no directory that later loads), with the SHA-256 of each file checked before loading
    (a damaged one is skipped for the previous round's), the newest two kept."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / _CKPT

    def save(self, state: ServerState) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"round_{state.round:05d}"
        tmp = self.root / f".tmp_round_{state.round:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(state.model, tmp / "model.pt")
        torch.save(state.strategy, tmp / "strategy.pt")
        digests = {name: _sha256(tmp / name) for name in _FILES}
        meta = {"round": state.round, "rounds": state.rounds, "extra": state.extra, "sha256": digests}
        (tmp / "state.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(self.root.glob("round_*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def mark_started(self, server_round: int) -> None:
        """Record that ``server_round`` began (a resumed server reports it lost if unsaved)."""
        self.root.mkdir(parents=True, exist_ok=True)
        _write_json(self.root / "started.json", {"round": server_round})

    def started_round(self) -> int:
        """The last round that began (0 when none did)."""
        try:
            return int(json.loads((self.root / "started.json").read_text())["round"])
        except (OSError, ValueError, KeyError):
            return 0

    def latest(self) -> ServerState | None:
        """The newest complete checkpoint, or ``None``."""
        for path in sorted(self.root.glob("round_*"), reverse=True):
            try:
                meta = json.loads((path / "state.json").read_text())
                if any(_sha256(path / name) != meta["sha256"][name] for name in _FILES):
                    continue  # damaged after it was written: try an older one
                model = torch.load(path / "model.pt", weights_only=True)
                strategy = torch.load(path / "strategy.pt", weights_only=True)
            except (OSError, ValueError, KeyError):
                continue  # incomplete: try an older one
            return ServerState(
                round=int(meta["round"]), model=model, strategy=strategy,
                rounds=list(meta["rounds"]), extra=dict(meta.get("extra", {})),
            )  # fmt: skip
        return None


def _metric(msg: Any, key: str, default: float = 0.0) -> float:
    metrics = msg.content.get("metrics")
    if metrics is None or key not in metrics:
        return default
    return float(metrics[key])


class RoundLoop:
    """Runs the rounds of ``config`` on ``grid`` (inside Flower's ``ServerApp``).

    Args:
        config: The run.
        grid: Flower's grid (the deployment engine's connection to the SuperLink).
        log: Where progress lines go (``print`` in the ServerApp: streamed by ``flwr run``).
        hooks: Optional wrappers of the strategy (privacy) and of replies (decompression); see
            :class:`RoundHooks`.
    """

    def __init__(
        self,
        config: FederatedConfig,
        grid: Any,
        *,
        log: Callable[[str], None] = print,
        hooks: RoundHooks | None = None,
    ) -> None:
        self.config, self.grid, self.log = config, grid, log
        self.hooks = hooks or RoundHooks()
        self.task = Task(config)
        self.strategy = self.hooks.wrap_strategy(build_strategy(config))
        self.checkpoint = ServerCheckpoint(config.run_dir)
        self.val = self.task.val_dataset()
        self.loss_fn = self.task.loss()
        self.model = self.task.model()

    def _evaluate(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        if self.val is None:
            return {}
        self.model.load_state_dict(state)
        return evaluate(self.model, self.val, self.loss_fn, seed=self.config.seed)

    def run(self) -> dict[str, Any]:
        """All rounds (from the checkpoint's next one when resuming); returns the summary."""
        from flwr.app import ArrayRecord, ConfigRecord

        cfg = self.config
        started = time.time()
        state = self.checkpoint.latest() if cfg.resume == "auto" else None
        rounds: list[dict[str, Any]] = []
        first = 1
        resumed_from = 0
        global_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if cfg.initial_state:
            global_state = torch.load(cfg.initial_state, weights_only=True)
        lost = 0
        if state is not None:
            global_state, rounds, first = state.model, state.rounds, state.round + 1
            resumed_from = state.round
            lost = max(0, self.checkpoint.started_round() - state.round)
            load_strategy_state(getattr(self.strategy, "inner", self.strategy), state.strategy)
            self.hooks.load_state_dict(state.extra)
            self.log(
                f"federated: resuming after round {state.round} of {cfg.rounds} "
                f"({lost} round(s) in progress were lost and are redone)"
            )
        wait = scaled_start_timeout(120.0)  # SuperNodes starting on a busy host take longer
        connected = wait_for_clients(self.grid, min(cfg.expected_nodes, max(cfg.min_clients, 1)), timeout=wait)
        if first == 1:
            connected = wait_for_clients(self.grid, cfg.expected_nodes, timeout=wait)
            initial = self._evaluate(global_state) if not cfg.initial_state else {}
            if initial:
                self.log(f"federated: round 0 (initial model) val loss {initial['loss']:.4f}")
        elif connected < cfg.expected_nodes:
            # Resumed: the others usually reconnect within seconds (a whole federation restarted
            # at once: its SuperNodes connect one by one), and the first round would sample only
            # those already back. Wait for them up to one round deadline, then go on with the
            # min_clients connected (a client gone for good must not stop the run).
            try:
                connected = wait_for_clients(
                    self.grid, cfg.expected_nodes, timeout=min(wait, cfg.round_timeout)
                )
            except TimeoutError:
                connected = len(list(self.grid.get_node_ids()))
        self.log(
            f"federated: {cfg.strategy}, {cfg.clients} clients ({connected} connected), rounds "
            f"{first}..{cfg.rounds}, deadline {cfg.round_timeout:g} s per round"
        )
        arrays = ArrayRecord(global_state)
        try:
            rounds = self._rounds(first, arrays, rounds, config_record=ConfigRecord)
        finally:
            self.hooks.close()
        summary = {
            "strategy": cfg.strategy,
            "clients": cfg.clients,
            "rounds": rounds,
            "resumed_from_round": resumed_from,
            "rounds_lost": lost,
            "wall_time_s": time.time() - started,
            "config": json.loads(cfg.to_json()),
            **self.hooks.summary(),
        }
        if rounds:
            summary["final_loss"] = rounds[-1]["loss"]
        _write_json(Path(cfg.run_dir) / SUMMARY, summary)
        return summary

    def _rounds(self, first: int, arrays: Any, rounds: list[dict[str, Any]], *, config_record: Any) -> list[dict[str, Any]]:
        for server_round in range(first, self.config.rounds + 1):
            self.checkpoint.mark_started(server_round)
            arrays, record = self._round(server_round, arrays, config_record)
            rounds.append(record)
            self.checkpoint.save(
                ServerState(
                    round=server_round, model=arrays.to_torch_state_dict(),
                    strategy=strategy_state(getattr(self.strategy, "inner", self.strategy)),
                    rounds=rounds, extra=self.hooks.state_dict(),
                )  # fmt: skip
            )
        return rounds

    def _secagg_round(self, server_round: int, arrays: Any, messages: list[Any], started: float) -> tuple[Any, dict[str, Any]]:
        """The round under SecAgg+: Flower's strategy sampled the nodes; the protocol trains them
        and returns the example-weighted mean (:mod:`~torsh_distributed.federated.secagg`)."""
        from flwr.app import ArrayRecord

        from torsh_distributed.federated.secagg import secagg_round

        cfg = self.config
        nodes = [m.metadata.dst_node_id for m in messages]
        shares, threshold = cfg.secagg_plan(len(nodes))
        res = secagg_round(
            self.grid, config=cfg, server_round=server_round, global_state=arrays.to_torch_state_dict(),
            node_ids=nodes, timeout=cfg.round_timeout, num_shares=shares, reconstruction_threshold=threshold,
            clipping_range=cfg.secagg_clip, quantization_range=cfg.secagg_quantization,
            proximal_mu=cfg.proximal_mu if cfg.strategy == "fedprox" else 0.0,
            on_stage=lambda stage, ids: self.log(  # a round that waits for the dead says where
                f"federated: round {server_round} secagg {stage}: {len(ids)} of {len(nodes)} clients in"
            ),
        )  # fmt: skip
        failed = not res.ok or res.completed < cfg.min_clients
        if not failed:
            arrays = ArrayRecord(res.state)
        weight = sum(c["examples"] for c in res.clients)
        train_loss = sum(c["loss"] * c["examples"] for c in res.clients) / weight if weight else float("nan")
        val = self._evaluate(arrays.to_torch_state_dict())
        record: dict[str, Any] = {
            "round": server_round,
            "loss": val.get("loss", train_loss),
            "train_loss": train_loss,
            "val_loss": val.get("loss"),
            "sampled": res.sampled,
            "answered": res.completed,
            "dropped": res.dropped,
            "failed": failed,
            "clients": sorted(res.clients, key=lambda c: c["partition_id"]),
            "bytes": dict(res.bytes),
            "seconds": time.perf_counter() - started,
            "secagg": {
                "error_bound": res.error_bound, "clipped": res.clipped, "failed_stage": res.failed_stage,
                "stage_seconds": res.stage_seconds, "stage_bytes": res.stage_bytes,
                "startup_seconds": res.startup_seconds,
                "num_shares": res.num_shares, "reconstruction_threshold": res.reconstruction_threshold,
            },
            **self.hooks.round_metrics(server_round, res.completed, not failed),
        }  # fmt: skip
        if "accuracy" in val:
            record["accuracy"] = val["accuracy"]
        client_eval = self._client_evaluate(server_round, arrays)
        if client_eval is not None:
            record["evaluate"] = client_eval
        if res.errors:
            record["errors"] = res.errors[:5]
        self.log(_round_line(cfg, record))
        self.hooks.on_round(record)
        return arrays, record

    def _client_evaluate(self, server_round: int, arrays: Any) -> dict[str, Any] | None:
        """Flower's client-side evaluation of the new global model (``fraction_evaluate`` > 0):
        the strategy samples the clients and aggregates their metrics; each client's row kept."""
        cfg = self.config
        if not cfg.fraction_evaluate:
            return None
        from flwr.app import ConfigRecord

        config = ConfigRecord({"spec": cfg.to_json()})
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, self.grid))
        if not messages:
            return None
        replies, _ = self._exchange(messages, timeout=cfg.round_timeout)
        ok = [m for m in replies if not m.has_error()]
        clients = []
        for m in ok:
            row = {"partition_id": int(_metric(m, "partition-id", -1)), "examples": int(_metric(m, "num-examples")),
                   "loss": _metric(m, "loss")}  # fmt: skip
            if "accuracy" in m.content["metrics"]:
                row["accuracy"] = _metric(m, "accuracy")
            clients.append(row)
        out: dict[str, Any] = {"sampled": len(messages), "answered": len(ok),
                               "clients": sorted(clients, key=lambda c: c["partition_id"])}  # fmt: skip
        aggregated = self.strategy.aggregate_evaluate(server_round, ok) if ok else None
        if aggregated:  # the strategy's own aggregate (FedAvg: the example-weighted means)
            out.update({k: float(v) for k, v in aggregated.items()
                        if k not in ("partition-id", "num-examples", "weight")})  # fmt: skip
        errors = [m.error.reason for m in replies if m.has_error()]
        if errors:
            out["errors"] = errors[:5]
        return out

    def _exchange(self, messages: list[Any], *, timeout: float) -> tuple[list[Any], dict[int, float]]:
        """Send the round's messages and collect replies until all arrived or ``timeout``; also
        each replying node's turnaround (sent to received, polled every 0.2 s)."""
        sent = time.monotonic()
        pending = set(self.grid.push_messages(messages))
        replies: list[Any] = []
        turnaround: dict[int, float] = {}
        while pending:
            got = list(self.grid.pull_messages(pending))
            now = time.monotonic()
            for msg in got:
                replies.append(msg)
                pending.discard(msg.metadata.reply_to_message_id)
                turnaround[msg.metadata.src_node_id] = now - sent
            if not pending or now - sent > timeout:
                break
            time.sleep(0.2)
        return replies, turnaround

    def _round(self, server_round: int, arrays: Any, config_record: Any) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        started = time.perf_counter()
        random.seed(cfg.seed * 1_000_003 + server_round)  # Flower samples with `random`
        train_config = config_record({"spec": cfg.to_json()})
        messages = list(self.strategy.configure_train(server_round, arrays, train_config, self.grid))
        if cfg.secagg:
            return self._secagg_round(server_round, arrays, messages, started)
        methods = self.hooks.configure(messages)
        sampled = len(messages)
        down = sampled * arrays.count_bytes()
        replies, turnaround = self._exchange(messages, timeout=cfg.round_timeout)
        ok = [m for m in replies if not m.has_error()]
        errors = [m.error.reason for m in replies if m.has_error()]
        if cfg.straggler_policy == "drop":
            ok = [m for m in ok if not _metric(m, "straggler")]
        up = sum(self.hooks.reply_bytes(m) for m in ok)
        clients = [
            {
                "partition_id": int(_metric(m, "partition-id", -1)),
                "examples": int(_metric(m, "num-examples")),
                "loss": _metric(m, "loss"),
                "steps": int(_metric(m, "steps")),
                "seconds": _metric(m, "seconds"),
                "straggler": bool(_metric(m, "straggler")),
                "bytes": self.hooks.reply_bytes(m),
                **({"region": True} if _metric(m, "region") else {}),
                **_link(m, turnaround, methods),
            }
            for m in ok
        ]
        for m in ok:
            node = m.metadata.src_node_id
            self.hooks.observe(node, turnaround[node] - _metric(m, "seconds"))
        failed = len(ok) < cfg.min_clients
        if not failed:
            new_arrays, _ = self.strategy.aggregate_train(server_round, self.hooks.prepare(ok, arrays))
            if new_arrays is not None:
                arrays = _same_dtypes(new_arrays, arrays)
            else:
                failed = True
        weight = sum(c["examples"] for c in clients)
        train_loss = sum(c["loss"] * c["examples"] for c in clients) / weight if weight else float("nan")
        val = self._evaluate(arrays.to_torch_state_dict())
        record: dict[str, Any] = {
            "round": server_round,
            "loss": val.get("loss", train_loss),
            "train_loss": train_loss,
            "val_loss": val.get("loss"),
            "sampled": sampled,
            "answered": len(ok),
            "dropped": sampled - len(ok),
            "failed": failed,
            "clients": sorted(clients, key=lambda c: c["partition_id"]),
            "bytes": {"down": down, "up": up, "total": down + up},
            "seconds": time.perf_counter() - started,
            **self.hooks.round_metrics(server_round, len(ok), not failed),
        }
        if "accuracy" in val:
            record["accuracy"] = val["accuracy"]
        client_eval = self._client_evaluate(server_round, arrays)
        if client_eval is not None:
            record["evaluate"] = client_eval
        if errors:
            record["errors"] = errors[:5]
        self.log(_round_line(cfg, record))
        self.hooks.on_round(record)
        return arrays, record


def _same_dtypes(new: Any, old: Any) -> Any:
    """``new`` with ``old``'s dtypes: Flower's FedAdam/FedYogi/FedAdagrad step in float64 NumPy,
    which would double the bytes of every later round and change the model's dtype."""
    from flwr.app import ArrayRecord

    reference = old.to_torch_state_dict()
    state = new.to_torch_state_dict()
    if all(state[k].dtype == v.dtype for k, v in reference.items() if k in state):
        return new
    return ArrayRecord({k: v.to(reference[k].dtype) if k in reference else v for k, v in state.items()})


def _link(msg: Any, turnaround: dict[int, float], methods: dict[int, str]) -> dict[str, Any]:
    """A client's turnaround, link time (turnaround minus training) and method, when known."""
    node = msg.metadata.src_node_id
    out: dict[str, Any] = {}
    if node in turnaround:
        out["turnaround_s"] = turnaround[node]
        out["link_s"] = turnaround[node] - _metric(msg, "seconds")
    if node in methods:
        out["compression"] = methods[node]
    return out


def _round_line(cfg: FederatedConfig, r: dict[str, Any]) -> str:
    parts = [f"federated: round {r['round']}/{cfg.rounds}"]
    parts.append(f"loss {r['loss']:.4f}" if r["loss"] == r["loss"] else "loss n/a")
    if "accuracy" in r:
        parts.append(f"acc {r['accuracy']:.3f}")
    if "loss" in r.get("evaluate", {}):
        ev = r["evaluate"]
        parts.append(f"client eval loss {ev['loss']:.4f} ({ev['answered']}/{ev['sampled']})")
    parts.append(f"clients {r['answered']}/{r['sampled']}")
    if r["failed"]:
        parts.append(f"FAILED (< min_clients {cfg.min_clients}: model kept)")
    parts.append(f"{r['bytes']['total'] / 1e6:.2f} MB")
    if "epsilon" in r:
        parts.append(f"eps {r['epsilon']:.3f}")
    parts.append(f"{r['seconds']:.1f} s")
    return ", ".join(parts)


class RoundHooks:
    """Extension points of the round loop; the default changes nothing.

    Privacy wraps the strategy and keeps an accountant; compressed updates turn replies back
    into weights before aggregation and count their bytes.
    """

    def wrap_strategy(self, strategy: Any) -> Any:
        return strategy

    def configure(self, messages: list[Any]) -> dict[int, str]:
        """Adjust the round's messages per client before they are sent; returns node -> the
        compression method each was given (empty: the run's method)."""
        return {}

    def observe(self, node: int, link_s: float) -> None:
        """A replying client's link time this round."""

    def prepare(self, replies: list[Any], arrays: Any) -> Iterable[Any]:
        """Replies as the strategy aggregates them (weights of the same shapes as ``arrays``)."""
        return replies

    def reply_bytes(self, reply: Any) -> int:
        arrays = reply.content.get("arrays")
        return int(arrays.count_bytes()) if arrays is not None else 0

    def round_metrics(self, server_round: int, answered: int, aggregated: bool) -> dict[str, Any]:
        """Extra fields of the round's record (``aggregated``: the round updated the model)."""
        return {}

    def on_round(self, record: dict[str, Any]) -> None:
        """Called with each finished round's record (monitoring)."""

    def close(self) -> None:
        """Called once when the loop ends (also on error)."""

    def summary(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    os.replace(tmp, path)
