"""ZeRO-2/3 with int8 block-quantised FSDP2 collectives (ZeRO++'s qwZ/qgZ) on 2 ranks: each
collective within its per-block error bound, training within the documented bound of uncompressed
ZeRO with >= 1.9x fewer bytes counted. One process launch for all of it (CI budget)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.parallel._quantized_zero import (
    QuantizedAllGather,
    QuantizedReduceScatter,
    QuantStats,
)
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import preset, train

STEPS = 30
# Validation-loss gap of int8 collectives vs uncompressed ZeRO (tiny preset, seed 1234): +0.01 %
# at 30 steps, +0.08 % at 40, +0.24 % at 200 (docs/compression.md); the bar is 3 %.
BOUND = 0.03


def _collectives() -> dict[str, float]:
    """Max error of one quantised all-gather / reduce-scatter, in units of its bound."""
    rank, w = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    n, block = 1000, 256
    shard = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    stats = QuantStats()
    out = torch.empty(w * n)
    QuantizedAllGather(stats, block=block)(out, shard, group)
    exact = torch.empty(w * n)
    dist.all_gather_into_tensor(exact, shard)
    # half a step of each block's own scale
    pad = (-n) % block
    amax = torch.nn.functional.pad(exact.view(w, n), (0, pad)).view(w, -1, block).abs().amax(2)
    step = (amax / 127).repeat_interleave(block, dim=1)[:, :n].reshape(-1)
    gather_err = float(((out - exact).abs() / (step / 2 + 1e-12)).max())
    grads = torch.randn(w * n, generator=g) * torch.logspace(-3, 1, w * n)
    reduced = torch.empty(n)
    QuantizedReduceScatter(stats, block=block)(reduced, grads.clone(), group, dist.ReduceOp.AVG)
    exact_rs = torch.empty(n)
    dist.reduce_scatter_tensor(exact_rs, grads.clone(), op=dist.ReduceOp.AVG)
    # each rank's contribution is off by at most half its block's step: the mean by the mean
    mine = torch.nn.functional.pad(grads.view(w, n), (0, pad)).view(w, -1, block).abs().amax(2)
    my_step = (mine / 127).repeat_interleave(block, dim=1)[:, :n]  # row r: my chunk for rank r
    bound = my_step[rank] / 2
    dist.all_reduce(bound)  # sum over ranks of their bound for my chunk ...
    bound /= w  # ... of the mean
    rs_err = float(((reduced - exact_rs).abs() / (bound + 1e-12)).max())
    return {
        "gather": gather_err,
        "scatter": rs_err,
        "gather_rel": float((out - exact).norm() / exact.norm()),
        "ratio": stats.ratio,
    }


def _train(runs: dict[str, tuple[int, str]]) -> dict[str, object]:
    out: dict[str, object] = {"collectives": _collectives()}
    for name, (stage, method) in runs.items():
        cfg = preset("tiny")
        cfg.max_steps, cfg.batch_size, cfg.progress, cfg.eval_batches = STEPS, 8, False, 8
        cfg.parallel.zero_stage = stage
        cfg.compression.method = method
        result = train(cfg)
        out[name] = {"loss": result.val_loss, "compression": result.compression}
    return out


@pytest.mark.slow
def test_int8_zero_collectives_train_within_bound_with_fewer_bytes():
    runs = {"zero2": (2, "none"), "zero2-int8": (2, "int8"), "zero3-int8": (3, "int8")}
    r = run_distributed(_train, 2, args=(runs,), timeout=300)[0]
    c = r["collectives"]
    assert c["gather"] <= 1.0 + 1e-4 and c["scatter"] <= 1.0 + 1e-4, c
    assert 0 < c["gather_rel"] < 0.02, c  # quantised, and not by much (0.0096 measured)
    base = r["zero2"]["loss"]
    for name in ("zero2-int8", "zero3-int8"):
        gap = (r[name]["loss"] - base) / base
        assert gap <= BOUND, (name, f"{gap:+.2%}", base, r[name]["loss"])
        comp = r[name]["compression"]
        assert comp["method"] == "int8" and comp["ratio"] >= 1.9, comp
        assert comp["bytes_uncompressed"] >= 1.9 * comp["bytes_sent"] > 0
        assert comp["all_gathers"] > 0 and comp["reduce_scatters"] > 0
    # ZeRO-3 re-gathers parameters in backward: more all-gathers, same reduce-scatters
    z2, z3 = r["zero2-int8"]["compression"], r["zero3-int8"]["compression"]
    assert z3["all_gathers"] > z2["all_gathers"] and z3["reduce_scatters"] == z2["reduce_scatters"]
    # the uncompressed run is really uncompressed (and int8 really changed the computation)
    assert r["zero2"]["compression"]["method"] == "none"
    assert r["zero2-int8"]["loss"] != base
