"""RPC between real processes: results, errors with the peer's name, futures, remote references,
registered names, timeouts honoured (within timeout + 2 s on a quiet host; the assertions leave
room for a loaded one), a SIGKILLed peer, bounded shutdown, loopback
binding and the token check. Each test runs its workers through the harness (``init=False``:
the workers rendezvous through ``rpc.init`` alone)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from torsh_distributed import rpc
from torsh_distributed.runtime.errors import ConfigurationError, DistributedTimeoutError
from torsh_distributed.testing import run_distributed

SLACK_S = 2.0  # the promised bound beyond a call's timeout
BLOCK_S = 8.0  # how long the blocked remote calls of the timeout checks last
LOADED_SLACK_S = 6.0
"""What the tests assert beyond a timeout: SLACK_S holds on a quiet host (the timings are
printed), but a host at load 7 on 2 cores broke it once; the alternatives these bounds rule out
(waiting for the 30 s call, a hang) take far longer."""


# --- functions the workers call on each other (module level: they travel by name) -----------


def _boom(text: str) -> None:
    raise KeyError(text)


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # two arguments: torch could not rebuild it
        super().__init__(f"{a}/{b}")
        self.lock = threading.Lock()  # and it does not pickle


def _boom_unpicklable() -> None:
    raise _Unpicklable(1, 2)


def _block(seconds: float) -> str:
    time.sleep(seconds)  # the remote call under test blocks: this is the workload
    return "done"


def _tensor(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def _sum_local(ref: rpc.RemoteRef[torch.Tensor]) -> float:
    return float(ref.local_value().sum())


@rpc.register("test.scale")
def _scale(t: torch.Tensor, *, by: float) -> torch.Tensor:
    return t * by


_KILLED = threading.Event()


def _wait_killed(seconds: float) -> bool:
    return _KILLED.wait(seconds)


def _init(rank: int, world_size: int, **extra: object) -> rpc.RPCContext:
    return rpc.init(
        name=f"w{rank}",
        rank=rank,
        world_size=world_size,
        master_port=int(os.environ["MASTER_PORT"]),
        rendezvous_timeout=30.0,
        timeout=10.0,
        **extra,
    )


def _listeners(pids: list[int]) -> list[str]:
    """``ss -ltnp`` lines of TCP sockets that the given processes listen on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


# --- bodies ---------------------------------------------------------------------------------


def _calls_body() -> dict[str, float]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timings: dict[str, float] = {}
    with _init(rank, world) as ctx:
        assert ctx.worker_names == tuple(f"w{r}" for r in range(world))
        if rank == 0:
            peers = [f"w{r}" for r in range(1, world)]
            # results of plain callables, on a peer and on this worker itself
            assert torch.equal(
                rpc.rpc_sync("w1", torch.add, args=(torch.ones(3), 1)), torch.full((3,), 2.0)
            )
            assert rpc.rpc_sync("w0", max, args=(3, 7)) == 7
            # futures: many in flight, each to its own peer, then chained
            futs = [rpc.rpc_async(p, _tensor, args=(i + 2,)) for i, p in enumerate(peers)]
            assert [int(f.wait().numel()) for f in futs] == [i + 2 for i in range(len(peers))]
            chained = rpc.rpc_async("w1", _tensor, args=(4,)).then(lambda f: float(f.wait().sum()))
            assert chained.wait() == 6.0 and chained.done()
            failed = rpc.rpc_async("w1", _boom, args=("x",)).then(lambda f: f.wait())
            with pytest.raises(rpc.RemoteError, match="w1"):
                failed.wait()
            # registered names, with kwargs; unknown names list what the peer has
            assert torch.equal(
                rpc.rpc_sync("w1", "test.scale", args=(torch.ones(2),), kwargs={"by": 3.0}),
                torch.full((2,), 3.0),
            )
            with pytest.raises(
                rpc.UnknownFunctionError,
                match=r"'nope' is registered on w1; registered there: \[.*'test.scale'",
            ):
                rpc.rpc_sync("w1", "nope")
            # remote exceptions: typed, with the peer's name and the remote traceback
            with pytest.raises(rpc.RemoteError) as info:
                rpc.rpc_sync("w1", _boom, args=("missing key",))
            err = info.value
            assert err.peer == "w1" and err.remote_type == "builtins.KeyError"
            assert (
                "_boom raised KeyError on w1" in str(err)
                and "raise KeyError(text)" in err.remote_traceback
            )
            assert isinstance(err.original, KeyError) and err.__cause__ is err.original
            with pytest.raises(rpc.RemoteError, match=r"_Unpicklable on w1: 1/2") as info:
                rpc.rpc_sync("w1", _boom_unpicklable)
            assert info.value.original is None
            # user errors, raised before anything is sent
            with pytest.raises(
                ValueError, match=r"no RPC worker named 'w9'; the workers are \['w0'"
            ):
                rpc.rpc_sync("w9", max, args=(1, 2))
            with pytest.raises(TypeError, match="module level"):
                rpc.rpc_sync("w1", lambda: 1)
            # remote references
            ref = rpc.remote("w1", _tensor, args=(5,))
            assert ref.owner() == "w1"
            assert torch.equal(ref.to_here(), torch.arange(5.0))
            # the owner reads the value in place
            assert rpc.rpc_sync("w1", _sum_local, args=(ref,)) == 10.0
            bad = rpc.remote("w1", _boom, args=("in remote",))
            with pytest.raises(rpc.RemoteError, match="in remote"):
                bad.to_here()
            ref.release()
            ref.release()  # a no-op
            assert ref.released
            with pytest.raises(rpc.RemoteRefReleasedError, match="released"):
                ref.to_here()
            with pytest.raises(rpc.RemoteRefReleasedError, match="released"):
                rpc.rpc_sync("w1", _sum_local, args=(ref,))
            # a call that outlives its timeout on the peer: a typed error long before the call
            # would have ended (BLOCK_S). Quiet, it comes within timeout + SLACK_S (printed below);
            # that figure is not asserted: at load 7 on 2 cores a 2 s slack was broken once (CI)
            start = time.monotonic()
            with pytest.raises(
                rpc.RPCTimeoutError, match=r"_block on w1 did not finish within 0.5 s"
            ) as tinfo:
                rpc.rpc_sync("w1", _block, args=(BLOCK_S,), timeout=0.5)
            timings["rpc_sync_timeout_0.5"] = time.monotonic() - start
            assert isinstance(tinfo.value, DistributedTimeoutError) and isinstance(
                tinfo.value, TimeoutError
            )
            start = time.monotonic()
            slow = rpc.remote("w1", _block, args=(BLOCK_S,), timeout=0.5)
            # the copy's 0.5 s and the creation's 0.5 s race: either timeout is the typed error
            with pytest.raises(rpc.RPCTimeoutError, match="unusable|did not finish within 0.5 s"):
                slow.to_here()
            timings["remote_timeout_0.5"] = time.monotonic() - start
            start = time.monotonic()
            with pytest.raises(rpc.RPCTimeoutError, match="unusable"):  # still unusable, at once
                slow.to_here(timeout=5)
            timings["remote_reuse_after_timeout"] = time.monotonic() - start
            for name, seconds in timings.items():
                assert seconds < BLOCK_S - 1.0, (name, seconds)
            # the agent and the store listen on loopback only
            if shutil.which("ss"):
                pids = [rpc.rpc_sync(f"w{r}", os.getpid) for r in range(world)]
                lines = _listeners(pids)
                assert lines, "no listening socket found"
                assert all(" 127.0.0.1:" in line for line in lines), "\n".join(lines)
                timings["listeners"] = float(len(lines))
        start = time.monotonic()
        assert rpc.shutdown() is True
        timings["graceful_shutdown"] = time.monotonic() - start
    assert not rpc.is_initialized()
    return timings


def test_calls_errors_futures_refs_timeouts() -> None:
    start = time.monotonic()
    results = run_distributed(_calls_body, 3, init=False, timeout=60)
    print(f"\n3 workers, total {time.monotonic() - start:.1f} s; rank 0: {results[0]}")


_VICTIM = """
import sys
from torsh_distributed import rpc
rpc.init(name="w2", rank=2, world_size=3, master_port=int(sys.argv[1]), timeout=10.0)
rpc.shutdown(timeout=60)  # serves calls until every worker shuts down (or this one is killed)
"""


def _killed_peer_body() -> dict[str, float]:
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    timings: dict[str, float] = {}
    victim = None
    if rank == 0:  # the third worker is a plain process, so its SIGKILL is not a harness failure
        victim = subprocess.Popen([sys.executable, "-c", _VICTIM, str(port)])
    try:
        _init(rank, 3, shutdown_timeout=3.0)
        if rank == 0:
            pid = rpc.rpc_sync("w2", os.getpid)
            assert pid == victim.pid
            in_flight = rpc.rpc_async("w2", time.sleep, args=(30,), timeout=5.0)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            _KILLED.set()
            with pytest.raises((rpc.PeerUnavailableError, rpc.RPCTimeoutError), match="w2"):
                in_flight.wait()
            timings["in_flight_call"] = time.monotonic() - killed_at
            assert timings["in_flight_call"] < 5.0 + LOADED_SLACK_S  # not the 30 s of the call
            assert victim.wait(timeout=10) == -signal.SIGKILL
        else:
            assert rpc.rpc_sync("w0", _wait_killed, args=(20.0,)) is True
        start = time.monotonic()
        with pytest.raises((rpc.PeerUnavailableError, rpc.RPCTimeoutError), match=r"w2") as info:
            rpc.rpc_sync("w2", os.getpid, timeout=3.0)
        timings["new_call"] = time.monotonic() - start
        assert timings["new_call"] < 3.0 + LOADED_SLACK_S, info.value
        start = time.monotonic()
        graceful = rpc.shutdown()  # shutdown_timeout=3: falls back to a local shutdown
        timings["shutdown"] = time.monotonic() - start
        assert graceful is False
        assert timings["shutdown"] < 3.0 + LOADED_SLACK_S + 1.0
        assert not rpc.is_initialized()
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait()
    return timings


def test_killed_peer_fails_calls_and_shutdown_is_bounded() -> None:
    start = time.monotonic()
    results = run_distributed(_killed_peer_body, 2, init=False, timeout=60)
    print(f"\ntotal {time.monotonic() - start:.1f} s; per rank: {results}")


def _token_body(tokens: list[str], store_url: str) -> str:
    rank = int(os.environ["RANK"])
    try:  # a file store: the first rank to fail must not take the store away from the other
        rpc.init(name=f"w{rank}", rank=rank, world_size=2, store_url=store_url, token=tokens[rank])
    except ConfigurationError as exc:
        return str(exc)
    rpc.shutdown(graceful=False)
    return "joined"


def test_token_mismatch_is_refused_before_the_agent_starts(tmp_path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_distributed(
        _token_body, 2, args=(["secret-a", "secret-b"], url), init=False, timeout=60
    )
    for rank, text in enumerate(results):
        assert f"rank {1 - rank}) presented a different token" in text, text


def test_same_token_joins(tmp_path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_distributed(_token_body, 2, args=(["s", "s"], url), init=False, timeout=60)
    assert results == ["joined", "joined"]
