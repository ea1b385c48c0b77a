"""A job that changes its world size between segments: the launcher side and the job side.

torch's elastic agent keeps a node's worker count for the life of the agent; the world size
changes only when nodes join or leave. A job that wants another size on the same node (carbon-
aware scaling: more workers while the grid is clean) runs in *segments*: :func:`launch_resizing`
starts one with :func:`~torsh_distributed.elastic.launch.launch` at the size ``choose`` gives
now; the job checkpoints, appends its record to the segment log and ends with every worker
succeeding; when that record asks for a new size, the launcher starts the next segment (which
resumes from the checkpoint), else the job is done. Each segment is a full launch, with its own
restarts (``max_restarts``) should a worker fail.

The job finds its segment in the environment (:func:`current_segment`): the log's path, this
segment's index, size and range, when the launcher started it and why it chose that size. Only
the job's rank 0 writes the log, one JSON line per segment (:func:`append_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_distributed.elastic._options import LaunchOptions
from torsh_distributed.runtime._net import free_port

__all__ = [
    "SEGMENT_ENV",
    "Segment",
    "append_record",
    "current_segment",
    "launch_resizing",
    "launch_resizing_nodes",
    "read_records",
]

SEGMENT_ENV = "TORSH_RESIZE_SEGMENT"
"""Set by :func:`launch_resizing` for the workers: this segment as JSON (see :class:`Segment`)."""

Choose = Callable[[float], tuple[int, dict[str, Any]]]
"""``choose(unix time) -> (world size, why)``: the size to launch at now, and a JSON-able reason
(its ``text``, if any, is printed with the launch)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One launch of a resizing job, as its workers see it."""

    index: int
    """0 for the first launch, one more per change of size."""
    world_size: int
    sizes: list[int]
    """The sizes the job may run at, ascending."""
    launched_unix_s: float
    """When the launcher started it: the first step minus this is what a restart costs."""
    why: dict[str, Any]
    """What the launcher's ``choose`` said (for carbon scaling: the intensity)."""
    log: str
    """The segment log (JSON lines; the job's rank 0 appends one record per segment)."""

    @property
    def min_size(self) -> int:
        return self.sizes[0]

    @property
    def max_size(self) -> int:
        return self.sizes[-1]


def current_segment(environ: Mapping[str, str] | None = None) -> Segment | None:
    """This process's segment, or ``None`` when not launched by :func:`launch_resizing`."""
    raw = (os.environ if environ is None else environ).get(SEGMENT_ENV)
    if not raw:
        return None
    data = json.loads(raw)
    return Segment(**{f.name: data[f.name] for f in dataclasses.fields(Segment)})


def read_records(log: str | Path) -> list[dict[str, Any]]:
    """Every segment's record, oldest first (``[]`` when none was written)."""
    try:
        lines = Path(log).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def append_record(log: str | Path, record: Mapping[str, Any]) -> None:
    """Append one segment's record (rank 0 only; one write of one line)."""
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")


def launch_resizing(
    options: LaunchOptions,
    *,
    choose: Choose,
    sizes: Sequence[int],
    module: str,
    args: Sequence[str] = (),
    write: Callable[[str], None] = print,
) -> int:
    """Run ``python -m module args`` on this node in segments whose worker count ``choose``
    gives at each launch (see the module doc). One node only.

    Args:
        options: Launch options; ``nproc_per_node`` is replaced by each segment's size.
        choose: The size to launch at now, and why (see :data:`Choose`); one of ``sizes``.
        sizes: The worker counts the job may run at.
        module: The job's module (``python -m``).
        args: Its arguments.
        write: Prints a line (each launch's size and why).

    Returns:
        The first non-zero exit status of a segment, else 0 once a segment ends without asking
        for another size.

    Raises:
        ValueError: more than one node, or ``choose`` gave a size not in ``sizes``.
    """
    from torsh_distributed.elastic.launch import launch

    allowed = sorted(set(sizes))
    if options.max_nodes != 1:
        raise ValueError(f"resizing runs on one node, got nnodes={options.nnodes!r}")
    work = tempfile.mkdtemp(prefix="torsh-resize-")
    log = os.path.join(work, "segments.jsonl")
    try:
        index = 0
        while True:
            now = time.time()
            size, why = choose(now)
            if size not in allowed:
                raise ValueError(f"choose gave world size {size}, not one of {allowed}")
            segment = Segment(index=index, world_size=size, sizes=allowed, launched_unix_s=now,
                              why=dict(why), log=log)
            reason = why.get("text", "")
            write(f"torsh-dist: segment {index}: {size} worker(s){f' ({reason})' if reason else ''}")
            sys.stdout.flush()
            env = {**options.env, SEGMENT_ENV: json.dumps(dataclasses.asdict(segment))}
            code = launch(dataclasses.replace(options, nproc_per_node=size, env=env),
                          module=module, args=args)
            records = read_records(log)
            if code or len(records) <= index or not records[index].get("stop"):
                return code
            index += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def launch_resizing_nodes(
    options: LaunchOptions,
    *,
    choose: Choose,
    node_counts: Sequence[int],
    module: str,
    args: Sequence[str] = (),
    write: Callable[[str], None] = print,
    poll_s: float = 0.5,
) -> int:
    """The segments of :func:`launch_resizing` over whole nodes: each segment runs on the first
    N nodes (``node_rank < N``), N chosen by node 0 at each launch; the other nodes wait.

    Every node runs this with the same ``options`` except ``node_rank``. Node 0 hosts a small
    coordination store on ``master_addr:master_port`` (a ``TCPStore``, unauthenticated like every
    torch store: keep it on a private network) and publishes each segment there: its node count,
    the fresh port of its own static rendezvous, and why. The nodes of a segment launch their
    workers (``nproc_per_node`` each) on that rendezvous; when it ends, node 0 reads the job's
    segment log (the job's rank 0 runs on node 0) and publishes the next segment or the end.
    Checkpoints must be on storage every node reads (the next segment resumes from them).

    Returns:
        As :func:`launch_resizing`: node 0's first non-zero segment status (every node returns
        it), else 0.

    Raises:
        ValueError: ``choose`` gave a world size that is not a whole number of nodes in
            ``node_counts``.
        ProcessFailureError: a waiting node lost node 0's store (its launcher died).
    """
    import datetime

    import torch.distributed as dist

    from torsh_distributed.elastic.launch import launch
    from torsh_distributed.runtime.errors import ProcessFailureError

    per_node = options.nproc_per_node
    allowed = sorted(set(node_counts))
    sizes = [n * per_node for n in allowed]
    host, port, me = options.master_addr, options.master_port or 29500, options.node_rank
    store = dist.TCPStore(host, port, is_master=me == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(options.master_timeout, 60.0)))

    def run(segment: Segment, nodes: int, seg_port: int) -> int:
        env = {**options.env, SEGMENT_ENV: json.dumps(dataclasses.asdict(segment))}
        return launch(dataclasses.replace(options, nnodes=str(nodes), node_rank=me, master_port=seg_port,
                                          rdzv_endpoint=None, rdzv_backend="static", env=env),
                      module=module, args=args)

    if me == 0:
        work = tempfile.mkdtemp(prefix="torsh-resize-")
        log = os.path.join(work, "segments.jsonl")
        code, index = 1, 0  # 1 if choose() fails before any segment ran
        try:
            while True:
                now = time.time()
                size, why = choose(now)
                if size not in sizes:
                    raise ValueError(f"choose gave world size {size}, not one of {sizes} ({per_node} per node)")
                nodes = size // per_node
                segment = Segment(index=index, world_size=size, sizes=sizes, launched_unix_s=now,
                                  why=dict(why), log=log)
                seg_port = free_port(host)
                store.set(f"segment/{index}", json.dumps({"nodes": nodes, "port": seg_port,
                                                         "segment": dataclasses.asdict(segment)}))
                reason = why.get("text", "")
                write(f"torsh-dist: segment {index}: {nodes} node(s) x {per_node} worker(s)"
                      f"{f' ({reason})' if reason else ''}")
                sys.stdout.flush()
                code = run(segment, nodes, seg_port)
                records = read_records(log)
                if code or len(records) <= index or not records[index].get("stop"):
                    break
                index += 1
        finally:
            store.set("end", json.dumps({"code": code}))  # after every segment key: see below
            deadline = time.monotonic() + 30.0  # keep the store up until the others read the end
            while time.monotonic() < deadline and store.add("followers_done", 0) < max(allowed) - 1:
                time.sleep(poll_s)
            shutil.rmtree(work, ignore_errors=True)
        return code

    def ask(op: Callable[[], Any]) -> Any:
        try:
            return op()
        except (RuntimeError, dist.DistStoreError) as exc:  # node 0's launcher has ended
            raise ProcessFailureError(
                f"node {me}: lost node 0's segment store at {host}:{port} ({exc}); its launcher has ended"
            ) from None

    index = 0
    while True:  # a segment may run for hours: poll node 0's store
        key = f"segment/{index}"
        if ask(lambda key=key: store.check([key])):
            data = json.loads(ask(lambda key=key: store.get(key)))
            if me < data["nodes"]:
                write(f"torsh-dist: node {me}: segment {index}: joins {data['nodes']} node(s)")
                sys.stdout.flush()
                run(Segment(**data["segment"]), data["nodes"], data["port"])  # node 0 reports its status
            else:
                write(f"torsh-dist: node {me}: segment {index}: waits ({data['nodes']} node(s) run it)")
                sys.stdout.flush()
            index += 1
        elif ask(lambda: store.check(["end"])):  # set after the last segment's key: none is missed
            code = int(json.loads(ask(lambda: store.get("end")))["code"])
            ask(lambda: store.add("followers_done", 1))
            return code
        else:
            time.sleep(poll_s)


