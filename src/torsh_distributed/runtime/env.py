"""Detect the job's layout (rank, world size, local rank, node, master) from the environment.

Each launcher publishes the layout differently. A :class:`ClusterEnvironment` reads one of them;
:func:`detect_environment` tries them in a fixed order: torchrun / ``torsh-dist run`` (``RANK``,
``WORLD_SIZE``, ...), then SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, ...), then Open MPI
(``OMPI_COMM_WORLD_*``). Torchrun's variables win because ``srun torchrun ...`` sets both and the
per-process values are torchrun's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torsh_distributed.runtime.errors import ConfigurationError, RankOutOfRangeError

__all__ = [
    "environ_set",
    "WorldInfo",
    "ClusterEnvironment",
    "TorchrunEnvironment",
    "SlurmEnvironment",
    "MPIEnvironment",
    "detect_environment",
    "expand_slurm_nodelist",
    "DEFAULT_MASTER_PORT",
]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes of this node; selects the device."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node, ``0 <= node_rank < num_nodes``."""
    master_addr: str | None = None
    """Host of the rendezvous store (rank 0's TCP store), if the launcher named one."""
    master_port: int | None = None
    """Port of the rendezvous store."""
    source: str = "explicit"
    """Which environment this came from: ``torchrun``, ``slurm``, ``mpi`` or ``explicit``."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise RankOutOfRangeError(
                f"rank {self.rank} is out of range for world_size {self.world_size} "
                f"(from {self.source})",
                operation="init",
                fix="give each process a distinct rank in [0, world_size).",
            )
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise RankOutOfRangeError(
                f"local_rank {self.local_rank} is out of range for local_world_size "
                f"{self.local_world_size} (from {self.source})",
                operation="init",
            )
        if self.node_rank < 0:
            raise ValueError(f"node_rank must be >= 0, got {self.node_rank} (from {self.source})")


@runtime_checkable
class ClusterEnvironment(Protocol):
    """Reads the job layout published by one kind of launcher."""

    name: str

    def detect(self, env: Mapping[str, str]) -> bool:
        """True when ``env`` was set by this launcher."""
        ...

    def world_info(self, env: Mapping[str, str]) -> WorldInfo:
        """The layout; raises :class:`ConfigurationError` naming the missing or bad variable."""
        ...


def _int(env: Mapping[str, str], key: str, source: str) -> int:
    raw = env.get(key)
    if raw is None:
        raise ConfigurationError(
            f"environment variable {key} is not set but {source} variables are present",
            operation="init",
            fix=f"launch with a {source} launcher that sets {key}, or pass rank/world_size to init().",
        )
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"environment variable {key}={raw!r} is not an integer", operation="init"
        ) from None


def _port(env: Mapping[str, str]) -> int | None:
    raw = env.get("MASTER_PORT")
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ConfigurationError(f"MASTER_PORT={raw!r} is not an integer", operation="init") from None
    if not 0 < port < 65536:
        raise ConfigurationError(f"MASTER_PORT={port} is not a valid TCP port", operation="init")
    return port


class TorchrunEnvironment:
    """``torchrun``, ``torsh-dist run`` and torch's elastic agent: ``RANK``, ``WORLD_SIZE``, ..."""

    name = "torchrun"

    def detect(self, env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    def world_info(self, env: Mapping[str, str]) -> WorldInfo:
        rank = _int(env, "RANK", self.name)
        world = _int(env, "WORLD_SIZE", self.name)
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world if "LOCAL_RANK" not in env else 1)))
        if "GROUP_RANK" in env:
            node_rank = int(env["GROUP_RANK"])
        elif "NODE_RANK" in env:
            node_rank = int(env["NODE_RANK"])
        else:
            node_rank = rank // max(local_world, 1)
        return WorldInfo(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            node_rank=node_rank,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_port(env),
            source=self.name,
        )


_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_tasks_per_node(spec: str, node_id: int) -> int:
    """Parse ``SLURM_TASKS_PER_NODE`` (e.g. ``"2(x3),1"``) and return the count for ``node_id``."""
    index = 0
    for part in spec.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if not match:
            raise ConfigurationError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}", operation="init")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node_id < index + repeat:
            return count
        index += repeat
    raise ConfigurationError(
        f"SLURM_NODEID={node_id} is beyond SLURM_TASKS_PER_NODE={spec!r}", operation="init"
    )


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``"gpu[01-03,07],login1"`` into host names."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


class SlurmEnvironment:
    """``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ...

    The master is ``MASTER_ADDR`` if set, else the first host of the step's node list
    (``SLURM_STEP_NODELIST``, where rank 0 runs; the job's list only outside a step); the port is
    ``MASTER_PORT`` if set, else :meth:`job_port`.
    """

    name = "slurm"

    PORT_BASE, PORT_SPAN = 15000, 17000
    """:meth:`job_port` lands in ``[15000, 32000)``: below Linux's ephemeral ports (32768+), so a
    port the kernel hands to a client cannot sit on it."""

    @classmethod
    def job_port(cls, job_id: int, step_id: int = 0) -> int:
        """``15000 + (job_id + 1000 * step_id) % 17000``, the same on every task of a step.

        Jobs whose ids differ by less than 17,000 never share a port, and neither do up to 17
        concurrent steps of one job (``srun ... & srun ... & wait``).
        """
        return cls.PORT_BASE + (job_id + 1000 * step_id) % cls.PORT_SPAN

    def detect(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    def world_info(self, env: Mapping[str, str]) -> WorldInfo:
        rank = _int(env, "SLURM_PROCID", self.name)
        world = _int(env, "SLURM_NTASKS", self.name)
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        node_rank = int(env.get("SLURM_NODEID", "0"))
        if "SLURM_TASKS_PER_NODE" in env:
            local_world = _slurm_tasks_per_node(env["SLURM_TASKS_PER_NODE"], node_rank)
        elif "SLURM_NTASKS_PER_NODE" in env:
            local_world = _int(env, "SLURM_NTASKS_PER_NODE", self.name)
        else:
            local_world = world // max(int(env.get("SLURM_NNODES", "1")), 1)
        master = env.get("MASTER_ADDR")
        if master is None:
            nodelist = (
                env.get("SLURM_STEP_NODELIST")
                or env.get("SLURM_NODELIST")  # srun sets it to the step's list too
                or env.get("SLURM_JOB_NODELIST")
            )
            if nodelist:
                master = expand_slurm_nodelist(nodelist)[0]
        port = _port(env)
        if port is None and "SLURM_JOB_ID" in env:
            step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
            port = self.job_port(
                _int(env, "SLURM_JOB_ID", self.name), int(step) if step.isdigit() else 0
            )
        return WorldInfo(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=max(local_world, 1),
            node_rank=node_rank,
            master_addr=master,
            master_port=port,
            source=self.name,
        )


class MPIEnvironment:
    """Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.

    Open MPI publishes no rendezvous address. ``MASTER_ADDR`` (and ``MASTER_PORT``) exported to
    every rank (``mpirun -x MASTER_ADDR=host0 ...``) wins; without it :func:`~torsh_distributed.
    runtime.init` derives one (``runtime/_mpi.py``) from :meth:`single_node` and
    :meth:`job_port`, which only read variables, as detection must. The node index assumes
    by-slot (block) placement.
    """

    name = "mpi"

    JOB_ID_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")
    """Variables naming the job, the same on every rank and different for each ``mpirun``: PMIx's
    namespace (Open MPI 4 and 5), then Open MPI 4's job id."""
    PORT_RANGE = (20000, 32000)
    """Where :meth:`job_port` lands: above most registered services, below Linux's ephemeral
    ports (32768+), so a port the kernel hands out to a client cannot sit on it."""

    def detect(self, env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env

    def world_info(self, env: Mapping[str, str]) -> WorldInfo:
        rank = _int(env, "OMPI_COMM_WORLD_RANK", self.name)
        world = _int(env, "OMPI_COMM_WORLD_SIZE", self.name)
        local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        return WorldInfo(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            node_rank=rank // max(local_world, 1),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_port(env),
            source=self.name,
        )

    @staticmethod
    def single_node(env: Mapping[str, str]) -> bool:
        """True when every rank of the job runs on this node.

        Open MPI 4's daemon count (``OMPI_MCA_orte_num_nodes``) decides when present; otherwise
        all ranks are local when ``OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE``. A job
        whose layout is unknown counts as several nodes, the case that needs a real address.
        """
        nodes = env.get("OMPI_MCA_orte_num_nodes", "")
        if nodes.isdigit():
            return int(nodes) == 1
        size, local = env.get("OMPI_COMM_WORLD_SIZE", ""), env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
        return size.isdigit() and size == local

    @classmethod
    def job_port(cls, env: Mapping[str, str]) -> int | None:
        """A port derived from the job's identity, the same on every rank; ``None`` without one.

        Two jobs on one node get different ports unless their ids collide in the
        :attr:`PORT_RANGE` (about one pair in 12,000); any other program can hold the port too.
        """
        job = next((env[key] for key in cls.JOB_ID_VARIABLES if env.get(key)), None)
        if job is None:
            return None
        low, high = cls.PORT_RANGE
        digest = hashlib.sha256(job.encode()).digest()  # not hash(): salted per process
        return low + int.from_bytes(digest[:4], "big") % (high - low)


ENVIRONMENTS: tuple[ClusterEnvironment, ...] = (
    TorchrunEnvironment(),
    SlurmEnvironment(),
    MPIEnvironment(),
)


def detect_environment(
    env: Mapping[str, str], environments: tuple[ClusterEnvironment, ...] = ENVIRONMENTS
) -> WorldInfo | None:
    """The layout from the first environment that recognises ``env``; ``None`` when none does."""
    for candidate in environments:
        if candidate.detect(env):
            return candidate.world_info(env)
    return None


@contextlib.contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the body; restore each variable after (unset again
    where it was unset), however the body ends."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
