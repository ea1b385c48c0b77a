"""Network lab: simulated hosts as Linux network namespaces behind a rate-limited virtual switch.

Every host is a namespace with one interface ``eth0`` (``10.77.<net>.<i+1>/24``), joined by a veth
pair to a bridge that lives in its own "switch" namespace (the root namespace is never touched).
``tc`` limits each host's link in both directions (host egress on ``eth0``, host ingress on the
switch port) to ``rate_mbit`` with an optional one-way ``delay_ms``. Ranks on one host talk over
that namespace's loopback, which is not limited: the intra-/inter-node split of a real cluster.

Needs root and ``ip``/``tc`` (iproute2)::

    with NetLab(hosts=2, rate_mbit=100) as lab:
        procs = [lab.popen(h, [sys.executable, "-c", "..."], env=lab.rank_env(...)) ...]

Everything is removed on exit, on exceptions and on SIGTERM/SIGINT; :func:`cleanup_stale` removes
namespaces left by a killed run (``tdl*``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType

__all__ = ["NetLab", "available", "cleanup_stale"]

_PREFIX = "tdl"
_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}


def available() -> str | None:
    """``None`` when a lab can be built here, else the reason it cannot (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (iproute2) on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def cleanup_stale(prefix: str = _PREFIX) -> list[str]:
    """Delete namespaces whose name starts with ``prefix`` (left by a killed run); returns them."""
    names = [
        line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line.strip()
    ]
    gone = [n for n in names if n.startswith(prefix)]
    for name in gone:
        _sh("ip", "netns", "pids", name, check=False)
        for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "delete", name, check=False)
    return gone


class NetLab:
    """``hosts`` namespaces on a switch, each link limited to ``rate_mbit`` (and ``delay_ms``).

    Args:
        hosts: Number of simulated hosts (namespaces).
        rate_mbit: Bandwidth of every host link, each direction; 0 = unlimited.
        delay_ms: One-way added latency per link direction (netem); 0 = none.
        net: Third octet of the lab's 10.77.<net>.0/24 subnet (distinct labs at once need distinct ones).
        sysctls: Set inside every host namespace; default keeps TCP's window across the idle gaps
            between collective steps (``tcp_slow_start_after_idle=0``), as tuned clusters do.
    """

    def __init__(
        self,
        *,
        hosts: int = 2,
        rate_mbit: float = 100.0,
        delay_ms: float = 0.0,
        net: int = 0,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        if rate_mbit < 0 or delay_ms < 0:
            raise ValueError("rate_mbit and delay_ms must be >= 0")
        self.hosts, self.rate_mbit, self.delay_ms, self.net = hosts, rate_mbit, delay_ms, net
        self.sysctls = dict(_SYSCTLS if sysctls is None else sysctls)
        self.tag = f"{_PREFIX}{os.getpid() % 100000}"
        self.switch = f"{self.tag}sw"
        self.namespaces = [f"{self.tag}h{i}" for i in range(hosts)]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._old_handlers: dict[int, object] = {}
        self._up = False

    def address(self, host: int) -> str:
        """IPv4 address of ``host``'s ``eth0``."""
        return f"10.77.{self.net}.{host + 1}"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        reason = available()
        if reason:
            raise RuntimeError(reason)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _qdisc(self, ns: str, dev: str) -> None:
        if not self.rate_mbit and not self.delay_ms:
            return
        if self.delay_ms:
            args = ["netem", "delay", f"{self.delay_ms}ms", "limit", "100000"]
            if self.rate_mbit:
                args += ["rate", f"{self.rate_mbit}mbit"]
        else:
            # burst: enough for a few 64 KiB GSO segments, so the rate holds without drops
            args = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "200ms"]
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *args)

    def _build(self) -> None:
        self._up = True
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            host_if, port_if = f"{self.tag}e{i}", f"{self.tag}p{i}"
            _sh(
                "ip",
                "link",
                "add",
                host_if,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port_if,
                "netns",
                self.switch,
            )
            _sh("ip", "-n", ns, "link", "set", host_if, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.switch, "link", "set", port_if, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port_if, "up")
            for key, value in self.sysctls.items():
                _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")
            self._qdisc(ns, "eth0")
            self._qdisc(self.switch, port_if)

    def close(self) -> None:
        """Kill the lab's processes and delete its namespaces (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._up:
            for ns in [*self.namespaces, self.switch]:
                for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _sh("ip", "netns", "delete", ns, check=False)
            self._up = False
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process inside ``host``'s namespace (a node dying); returns pids."""
        pids = [int(p) for p in _sh("ip", "netns", "pids", self.namespaces[host], check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    # -- running things ------------------------------------------------------------------------
    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace; the lab kills it on close."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[host], *argv],
            env=dict(env) if env is not None else None,
            **kwargs,
        )  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def run(
        self, host: int, argv: Sequence[str], *, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host``'s namespace to completion; returns its output."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespaces[host], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def rank_env(
        self,
        *,
        rank: int,
        world_size: int,
        ranks_per_host: int,
        master_port: int,
        base: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """Environment of global ``rank`` with ranks placed host by host (rank // ranks_per_host).

        ``MASTER_ADDR`` is host 0's address and ``GLOO_SOCKET_IFNAME=eth0``, so Gloo's traffic
        between hosts crosses the limited links; ``TORSH_NODE_ASSIGNMENT`` declares the hosts.
        """
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % ranks_per_host),
                "LOCAL_WORLD_SIZE": str(ranks_per_host),
                "GROUP_RANK": str(rank // ranks_per_host),
                "MASTER_ADDR": self.address(0),
                "MASTER_PORT": str(master_port),
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
                "TORSH_NODE_ASSIGNMENT": ",".join(
                    str(r // ranks_per_host) for r in range(world_size)
                ),
            }
        )
        return env
