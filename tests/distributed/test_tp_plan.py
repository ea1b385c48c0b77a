"""Tensor-parallel plans for user models: a model we did not write, sharded by a plan of named
styles (with gathered or loss-parallel logits), trains exactly like the unsharded model; bad
plans raise before any collective; a pipeline stage takes the plan non-strictly."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torsh_distributed.parallel.tp_plan import TPPlan, resolve_tp_plan
from torsh_distributed.testing import run_distributed


class _Attention(nn.Module):
    """Separate q/k/v projections; the head count comes from the shape (``view(..., -1, hd)``),
    so the same code runs on all heads or on this rank's ``heads / tp``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.head_dim = d // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.mlp = nn.ModuleDict({"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp["down"](F.gelu(self.mlp["up"](self.norm2(x))))


class UserLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


PLAN = {
    "emb": "embedding",
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
    "head": "colwise_replicate",
}
PLAN_LAYER = ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down"]


def _mark_prepared(module: nn.Module, tp: int) -> None:
    module.prepared_with = tp  # type: ignore[assignment]


# the head leaves the logits sharded over the vocabulary; the loss runs under loss_parallel()
LOSS_PARALLEL = TPPlan(
    rules={
        **PLAN,
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    },
    loss_parallel=True,
    prepare=_mark_prepared,
)


def _train_both(steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = UserLM()
    models = {"ref": ref}
    for name, plan in (("tp", PLAN), ("tp_loss_parallel", LOSS_PARALLEL)):
        torch.manual_seed(0)
        models[name] = apply_tp_plan(UserLM(), mesh, plan)
    sharded = sorted(n for n, p in models["tp"].named_parameters() if isinstance(p, DTensor))
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.5) for name, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    losses: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        y = torch.randint(0, 64, (4, 16), generator=gen)
        for name, model in models.items():
            opts[name].zero_grad()
            lp = name == "tp_loss_parallel"
            with loss_parallel() if lp else contextlib.nullcontext():
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            opts[name].step()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            losses[name].append(float(loss.detach()))
    worst = 0.0
    expected = dict(ref.named_parameters())
    for name in ("tp", "tp_loss_parallel"):
        for pname, p in models[name].named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            worst = max(worst, float((full - expected[pname]).abs().max()))
    return {
        "losses": losses,
        "worst_param_error": worst,
        "sharded": sharded,
        "logits_dtensor": isinstance(logits, DTensor),  # the last model's: loss-parallel
        "prepared_with": getattr(models["tp_loss_parallel"], "prepared_with", None),
    }


def test_user_model_by_plan_trains_like_the_unsharded_model() -> None:
    for r in run_distributed(_train_both, 2, args=(4,), timeout=120):
        ref = r["losses"]["ref"]
        assert ref[-1] < ref[0]  # it trains
        for name in ("tp", "tp_loss_parallel"):
            for a, b in zip(ref, r["losses"][name], strict=True):
                assert abs(a - b) <= 1e-5 * abs(a), (name, ref, r["losses"][name])
        assert r["worst_param_error"] < 1e-5, r["worst_param_error"]
        # every planned module's weight is sharded: 1 + 2 x (4 + 2) + 1 weights, with biases
        assert "emb.weight" in r["sharded"] and "head.weight" in r["sharded"]
        assert "layers.1.mlp.down.weight" in r["sharded"]
        assert "layers.0.norm1.weight" not in r["sharded"]
        assert r["logits_dtensor"] is True
        assert r["prepared_with"] == 2  # prepare ran once, with the tp degree


def test_plan_expands_patterns_in_module_order() -> None:
    resolved = resolve_tp_plan(UserLM(), PLAN, 2)
    assert list(resolved)[:3] == ["emb", "layers.0.attn.q", "layers.0.attn.k"]
    assert len(resolved) == 1 + 2 * 6 + 1


@pytest.mark.parametrize(
    ("plan", "tp", "match"),
    [
        ({"layers.*.attn.qq": "colwise"}, 2, "matches no module of UserLM"),
        ({"layers.*.attn.q": "colwise", "layers.0.attn.q": "rowwise"}, 2, "matched by TP plan"),
        ({"layers.*.norm1": "colwise"}, 2, "applies to nn.Linear or nn.Embedding"),
        ({"head": "sequence"}, 2, "'sequence' applies to LayerNorm"),
        ({"head": "embedding"}, 2, "'embedding' applies to nn.Embedding"),
        ({"layers.*.mlp.up": "colwise"}, 3, "out_features=128 is not divisible by tp=3"),
        ({"layers.*.attn.o": "rowwise"}, 3, "in_features=32 is not divisible by tp=3"),
        ({"emb": "embedding"}, 5, "num_embeddings=64 is not divisible by tp=5"),
        ({"emb": "colwise"}, 0, "tp must be >= 1"),
    ],
)
def test_bad_plans_raise_before_any_collective(plan: dict, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_tp_plan(UserLM(), plan, tp)


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ({}, "at least one"),
        ({"head": "columnwise"}, "unknown style 'columnwise'"),
        ({"": "colwise"}, "non-empty"),
    ],
)
def test_plan_config_is_validated_at_construction(rules: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TPPlan(rules=rules)


def _noop(module: nn.Module, tp: int) -> None:
    del module, tp


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"loss_parallel": "yes"}, r"TPPlan.loss_parallel must be a bool, got str"),
        ({"loss_parallel": 1}, r"TPPlan.loss_parallel must be a bool, got int"),
        ({"prepare": 42}, r"TPPlan.prepare must be a function \(module, tp\) -> None or None"),
        ({"check": "tp | heads"}, r"TPPlan.check must be a function .* got str"),
    ],
)
def test_plan_options_are_validated_at_construction(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TPPlan(rules=PLAN, **options)
    plan = TPPlan(rules=PLAN, loss_parallel=True, prepare=_noop, check=_noop)
    assert plan.loss_parallel and plan.prepare is _noop and plan.check is _noop


def _heads_divisible(model: nn.Module, tp: int) -> None:
    if 4 % tp:
        raise ValueError(f"tp={tp} must divide the 4 heads of {type(model).__name__}")


def test_plan_check_runs_first_and_at_every_degree() -> None:
    plan = TPPlan(rules={"layers.*.attn.q": "colwise"}, check=_heads_divisible)
    with pytest.raises(ValueError, match=r"tp=3 must divide the 4 heads of UserLM"):
        resolve_tp_plan(UserLM(), plan, 3)  # before the rules' own "not divisible" message
    assert list(resolve_tp_plan(UserLM(), plan, 2)) == ["layers.0.attn.q", "layers.1.attn.q"]
    assert len(resolve_tp_plan(UserLM(), plan, 1)) == 2


@pytest.mark.parametrize(
    ("style", "module", "match"),
    [
        (ColwiseParallel(), "layers.*.mlp.up", "out_features=128 is not divisible by tp=3"),
        (RowwiseParallel(), "layers.*.attn.o", "in_features=32 is not divisible by tp=3"),
        (RowwiseParallel(), "emb", "num_embeddings=64 is not divisible by tp=3"),
    ],
)
def test_given_styles_are_checked_for_divisibility(style: object, module: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_tp_plan(UserLM(), {module: style}, 3)


def _stage(model: UserLM, keep: int, *, first: bool, last: bool) -> UserLM:
    """A pipeline stage as a pruned deep copy (the unsplit names, other parts ``None``)."""
    stage = copy.deepcopy(model)
    for i in range(len(stage.layers)):
        if i != keep:
            stage.layers[i] = None
    if not first:
        stage.emb = None
    if not last:
        stage.head = None
    return stage


def test_non_strict_plan_skips_what_a_stage_does_not_hold() -> None:
    first = _stage(UserLM(), 0, first=True, last=False)
    with pytest.raises(ValueError, match=r"'head' matches no module of UserLM"):
        resolve_tp_plan(first, PLAN, 2)
    resolved = resolve_tp_plan(first, PLAN, 2, strict=False)
    assert list(resolved) == ["emb"] + [f"layers.0.{m}" for m in PLAN_LAYER]
    last = _stage(UserLM(), 1, first=False, last=True)
    resolved = resolve_tp_plan(last, PLAN, 2, strict=False)
    assert list(resolved) == [f"layers.1.{m}" for m in PLAN_LAYER] + ["head"]
    # non-strict still validates what it matches, and each module gets its own style object
    with pytest.raises(ValueError, match=r"in_features=32 is not divisible by tp=3"):
        resolve_tp_plan(last, {"layers.*.attn.o": "rowwise", "emb": "embedding"}, 3, strict=False)
    style = ColwiseParallel()
    shared = resolve_tp_plan(UserLM(), {"layers.*.attn.q": style}, 2)
    assert len({id(s) for s in shared.values()}) == 2 and style not in shared.values()
