"""Tensor parallelism (and dp x tp, tp x pp) trains the built-in model exactly like one process.

Same seed, same global batch: the per-step global losses and the validation loss of TP=2 (with
vocabulary-parallel embedding and loss-parallel cross-entropy), TP=2 with sequence parallelism,
dp2 x tp2 (gradient all-reduce or FSDP2 over dp, each with and without sequence parallelism),
tp2 x pp2 (with and without sequence parallelism) and dp2 x tp2 x pp2 (FSDP2 over dp) must
equal those of a one-process run within 1e-4 relative (fp32 CPU). One spawn per world size; the
4- and 8-rank runs are marked slow.
"""

from __future__ import annotations

import json

import pytest
import torch

from torsh_distributed.parallel._trainer_mp import check_model_parallel
from torsh_distributed.parallel.config import ParallelConfig
from torsh_distributed.parallel.tensor import check_tp, qkv_permutation
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config
from torsh_distributed.train import TrainConfig, train

REL = 1e-4


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


def _grad_errors(sequence_parallel: bool) -> dict[str, tuple[float, bool]]:
    """One forward/backward of a TP model vs. the unsharded one: per parameter, the relative
    error of the gradient and whether it is laid out like its parameter.

    Catches wrong norm gradients that AdamW's scale invariance hides from a few-step loss test.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torsh_distributed.parallel.tensor import apply_tp, reduce_partial_grads
    from torsh_distributed.models.gpt import GPT

    model_cfg = TrainConfig.from_dict(_config()).model
    model_cfg.n_layer = 2
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = GPT(model_cfg)
    torch.manual_seed(0)
    tp = apply_tp(GPT(model_cfg), mesh, loss_parallel=True, sequence_parallel=sequence_parallel)
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randint(0, model_cfg.vocab_size, (4, model_cfg.block_size), generator=gen)
        for _ in range(2)
    )
    ref(x, y)[1].backward()
    with loss_parallel():
        tp(x, y)[1].backward()
    reduce_partial_grads(list(tp.parameters()))
    expected = dict(ref.named_parameters())
    perm = qkv_permutation(model_cfg.d_model, mesh.size())
    errors = {}
    for name, param in tp.named_parameters():
        grad, want = param.grad, expected[name].grad
        laid_out = not isinstance(param, DTensor) or grad.placements == param.placements
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        want = want[perm] if ".qkv." in name else want
        errors[name] = (float((full - want).abs().max() / want.abs().max()), laid_out)
    return errors


def _run_with_grads(variants: dict[str, dict]) -> tuple[dict, dict]:
    grads = {sp: _grad_errors(sp) for sp in (False, True)}
    return _run(variants), grads


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], float]:
    return run_distributed(_run, 1, args=({"one": {}},), timeout=180)[0]["one"]


def _check(results: list[dict], reference: tuple[list[float], float]) -> None:
    losses, val = reference
    assert losses[-1] < losses[0], "the loss did not fall"
    for name in results[0]:
        for rank_result in results[1:]:
            assert rank_result[name] == results[0][name], f"{name}: ranks disagree"
        got, got_val = results[0][name]
        assert len(got) == len(losses)
        for step, (a, b) in enumerate(zip(losses, got, strict=True)):
            assert b == pytest.approx(a, rel=REL), f"{name}, step {step + 1}"
        assert got_val == pytest.approx(val, rel=REL), f"{name}: validation loss"


def test_tp2_matches_one_process(reference: tuple[list[float], float]) -> None:
    variants = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}
    results = run_distributed(_run_with_grads, 2, args=(variants,), timeout=300)
    _check([losses for losses, _ in results], reference)
    for rank, (_, grads) in enumerate(results):
        for sp, errors in grads.items():
            assert len(errors) == 29  # 2 embeddings, 2 blocks x 12, final norm (2), head
            for name, (error, laid_out) in errors.items():
                assert error < REL, f"rank {rank}, sequence_parallel={sp}: {name} gradient"
                assert laid_out, f"rank {rank}, sequence_parallel={sp}: {name} gradient layout"


@pytest.mark.slow
def test_dp2_tp2_fsdp_and_tp2_pp2_match_one_process(reference: tuple[list[float], float]) -> None:
    variants = {
        "dp2xtp2": {"dp": 2, "tp": 2},
        "dp2xtp2_fsdp": {"dp": 2, "tp": 2, "zero_stage": 3},
        "tp2xpp2": {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
        "dp2xtp2_sp": {"dp": 2, "tp": 2, "sequence_parallel": True},
        "dp2xtp2_fsdp_sp": {"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True},
        "tp2xpp2_sp": {"tp": 2, "pp": 2, "microbatches": 2, "sequence_parallel": True},
    }
    results = run_distributed(_run, 4, args=(variants,), timeout=540)
    _check(results, reference)


@pytest.mark.slow
def test_dp2_tp2_pp2_at_8_ranks_matches_one_process(reference: tuple[list[float], float]) -> None:
    variants = {"dp2xtp2xpp2_fsdp": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero_stage": 3}}
    results = run_distributed(_run, 8, args=(variants,), timeout=480)
    _check(results, reference)


def test_qkv_permutation_groups_heads_per_rank() -> None:
    perm = qkv_permutation(4, 2)  # q = rows 0-3, k = 4-7, v = 8-11
    assert perm.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(perm[perm.argsort()], torch.arange(12))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 4, "n_head": 2, "d_model": 64}, r"tp=4 must divide model.n_head=2"),
        ({"tp": 3, "n_head": 3, "d_model": 63, "vocab_size": 256}, r"vocab_size=256"),
    ],
)
def test_tp_shapes_not_divisible(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tp(**kwargs)


def test_degrees_must_match_world_size() -> None:
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "dp": 2}})
    with pytest.raises(ValueError, match=r"degrees do not match the world size.*!= world size 2"):
        check_model_parallel(cfg, 2)
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"dp": 3}})
    with pytest.raises(ValueError, match=r"degrees do not match the world size"):
        check_model_parallel(cfg, 2)
    assert (
        check_model_parallel(TrainConfig.from_dict({**_config(), "parallel": {"tp": 2}}), 4).dp == 2
    )


def test_tp_rejects_zero1_and_sharding_without_dp() -> None:
    with pytest.raises(ValueError, match=r"not yet with zero_stage 1"):
        TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "zero_stage": 1}})
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "zero_stage": 3}})
    with pytest.raises(ValueError, match=r"shards over the dp axis, but dp = 1"):
        check_model_parallel(cfg, 2)


def test_sequence_parallel_needs_tp() -> None:
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel needs parallel.tp > 1.*tp=1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel needs parallel.tp > 1"):
        check_tp(tp=1, n_head=2, d_model=32, sequence_parallel=True)
    assert ParallelConfig(tp=2, sequence_parallel=True).sequence_parallel


def test_sequence_parallel_needs_block_size_divisible_by_tp() -> None:
    data = _config()
    data["model"]["block_size"] = 31
    data["parallel"] = {"tp": 2, "sequence_parallel": True}
    cfg = TrainConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"tp=2 to divide model.block_size=31"):
        check_model_parallel(cfg, 2)
    data["parallel"]["sequence_parallel"] = False  # plain TP does not shard the sequence
    assert check_model_parallel(TrainConfig.from_dict(data), 2).tp == 2


def test_sequence_parallel_flags() -> None:
    import argparse

    from torsh_distributed.cli.train import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    on = config_from_args(parser.parse_args(["--tp", "2", "--sequence-parallel"])).parallel
    assert (on.tp, on.sequence_parallel) == (2, True)
    off = parser.parse_args(["--tp", "2", "--no-sequence-parallel"])
    assert config_from_args(off).parallel.sequence_parallel is False
    with pytest.raises(ValueError, match=r"sequence_parallel needs parallel.tp > 1"):
        config_from_args(parser.parse_args(["--parallel.sequence-parallel"]))
