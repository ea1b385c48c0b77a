"""init() rejects bad arguments before any process group is touched."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torsh_distributed as tdist
from torsh_distributed.runtime.errors import (
    ConfigurationError,
    RankOutOfRangeError,
    TorshDistributedError,
)
from torsh_distributed.runtime.world import resolve_backend


def test_world_size_zero():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        tdist.init(rank=0, world_size=0, env={})


def test_rank_not_below_world_size():
    with pytest.raises(RankOutOfRangeError, match="rank 2 is out of range for world_size 2"):
        tdist.init(rank=2, world_size=2, env={})
    with pytest.raises(ValueError):  # also a ValueError for callers that catch that
        tdist.init(rank=-1, world_size=2, env={})


def test_rank_without_world_size():
    with pytest.raises(ValueError, match="pass both rank and world_size"):
        tdist.init(rank=0, env={})


def test_non_integer_rank_is_type_error():
    with pytest.raises(TypeError, match="rank must be an int, got str"):
        tdist.init(rank="0", world_size=2, env={})


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'mpi2'; choose one of auto, gloo, nccl"):
        tdist.init(backend="mpi2", env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda():
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        tdist.init(backend="nccl", env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_auto_backend_on_cpu_is_gloo_shm_for_local_ranks_else_gloo():
    from torsh_distributed.runtime import shm

    assert resolve_backend("auto", local_world_size=1) == "gloo"
    want = "gloo+shm" if shm.unavailable_reason() is None else "gloo"
    try:
        assert resolve_backend("auto", local_world_size=2) == want
    finally:
        shm.set_lenient(False)  # resolve_backend set it for the groups of this process


def test_bad_timeout():
    with pytest.raises(ValueError, match="timeout must be positive"):
        tdist.init(timeout=0, env={})
    with pytest.raises(TypeError, match="timeout must be a timedelta or seconds"):
        tdist.init(timeout="10", env={})


def test_store_and_init_method_are_exclusive():
    with pytest.raises(ValueError, match="pass init_method or store, not both"):
        tdist.init(init_method="env://", store=dist.HashStore(), env={})


def test_missing_master_addr_names_the_fix():
    with pytest.raises(ConfigurationError, match="export MASTER_ADDR") as info:
        tdist.init(env={"RANK": "0", "WORLD_SIZE": "2"})
    assert info.value.operation == "init" and info.value.rank == 0


def test_single_process_world_needs_no_launcher():
    with tdist.init(env={}) as rt:
        assert (rt.rank, rt.world_size, rt.backend) == (0, 1, "gloo")
        assert tdist.is_initialized() and tdist.world_size() == 1
        assert str(rt.device) == "cpu"
    assert not tdist.is_initialized()
    tdist.shutdown()  # a second shutdown is harmless


def test_error_message_names_rank_operation_and_fix():
    err = TorshDistributedError("peer 3 vanished", rank=1, operation="all_reduce", fix="restart")
    assert str(err) == "[rank 1, all_reduce] peer 3 vanished Fix: restart"
    import pickle

    copy = pickle.loads(pickle.dumps(err))
    assert (copy.rank, copy.operation, copy.fix) == (1, "all_reduce", "restart")


def test_shutdown_frees_unreachable_ddp_before_destroying_the_group():
    """A DDP wrapper in a reference cycle keeps its process group alive; left to the
    interpreter's final collection, Gloo's teardown there aborted `torsh-dist train` now and then
    ("terminate called without an active exception"). shutdown() collects it first."""
    import gc
    import weakref

    gc.disable()  # only shutdown() may collect the cycle
    try:
        tdist.init(env={})
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        model.loop = [model]  # a reference cycle, as hooks and closures make in practice
        alive = weakref.ref(model)
        del model
        assert alive() is not None
        tdist.shutdown()
        assert alive() is None
    finally:
        gc.enable()
        tdist.shutdown()
