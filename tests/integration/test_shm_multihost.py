"""The hierarchical ``gloo+shm`` path on 2 network-namespace hosts x 2 ranks (benchmarks/netlab).

No ``TORSH_NODE_ASSIGNMENT``: the backend must see by itself that the namespaces are two nodes
(their network namespaces differ) and take shm inside each, Gloo between the two leaders. Every
op and dtype is compared with a plain Gloo group over the same 4 ranks: integers, min and max
exactly; floats against the documented hierarchical order (fold inside each node, then Gloo's
sum of the node results between leaders) within one unit in the last place; all-gather and
reduce-scatter (also node by node: the nodes have as many ranks) exactly.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

from torsh_distributed.testing import find_free_port  # noqa: E402

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}")

_RANK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    import torsh_distributed as tdist

    out = sys.argv[1]
    tdist.init(backend="gloo+shm", timeout=60)
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    pg = dist.group.WORLD
    failures = []
    nodes = [[0, 1], [2, 3]]

    def gather(x):
        xs = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(xs, x, group=gloo)
        return xs

    def fold(xs, fn):
        half = xs[0].dtype in (torch.float16, torch.bfloat16)
        acc = xs[0].float() if half else xs[0].clone()
        for x in xs[1:]:
            acc = fn(acc, x)
        return acc.to(xs[0].dtype)

    ops = {"sum": (dist.ReduceOp.SUM, torch.add), "max": (dist.ReduceOp.MAX, torch.maximum),
           "min": (dist.ReduceOp.MIN, torch.minimum), "product": (dist.ReduceOp.PRODUCT, torch.mul)}
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8):
        for name, (op, fn) in ops.items():
            for size in (3, 100_000):
                g = torch.Generator().manual_seed(rank * 31 + size)
                if name == "product":
                    x = torch.randint(1, 3, (size,), generator=g).to(dtype)
                elif dtype.is_floating_point:
                    x = (torch.rand(size, generator=g) * 4 - 2).to(dtype)
                else:
                    x = torch.randint(0, 8, (size,), generator=g).to(dtype)
                xs = gather(x)
                got, ref = x.clone(), x.clone()
                dist.all_reduce(got, op=op)
                dist.all_reduce(ref, op=op, group=gloo)
                per_node = [fold([xs[r] for r in node], fn) for node in nodes]
                want = fn(per_node[0], per_node[1]).to(dtype)  # two leaders: one Gloo step
                tag = f"all_reduce {name} {dtype} n={size}"
                if not dtype.is_floating_point or name in ("min", "max"):
                    if not torch.equal(got, ref):
                        failures.append(tag + " != gloo")
                else:
                    ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(1e-3)
                    if ((got.double() - want.double()).abs() > ulp).any():
                        failures.append(tag + " > 1 ulp from the documented order")
        for root in (0, 3):
            b = gather(torch.full((1000,), float(rank)).to(dtype))[root]
            t = torch.full((1000,), float(rank)).to(dtype)
            dist.broadcast(t, root)
            if not torch.equal(t, b):
                failures.append(f"broadcast root={root} {dtype}")
        x = torch.full((5,), rank).to(dtype)
        o = torch.empty(5 * n, dtype=dtype)
        dist.all_gather_into_tensor(o, x)
        if not torch.equal(o, torch.cat(gather(x))):
            failures.append(f"all_gather {dtype}")
        listed = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(listed, x)
        if not torch.equal(torch.cat(listed), o):
            failures.append(f"all_gather (list) {dtype}")
        full = torch.arange(4 * n).to(dtype) + rank
        part, ref_part = torch.empty(4, dtype=dtype), torch.empty(4, dtype=dtype)
        dist.reduce_scatter_tensor(part, full)
        dist.reduce_scatter_tensor(ref_part, full, group=gloo)
        if not torch.equal(part, ref_part):
            failures.append(f"reduce_scatter {dtype}")
    dist.barrier()
    avg = torch.full((10,), float(rank))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    if not torch.equal(avg, torch.full((10,), 1.5)):
        failures.append(f"avg {avg[:2]}")
    result = {"nodes": pg.num_nodes, "counts": dict(pg.counts), "failures": failures}
    json.dump(result, open(out, "w"))
    dist.barrier(group=gloo)
    tdist.shutdown()
    """
)


def test_hierarchical_gloo_shm_on_two_namespace_hosts_equals_gloo(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = find_free_port()
    with NetLab(hosts=2, rate_mbit=0, net=29) as lab:
        procs = []
        for rank in range(4):
            env = lab.rank_env(rank=rank, world_size=4, ranks_per_host=2, master_port=port)
            env.pop("TORSH_NODE_ASSIGNMENT")  # the backend must find the two hosts itself
            env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
            env["PYTHONPATH"] = os.pathsep.join(sys.path)
            out = tmp_path / f"rank{rank}.json"
            procs.append(
                (lab.popen(rank // 2, [sys.executable, str(script), str(out)], env=env), out)
            )
        for proc, _ in procs:
            assert proc.wait(timeout=240) == 0
    for _, out in procs:
        result = json.loads(out.read_text())
        assert result["nodes"] == 2
        assert result["failures"] == []
        for path in (
            "allreduce",
            "broadcast",
            "_allgather_base",
            "allgather",
            "_reduce_scatter_base",
        ):
            assert result["counts"].get(f"shm {path}", 0) > 0, (path, result["counts"])
