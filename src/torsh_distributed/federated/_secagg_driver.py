"""Machinery of :func:`~torsh_distributed.federated.secagg.secagg_round`: the start-up probe
that measures how long the nodes take to start a ClientApp, the grid it hands Flower's SecAgg+
workflow (bytes counted per stage, replies polled every 0.25 s), the legacy strategy the workflow
consults for one round, and the repair of Flower 1.42's unmask stage for clients that dropped
before sharing their keys."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import Message

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "PROBE_ACTION",
    "PROBE_TYPE",
    "CountingGrid",
    "OneRound",
    "forget_silent",
    "message_bytes",
    "probe",
]

PROBE_ACTION = "startup"
PROBE_TYPE = f"query.{PROBE_ACTION}"
"""Message type of the start-up probe; :data:`~torsh_distributed.federated.secagg.secagg_client_app`
answers it (a ClientApp without a handler for a type answers with an error, and Flower's
SuperNode logs the exception and exit code 800)."""


def probe(
    grid: Any, node_ids: Sequence[int], *, timeout: float, poll: float = 0.25
) -> tuple[float, list[Message]]:
    """Send every node a :data:`PROBE_TYPE` message and wait for the replies.

    A SuperNode starts a ClientApp process for every message (imports, and the app's install on
    the first message of a run): on a small shared host several nodes starting at once take
    longer than a stage's timeout, before the protocol has begun.

    Returns:
        ``(seconds, replies)``: seconds from sending to the last reply that arrived (all of them
        when every node answered; the whole ``timeout`` when none did) and the replies.
    """
    from flwr.app import RecordDict

    messages = [Message(RecordDict(), dst_node_id=nid, message_type=PROBE_TYPE) for nid in node_ids]
    sent = time.monotonic()
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        return time.monotonic() - sent, replies
    pending = set(grid.push_messages(messages))
    deadline = sent + timeout
    replies: list[Message] = []
    last = deadline
    while pending:
        got = list(grid.pull_messages(pending))
        if got:
            last = time.monotonic()
        replies += got
        pending -= {m.metadata.reply_to_message_id for m in got}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    return last - sent, replies


class CountingGrid:
    """The workflow's grid: counts the record bytes of each stage's messages, and polls for the
    replies every ``poll`` seconds (Flower's ``send_and_receive`` sleeps 3 s between pulls,
    which SecAgg+'s four exchanges per round would pay four times)."""

    def __init__(
        self,
        grid: Any,
        *,
        poll: float = 0.25,
        after_first: float = 0.0,
        silent_grace: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid = grid
        self.poll = poll
        self.clock, self.sleep = clock, sleep
        """How the stage reads the time and waits between pulls (a test's clock: exact deadlines
        whatever the host's load)."""
        self.after_first = after_first
        """A stage never closes sooner than this many seconds after its first reply: when the
        host slows down after the start-up probe (another job starts), every ClientApp starts
        late, and the first answer says so; the others get the stage's own wait from there."""
        self.silent_grace = silent_grace
        """A stage nobody has answered by its deadline waits up to this much longer for a first
        answer (the start-up probe's own limit) before it closes empty."""
        self.stage = ""
        self.stage_bytes: dict[str, dict[str, int]] = {}
        self.node_up: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        counts = self.stage_bytes.setdefault(self.stage, {"down": 0, "up": 0})
        counts["down"] += sum(message_bytes(m) for m in messages)
        if hasattr(self.grid, "push_messages") and hasattr(self.grid, "pull_messages"):
            replies = self._exchange(messages, timeout)
        else:
            replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            size = message_bytes(reply)
            counts["up"] += size
            src = reply.metadata.src_node_id
            self.node_up[src] = self.node_up.get(src, 0) + size
        return replies

    def _exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        pending = set(self.grid.push_messages(messages))
        deadline = math.inf if timeout is None else self.clock() + timeout
        cap = deadline + self.silent_grace
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(pending))
            now = self.clock()
            if got and not replies:  # the first answer: the others get `after_first` from here
                deadline = max(deadline, now + self.after_first)
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (now >= deadline and (replies or now >= cap)):
                break
            self.sleep(self.poll)
        return replies


def message_bytes(msg: Message) -> int:
    if msg.has_error():
        return 0
    content = msg.content
    size = sum(int(r.count_bytes()) for r in content.array_records.values())
    for record in [*content.config_records.values(), *content.metric_records.values()]:
        # Flower's ConfigRecord.count_bytes fails on an empty list value
        size += sum(len(key) + _value_bytes(value) for key, value in record.items())
    return size


def _value_bytes(value: Any) -> int:
    if isinstance(value, list):
        return sum(_value_bytes(v) for v in value)
    if isinstance(value, (bytes, str)):
        return len(value)
    return 1 if isinstance(value, bool) else 8


class OneRound:
    """The legacy strategy the workflow consults: our instructions to the given nodes, and the
    unmasked aggregate (with the clients' results) captured instead of aggregated again."""

    def __init__(self, fit_ins: Any, node_ids: Sequence[int], grid: Any) -> None:
        self.fit_ins, self.node_ids, self.grid = fit_ins, list(node_ids), grid
        self.results: list[tuple[Any, Any]] = []
        self.aggregate: list[np.ndarray] | None = None

    def configure_fit(
        self, server_round: int, parameters: Any, client_manager: Any
    ) -> list[tuple[Any, Any]]:
        from flwr.server.compat.grid_client_proxy import GridClientProxy

        del server_round, parameters
        proxies = [GridClientProxy(nid, self.grid, 0) for nid in self.node_ids]
        for proxy in proxies:
            client_manager.register(proxy)
        return [(proxy, self.fit_ins) for proxy in proxies]

    def aggregate_fit(
        self, server_round: int, results: list[Any], failures: list[Any]
    ) -> tuple[Any, dict[str, Any]]:
        from flwr.common import parameters_to_ndarrays

        del server_round, failures
        self.results = list(results)
        if not results:
            return None, {}
        parameters = results[0][1].parameters  # the workflow gives every result the aggregate
        self.aggregate = parameters_to_ndarrays(parameters)
        return parameters, {}


def forget_silent(state: Any) -> None:
    """Take the clients that did not finish ``share_keys`` out of the protocol.

    They gave no shares to anyone, so no live client masked against them; Flower's unmask stage
    would still ask for their key shares (nobody has them) and halt."""
    gone = state.sampled_node_ids - state.active_node_ids
    if not gone:
        return
    state.sampled_node_ids = set(state.active_node_ids)
    for nid in gone:
        state.nid_to_neighbours.pop(nid, None)
    for neighbours in state.nid_to_neighbours.values():
        neighbours -= gone
