"""Compressed data parallelism on 2 ranks: every method trains the built-in model to within 3 %
of uncompressed; compressor state saved mid-run continues identically; DDP's options work.

All training runs of a test share one process launch (CI budget)."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.compression import (
    build_compressor,
    find_compression,
    prime_buckets,
    register_compression,
)
from torsh_distributed.models.gpt import GPT
from torsh_distributed.parallel.data import DDPOptions, apply_ddp
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train
from torsh_distributed.train.config import ModelConfig

# Methods at the settings this CI budget (200 steps of a 137 k-parameter model, validation loss,
# seed 1234) takes to within 3 % of uncompressed; see docs/compression.md for other seeds.
# powersgd:4 runs with a 10-step uncompressed warm-up (--compression-warmup 10, as torch's
# start_powerSGD_iter): val gap over seeds 1234, 1, 2 +0.7, +0.6, +1.4 % (without: +7.0, +2.6,
# +1.4 %). sign:vote: +1.9, +2.4, +2.9 %.
SPECS = [
    "fp16",
    "bf16",
    "int8",
    "topk:0.3",
    "threshold:1e-3",
    "ternary",
    "sign:vote",
    "powersgd:4",
    "auto",
]
WARMUP = {"powersgd:4": 10}
# Under AdamW (the trainer's default) the sparsifiers at 1 % / 50 %, scaled sign and EF21 lag on
# this budget (val gap over seeds 1234, 1, 2: ef21:topk:0.1 +5.0, +5.4, +2.4 %; a 30-step warm-up
# narrows topk:0.01 to +7.0, +8.3, +6.7 %, randomk:0.5 to +3.6, +3.8, +2.1 %, sign to +4.5, +4.0,
# +4.2 %). Error feedback is exact (test_error_feedback_is_exact_through_ddp), and with plain SGD,
# the setting of its convergence proofs, the same methods train within 3 % of uncompressed SGD
# (seeds 1234, 1, 2: topk:0.01 +1.0, +0.4, -0.3 %; randomk:0.5 -0.5, -1.4, -2.4 %; sign -1.4,
# -3.7, -3.3 %; ef21:topk:0.1 -0.9, -0.9, -1.5 %). Adam's per-coordinate normalisation is not
# linear, so what error feedback delivers late is not applied as if it came on time (so is
# momentum's: with SGD momentum 0.9 the gaps come back). Both are checked: under SGD at 3 %,
# under AdamW with a looser bound that still fails on a broken method (initial loss ~ +130 %).
LOOSE = {
    "randomk:0.5": 0.15,
    "topk:0.01": 0.2,
    "sign": 0.25,
    "ef21:topk:0.1": 0.08,
}
SGD_LR = 0.5
STEPS = 200


def _config(method: str, optimizer: str = "adamw") -> dict:
    cfg = preset("tiny")
    cfg.max_steps = STEPS
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 8  # the compared loss: validation, the same fixed batches for every method
    cfg.compression.method = method
    cfg.compression.warmup_steps = WARMUP.get(method, 0)
    if optimizer == "sgd":
        cfg.optim.optimizer = "sgd"
        cfg.optim.lr = SGD_LR
    return cfg.to_dict()


def _train_all(runs: list[str]) -> dict[str, dict]:
    """``runs``: method specs, ``sgd/<spec>`` for plain SGD instead of AdamW."""
    out = {}
    for run in runs:
        optimizer, _, method = run.rpartition("/")
        result = train(TrainConfig.from_dict(_config(method, optimizer or "adamw")))
        # validation loss, not the last training steps' mean: that one moves by several percent
        # with the sample order alone (a different seed shifts powersgd:4's gap from +1 % to +8 %)
        out[run] = {"loss": result.val_loss, "compression": result.compression}
    return out


@pytest.mark.slow
# 18 runs of 200 steps: 101 s alone on a slow host (import torch 3.7 s), over 300 s in the suite
# there beside the other worker's multi-process tests; the bound is run_distributed's own
@pytest.mark.timeout(960)
def test_every_compressor_trains_within_three_percent_of_uncompressed():
    sgd = [f"sgd/{m}" for m in ("none", *LOOSE)]
    runs = ["none", *SPECS, *LOOSE, *sgd]
    # over gloo+shm, the backend `auto` gives a multi-rank CPU job (the other tests here: Gloo):
    # the same losses as over Gloo, in 24 % less wall time (Gloo's TCP round trips, 5 methods
    # measured side by side: 18.2 -> 13.8 s, 31 -> 28 CPU-s)
    results = run_distributed(_train_all, 2, args=(runs,), timeout=900, backend="gloo+shm")
    assert results[0].keys() == results[1].keys()
    base = {"": results[0]["none"]["loss"], "sgd": results[0]["sgd/none"]["loss"]}
    gaps = {
        m: (r["loss"] - base[m.rpartition("/")[0]]) / base[m.rpartition("/")[0]]
        for m, r in results[0].items()
    }
    bound = {m: LOOSE.get(m, 0.03) for m in gaps}
    # auto picks per bucket by *measured* time: on a loaded machine it may pick topk:0.01, which
    # then gets that method's bound (its choice is in the decisions it logged)
    chosen = re.findall(r"bucket \d+: (\S+) \(", " ".join(
        results[0]["auto"]["compression"].get("decisions", [])))
    bound["auto"] = max([0.03, *(LOOSE.get(m, 0.03) for m in chosen)])
    failed = {m: f"{g:+.2%} (auto chose {chosen})" if m == "auto" else f"{g:+.2%}"
              for m, g in gaps.items() if g > bound[m]}
    assert not failed, f"loss gap > 3 % vs none with the same optimizer ({base}): {failed}"
    for run, r in results[0].items():
        method = run.rpartition("/")[2]
        c = r["compression"]
        assert set(c) >= {"method", "bytes_uncompressed", "bytes_sent", "ratio", "seconds"}
        if method not in ("none", "auto", "threshold:1e-3", "randomk:0.5"):
            assert c["bytes_sent"] < c["bytes_uncompressed"], (method, c)
            assert c["ratio"] == pytest.approx(c["bytes_uncompressed"] / c["bytes_sent"], rel=1e-3)
    none = results[0]["none"]["compression"]
    assert none["ratio"] == 1.0 and none["steps"] == STEPS and none["bytes_sent"] > 0
    assert results[0]["int8"]["compression"]["ratio"] == pytest.approx(4.0, rel=0.01)
    assert results[0]["fp16"]["compression"]["ratio"] == pytest.approx(2.0, rel=0.01)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(ModelConfig(block_size=16, n_layer=1, n_head=2, d_model=32))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def _run(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _build(spec: str):
    base = _model()
    # several buckets; find_unused_parameters keeps DDP from rebuilding them after step 1, so
    # a restored run sees the layout the saved state was keyed by (see docs/compression.md)
    model = apply_ddp(base, bucket_cap_mb=0.02, find_unused_parameters=True)
    hook = register_compression(model, build_compressor(spec, seed=3))
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    return base, model, hook, opt


def _save_restore(specs: list[str]) -> dict[str, tuple[bool, bool, bool]]:
    torch.set_num_threads(1)
    out = {}
    for spec in specs:
        base, model, hook, opt = _build(spec)
        _run(model, opt, range(0, 12))  # past auto's probing (1 + 2 x 5 steps)
        blob = io.BytesIO()
        torch.save(
            {"model": base.state_dict(), "opt": opt.state_dict(), "comp": hook.state_dict()}, blob
        )
        straight = _run(model, opt, range(12, 18))
        blob.seek(0)
        state = torch.load(blob, weights_only=True)
        base2, model2, hook2, opt2 = _build(spec)
        base2.load_state_dict(state["model"])
        opt2.load_state_dict(state["opt"])
        hook2.load_state_dict(state["comp"])
        resumed = _run(model2, opt2, range(12, 18))
        # control: restoring everything but the compressor state changes the run
        base3, model3, _, opt3 = _build(spec)
        base3.load_state_dict(state["model"])
        opt3.load_state_dict(state["opt"])
        fresh = _run(model3, opt3, range(12, 18))
        out[spec] = (straight == resumed, straight != fresh, find_compression(model2) is hook2)
    return out


@pytest.mark.slow
def test_compressor_state_restores_mid_training_identically():
    specs = ["topk:0.05", "powersgd:2", "int8", "ternary", "randomk:0.1", "ef21:topk:0.1", "auto"]
    results = run_distributed(_save_restore, 2, args=(specs,), timeout=300)
    for spec, (identical, state_matters, found) in results[0].items():
        assert identical, f"{spec}: the restored run differs from the uninterrupted one"
        assert found
        if spec not in ("int8",):  # int8 round-to-nearest keeps no state
            assert state_matters, f"{spec}: the run does not depend on the compressor state"


def _warmup_case() -> dict[str, object]:
    """3 warm-up steps of powersgd:1 equal uncompressed DDP exactly and count as sent in full;
    step 4 is compressed."""
    torch.set_num_threads(1)
    runs = {}
    for spec, warm in (("none", 0), ("powersgd:1", 3)):
        base = _model()
        model = apply_ddp(base, bucket_cap_mb=0.02)
        hook = register_compression(model, build_compressor(spec, seed=3), warmup_steps=warm)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
        losses = _run(model, opt, range(0, 3))
        dense = (hook.total.bytes_sent, hook.total.bytes_uncompressed)
        losses += _run(model, opt, range(3, 5))
        runs[spec] = (losses, dense, hook.total.bytes_sent, hook.total.bytes_uncompressed)
    return runs


def test_warmup_steps_are_uncompressed_then_compression_starts():
    for r in run_distributed(_warmup_case, 2, timeout=120):
        none, psgd = r["none"], r["powersgd:1"]
        assert psgd[0][:3] == none[0][:3]  # bit-identical while warming up
        assert psgd[0][4] != none[0][4]  # compressed afterwards
        assert psgd[1][0] == psgd[1][1] > 0  # warm-up steps: sent in full
        assert psgd[2] < psgd[3]  # then fewer bytes than uncompressed


def _fp16_overflow_case() -> dict[str, dict]:
    out = {}
    for method in ("none", "topk:0.1", "powersgd:2"):
        cfg = preset("tiny")
        cfg.max_steps = 10
        cfg.batch_size = 8
        cfg.progress = False
        cfg.eval_batches = 1
        cfg.data.max_bytes = 200_000
        cfg.compression.method = method
        cfg.parallel.param_dtype = "fp16"  # autocast + DDP + dynamic loss scaling
        cfg.parallel.loss_scale_init = 2.0**20  # overflows for the first steps
        result = train(cfg)
        out[method] = {
            "precision": result.precision,
            "losses": result.losses,
            "compression": result.compression,
        }
    return out


def test_fp16_overflow_does_not_poison_error_feedback():
    """An overflowed step (skipped by the loss scaler) must not leave inf/NaN in residuals or
    PowerSGD factors: before the fix every later step overflowed too and training stopped
    (30 of 30 steps skipped, scale down to 0.93)."""
    r = run_distributed(_fp16_overflow_case, 2, timeout=240)[0]
    skipped = r["none"]["precision"]["skipped_at"]
    assert 0 < len(skipped) < 8, r["none"]["precision"]
    for method in ("topk:0.1", "powersgd:2"):
        p = r[method]["precision"]
        assert p["skipped_at"] == skipped, (method, p)  # the same overflow steps, then training
        assert r[method]["compression"]["error_resets"] == len(skipped), r[method]["compression"]
        losses = r[method]["losses"]
        assert losses[-1] < losses[len(skipped)], (method, losses)


def _rebucketing_case() -> dict[str, object]:
    """DDP re-buckets after step 1: unprimed, the hook resets (never misapplies) its state."""
    import warnings

    torch.set_num_threads(1)
    out: dict[str, object] = {}
    for primed in (False, True):
        base = _model()
        model = apply_ddp(base, bucket_cap_mb=0.02)
        hook = register_compression(model, build_compressor("topk:0.05", seed=3))
        opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
        if primed:
            x, y = _batch(99)
            out["primed_ran"] = prime_buckets(
                model, lambda m=model, x=x, y=y: m(x[:1, :2], y[:1, :2])[1]
            )
            out["grads_cleared"] = all(p.grad is None for p in base.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(model, opt, range(0, 3))
        messages = [str(w.message) for w in caught if "changed its parameters" in str(w.message)]
        out[f"warned_{primed}"] = bool(messages)
        out[f"steps_{primed}"] = hook.steps
        out[f"layouts_{primed}"] = len(hook.layouts)
    return out


def test_rebucketing_resets_state_unless_primed():
    results = run_distributed(_rebucketing_case, 2, timeout=120)
    for r in results:
        assert r["warned_False"], "DDP re-bucketed without the hook noticing"
        assert not r["warned_True"], "prime_buckets left a layout change for training"
        assert r["primed_ran"] and r["grads_cleared"]
        assert r["steps_True"] == 3, "priming must not count as a step"
        assert r["layouts_True"] > 1


def _ddp_options_case() -> dict[str, object]:
    torch.set_num_threads(1)
    out: dict[str, object] = {}
    # no_sync gradient accumulation over two micro-batches == one step on both at once
    base = _model()
    model = apply_ddp(base, gradient_as_bucket_view=True, first_bucket_mb=0.01, bucket_cap_mb=0.05)
    static = apply_ddp(_model(), static_graph=True)
    out["static"] = bool(static.static_graph) and bool(model.gradient_as_bucket_view)
    x, y = _batch(0)
    with model.no_sync():
        _, loss = model(x[:2], y[:2])
        (loss / 2).backward()
    _, loss = model(x[2:], y[2:])
    (loss / 2).backward()
    accumulated = torch.cat([p.grad.reshape(-1) for p in base.parameters()])
    ref_base = _model()
    ref = apply_ddp(ref_base)
    _, loss = ref(x, y)
    loss.backward()
    full = torch.cat([p.grad.reshape(-1) for p in ref_base.parameters()])
    out["accumulation"] = float((accumulated - full).abs().max() / full.abs().max())
    # an options object reaches DDP; keywords override its fields
    inner = apply_ddp(_model(), options=DDPOptions(find_unused_parameters=True, static_graph=True), static_graph=False)
    out["override"] = not inner.static_graph
    out["find_unused"] = bool(inner.find_unused_parameters)
    out["default_after"] = bool(apply_ddp(_model()).find_unused_parameters)
    # the none hook (Identity) gives DDP's result
    b1, m1 = _model(), None
    m1 = apply_ddp(b1)
    register_compression(m1, build_compressor("none"))
    _, loss = m1(x, y)
    loss.backward()
    hooked = torch.cat([p.grad.reshape(-1) for p in b1.parameters()])
    out["identity"] = float((hooked - full).abs().max() / full.abs().max())
    return out


def test_ddp_options_and_no_sync_accumulation():
    results = run_distributed(_ddp_options_case, 2, timeout=120)
    for r in results:
        assert r["static"] and r["find_unused"] and r["override"] and not r["default_after"]
        assert r["accumulation"] < 1e-5
        assert r["identity"] < 1e-6


def _error_feedback_books(specs: list[str]) -> dict[str, float]:
    """Per method: max over buckets of |sum of exact mean gradients - sum of exchanged means -
    mean residual| after 15 SGD steps through DDP, relative to the largest summed gradient."""
    torch.set_num_threads(1)
    out = {}
    for spec in specs:
        base = _model()
        model = apply_ddp(base, bucket_cap_mb=0.02)
        compressor = build_compressor(spec, seed=3)
        register_compression(model, compressor)
        x, y = _batch(999)
        prime_buckets(model, lambda x=x, y=y, model=model: model(x[:1], y[:1])[1])
        exact: dict[int, torch.Tensor] = {}
        sent: dict[int, torch.Tensor] = {}
        reduce = compressor.reduce

        def books(
            tensor, comm, *, key=0, timer=None, shapes=None, reduce=reduce, exact=exact, sent=sent
        ):
            mean = tensor.clone()
            dist.all_reduce(mean)
            exact[key] = exact.get(key, 0) + mean.double() / dist.get_world_size()
            result = reduce(tensor, comm, key=key, timer=timer, shapes=shapes)
            sent[key] = sent.get(key, 0) + result.double()
            return result

        compressor.reduce = books  # type: ignore[method-assign]
        _run(model, torch.optim.SGD(base.parameters(), lr=0.1), range(15))
        errors = []
        for key, total in exact.items():
            residual = compressor.residuals[key].clone()
            dist.all_reduce(residual)
            missing = total - sent[key] - residual.double() / dist.get_world_size()
            errors.append(float(missing.abs().max() / total.abs().max()))
        assert len(exact) > 1, "the model should span several buckets"
        out[spec] = max(errors)
    return out


def test_error_feedback_is_exact_through_ddp():
    """Error feedback loses nothing on 2 ranks through DDP's hook: what every step exchanged plus
    what is left in the residuals equals the sum of the exact mean gradients (float64 books).
    The sparse and sign methods' lag under AdamW (see LOOSE) is therefore not lost gradient."""
    specs = ["topk:0.01", "randomk:0.5", "sign", "threshold:1e-3"]
    results = run_distributed(_error_feedback_books, 2, args=(specs,), timeout=120)
    for spec, error in results[0].items():
        assert error < 1e-5, (spec, error)
