"""``horovod.run``'s arguments: Horovod's signature is accepted, the elastic, MPI and remote-host
arguments are refused with an error naming the argument, the ssh ones warn that they have no
effect, and nothing that cannot be pickled reaches a process. No rank is started here (each case
fails before the processes start); tests/distributed/test_horovod_run.py runs real jobs."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any

import pytest

import torsh_distributed.horovod as horovod


def _noop() -> None:
    return None


HOROVOD_SIGNATURE = [  # horovod/runner/__init__.py, in order
    "func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit",
    "cooldown_range", "hosts", "hostfile", "start_timeout", "ssh_port", "ssh_identity_file",
    "disable_cache", "output_filename", "verbose", "use_gloo", "use_mpi", "mpi_args",
    "network_interface", "executable", "np", "min_np", "max_np",
]


def test_horovods_positional_order_is_kept():
    params = inspect.signature(horovod.run).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == HOROVOD_SIGNATURE


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"min_num_proc": 1}, "min_num_proc"),
        ({"max_num_proc": 4}, "max_num_proc"),
        ({"slots": 2}, "slots"),
        ({"reset_limit": 3}, "reset_limit"),
        ({"cooldown_range": (1, 10)}, "cooldown_range"),
        ({"use_mpi": True}, "use_mpi"),
        ({"mpi_args": "-x NCCL_DEBUG"}, "mpi_args"),
    ],
)
def test_unsupported_arguments_are_refused_by_name(kwargs: dict[str, Any], named: str):
    with pytest.raises(ValueError, match=rf"horovod.run\({named}=\.\.\.\) is not supported here"):
        horovod.run(_noop, num_proc=2, **kwargs)


def test_deprecated_names_warn_like_horovod_and_elastic_ones_are_refused():
    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"):
        with pytest.raises(ValueError, match=r"horovod.run\(min_np=\.\.\.\) is not supported here: elastic"):
            horovod.run(_noop, min_np=1)
    # np is num_proc (when num_proc is left at 1): 2 ranks do not fit one slot
    with pytest.warns(DeprecationWarning, match="np is deprecated, use num_proc"):
        with pytest.raises(ValueError, match=r"num_proc 2 is more than the 1 slot\(s\) of localhost"):
            horovod.run(_noop, np=2, hosts="localhost:1")


def test_hosts_must_be_this_machine(tmp_path: Path):
    with pytest.raises(ValueError, match=r"names node7: it starts its ranks on this host only .*launch.ray"):
        horovod.run(_noop, num_proc=2, hosts="node7:2")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nnode8 slots=2\n")
    with pytest.raises(ValueError, match=r"names localhost, node8"):
        horovod.run(_noop, num_proc=2, hostfile=str(hostfile))
    with pytest.raises(ValueError, match="pass hosts or hostfile, not both"):
        horovod.run(_noop, num_proc=2, hosts="localhost:2", hostfile=str(hostfile))
    with pytest.raises(ValueError, match="num_proc must be an integer >= 1"):
        horovod.run(_noop, num_proc=0)


def test_ssh_arguments_have_no_effect_and_say_so():
    with pytest.warns(UserWarning, match=r"horovod.run\(ssh_port=\.\.\.\) has no effect"):
        with pytest.raises(ValueError, match="more than the 1 slot"):
            horovod.run(_noop, num_proc=2, hosts="localhost:1", ssh_port=2222)


def test_what_cannot_be_pickled_never_reaches_a_process():
    with pytest.raises(TypeError, match="func, args and kwargs must pickle"):
        horovod.run(_noop, args=(threading.Lock(),), num_proc=2)
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        horovod.run(_noop, num_proc=2, timeout_s=0)
    with pytest.raises(ValueError, match="HOROVOD_START_TIMEOUT must be seconds"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HOROVOD_START_TIMEOUT", "soon")
            horovod.run(_noop, num_proc=2)
