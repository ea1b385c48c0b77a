"""Opt-in hang and mismatch diagnosis for the collectives facade.

With :func:`enable` (or ``TORSH_COMM_DEBUG=1`` in every rank's environment), every collective
first publishes a fingerprint (op, sequence number on its group, shape, dtype, reduce op / root,
group) in the job's store and waits until every member of the group has published the same sequence number:

- different fingerprints raise :class:`CollectiveMismatchError` on every member, naming the ranks
  on each side and both fingerprints, instead of hanging or silently corrupting data;
- members that do not arrive within ``timeout`` raise :class:`CollectiveHangError` naming them,
  the op and sequence number they never reached, and the last collective each did enter; the
  Python stacks of all ranks (collected through the store by a watcher thread on every rank) are
  written to ``<dump_dir>/torsh-hang-<group>-<seq>-rank<r>.txt``.

The price is a few store round trips per collective: use it to debug, not to train fast.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from torsh_distributed.comm import _hot
from torsh_distributed.runtime.errors import CommunicationError, DistributedTimeoutError

__all__ = [
    "Fingerprint",
    "CollectiveMismatchError",
    "CollectiveHangError",
    "enable",
    "disable",
    "enabled",
    "check",
]

_PREFIX = "torsh/dbg"


class CollectiveMismatchError(CommunicationError, ValueError):
    """Ranks called different collectives (or the same one with different shapes/dtypes)."""


class CollectiveHangError(DistributedTimeoutError):
    """Some members of a group never arrived at a collective within the debug timeout."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a rank is about to do; ranks of a group must agree on everything but ``rank``."""

    op: str
    seq: int
    group: str
    shape: tuple[int, ...] | None
    dtype: str
    detail: str
    rank: int

    def key(self) -> tuple[object, ...]:
        return (self.op, self.seq, self.group, self.shape, self.dtype, self.detail)

    def describe(self) -> str:
        shape = "" if self.shape is None else f"shape={list(self.shape)}, "
        extra = f", {self.detail}" if self.detail else ""
        return f"{self.op} #{self.seq} on {self.group} ({shape}dtype={self.dtype}{extra})"

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: bytes | str) -> Fingerprint:
        data = json.loads(text)
        data["shape"] = None if data["shape"] is None else tuple(data["shape"])
        return cls(**data)


@dataclass(slots=True)
class _State:
    store: dist.Store
    timeout: float
    dump_dir: Path
    rank: int
    seq: dict[str, int]
    stop: threading.Event
    watcher: threading.Thread | None = None


_STATE: _State | None = None


def enable(
    *,
    timeout: float = 60.0,
    dump_dir: str | os.PathLike[str] | None = None,
    store: dist.Store | None = None,
) -> None:
    """Turn diagnosis on for this process (every rank must do the same, before any collective).

    Args:
        timeout: Seconds to wait for the other members at each collective before reporting who
            never arrived. Shorter than the process group's timeout, so the report comes first.
        dump_dir: Where the all-rank stack dump goes (default: the temp directory).
        store: Store to publish fingerprints in (default: the default process group's store).
    """
    global _STATE
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if not dist.is_initialized():
        raise ValueError("comm debug mode needs a running process group (call init() first)")
    disable()
    store = store or dist.distributed_c10d._get_default_store()
    state = _State(
        store=store,
        timeout=float(timeout),
        dump_dir=Path(dump_dir or tempfile.gettempdir()),
        rank=dist.get_rank(),
        seq={},
        stop=threading.Event(),
    )
    state.watcher = threading.Thread(
        target=_watch, args=(state,), name="torsh-comm-debug", daemon=True
    )
    state.watcher.start()
    _STATE = state
    _hot.invalidate()


def disable() -> None:
    """Turn diagnosis off (stops the stack watcher)."""
    global _STATE
    state, _STATE = _STATE, None
    _hot.invalidate()
    if state is not None:
        state.stop.set()


def enabled() -> bool:
    return _STATE is not None


def _stacks_text() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(
            f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        )
    return "\n".join(parts)


def _watch(state: _State) -> None:
    """Publish this rank's Python stacks whenever some rank asks (polls the store)."""
    seen = 0
    while not state.stop.wait(0.2):
        try:
            wanted = state.store.add(f"{_PREFIX}/dump", 0)
            if wanted > seen:
                seen = wanted
                state.store.set(f"{_PREFIX}/stack/{state.rank}/{wanted}", _stacks_text())
        except Exception:  # noqa: BLE001 - the store is gone at shutdown: stop quietly
            return


def check(
    op: str,
    *,
    group: dist.ProcessGroup | None,
    group_label: str,
    ranks: tuple[int, ...],
    shape: tuple[int, ...] | None,
    dtype: str,
    detail: str = "",
) -> None:
    """Publish this rank's fingerprint and wait for the group's; raise on mismatch or timeout."""
    state = _STATE
    if state is None:
        return
    seq = state.seq.get(group_label, 0) + 1
    state.seq[group_label] = seq
    mine = Fingerprint(op, seq, group_label, shape, dtype, detail, state.rank)
    base = f"{_PREFIX}/g/{group_label}"
    store = state.store
    store.set(f"{base}/{seq}/{state.rank}", mine.dumps())
    store.set(f"{_PREFIX}/last/{state.rank}", mine.dumps())
    if seq > 2:  # everyone has passed seq - 1, so nobody reads seq - 2 any more
        try:
            store.delete_key(f"{base}/{seq - 2}/{state.rank}")
        except Exception:  # noqa: BLE001 - stores without delete_key keep the key
            pass
    deadline = time.monotonic() + state.timeout
    pending = [r for r in ranks if r != state.rank]
    delay = 0.0005
    while pending:
        pending = [r for r in pending if not store.check([f"{base}/{seq}/{r}"])]
        if not pending:
            break
        if time.monotonic() >= deadline:
            _report_hang(state, mine, pending)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    prints = [Fingerprint.loads(store.get(f"{base}/{seq}/{r}")) for r in ranks if r != state.rank]
    prints.append(mine)
    kinds: dict[tuple[object, ...], list[Fingerprint]] = {}
    for fp in sorted(prints, key=lambda f: f.rank):
        kinds.setdefault(fp.key(), []).append(fp)
    if len(kinds) > 1:
        sides = [
            f"ranks {[f.rank for f in fps]} called {fps[0].describe()}" for fps in kinds.values()
        ]
        raise CollectiveMismatchError(
            "collective mismatch: " + "; but ".join(sides),
            rank=state.rank,
            operation=op,
            fix="every rank of a group must call the same collectives in the same order with the "
            "same shapes and dtypes; look for a rank-dependent branch or shape.",
        )


def _report_hang(state: _State, mine: Fingerprint, missing: list[int]) -> None:
    store = state.store
    lines = []
    for r in missing:
        key = f"{_PREFIX}/last/{r}"
        last = Fingerprint.loads(store.get(key)).describe() if store.check([key]) else None
        where = f"its last collective was {last}" if last else "it never entered a collective"
        lines.append(f"rank {r} never arrived at {mine.describe()}; {where}")
    path = _dump_stacks(state, mine)
    raise CollectiveHangError(
        f"after {state.timeout:.1f} s: "
        + "; ".join(lines)
        + f". Python stacks of all ranks: {path}",
        rank=state.rank,
        operation=mine.op,
        fix="the stacks show where the missing ranks are; a rank-dependent branch that skips a "
        "collective, or a rank that crashed, is the usual cause.",
    )


def _dump_stacks(state: _State, mine: Fingerprint, wait_s: float = 2.0) -> Path:
    store = state.store
    request = store.add(f"{_PREFIX}/dump", 1)
    world = dist.get_world_size()
    got: dict[int, str] = {state.rank: _stacks_text()}
    deadline = time.monotonic() + wait_s
    while len(got) < world and time.monotonic() < deadline:
        for r in range(world):
            if r in got:
                continue
            # a watcher may answer a later request number: take any at or after ours
            current = store.add(f"{_PREFIX}/dump", 0)
            for n in range(request, current + 1):
                key = f"{_PREFIX}/stack/{r}/{n}"
                if store.check([key]):
                    got[r] = store.get(key).decode(errors="replace")
                    break
        time.sleep(0.05)
    state.dump_dir.mkdir(parents=True, exist_ok=True)
    path = state.dump_dir / f"torsh-hang-{mine.group}-{mine.seq}-rank{state.rank}.txt"
    parts = [f"# stacks at {mine.describe()} seen from rank {state.rank}\n"]
    for r in range(world):
        parts.append(
            f"===== rank {r} =====\n{got.get(r, '(no answer: process exited or unresponsive)')}\n"
        )
    path.write_text("\n".join(parts))
    return path
