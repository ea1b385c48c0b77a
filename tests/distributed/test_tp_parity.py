"""Tensor parallelism of the built-in GPT, applied by its plan, trains exactly like one process.

The plan (:func:`~torsh_distributed.models.gpt_tp.gpt_tp_plan`) is proven directly first: same
seed, same batches, a 2-rank TP model (with loss-parallel cross-entropy, with sequence
parallelism, and with gathered logits) and the unsharded model give the same losses over five
AdamW steps and the same gradients, within 1e-4 relative (fp32 CPU); the same plan applied
non-strictly to two pipeline stages (pruned copies of the GPT) gives the unsharded gradients too.

The engine is proven end to end: the per-step global losses and the validation loss of TP=2,
TP=2 with sequence parallelism, dp2 x tp2 (gradient all-reduce or FSDP2 over dp, each with and
without sequence parallelism), tp2 x pp2 (with and without sequence parallelism) and
dp2 x tp2 x pp2 (FSDP2 over dp) must equal those of a one-process run within 1e-4 relative. One
spawn per world size; the 4- and 8-rank runs are marked slow.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT
from torsh_distributed.models.gpt_tp import check_gpt_tp, gpt_tp_plan, permute_qkv
from torsh_distributed.parallel.blocks import block_entries
from torsh_distributed.parallel.tensor import qkv_permutation
from torsh_distributed.parallel.tp_plan import resolve_tp_plan
from torsh_distributed.testing import run_distributed

if TYPE_CHECKING:
    from torsh_distributed.engine._setup import RunPlan

REL = 1e-4
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16, "vocab_size": 256}
# name: (sequence_parallel, loss_parallel)
PLANS = {"tp2": (False, True), "tp2_sp": (True, True), "tp2_gathered": (False, False)}


# --- the plan, without the engine ----------------------------------------------------------------


def _batch(gen: torch.Generator, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and a learnable target (a fixed map of each token), so the loss falls."""
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
    return x, (7 * x + 3) % cfg.vocab_size


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model``'s logits (DTensor logits under ``loss_parallel``)."""
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits  # forward may return (logits, _)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def _grad_errors(tp_model: nn.Module, ref: nn.Module, tp: int) -> dict[str, tuple[float, bool]]:
    """Per parameter: the relative error of the TP gradient against the unsharded one, and
    whether it is laid out like its parameter (catches wrong norm gradients that AdamW's scale
    invariance hides from a few-step loss test)."""
    from torch.distributed.tensor import DTensor

    expected = dict(ref.named_parameters())
    perm = qkv_permutation(ref.config.d_model, tp)
    errors = {}
    for name, param in tp_model.named_parameters():
        grad, want = param.grad, expected[name].grad
        laid_out = not isinstance(param, DTensor) or grad.placements == param.placements
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        want = want[perm] if ".qkv." in name else want
        errors[name] = (float((full - want).abs().max() / want.abs().max()), laid_out)
    return errors


def _plan_vs_one_process(steps: int) -> dict[str, dict]:
    """Each plan variant against the unsharded GPT on the same batches (AdamW)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torsh_distributed.parallel.tensor import reduce_partial_grads
    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    cfg = ModelConfig(**MODEL)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name, (sp, lp) in PLANS.items():
        torch.manual_seed(0)
        ref = GPT(cfg)
        torch.manual_seed(0)
        tp = apply_tp_plan(GPT(cfg), mesh, gpt_tp_plan(sequence_parallel=sp, loss_parallel=lp))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ref, tp)]
        gen = torch.Generator().manual_seed(1)
        losses: dict[str, list[float]] = {"ref": [], "tp": []}
        grads = {}
        for step in range(steps):
            x, y = _batch(gen, cfg)
            for opt in opts:
                opt.zero_grad()
            loss = _loss(ref, x, y)
            loss.backward()
            losses["ref"].append(float(loss.detach()))
            with loss_parallel() if lp else contextlib.nullcontext():
                loss = _loss(tp, x, y)
                loss.backward()
            reduce_partial_grads(list(tp.parameters()))
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            losses["tp"].append(float(loss.detach()))
            if step == 0:
                grads = _grad_errors(tp, ref, mesh.size())
            for opt in opts:
                opt.step()
        dtensors = sorted(n for n, p in tp.named_parameters() if isinstance(p, DTensor))
        out[name] = {"losses": losses, "grads": grads, "dtensors": dtensors}
    return out


def _prune(model: GPT, keep: range, *, first: bool, last: bool) -> GPT:
    """A pipeline stage as a pruned deep copy: the unsplit model's names, other parts ``None``."""
    stage = copy.deepcopy(model)
    for i in range(len(stage.blocks)):
        if i not in keep:
            stage.blocks[i] = None
    if not first:
        stage.tok_emb = stage.pos_emb = stage.drop = None
    if not last:
        stage.ln_f = stage.head = None
    return stage


def _stage_forward(stage: GPT, x: torch.Tensor) -> torch.Tensor:
    if stage.tok_emb is not None:
        x = stage.drop(stage.tok_emb(x) + stage.pos_emb(torch.arange(x.shape[1])))
    for _, block in block_entries(stage.blocks):
        x = block(x)
    return x if stage.head is None else stage.head(stage.ln_f(x))


def _stages_vs_one_process() -> dict[bool, dict]:
    """The plan applied with strict=False to two stages; one forward/backward through both."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torsh_distributed.parallel.tensor import reduce_partial_grads
    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    cfg = ModelConfig(**MODEL)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(1)
    x, y = _batch(gen, cfg)
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        ref = GPT(cfg)
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        plan = gpt_tp_plan(sequence_parallel=sp)
        stages = [_prune(ref, range(0, 1), first=True, last=False)]
        stages.append(_prune(ref, range(1, 2), first=False, last=True))
        try:
            apply_tp_plan(stages[1], mesh, plan)  # no embeddings on this stage
            strict_error = ""
        except ValueError as exc:
            strict_error = str(exc)
        for stage in stages:
            stage.zero_grad()
            apply_tp_plan(stage, mesh, plan, strict=False)
        h = _stage_forward(stages[0], x)
        h = h.to_local() if isinstance(h, DTensor) else h  # a pipeline sends plain tensors
        logits = _stage_forward(stages[1], h)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
        reduce_partial_grads([p for s in stages for p in s.parameters()])
        errors: dict[str, tuple[float, bool]] = {}
        for stage in stages:
            errors.update(_grad_errors(stage, ref, mesh.size()))
        out[sp] = {
            "loss": (float(ref_loss.detach()), float(loss.detach())),
            "grads": errors,
            "strict_error": strict_error,
        }
    return out


def _both(steps: int) -> tuple[dict, dict]:
    return _plan_vs_one_process(steps), _stages_vs_one_process()


def _check_grads(errors: dict[str, tuple[float, bool]], where: str) -> None:
    assert len(errors) == 29, where  # 2 embeddings, 2 blocks x 12, final norm (2), head
    for name, (error, laid_out) in errors.items():
        assert error < REL, f"{where}: {name} gradient, relative error {error}"
        assert laid_out, f"{where}: {name} gradient layout"


def test_gpt_plan_trains_like_one_process() -> None:
    results = run_distributed(_both, 2, args=(5,), timeout=300)
    for rank, (plans, stages) in enumerate(results):
        for name, r in plans.items():
            ref, tp = r["losses"]["ref"], r["losses"]["tp"]
            assert ref[-1] < ref[0], f"{name}: the loss did not fall"
            for step, (a, b) in enumerate(zip(ref, tp, strict=True)):
                assert b == pytest.approx(a, rel=REL), f"rank {rank}, {name}, step {step + 1}"
            assert tp == results[0][0][name]["losses"]["tp"], f"{name}: ranks disagree"
            _check_grads(r["grads"], f"rank {rank}, {name}")
            # embedding, linears and head are DTensors; norms only under sequence parallelism
            dtensors = set(r["dtensors"])
            assert {"tok_emb.weight", "head.weight", "blocks.1.mlp.down.weight"} <= dtensors
            assert ("ln_f.weight" in dtensors) is PLANS[name][0], name
            assert ("blocks.0.ln1.weight" in dtensors) is PLANS[name][0], name
        for sp, r in stages.items():
            want, got = r["loss"]
            assert got == pytest.approx(want, rel=REL), f"rank {rank}, stages, sp={sp}"
            _check_grads(r["grads"], f"rank {rank}, stages, sequence_parallel={sp}")
            assert "'tok_emb' matches no module" in r["strict_error"]


def test_qkv_permutation_groups_heads_per_rank() -> None:
    perm = qkv_permutation(4, 2)  # q = rows 0-3, k = 4-7, v = 8-11
    assert perm.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(perm[perm.argsort()], torch.arange(12))


def test_prepare_permutes_the_qkv_of_the_blocks_a_stage_holds() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL))
    stage = _prune(model, range(1, 2), first=False, last=True)
    before = stage.blocks[1].attn.qkv.weight.clone()
    permute_qkv(stage, 2)
    perm = qkv_permutation(MODEL["d_model"], 2)
    assert torch.equal(stage.blocks[1].attn.qkv.weight, before[perm])
    assert not torch.equal(stage.blocks[1].attn.qkv.weight, before)
    assert gpt_tp_plan().prepare is permute_qkv


@pytest.mark.parametrize(
    ("sequence_parallel", "loss_parallel", "count"), [(False, False, 10), (True, True, 16)]
)
def test_gpt_plan_covers_the_model(
    sequence_parallel: bool, loss_parallel: bool, count: int
) -> None:
    plan = gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    assert plan.loss_parallel is loss_parallel
    resolved = resolve_tp_plan(GPT(ModelConfig(**MODEL)), plan, 2)
    # tok_emb, [pos_emb], per block qkv/proj/up/down [+ ln1, ln2], [ln_f], head
    assert len(resolved) == count
    assert list(resolved)[0] == "tok_emb" and list(resolved)[-1] == "head"
    assert ("blocks.1.ln2" in resolved) is sequence_parallel
    again = pickle.loads(pickle.dumps(plan))  # a plan can travel to spawned ranks
    assert list(resolve_tp_plan(GPT(ModelConfig(**MODEL)), again, 2)) == list(resolved)


@pytest.mark.parametrize(
    ("shape", "tp", "sequence_parallel", "match"),
    [
        ({"n_head": 2, "d_model": 64}, 4, False, r"tp=4 must divide model.n_head=2"),
        ({"n_head": 3, "d_model": 63, "vocab_size": 256}, 3, False, r"vocab_size=256"),
        ({}, 0, False, r"tp must be >= 1, got 0"),
        ({}, 1, True, r"sequence_parallel needs parallel.tp > 1.*tp=1"),
        ({"block_size": 31}, 2, True, r"tp=2 to divide model.block_size=31"),
    ],
)
def test_gpt_shapes_not_divisible(
    shape: dict, tp: int, sequence_parallel: bool, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_gpt_tp(ModelConfig(**shape), tp=tp, sequence_parallel=sequence_parallel)
    # the plan's check applies the same rules to a built model, before any collective
    plan = gpt_tp_plan(sequence_parallel=sequence_parallel)
    with pytest.raises(ValueError, match=match):
        resolve_tp_plan(GPT(ModelConfig(**shape)), plan, tp)


def test_gpt_shapes_that_shard() -> None:
    check_gpt_tp(ModelConfig(block_size=31), tp=2, sequence_parallel=False)  # plain TP: any seq
    check_gpt_tp(ModelConfig(n_head=4, d_model=64), tp=4, sequence_parallel=True)
    check_gpt_tp(ModelConfig(), tp=1, sequence_parallel=False)


# --- the engine, end to end ----------------------------------------------------------------------


def _config(steps: int = 4) -> dict:
    from torsh_distributed.testing.configs import small_config

    return small_config(steps).to_dict()


def _run(variants: dict[str, dict]) -> dict[str, tuple[list[float], float]]:
    from torsh_distributed.train import TrainConfig, train

    out = {}
    for name, parallel in variants.items():
        data = json.loads(json.dumps(_config()))
        data["parallel"] = parallel
        result = train(TrainConfig.from_dict(data))
        out[name] = (result.losses, result.val_loss)
    return out


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


def test_engine_tp2_matches_one_process(reference: tuple[list[float], float]) -> None:
    variants = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}
    _check(run_distributed(_run, 2, args=(variants,), timeout=300), reference)


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


def _plan_run(parallel: dict, world_size: int) -> RunPlan:
    from torsh_distributed.engine._setup import plan_run
    from torsh_distributed.train import TrainConfig

    cfg = TrainConfig.from_dict({**_config(), "parallel": parallel})
    plan = gpt_tp_plan(sequence_parallel=cfg.parallel.sequence_parallel)
    return plan_run(cfg, world_size=world_size, tp_plan=plan if cfg.parallel.tp > 1 else None)


def test_degrees_must_match_world_size() -> None:
    with pytest.raises(ValueError, match=r"degrees do not match the world size.*!= world size 2"):
        _plan_run({"tp": 2, "dp": 2}, 2)
    with pytest.raises(ValueError, match=r"degrees do not match the world size"):
        _plan_run({"dp": 3}, 2)
    assert _plan_run({"tp": 2}, 4).dims.dp == 2


def test_tp_rejects_zero1_and_sharding_without_dp() -> None:
    from torsh_distributed.train import TrainConfig

    with pytest.raises(ValueError, match=r"not with zero_stage 1"):
        TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "zero_stage": 1}})
    with pytest.raises(ValueError, match=r"zero_stage 3 shards .* but there is 1 data-parallel"):
        _plan_run({"tp": 2, "zero_stage": 3}, 2)


def test_sequence_parallel_needs_tp() -> None:
    from torsh_distributed.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel.sequence_parallel needs parallel.tp > 1.*tp=1"):
        ParallelConfig(sequence_parallel=True)
    assert ParallelConfig(tp=2, sequence_parallel=True).sequence_parallel


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
