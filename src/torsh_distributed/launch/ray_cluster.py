"""Run a training function on N workers of a Ray cluster: :func:`ray`.

Exported as ``torsh_distributed.launch.ray``; see docs/ray-dask.md. Needs the ``ray`` extra
(``pip install 'torsh-distributed[ray]'``), imported only when :func:`ray` is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from torsh_distributed.launch._workers import DEFAULT_TIMEOUT_S, JobSpec

__all__ = ["ray"]

T = TypeVar("T")


def ray(
    fn: Callable[..., T],
    *,
    num_workers: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float | None = None,
    address: str | None = None,
    resources_per_worker: Mapping[str, float] | None = None,
    placement_strategy: str = "PACK",
    env: Mapping[str, str] | None = None,
    backend: str = "auto",
) -> list[T]:
    """Call ``fn(*args, **kwargs)`` as every rank of a ``num_workers``-rank job on Ray actors.

    Each rank runs in its own actor process with torchrun's variables set (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) and the default process group already
    started, so ``fn`` may be any code written for ``torsh-dist run``: the built-in trainer
    (``torsh_distributed.train.trainer.train``), an engine's ``fit``, raw collectives. Rank 0
    opens the rendezvous store on a port the kernel picks, bound to ``127.0.0.1`` when all ranks
    share a node (Gloo then uses loopback too) and to rank 0's node address otherwise.

    Args:
        fn: The function every rank calls; it must pickle. Functions of importable modules
            travel by reference (the workers import them); those of ``__main__`` by value.
        num_workers: Number of ranks, one actor each.
        args: Positional arguments of ``fn``, the same on every rank.
        kwargs: Keyword arguments of ``fn``.
        timeout_s: Seconds allowed for the rendezvous and for each collective. A rank that hangs
            makes its peers fail after this long, so the call returns within about
            ``timeout_s`` + 10 s of the fault (a dead worker is noticed within about a second);
            too small a value fails slow but healthy steps (a long checkpoint write on one rank
            while the others wait).
        start_timeout_s: Seconds allowed from the call until every rank is ready to rendezvous:
            the reservation of the workers' resources, the actors' start and ``fn``'s imports.
            ``None``: ``timeout_s`` or 300 s, whichever is longer
            (a short ``timeout_s`` does not shorten the start on a busy cluster).
        address: ``None``: the running Ray session, else ``RAY_ADDRESS``, else a new local
            cluster with enough CPUs for the job, shut down at the end. Otherwise passed to
            ``ray.init(address=...)``.
        resources_per_worker: Ray resources of each actor, default ``{"CPU": 1}``; fractions
            let several ranks share a core, ``{"GPU": 1}`` gives each rank a GPU (NCCL with
            ``backend="auto"``).
        placement_strategy: How the ranks' reservation spreads over nodes: ``PACK`` (default),
            ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
        env: Environment variables set on every rank for the call (not the layout variables).
        backend: ``auto``, ``gloo``, ``nccl`` or ``gloo+shm`` (see :func:`torsh_distributed.init`).

    Returns:
        ``fn``'s return value of every rank, in rank order.

    Raises:
        TypeError / ValueError: bad arguments, before anything starts.
        ImportError: Ray is not installed.
        ProcessFailureError: a rank raised, or its process died (killed, crashed, node lost);
            the message names the root-cause rank and its worker, with its traceback, and
            ``__cause__`` is the rank's exception when it could be sent back. Every other rank
            is stopped first.
        DistributedTimeoutError: the workers could not be placed and started within
            ``start_timeout_s``, or the root cause is a rank that timed out waiting for its peers
            (rendezvous or collective, ``timeout_s``).

    Example::

        from torsh_distributed import launch
        from torsh_distributed.train.config import preset
        from torsh_distributed.train.trainer import train

        results = launch.ray(train, num_workers=2, args=(preset("tiny"),), timeout_s=120)
        print(results[0].final_loss)
    """
    from torsh_distributed.launch import _ray_backend

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
    options = _ray_backend.RayOptions(
        address=address,
        resources_per_worker={"CPU": 1.0} if resources_per_worker is None else resources_per_worker,
        placement_strategy=placement_strategy,
    )
    return _ray_backend.run(spec, options)
