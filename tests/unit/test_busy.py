"""Start-up deadlines on a busy host: a default deadline stretches with the load per usable
core (never shrinks, at most 10x); a deadline the user set is never changed."""

from __future__ import annotations

import os

import pytest

from torsh_distributed.compat.horovod import _launch
from torsh_distributed.runtime import busy


def _host(monkeypatch: pytest.MonkeyPatch, *, load: float, cores: int) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))


@pytest.mark.parametrize(
    ("load", "cores", "factor"),
    [(0.3, 2, 1.0), (2.0, 2, 1.0), (6.0, 2, 3.0), (20.0, 2, 10.0), (20.0, 16, 1.25), (500.0, 2, 10.0)],
)
def test_factor_is_load_per_usable_core_between_1_and_10(
    monkeypatch: pytest.MonkeyPatch, load: float, cores: int, factor: float
) -> None:
    _host(monkeypatch, load=load, cores=cores)
    assert busy.usable_cores() == cores
    assert busy.busy_factor() == pytest.approx(factor)
    assert busy.scaled_start_timeout(30.0) == pytest.approx(30.0 * factor)


def test_unreadable_load_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unreadable)
    assert busy.busy_factor() == 1.0


def test_horovod_default_start_timeout_stretches_but_a_set_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, load=20.0, cores=2)
    monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    assert _launch._start_timeout(None) == pytest.approx(10 * _launch.DEFAULT_START_TIMEOUT_S)
    assert _launch._start_timeout(12.0) == 12.0  # the caller's value is theirs
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "45")
    assert _launch._start_timeout(None) == 45.0  # so is the environment's, as in Horovod
    _host(monkeypatch, load=0.5, cores=2)
    monkeypatch.delenv("HOROVOD_START_TIMEOUT")
    assert _launch._start_timeout(None) == _launch.DEFAULT_START_TIMEOUT_S


def test_openmp_waits_sleep_on_a_busy_host_and_spin_on_a_quiet_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, load=0.0, cores=2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    env: dict[str, str] = {}
    assert busy.sleeping_openmp_waits(env, runnable=2.0)  # two burners on 2 cores
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["TORSH_OMP_WAIT"].startswith("PASSIVE (busy): 2 thread")
    for quiet in (0.0, 0.34):  # nothing, or a neighbour ready at one read in three
        env = {}
        assert not busy.sleeping_openmp_waits(env, runnable=quiet)
        assert "OMP_WAIT_POLICY" not in env and env["TORSH_OMP_WAIT"].startswith("spin (quiet)")
    env = {}
    assert busy.sleeping_openmp_waits(env, runnable=None)  # unreadable: the safe side
    assert "cannot be read" in env["TORSH_OMP_WAIT"]
    # a team of 1 core of 2 (an affinity mask): one neighbour still leaves it a core
    _host(monkeypatch, load=0.0, cores=1)
    assert not busy.sleeping_openmp_waits({}, runnable=1.0)


def test_openmp_waits_are_the_users_or_the_parents_choice() -> None:
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        assert not busy.sleeping_openmp_waits(env, runnable=8.0)
        assert env.pop("TORSH_OMP_WAIT").startswith("kept: ") and env == chosen  # the user's is kept
    inherited = {"TORSH_OMP_WAIT": "spin (quiet): ..."}
    assert not busy.sleeping_openmp_waits(inherited, runnable=8.0)
    assert inherited == {"TORSH_OMP_WAIT": "spin (quiet): ..."}  # the parent decided


def test_runnable_threads_are_read_from_proc_stat() -> None:
    seen = busy.runnable_besides_me(samples=2, interval_s=0.0)
    if not os.path.exists("/proc/stat"):
        assert seen is None
    else:
        assert seen is not None and seen >= 0
