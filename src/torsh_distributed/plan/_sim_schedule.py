"""Pipeline schedules and the event engine that plays them.

Each pipeline rank runs its list of forward (``F``) and backward (``B``) passes of one
micro-batch through one model chunk, in the schedule's order. A pass starts when its rank is
free and its input has arrived: ``F`` of virtual stage ``k`` needs ``F`` of stage ``k - 1`` plus
the send between them; ``B`` of stage ``k`` needs ``B`` of stage ``k + 1`` plus the send (the last
stage's ``B`` needs its own ``F``). Sends do not occupy the sender (asynchronous p2p). Every start
remembers what it waited for, so the critical path is read back from the last pass.

Orders (Narayanan et al. 2021, section 2.2): ``gpipe`` (all forwards, then all backwards),
``1f1b`` (PipeDream-Flush: ``p - r - 1`` warm-up forwards on rank ``r``, then one forward one
backward, then the cool-down backwards) and ``interleaved`` (``v`` chunks per rank, virtual stage
``c * p + r``; Megatron-LM's order, which needs the micro-batches to be a multiple of ``p``).

``deepspeed`` is DeepSpeed's pipeline engine (``TrainSchedule``, the pipeline of
Megatron-DeepSpeed: MT-NLG, BLOOM), played by :func:`play_deepspeed`: ``2 (m + p - 1)`` steps per
rank, even and odd stages alternating forward and backward, each step first exchanging the
previous step's output with a neighbour and then computing; its sends and receives are
blocking and paired ("must be paired ... to avoid deadlock", ``deepspeed/runtime/pipe/
schedule.py``), so a send waits for its receiver and the neighbours run in lock-step: in the
steady state a step lasts as long as the longer of a forward and a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Pass", "critical_path", "held_layers", "order", "play", "play_deepspeed"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "deepspeed")


@dataclass(slots=True, eq=False)
class Pass:
    """One forward or backward pass of micro-batch ``mb`` through chunk ``chunk`` of ``rank``."""

    kind: str
    mb: int
    chunk: int
    rank: int
    start: float = 0.0
    end: float = 0.0
    cause: Pass | None = None
    """The pass whose end set this start (``None``: the step's start)."""
    wait: float = 0.0
    """Seconds between ``cause``'s end and this start on the path (the send, or 0)."""


def order(schedule: str, *, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank, ``(kind, micro-batch, chunk)`` in execution order."""
    if schedule == "gpipe":
        return [
            [("F", i, c) for i in range(m) for c in range(v)]
            + [("B", i, c) for i in range(m) for c in reversed(range(v))]
            for _ in range(p)
        ]
    if schedule == "1f1b" and v == 1:
        out = []
        for r in range(p):
            warm = min(p - r - 1, m)
            ops = [("F", i, 0) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i, 0), ("B", i, 0)]
            ops += [("B", i, 0) for i in range(m - warm, m)]
            out.append(ops)
        return out
    if schedule in ("1f1b", "interleaved"):
        return [_interleaved(r, p, m, v) for r in range(p)]
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")


def held_layers(orders: list[list[tuple[str, int, int]]], counts: list[int]) -> int:
    """The most layer-micro-batches any rank holds for backward at once, walking each rank's
    order: a forward of chunk ``c`` on rank ``r`` adds the layers of virtual stage ``c p + r``
    (``counts``), its backward frees them. Chunks without layers (Llama 3's embedding-only first
    and head-only last chunk) hold none."""
    p = len(orders)
    peak = 0
    for r, ops in enumerate(orders):
        held = 0
        for kind, _, chunk in ops:
            held += counts[chunk * p + r] if kind == "F" else -counts[chunk * p + r]
            peak = max(peak, held)
    return peak


def _interleaved(r: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B on rank ``r`` (``m`` a multiple of ``p``)."""
    total = m * v

    def ident(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    ops = [("F", *ident(k, True)) for k in range(warm)]
    for j in range(total - warm):
        ops.append(("F", *ident(warm + j, True)))
        ops.append(("B", *ident(j, False)))
    ops += [("B", *ident(k, False)) for k in range(total - warm, total)]
    return ops


def play(
    orders: list[list[tuple[str, int, int]]],
    *,
    v: int,
    run: Callable[[Pass, float], float],
    send: Callable[[Pass], float],
) -> list[list[Pass]]:
    """Play the orders; ``run(pass, start)`` returns the pass's end (and may record sub-events),
    ``send(pass)`` the seconds its output takes to reach the next pass. Returns the passes per
    rank with their times."""
    p = len(orders)
    last = p * v - 1
    passes = [[Pass(kind, mb, c, r) for kind, mb, c in ops] for r, ops in enumerate(orders)]
    done: dict[tuple[str, int, int], Pass] = {}
    nxt = [0] * p
    free = [0.0] * p
    prev: list[Pass | None] = [None] * p
    remaining = sum(len(ops) for ops in passes)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(passes[r]):
                ps = passes[r][nxt[r]]
                stage = ps.chunk * p + r
                if ps.kind == "F":
                    dep = done.get(("F", stage - 1, ps.mb)) if stage > 0 else None
                    needed = stage > 0
                elif stage < last:
                    dep, needed = done.get(("B", stage + 1, ps.mb)), True
                else:
                    dep, needed = done.get(("F", stage, ps.mb)), True
                if needed and dep is None:
                    break
                ready = wait = 0.0
                if dep is not None:
                    wait = send(dep) if dep.rank != r else 0.0
                    ready = dep.end + wait
                if prev[r] is not None and free[r] >= ready:
                    ps.cause, ps.wait = prev[r], 0.0
                else:
                    ps.cause, ps.wait = dep, wait
                ps.start = max(free[r], ready)
                ps.end = run(ps, ps.start)
                free[r] = ps.end
                prev[r] = ps
                done[(ps.kind, stage, ps.mb)] = ps
                nxt[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked"
    return passes


def critical_path(end: Pass) -> list[Pass]:
    """The passes that set the step's length, first to last."""
    path = []
    node: Pass | None = end
    while node is not None:
        path.append(node)
        node = node.cause
    return path[::-1]


def _deepspeed_step(step: int, stage: int, p: int) -> tuple[int, bool]:
    """DeepSpeed's ``TrainSchedule._step_to_micro_batch``: (micro-batch, is forward)."""
    if step % 2 == stage % 2:  # even step on an even stage, odd on odd: forward
        return (step - stage % 2) // 2 - stage // 2, True
    if step % 2 == 0:  # even step, odd stage: backward
        return step // 2 - p + (stage + 1) // 2, False
    return (step - 1) // 2 - p + 1 + stage // 2, False


def _deepspeed_commands(r: int, p: int, m: int) -> list[tuple[str, int]]:
    """Rank ``r``'s instructions: ``("F"|"B", mb)`` compute, ``("send_act"|"recv_act"|
    "send_grad"|"recv_grad", mb)`` blocking exchanges, in DeepSpeed's order."""
    cmds: list[tuple[str, int]] = []
    prev = -1
    for step in range(2 * (m + p - 1)):
        mb, forward = _deepspeed_step(step, r, p)
        valid, prev_valid = 0 <= mb < m, 0 <= prev < m
        if forward:
            if valid and r > 0:
                cmds.append(("recv_act", mb))
            if prev_valid and r > 0:
                cmds.append(("send_grad", prev))
        else:
            if prev_valid and r < p - 1:
                cmds.append(("send_act", prev))
            if valid and r < p - 1:
                cmds.append(("recv_grad", mb))
        if valid:
            cmds.append(("F" if forward else "B", mb))
        prev = mb
    return cmds


_PARTNER = {
    "send_act": ("recv_act", 1),
    "recv_act": ("send_act", -1),
    "send_grad": ("recv_grad", -1),
    "recv_grad": ("send_grad", 1),
}


def play_deepspeed(
    *, p: int, m: int, run: Callable[[Pass, float], float], send: Callable[[Pass], float]
) -> list[list[Pass]]:
    """Play DeepSpeed's ``TrainSchedule`` (module docstring): a blocking exchange starts when
    both sides have reached it and ends on both after the transfer (``send(pass)`` of the pass
    whose output moves); returns the compute passes per rank with their times."""
    cmds = [_deepspeed_commands(r, p, m) for r in range(p)]
    passes: list[list[Pass]] = [[] for _ in range(p)]
    made: dict[tuple[str, int, int], Pass] = {}
    nxt, clock = [0] * p, [0.0] * p
    last: list[Pass | None] = [None] * p
    remaining = sum(len(c) for c in cmds)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(cmds[r]):
                kind, mb = cmds[r][nxt[r]]
                if kind in ("F", "B"):
                    ps = Pass(kind, mb, 0, r, cause=last[r])
                    ps.start = clock[r]
                    ps.end = clock[r] = run(ps, ps.start)
                    passes[r].append(ps)
                    made[(kind, r, mb)] = ps
                    last[r] = ps
                    nxt[r] += 1
                    remaining -= 1
                else:
                    want, step = _PARTNER[kind]
                    q = r + step
                    if nxt[q] >= len(cmds[q]) or cmds[q][nxt[q]] != (want, mb):
                        break  # the partner has not reached the exchange yet
                    src = r if kind.startswith("send") else q
                    moved = made[("F" if "act" in kind else "B", src, mb)]
                    late = r if clock[r] >= clock[q] else q
                    end = max(clock[r], clock[q]) + send(moved)
                    for side in (r, q):
                        last[side] = last[late] or last[side]  # the later arrival set the start
                        clock[side] = end
                        nxt[side] += 1
                    remaining -= 2
                progressed = True
        assert progressed, "DeepSpeed pipeline schedule deadlocked"
    return passes
