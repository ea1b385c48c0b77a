"""The rendezvous derived under ``mpirun`` (no MASTER_ADDR): node count, job port, errors.

mpi4py is blocked in every test here (``sys.modules["mpi4py"] = None``, which is how Python
reports a missing module): importing it for real would start MPI as a singleton in this process.
"""

from __future__ import annotations

import socket
import sys
import threading
from datetime import timedelta

import pytest

import torsh_distributed as tdist
from torsh_distributed.runtime import ConfigurationError, MPIEnvironment, _mpi, detect_environment
from torsh_distributed.runtime._net import loopback_interface


def _ompi(rank: int = 0, size: int = 2, local_size: int = 2, **extra: str) -> dict[str, str]:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "PMIX_NAMESPACE": "1185021953", "OMPI_MCA_ess_base_jobid": "1185021953",
    }
    env.update(extra)
    return env


@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("env", "single"),
    [
        (_ompi(size=2, local_size=2), True),
        (_ompi(size=4, local_size=2), False),
        (_ompi(size=4, local_size=2, OMPI_MCA_orte_num_nodes="2"), False),
        # Open MPI 4's node count decides over the local size (which a user's -x could fake).
        (_ompi(size=2, local_size=1, OMPI_MCA_orte_num_nodes="1"), True),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False),  # unknown: not one
    ],
)
def test_single_node(env: dict[str, str], single: bool) -> None:
    assert MPIEnvironment.single_node(env) is single


@pytest.mark.timeout(10)
def test_job_port_is_stable_and_per_job() -> None:
    # Pinned: a change of the formula would split a job across versions (and hash() would
    # differ in every process, PYTHONHASHSEED being random).
    assert MPIEnvironment.job_port({"PMIX_NAMESPACE": "1185021953"}) == 24372
    assert MPIEnvironment.job_port({"OMPI_MCA_ess_base_jobid": "1185021953"}) == 24372
    # PMIx's namespace first: Open MPI 5 sets no ess_base_jobid.
    assert MPIEnvironment.job_port(
        {"PMIX_NAMESPACE": "prterun-vm-4242@1", "OMPI_MCA_ess_base_jobid": "1185021953"}
    ) == MPIEnvironment.job_port({"PMIX_NAMESPACE": "prterun-vm-4242@1"}) != 24372
    ports = {MPIEnvironment.job_port({"PMIX_NAMESPACE": str(1185021953 + i)}) for i in range(50)}
    assert len(ports) > 45 and all(20000 <= p < 32000 for p in ports)
    assert MPIEnvironment.job_port({"OMPI_COMM_WORLD_RANK": "0"}) is None


@pytest.mark.timeout(10)
def test_detection_reads_no_master_and_stays_pure(no_mpi4py: None) -> None:
    info = detect_environment(_ompi(rank=1))
    assert info is not None and info.source == "mpi"
    assert (info.master_addr, info.master_port) == (None, None)


@pytest.mark.timeout(10)
def test_multi_node_without_mpi4py_says_what_to_do(no_mpi4py: None) -> None:
    with pytest.raises(ConfigurationError, match="several nodes") as err:
        tdist.init(backend="gloo", env=_ompi(size=4, local_size=2))
    text = str(err.value)
    assert "mpi4py is not installed" in text
    assert "mpirun -x MASTER_ADDR=" in text and "pip install 'torsh-distributed[mpi]'" in text
    assert not tdist.is_initialized()


@pytest.mark.timeout(10)
def test_env_mode_refuses_several_nodes() -> None:
    env = _ompi(size=4, local_size=2, TORSH_MPI_RENDEZVOUS="env")
    message = "TORSH_MPI_RENDEZVOUS=env derives a rendezvous on one node only"
    with pytest.raises(ConfigurationError, match=message):
        tdist.init(backend="gloo", env=env)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("mpi4py", "TORSH_MPI_RENDEZVOUS=mpi4py but mpi4py is not installed"),
        ("sockets", "TORSH_MPI_RENDEZVOUS='sockets' is not one of auto, mpi4py, env"),
    ],
)
def test_mode_errors(no_mpi4py: None, mode: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[")):
        tdist.init(backend="gloo", env=_ompi(TORSH_MPI_RENDEZVOUS=mode))


@pytest.fixture
def mpich_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an MPICH-built mpi4py gives under Open MPI's mpirun: every rank a singleton."""

    class _World:
        def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
            return 0

        def Get_size(self) -> int:  # noqa: N802
            return 1

    fake = type(sys)("mpi4py.MPI")
    fake.COMM_WORLD = _World()  # type: ignore[attr-defined]
    package = type(sys)("mpi4py")
    package.MPI = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)


@pytest.mark.timeout(10)
def test_mpi4py_of_another_mpi_is_refused_on_several_nodes(mpich_mpi4py: None) -> None:
    env = _ompi(size=2, local_size=1)
    with pytest.raises(ConfigurationError, match="built against another MPI than this mpirun"):
        _mpi.rendezvous(detect_environment(env), env, timeout=timedelta(seconds=2))


@pytest.mark.timeout(10)
def test_mpi4py_of_another_mpi_falls_back_on_one_node(mpich_mpi4py: None) -> None:
    env = _ompi(rank=0, PMIX_NAMESPACE=_namespace_with_free_port())
    with pytest.warns(RuntimeWarning, match="built against another MPI"):
        rdzv = _mpi.rendezvous(detect_environment(env), env, timeout=timedelta(seconds=2))
    assert (rdzv.method, rdzv.master_port) == ("env", MPIEnvironment.job_port(env))


def _namespace_with_free_port() -> str:
    """A job id whose derived port nothing on this machine holds right now."""
    for attempt in range(20):
        namespace = f"test-{attempt}-{id(object())}"
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", MPIEnvironment.job_port({"PMIX_NAMESPACE": namespace})))
            except OSError:
                continue
        return namespace
    pytest.skip("every derived port tried is in use")


def _both_ranks(env_of: dict[int, dict[str, str]]) -> dict[int, object]:
    """Run :func:`_mpi.rendezvous` for ranks 0 and 1 on threads; each result or exception."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        env = env_of[rank]
        try:
            out[rank] = _mpi.rendezvous(detect_environment(env), env, timeout=timedelta(seconds=5))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


@pytest.mark.timeout(20)
def test_single_node_env_rendezvous_shares_one_store(no_mpi4py: None) -> None:
    namespace = _namespace_with_free_port()
    env_of = {r: _ompi(rank=r, PMIX_NAMESPACE=namespace) for r in (0, 1)}
    port = MPIEnvironment.job_port(env_of[0])
    out = _both_ranks(env_of)
    first, second = out[0], out[1]
    assert isinstance(first, _mpi.MPIRendezvous), first
    assert isinstance(second, _mpi.MPIRendezvous), second
    assert (first.method, first.master_addr, first.master_port) == ("env", "127.0.0.1", port)
    assert (second.master_addr, second.master_port) == ("127.0.0.1", port)
    first.store.set("from-0", b"hello")
    assert second.store.get("from-0") == b"hello"
    assert first.gloo_ifname == loopback_interface()


@pytest.mark.timeout(20)
def test_taken_derived_port_names_port_and_fix(no_mpi4py: None) -> None:
    namespace = f"taken-{id(object())}"
    env = _ompi(rank=0, PMIX_NAMESPACE=namespace)
    port = MPIEnvironment.job_port(env)
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError:
            pytest.skip(f"derived port {port} already in use on this machine")
        other.listen(1)
        with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}") as err:
            _mpi.rendezvous(detect_environment(env), env, timeout=timedelta(seconds=2))
    assert "MASTER_PORT" in str(err.value) and "mpi4py" in str(err.value)


@pytest.mark.timeout(10)
def test_address_toward_other_nodes() -> None:
    with pytest.raises(ConfigurationError, match="address toward the other nodes"):
        _mpi._address_toward(["node0", "localhost"])  # the only peer is this machine's loopback
    try:  # a documentation address (TEST-NET-1): the kernel only picks a route, sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.123", 9))
            expected = probe.getsockname()[0]
    except OSError:
        pytest.skip("no route off this machine")
    assert _mpi._address_toward(["node0", "node0", "192.0.2.123"]) == expected
