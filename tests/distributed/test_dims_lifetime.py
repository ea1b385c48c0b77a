"""Process groups of ``ParallelDims`` live as long as the run: ``destroy()`` removes every group
``build()`` and ``subgroup()`` created, and ``Engine.fit()`` called again and again in one process
(on a process group the caller owns) ends with as many groups as it started with."""

from __future__ import annotations

from typing import Any

from torsh_distributed.testing import run_distributed


def _num_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _build_and_destroy() -> dict[str, Any]:
    import pytest

    from torsh_distributed.comm.dims import ParallelDims, current_dims, group_name

    before = _num_groups()
    # 2 ranks as dp 1 x tp 2: tp spans the world (the default group, not ours); pp, dp and ep
    # are one rank each (a group per rank); plus one explicit subgroup
    dims = ParallelDims(dp=1, tp=2).build()
    pair = dims.subgroup([0, 1], name="pair")
    built = _num_groups()
    names = group_name(dims.group("pp")), group_name(pair)
    with pytest.raises(ValueError, match=r"already called; call destroy\(\) first"):
        dims.build()
    dims.destroy()
    after = _num_groups()
    with pytest.raises(ValueError, match=r"call build\(\) before asking for groups"):
        dims.group("tp")
    again = dims.build()  # a destroyed dims builds again
    rebuilt = _num_groups()
    again.destroy()
    again.destroy()  # idempotent
    return {
        "before": before,
        "built": built,
        "after": after,
        "rebuilt": rebuilt,
        "final": _num_groups(),
        "names": names,
        "current": current_dims() is None,
    }


def test_destroy_removes_the_groups_build_and_subgroup_created():
    for rank in run_distributed(_build_and_destroy, 2, timeout=90):
        assert rank["built"] == rank["before"] + 4, rank  # pp, dp, ep singletons + the pair
        assert rank["after"] == rank["before"], rank
        assert rank["rebuilt"] == rank["before"] + 3, rank  # the mesh again, no pair
        assert rank["final"] == rank["before"], rank
        assert rank["names"] == ("pp", "pair")
        assert rank["current"]


def _fit_three_times() -> list[int]:
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


def test_repeated_fit_in_one_process_leaves_no_groups_behind():
    for counts in run_distributed(_fit_three_times, 2, timeout=180):
        assert counts == [counts[0]] * 4, f"process groups before and after each fit: {counts}"
