"""The collectives facade against raw torch.distributed on real Gloo groups of 2 and 4 ranks.

One multi-rank run per world size checks the whole matrix (op x reduce op x dtype x algorithm x
size, sub-groups, async handles, p2p, object collectives) and returns the list of failures, so the
matrix costs two process launches, not hundreds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.comm import ParallelDims, ReduceOp, profiler
from torsh_distributed.comm import collectives as C
from torsh_distributed.testing import run_distributed

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.bool,
]
SIZES = [1, 3, 1001]  # 1 and 3 are fewer elements than ranks (empty ring chunks); 1001 is uneven


def _data(rank: int, n: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op is ReduceOp.PRODUCT:
        vals = torch.randint(1, 3, (n,), generator=g)
    elif dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 4 - 2).to(dtype)
    else:
        vals = torch.randint(0, 8, (n,), generator=g)
    return vals.to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        tol = 2e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    return torch.equal(a, b)


def _reference(t: torch.Tensor, op: ReduceOp, group) -> torch.Tensor:
    ref = t.clone()
    if op is ReduceOp.MEAN:
        ref = ref.double()
        dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=group)
        return (ref / dist.get_world_size(group)).to(t.dtype)
    dist.all_reduce(ref, op=op.to_torch(native_avg=False), group=group)
    return ref


def _all_reduce_matrix(group, algos: list[str], failures: list[str], tag: str) -> int:
    rank, cases = dist.get_rank(), 0
    for dtype in DTYPES:
        for op in ReduceOp:
            for n in SIZES:
                base = _data(rank, n, dtype, op)
                try:
                    C.all_reduce(base.clone(), op, group=group)
                except TypeError:
                    bad = (op is ReduceOp.MEAN and not dtype.is_floating_point) or (
                        op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
                        and dtype.is_floating_point
                    )
                    if not bad:
                        failures.append(f"{tag} unexpected TypeError {dtype} {op}")
                    continue
                ref = _reference(base, op, group)
                for algo in algos:
                    out = base.clone()
                    C.all_reduce(out, op, group=group, algorithm=algo)
                    cases += 1
                    if not _close(out, ref):
                        failures.append(
                            f"{tag} all_reduce {algo} {op.name} {dtype} n={n}: {out[:4]} != {ref[:4]}"
                        )
    return cases


def _rooted_matrix(group, failures: list[str], tag: str) -> int:
    """reduce (torch, tree) and reduce_scatter_tensor for every reduce op x dtype vs raw torch."""
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    me, n, cases = dist.get_rank(), len(ranks), 0
    root = ranks[-1]
    for dtype in DTYPES:
        for op in ReduceOp:
            base = _data(me, 3 * n, dtype, op)
            try:
                C.reduce(base.clone(), root, op, group=group)
            except TypeError:
                continue  # dtype rules are checked in _all_reduce_matrix
            ref = _reference(base, op, group)  # all-reduce: what the root must hold
            for algo in ("torch", "tree"):
                out = base.clone()
                C.reduce(out, root, op, group=group, algorithm=algo)
                cases += 1
                if me == root and not _close(out, ref):
                    failures.append(
                        f"{tag} reduce {algo} {op.name} {dtype}: {out[:4]} != {ref[:4]}"
                    )
            shard = torch.zeros(3, dtype=dtype)
            C.reduce_scatter_tensor(shard, base.clone(), op, group=group)
            cases += 1
            mine = ref[3 * ranks.index(me) : 3 * ranks.index(me) + 3]
            if not _close(shard, mine):
                failures.append(f"{tag} reduce_scatter {op.name} {dtype}: {shard} != {mine}")
    return cases


def _other_ops(group, failures: list[str], tag: str) -> int:
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    n, me, cases = len(ranks), dist.get_rank(), 0
    gi = ranks.index(me)
    for src in ranks:  # broadcast, both algorithms, every root, uneven size
        for algo in ("torch", "tree", "auto"):
            t = torch.full((7,), float(me))
            C.broadcast(t, src, group=group, algorithm=algo)
            cases += 1
            if not torch.equal(t, torch.full((7,), float(src))):
                failures.append(f"{tag} broadcast {algo} src={src}: {t}")
    for dst in ranks:
        for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.PRODUCT):
            for algo in ("torch", "tree"):
                t = torch.tensor([float(me + 1), 2.0, -float(me)])
                C.reduce(t, dst, op, group=group, algorithm=algo)
                vals = torch.tensor([[float(r + 1), 2.0, -float(r)] for r in ranks])
                want = {
                    ReduceOp.SUM: vals.sum(0),
                    ReduceOp.MEAN: vals.mean(0),
                    ReduceOp.MAX: vals.max(0).values,
                    ReduceOp.PRODUCT: vals.prod(0),
                }[op]
                cases += 1
                if me == dst and not torch.allclose(t, want):
                    failures.append(f"{tag} reduce {algo} {op.name} dst={dst}: {t} != {want}")
    # all_gather (list and tensor forms), gather, scatter
    outs = [torch.zeros(2) for _ in ranks]
    C.all_gather(outs, torch.tensor([me, -me], dtype=torch.float32), group=group)
    cat = torch.zeros(2 * n)
    C.all_gather_into_tensor(cat, torch.tensor([me, -me], dtype=torch.float32), group=group)
    want = torch.tensor([[r, -r] for r in ranks], dtype=torch.float32)
    cases += 2
    if not torch.equal(torch.stack(outs), want) or not torch.equal(cat, want.flatten()):
        failures.append(f"{tag} all_gather {outs} {cat}")
    root = ranks[-1]
    lst = [torch.zeros(1) for _ in ranks] if me == root else None
    C.gather(torch.tensor([float(me)]), lst, dst=root, group=group)
    cases += 1
    if me == root and [x.item() for x in lst] != [float(r) for r in ranks]:
        failures.append(f"{tag} gather {lst}")
    got = torch.zeros(3)
    C.scatter(
        got,
        [torch.full((3,), float(i)) for i in range(n)] if me == root else None,
        src=root,
        group=group,
    )
    cases += 1
    if not torch.equal(got, torch.full((3,), float(gi))):
        failures.append(f"{tag} scatter {got}")
    # reduce_scatter (list and tensor) with SUM and emulated MEAN
    for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MIN):
        inp = [torch.full((2,), float(me * 10 + i)) for i in range(n)]
        out = torch.zeros(2)
        C.reduce_scatter(out, inp, op, group=group)
        vals = torch.tensor([float(r * 10 + gi) for r in ranks])
        want_v = {ReduceOp.SUM: vals.sum(), ReduceOp.MEAN: vals.mean(), ReduceOp.MIN: vals.min()}[
            op
        ]
        out2 = torch.zeros(2)
        C.reduce_scatter_tensor(out2, torch.cat(inp), op, group=group)
        cases += 2
        if not (torch.allclose(out, torch.full((2,), float(want_v))) and torch.allclose(out2, out)):
            failures.append(f"{tag} reduce_scatter {op.name}: {out} {out2} want {want_v}")
    # all_to_all (list) and all_to_all_single with uneven splits
    outl = [torch.zeros(1) for _ in ranks]
    C.all_to_all(outl, [torch.tensor([float(me * 100 + i)]) for i in range(n)], group=group)
    cases += 1
    if [x.item() for x in outl] != [float(r * 100 + gi) for r in ranks]:
        failures.append(f"{tag} all_to_all {outl}")
    in_splits = [i + 1 for i in range(n)]  # send i+1 elements to group rank i
    out_splits = [gi + 1] * n
    inp = torch.cat([torch.full((i + 1,), float(me)) for i in range(n)])
    out = torch.zeros(sum(out_splits))
    C.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    cases += 1
    if not torch.equal(out, torch.cat([torch.full((gi + 1,), float(r)) for r in ranks])):
        failures.append(f"{tag} all_to_all_single {out}")
    # async: torch algorithm with emulated MEAN finishes in wait(); ring returns a done handle
    for algo in ("torch", "ring"):
        t = torch.full((5,), float(me))
        work = C.all_reduce(t, ReduceOp.MEAN, group=group, async_op=True, algorithm=algo)
        work.wait()
        cases += 1
        if not torch.allclose(t, torch.full((5,), sum(ranks) / n)):
            failures.append(f"{tag} async {algo} mean {t}")
    C.barrier(group=group)
    # object collectives
    objs = [None] * n
    C.all_gather_object(objs, {"r": me}, group=group)
    box = [{"from": root}] if me == root else [None]
    C.broadcast_object_list(box, root, group=group)
    cases += 2
    if objs != [{"r": r} for r in ranks] or box != [{"from": root}]:
        failures.append(f"{tag} objects {objs} {box}")
    return cases


def _p2p(failures: list[str]) -> int:
    me, n = dist.get_rank(), dist.get_world_size()
    right, left = (me + 1) % n, (me - 1) % n
    got = torch.zeros(3)
    works = C.batch_isend_irecv(
        [C.P2POp(dist.isend, torch.full((3,), float(me)), right), C.P2POp(dist.irecv, got, left)]
    )
    for w in works:
        w.wait()
    if me % 2 == 0:
        C.send(torch.tensor([42.0 + me]), right)
        w = C.irecv(buf := torch.zeros(1), left)
        w.wait()
    else:
        buf = torch.zeros(1)
        C.recv(buf, left)
        C.isend(torch.tensor([42.0 + me]), right).wait()
    if not torch.equal(got, torch.full((3,), float(left))) or buf.item() != 42.0 + left:
        failures.append(f"p2p {got} {buf}")
    return 2


def _matrix(world: int) -> tuple[int, list[str]]:
    nodes = [0, 0, 1, 1] if world == 4 else [0, 1]
    dims = ParallelDims(dp=-1, node_assignment=nodes).build()
    failures: list[str] = []
    algos = ["torch", "ring", "tree", "auto"] + (["hierarchical"] if dims.hierarchical else [])
    cases = _all_reduce_matrix(None, algos, failures, "world")
    cases += _other_ops(None, failures, "world")
    cases += _rooted_matrix(None, failures, "world")
    cases += _p2p(failures)
    # sub-groups: every rank creates them, members use them
    sub = [1, 2, 3] if world == 4 else [1]
    group = dims.subgroup(sub)
    if dist.get_rank() in sub:
        cases += _all_reduce_matrix(group, ["torch", "ring", "tree"], failures, f"sub{sub}")
        cases += _other_ops(group, failures, f"sub{sub}")
        cases += _rooted_matrix(group, failures, f"sub{sub}")
    # big, uneven buffers: several pipelined 64 KiB segments per ring chunk
    for dtype, op in (
        (torch.float32, ReduceOp.SUM),
        (torch.int64, ReduceOp.MAX),
        (torch.float64, ReduceOp.MEAN),
    ):
        base = _data(dist.get_rank(), 200_003, dtype, op)
        ref = _reference(base, op, None)
        for algo in algos:
            out = base.clone()
            C.all_reduce(out, op, algorithm=algo)
            cases += 1
            if not _close(out, ref):
                failures.append(f"big all_reduce {algo} {op.name} {dtype}")
    # bucketed: many small tensors of mixed dtypes in one call
    me = dist.get_rank()
    ts = [torch.full((i + 1,), float(me + i)) for i in range(20)] + [torch.arange(5) * (me + 1)]
    C.all_reduce_coalesced(ts, "sum", algorithm="ring", bucket_bytes=64)
    if not all(
        torch.equal(t, torch.full((i + 1,), float(sum(range(world)) + world * i)))
        for i, t in enumerate(ts[:20])
    ):
        failures.append(f"coalesced {ts[:3]}")
    if not torch.equal(ts[20], torch.arange(5) * sum(range(1, world + 1))):
        failures.append(f"coalesced int {ts[20]}")
    return cases + 2, failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_matrix_matches_torch(world_size):
    results = run_distributed(_matrix, world_size, args=(world_size,), timeout=240)
    for rank, (cases, failures) in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} failures, first: {failures[:5]}"
        assert cases > 300


def _dims_and_profiler(trace: str) -> dict:
    from torsh_distributed.comm import dims as dims_mod

    d = ParallelDims(dp=-1, tp=2).build()
    sub_meshes = []  # the engine asks for the data rank at every step: no sub-mesh built for it
    original = type(d.mesh).__getitem__
    type(d.mesh).__getitem__ = lambda mesh, key: sub_meshes.append(key) or original(mesh, key)
    try:
        data_rank = d.data_rank()
    finally:
        type(d.mesh).__getitem__ = original
    tp = dist.get_process_group_ranks(d.group("tp"))
    dp = dist.get_process_group_ranks(d.group("dp"))
    hosts = d.num_nodes, d.hierarchical  # one host name for all ranks: one node
    h = ParallelDims(dp=-1, node_assignment=[5, 5, 9, 9]).build()
    assert dims_mod.current_dims() is h
    intra = dist.get_process_group_ranks(h.intra_group)
    inter = dist.get_process_group_ranks(h.inter_group)
    model = h.probe()
    profiler.enable()
    t = torch.ones(1 << 16)
    for algo in ("torch", "ring", "hierarchical", "auto"):
        C.all_reduce(t, group=None, algorithm=algo)
    summary = profiler.active().summary()
    profiler.write_merged_trace(trace)
    profiler.disable()
    return {
        "tp": tp,
        "dp": dp,
        "data_rank": (data_rank, sub_meshes),
        "hosts": hosts,
        "intra": intra,
        "inter": inter,
        "nodes": h.node_of_rank,
        "model": model.to_dict(),
        "decisions": len(model.decisions),
        "algos": sorted(r["algorithm"] for r in summary),
    }


def test_parallel_dims_groups_probe_and_merged_trace(tmp_path):
    trace = tmp_path / "trace.json"
    results = run_distributed(_dims_and_profiler, 4, args=(str(trace),), timeout=180)
    r1 = results[1]
    assert r1["tp"] == [0, 1] and r1["dp"] == [1, 3]
    assert [r["data_rank"] for r in results] == [(0, []), (0, []), (1, []), (1, [])]
    assert r1["hosts"] == (1, False)
    assert r1["intra"] == [0, 1] and r1["inter"] == [1, 3]
    assert results[3]["intra"] == [2, 3] and results[3]["inter"] == [1, 3]
    assert r1["nodes"] == (0, 0, 1, 1)
    assert r1["model"]["inter"]["beta"] > 0 and r1["decisions"] >= 1
    assert "hierarchical" in r1["algos"] and "ring" in r1["algos"]
    data = json.loads(trace.read_text())
    rows = {e["pid"] for e in data["traceEvents"] if e.get("ph") == "X"}
    assert rows == {0, 1, 2, 3}
    x = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    assert all(e["args"]["busbw_MBps"] >= 0 and e["dur"] > 0 for e in x)
    # aligned: the same collective starts within a second on every rank
    firsts = [min(e["ts"] for e in x if e["pid"] == p) for p in range(4)]
    assert max(firsts) - min(firsts) < 1e6


def _bench_rows() -> list[dict]:
    from torsh_distributed.cli.bench import run_bench

    return run_bench(
        ops=["all_reduce", "all_gather"],
        sizes=[4096],
        impls=["torch", "torch2", "torsh", "ring"],
        iters=3,
        warmup=1,
        rounds=2,
    )


def test_bench_rows_on_two_ranks():
    """`torsh-dist bench collectives` rows: same on every rank, every field, paired ratios."""
    rows0, rows1 = run_distributed(_bench_rows, 2, timeout=120)
    assert rows0 == rows1, "ranks must agree on the table (times are maxima over ranks)"
    keys = {(r["op"], r["impl"]) for r in rows0}
    expected = {
        (op, i) for op in ("all_reduce", "all_gather") for i in ("torch", "torch2", "torsh")
    }
    assert keys == expected | {("all_reduce", "ring")}  # ring is all-reduce only
    for r in rows0:
        assert r["calls"] == 6 and r["time_us"] > 0 and r["size"] == 4096
        assert r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * (1.0 if r["op"] == "all_reduce" else 0.5), rel=1e-9
        )
        assert r["paired_vs_torch"] > 0
        if r["impl"] == "torch":
            assert r["paired_vs_torch"] == 1.0


def _hot_path_follows_debug_and_profiler() -> dict:
    from torsh_distributed.comm import debug
    from torsh_distributed.comm._hot import HOT

    t, seen = torch.ones(8), {}
    C.all_reduce(t)
    C.broadcast(t, 0)
    seen["hot"] = HOT[0]
    prof = profiler.enable()
    seen["hot_profiling"] = HOT[0]
    C.all_reduce(t)
    C.broadcast(t, 0)
    seen["recorded"] = [e.op for e in prof.events]
    profiler.disable()
    C.all_reduce(t)
    seen["hot_again"] = HOT[0]
    seen["after_disable"] = len(prof.events)
    debug.enable(timeout=30)
    C.all_reduce(t)
    seen["fingerprinted"] = sum(debug._STATE.seq.values())
    debug.disable()
    C.broadcast(t, 0)
    seen["hot_last"] = HOT[0]
    return seen


def test_hot_path_is_left_while_debug_or_profiler_is_on():
    for seen in run_distributed(_hot_path_follows_debug_and_profiler, 2, timeout=60):
        assert seen["hot"] and seen["hot_again"] and seen["hot_last"]
        assert not seen["hot_profiling"]
        assert seen["recorded"] == ["all_reduce", "broadcast"]
        assert seen["after_disable"] == 2
        assert seen["fingerprinted"] == 1


def _peer_never_arrives(done: str) -> str:
    import time
    from datetime import timedelta

    from torsh_distributed.runtime.errors import DistributedTimeoutError

    group = dist.new_group(timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:  # never joins; returns once rank 0 has timed out
        deadline = time.monotonic() + 30
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "skipped"
    try:
        C.all_reduce(torch.ones(4), group=group)  # the direct (plain) path
    except DistributedTimeoutError as exc:
        return str(exc)
    finally:
        Path(done).touch()
    return "no error"


def test_facade_reports_a_torch_timeout_as_distributed_timeout_error(tmp_path):
    message, _ = run_distributed(_peer_never_arrives, 2, args=(str(tmp_path / "done"),), timeout=60)
    assert "all_reduce on" in message and "timed out" in message, message
    assert "TORSH_COMM_DEBUG=1" in message
