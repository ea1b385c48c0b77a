"""fp16 mixed precision with dynamic loss scaling, on Gloo/CPU at 2 ranks.

* fp16 training (FSDP2 MixedPrecisionPolicy at stage 3, fp16 reduce-scatter at stage 2,
  autocast under DDP and ZeRO-1) tracks fp32 DDP within a loose tolerance, with no skipped step
  at the default scale;
* a forced overflow (initial scale 2**17: the fp16 loss's gradient is inf) skips the first steps
  on every rank, backs the scale off to 2**15, and is reported in the summary;
* an overflow that only one rank's gradient shard sees still skips the step on both ranks (the
  inf flag is reduced across ranks): neither rank's optimizer steps, and the next clean step
  steps both. (In torch 2.13 DTensor's own unscale handler already agrees across the mesh, so
  this guards the property, whichever of it and ShardedGradScaler's all-reduce provides it.)
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

VARIANTS: dict[str, dict] = {
    "ddp": {},
    "ddp_fp16": {"param_dtype": "fp16"},  # autocast + DDP
    "zero1_fp16": {"zero_stage": 1, "param_dtype": "fp16"},  # autocast + ZeroRedundancyOptimizer
    "zero3_fp16": {"zero_stage": 3, "param_dtype": "fp16"},
    "zero2_fp16_reduce": {"zero_stage": 2, "param_dtype": "fp16", "reduce_dtype": "fp16"},
    "zero3_overflow": {"zero_stage": 3, "param_dtype": "fp16", "loss_scale_init": 2.0**17},
}


def _config() -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 6
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    return cfg.to_dict()


def _run(config: dict) -> dict:
    out = {}
    for name, parallel in VARIANTS.items():
        data = json.loads(json.dumps(config))
        data["parallel"] = parallel
        result = train(TrainConfig.from_dict(data))
        out[name] = {"losses": result.losses, "precision": result.precision}
    return out


@pytest.mark.slow  # about 9 s alone, 20-35 s on a busy machine
def test_fp16_tracks_fp32_and_overflow_skips_on_every_rank():
    results = run_distributed(_run, 2, args=(_config(),), timeout=300)
    ddp = results[0]["ddp"]["losses"]
    assert results[0]["ddp"]["precision"] == {}
    for name in VARIANTS:
        assert results[0][name] == results[1][name], f"{name}: ranks disagree"
    for name in ("ddp_fp16", "zero1_fp16", "zero3_fp16", "zero2_fp16_reduce"):
        precision = results[0][name]["precision"]
        assert precision["loss_scaling"] is True
        assert precision["skipped_steps"] == 0, name
        assert precision["loss_scale"] == 2.0**15, name
        losses = results[0][name]["losses"]
        assert losses != ddp, f"{name}: fp16 had no effect"
        assert losses[-1] < losses[0], f"{name}: the loss did not fall"
        for step, (a, b) in enumerate(zip(ddp, losses, strict=True)):
            assert b == pytest.approx(a, rel=2e-2), f"{name}, step {step + 1}"
    assert results[0]["ddp_fp16"]["precision"]["compute"] == "autocast"
    assert results[0]["zero3_fp16"]["precision"]["compute"] == "fsdp2"

    overflow = results[0]["zero3_overflow"]
    # 2**17 and 2**16 exceed fp16's max (65504): steps 1 and 2 skipped, the scale halved twice
    assert overflow["precision"]["skipped_steps"] == 2
    assert overflow["precision"]["skipped_at"] == [1, 2]
    assert overflow["precision"]["loss_scale"] == 2.0**15
    clean = results[0]["zero3_fp16"]["losses"]
    assert overflow["losses"][0] == clean[0]  # same weights, same batch
    assert overflow["losses"][1] != clean[1]  # the skipped step left the initial weights


def _one_rank_overflows() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.parallel.precision import LossScaler

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16, bias=False)  # weight rows 0-7 on rank 0, rows 8-15 on rank 1
    fully_shard(
        layer,
        mesh=ParallelDims(dp=-1).build().mesh["dp"],
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    )
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = LossScaler(enabled=True, device="cpu", init_scale=2.0**40)  # a user's own loop
    x = torch.randn(4, 8)

    def step() -> tuple[bool, bool]:
        optimizer.zero_grad()
        # only output units 8-15 enter the loss: only rank 1's rows get a gradient
        scaler.backward(layer(x)[:, 8:].float().sum())
        local = layer.weight.grad.to_local()
        local_inf = not torch.isfinite(local).all().item()
        scaler.unscale(optimizer)
        return scaler.step(optimizer), local_inf

    before = layer.weight.to_local().clone()
    stepped, local_inf = step()  # 2**40 overflows fp16 on rank 1's rows only
    record = {
        "stepped": stepped,
        "local_inf": local_inf,
        "unchanged": torch.equal(before, layer.weight.to_local()),
        "optimizer_state": len(optimizer.state),
        "scale": scaler.scale,
    }
    scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0})
    record["next_stepped"], _ = step()
    record["changed_after"] = not torch.equal(before, layer.weight.to_local())
    record["skipped"] = scaler.skipped_steps
    record["rank"] = dist.get_rank()
    return record


def test_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_one_rank_overflows, 2, timeout=120)
    by_rank = {r["rank"]: r for r in results}
    # the overflow is local to rank 1's shard: rank 0's own gradients are finite
    assert by_rank[0]["local_inf"] is False
    assert by_rank[1]["local_inf"] is True
    for record in results:
        assert record["stepped"] is False
        assert record["unchanged"] is True
        assert record["optimizer_state"] == 0  # AdamW never stepped (its state is lazy)
        assert record["scale"] == 2.0**39
        assert record["next_stepped"] is True
        assert record["changed_after"] is True  # weight decay moves even zero-gradient rows
        assert record["skipped"] == 1
