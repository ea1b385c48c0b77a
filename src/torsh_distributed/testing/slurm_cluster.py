"""A private, single-host Slurm cluster for tests and benchmarks (Debian's packages, as root).

:func:`slurm_cluster` starts ``munged`` (with a key of its own), ``slurmctld`` and ``slurmd``
from a throwaway directory and yields a :class:`SlurmCluster` whose :attr:`~SlurmCluster.env`
(``SLURM_CONF=...``) points ``srun`` / ``sbatch`` / ``squeue`` at it. Nothing under /etc/slurm or
the system's munge is read or changed; on exit every job is cancelled, the daemons are stopped and
the directory is removed, also when the body raised.

Why each setting (slurm.conf):

* ``SlurmUser=root``/``SlurmdUser=root``: slurmd must be root to start tasks as the submitting
  user; the daemons bind ports picked free a moment before (``SlurmctldPort``/``SlurmdPort``).
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups, which containers
  and VMs without a delegated cgroup tree cannot give.
* ``SelectType=select/cons_tres`` + ``CR_CPU`` with ``CPUs=max(2, cores)`` and
  ``SlurmdParameters=config_overrides``: two one-core tasks fit on a one-core host too.
* ``auth/munge`` through a private ``munged`` socket (``AuthInfo=socket=...``): munge checks
  that every directory above the socket is traversable, hence the root directory's mode 0711.
* ``SchedulerParameters=batch_sched_delay=0,sched_min_interval=0``: a batch job starts about
  two seconds sooner than with the defaults, which are tuned for high submission rates.
* ``FirstJobId`` is random, so two clusters on one host do not derive the same rendezvous
  ports (:meth:`~torsh_distributed.runtime.env.SlurmEnvironment.job_port`).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torsh_distributed.testing.harness import find_free_port

__all__ = ["SlurmCluster", "SlurmUnavailableError", "SlurmStartError", "slurm_cluster"]

_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "sinfo", "scontrol")
_FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
     "BOOT_FAIL", "DEADLINE"}
)


class SlurmUnavailableError(RuntimeError):
    """This host cannot run the cluster at all (not root, packages missing); a reason to skip."""


class SlurmStartError(RuntimeError):
    """The daemons were there but the cluster did not come up; carries the daemons' log tails."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmCluster:
    """A running cluster: where it lives and the environment its clients need."""

    root: Path
    """The private directory (configuration, state, spool, logs, munge key and socket)."""
    conf: Path
    """Its slurm.conf."""
    node: str
    """The one node's name (this host's short name, which must resolve)."""
    cpus: int
    """CPUs the node offers to jobs."""
    env: Mapping[str, str]
    """``os.environ`` without inherited ``SLURM_*`` variables, plus ``SLURM_CONF``."""

    def job_state(self, job_id: str) -> tuple[str, str]:
        """``(JobState, ExitCode)`` of a job, e.g. ``("COMPLETED", "0:0")``."""
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "?")

    def wait_job(self, job_id: str, *, timeout: float) -> tuple[str, str]:
        """Poll until the job reaches a final state; raises :class:`TimeoutError` after
        ``timeout`` seconds (the job is left to the cluster's teardown, which cancels it)."""
        deadline = time.monotonic() + timeout
        while True:
            state, code = self.job_state(job_id)
            if state in _FINAL_STATES:
                return state, code
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of each daemon's log, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def client(
        self, argv: Sequence[str], *, timeout: float = 10.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``squeue``, ``scontrol``, ...) against this cluster."""
        return subprocess.run(
            list(argv), env=dict(self.env), capture_output=True, text=True, timeout=timeout
        )


def _check_host() -> str:
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        raise SlurmUnavailableError(
            f"{', '.join(missing)} not installed: run `make system-deps` as root (Debian "
            "packages slurmctld, slurmd, slurm-client, munge)"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailableError(
            "a private Slurm cluster needs root: slurmd starts job tasks as the submitting user"
        )
    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)
    except OSError as exc:
        raise SlurmUnavailableError(
            f"this host's name {node!r} does not resolve ({exc}): Slurm names nodes by host name "
            "and jobs reach rank 0 through it; add it to /etc/hosts"
        ) from None
    return node


def _conf(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=torshtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
FirstJobId={random.randint(1, 16000)}
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cancel_all(cluster: SlurmCluster, timeout: float = 15.0) -> None:
    """Cancel this cluster's jobs and wait (bounded) until none is left, so no job step
    (``slurmstepd`` and its tasks) outlives the daemons that would reap it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        jobs = cluster.client(["squeue", "-h", "-o", "%i"]).stdout.split()
        if not jobs:
            return
        cluster.client(["scancel", *jobs])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not cluster.client(["squeue", "-h", "-o", "%i"]).stdout.split():
                return
            time.sleep(0.1)


@contextlib.contextmanager
def slurm_cluster(
    *, cpus: int | None = None, start_timeout: float = 30.0
) -> Iterator[SlurmCluster]:
    """Start a one-node Slurm cluster; stop it and delete its files on exit.

    Args:
        cpus: CPUs the node offers (``None``: this host's cores, at least 2). More than the host
            has lets more tasks run at once, oversubscribing the cores.
        start_timeout: Seconds to wait for the node to show ``idle`` in ``sinfo``.

    Raises:
        SlurmUnavailableError: not root, Slurm or munge not installed, host name not resolvable.
        SlurmStartError: a daemon exited or the node did not become idle in time (with logs).
    """
    node = _check_host()
    cpus = cpus if cpus is not None else max(2, os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(prefix="torsh-slurm-"))
    procs: list[subprocess.Popen[bytes]] = []
    cluster: SlurmCluster | None = None
    try:
        root.chmod(0o711)  # munged refuses a socket below a directory others cannot traverse
        (root / "munge").mkdir(mode=0o755)
        for sub in ("state", "spool"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(1024))
        ctld_port = find_free_port()
        slurmd_port = find_free_port()
        while slurmd_port == ctld_port:
            slurmd_port = find_free_port()
        conf = root / "slurm.conf"
        conf.write_text(_conf(root, node, cpus, ctld_port, slurmd_port))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(conf)
        cluster = running = SlurmCluster(root=root, conf=conf, node=node, cpus=cpus, env=env)
        daemons = {
            "munged": [
                "munged", "--foreground", f"--key-file={key}",
                f"--socket={root}/munge/munge.socket", f"--pid-file={root}/munged.pid",
                f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed",
            ],
            "slurmctld": ["slurmctld", "-D", "-f", str(conf)],
            "slurmd": ["slurmd", "-D", "-f", str(conf), "-N", node],
        }
        deadline = time.monotonic() + start_timeout
        for name, argv in daemons.items():
            with open(root / f"{name}.out", "wb") as out:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
            if name == "munged":  # slurmctld authenticates through it from its first message
                _wait_for(lambda: (root / "munge" / "munge.socket").exists(), procs, deadline,
                          running, "munged did not create its socket")
        _wait_for(lambda: _node_state(running) == "idle", procs, deadline, running,
                  f"node {node} did not become idle")
        yield running
    finally:
        if cluster is not None and procs and all(p.poll() is None for p in procs):
            _cancel_all(cluster)
        for proc in reversed(procs):  # slurmd, slurmctld, then munged (which they talk to)
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def _node_state(cluster: SlurmCluster) -> str:
    try:
        out = cluster.client(["sinfo", "-h", "-n", cluster.node, "-o", "%t"], timeout=5)
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout.strip()


def _wait_for(
    ready: Callable[[], bool],
    procs: list[subprocess.Popen[bytes]],
    deadline: float,
    cluster: SlurmCluster,
    what: str,
) -> None:
    while not ready():
        dead = [p.args[0] for p in procs if p.poll() is not None]  # type: ignore[index]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(map(str, dead))} exited" if dead else "timed out"
            outs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in sorted(cluster.root.glob("*.out"))
            )
            raise SlurmStartError(f"{what} ({why})\n{outs}\n{cluster.log_tail()}")
        time.sleep(0.05)
