"""``horovod.run``: Horovod's programmatic launcher on our launcher machinery.

:func:`run` starts ``num_proc`` Python processes on this host, each one rank of a Gloo/NCCL job
(torchrun's variables, a ``TCPStore`` opened by rank 0 on a port the kernel picks), calls
``func(*args, **kwargs)`` on every rank and returns the list of their return values. The ranks
are supervised like the Ray and Dask launchers' (:mod:`torsh_distributed.launch._workers`): the
first rank that fails on its own is raised with its traceback, a rank that dies is named with its
exit code, ranks still running are stopped, and no process is left behind. Each rank is a fresh
``python`` (Horovod does the same), so the caller's script is not imported again and needs no
``if __name__ == "__main__"`` guard; ``func`` is pickled with cloudpickle when installed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from torsh_distributed.compat.horovod import _run_task as task
from torsh_distributed.launch import _workers
from torsh_distributed.launch._workers import DEFAULT_TIMEOUT_S, JobSpec, RankOutcome
from torsh_distributed.runtime.busy import scaled_start_timeout
from torsh_distributed.runtime.errors import DistributedTimeoutError

__all__ = ["DEFAULT_START_TIMEOUT_S", "run"]

DEFAULT_START_TIMEOUT_S = 30.0
"""Horovod's default ``start_timeout`` on a quiet host (``HOROVOD_START_TIMEOUT`` overrides it, as
in Horovod); on a busy one the default is stretched by the load
(:func:`~torsh_distributed.runtime.busy.scaled_start_timeout`)."""
_POLL_S = 0.02  # how often the job directory is looked at while waiting
_EXIT_GRACE_S = 5.0  # ranks that reported get this long to exit on their own

_ELASTIC = (
    "elastic horovod.run is not supported; run an elastic script with "
    "`torsh-dist horovodrun -np N --min-np MIN --max-np MAX python train.py` (hvd.elastic.run)"
)


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(f"horovod.run({name}=...) is not supported here: {why} (see docs/horovod.md)")


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "auto",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks of this host; return every rank's
    return value, in rank order (Horovod's ``horovod.run``).

    ``func`` calls ``hvd.init()`` (it adopts the process group the rank already has) and uses
    Horovod's API as under ``horovodrun``. Horovod's positional order of arguments is kept.

    Args:
        func: The function every rank calls; it, ``args``, ``kwargs`` and the return values must
            pickle (with cloudpickle when installed: functions of ``__main__`` travel by value).
        args: Positional arguments, the same on every rank.
        kwargs: Keyword arguments, the same on every rank.
        num_proc: Number of ranks (processes).
        min_num_proc, max_num_proc, slots, reset_limit, cooldown_range: Horovod's elastic mode:
            refused (use ``torsh-dist horovodrun`` with a script).
        hosts: ``"localhost:4"``: this host only, ``num_proc`` at most its slots.
        hostfile: Horovod's host file, naming this host only; exclusive with ``hosts``.
        start_timeout: Seconds for every rank to start (Python, torch and ``func``'s module
            imported); default ``HOROVOD_START_TIMEOUT`` or 30 s times the host's load per core
            (at least 1, at most 10: a start at load 20 on 2 cores takes ~10 times as long).
            Slow file systems need more.
        ssh_port, ssh_identity_file, disable_cache: No effect (nothing is started over ssh,
            there is no check cache): accepted with a warning.
        output_filename: Directory for each rank's output, in Horovod's layout
            ``DIR/rank.<rank>/stdout`` and ``stderr``; default: this process's streams.
        verbose: Print each rank's process id and the end of the job to stderr.
        use_gloo: Accepted: the ranks meet through torch's ``TCPStore`` (Gloo's role in
            Horovod), and use Gloo on CPU.
        use_mpi, mpi_args: Refused: there is no MPI controller.
        network_interface: Interface(s) for Gloo and NCCL (``GLOO_SOCKET_IFNAME``,
            ``NCCL_SOCKET_IFNAME``); default: loopback.
        executable: The Python interpreter of the ranks (default ``sys.executable``); it must
            import torch and torsh_distributed.
        np, min_np, max_np: Horovod's deprecated names of ``num_proc``, ``min_num_proc``,
            ``max_num_proc`` (a ``DeprecationWarning``, as in Horovod).
        timeout_s: Ours: seconds allowed for the rendezvous and for each collective. A rank
            whose peer never arrives fails after it, so a hung job ends; larger values tolerate
            longer pauses (a rank evaluating alone).
        backend: Ours: ``auto`` (NCCL when every rank has a GPU, else ``gloo+shm`` or Gloo: see
            :func:`torsh_distributed.init`), ``gloo``, ``nccl``, ``gloo+shm``.
        env: Ours: extra environment variables for the ranks (they inherit this process's).

    Returns:
        ``[return value of rank 0, of rank 1, ...]``.

    Raises:
        ValueError: an unsupported argument (named), hosts other than this one, bad values.
        TypeError: ``func`` or its arguments cannot be pickled.
        ProcessFailureError: a rank raised (its traceback in the message; the exception itself
            chained as ``__cause__`` when it pickles) or its process died.
        DistributedTimeoutError: ranks did not start within ``start_timeout``, or a rank's
            collective timed out (``timeout_s``).
    """
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
        if num_proc == 1:  # Horovod: np wins only over num_proc's default
            num_proc = np
    for old, value in (("min_np", min_np), ("max_np", max_np)):
        if value is not None:
            new = old.replace("_np", "_num_proc")
            warnings.warn(
                f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=2
            )
    elastic = {
        "min_num_proc": min_num_proc,
        "max_num_proc": max_num_proc,
        "min_np": min_np,
        "max_np": max_np,
        "slots": slots,
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
    }
    for name, value in elastic.items():
        if value is not None:
            raise _refuse(name, _ELASTIC)
    if use_mpi:
        raise _refuse("use_mpi", "there is no MPI controller; the ranks meet through a TCPStore")
    if mpi_args is not None:
        raise _refuse("mpi_args", "there is no MPI controller (mpirun is not used)")
    for name, value in (
        ("ssh_port", ssh_port),
        ("ssh_identity_file", ssh_identity_file),
        ("disable_cache", disable_cache),
    ):
        if value is not None:
            warnings.warn(
                f"horovod.run({name}=...) has no effect: the ranks start on this host, not over "
                "ssh, and there are no start-up checks to cache",
                stacklevel=2,
            )
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"horovod.run: num_proc must be an integer >= 1, got {num_proc!r}")
    _check_hosts(hosts, hostfile, num_proc)
    python = sys.executable if executable is None else executable
    if not isinstance(python, str) or not python:
        raise ValueError(f"horovod.run: executable must be a path, got {executable!r}")
    rank_env = dict(env or {})
    if network_interface:
        rank_env.setdefault("GLOO_SOCKET_IFNAME", network_interface)
        rank_env.setdefault("NCCL_SOCKET_IFNAME", network_interface)
    spec = JobSpec(
        fn=func,
        num_workers=num_proc,
        args=tuple(args),
        kwargs=dict(kwargs or {}),
        timeout_s=timeout_s,
        start_timeout_s=_start_timeout(start_timeout),
        env=rank_env,
        backend=backend,
    )
    return _Job(spec, python=python, output_dir=output_filename, verbose=bool(verbose)).run()


def _start_timeout(value: float | None) -> float:
    if value is not None:
        return value
    text = os.environ.get("HOROVOD_START_TIMEOUT")
    if text is None:  # Horovod's 30 s on a quiet host, stretched by the load on a busy one
        return scaled_start_timeout(DEFAULT_START_TIMEOUT_S)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"HOROVOD_START_TIMEOUT must be seconds, got {text!r}") from None


def _check_hosts(hosts: str | None, hostfile: str | None, num_proc: int) -> None:
    if hosts is not None and hostfile is not None:
        raise ValueError("horovod.run: pass hosts or hostfile, not both")
    if hosts is None and hostfile is None:
        return
    # horovodrun's parsers; imported here since their module loads the elastic launcher
    from torsh_distributed.compat.horovod._runner import is_local_host, parse_hostfile, parse_hosts

    listed = parse_hostfile(hostfile) if hostfile is not None else parse_hosts(hosts or "")
    name, count = listed[0]
    if len(listed) != 1 or not is_local_host(name):
        names = ", ".join(h for h, _ in listed)
        raise ValueError(
            f"horovod.run(hosts=...) names {names}: it starts its ranks on this host only (no "
            "ssh). Run a function on several hosts with torsh_distributed.launch.ray or "
            "torsh_distributed.launch.dask, or a script with `torsh-dist run` on each host"
        )
    if num_proc > count:
        raise ValueError(
            f"horovod.run: num_proc {num_proc} is more than the {count} slot(s) of {name}"
        )


class _Job:
    """One call of :func:`run`: the job directory, the rank processes and their supervision."""

    def __init__(
        self, spec: JobSpec, *, python: str, output_dir: str | None, verbose: bool
    ) -> None:
        self.spec, self.python, self.verbose = spec, python, verbose
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.dir = Path(tempfile.mkdtemp(prefix="torsh-horovod-run-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.streams: list[IO[bytes]] = []
        self.reported: set[int] = set()
        self.started_at = time.monotonic()

    def run(self) -> list[Any]:
        try:
            self._write_job()
            self._start()
            return _workers.supervise(
                self._poll, world_size=self.spec.num_workers, launcher="horovod.run"
            )
        finally:
            self._stop()

    def _write_job(self) -> None:
        _, placements = _workers.assign_ranks(["localhost"] * self.spec.num_workers)
        job = task._Job(job_id=uuid.uuid4().hex, spec=self.spec, placements=placements)
        fn = self.spec.fn
        try:
            import cloudpickle  # noqa: F401
        except ImportError:
            if getattr(fn, "__module__", None) == "__main__":
                raise TypeError(
                    "horovod.run: func is defined in __main__, which the ranks cannot import "
                    "without cloudpickle: pip install cloudpickle, or define func in a module"
                ) from None
        try:
            payload = task.dumps(list(sys.path)) + task.dumps(job)
        except Exception as exc:  # noqa: BLE001 - whatever pickling raises, one clear error
            raise TypeError(
                f"horovod.run: func, args and kwargs must pickle (as in Horovod): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        task.write_atomic(self.dir / task.JOB_FILE, payload)

    def _start(self) -> None:
        child_env = dict(os.environ)
        # The ranks import this package before reading the job: make the copy this process uses
        # importable there even when it came from sys.path rather than an installation.
        package_root = str(Path(__file__).resolve().parents[3])  # .../torsh_distributed/..
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, child_env.get("PYTHONPATH", "")) if p
        )
        width = len(str(self.spec.num_workers - 1))
        self.started_at = time.monotonic()  # start_timeout counts from the first process
        for rank in range(self.spec.num_workers):
            stdout: IO[bytes] | None = None
            stderr: IO[bytes] | None = None
            if self.output_dir is not None:  # Horovod's layout: DIR/rank.<padded rank>/stdout
                rank_dir = self.output_dir / f"rank.{str(rank).zfill(width)}"
                rank_dir.mkdir(parents=True, exist_ok=True)
                stdout = open(rank_dir / "stdout", "wb")  # noqa: SIM115 - closed in _stop
                stderr = open(rank_dir / "stderr", "wb")  # noqa: SIM115
                self.streams += [stdout, stderr]
            proc = subprocess.Popen(
                [self.python, "-c", task.ENTRY, str(self.dir), str(rank)],
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
            )
            self.procs.append(proc)
            if self.verbose:
                print(f"horovod.run: rank {rank} is process {proc.pid}", file=sys.stderr)

    def _where(self, rank: int) -> str:
        return f"process {self.procs[rank].pid} on this host"

    def _poll(self, wait: float) -> Iterable[RankOutcome]:
        """Outcomes that arrived within ``wait`` seconds: the files ranks wrote, and ranks whose
        process ended without writing one (they died). Past ``start_timeout``, ranks that have
        not started raise :class:`DistributedTimeoutError`."""
        deadline = time.monotonic() + wait
        while True:
            outcomes = []
            for rank, proc in enumerate(self.procs):
                if rank in self.reported:
                    continue
                exited = proc.poll() is not None  # before the file: a rank writes, then exits
                outcome = self._read(rank)
                if outcome is None and exited:
                    outcome = RankOutcome(
                        rank=rank,
                        ok=False,
                        died=True,
                        error=f"the process exited with {_exit_status(proc.returncode)} "
                        "before reporting",
                        where=self._where(rank),
                    )
                if outcome is not None:
                    self.reported.add(rank)
                    outcomes.append(outcome)
            if outcomes:
                return outcomes
            self._check_started()
            if time.monotonic() >= deadline:
                return []
            time.sleep(_POLL_S)  # waiting on other processes' files and exits

    def _read(self, rank: int) -> RankOutcome | None:
        path = task.outcome_file(self.dir, rank)
        if not path.exists():
            return None
        try:
            outcome = pickle.loads(path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - e.g. a class this process cannot import
            return RankOutcome(
                rank=rank,
                ok=False,
                error=f"rank {rank}'s result cannot be unpickled here: {type(exc).__name__}: {exc}",
                where=self._where(rank),
            )
        assert isinstance(outcome, RankOutcome), type(outcome)
        return outcome

    def _check_started(self) -> None:
        if time.monotonic() - self.started_at < self.spec.start_s:
            return
        late = [
            rank
            for rank in range(self.spec.num_workers)
            if rank not in self.reported and not task.ready_file(self.dir, rank).exists()
        ]
        if late:
            raise DistributedTimeoutError(
                f"horovod.run: rank(s) {', '.join(map(str, late))} did not start within "
                f"start_timeout {self.spec.start_s:g} s (Python, torch and func's module "
                "imported)",
                operation="horovod.run",
                fix="raise start_timeout (or HOROVOD_START_TIMEOUT) on a slow or busy machine.",
            )

    def _stop(self) -> None:
        """Ranks that reported get a moment to exit; the others are blocked or hung and are
        terminated at once; then every process is killed if need be and reaped."""
        for rank, proc in enumerate(self.procs):
            if rank not in self.reported and proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + _EXIT_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in self.streams:
            stream.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.verbose and self.procs:
            codes = ", ".join(_exit_status(p.returncode) for p in self.procs)
            print(f"horovod.run: ranks ended ({codes})", file=sys.stderr)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
