"""The ``gloo+shm`` backend against Gloo on the same ranks, at 2 and 4 ranks (one launch each).

Each rank runs every op x reduce op x dtype x size on the default ``gloo+shm`` group and on a
plain Gloo group over the same ranks, and returns the list of mismatches. Integers, min and max
must equal Gloo exactly; floats must equal, bit for bit, the documented reduction order (a left
fold over ranks, float32 accumulation for half types) computed here from the gathered inputs,
and agree with Gloo to its own rounding. Slots of 8 KiB make the 20 000-element cases run the
chunked, pipelined path with small tensors: the C kernel's three buffers of ~2.7 KiB, and (with
``TORSH_SHM_NO_CC=1``) the Python fallback's two slots.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.testing import run_distributed

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}
SIZES = [1, 1001, 20000]  # 20000 elements > one 8 KiB slot: chunked and pipelined
ENV = {"TORSH_SHM_SLOT_BYTES": "8192"}


def _data(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + n)
    if op == "product":
        vals = torch.randint(1, 3, (n,), generator=g)
        return vals.to(dtype) if not dtype.is_floating_point else (vals * 0.75).to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 4 - 2).to(dtype)
    return torch.randint(0, 8, (n,), generator=g).to(dtype)


def _documented(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction order of docs/shm.md: left fold over ranks, half types in float32."""
    half = inputs[0].dtype in (torch.float16, torch.bfloat16)
    fn = {"sum": torch.add, "avg": torch.add, "product": torch.mul}.get(op)
    fn = fn or {"min": torch.minimum, "max": torch.maximum}[op]
    acc = inputs[0].float() if half else inputs[0].clone()
    for x in inputs[1:]:
        acc = fn(acc, x)
    if op == "avg":
        acc = acc / len(inputs)
    return acc.to(inputs[0].dtype)


def _gather(x: torch.Tensor, gloo) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(gloo))]
    dist.all_gather(out, x, group=gloo)
    return out


def _check(
    got: torch.Tensor,
    gloo_result: torch.Tensor | None,
    want: torch.Tensor,
    tag: str,
    failures: list[str],
) -> None:
    if not torch.equal(got, want):
        failures.append(f"{tag}: not the documented order: {got[:3]} != {want[:3]}")
    if gloo_result is None:
        return
    if got.dtype.is_floating_point:
        tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2}.get(got.dtype, 1e-6)
        ok = torch.allclose(got.double(), gloo_result.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, gloo_result)
    if not ok:
        failures.append(f"{tag}: differs from Gloo: {got[:3]} != {gloo_result[:3]}")


def _matrix() -> tuple[list[str], int, list[tuple[str, str]], dict[str, int]]:
    assert dist.get_backend() == "gloo+shm"
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    failures: list[str] = []
    cases = 0
    for dtype in DTYPES:
        for name, op in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            for size in SIZES:
                x = _data(rank, size, dtype, name)
                everyone = _gather(x, gloo)
                want = _documented(everyone, name)
                got = x.clone()
                dist.all_reduce(got, op=op)
                ref = None
                if name != "avg":  # Gloo has no AVG
                    ref = x.clone()
                    dist.all_reduce(ref, op=op, group=gloo)
                exact = not dtype.is_floating_point or name in ("min", "max") or n == 2
                _check(got, ref, want, f"all_reduce {name} {dtype} n={size}", failures)
                if exact and ref is not None and not torch.equal(got, ref):
                    failures.append(f"all_reduce {name} {dtype} n={size}: not exactly Gloo's")
                cases += 1
                # reduce-scatter: this rank's part of the same reduction
                if name != "avg" and size > 1:
                    full = _data(rank, size * n, dtype, name)
                    want_rs = _documented(_gather(full, gloo), name).view(n, size)[rank]
                    out = torch.empty(size, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full, op=op)
                    ref_rs = torch.empty(size, dtype=dtype)
                    dist.reduce_scatter_tensor(ref_rs, full, op=op, group=gloo)
                    _check(
                        out, ref_rs, want_rs, f"reduce_scatter {name} {dtype} n={size}", failures
                    )
                    cases += 1
        for size in SIZES:
            x = _data(rank, size, dtype, "sum")
            everyone = _gather(x, gloo)
            out = torch.empty(size * n, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            if not torch.equal(out, torch.cat(everyone)):
                failures.append(f"all_gather {dtype} n={size}")
            listed = [torch.empty(size, dtype=dtype) for _ in range(n)]
            dist.all_gather(listed, x)
            if not torch.equal(torch.cat(listed), out):
                failures.append(f"all_gather (list) {dtype} n={size}")
            for root in range(n):
                b = x.clone()
                dist.broadcast(b, root)
                if not torch.equal(b, everyone[root]):
                    failures.append(f"broadcast root={root} {dtype} n={size}")
            cases += 2 + n
    # list all-gather into strided views of one tensor
    big = torch.zeros(4, 2 * n)
    dist.all_gather([big[:, 2 * j] for j in range(n)], torch.full((4,), float(rank)))
    if not torch.equal(big[:, ::2], torch.arange(n, dtype=torch.float32).expand(4, n)):
        failures.append(f"all_gather into strided outputs {big[0]}")
    # async handles, a barrier, and a sub-group (which gets its own segment)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, async_op=True).wait()
    dist.barrier()
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        s = torch.full((5000,), float(rank + 1))
        dist.all_reduce(s, group=sub)
        if not torch.equal(s, torch.full((5000,), 3.0)):
            failures.append(f"sub-group all_reduce {s[:2]}")
    if not torch.equal(t, torch.full((3,), float(sum(range(n))))):
        failures.append(f"async all_reduce {t}")
    # what goes to Gloo through the Python overrides (torch's trampoline would call it holding
    # the GIL): all-to-all with uneven splits, send/recv around the ring, coalesced all-reduce
    for _ in range(3):
        send_splits = [rank + j + 1 for j in range(n)]
        recv_splits = [j + rank + 1 for j in range(n)]
        src = torch.cat([torch.full((k,), 10.0 * rank + j) for j, k in enumerate(send_splits)])
        got = torch.empty(sum(recv_splits))
        dist.all_to_all_single(got, src, recv_splits, send_splits)
        want = torch.cat([torch.full((k,), 10.0 * j + rank) for j, k in enumerate(recv_splits)])
        if not torch.equal(got, want):
            failures.append(f"all_to_all_single uneven {got[:4]}")
    box = torch.full((3,), float(rank))
    if rank % 2 == 0:
        dist.send(box, (rank + 1) % n)
        dist.recv(box, (rank - 1) % n)
    else:
        incoming = torch.empty(3)
        dist.recv(incoming, (rank - 1) % n)
        dist.send(box, (rank + 1) % n)
        box = incoming
    if not torch.equal(box, torch.full((3,), float((rank - 1) % n))):
        failures.append(f"send/recv ring {box}")
    pair = [torch.ones(2), torch.full((3,), 2.0)]
    dist.all_reduce_coalesced(pair)
    if not (torch.equal(pair[0], torch.full((2,), float(n))) and pair[1][0] == 2.0 * n):
        failures.append(f"all_reduce_coalesced {pair}")
    # `torsh-dist bench collectives --impl shm` rows (a gloo+shm group beside the default one)
    from torsh_distributed.cli.bench import run_bench

    rows = run_bench(
        ops=["all_reduce", "reduce_scatter"],
        sizes=[1 << 16],
        impls=["torch", "shm"],
        iters=2,
        warmup=1,
        rounds=1,
    )
    bench = sorted((r["op"], r["impl"]) for r in rows if r["busbw_GBps"] > 0 and r["calls"] == 2)
    kernel = dict(dist.group.WORLD._transport.kernel_calls)
    return failures, cases, bench, kernel


@pytest.mark.parametrize(
    ("world_size", "kernels"), [(2, "C"), (4, "C"), (2, "python fallback (no compiler)")]
)
def test_every_op_and_dtype_equals_gloo(world_size, kernels):
    env = dict(ENV, TORSH_SHM_NO_CC="1" if kernels.startswith("python") else "0")
    results = run_distributed(_matrix, world_size, backend="gloo+shm", env=env, timeout=180)
    for failures, cases, bench, kernel in results:
        assert cases > 200
        assert failures == []
        ops = ("all_reduce", "reduce_scatter")
        assert bench == sorted((op, impl) for op in ops for impl in ("shm", "torch"))
        if kernels == "C":  # every op went through the C kernel at least once, else none did
            assert set(kernel) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
        else:
            assert kernel == {}


def _hierarchical() -> tuple[int, list[str], dict]:
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for size in (3, 20000):
            x = (torch.arange(size) % 5 + rank).to(dtype)  # small integers: every order exact
            for name in ("sum", "max", "product"):
                got, ref = x.clone(), x.clone()
                dist.all_reduce(got, op=OPS[name])
                dist.all_reduce(ref, op=OPS[name], group=gloo)
                if not torch.equal(got, ref):
                    failures.append(f"all_reduce {name} {dtype} n={size}")
            for root in range(n):
                b = x.clone() * (rank == root)
                ref = b.clone()
                dist.broadcast(b, root)
                dist.broadcast(ref, root, group=gloo)
                if not torch.equal(b, ref):
                    failures.append(f"broadcast root={root} {dtype}")
            out, ref = torch.empty(size * n, dtype=dtype), torch.empty(size * n, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            dist.all_gather_into_tensor(ref, x, group=gloo)
            listed = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(listed, x)
            if not (torch.equal(out, ref) and torch.equal(torch.cat(listed), ref)):
                failures.append(f"all_gather {dtype} n={size}")
            full = (torch.arange(size * n) % 7 + rank).to(dtype)
            part, ref_part = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
            dist.reduce_scatter_tensor(part, full)
            dist.reduce_scatter_tensor(ref_part, full, group=gloo)
            if not torch.equal(part, ref_part):
                failures.append(f"reduce_scatter {dtype} n={size}")
    avg = torch.full((7,), float(rank))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    if not torch.equal(avg, torch.full((7,), (n - 1) / 2)):
        failures.append(f"avg {avg}")
    dist.barrier()
    pg = dist.group.WORLD
    return pg.num_nodes, failures, dict(pg.counts)


@pytest.mark.parametrize("nodes", ["0,1,0,1", "0,0,0,1"])
def test_hierarchical_path_on_simulated_nodes_equals_gloo(nodes):
    """Interleaved nodes (rows of all-gather / reduce-scatter go back to their global ranks) and
    uneven nodes (all-gather and reduce-scatter fall back to Gloo, the rest stays node by node)."""
    env = {**ENV, "TORSH_NODE_ASSIGNMENT": nodes}
    for num_nodes, failures, counts in run_distributed(
        _hierarchical, 4, backend="gloo+shm", env=env, timeout=120
    ):
        assert num_nodes == 2
        assert failures == []
        even = nodes == "0,1,0,1"
        assert counts.get("shm allreduce", 0) > 0 and counts.get("shm broadcast", 0) > 0
        assert (counts.get("shm _allgather_base", 0) > 0) == even
        assert (counts.get("gloo _reduce_scatter_base", 0) > 0) == (not even)


def _few_phases(max_phases: int) -> tuple[list[str], list[int]]:
    """Large chunks (``TORSH_SHM_MAX_PHASES``): exact results and the phase count per call."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    transport = dist.group.WORLD._transport
    failures, phases = [], []
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        x = (torch.arange(60000) % 11 + rank).to(dtype)  # small integers: every order exact
        got, ref = x.clone(), x.clone()
        before = transport._seq
        dist.all_reduce(got)
        phases.append(transport._seq - before)
        dist.all_reduce(ref, group=gloo)
        if not torch.equal(got, ref):
            failures.append(f"all_reduce {dtype}")
        full = (torch.arange(60000 * n) % 7 + rank).to(dtype)
        part, ref_part = torch.empty(60000, dtype=dtype), torch.empty(60000, dtype=dtype)
        dist.reduce_scatter_tensor(part, full)
        dist.reduce_scatter_tensor(ref_part, full, group=gloo)
        out, ref_out = torch.empty(60000 * n, dtype=dtype), torch.empty(60000 * n, dtype=dtype)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather_into_tensor(ref_out, x, group=gloo)
        b = x.clone()
        dist.broadcast(b, n - 1)
        if not (torch.equal(part, ref_part) and torch.equal(out, ref_out)):
            failures.append(f"reduce_scatter / all_gather {dtype}")
        if not torch.equal(b, (torch.arange(60000) % 11 + n - 1).to(dtype)):
            failures.append(f"broadcast {dtype}")
    return failures, phases


@pytest.mark.parametrize("max_phases", [1, 3])
def test_large_chunks_keep_results_and_bound_the_phases(max_phases):
    """A 240 KB float32 all-reduce in ``max_phases`` chunks (one more phase for the all-gather
    half): what keeps a busy host's descheduled peers from stalling every small chunk."""
    env = {"TORSH_SHM_SLOT_BYTES": str(1 << 20), "TORSH_SHM_CHUNK_BYTES": "4096",
           "TORSH_SHM_MAX_PHASES": str(max_phases)}
    for failures, phases in run_distributed(
        _few_phases, 2, args=(max_phases,), backend="gloo+shm", env=env, timeout=120
    ):
        assert failures == []
        assert phases[0] == max_phases + 1  # float32: 240 KB in max_phases chunks
        assert all(p <= max_phases + 1 for p in phases)
