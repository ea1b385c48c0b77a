"""Run a function on N real processes (Gloo, CPU) and bring back results or failures.

Used by the test suite and usable by anyone testing distributed code::

    from torsh_distributed.testing import distributed_test, run_distributed

    @distributed_test(world_size=2, timeout=60)
    def test_all_reduce():
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert t.item() == 3

Guarantees: every rank's exception comes back with its traceback (the first failing rank is
raised, the others summarised); a per-call timeout kills all ranks and reports which ranks did not
finish plus their Python stacks (dumped by ``faulthandler`` just before the deadline); no process
is left behind. Functions are passed by module and qualified name, so they must be defined at
module level.

Results, exceptions and arguments cross the process boundary as plain ``pickle`` bytes, never as
tensors shared through ``torch.multiprocessing``'s file-descriptor passing: with the latter a rank
that exits before the parent has received its tensors takes their storage with it (the parent got
``ConnectionResetError`` in ``rebuild_storage_fd``). Bytes in the queue do not depend on the sender
staying alive. Like any ``multiprocessing`` queue this trusts the ranks: they are our own children.

Ranks start from a forkserver that has imported torch and this package once per session.
``TORSH_TEST_PRELOAD`` (comma-separated module names) adds modules to that preload: every rank
of a suite that trains through the engine would otherwise import it again, about 2 s on 2 cores.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torsh_distributed.runtime._net import free_port
from torsh_distributed.runtime.busy import usable_cores
from torsh_distributed.runtime.errors import (
    DistributedTimeoutError,
    ProcessFailureError,
    is_peer_failure,
)

__all__ = ["run_distributed", "distributed_test", "find_free_port", "RankFailedError"]

F = TypeVar("F", bound=Callable[..., Any])
_BODY_ATTR = "__torsh_distributed_body__"
# first: OpenMP's idle threads sleep instead of spinning (read once, when torch loads OpenMP)
_PRELOAD = [
    "torsh_distributed.runtime._omp_wait", "torch", "torch.distributed", "torsh_distributed",
    "torch._dynamo",  # DDP's constructor and the first optimizer step import it (~1 s per rank)
]
_PRELOAD_ENV = "TORSH_TEST_PRELOAD"
"""Extra modules for the forkserver to import once (comma-separated), read when it starts."""


class RankFailedError(ProcessFailureError, AssertionError):
    """A rank raised (or died) inside :func:`run_distributed`; the message holds its traceback.

    Subclasses ``AssertionError`` so pytest reports it as a test failure, not an error.
    """


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``: :func:`~torsh_distributed.runtime._net.free_port`
    (drawn at random outside the kernel's ephemeral range)."""
    return free_port(host)


_PORT_ATTEMPTS = 3


class _PortTakenError(RuntimeError):
    """Rank 0 could not listen on the job's port: taken since it was probed (the run is retried)."""


@dataclass(frozen=True, slots=True)
class _Task:
    module: str
    qualname: str
    call: bytes
    """``pickle.dumps((args, kwargs))``: tensors travel as bytes, not as shared file descriptors."""
    rank: int
    world_size: int
    backend: str
    master_port: int
    env: dict[str, str]
    sys_path: list[str]
    stack_file: str
    stack_after_s: float
    init: bool


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, _BODY_ATTR, obj)


def _share_cores(ranks: int) -> None:
    """The rank's torch intra-op threads: ``OMP_NUM_THREADS`` when set, else the usable cores
    divided by the ranks (the engine's default), so that the ranks of one run do not ask for more
    threads than there are cores (torch's default is every core per process; 4 ranks at 2
    threads each on 2 cores spin in OpenMP's waits: 12 % more CPU for two harness-heavy files)."""
    import torch

    torch.set_num_threads(omp_threads(os.environ) or max(1, usable_cores() // max(1, ranks)))


def omp_threads(env: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` of ``env`` as a positive int; ``None`` when unset or not one."""
    text = env.get("OMP_NUM_THREADS", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def _worker(task: _Task, results: Any) -> None:
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(task.env)
    os.environ.update(
        {
            "RANK": str(task.rank),
            "WORLD_SIZE": str(task.world_size),
            "LOCAL_RANK": str(task.rank),
            "LOCAL_WORLD_SIZE": str(task.world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(task.master_port),
        }
    )
    _share_cores(task.world_size)
    stack_out = open(task.stack_file, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.dump_traceback_later(task.stack_after_s, exit=False, file=stack_out)
    try:
        fn = _resolve(task.module, task.qualname)
        if task.init:
            from torsh_distributed.runtime import world

            try:
                world.init(backend=task.backend, timeout=max(task.stack_after_s, 5.0))
            except Exception as exc:
                if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                    raise _PortTakenError(f"port {task.master_port} is in use: {exc}") from exc
                raise
            # Every rank's connections are up before any rank runs fn: Gloo's connectFullMesh
            # returns on one rank while a slower peer is still connecting, and a rank whose fn
            # returned at once (a refusal) exited and closed its end under it ("Connection
            # closed by peer" in init, seen at load ~15).
            import torch.distributed as dist

            dist.barrier()
        args, kwargs = pickle.loads(task.call)
        value = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - say which rank returned what
            raise TypeError(
                f"rank {task.rank} returned a {type(value).__name__} that cannot be pickled "
                f"({type(exc).__name__}: {exc}); return tensors, numbers, strings or containers of them"
            ) from exc
        results.put(("ok", task.rank, payload))
        _meet_before_exit()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", task.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            from torsh_distributed.runtime import world

            world.shutdown()
        except Exception:  # noqa: BLE001 - a broken group must not mask the real result
            pass


def _meet_before_exit() -> None:
    """Hold a rank that finished until its peers finished too, before it closes its connections.

    A function whose last act creates a group (or any collective whose Gloo mesh is still being
    connected) returns on one rank while a slower peer is still connecting to it; if the fast rank
    exits then, the peer fails with "Connection reset by peer". The result is already reported:
    a peer that failed instead leaves this rank waiting until the parent stops it.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except BaseException:  # noqa: BLE001 - the result is reported; nothing may follow it
        pass


def _context() -> mp.context.BaseContext:
    method = os.environ.get("TORSH_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        extra = [m.strip() for m in os.environ.get(_PRELOAD_ENV, "").split(",") if m.strip()]
        # last: the ranks' garbage collections skip what the preload created
        ctx.set_forkserver_preload([*_PRELOAD, *extra, "torsh_distributed.runtime._gc_freeze"])
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    init: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return each rank's result.

    Args:
        fn: A module-level function (passed by name, not pickled).
        world_size: Number of ranks.
        args: Positional arguments, pickled to every rank.
        kwargs: Keyword arguments, pickled to every rank.
        timeout: Seconds for the whole run; past it every rank is killed and
            :class:`DistributedTimeoutError` names the ranks that had not finished, with stacks.
        backend: Backend for ``torsh_distributed.init`` in each rank (``"gloo"`` on CPU).
        env: Extra environment variables for the ranks.
        init: Start the process group before calling ``fn`` (and destroy it after). A rank
            whose ``fn`` returned waits at a barrier for its peers before it shuts its group
            down, so a slow peer still connecting to a group ``fn`` created is not cut off.

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results must be picklable).

    Raises:
        RankFailedError: a rank raised or died; the message holds its traceback.
        DistributedTimeoutError: not all ranks finished within ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{qualname} must be a module-level function to run on other processes")

    ctx = _context()
    try:
        call = pickle.dumps((tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"the arguments of {qualname} cannot be pickled for the ranks: {exc}"
        ) from exc
    stack_dir = Path(tempfile.mkdtemp(prefix="torsh-harness-"))
    # Stacks are dumped a little before the deadline so the parent can read them.
    stack_after = max(timeout - min(5.0, timeout * 0.2), 0.5)
    deadline = time.monotonic() + timeout
    for attempt in range(_PORT_ATTEMPTS):
        # a fresh queue and port per attempt: nothing of a retried attempt can reach this one
        results = ctx.Queue()
        port = find_free_port()
        procs = []
        for rank in range(world_size):
            task = _Task(
                module=module,
                qualname=qualname,
                call=call,
                rank=rank,
                world_size=world_size,
                backend=backend,
                master_port=port,
                env=dict(env or {}),
                sys_path=list(sys.path),
                stack_file=str(stack_dir / f"stack-rank{rank}.txt"),
                stack_after_s=stack_after,
                init=init,
            )
            proc = ctx.Process(target=_worker, args=(task, results), name=f"torsh-rank{rank}")
            proc.start()
            procs.append(proc)
        values, errors = _collect(procs, results, world_size, deadline)
        port_taken = any(s.startswith(_PortTakenError.__name__) for s, _ in errors.values())
        if not port_taken or attempt == _PORT_ATTEMPTS - 1 or time.monotonic() >= deadline:
            break  # a port taken at init: nothing of fn ran yet, so start again on another

    try:
        if errors:
            first = _root_cause(errors)
            summary, tb = errors[first]
            others = [f"  rank {r}: {errors[r][0]}" for r in sorted(errors) if r != first]
            missing = sorted(set(range(world_size)) - set(values) - set(errors))
            text = f"rank {first} of {world_size} failed: {summary}"
            if tb:
                text += f"\n--- traceback from rank {first} ---\n{tb.rstrip()}"
            if others:
                text += "\n--- other failed ranks ---\n" + "\n".join(others)
            if missing:
                text += f"\n(ranks {missing} did not finish and were stopped)"
            raise RankFailedError(text, rank=first, operation=qualname)
        if len(values) < world_size:
            missing = sorted(set(range(world_size)) - set(values))
            stacks = _read_stacks(stack_dir, missing)
            raise DistributedTimeoutError(
                f"ranks {missing} of {world_size} did not finish {qualname} within {timeout:.0f} s"
                + (f"\n--- their Python stacks ---\n{stacks}" if stacks else ""),
                operation=qualname,
                fix="look at the stacks above for the call each rank is blocked in.",
            )
        return [values[r] for r in range(world_size)]
    finally:
        for path in stack_dir.glob("*"):
            path.unlink(missing_ok=True)
        stack_dir.rmdir()


def _collect(
    procs: list[Any], results: Any, world_size: int, deadline: float
) -> tuple[dict[int, Any], dict[int, tuple[str, str]]]:
    """Gather every rank's result or error until ``deadline``, then stop the ranks."""
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    first_error_at: float | None = None
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            if first_error_at is not None and now >= first_error_at + 3.0:
                break  # peers of a failed rank usually block in a collective: do not wait
            try:
                _store(results.get(timeout=0.2), values, errors)
            except queue.Empty:
                _note_crashes(procs, results, values, errors)
            if errors and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        _reap(procs, reported={*values, *errors})
    return values, errors


def _root_cause(errors: dict[int, tuple[str, str]]) -> int:
    """The rank that failed first on its own (not because a peer vanished).

    ``errors`` is in arrival order; a rank whose error says its peer disconnected is a victim.
    """
    for rank, (summary, _) in errors.items():
        if not is_peer_failure(summary):
            return rank
    return next(iter(errors))


def _note_crashes(
    procs: list[Any], results: Any, values: dict[int, Any], errors: dict[int, tuple[str, str]]
) -> None:
    """Record ranks whose process died without reporting (segfault, ``os._exit``, OOM kill)."""
    dead = [
        r
        for r, p in enumerate(procs)
        if p.exitcode not in (None, 0) and r not in values and r not in errors
    ]
    if not dead:
        return
    time.sleep(0.2)  # a message already in flight gets a moment to arrive first
    try:
        while True:
            _store(results.get_nowait(), values, errors)
    except queue.Empty:
        pass
    for r in dead:
        if r not in values and r not in errors:
            errors[r] = (f"process exited with code {procs[r].exitcode} before reporting", "")


def _store(
    msg: tuple[Any, ...], values: dict[int, Any], errors: dict[int, tuple[str, str]]
) -> None:
    if msg[0] == "ok":
        try:
            values[msg[1]] = pickle.loads(msg[2])
        except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
            errors[msg[1]] = (
                f"its result could not be unpickled here: {type(exc).__name__}: {exc}",
                "",
            )
    else:
        errors[msg[1]] = (msg[2], msg[3])


def _reap(procs: list[Any], *, reported: set[int]) -> None:
    """Stop every rank and always join.

    Ranks that reported get 5 s to exit on their own (they are shutting their process group
    down). A rank that did not report is hung or blocked in a collective whose peer failed, and
    waiting for it would only delay the report: it gets SIGTERM at once. Then SIGKILL.
    """
    for rank, proc in enumerate(procs):
        if rank not in reported and proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(deadline - time.monotonic(), 0.01))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def _read_stacks(stack_dir: Path, ranks: list[int]) -> str:
    parts = []
    for rank in ranks:
        path = stack_dir / f"stack-rank{rank}.txt"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            parts.append(f"[rank {rank}]\n{text}")
    return "\n".join(parts)


def distributed_test(
    world_size: int = 2,
    *,
    timeout: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> Callable[[F], F]:
    """Decorate a module-level test so its body runs on ``world_size`` ranks.

    pytest fixtures requested by the test (``tmp_path``...) are resolved in the parent and passed
    to every rank, so they must be picklable.
    """

    def decorate(body: F) -> F:
        @functools.wraps(body)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(
                wrapper,
                world_size,
                args=args,
                kwargs=kwargs,
                timeout=timeout,
                backend=backend,
                env=env,
            )

        setattr(wrapper, _BODY_ATTR, body)
        return wrapper  # type: ignore[return-value]

    return decorate
