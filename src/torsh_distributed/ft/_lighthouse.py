"""The replica groups' quorum service: torchft's lighthouse rules, told of deaths by the launcher.

torchft's ``LighthouseServer`` learns that a replica group is gone only when its heartbeats stop
for ``heartbeat_timeout``; with two groups its split-brain rule (a quorum needs more than half of
the heartbeating groups) then holds the healthy group for that long (1.2 s measured, 10 steps of
0.12 s). The launcher owns the groups' processes and sees a death within one poll (20 ms):
:meth:`Lighthouse.forget` drops the dead group at once and the healthy group's quorum is issued
at the next tick.

It speaks torchft 0.2.0's ``torchft.LighthouseService`` gRPC protocol (``Quorum`` and
``Heartbeat``; torchft's ``ManagerServer`` is the only client) with the same rules as torchft's
``lighthouse.rs``: a quorum is the heartbeating participants; the previous quorum's members all
back = a fast quorum; at least ``min_replicas`` and more than half of the heartbeating groups;
stragglers waited for up to ``join_timeout_s``; the quorum id bumps when the members change. A
group silent for ``heartbeat_timeout_s`` still leaves the quorum (a hung group the launcher
cannot see). The messages are encoded by hand on the protobuf wire format: members pass through
as the bytes their managers sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Lighthouse"]

_SERVICE = "torchft.LighthouseService"


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 on the wire: two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> dict[int, bytes | int]:
    """A message's fields (last wins): varints as ``int``, length-delimited ones as ``bytes``."""
    out: dict[int, bytes | int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            out[number], pos = _read_varint(data, pos)
        elif kind == 2:
            size, pos = _read_varint(data, pos)
            out[number], pos = data[pos : pos + size], pos + size
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {kind}")
    return out


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@dataclass(slots=True)
class _Member:
    replica_id: str
    shrink_only: bool
    raw: bytes  # the QuorumMember as the manager sent it
    joined: float


@dataclass(slots=True)
class _Quorum:
    seq: int  # issue order (a quorum id repeats while the members stay)
    quorum_id: int
    members: list[_Member]

    def encode(self) -> bytes:
        now = time.time()
        created = _varint(1 << 3) + _varint(int(now)) + _varint(2 << 3)
        created += _varint(int((now % 1) * 1e9))
        body = _varint(1 << 3) + _varint(self.quorum_id)
        body += b"".join(_len_field(2, m.raw) for m in self.members) + _len_field(3, created)
        return _len_field(1, body)  # LighthouseQuorumResponse.quorum


class Lighthouse:
    """torchft's quorum service in the launcher's process (see the module doc).

    Args:
        min_replicas: Fewest groups a quorum may have.
        start_replicas: Groups the job's first quorum waits for (all of them, from the
            launcher): a job starts with every group, however late one's heartbeat reaches this
            service on a loaded host. :meth:`give_up` lowers it for a group that will not come.
        join_timeout_s: How long a valid quorum waits for heartbeating groups that have not
            asked to join yet (a restarted group still starting up is waited for this long).
        heartbeat_timeout_s: A group silent this long leaves the quorum (the fallback for a
            failure the launcher does not see: a hung process).
        tick_s: How often a pending quorum is re-evaluated.
        on_request: Called with a replica id when its first quorum request arrives (under the
            service's lock: keep it short); the launcher logs it as the group's ``requested``
            event.
    """

    def __init__(
        self,
        *,
        min_replicas: int = 1,
        start_replicas: int = 1,
        join_timeout_s: float = 0.2,
        heartbeat_timeout_s: float = 1.0,
        tick_s: float = 0.02,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        import grpc

        self.min_replicas, self.join_timeout_s = min_replicas, join_timeout_s
        self.start_replicas = start_replicas
        self.heartbeat_timeout_s, self.tick_s = heartbeat_timeout_s, tick_s
        self._cond = threading.Condition()
        self._heartbeats: dict[str, float] = {}
        self._participants: dict[str, _Member] = {}
        self._forgotten: set[str] = set()
        self._requested: set[str] = set()
        self._on_request = on_request
        self._prev: _Quorum | None = None
        self._issued: list[_Quorum] = []  # the last few, for waiters that woke late
        self._seq = 0
        self._quorum_id = 0
        self._stopped = False
        self._server = grpc.server(ThreadPoolExecutor(max_workers=64, thread_name_prefix="lh"))
        handlers = {
            "Quorum": grpc.unary_unary_rpc_method_handler(self._rpc_quorum),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._rpc_heartbeat),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),)
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self._ticker = threading.Thread(target=self._run_ticks, name="lighthouse", daemon=True)
        self._ticker.start()

    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def forget(self, group_id: str) -> None:
        """Drop every replica of ``group_id`` (``"g1"`` drops ``"g1:<uuid>"``): its processes
        are dead, so a quorum need not wait for its heartbeats to time out."""
        with self._cond:
            for table in (self._heartbeats, self._participants):
                for rid in [r for r in table if r.split(":")[0] == group_id]:
                    self._forgotten.add(rid)
                    del table[rid]
            self._tick()
            self._cond.notify_all()

    def give_up(self, group_id: str) -> None:
        """``group_id`` will not come back (the launcher gave it up): forget it, and a first
        quorum not issued yet no longer waits for it."""
        with self._cond:
            self.start_replicas = max(1, self.start_replicas - 1)
        self.forget(group_id)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._server.stop(grace=None)

    # --- gRPC -----------------------------------------------------------------------------

    def _rpc_heartbeat(self, request: bytes, context: Any) -> bytes:
        rid = _fields(request).get(1, b"")
        assert isinstance(rid, bytes)
        with self._cond:
            if rid.decode() not in self._forgotten:
                self._heartbeats[rid.decode()] = time.monotonic()
        return b""

    def _rpc_quorum(self, request: bytes, context: Any) -> bytes:
        raw = _fields(request).get(1, b"")
        assert isinstance(raw, bytes)
        fields = _fields(raw)
        rid_bytes = fields.get(1, b"")
        assert isinstance(rid_bytes, bytes)
        rid = rid_bytes.decode()
        shrink = bool(fields.get(6, 0))
        with self._cond:
            now = time.monotonic()
            self._heartbeats[rid] = now  # an implicit heartbeat
            self._participants[rid] = _Member(rid, shrink, raw, now)
            if rid not in self._requested:
                self._requested.add(rid)
                if self._on_request is not None:
                    self._on_request(rid)
            seen = self._seq
            self._tick()
            while True:
                for quorum in (q for q in self._issued if q.seq > seen):
                    if any(m.replica_id == rid for m in quorum.members):
                        return quorum.encode()
                if self._issued and self._issued[-1].seq > seen:  # issued without us: again
                    seen = self._issued[-1].seq
                    self._participants[rid] = _Member(rid, shrink, raw, time.monotonic())
                self._cond.wait(0.1)
                if self._stopped or rid in self._forgotten or not context.is_active():
                    self._participants.pop(rid, None)
                    context.abort(_unavailable(), "lighthouse: replica gone or shutting down")

    # --- the rules (torchft's lighthouse.rs quorum_compute) ------------------------------------

    def _run_ticks(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                self._tick()
            time.sleep(self.tick_s)

    def _tick(self) -> None:
        members = self._compute(time.monotonic())
        if members is None:
            return
        ids = [m.replica_id for m in members]
        if self._prev is None or ids != [m.replica_id for m in self._prev.members]:
            self._quorum_id += 1
        self._seq += 1
        quorum = _Quorum(self._seq, self._quorum_id, members)
        self._prev = quorum
        self._issued = [*self._issued[-15:], quorum]
        self._participants.clear()
        self._cond.notify_all()

    def _compute(self, now: float) -> list[_Member] | None:
        healthy = {
            rid for rid, last in self._heartbeats.items() if now - last < self.heartbeat_timeout_s
        }
        present = {rid: m for rid, m in self._participants.items() if rid in healthy}
        candidates = sorted(present.values(), key=lambda m: m.replica_id)
        if self._prev is not None:
            prev_ids = {m.replica_id for m in self._prev.members}
            if any(m.shrink_only for m in present.values()):
                candidates = [m for m in candidates if m.replica_id in prev_ids]
            if prev_ids and all(rid in present for rid in prev_ids):
                return candidates  # fast quorum: every member of the last one is back
        if len(present) < self.min_replicas:
            return None
        if self._prev is None and len(present) < self.start_replicas:
            return None  # the job's first step: every group, whoever heartbeats by now
        if len(present) <= len(healthy) // 2:  # no split brain: more than half of the living
            return None
        if len(present) < len(healthy):
            first = min(m.joined for m in present.values())
            if now - first < self.join_timeout_s:
                return None  # wait for heartbeating stragglers
        return candidates


def _unavailable() -> Any:
    import grpc

    return grpc.StatusCode.UNAVAILABLE
