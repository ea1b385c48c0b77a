"""Process groups of ``ParallelDims`` live as long as the process group, and a layout built again
reuses them: ``Engine.fit()`` called again and again in one process (on a process group the caller
owns) creates its groups once, and a tensor-parallel run after another one still finds its groups
(destroying and rebuilding them left torch's DTensor caches pointing at destroyed groups)."""

from __future__ import annotations

from typing import Any

from torsh_distributed.testing import run_distributed


def _num_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _build_twice() -> dict[str, Any]:
    from torsh_distributed.comm.dims import ParallelDims, current_dims, group_name

    before = _num_groups()
    # 2 ranks as dp 1 x tp 2: tp spans the world (the default group); pp, dp and ep are one
    # rank each (a group per rank); plus one explicit subgroup
    first = ParallelDims(dp=1, tp=2).build()
    pair = first.subgroup([0, 1], name="pair")
    built = _num_groups()
    assert first.build() is first  # building twice is a no-op
    second = ParallelDims(dp=1, tp=2).build()  # the same layout: the same groups
    same = all(first.group(a) is second.group(a) for a in ("pp", "dp", "ep", "tp"))
    same_pair = second.subgroup([1, 0]) is pair
    reused = _num_groups()
    other = ParallelDims(dp=2, tp=1).build()  # another layout: its own groups
    groups = _num_groups()
    # the harness meets every rank at a barrier before exit: a new group's connections are done
    return {
        "before": before,
        "built": built,
        "reused": reused,
        "other": groups,
        "same": same and same_pair and second.mesh is first.mesh,
        "names": (group_name(second.group("pp")), group_name(pair)),
        "current": current_dims() is other,
    }


def test_a_layout_built_again_reuses_its_groups():
    for rank in run_distributed(_build_twice, 2, timeout=90):
        assert rank["built"] == rank["before"] + 4, rank  # pp, dp, ep singletons + the pair
        assert rank["reused"] == rank["built"], rank
        assert rank["other"] > rank["reused"], rank
        assert rank["same"], rank
        assert rank["names"] == ("pp", "pair")
        assert rank["current"]


def _fit_repeatedly() -> list[int]:
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.testing import models as M

    counts = [_num_groups()]
    for parallel in (ParallelConfig(), ParallelConfig(zero_stage=3), ParallelConfig()):
        config = EngineConfig(progress=False, max_steps=2, batch_size=16, parallel=parallel)
        Engine(M.mlp, dataset=M.classification_data(), config=config).fit()
        counts.append(_num_groups())
    return counts


def test_repeated_fit_in_one_process_creates_its_groups_once():
    for counts in run_distributed(_fit_repeatedly, 2, timeout=180):
        assert counts[1] > counts[0], counts
        assert counts[1:] == [counts[1]] * 3, f"process groups before and after each fit: {counts}"
