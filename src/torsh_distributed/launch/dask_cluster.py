"""Run a training function on N workers of a Dask cluster: :func:`dask`.

Exported as ``torsh_distributed.launch.dask``; see docs/ray-dask.md. Needs the ``dask`` extra
(``pip install 'torsh-distributed[dask]'``), imported only when :func:`dask` is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from torsh_distributed.launch._workers import DEFAULT_TIMEOUT_S, JobSpec

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["dask"]

T = TypeVar("T")


def dask(
    fn: Callable[..., T],
    *,
    num_workers: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float | None = None,
    client: Client | None = None,
    address: str | None = None,
    env: Mapping[str, str] | None = None,
    backend: str = "auto",
) -> list[T]:
    """Call ``fn(*args, **kwargs)`` as every rank of a ``num_workers``-rank job on Dask workers.

    Each rank is one task pinned to its own worker process (never two ranks in one process,
    never moved to another worker), with torchrun's variables set (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ...) and the default process group already started, so
    ``fn`` may be any code written for ``torsh-dist run``. Rank 0 opens the rendezvous store on
    a port the kernel picks, bound to ``127.0.0.1`` when all ranks share a host and to rank 0's
    host otherwise. Workers must be processes (Dask's default ``LocalCluster(processes=True)``,
    or ``dask worker`` processes), one thread or more each.

    Args:
        fn: The function every rank calls; it must pickle (functions of importable modules
            travel by reference, so the workers must be able to import them).
        num_workers: Number of ranks; the cluster needs at least this many workers (idle ones
            are preferred).
        args: Positional arguments of ``fn``, the same on every rank.
        kwargs: Keyword arguments of ``fn``.
        timeout_s: Seconds allowed for the rendezvous and for each collective. A rank that hangs
            makes its peers fail after this long, so the call returns within about
            ``timeout_s`` + 10 s of the fault (a dead worker is noticed within about a second);
            too small a value fails slow but healthy steps.
        start_timeout_s: Seconds allowed from the call until every rank is ready to rendezvous:
            enough workers, and ``fn``'s imports done on each. ``None``: ``timeout_s`` or 300 s,
            whichever is longer (a short ``timeout_s`` does not shorten the start on a busy
            cluster).
        client: A connected ``distributed.Client`` to use (left open). Ranks still running when
            the job fails are stopped by ending their worker processes, which their nannies
            replace (``dask worker`` and ``LocalCluster(processes=True)`` have nannies; a
            worker without one is left to time out, with a warning).
        address: A scheduler address to connect to instead (``"tcp://host:8786"``).
            With neither ``client`` nor ``address``, a ``LocalCluster`` of ``num_workers``
            single-threaded worker processes on ``127.0.0.1`` is started and closed at the end.
        env: Environment variables set on every rank for the call (not the layout variables);
            restored afterwards, since Dask workers outlive the call.
        backend: ``auto``, ``gloo``, ``nccl`` or ``gloo+shm`` (see :func:`torsh_distributed.init`).

    Returns:
        ``fn``'s return value of every rank, in rank order.

    Raises:
        TypeError / ValueError: bad arguments, before anything starts.
        ImportError: Dask's ``distributed`` is not installed.
        ProcessFailureError: a rank raised, or its worker died; the message names the
            root-cause rank and its worker, with its traceback, and ``__cause__`` is the rank's
            exception when it could be sent back. Every other rank is stopped first.
        DistributedTimeoutError: too few (idle) workers within ``start_timeout_s``, or the root
            cause is a rank that timed out waiting for its peers (rendezvous or collective,
            ``timeout_s``).

    Example::

        from torsh_distributed import launch
        from torsh_distributed.train.config import preset
        from torsh_distributed.train.trainer import train

        results = launch.dask(train, num_workers=2, args=(preset("tiny"),), timeout_s=120)
        print(results[0].final_loss)
    """
    from torsh_distributed.launch import _dask_backend

    spec = JobSpec(
        fn=fn,
        num_workers=num_workers,
        args=args,
        kwargs={} if kwargs is None else kwargs,
        timeout_s=timeout_s,
        start_timeout_s=start_timeout_s,
        env={} if env is None else env,
        backend=backend,
    )
    options = _dask_backend.DaskOptions(client=client, address=address)
    return _dask_backend.run(spec, options)
