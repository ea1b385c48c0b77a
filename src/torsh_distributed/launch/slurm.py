"""Write ``sbatch`` scripts that run a job on N nodes x G processes per node.

Two ways to start the processes, both one ``srun`` inside the allocation:

* ``mode="tasks"`` (the default): one Slurm task per process,
  ``srun torsh-dist train ...``. Every task reads its rank and the world from ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ...
  (:class:`~torsh_distributed.runtime.env.SlurmEnvironment`);
  rank 0's store listens on the first host of the step's node list at a port derived from the job
  id (or ``MASTER_PORT``). Slurm alone places, signals and kills the processes.
* ``mode="agent"``: one task per node running ``torsh-dist run`` (torch's elastic agent), which
  starts G workers and joins the other nodes through a ``c10d`` rendezvous on the first node.
  Adds what the agent gives: ``[rankN]:`` prefixed output, one failure report, ``--max-restarts``.

``slurm_script(["torsh-dist", "train", "--preset", "tiny"], nodes=2, procs_per_node=4)`` returns
the script's text (and writes it with ``path=``); ``torsh-dist slurm`` is the same on the command
line. Every argument is quoted with :func:`shlex.quote`; everything else is validated when the
:class:`SlurmJob` is built, so a bad value raises ``ValueError`` naming the field instead of
producing a script that ``sbatch`` rejects or, worse, runs something else.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torsh_distributed.runtime.env import SlurmEnvironment

__all__ = ["MODES", "SlurmJob", "slurm_script"]

MODES = ("tasks", "agent")
"""``tasks``: one Slurm task per process; ``agent``: one ``torsh-dist run`` per node."""

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_TIME = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$"
)
_PYTHON = re.compile(r"^python[\d.]*$")
_NO_SPACE = re.compile(r"^[^\s'\"\\]+$")


def _positive(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmJob:
    """One batch job: its shape, its ``#SBATCH`` options and the command every process runs."""

    command: tuple[str, ...]
    """``tasks`` mode: the program each process runs (``("torsh-dist", "train", ...)``,
    ``("python", "train.py")``); it must call :func:`torsh_distributed.init` (``torsh-dist train``
    does). ``agent`` mode: what ``torsh-dist run`` starts, a Python file and its arguments or
    ``("-m", "module", ...)`` (``("-m", "torsh_distributed.train", "--preset", "tiny")``)."""
    nodes: int = 1
    """Nodes to allocate (``#SBATCH --nodes``)."""
    procs_per_node: int = 1
    """Training processes per node: one per GPU on GPU nodes, a few per node on CPUs."""
    mode: str = "tasks"
    """``"tasks"`` (one Slurm task per process; Slurm signals and kills each one) or ``"agent"``
    (one ``torsh-dist run`` per node: rank-prefixed output, one failure report, restarts)."""
    job_name: str = "torsh"
    """``#SBATCH --job-name``: letters, digits and ``_.+-``."""
    partition: str | None = None
    """``#SBATCH --partition`` (comma-separated to let Slurm pick); ``None``: the default one."""
    time_limit: str | None = None
    """``#SBATCH --time`` in Slurm's formats (``30``, ``2:00:00``, ``1-12``); ``None``: the
    partition's default. A short limit schedules sooner; the job is killed when it runs out."""
    cpus_per_process: int | None = None
    """CPU cores per training process (``--cpus-per-task``, times ``procs_per_node`` in agent
    mode); also exported as ``OMP_NUM_THREADS`` unless ``env`` sets it, so processes sharing a
    node do not oversubscribe it. ``None``: Slurm's default (one core per task)."""
    gpus_per_node: int = 0
    """``#SBATCH --gpus-per-node``; 0 on CPU nodes. Each process picks GPU ``local_rank``."""
    job_output: str | None = None
    """``#SBATCH --output``, where the job's stdout and stderr go (``%j`` is the job id, ``%x``
    the job name); ``None``: Slurm's ``slurm-%j.out`` in the submission directory."""
    port: int | None = None
    """Rendezvous port on the first node. ``None``: derived from the job id
    (``SlurmEnvironment.job_port``: 15000 + job id % 17000), so jobs sharing a node differ.
    Tasks mode exports it as ``MASTER_PORT``; agent mode uses it for ``--rdzv-endpoint``."""
    max_restarts: int = 0
    """Agent mode: restart every worker up to this many times after a failure (``torsh-dist run
    --max-restarts``); workers read ``TORCHELASTIC_RESTART_COUNT`` and resume from their last
    checkpoint. Tasks mode cannot restart (Slurm ends the step): must stay 0 there."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables exported before ``srun`` (on top of the environment ``sbatch`` was called in)."""
    sbatch_options: tuple[str, ...] = ()
    """Further ``#SBATCH`` lines, one option each: ``("--account=proj", "--exclusive")``."""

    def __post_init__(self) -> None:
        if isinstance(self.command, str) or not all(isinstance(a, str) for a in self.command):
            raise TypeError(
                "command must be a sequence of strings (one per argument), not a string"
            )
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command:
            raise ValueError("command must name the program every process runs, got nothing")
        if any("\0" in arg for arg in self.command):
            raise ValueError("command arguments must not contain NUL characters")
        _positive("nodes", self.nodes)
        _positive("procs_per_node", self.procs_per_node)
        _positive("gpus_per_node", self.gpus_per_node, minimum=0)
        if self.cpus_per_process is not None:
            _positive("cpus_per_process", self.cpus_per_process)
        _positive("max_restarts", self.max_restarts, minimum=0)
        if self.port is not None:
            _positive("port", self.port)
            if self.port > 65535:
                raise ValueError(f"port must be a TCP port in [1, 65535], got {self.port}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_restarts and self.mode != "agent":
            raise ValueError(
                f"max_restarts={self.max_restarts} needs mode 'agent' (torsh-dist run restarts "
                "workers; under mode 'tasks' a failed task ends the Slurm step)"
            )
        program = Path(self.command[0]).name
        if self.mode == "agent" and (program == "torsh-dist" or _PYTHON.match(program)):
            raise ValueError(
                "mode 'agent' runs `torsh-dist run COMMAND`, so command must be a Python file or "
                "'-m MODULE' and its arguments, got "
                f"{shlex.join(self.command[:2])!r}: for `torsh-dist train ARGS` give "
                "`-m torsh_distributed.train ARGS`"
            )
        if not _NAME.match(self.job_name):
            raise ValueError(
                f"job_name must use letters, digits and _.+- only, got {self.job_name!r}"
            )
        if self.partition is not None and not _PARTITION.match(self.partition):
            raise ValueError(
                f"partition must be a name or comma-separated names, got {self.partition!r}"
            )
        if self.time_limit is not None and not _TIME.match(self.time_limit):
            raise ValueError(
                f"time_limit must be a Slurm time (MINUTES, H:MM:SS, D-HH, D-HH:MM:SS or "
                f"UNLIMITED), got {self.time_limit!r}"
            )
        if self.job_output is not None and not _NO_SPACE.match(self.job_output):
            raise ValueError(
                f"job_output must be a path without spaces, quotes or backslashes (#SBATCH lines "
                f"are not parsed by a shell), got {self.job_output!r}"
            )
        env = dict(self.env)
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_KEY.match(key):
                raise ValueError(f"env names must be shell variable names, got {key!r}")
            if not isinstance(value, str) or "\0" in value:
                raise ValueError(f"env[{key!r}] must be a string without NUL characters")
        object.__setattr__(self, "env", env)
        options = tuple(self.sbatch_options)
        for option in options:
            if not (isinstance(option, str) and option.startswith("-") and _NO_SPACE.match(option)):
                raise ValueError(
                    f"sbatch_options must be single options such as '--account=proj' (no "
                    f"spaces or quotes), got {option!r}"
                )
        object.__setattr__(self, "sbatch_options", options)

    @property
    def world_size(self) -> int:
        """Training processes in the whole job."""
        return self.nodes * self.procs_per_node

    def script(self) -> str:
        """The batch script's text (``#!/bin/bash``, ``#SBATCH`` lines, then one ``srun``)."""
        tasks = self.mode == "tasks"
        task_cpus = None
        if self.cpus_per_process is not None:
            task_cpus = self.cpus_per_process * (1 if tasks else self.procs_per_node)
        sbatch = [f"--job-name={self.job_name}", f"--nodes={self.nodes}"]
        sbatch.append(f"--ntasks-per-node={self.procs_per_node if tasks else 1}")
        if task_cpus is not None:
            sbatch.append(f"--cpus-per-task={task_cpus}")
        if self.gpus_per_node:
            sbatch.append(f"--gpus-per-node={self.gpus_per_node}")
        for option, value in (
            ("--partition", self.partition),
            ("--time", self.time_limit),
            ("--output", self.job_output),
        ):
            if value is not None:
                sbatch.append(f"{option}={value}")
        sbatch += self.sbatch_options
        how = "one Slurm task per process" if tasks else "one `torsh-dist run` agent per node"
        lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in sbatch), ""]
        lines += [
            f"# Written by torsh-dist slurm: {self.nodes} node(s) x {self.procs_per_node} "
            f"process(es) = world size {self.world_size},",
            f"# {how}. Submit with `sbatch THIS_FILE`; see docs/slurm.md.",
            "set -euo pipefail",
        ]
        env = dict(self.env)
        if self.cpus_per_process is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.cpus_per_process))
        lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
        # Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: repeat it.
        srun = "srun --kill-on-bad-exit=1"
        if not tasks:
            srun += " --ntasks-per-node=1"
        if task_cpus is not None:
            srun += f" --cpus-per-task={task_cpus}"
        if tasks:
            if self.port is not None:
                lines.append(f"export MASTER_PORT={self.port}")
            lines += [
                "# Each task reads its rank from SLURM_PROCID / SLURM_NTASKS; rank 0's store",
                "# listens on the first host of the step's node list, at MASTER_PORT or else",
                "# at 15000 + job id % 17000 (SlurmEnvironment.job_port).",
                f"{srun} {shlex.join(self.command)}",
            ]
            return "\n".join(lines) + "\n"
        base, span = SlurmEnvironment.PORT_BASE, SlurmEnvironment.PORT_SPAN
        port = str(self.port) if self.port is not None else f"$(({base} + SLURM_JOB_ID % {span}))"
        lines += [
            "# The agents meet at a c10d rendezvous on the allocation's first node.",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"port={port}",
            f"{srun} \\",
            f"    torsh-dist run --nnodes {self.nodes} --nproc-per-node {self.procs_per_node} \\",
            *([f"    --max-restarts {self.max_restarts} \\"] if self.max_restarts else []),
            '    --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \\',
            f"    {shlex.join(self.command)}",
        ]
        return "\n".join(lines) + "\n"


def slurm_script(
    command: Sequence[str],
    *,
    nodes: int = 1,
    procs_per_node: int = 1,
    mode: str = "tasks",
    job_name: str = "torsh",
    partition: str | None = None,
    time_limit: str | None = None,
    cpus_per_process: int | None = None,
    gpus_per_node: int = 0,
    job_output: str | None = None,
    port: int | None = None,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    sbatch_options: Sequence[str] = (),
    path: str | os.PathLike[str] | None = None,
) -> str:
    """An ``sbatch`` script running ``command`` on ``nodes`` x ``procs_per_node`` processes.

    Args:
        command: What runs; see :attr:`SlurmJob.command` (its meaning depends on ``mode``).
        nodes: Nodes to allocate.
        procs_per_node: Training processes per node (one per GPU on GPU nodes).
        mode: ``"tasks"`` (default: ``srun`` starts every process; simplest, Slurm-native) or
            ``"agent"`` (``srun`` starts one ``torsh-dist run`` per node; prefixed output, one
            failure report and ``--max-restarts``, at the cost of one more process per node).
        job_name: ``#SBATCH --job-name``.
        partition: ``#SBATCH --partition``; ``None`` uses the cluster's default.
        time_limit: ``#SBATCH --time`` (``"30"``, ``"2:00:00"``, ``"1-12"``).
        cpus_per_process: Cores per process; also sets ``OMP_NUM_THREADS``.
        gpus_per_node: ``#SBATCH --gpus-per-node``; 0 on CPU nodes.
        job_output: ``#SBATCH --output`` (``%j`` = job id); ``None``: ``slurm-%j.out``.
        port: Rendezvous port; ``None`` derives one from the job id.
        max_restarts: Agent mode only: worker restarts after a failure.
        env: Variables to export in the script before ``srun``.
        sbatch_options: Further ``#SBATCH`` options (``"--account=proj"``).
        path: Also write the script there (mode 0o755).

    Returns:
        The script's text.

    Raises:
        ValueError / TypeError: a field out of range or malformed, naming it.
    """
    if isinstance(command, str):
        raise TypeError("command must be a sequence of strings (one per argument), not a string")
    job = SlurmJob(
        command=tuple(command),
        nodes=nodes,
        procs_per_node=procs_per_node,
        mode=mode,
        job_name=job_name,
        partition=partition,
        time_limit=time_limit,
        cpus_per_process=cpus_per_process,
        gpus_per_node=gpus_per_node,
        job_output=job_output,
        port=port,
        max_restarts=max_restarts,
        env=dict(env or {}),
        sbatch_options=tuple(sbatch_options),
    )
    text = job.script()
    if path is not None:
        target = Path(path)
        target.write_text(text)
        target.chmod(0o755)
    return text
