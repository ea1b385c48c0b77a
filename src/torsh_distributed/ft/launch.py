"""The replica-group launcher: R groups of ranks on this host, and only a dead rank's group restarts.

It starts torchft's lighthouse (the quorum service, 127.0.0.1) and the job's store (live state
between groups, :mod:`torsh_distributed.ft._transport`), then each group's ranks as one
torchrun-style world of its own (``RANK``/``WORLD_SIZE``/``MASTER_PORT`` of the group). When a
rank dies, the rest of its group is killed (their process group is broken) and the group is
started again after a back-off (``ft.backoff_s``, doubled per restart of that group); the other
groups keep their processes and step on. A group that fails more than ``ft.max_restarts`` times
is given up: the job goes on without it while ``ft.min_groups`` groups remain, and stops with
one line saying so otherwise. When every group holding live state is down at once, nothing can
heal the others: the job stops (resume from a checkpoint) instead of silently starting over.

Usage::

    python -m torsh_distributed.ft.launch --nproc 4 --replica-groups 2 script.py [args]

or ``torsh-dist train --nproc-per-node 4 --ft.replica-groups 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torsh_distributed.elastic import _warm
from torsh_distributed.ft._lighthouse import Lighthouse
from torsh_distributed.ft.config import FTConfig
from torsh_distributed.ft.replica import append_event, read_events
from torsh_distributed.runtime._net import free_port

__all__ = ["launch_groups", "main"]


def _lighthouse(section: FTConfig, on_request: Callable[[str], None]) -> Any:
    """The quorum service ``ft.lighthouse`` names, listening on 127.0.0.1 (``on_request``: a
    replica's first quorum request, told by the launcher's own service only)."""
    if section.lighthouse == "torchft":
        from torchft._torchft import LighthouseServer

        return LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=200,
            heartbeat_timeout_ms=int(section.heartbeat_timeout_s * 1000),
        )
    return Lighthouse(
        min_replicas=1,
        start_replicas=section.replica_groups,  # the first step waits for every group
        join_timeout_s=0.2,
        heartbeat_timeout_s=section.heartbeat_timeout_s,
        on_request=on_request,
    )


_PHASES = (  # (event, what the time up to it went on), in the order a restarted group emits them
    ("started", "back-off"),
    ("setup", "start-up and imports"),
    ("built", "model and group"),
    ("attached", "torchft manager"),
    ("joining", "first quorum call"),
    ("requested", "every rank's quorum call"),
    ("healed", "quorum and live state"),
)


def _phases(events: list[dict[str, object]], group: _Group, died: float) -> str:
    """Where a restarted group's rejoin went, from its event lines (seconds per phase)."""
    times = {
        e["event"]: e["time"]
        for e in events
        if e["group"] == group.index and e.get("incarnation") == group.incarnation
    }
    parts, last = [], died
    for name, what in _PHASES:
        if name in times:
            at = float(times[name])  # type: ignore[arg-type]
            parts.append(f"{what} {at - last:.1f} s")
            last = at
    return ", ".join(parts)


class _Forked:
    """A rank forked from the launcher's warm forkserver (``start_method="forkserver"``), with
    the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        import multiprocessing

        from torsh_distributed.elastic._bootstrap import run_worker

        ctx = multiprocessing.get_context("forkserver")
        # as `python ARGV[1:]` in this directory with ``env`` (see elastic._warm)
        self._proc = ctx.Process(target=run_worker, args=(dict(env), os.getcwd(), list(argv[1:])))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal), or ``None`` while it runs."""
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None and self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int | None:
        self._proc.join()
        return self._proc.exitcode


_Proc = subprocess.Popen[bytes] | _Forked


@dataclass(slots=True)
class _Group:
    index: int
    ranks: list[int]
    procs: list[_Proc] = field(default_factory=list)
    incarnation: int = 0
    restarts: int = 0
    restart_at: float | None = None  # when a back-off ends
    healthy: bool = True  # holds live state (first incarnation, or healed)
    given_up: bool = False
    done: bool = False


def launch_groups(
    argv: Sequence[str],
    *,
    nproc: int,
    section: FTConfig,
    env: Mapping[str, str] | None = None,
    write: Callable[[str], None] | None = None,
    start_method: str = "forkserver",
) -> int:
    """Run ``argv`` as ``nproc`` ranks in ``section.replica_groups`` groups; the exit status.

    Args:
        argv: The worker command (``[sys.executable, "-m", "pkg", ...]``), the same on every rank.
        nproc: Ranks in all; a multiple of the number of groups.
        section: The ``ft`` configuration (groups, restarts, back-off, minimum groups).
        env: Base environment of the workers (``os.environ`` by default); ``TORSH_FT_FAULT``
            in it injects kills (``kill:rank=R:step=S[:attempt=N]``, global rank, tests).
        write: Where the launcher's lines go (stdout by default).
        start_method: ``"forkserver"`` (the default): every rank, at the start and at each
            restart, forks from one warm process that imported torch, torchft and the engine
            once (:mod:`torsh_distributed.elastic._warm`), so a restarted group is past its
            imports at once and ``ft.spare_group`` is not needed. ``"spawn"``: a fresh
            interpreter per rank (and the spare group, if ``ft.spare_group``). A worker
            command whose interpreter is not this one always spawns.

    Raises:
        ValueError: ``nproc`` is not a multiple of the groups, or an unknown ``start_method``.
    """
    _warm.check_start_method(start_method)
    warm = start_method == "forkserver" and bool(argv) and argv[0] == sys.executable
    if warm:  # usually started by the CLI already, before it imported torch
        _warm.prestart(_warm.preload_for("torsh_distributed.train", ft=True))
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
    from torch.distributed import TCPStore

    groups_n = section.replica_groups
    section.check_nproc(nproc)
    say = write or (lambda text: print(text, flush=True))
    size = nproc // groups_n
    base = dict(os.environ if env is None else env)
    base.setdefault("RUST_LOG", "warn")  # torchft's quorum logs a few lines per step at info
    directory = tempfile.mkdtemp(prefix="torsh-ft-")
    groups = [_Group(g, list(range(g * size, (g + 1) * size))) for g in range(groups_n)]

    def requested(replica_id: str) -> None:  # "g<index>:<uuid>": every rank of it is in quorum
        group = groups[int(replica_id.split(":")[0][1:])]
        event = {"event": "requested", "group": group.index, "time": time.time()}
        append_event(directory, {**event, "incarnation": group.incarnation})

    lighthouse = _lighthouse(section, requested)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    spares: list[subprocess.Popen[bytes]] = []  # ft.spare_group: started, imported, waiting
    attached: set[tuple[int, int]] = set()  # (group, incarnation) whose manager is up

    def start_spares() -> None:
        spare_argv = [argv[0], "-m", "torsh_distributed.ft._spare", *argv[1:]]
        spares[:] = [
            subprocess.Popen(spare_argv, env=base, stdin=subprocess.PIPE) for _ in range(size)
        ]

    def start(group: _Group) -> None:
        port = free_port()  # the group's store: bound by its rank 0, drawn outside ephemeral ports
        use_spares = len(spares) == size and all(p.poll() is None for p in spares)
        group.procs = []
        for local, rank in enumerate(group.ranks):
            worker_env = {
                **base,
                "RANK": str(local),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(size),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": str(group.incarnation),
                "TORCHELASTIC_RUN_ID": f"ft-g{group.index}",
                "TORSH_FT_GROUP": str(group.index),
                "TORSH_FT_GROUPS": str(groups_n),
                "TORSH_FT_RANK": str(rank),
                "TORSH_FT_LIGHTHOUSE": lighthouse.address(),
                "TORSH_FT_STORE": f"127.0.0.1:{store.port}",
                "TORSH_FT_DIR": directory,
            }
            if warm:
                group.procs.append(_Forked(argv, worker_env))
            elif use_spares:  # hand the waiting process its rank (see ft._spare)
                proc = spares[local]
                assert proc.stdin is not None
                proc.stdin.write((json.dumps(worker_env) + "\n").encode())
                proc.stdin.close()
                group.procs.append(proc)
            else:
                group.procs.append(subprocess.Popen(list(argv), env=worker_env))
        if use_spares:
            spares.clear()
        append_event(
            directory,
            {
                "event": "started",
                "group": group.index,
                "time": time.time(),
                "incarnation": group.incarnation,
                "pids": [p.pid for p in group.procs],
                "spare": use_spares,
            },
        )

    def kill(group: _Group) -> None:
        for p in group.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in group.procs:
            p.wait()

    say(
        f"ft: {nproc} ranks in {groups_n} replica groups of {size} (lighthouse {lighthouse.address()})"
    )
    for group in groups:
        start(group)
    seen_events = 0
    status = 0
    try:
        while True:
            now = time.time()
            events = read_events(directory)
            for event in events[seen_events:]:
                if event["event"] == "attached":
                    attached.add((event["group"], event["incarnation"]))
                if event["event"] == "healed":
                    group = groups[event["group"]]
                    if event["incarnation"] == group.incarnation:
                        group.healthy = True
                        died = max(
                            (
                                e["time"]
                                for e in events
                                if e["event"] == "died" and e["group"] == group.index
                            ),
                            default=event["time"],
                        )
                        say(
                            f"ft: group {group.index} rejoined at step {event['step']}, "
                            f"{event['time'] - died:.1f} s after its rank died (live state "
                            f"from a healthy group; {_phases(events, group, died)})"
                        )
            seen_events = len(events)
            live = [g for g in groups if not (g.given_up or g.done)]
            if (
                section.spare_group
                and not warm  # a forked rank is past its imports: nothing to start ahead
                and not spares
                and live
                and all(g.healthy and (g.index, g.incarnation) in attached for g in live)
            ):  # every group is up and none is healing: the spares' imports disturb no rejoin
                start_spares()
            for group in groups:
                if group.given_up or group.done:
                    continue
                if group.restart_at is not None:
                    if now >= group.restart_at:
                        group.restart_at = None
                        start(group)
                    continue
                codes = [p.poll() for p in group.procs]
                if all(c == 0 for c in codes):
                    group.done = True
                    for other in groups:  # the job is done: a group still healing is not needed
                        if not (other.done or other.given_up or other.healthy):
                            kill(other)
                            other.done, other.restart_at = True, None
                            say(f"ft: group {other.index} had not rejoined when the job ended")
                    continue
                bad = _cause(codes)
                if bad is None:
                    continue
                code = codes[bad]
                assert code is not None
                kill(group)
                if isinstance(lighthouse, Lighthouse):
                    lighthouse.forget(f"g{group.index}")  # its processes are gone: no waiting
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
                rank = group.ranks[bad]
                append_event(
                    directory,
                    {
                        "event": "died",
                        "rank": rank,
                        "group": group.index,
                        "time": now,
                        "incarnation": group.incarnation,
                        "restarted_ranks": group.ranks,
                        "signal": how,
                    },
                )
                group.healthy = False
                alive = [g for g in groups if g.healthy and not g.given_up]
                if not alive:
                    say(
                        f"ft: rank {rank} (group {group.index}) died ({how}) and no replica group "
                        "holds live state any more (all failed at once): stopping; resume from "
                        "a checkpoint"
                    )
                    return 1
                if group.restarts >= section.max_restarts:
                    group.given_up = True
                    if isinstance(lighthouse, Lighthouse):
                        lighthouse.give_up(f"g{group.index}")
                    append_event(
                        directory, {"event": "given_up", "group": group.index, "time": now}
                    )
                    left = sum(1 for g in groups if not g.given_up)
                    if left < section.min_groups:
                        say(
                            f"ft: group {group.index} failed {group.restarts + 1} times "
                            f"(ft.max_restarts {section.max_restarts}); {left} group(s) left, "
                            f"fewer than ft.min_groups {section.min_groups}: stopping"
                        )
                        return 1
                    say(
                        f"ft: group {group.index} failed {group.restarts + 1} times "
                        f"(ft.max_restarts {section.max_restarts}): going on without it "
                        f"({left} of {groups_n} groups left)"
                    )
                    continue
                wait = section.backoff_s * 2**group.restarts
                group.restarts += 1
                group.incarnation += 1
                group.restart_at = now + wait
                say(
                    f"ft: rank {rank} (group {group.index}) died ({how}); restarting group "
                    f"{group.index} (ranks {', '.join(map(str, group.ranks))}) in {wait:.1f} s "
                    f"(restart {group.restarts} of {section.max_restarts}); the other groups "
                    "keep stepping"
                )
            if all(g.done or g.given_up for g in groups):
                status = 0 if any(g.done for g in groups) else 1
                return status
            time.sleep(0.02)
    finally:
        for group in groups:
            kill(group)
        for proc in spares:
            proc.kill()
            proc.wait()
        lighthouse.shutdown()
        shutil.rmtree(directory, ignore_errors=True)  # the event log: read by now


def _cause(codes: list[int | None]) -> int | None:
    """The index of the rank whose end failed its group, or ``None`` while none has.

    A rank ended by a signal (SIGKILL, out of memory, a crash) is the cause over peers that
    exited with an error: those exits follow from it (their collective saw the dead peer's
    socket close), and one poll can find both. Otherwise the lowest failed rank."""
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    signalled = [i for i in failed if (codes[i] or 0) < 0]
    return (signalled or failed or [None])[0]


_D = FTConfig()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torsh_distributed.ft.launch",
        description="Run a script as fault-tolerant replica groups (docs/fault-tolerance.md).",
    )
    parser.add_argument("--nproc", type=int, required=True, help="ranks in all")
    parser.add_argument("--replica-groups", type=int, required=True, help="groups R")
    parser.add_argument("--max-restarts", type=int, default=_D.max_restarts)
    parser.add_argument("--backoff-s", type=float, default=_D.backoff_s)
    parser.add_argument("--min-groups", type=int, default=_D.min_groups)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=_D.heartbeat_timeout_s)
    parser.add_argument("--lighthouse", choices=("launcher", "torchft"), default=_D.lighthouse)
    parser.add_argument(
        "--spare-group", type=lambda v: v.lower() in ("1", "true", "yes"), default=_D.spare_group
    )
    parser.add_argument("--start-method", choices=_warm.START_METHODS, default="forkserver")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    section = FTConfig(
        replica_groups=ns.replica_groups,
        max_restarts=ns.max_restarts,
        backoff_s=ns.backoff_s,
        min_groups=ns.min_groups,
        heartbeat_timeout_s=ns.heartbeat_timeout_s,
        lighthouse=ns.lighthouse,
        spare_group=ns.spare_group,
    )
    return launch_groups(
        [sys.executable, ns.script, *ns.args],
        nproc=ns.nproc,
        section=section,
        start_method=ns.start_method,
    )


if __name__ == "__main__":
    sys.exit(main())
