"""Asynchronous ``gloo+shm`` operations on real processes: ``async_op=True`` returns before the
collective can have completed (the peer has not called it yet) and the caller keeps running
Python; a mix of asynchronous and waiting calls of every kind completes in call order with
Gloo's results; DDP's bucket all-reduces run on the progress thread and train as on Gloo; a
group destroyed while an operation waits for a peer fails that work and leaves nothing behind; a
peer that dies during DDP's backward fails the backward with our message (it once crashed the
reducer: torch's ``Future.set_exception`` completes a future with the exception as its value).
(A dead or hung peer seen through ``Work.wait()``: tests/distributed/test_shm_safety.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.runtime.errors import CommunicationError
from torsh_distributed.testing import RankFailedError, run_distributed

pytestmark = [
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm"),
    pytest.mark.timeout(240),
]


def _async_mix() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    gloo = dist.new_group(backend="gloo")
    x = torch.full((1_000_000,), float(rank + 1))  # 4 MB: many phases of the C kernel
    returned_early = True
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        # rank 1 calls its all-reduce only after this store write: the work cannot be done yet,
        # and the caller (holding the GIL between bytecodes) ran on while the thread waited
        returned_early = not work.is_completed()
        store.set("rank0 went on", "1")
    else:
        store.wait(["rank0 went on"])
        work = dist.all_reduce(x, async_op=True)
    # every kind, sizes that differ (a reordering would mix them up or hang), waiting calls between
    small = torch.arange(10, dtype=torch.int64) * (rank + 1)
    works = [work, dist.all_reduce(small, op=dist.ReduceOp.MAX, async_op=True)]
    b = torch.arange(70_000, dtype=torch.float32) * (rank == 1)
    works.append(dist.broadcast(b, 1, async_op=True))
    gathered = torch.empty(n * 5000, dtype=torch.bfloat16)
    works.append(
        dist.all_gather_into_tensor(
            gathered, torch.full((5000,), float(rank), dtype=torch.bfloat16), async_op=True
        )
    )
    full = torch.arange(n * 40_000, dtype=torch.float64) + rank
    part = torch.empty(40_000, dtype=torch.float64)
    works.append(dist.reduce_scatter_tensor(part, full, async_op=True))
    sync = torch.full((33,), float(rank))
    dist.all_reduce(sync)  # waits: queued behind the five above, done when it returns
    sync_done_first = all(w.is_completed() for w in works)
    works.append(dist.barrier(async_op=True))
    for w in works:
        w.wait()
    failures = []
    ref_small = torch.arange(10, dtype=torch.int64)
    dist.all_reduce(ref_small.mul_(rank + 1), op=dist.ReduceOp.MAX, group=gloo)
    ref_part = torch.empty_like(part)
    dist.reduce_scatter_tensor(ref_part, full, group=gloo)
    ref_gathered = torch.empty_like(gathered)
    dist.all_gather_into_tensor(
        ref_gathered, torch.full((5000,), float(rank), dtype=torch.bfloat16), group=gloo
    )
    checks = {
        "all_reduce 12 MB": torch.equal(x, torch.full_like(x, n * (n + 1) / 2)),
        "all_reduce max": torch.equal(small, ref_small),
        "broadcast": torch.equal(b, torch.arange(70_000, dtype=torch.float32)),
        "all_gather": torch.equal(gathered, ref_gathered),
        "reduce_scatter": torch.equal(part, ref_part),
        "waiting all_reduce": torch.equal(sync, torch.full((33,), float(sum(range(n))))),
    }
    failures = [name for name, ok in checks.items() if not ok]
    return {
        "failures": failures,
        "returned_early": returned_early,
        "sync_done_first": sync_done_first,
        "runs": dict(dist.group.WORLD.progress.runs),
    }


def _ddp(steps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    pg = dist.group.WORLD
    before = dict(getattr(pg, "progress", None).runs) if dist.get_backend() == "gloo+shm" else {}
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ddp(torch.randn(16, 64, generator=data)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = dict(pg.progress.runs) if before else {}
    on_thread = after.get("thread", 0) - before.get("thread", 0)
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "on_thread": on_thread,
    }


def test_async_ops_return_at_once_and_complete_in_call_order():
    for result in run_distributed(_async_mix, 2, backend="gloo+shm", timeout=180):
        assert result["failures"] == []
        assert result["returned_early"]
        assert result["sync_done_first"], "a waiting call returned before earlier async ones ran"
        assert result["runs"]["thread"] >= 6


def test_ddp_bucket_all_reduces_run_on_the_progress_thread_and_equal_gloo():
    shm = run_distributed(_ddp, 2, args=(4,), backend="gloo+shm", timeout=180)
    gloo = run_distributed(_ddp, 2, args=(4,), backend="gloo", timeout=180)
    assert shm[0]["on_thread"] >= 4 * 2  # several buckets a step, all queued to the thread
    for a, b in zip(shm[0]["params"], shm[1]["params"], strict=True):
        assert torch.equal(a, b), "ranks disagree"
    assert shm[0]["losses"] == pytest.approx(gloo[0]["losses"], rel=1e-6)
    for a, b in zip(shm[0]["params"], gloo[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _destroy_while_waiting() -> dict:
    pg = dist.new_group(backend="gloo+shm")
    rank = dist.get_rank()
    name = None
    error = None
    if rank == 0:
        name = pg._transport.segment.name
        work = dist.all_reduce(torch.ones(1000), group=pg, async_op=True)  # rank 1 never joins
        deadline = time.monotonic() + 60
        while pg.progress._queue and time.monotonic() < deadline:
            time.sleep(0.001)  # until the thread runs it: a running job must be cancelled
        dist.destroy_process_group(pg)  # cancels the waiting job, then unmaps the segment
        try:
            work.wait()
        except CommunicationError as exc:
            error = str(exc)
        thread_alive = pg.progress._thread is not None and pg.progress._thread.is_alive()
    else:
        thread_alive = False
    dist.barrier()  # the default group (not the destroyed one)
    if rank == 1:
        dist.destroy_process_group(pg)
    return {"error": error, "thread_alive": thread_alive, "name": name, "pid": os.getpid()}


def test_a_group_destroyed_while_an_async_op_waits_fails_the_work():
    results = run_distributed(_destroy_while_waiting, 2, backend="gloo+shm", timeout=120)
    error = results[0]["error"]
    assert error is not None and "cancelled: the process group is shutting down" in error
    assert not results[0]["thread_alive"]
    assert not (Path("/dev/shm") / results[0]["name"]).exists()


def _ddp_peer_dies(out: str) -> None:
    from torsh_distributed.runtime import world

    world.init(backend="gloo+shm", timeout=30.0)  # a dead peer is seen in 0.25 s regardless
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    ddp(torch.randn(8, 256)).sum().backward()
    loss = ddp(torch.randn(8, 256)).sum()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # after the forward: rank 0's backward waits on it
    start = time.monotonic()
    try:
        loss.backward()
        error = None
    except RuntimeError as exc:  # DDP's reducer waits in C++: torch wraps the error it got
        error = str(exc)
    Path(out).write_text(json.dumps({"error": error, "elapsed": time.monotonic() - start}))


def test_a_peer_dying_during_ddp_backward_fails_the_backward_with_our_message(tmp_path):
    out = tmp_path / "rank0.json"
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed"):
        run_distributed(_ddp_peer_dies, 2, args=(str(out),), init=False, timeout=120)
    result = json.loads(out.read_text())
    assert result["error"] is not None, "rank 0's backward finished without its peer"
    assert "rank 1 did not reach all_reduce(sum) over shared memory: its process" in result["error"]
    assert result["elapsed"] < 30  # the dead process was seen, not the group's timeout
