"""One rank's side of fault-tolerant replica groups (torchft's Manager under the engine's step).

The engine's run calls four things (and nothing else changes in its loop):

* :meth:`ReplicaGroups.next_step` before each step: torchft's quorum. A restarted group heals
  here: a healthy group's rank of the same group rank sends its live state (model, optimizer,
  scaler, scheduler, compressor, losses, per-step membership, RNG) through the job's store, and the
  engine goes on at the step the healthy groups are at;
* :meth:`ReplicaGroups.shard` on each training batch: group ``g`` of ``R`` takes the ``g``-th
  contiguous share of the global batch (which stays a pure function of the step), then the
  group's ranks split that share as in plain DDP/ZeRO;
* :meth:`ReplicaGroups.exchange` after backward: one all-reduce of this rank's gradients (the
  local shard under ZeRO) and its loss with the same group rank of every group present,
  averaged over the groups present, then torchft's commit vote. ``None`` = the step did not
  commit (a group died in it): the engine trains the same step again with the new quorum;
* :meth:`ReplicaGroups.summary` at the end: the summary JSON's ``ft`` section.

What a step computes: the mean over the groups present of each group's gradient (the mean over
its share of the batch), i.e. the gradient of the mean loss over the present groups' shares;
a missing group's share is dropped for that step (as torchft does), never redistributed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torsh_distributed.checkpoint import faults
from torsh_distributed.ft.config import FTConfig

__all__ = [
    "ENV",
    "FTFault",
    "ReplicaGroups",
    "RunState",
    "append_event",
    "parse_faults",
    "read_events",
]

ENV = (
    "TORSH_FT_GROUP",
    "TORSH_FT_GROUPS",
    "TORSH_FT_RANK",
    "TORSH_FT_LIGHTHOUSE",
    "TORSH_FT_STORE",
    "TORSH_FT_DIR",
)
"""What the replica-group launcher (:mod:`torsh_distributed.ft.launch`) gives every rank."""

_REJOIN_PHASES = ("started", "setup", "built", "attached", "joining", "requested", "healed")
"""A restarted group's event lines, in order: the launcher spawned it, its rank 0 imported the
engine, built the model and group, started torchft's Manager, asked to join, every rank's
quorum call reached the launcher's lighthouse (not told by torchft's), healed."""


class RunState(Protocol):
    """What :class:`ReplicaGroups` reads and restores of the engine's run."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    losses: list[float]
    start_step: int

    @property
    def model(self) -> nn.Module: ...

    @property
    def scaler_state(self) -> dict[str, Any]: ...

    def load_scaler_state(self, state: dict[str, Any]) -> None: ...

    @property
    def compression_state(self) -> Any:
        """The gradient compressor's ``Stateful`` (residuals, PowerSGD factors, ``auto``'s
        decisions, counters), or ``None`` without compression."""


def append_event(directory: str | Path, event: Mapping[str, Any]) -> None:
    """Append one JSON line to the job's event log (one ``write`` of a short line: atomic)."""
    line = (json.dumps(dict(event)) + "\n").encode()
    fd = os.open(Path(directory) / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    path = Path(directory) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(slots=True)
class FTFault:
    """One injected fault of ``TORSH_FT_FAULT`` (global ranks; the group's restart count)."""

    kind: str
    rank: int
    step: int
    attempt: int = 0
    group: int = -1
    joins: int = 1
    done: bool = False


def parse_faults(spec: str) -> list[FTFault]:
    """``TORSH_FT_FAULT``: comma-separated ``kill:rank=R:step=S[:attempt=N]`` (rank R sends
    itself SIGKILL once S steps are done, in its group's N-th start, 0 by default) and
    ``hold:rank=R:step=S:group=G[:joins=N]`` (rank R waits before step S until a restarted
    group G has asked to join N times, 1 by default, at most ``ft.timeout_s``: a straggler that
    lets a restarted group heal at a known step in tests; see ``ReplicaGroups._hold``).

    Raises:
        ValueError: a malformed fault, naming it.
    """
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, *pairs = part.split(":")
        values: dict[str, int] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if (
                not sep
                or key not in ("rank", "step", "attempt", "group", "joins")
                or not value.isdigit()
            ):
                raise ValueError(f"TORSH_FT_FAULT: bad {pair!r} in {part!r}")
            values[key] = int(value)
        if (
            kind not in ("kill", "hold")
            or "rank" not in values
            or "step" not in values
            or (kind == "hold" and "group" not in values)
        ):
            raise ValueError(
                f"TORSH_FT_FAULT: {part!r} must be kill:rank=R:step=S[:attempt=N] or "
                "hold:rank=R:step=S:group=G"
            )
        out.append(FTFault(kind=kind, **values))
    return out


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class ReplicaGroups:
    """This rank's replica group and its torchft Manager (see the module doc).

    Args:
        section: The ``ft`` configuration (the launcher's ``replica_groups`` must match).
        group_rank: This rank in its group (the group's process group rank).
        group_size: Ranks per group.
        env: The launcher's variables (:data:`ENV`); ``os.environ`` by default.

    Raises:
        ValueError: not started by the replica-group launcher, or started with other R.
    """

    def __init__(
        self,
        section: FTConfig,
        *,
        group_rank: int,
        group_size: int,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        missing = [k for k in ENV if k not in env]
        if missing:
            raise ValueError(
                f"ft.replica_groups {section.replica_groups} needs the replica-group launcher "
                "(torsh-dist train --ft.replica-groups R --nproc-per-node N, or python -m "
                f"torsh_distributed.ft.launch); missing {', '.join(missing)}"
            )
        self.num_groups = int(env["TORSH_FT_GROUPS"])
        if self.num_groups != section.replica_groups:
            raise ValueError(
                f"ft.replica_groups is {section.replica_groups} but the launcher started "
                f"{self.num_groups} groups"
            )
        self.section = section
        self.group, self.rank = int(env["TORSH_FT_GROUP"]), int(env["TORSH_FT_RANK"])
        self.group_rank, self.group_size = group_rank, group_size
        self.lighthouse, self.store_addr = env["TORSH_FT_LIGHTHOUSE"], env["TORSH_FT_STORE"]
        self.directory = env["TORSH_FT_DIR"]
        self.incarnation = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.faults = parse_faults(env.get("TORSH_FT_FAULT", ""))
        self.history: list[list[int]] = []  # groups present at each committed step
        self.commit_times: list[float] = []  # unix time of each commit
        self.redone = 0  # steps trained again after a failed commit
        self.healed_at: int | None = None
        self.manager: Any = None
        self.run: RunState | None = None
        self._transport: Any = None
        self._announced = False
        self.timers = {"quorum": 0.0, "allreduce": 0.0, "commit": 0.0}  # seconds, all steps
        self.slow_quorums: list[tuple[float, float]] = []  # (unix start, seconds) over 50 ms
        self._event("setup")  # the process is up and has imported the engine

    def _event(self, name: str, **extra: Any) -> None:
        """One line of the job's event log from this group's rank 0 (rejoin phases)."""
        if self.group_rank == 0:
            append_event(
                self.directory,
                {
                    "event": name,
                    "group": self.group,
                    "time": time.time(),
                    "incarnation": self.incarnation,
                    **extra,
                },
            )

    # --- set-up ----------------------------------------------------------------------------

    def attach(self, run: RunState, *, master_addr: str, master_port: int) -> None:
        """Start torchft's Manager for this rank, with the run's state as what a peer heals
        from; called once the model and optimizer exist (the end of the engine's setup)."""
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        logging.getLogger("torchft").setLevel(logging.ERROR)  # per-step info and CUDA-only warnings

        from torsh_distributed.ft._transport import StoreTransport

        self._event("built")  # model, optimizer and the group's own process group exist
        self.run = run
        timeout = timedelta(seconds=self.section.timeout_s)
        host, port = self.store_addr.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        self._transport = StoreTransport(
            store,
            key=f"ft/state/g{self.group}.{self.incarnation}/r{self.group_rank}",
            timeout=timeout,
        )
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the forward, not during it
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=self.group_size,
            store_addr=master_addr,
            store_port=master_port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"g{self.group}",
            hostname="127.0.0.1",
            checkpoint_transport=self._transport,
            init_sync=False,  # every group builds the same weights from the seed
        )
        # every group's manager is up before the first quorum (the launcher's lighthouse also
        # holds the first quorum for every group: a first heartbeat can arrive late)
        store.set(f"ft/up/g{self.group}/r{self.group_rank}", "1")
        store.wait(
            [f"ft/up/g{g}/r{r}" for g in range(self.num_groups) for r in range(self.group_size)],
            timedelta(seconds=max(self.section.timeout_s, 600.0)),  # a loaded host's start-up
        )
        self._event("attached")  # torchft's Manager is up

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # --- the step --------------------------------------------------------------------------

    def next_step(self) -> int:
        """Apply due faults, then torchft's quorum (a restarted group heals here); the step to
        train next."""
        assert self.manager is not None, "attach() first"
        done = self.manager.current_step()
        for fault in self.faults:  # TORSH_FT_FAULT (tests, benchmarks): see parse_faults
            if fault.rank != self.rank or done < fault.step or fault.attempt != self.incarnation:
                continue
            if fault.kind == "kill":
                faults.log_event("kill", rank=self.rank, step=done, where="ft")
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hold" and not fault.done:
                self._hold(fault.group, fault.joins)
                fault.done = True
        if self.incarnation and not self._announced:
            self._announced = True  # a restarted group asks to join (tests' hold faults wait)
            self._event("joining")
        started, wall = time.perf_counter(), time.time()
        self.manager.start_quorum()
        took = time.perf_counter() - started
        self.timers["quorum"] += took
        if took > 0.05:  # a membership change, a join, or a slow host: kept for the report
            self.slow_quorums.append((wall, took))
        step = self.manager.current_step()
        if self.healed_at is None and step > done:  # healed from a live group
            self.healed_at = step
            self._event("healed", step=step)
        return step

    def _hold(self, group: int, joins: int) -> None:
        """Wait until a restarted ``group`` has asked to join ``joins`` times (at most
        ``ft.timeout_s``): a straggler on purpose, so that the group heals in this rank's next
        quorum. With the launcher's lighthouse a join counts once the group's quorum request is
        in the lighthouse (every rank of it called); the group's rank 0 calling is all that
        torchft's lighthouse lets us see."""
        if self.section.lighthouse == "launcher":
            wanted = "requested"
        else:
            wanted = "joining"
        deadline = time.monotonic() + self.section.timeout_s
        while time.monotonic() < deadline:
            events = read_events(self.directory)
            joined = sum(
                e["event"] == wanted and e["group"] == group and e["incarnation"] > 0
                for e in events
            )
            if joined >= joins:
                return
            time.sleep(0.05)

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This group's contiguous share of a global batch of training indices."""
        size = len(indices) // self.num_groups
        return indices[self.group * size : (self.group + 1) * size]

    def exchange(self, params: list[nn.Parameter], loss: torch.Tensor) -> torch.Tensor | None:
        """Average this rank's gradients and loss over the groups present; commit or not.

        Returns:
            The loss averaged over the groups present, or ``None`` when the step did not commit
            on every group (the engine then trains the step again).
        """
        manager = self.manager
        assert manager is not None
        grads = [_local(p.grad) for p in params if p.grad is not None]
        onehot = torch.zeros(self.num_groups, dtype=torch.float32)
        onehot[self.group] = 1.0
        flat = torch.cat(
            [
                *(g.reshape(-1).float() for g in grads),
                _local(loss.detach()).reshape(1).float(),
                onehot,
            ]
        )
        started = time.perf_counter()
        manager.allreduce(flat).wait()  # sum / participants (zeros from a healing group)
        voted = time.perf_counter()
        commit = manager.should_commit()
        self.timers["allreduce"] += voted - started
        self.timers["commit"] += time.perf_counter() - voted
        if not commit:
            self.redone += 1
            return None
        n = manager.num_participants()
        members = [g for g in range(self.num_groups) if flat[-self.num_groups + g] * n > 0.5]
        offset = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.history.append(members)
        self.commit_times.append(time.time())
        return flat[offset].to(loss.dtype)

    # --- live state ------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        run = self.run
        assert run is not None
        optim = run.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        sharded: dict[int, list[str]] = {}
        for idx, entry in optim["state"].items():
            state[idx] = {k: _local(v) for k, v in entry.items()}
            sharded[idx] = [k for k, v in entry.items() if isinstance(v, DTensor)]
        return {
            "model": {k: _local(v) for k, v in run.model.state_dict().items()},
            "optim_state": state,
            "optim_sharded": sharded,
            "param_groups": optim["param_groups"],
            "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "scaler": run.scaler_state,
            "losses": list(run.losses),
            "history": self.history,
            "commit_times": self.commit_times,
            "rng": torch.get_rng_state(),
            "compression": (
                run.compression_state.state_dict() if run.compression_state is not None else None
            ),
        }

    def _load_state(self, sd: dict[str, Any]) -> None:
        run = self.run
        assert run is not None
        with torch.no_grad():
            own = run.model.state_dict()
            for key, value in own.items():
                _local(value).copy_(sd["model"][key])
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for idx, entry in sd["optim_state"].items():
            param = params[int(idx)]
            wrapped = set(sd["optim_sharded"].get(idx, []))
            state[int(idx)] = {
                k: DTensor.from_local(
                    v,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                if k in wrapped and isinstance(param, DTensor)
                else v
                for k, v in entry.items()
            }
        run.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
        if run.scheduler is not None and sd["scheduler"] is not None:
            run.scheduler.load_state_dict(sd["scheduler"])
        run.load_scaler_state(sd["scaler"])
        run.losses[:] = sd["losses"]
        self.history, self.commit_times = sd["history"], sd["commit_times"]
        torch.set_rng_state(sd["rng"])
        if run.compression_state is not None and sd.get("compression") is not None:
            run.compression_state.load_state_dict(sd["compression"])
        run.start_step = len(run.losses)

    # --- the report ------------------------------------------------------------------------

    @property
    def reports(self) -> bool:
        """Whether this rank writes the job's summary (rank 0 of the lowest group at the end)."""
        return self.group_rank == 0 and bool(self.history) and self.group == min(self.history[-1])

    def summary(self) -> dict[str, Any]:
        """The summary JSON's ``ft`` section (see docs/fault-tolerance.md, "Replica groups")."""
        events = read_events(self.directory)
        times = self.commit_times
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        typical = statistics.median(gaps) if gaps else 0.0
        failures = []
        for event in (e for e in events if e["event"] == "died"):
            group, died = event["group"], event["time"]
            after = next((i for i, t in enumerate(times) if t >= died), None)
            healed = next(
                (
                    e
                    for e in events
                    if e["event"] == "healed"
                    and e["group"] == group
                    and e["incarnation"] == event["incarnation"] + 1
                ),
                None,
            )
            gap = times[after] - times[after - 1] if after else None
            phases = {  # seconds after the death: where a rejoin's time goes
                e["event"]: round(e["time"] - died, 3)
                for e in events
                if e["group"] == group
                and e.get("incarnation") == event["incarnation"] + 1
                and e["event"] in _REJOIN_PHASES
            }
            failures.append(
                {
                    "rank": event["rank"],
                    "group": group,
                    "step": after if after is not None else len(times),
                    "restarted_ranks": event["restarted_ranks"],
                    "recovery_s": round(healed["time"] - died, 3) if healed else None,
                    "rejoined_step": healed["step"] if healed else None,
                    "rejoin_phases_s": phases,
                    "healthy_stall_s": round(gap - typical, 3) if gap is not None else None,
                    "healthy_stall_steps": round(gap / typical - 1, 2) if gap and typical else None,
                    # the launcher saw the death -> the healthy groups' next commit
                    "commit_after_death_s": round(times[after] - died, 3) if after else None,
                    # the healthy rank's quorum that was waiting or started when the group died
                    "quorum_after_death_s": next(
                        (
                            round(start + took - died, 3)
                            for start, took in self.slow_quorums
                            if start + took >= died
                        ),
                        None,
                    ),
                    "steps_lost_healthy": 0,
                    "signal": event.get("signal"),
                }
            )
        return {
            "replica_groups": self.num_groups,
            "failures": failures,
            "steps": self.history,
            "given_up": [e["group"] for e in events if e["event"] == "given_up"],
            "processes": [
                {k: e[k] for k in ("group", "incarnation", "pids")}
                for e in events
                if e["event"] == "started"
            ],
            "redone_steps": self.redone,
            "median_step_s": round(typical, 4),
            "state_bytes_sent": self._transport.bytes_sent if self._transport else 0,
            "time_s": {k: round(v, 3) for k, v in self.timers.items()},
        }
