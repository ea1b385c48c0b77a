"""Single-process tests of the communication layer: reduce ops, ParallelDims validation, cost
model decisions, profiler maths, bucketing, bench CLI parsing and the trainer's comm section."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.cli.bench import format_table, parse_size
from torsh_distributed.cli.main import build_parser
from torsh_distributed.comm import CostModel, LinkCost, ParallelDims, ReduceOp
from torsh_distributed.comm.algorithms import buckets
from torsh_distributed.comm.config import CommConfig
from torsh_distributed.comm.degrees import WorldSizeMismatch
from torsh_distributed.comm.profiler import Event, Profiler, busbw_factor
from torsh_distributed.comm.reduce_op import check_dtype, combine_, finish_mean_


def test_reduce_op_parse_and_torch_mapping():
    assert ReduceOp.parse("avg") is ReduceOp.MEAN and ReduceOp.parse("prod") is ReduceOp.PRODUCT
    assert ReduceOp.parse(dist.ReduceOp.MAX) is ReduceOp.MAX
    assert ReduceOp.MEAN.to_torch(native_avg=False) == dist.ReduceOp.SUM
    assert ReduceOp.MEAN.to_torch(native_avg=True) == dist.ReduceOp.AVG
    with pytest.raises(ValueError, match="unknown reduce op 'median'; choose one of sum, mean"):
        ReduceOp.parse("median")


def test_reduce_op_dtype_rules():
    with pytest.raises(TypeError, match="MEAN needs a floating-point tensor, got torch.int64"):
        check_dtype(ReduceOp.MEAN, torch.int64)
    with pytest.raises(TypeError, match="BXOR needs an integral or bool tensor"):
        check_dtype(ReduceOp.BXOR, torch.float32)
    check_dtype(ReduceOp.BAND, torch.int8)


@pytest.mark.parametrize(
    ("op", "want"),
    [
        (ReduceOp.SUM, [5, 1]),
        (ReduceOp.PRODUCT, [6, 0]),
        (ReduceOp.MIN, [2, 0]),
        (ReduceOp.MAX, [3, 1]),
        (ReduceOp.BAND, [2, 0]),
        (ReduceOp.BOR, [3, 1]),
        (ReduceOp.BXOR, [1, 1]),
    ],
)
def test_combine_matches_definition(op, want):
    acc = torch.tensor([2, 1])
    combine_(acc, torch.tensor([3, 0]), op)
    assert acc.tolist() == want


def test_mean_is_sum_then_divide():
    t = torch.tensor([4.0, 6.0])
    combine_(t, torch.tensor([2.0, 2.0]), ReduceOp.MEAN)
    assert finish_mean_(t, ReduceOp.MEAN, 2).tolist() == [3.0, 4.0]


def test_parallel_dims_validation():
    d = ParallelDims(dp=-1, tp=2, pp=2, world_size=8)
    assert d.degrees == {"pp": 2, "dp": 2, "ep": 1, "tp": 2}
    with pytest.raises(
        ValueError, match=r"dp \* tp \* pp \* ep = pp=2 \* dp=2 \* ep=1 \* tp=1 = 4 != world size 8"
    ):
        ParallelDims(dp=2, pp=2, world_size=8)
    with pytest.raises(ValueError, match="only one degree may be -1, got dp, tp") as bad:
        ParallelDims(dp=-1, tp=-1, world_size=8)
    assert not isinstance(bad.value, WorldSizeMismatch)  # wrong degrees, whatever the world
    with pytest.raises(WorldSizeMismatch, match="world size 6 is not divisible by the fixed degrees"):
        ParallelDims(dp=-1, tp=4, world_size=6)
    with pytest.raises(ValueError, match="tp must be a positive int or -1"):
        ParallelDims(tp=0, world_size=2)
    with pytest.raises(
        ValueError, match=r"node_assignment must give one node id per rank \(4\), got 3"
    ):
        ParallelDims(world_size=4, node_assignment=[0, 0, 1])
    assert ParallelDims(world_size=4, node_assignment=[7, 7, 3, 3]).node_assignment == (0, 0, 1, 1)
    with pytest.raises(
        ValueError, match="world_size must be given when no process group is running"
    ):
        ParallelDims()


def _link_model() -> CostModel:
    return CostModel(
        intra=LinkCost(alpha=50e-6, beta=1 / 2e9), inter=LinkCost(alpha=200e-6, beta=1 / 12.5e6)
    )


def test_cost_model_predicts_hierarchical_speedup_and_auto_picks_it():
    m = _link_model()
    size = 16 << 20
    ring = m.estimate("ring", size, ranks=4, nodes=2)
    hier = m.estimate("hierarchical", size, ranks=4, nodes=2)
    assert 1.4 < ring / hier < 1.5  # theory 1.5x, minus the intra-node phases
    assert m.choose("all_reduce", size, ranks=4, nodes=2) == "hierarchical"
    d = m.decisions[-1]
    assert d.chosen == "hierarchical" and set(d.estimates) == {
        "torch",
        "ring",
        "tree",
        "hierarchical",
    }


def test_cost_model_small_messages_on_many_ranks_prefer_tree_and_one_node_no_hierarchy():
    m = _link_model()
    assert m.choose("all_reduce", 8, ranks=64, nodes=1) == "tree"
    assert m.choose("all_reduce", 64 << 20, ranks=4, nodes=1) == "torch"
    assert "hierarchical" not in m.decisions[-1].estimates
    with pytest.raises(ValueError, match="no cost model for algorithm 'magic'"):
        m.estimate("magic", 1, ranks=2, nodes=1)


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == 0.75 and busbw_factor("reduce_scatter", 8) == 7 / 8
    assert busbw_factor("broadcast", 4) == 1.0


def test_profiler_summary_and_chrome_events():
    p = Profiler()
    p.events += [Event("all_reduce", 1_000_000, "world", 4, "ring", 10.0, 1000.0)] * 2
    (row,) = p.summary()
    assert row["calls"] == 2 and row["algbw_MBps"] == pytest.approx(1000.0)
    assert row["busbw_MBps"] == pytest.approx(1500.0)
    ev = p.chrome_events(3, offset_us=5.0)
    x = [e for e in ev if e["ph"] == "X"]
    assert x[0]["pid"] == 3 and x[0]["ts"] == 5.0 and x[0]["tid"] == "world"
    assert "all_reduce" in p.format_summary()
    json.dumps(ev)


def test_buckets_group_by_dtype_and_cap():
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.zeros(100)]
    assert buckets(ts, 32) == [[0, 1], [3], [2]]
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        buckets(ts, 0)


def test_bench_sizes_table_and_cli():
    assert parse_size("1K") == 1024 and parse_size("16M") == 16 << 20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="size must look like 1K"):
        parse_size("lots")
    rows = [
        {
            "op": "all_reduce",
            "impl": i,
            "algorithm": i,
            "size": 1024,
            "count": 256,
            "dtype": "float32",
            "time_us": t,
            "algbw_GBps": 1.0 / t,
            "busbw_GBps": 1.0 / t,
        }
        for i, t in (("torch", 1.0), ("torsh", 2.0))
    ]
    assert "| 0.500 |" in format_table(rows)
    args = build_parser().parse_args(
        ["bench", "collectives", "--nproc", "4", "--impl", "torch,auto", "--json", "x.json"]
    )
    assert args.nproc == 4 and args.impl == "torch,auto" and args.json == "x.json"


def test_comm_config_validation():
    assert CommConfig().algorithm == ""  # default: DDP's own all-reduce
    with pytest.raises(ValueError, match="comm.algorithm must be empty or one of torch, ring"):
        CommConfig(algorithm="fast")
    with pytest.raises(ValueError, match="comm.node_assignment must be comma-separated ints"):
        CommConfig(node_assignment="a,b")
    with pytest.raises(ValueError, match="comm.debug_timeout must be > 0"):
        CommConfig(debug_timeout=0)
