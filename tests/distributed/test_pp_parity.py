"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) of the built-in GPT trains like one process.

Two ranks, one spawn for the three schedules: per-step global losses and validation loss of the
trainer equal a one-process run on the same global batch within 1e-4 relative (fp32 CPU), and
one step of :func:`build_pipeline` at split points ``blocks.<i>`` gives the unsplit model's loss
and gradients under every schedule. Invalid set-ups raise their ``ValueError`` on every rank
before any collective. Splits of user models: ``test_pipeline_split.py``.
"""

from __future__ import annotations

import json

import pytest

from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT
from torsh_distributed.parallel.pipeline import (
    check_pipeline,
    check_split_points,
    even_split_points,
    stage_ids,
)
from torsh_distributed.testing import RankFailedError, run_distributed
from torsh_distributed.testing.configs import small_config
from torsh_distributed.train import TrainConfig, train

REL = 1e-4
SCHEDULES = {
    "gpipe": {"pp": 2, "pp_schedule": "gpipe", "microbatches": 2},
    "1f1b": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4},
    "interleaved": {"pp": 2, "pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2},
}


def _config(steps: int = 4) -> dict:
    return small_config(steps).to_dict()


def _run(variants: dict[str, dict]) -> dict[str, tuple[list[float], float]]:
    out = {}
    for name, parallel in variants.items():
        data = json.loads(json.dumps(_config()))
        data["parallel"] = parallel
        result = train(TrainConfig.from_dict(data))
        out[name] = (result.losses, result.val_loss)
    return out


def test_pp2_each_schedule_matches_one_process() -> None:
    ref_losses, ref_val = run_distributed(_run, 1, args=({"one": {}},), timeout=180)[0]["one"]
    assert ref_losses[-1] < ref_losses[0], "the loss did not fall"
    results = run_distributed(_run, 2, args=(SCHEDULES,), timeout=300)
    for name in SCHEDULES:
        assert results[1][name] == results[0][name], f"{name}: ranks disagree"
        losses, val = results[0][name]
        for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
            assert b == pytest.approx(a, rel=REL), f"{name}, step {step + 1}"
        assert val == pytest.approx(ref_val, rel=REL), f"{name}: validation loss"


def _train_invalid(parallel: dict) -> None:
    data = _config(steps=1)
    data["parallel"] = parallel
    train(TrainConfig.from_dict(data))


def test_invalid_pipeline_fails_fast_on_every_rank() -> None:
    # 1F1B with 1 micro-batch for 2 stages: each rank raises before the first collective
    with pytest.raises(
        RankFailedError, match=r"microbatches=1 is fewer than the 2 pipeline stages"
    ) as info:
        run_distributed(_train_invalid, 2, args=({"pp": 2, "microbatches": 1},), timeout=60)
    assert "rank 1" in str(info.value) and "ValueError" in str(info.value)


BASE = {
    "pp": 2,
    "schedule": "1f1b",
    "microbatches": 2,
    "virtual_stages": 1,
    "batch_size": 8,
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"microbatches": 1}, r"1f1b needs microbatches >= pp"),
        ({"schedule": "interleaved", "virtual_stages": 2, "microbatches": 1}, r"interleaved needs"),
        ({"schedule": "interleaved", "virtual_stages": 2, "microbatches": 3}, r"multiple of pp=2"),
        ({"schedule": "interleaved"}, r"virtual_stages >= 2"),
        ({"virtual_stages": 2}, r"needs parallel.pp_schedule=interleaved"),
        ({"batch_size": 6, "microbatches": 4}, r"batch 6 is not divisible"),
        ({"schedule": "zb"}, r"pp_schedule must be one of gpipe, 1f1b, interleaved"),
    ],
)
def test_invalid_pipeline_setups(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_pipeline(**{**BASE, **change})


# (schedule, n_layer, virtual_stages, microbatches, split points): uneven splits included
SPLITS = [
    ("gpipe", 3, 1, 2, ["blocks.1"]),
    ("1f1b", 3, 1, 4, ["blocks.2"]),
    ("interleaved", 4, 2, 2, None),
    ("interleaved", 5, 2, 2, ["blocks.1", "blocks.2", "blocks.4"]),
]


def _split_steps() -> list[tuple[float, float, float, list[str]]]:
    import torch
    import torch.distributed as dist

    from torsh_distributed.models.gpt import lm_loss
    from torsh_distributed.parallel.pipeline import build_pipeline

    out = []
    for schedule, n_layer, virtual, microbatches, points in SPLITS:
        cfg = ModelConfig(block_size=16, n_layer=n_layer, n_head=2, d_model=32)
        torch.manual_seed(0)
        reference = GPT(cfg)
        torch.manual_seed(0)
        model = GPT(cfg)
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 256, (4, 16), generator=gen) for _ in range(2))
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        runner = build_pipeline(
            model,
            split_points=points,
            pp_rank=dist.get_rank(),
            pp=2,
            group=None,
            device=torch.device("cpu"),
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual,
            loss_fn=lm_loss,
        )
        loss = runner.step(x, y)
        ref_grads = dict(reference.named_parameters())
        names = [n for m in runner.modules for n, _ in m.named_parameters()]
        worst = max(
            float((p.grad - ref_grads[n].grad).abs().max())
            for m in runner.modules
            for n, p in m.named_parameters()
        )
        value = float(loss) if loss is not None else float("nan")
        out.append((value, float(ref_loss), worst, names))
    return out


def test_split_points_match_unsplit_model_under_each_schedule() -> None:
    results = run_distributed(_split_steps, 2, timeout=120)
    for i, (schedule, n_layer, *_, points) in enumerate(SPLITS):
        case = f"{schedule}, {n_layer} blocks at {points}"
        loss, ref_loss, _, _ = results[1][i]  # rank 1 holds the last stage
        assert loss == pytest.approx(ref_loss, rel=1e-6), case
        for rank in (0, 1):
            assert results[rank][i][2] < 1e-6, f"{case}: rank {rank} gradients"
        # every parameter of the GPT on exactly one rank, under its unsplit name
        names = results[0][i][3] + results[1][i][3]
        whole = GPT(ModelConfig(block_size=16, n_layer=n_layer, n_head=2, d_model=32))
        assert sorted(names) == sorted(n for n, _ in whole.named_parameters()), case


@pytest.mark.parametrize(
    ("points", "match"),
    [
        (["blocks.1", "blocks.2"], r"name 2 modules; 2 pipeline stages .* need 1"),
        (
            ["blocks.3"],
            r"'blocks.3' names no module of GPT \(entries of 'blocks': blocks.0, blocks.1, blocks.2\)",
        ),
        (["blocks.0"], r"first entry of 'blocks': stage 0 would be empty"),
        (["ln_f"], r"'ln_f' is not an entry of a container"),
    ],
)
def test_invalid_split_points(points: list[str], match: str) -> None:
    model = GPT(ModelConfig(block_size=16, n_layer=3, n_head=2, d_model=32))
    with pytest.raises(ValueError, match=match):
        check_split_points(model, points, num_stages=2)
    # block indices (the old API) are rejected with a pointer to names
    with pytest.raises(TypeError, match=r"module names like 'layers.4'; got 1 \(int\)"):
        check_split_points(model, [1], num_stages=2)


def test_trainer_flags_reach_the_config() -> None:
    import argparse

    from torsh_distributed.cli.train import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = "--tp 2 --pp 2 --dp 1 --pp-schedule interleaved --microbatches 4 --virtual-stages 2"
    par = config_from_args(parser.parse_args(argv.split())).parallel
    assert (par.tp, par.pp, par.dp, par.pp_schedule, par.microbatches, par.virtual_stages) == (
        2,
        2,
        1,
        "interleaved",
        4,
        2,
    )
    default = config_from_args(parser.parse_args([])).parallel
    assert (default.tp, default.pp, default.dp, default.model_parallel) == (1, 1, -1, False)


def test_gpipe_allows_fewer_microbatches_than_stages() -> None:
    check_pipeline(**{**BASE, "schedule": "gpipe", "microbatches": 1})


def test_stage_placement() -> None:
    assert stage_ids(1, pp=2, virtual_stages=2) == [1, 3]
    model = GPT(ModelConfig(block_size=16, n_layer=8, n_head=2, d_model=32))
    assert even_split_points(model, 4) == ["blocks.2", "blocks.4", "blocks.6"]
    split = check_split_points(model, ["blocks.1"], num_stages=2)
    assert split.stages == (("0",), ("1", "2", "3", "4", "5", "6", "7"))
    with pytest.raises(ValueError, match=r"the 8 entries of 'blocks' .* do not split evenly into 3"):
        check_split_points(model, None, num_stages=3)


def test_config_flags_validate() -> None:
    with pytest.raises(ValueError, match=r"parallel.pp_schedule must be one of"):
        TrainConfig.from_dict({"parallel": {"pp_schedule": "zb"}})
    with pytest.raises(ValueError, match=r"parallel.tp must be >= 1"):
        TrainConfig.from_dict({"parallel": {"tp": 0}})
