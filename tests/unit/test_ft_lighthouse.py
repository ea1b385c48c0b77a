"""The launcher's lighthouse (torsh_distributed.ft._lighthouse) against torchft's own Rust client:
the quorum protocol, the split-brain hold of torchft's rules, and forget() releasing it at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")

from torchft._torchft import LighthouseClient  # noqa: E402

from torsh_distributed.ft._lighthouse import Lighthouse  # noqa: E402

T = timedelta(seconds=10)


def _quorum(client: LighthouseClient, rid: str, step: int, out: dict[str, object]) -> None:
    out[rid] = client.quorum(
        replica_id=rid,
        timeout=T,
        address=f"addr-{rid}",
        store_address="s",
        step=step,
        world_size=2,
        shrink_only=False,
    )


@pytest.mark.timeout(60)
def test_two_groups_then_forget_releases_the_survivor_at_once() -> None:
    lighthouse = Lighthouse(heartbeat_timeout_s=30.0)
    try:
        client = LighthouseClient(lighthouse.address(), connect_timeout=T)
        client.heartbeat("g0:a")
        client.heartbeat("g1:b")  # both alive: the first to ask waits for the other
        got: dict[str, object] = {}
        threads = [
            threading.Thread(target=_quorum, args=(client, rid, 3, got)) for rid in ("g0:a", "g1:b")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        first = got["g0:a"]
        assert [p.replica_id for p in first.participants] == ["g0:a", "g1:b"]
        assert [p.step for p in first.participants] == [3, 3]
        assert first.participants[1].address == "addr-g1:b"

        # g1 heartbeats but never joins: g0 alone is half of the living, held (split brain)
        client.heartbeat("g1:b")
        lone: dict[str, object] = {}
        waiter = threading.Thread(target=_quorum, args=(client, "g0:a", 4, lone))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "a lone half must wait"
        started = time.monotonic()
        lighthouse.forget("g1")  # the launcher saw group 1's processes die
        waiter.join(10)
        assert not waiter.is_alive()
        assert time.monotonic() - started < 5  # not the 30 s heartbeat timeout (margin: load)
        second = lone["g0:a"]
        assert [p.replica_id for p in second.participants] == ["g0:a"]
        assert second.quorum_id == first.quorum_id + 1
    finally:
        lighthouse.shutdown()


@pytest.mark.timeout(60)
def test_silent_group_leaves_after_the_heartbeat_timeout() -> None:
    lighthouse = Lighthouse(heartbeat_timeout_s=0.5)
    try:
        client = LighthouseClient(lighthouse.address(), connect_timeout=T)
        client.heartbeat("g1:b")
        done = threading.Event()

        def beat() -> None:  # g0's manager heartbeats while it waits (as torchft's does)
            while not done.wait(0.05):
                client.heartbeat("g0:a")

        beating = threading.Thread(target=beat)
        beating.start()
        got: dict[str, object] = {}
        started = time.monotonic()
        try:
            _quorum(client, "g0:a", 0, got)
        finally:
            done.set()
            beating.join()
        assert 0.3 < time.monotonic() - started < 5
        assert [p.replica_id for p in got["g0:a"].participants] == ["g0:a"]
    finally:
        lighthouse.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("release", ["group 0 joins", "group 0 given up"])
def test_the_first_quorum_waits_for_every_group_even_one_not_heartbeating_yet(release: str) -> None:
    """A job starts with all its groups: group 0's heartbeat has not arrived (a loaded host)
    when group 1 asks; group 1 waits until group 0 joins, or until the launcher gives it up."""
    lighthouse = Lighthouse(start_replicas=2, heartbeat_timeout_s=30.0)
    try:
        client = LighthouseClient(lighthouse.address(), connect_timeout=T)
        got: dict[str, object] = {}
        early = threading.Thread(target=_quorum, args=(client, "g1:b", 0, got))
        early.start()
        early.join(1.0)
        assert early.is_alive(), "the first quorum must wait for group 0"
        if release == "group 0 joins":
            _quorum(client, "g0:a", 0, got)
            want = ["g0:a", "g1:b"]
        else:
            lighthouse.give_up("g0")  # the launcher gave group 0 up before the job's first step
            want = ["g1:b"]
        early.join(10)
        assert not early.is_alive()
        for rid in want:
            assert [p.replica_id for p in got[rid].participants] == want  # type: ignore[attr-defined]
    finally:
        lighthouse.shutdown()


@pytest.mark.timeout(60)
def test_on_request_tells_each_replicas_first_quorum_request_once() -> None:
    told: list[str] = []
    lighthouse = Lighthouse(heartbeat_timeout_s=30.0, on_request=told.append)
    try:
        client = LighthouseClient(lighthouse.address(), connect_timeout=T)
        client.heartbeat("g0:a")
        assert told == []  # a heartbeat is not a request to join
        for step in (1, 2):  # g0 alone: a quorum each time; told only of the first request
            got: dict[str, object] = {}
            _quorum(client, "g0:a", step, got)
            assert [p.replica_id for p in got["g0:a"].participants] == ["g0:a"]
        assert told == ["g0:a"]
        later: dict[str, object] = {}  # a restarted g1: told while it waits (split brain)
        waiter = threading.Thread(target=_quorum, args=(client, "g1:c", 0, later))
        waiter.start()
        deadline = time.monotonic() + 10
        while told != ["g0:a", "g1:c"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told == ["g0:a", "g1:c"] and waiter.is_alive()
        _quorum(client, "g0:a", 3, later)  # g0 back: the fast quorum takes g1 in
        waiter.join(10)
        assert [p.replica_id for p in later["g1:c"].participants] == ["g0:a", "g1:c"]
    finally:
        lighthouse.shutdown()
