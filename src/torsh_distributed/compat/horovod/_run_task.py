"""One rank of :func:`torsh_distributed.horovod.run`: a process started as
``python -c "<ENTRY>" JOB_DIR RANK`` (:data:`ENTRY` calls :func:`main`; not ``python -m``, which
would load this module a second time as ``__main__`` and its classes would not match the job's).

The driver (:mod:`._launch`) wrote ``JOB_DIR/job.pkl``: the driver's ``sys.path``, then the job
(:class:`_Job`, pickled with cloudpickle when it is installed). This process

1. loads the job and touches ``ready.RANK`` (its start-up is over: imports done);
2. rank 0 opens the rendezvous store on a port the kernel picks and writes it to ``port``; the
   other ranks wait for that file;
3. runs the function through :func:`~torsh_distributed.launch._workers.run_rank` (torchrun's
   variables set, process group started with the job's timeout and always destroyed);
4. writes its :class:`~torsh_distributed.launch._workers.RankOutcome` as pickled bytes to
   ``rank.RANK.out`` (written aside, then renamed: the driver never reads half a file).

Results travel as bytes in a file, never as a tensor shared by file descriptor through a
``torch.multiprocessing`` queue: a rank may exit before the driver reads, and the result survives.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_distributed.launch import _workers
from torsh_distributed.launch._workers import JobSpec, Placement, RankOutcome

__all__ = [
    "ENTRY",
    "JOB_FILE",
    "PORT_FILE",
    "dumps",
    "main",
    "outcome_file",
    "ready_file",
    "write_atomic",
]

ENTRY = (
    "import sys; from torsh_distributed.compat.horovod._run_task import main; "
    "sys.exit(main(sys.argv[1:]))"
)
"""The ``python -c`` program of a rank (arguments: the job directory and the rank)."""
JOB_FILE = "job.pkl"
PORT_FILE = "port"
_PORT_POLL_S = 0.02
_CLEANUP_S = 30.0  # how long a rank's process waits for its group's teardown after its outcome


@dataclass(frozen=True, slots=True)
class _Job:
    """What every rank of one call runs."""

    job_id: str
    spec: JobSpec
    placements: list[Placement]


def dumps(obj: Any) -> bytes:
    """Pickle with cloudpickle when installed (functions of ``__main__`` and closures travel by
    value), else with pickle (functions travel by module and name)."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return bytes(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def ready_file(job_dir: Path, rank: int) -> Path:
    return job_dir / f"ready.{rank}"


def outcome_file(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank.{rank}.out"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path``, then rename: readers see nothing or everything."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _wait_for_port(job_dir: Path, deadline: float) -> int:
    path = job_dir / PORT_FILE
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                "rank 0 did not open the rendezvous store within start_timeout "
                f"({path} never appeared)"
            )
        time.sleep(_PORT_POLL_S)  # a file written by another process: nothing to block on
    return int(path.read_text())


def _encode(outcome: RankOutcome) -> bytes:
    """The outcome as bytes; a return value that cannot be pickled becomes this rank's error."""
    try:
        return dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported, not raised
        what = "return value" if outcome.ok else "exception"
        failed = RankOutcome(
            rank=outcome.rank,
            ok=False,
            error=outcome.error
            or f"TypeError: rank {outcome.rank}'s {what} cannot be pickled back to the "
            f"caller ({type(exc).__name__}: {exc}); return picklable values (tensors, numbers, "
            "dicts, lists)",
            traceback=outcome.traceback,
            where=outcome.where,
        )
        return pickle.dumps(failed)


def main(argv: list[str]) -> int:
    """Run one rank; always write an outcome (exit code 0) unless the process itself dies."""
    job_dir, rank = Path(argv[0]), int(argv[1])
    started = time.monotonic()
    where = f"process {os.getpid()} on {socket.gethostname()}"
    try:
        with open(job_dir / JOB_FILE, "rb") as f:
            data = f.read()
        stream = io.BytesIO(data)
        for entry in reversed(pickle.load(stream)):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        job = pickle.load(stream)  # imports func's module (and cloudpickle's by-value code)
        assert isinstance(job, _Job), type(job)
        write_atomic(ready_file(job_dir, rank), b"")
        placement = job.placements[rank]
        spec = job.spec
        if rank == 0:
            port = _workers.open_store(
                job.job_id, placement.master_addr, spec.num_workers, spec.timeout_s
            )
            write_atomic(job_dir / PORT_FILE, str(port).encode())
        else:
            port = _wait_for_port(job_dir, started + spec.start_s)
        placement = dataclasses.replace(placement, master_port=port)
        outcome = _workers.run_rank(  # this process ends after the job: see finish_cleanup below
            job.job_id, placement, spec, where, cleanup_wait_s=_workers.CLEANUP_WAIT_S
        )
    except BaseException as exc:  # noqa: BLE001 - start-up failures are this rank's outcome too
        outcome = RankOutcome(
            rank=rank,
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
            where=where,
        )
    write_atomic(outcome_file(job_dir, rank), _encode(outcome))
    if not _workers.finish_cleanup(_CLEANUP_S):  # a failed rank's teardown, still running
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)  # the outcome is written; an exit under torch's teardown could crash
    return 0
