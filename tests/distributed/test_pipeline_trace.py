"""A pipeline of a model whose forward is written the ordinary way (it does not skip ``None``
modules): split by tracing when torch.export can trace it, else one ``ValueError`` line on every
rank before any step.

Without a process group: :func:`check_forward` on ``meta`` finds the first module a stage calls
that lives on another stage (also behind data-dependent control flow), passes a forward that
skips them, and leaves the global random state alone. On 2 ranks (Gloo, CPU): one step of
:func:`build_pipeline` of :class:`PlainNet` traced at ``layers.2`` gives the unsplit model's loss
and gradients, with checkpoint names unchanged; the Engine trains it with ``pp=2`` exactly like
one process (1e-4); :class:`GatedNet` (untraceable) and a traced split with activation
checkpointing are refused by the same line on both ranks, after which both still communicate.
The CLI: ``tests/integration/test_train_cli_user_model.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torsh_distributed.parallel._pipeline_trace import check_forward, meta_skeleton
from torsh_distributed.parallel.pipeline import check_split_points, stage_module
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.models import GatedNet, PlainNet

TOL = 1e-4


class Skips(PlainNet):
    """PlainNet's modules, with a forward that skips the modules a stage lacks (no skip path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x)) if self.stem is not None else x
        h = self.layers(h)
        return self.out(h) if self.out is not None else h


class Headless(PlainNet):
    """Calls ``stem`` unconditionally: the stage after the first calls a module of stage 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(torch.relu(self.stem(x)))
        return self.out(h) if self.out is not None else h


class Partial(nn.Module):
    """Skips ``stem`` but not ``norm``, which is registered before ``layers`` (stage 0) and
    called after them (on the last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.layers = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x)) if self.stem is not None else x
        h = self.layers(h)
        return self.out(self.norm(h)) if self.out is not None else h


class ReadsWeight(PlainNet):
    """Reads ``out.weight`` (not calling ``out``) on the first stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.layers(torch.relu(self.stem(x))), self.out.weight)


class NoMetaKernel(Skips):
    """Skips None modules, but uses an op with no ``meta`` kernel (data-dependent output size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0 * torch.nonzero(x).sum()


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


def _check(model: nn.Module, points: list[str]) -> Any:
    split = check_split_points(model, points, num_stages=len(points) + 1)
    skeleton = meta_skeleton(model)
    return check_forward(skeleton, split, lambda m, s: stage_module(m, split, s), (X,), {})


@pytest.mark.parametrize(
    ("model", "points", "wrong"),
    [
        (PlainNet(), ["layers.2"], "stage 0 of 2 called `out`, which lives on stage 1"),
        (GatedNet(), ["layers.1"], "stage 0 of 2 called `out`, which lives on stage 1"),
        (Headless(), ["layers.2"], "stage 1 of 2 called `stem`, which lives on stage 0"),
        (PlainNet(), ["layers.1", "layers.3"], "stage 0 of 3 called `out`, which lives on stage 2"),
        # the stand-in for `stem` (skipped by `is not None`) is passed over: `norm` is named
        (Partial(), ["layers.2"], "stage 1 of 2 called `norm`, which lives on stage 0"),
        (ReadsWeight(), ["layers.2"], "stage 0 of 2 used `out.weight`, which lives on stage 1"),
    ],
    ids=["plain", "gated", "headless", "three-stages", "partial", "reads-weight"],
)
def test_check_names_the_first_module_of_another_stage(
    model: nn.Module, points: list[str], wrong: str
) -> None:
    found = _check(model, points)
    assert found.wrong_call == wrong and not found.follows_convention


def test_check_passes_a_forward_that_skips_none_modules_and_keeps_the_rng() -> None:
    model = Skips()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    before = torch.get_rng_state()
    found = _check(model, ["layers.2"])
    assert found.follows_convention, found
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # untouched


def test_check_without_meta_kernels_is_inconclusive_not_wrong() -> None:
    found = _check(NoMetaKernel(), ["layers.2"])
    assert found.wrong_call is None
    assert found.inconclusive is not None and found.inconclusive.startswith("stage 0: ")


def test_what_a_traced_stage_cannot_carry_is_named() -> None:
    from torsh_distributed.parallel._pipeline_trace import _unsupported
    from torsh_distributed.parallel.precision import apply_autocast

    model = PlainNet()
    model.layers[0].register_forward_pre_hook(lambda module, args: None)  # the model's own
    skeleton = meta_skeleton(model)
    assert _unsupported(model, skeleton) is None  # traced with the skeleton, hook included
    model.layers[1].register_forward_hook(lambda module, args, out: None)
    assert _unsupported(model, skeleton) == "forward hooks added to layers.1"
    apply_autocast(model, dtype="bf16", device_type="cpu")
    assert _unsupported(model, skeleton) == (
        "a replaced forward of the model (autocast: parallel.param_dtype)"
    )


# --- on 2 ranks ---


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _traced_step() -> dict[str, Any]:
    import torch.distributed as dist

    from torsh_distributed.parallel.pipeline import build_pipeline

    torch.manual_seed(0)
    reference = PlainNet()
    torch.manual_seed(0)
    model = PlainNet()
    x, y = _batch()
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    runner = build_pipeline(
        model, split_points=["layers.2"], pp_rank=dist.get_rank(), pp=2, group=None,
        device=torch.device("cpu"), schedule="1f1b", microbatches=2, loss_fn=F.cross_entropy,
    )
    loss = runner.step(x, y)
    ref = dict(reference.named_parameters())
    named = [(n, p) for m in runner.modules for n, p in m.named_parameters()]
    val = runner.evaluate(x, y)
    with torch.no_grad():
        ref_val = F.cross_entropy(reference(x), y)
    return {
        "traced": runner.traced,
        "loss": None if loss is None else float(loss),
        "ref_loss": float(ref_loss),
        "val": None if val is None else float(val),
        "ref_val": float(ref_val),
        "names": [n for n, _ in named],
        "grad_err": max(float((p.grad - ref[n].grad).abs().max()) for n, p in named),
        "state_keys": list(runner.state_module().state_dict()),
    }


def test_traced_split_step_matches_the_unsplit_model() -> None:
    results = run_distributed(_traced_step, 2, timeout=180)
    assert [r["traced"] for r in results] == [True, True]
    assert results[0]["loss"] is None and results[0]["val"] is None
    last = results[1]
    assert last["loss"] == pytest.approx(last["ref_loss"], rel=TOL)
    assert last["val"] == pytest.approx(last["ref_val"], rel=TOL)
    for rank, r in enumerate(results):
        assert r["grad_err"] < TOL, f"rank {rank}: gradients differ by {r['grad_err']}"
    # the stages' parameters and checkpoint keys are the split by module's: the unsplit names
    whole = list(PlainNet().state_dict())
    assert results[0]["state_keys"] + results[1]["state_keys"] == whole
    assert results[0]["names"][:2] == ["stem.weight", "stem.bias"]
    assert results[1]["names"][-2:] == ["out.weight", "out.bias"]


def _config(steps: int, **parallel: Any) -> Any:
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.parallel.config import ParallelConfig

    return EngineConfig(
        max_steps=steps, batch_size=16, eval_batches=2, progress=False,
        optim=OptimConfig(lr=1e-2, warmup_steps=0), parallel=ParallelConfig(**parallel),
    )


def _fit(factory: str, steps: int, parallel: dict[str, Any]) -> dict[str, Any]:
    from torsh_distributed.engine import Engine
    from torsh_distributed.testing import models as M

    result = Engine(
        getattr(M, factory), dataset=M.classification_data(),
        val_dataset=M.classification_data(seed=1), config=_config(steps, **parallel),
    ).fit()
    return {"losses": result.losses, "val": result.val_loss}


def test_engine_trains_an_ordinary_forward_with_pp2_like_one_process() -> None:
    ref = run_distributed(_fit, 1, args=("plain_net", 6, {}), timeout=120)[0]
    assert sum(ref["losses"][-3:]) < sum(ref["losses"][:3]), "the loss did not fall"
    results = run_distributed(
        _fit, 2, args=("plain_net", 6, {"pp": 2, "pp_split": "layers.2", "microbatches": 2}),
        timeout=240,
    )
    assert results[0] == results[1], "ranks disagree"
    for step, (a, b) in enumerate(zip(ref["losses"], results[0]["losses"], strict=True)):
        assert b == pytest.approx(a, rel=TOL), f"step {step + 1}"
    assert results[0]["val"] == pytest.approx(ref["val"], rel=TOL)


REFUSED = {
    "gated": (
        "gated_net", {},
        r"GatedNet: stage 0 of 2 called `out`, which lives on stage 1, and tracing the forward "
        r"with torch\.export to split it failed \(GuardOnDataDependentSymNode: .*\); write the "
        r"forward to skip the modules that are None on a stage",
    ),
    "checkpointing": (
        "plain_net", {"activation_checkpointing": "full"},
        r"PlainNet: stage 0 of 2 called `out`, which lives on stage 1; a split by tracing runs "
        r"each stage as a traced graph, which activation checkpointing "
        r"\(parallel\.activation_checkpointing\) "
        r"cannot hook",
    ),
}


def _refused() -> dict[str, str]:
    import torch.distributed as dist

    out = {}
    for name, (factory, extra) in ((k, v[:2]) for k, v in REFUSED.items()):
        try:
            _fit(factory, 2, {"pp": 2, "pp_split": "layers.2", "microbatches": 2, **extra})
        except ValueError as exc:
            out[name] = str(exc)
        # the peer is not left waiting in a send or receive: both ranks still agree
        total = torch.ones(())
        dist.all_reduce(total)
        out[name + " peers"] = str(float(total))
    return out


def test_untraceable_ordinary_forward_is_one_line_on_every_rank_before_any_step() -> None:
    results = run_distributed(_refused, 2, timeout=240)
    for rank, got in enumerate(results):
        for name, (_, _, pattern) in REFUSED.items():
            assert name in got, f"rank {rank}: {name} was not refused"
            assert "\n" not in got[name], got[name]
            assert pytest.approx(2.0) == float(got[name + " peers"])
            assert re.search(pattern, got[name]), f"rank {rank}: {got[name]}"
