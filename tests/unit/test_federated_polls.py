"""Flower's idle polls shortened (``federated/_flower_polls.py``): the two sites still hold the
3-second sleep this Flower was read for, the clock that replaces ``time`` there shortens only
that sleep, the interval is validated wherever it is given, and the SuperNode's command, its
environment and the ServerApp's forked process all carry it (the rounds themselves:
``benchmarks/bench_federated_polls.py``; every federated integration test runs with it)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time

import pytest

from torsh_distributed.federated import _flower_polls as polls
from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.deploy import Federation, _env, join


@pytest.mark.parametrize("site", [polls.SUPERNODE_SITE, polls.SERVERAPP_SITE])
def test_flower_still_sleeps_three_seconds_where_it_idles(site: str) -> None:
    # if Flower changes these, shorten_idle_polls leaves them alone: this says it is time to re-read
    source = inspect.getsource(importlib.import_module(site))
    assert "time.sleep(3)" in source and "\nimport time\n" in source


def test_the_clock_shortens_only_the_idle_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = polls.PollClock(0.25)
    clock.sleep(3)
    clock.sleep(0.5)
    clock.sleep(3.0)
    assert slept == [0.25, 0.5, 0.25]
    assert clock.monotonic is time.monotonic and clock.time is time.time


def test_shorten_patches_flowers_modules_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    sites = (polls.SUPERNODE_SITE, polls.SERVERAPP_SITE)
    modules = [importlib.import_module(s) for s in sites]
    for module in modules:
        monkeypatch.setattr(module, "time", time)  # undone after the test
    assert polls.shorten_idle_polls(0.5, sites) == list(sites)
    assert all(isinstance(m.time, polls.PollClock) and m.time.poll_s == 0.5 for m in modules)
    assert polls.shorten_idle_polls(0.1, sites) == list(sites)  # a second call updates the interval
    assert all(m.time.poll_s == 0.1 for m in modules)


def test_no_interval_or_flowers_own_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(polls.SUPERNODE_SITE)
    monkeypatch.setattr(module, "time", time)
    assert polls.shorten_idle_polls(None, (polls.SUPERNODE_SITE,)) == []
    assert polls.shorten_idle_polls(3, (polls.SUPERNODE_SITE,)) == []
    assert module.time is time


def test_a_site_without_the_sleep_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    # this module has no `time.sleep(3)` of Flower's: nothing is replaced, and the log says why
    with caplog.at_level("WARNING"):
        assert polls.shorten_idle_polls(0.25, ("torsh_distributed.federated.report",)) == []
    assert "left as Flower has them" in caplog.text


@pytest.mark.parametrize("bad", [0, -1, 3.5, float("nan"), True])
def test_bad_intervals_are_refused_with_their_name(bad: float) -> None:
    with pytest.raises(ValueError, match=r"poll_s \(--poll\) must be seconds in \(0, 3\]"):
        Federation(FederatedConfig(clients=1), poll_s=bad)
    with pytest.raises(ValueError, match=r"poll_s \(--poll\) must be seconds in \(0, 3\]"):
        join("127.0.0.1:9092", partition_id=0, num_partitions=1, poll_s=bad)


def test_the_environment_carries_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(polls.SUPEREXEC_POLL_ENV, raising=False)
    env = _env(poll_s=0.5)
    assert env[polls.POLL_ENV] == "0.5" and env[polls.SUPEREXEC_POLL_ENV] == "0.5"
    assert polls.poll_from_env(env) == 0.5
    monkeypatch.setenv(polls.SUPEREXEC_POLL_ENV, "2")  # the user's own Flower setting wins
    assert _env(poll_s=0.5)[polls.SUPEREXEC_POLL_ENV] == "2"
    assert polls.poll_from_env({}) is None
    with pytest.raises(ValueError, match="TORSH_FLOWER_POLL_S='soon' is not a number of seconds"):
        polls.poll_from_env({polls.POLL_ENV: "soon"})
    with pytest.raises(ValueError, match=r"TORSH_FLOWER_POLL_S must be seconds in \(0, 3\]"):
        polls.poll_from_env({polls.POLL_ENV: "9"})


def test_the_wrapper_refuses_anything_but_the_supernode(capsys: pytest.CaptureFixture[str]) -> None:
    assert polls.main(["flwr", "run"]) == 2
    assert (
        "usage: python -m torsh_distributed.federated._flower_polls flower-supernode"
        in capsys.readouterr().err
    )


def test_the_forked_serverapp_gets_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from torsh_distributed.federated import _warm_node

    grid = importlib.import_module(polls.SERVERAPP_SITE)
    monkeypatch.setattr(grid, "time", time)
    monkeypatch.setenv(polls.POLL_ENV, "0.3")
    ran: list[str] = []
    monkeypatch.setitem(_warm_node._WARM_TASKS, "flwr-serverapp", f"{__name__}:_fake_main")
    monkeypatch.setattr(_warm_node._warm, "line_buffered_output", lambda: None)
    monkeypatch.setattr(_warm_node._warm, "set_title", lambda argv: ran.append(" ".join(argv)))
    # run_app ends a forked process: it runs the atexit handlers, which here, in the pytest process,
    # would remove multiprocessing's temporary directory (the harness's forkserver socket with it)
    monkeypatch.setattr(_warm_node._warm, "exit_handlers_at_end", contextlib.nullcontext)
    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))
    _warm_node.run_app(["flwr-serverapp", "--token", "t"], False)
    assert isinstance(grid.time, polls.PollClock) and grid.time.poll_s == 0.3
    assert _FAKE_CALLS == [1]


_FAKE_CALLS: list[int] = []


def _fake_main() -> None:
    _FAKE_CALLS.append(1)
