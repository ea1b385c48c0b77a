"""``horovodrun`` mapped onto our launcher: hosts, slots, the command and the elastic flags
become :class:`~torsh_distributed.elastic.launch.LaunchOptions` plus a script or module.

Only this host is launched (torch's agent runs the workers here; nothing is started over ssh):
``-H localhost:4`` or no ``-H`` at all. A host list naming other hosts is refused with the
``torsh-dist run`` command to start on each host instead, since every node runs its own agent.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from torsh_distributed.compat.horovod import COMMIT_DIR_ENV
from torsh_distributed.elastic._options import LaunchOptions

__all__ = [
    "HorovodRunPlan",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "plan_horovodrun",
    "split_command",
]

_PYTHON = re.compile(r"^python[0-9.]*$")
_PYTHON_FLAGS_WITHOUT_VALUE = {"-u", "-O", "-OO", "-B", "-s", "-S", "-E", "-I", "-b", "-bb", "-q"}
ELASTIC_DEFAULT_RESTARTS = 3


@dataclass(frozen=True, slots=True)
class HorovodRunPlan:
    """What ``torsh-dist horovodrun`` will launch."""

    options: LaunchOptions
    """Launch options for :func:`torsh_distributed.elastic.launch.launch`."""
    script: str | None
    """The Python file to run, or ``None`` with ``module``."""
    module: str | None
    """The module to run (``python -m``), or ``None``."""
    args: list[str]
    """Arguments of the script or module."""
    notes: list[str] = field(default_factory=list)
    """Warnings for the user: flags that have no effect here, defaults chosen."""


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"a:2,b:4"`` -> ``[("a", 2), ("b", 4)]`` (a host without ``:slots`` has 1 slot)."""
    hosts = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, slots = part.rpartition(":")
        if not sep:
            name, slots = part, "1"
        try:
            count = int(slots)
        except ValueError:
            raise ValueError(f"-H/--hosts: {part!r} is not HOST or HOST:SLOTS") from None
        if count < 1 or not name:
            raise ValueError(f"-H/--hosts: {part!r} needs a host name and slots >= 1")
        hosts.append((name, count))
    if not hosts:
        raise ValueError(f"-H/--hosts names no host: {text!r}")
    return hosts


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """Horovod's host file: one ``HOST slots=N`` (or ``HOST:N``, or ``HOST``) per line."""
    hosts = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
            if match:
                hosts.append((match.group(1), int(match.group(2))))
                continue
            try:
                hosts.extend(parse_hosts(line))
            except ValueError:
                raise ValueError(
                    f"--hostfile {path}:{number}: expected 'HOST slots=N', got {line!r}"
                ) from None
    if not hosts:
        raise ValueError(f"--hostfile {path} names no host")
    return hosts


def is_local_host(name: str) -> bool:
    """Whether ``name`` is this machine (localhost, a loopback address or our host name)."""
    if name in ("localhost", "127.0.0.1", "::1") or name.startswith("127."):
        return True
    return name in {socket.gethostname(), socket.getfqdn()}


def split_command(command: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """``python -u train.py --lr 1`` -> ``(script, module, args)``.

    Accepts ``[python [flags]] SCRIPT.py ARGS`` and ``[python [flags]] -m MODULE ARGS``.

    Raises:
        ValueError: no command, or a command that is not a Python script or module.
    """
    tokens = list(command)
    if tokens and tokens[0] == "--":
        tokens = tokens[1:]
    if not tokens:
        raise ValueError("name the command to run, e.g. `python train.py`")
    if _PYTHON.match(os.path.basename(tokens[0])):
        tokens = tokens[1:]
        while tokens and tokens[0] in _PYTHON_FLAGS_WITHOUT_VALUE:
            tokens = tokens[1:]
        if tokens and tokens[0] == "-m":
            if len(tokens) < 2:
                raise ValueError("`python -m` needs a module name")
            return None, tokens[1], tokens[2:]
    if not tokens or tokens[0].startswith("-"):
        raise ValueError(
            f"cannot run {' '.join(command)!r}: torsh-dist horovodrun starts Python scripts "
            "(`python train.py ...`) or modules (`python -m pkg.train ...`)"
        )
    if not tokens[0].endswith(".py") and not os.path.isfile(tokens[0]):
        raise ValueError(
            f"cannot run {tokens[0]!r}: torsh-dist horovodrun starts Python scripts "
            "(`python train.py ...`) or modules (`python -m pkg.train ...`), not other programs"
        )
    return tokens[0], None, tokens[1:]


def _multi_host_error(hosts: list[tuple[str, int]], np: int, command: Sequence[str]) -> ValueError:
    master = hosts[0][0]
    lines = [
        f"torsh-dist horovodrun -H {','.join(f'{h}:{s}' for h, s in hosts)} names "
        f"{len(hosts)} host(s) that are not all this machine; it starts workers on this host "
        "only (no ssh). Start the job on every host with torsh-dist run instead:"
    ]
    remaining = np
    for rank, (host, slots) in enumerate(hosts):
        here = min(slots, remaining)
        remaining -= here
        lines.append(
            f"  on {host}: torsh-dist run --nnodes {len(hosts)} --node-rank {rank} "
            f"--nproc-per-node {here} --master-addr {master} --master-port 29500 "
            f"{' '.join(command)}"
        )
    return ValueError("\n".join(lines))


def plan_horovodrun(
    *,
    np: int,
    hosts: str | None = None,
    hostfile: str | None = None,
    command: Sequence[str] = (),
    min_np: int | None = None,
    max_np: int | None = None,
    reset_limit: int | None = None,
    max_restarts: int | None = None,
    host_discovery_script: str | None = None,
    network_interface: str | None = None,
    output_filename: str | None = None,
    verbose: bool = False,
    ignored: Sequence[str] = (),
    elastic_dir: str | None = None,
) -> HorovodRunPlan:
    """Turn horovodrun's flags into a launch of this host's workers.

    Args:
        np: ``-np``: number of processes.
        hosts: ``-H``: ``HOST:SLOTS,...``; must be this host only.
        hostfile: ``--hostfile``; exclusive with ``hosts``.
        command: The command (``python train.py ARGS``).
        min_np, max_np: Horovod's elastic bounds; on one host the world stays at ``np``.
        reset_limit: Horovod's cap on resets: our ``max_restarts``.
        max_restarts: Our name for the same; exclusive with ``reset_limit``.
        host_discovery_script: Horovod's elastic discovery: not supported.
        network_interface: Interface for Gloo/NCCL traffic (``GLOO_SOCKET_IFNAME``...).
        output_filename: Directory for each worker's logs (our ``log_dir``).
        verbose: Show the agent's logs.
        ignored: Horovod tuning flags given, which have no effect here (reported as notes).
        elastic_dir: Where rank 0 keeps its last commit across restarts
            (``TORSH_HOROVOD_ELASTIC_DIR``), unless the environment already names one.

    Raises:
        ValueError: a bad value, hosts other than this one, or an unsupported flag.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"-np must be an integer >= 1, got {np!r}")
    if hosts and hostfile:
        raise ValueError("pass -H/--hosts or --hostfile, not both")
    if host_discovery_script:
        raise ValueError(
            "--host-discovery-script is not supported: torch's elastic agent admits nodes through "
            "its rendezvous (torsh-dist run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT on each node)"
        )
    if reset_limit is not None and max_restarts is not None and reset_limit != max_restarts:
        raise ValueError("--reset-limit and --max-restarts are the same setting; pass one")
    host_list = (
        parse_hostfile(hostfile)
        if hostfile
        else parse_hosts(hosts)
        if hosts
        else [("localhost", np)]
    )
    if len(host_list) != 1 or not is_local_host(host_list[0][0]):
        raise _multi_host_error(host_list, np, command)
    slots = host_list[0][1]
    if np > slots:
        raise ValueError(f"-np {np} is larger than the {slots} slot(s) of {host_list[0][0]}")
    script, module, args = split_command(command)

    notes = [f"{flag} has no effect here (Horovod tuning of its own engine)" for flag in ignored]
    elastic = min_np is not None or max_np is not None
    if elastic and (min_np not in (None, np) or max_np not in (None, np)):
        notes.append(
            f"--min-np/--max-np are ignored on one host: the world stays at -np {np} and a failure "
            "restarts every worker"
        )
    restarts = reset_limit if reset_limit is not None else max_restarts
    if restarts is None:
        restarts = ELASTIC_DEFAULT_RESTARTS if elastic else 0
    if restarts < 0:
        raise ValueError(f"--reset-limit/--max-restarts must be >= 0, got {restarts}")

    env: dict[str, str] = {}
    if network_interface:
        env["GLOO_SOCKET_IFNAME"] = network_interface
        env["NCCL_SOCKET_IFNAME"] = network_interface
    if elastic_dir is not None and COMMIT_DIR_ENV not in os.environ:
        env[COMMIT_DIR_ENV] = elastic_dir
    options = LaunchOptions(
        nproc_per_node=np,
        max_restarts=restarts,
        log_dir=output_filename,
        env=env,
        verbose=verbose,
    )
    return HorovodRunPlan(options=options, script=script, module=module, args=args, notes=notes)
