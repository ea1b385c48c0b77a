"""Ray side of :func:`torsh_distributed.launch.ray`: one actor per rank in a placement group.

The placement group reserves every rank's resources at once (all or nothing), so two jobs that
each got half of a cluster cannot wait on each other forever; when the reservation does not come
within ``start_timeout_s`` the error lists what the cluster has free. Actors are created with
``max_restarts=0`` (a restarted actor would rejoin a process group that no longer exists) and are
killed when the call ends, whatever the outcome, so no rank outlives it.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torsh_distributed.launch import _workers
from torsh_distributed.launch._workers import JobSpec, Placement, RankOutcome
from torsh_distributed.runtime.errors import DistributedTimeoutError, ProcessFailureError

__all__ = ["PLACEMENT_STRATEGIES", "RayOptions", "import_ray", "run"]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RayOptions:
    """How the job sits on Ray (validated at construction)."""

    address: str | None = None
    """``None``: the running Ray session, else ``RAY_ADDRESS``, else a new local cluster sized
    for the job (shut down at the end). A string: ``ray.init(address=...)`` (e.g. ``"auto"``,
    ``"ray://head:10001"``), disconnected at the end."""
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources of each rank's actor (``CPU``, ``GPU``, custom ones). Fractions let more
    ranks share a core (``{"CPU": 0.5}``)."""
    placement_strategy: str = "PACK"
    """Placement-group strategy: ``PACK`` (few nodes), ``SPREAD``, ``STRICT_PACK`` (one node) or
    ``STRICT_SPREAD`` (one rank per node)."""

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ValueError(f"address must be a non-empty str or None, got {self.address!r}")
        resources = self.resources_per_worker
        if not isinstance(resources, Mapping) or not resources:
            raise ValueError(
                f"resources_per_worker must be a non-empty mapping such as {{'CPU': 1}}, "
                f"got {resources!r}"
            )
        for key, amount in resources.items():
            if (
                not isinstance(key, str)
                or isinstance(amount, bool)
                or not isinstance(amount, (int, float))
            ):
                raise ValueError(
                    f"resources_per_worker must map str to numbers, got {key!r}: {amount!r}"
                )
            if not (math.isfinite(amount) and amount >= 0):
                raise ValueError(f"resources_per_worker[{key!r}] must be >= 0, got {amount}")
        if not any(resources.values()):
            raise ValueError("resources_per_worker must ask for something (e.g. {'CPU': 1})")
        object.__setattr__(
            self, "resources_per_worker", {k: float(v) for k, v in resources.items()}
        )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {self.placement_strategy!r}"
            )


def import_ray() -> Any:
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "torsh_distributed.launch.ray needs Ray, which is not installed: "
            "pip install 'torsh-distributed[ray]'"
        ) from exc
    return ray


class RankActor:
    """The process of one rank (made a Ray actor by :func:`run`)."""

    def __init__(self) -> None:
        self._spec: JobSpec | None = None

    def prepare(self, spec: JobSpec) -> tuple[str, str, int]:
        """Keep ``spec`` (its imports done); return ``(node address, host name, pid)``."""
        import ray

        self._spec = spec
        host, pid = _workers.prepare(spec)
        return ray.util.get_node_ip_address(), host, pid

    def open_store(self, job_id: str, host: str, world_size: int, timeout_s: float) -> int:
        return _workers.open_store(job_id, host, world_size, timeout_s)

    def run(self, job_id: str, placement: Placement, where: str) -> RankOutcome:
        assert self._spec is not None, "prepare() first"
        # the driver kills this actor after the job: a failed rank need not wait for its teardown
        return _workers.run_rank(
            job_id, placement, self._spec, where, cleanup_wait_s=_workers.CLEANUP_WAIT_S
        )


def _connect(ray: Any, spec: JobSpec, options: RayOptions) -> bool:
    """Start or join Ray; True when this call must shut it down (or disconnect) at the end."""
    if ray.is_initialized():
        if options.address is not None:
            warnings.warn(
                f"Ray is already initialised in this process: address={options.address!r} is "
                "ignored (call ray.shutdown() first to connect elsewhere)",
                stacklevel=4,
            )
        return False
    if options.address is not None or os.environ.get("RAY_ADDRESS"):
        ray.init(address=options.address, log_to_driver=True)
        return True
    cpus = options.resources_per_worker.get("CPU", 0.0) * spec.num_workers
    ray.init(
        num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)),
        include_dashboard=False,
        log_to_driver=True,
    )
    return True


def run(spec: JobSpec, options: RayOptions) -> list[Any]:
    """Run ``spec`` on Ray as :func:`torsh_distributed.launch.ray` documents."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    owned = _connect(ray, spec, options)
    deadline = time.monotonic() + spec.start_s  # until every rank is ready to rendezvous
    group = None
    actors: list[Any] = []
    try:
        resources = dict(options.resources_per_worker)
        group = placement_group([resources] * spec.num_workers, strategy=options.placement_strategy)
        ready, _ = ray.wait([group.ready()], timeout=_left(deadline))
        if not ready:
            raise DistributedTimeoutError(
                f"Ray could not reserve {spec.num_workers} worker(s) x {resources} "
                f"({options.placement_strategy}) within {spec.start_s:g} s; free now: "
                f"{ray.available_resources()}",
                operation="launch.ray",
                fix="lower num_workers or resources_per_worker, add nodes, or raise "
                "start_timeout_s.",
            )
        actor_class = ray.remote(RankActor)
        extra = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        for index in range(spec.num_workers):
            actors.append(
                actor_class.options(
                    num_cpus=resources.get("CPU", 0.0),
                    num_gpus=resources.get("GPU", 0.0),
                    resources=extra or None,
                    max_restarts=0,
                    max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=index
                    ),
                ).remote()
            )
        spec_ref = ray.put(spec)  # one copy in the object store, not one per actor call
        described = _get(ray, [a.prepare.remote(spec_ref) for a in actors], deadline, "start")
        order, placements = _workers.assign_ranks([node for node, _, _ in described])
        actors = [actors[i] for i in order]
        wheres = [f"Ray actor pid {described[i][2]} on {described[i][0]}" for i in order]
        job_id = uuid.uuid4().hex
        master = placements[0].master_addr
        [port] = _get(
            ray,
            [actors[0].open_store.remote(job_id, master, spec.num_workers, spec.timeout_s)],
            deadline,
            "open the rendezvous store on rank 0",
        )
        refs = {
            actors[p.rank].run.remote(job_id, _with_port(p, port), wheres[p.rank]): p.rank
            for p in placements
        }
        return _workers.supervise(
            _poller(ray, refs, wheres), world_size=spec.num_workers, launcher="ray"
        )
    finally:  # no rank outlives the call, whatever happened; each step even if one fails
        for actor in actors:
            _cleanup(ray.kill, actor, no_restart=True)
        if group is not None:
            _cleanup(remove_placement_group, group)
        if owned:
            _cleanup(ray.shutdown)


def _cleanup(step: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        step(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - cleanup must go on; the job's error matters more
        log.warning(
            "launch.ray: %s failed during cleanup: %s", getattr(step, "__name__", step), exc
        )


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _with_port(placement: Placement, port: int) -> Placement:
    import dataclasses

    return dataclasses.replace(placement, master_port=port)


def _get(ray: Any, refs: list[Any], deadline: float, what: str) -> list[Any]:
    try:
        return ray.get(refs, timeout=_left(deadline))
    except ray.exceptions.GetTimeoutError:
        raise DistributedTimeoutError(
            f"Ray workers did not {what} within start_timeout_s",
            operation="launch.ray",
            fix="check the cluster's health (`ray status`) or raise start_timeout_s.",
        ) from None
    except ray.exceptions.RayError as exc:  # e.g. fn's module is not importable there
        raise ProcessFailureError(
            f"Ray workers failed to {what}: {type(exc).__name__}: {exc}",
            operation="launch.ray",
            fix="fn, its module and its arguments must be importable on the workers (install "
            "the package there, or give ray.init a runtime_env with PYTHONPATH or py_modules).",
        ) from exc


def _poller(
    ray: Any, refs: dict[Any, int], wheres: list[str]
) -> Callable[[float], Iterable[RankOutcome]]:
    pending = list(refs)

    def poll(timeout: float) -> Iterable[RankOutcome]:
        nonlocal pending
        if not pending:
            return []
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
        outcomes = []
        for ref in ready:
            rank = refs[ref]
            try:
                outcomes.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:  # the process is gone
                outcomes.append(
                    RankOutcome(
                        rank=rank,
                        ok=False,
                        died=True,
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                        where=wheres[rank],
                    )
                )
            except Exception as exc:  # noqa: BLE001 - e.g. a result that would not pickle
                outcomes.append(
                    RankOutcome(
                        rank=rank,
                        ok=False,
                        error=f"{type(exc).__name__}: {exc}",
                        where=wheres[rank],
                    )
                )
        return outcomes

    return poll
