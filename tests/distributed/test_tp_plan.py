"""Tensor-parallel plans for user models: a model we did not write, sharded by a plan of named
styles, trains exactly like the unsharded model; bad plans raise before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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


def _train_both(steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = UserLM()
    torch.manual_seed(0)
    tp = apply_tp_plan(UserLM(), mesh, PLAN)
    sharded = sorted(n for n, p in tp.named_parameters() if isinstance(p, DTensor))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, tp)]
    gen = torch.Generator().manual_seed(1)
    losses: dict[str, list[float]] = {"ref": [], "tp": []}
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        y = torch.randint(0, 64, (4, 16), generator=gen)
        for name, model, opt in (("ref", ref, opts[0]), ("tp", tp, opts[1])):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            losses[name].append(float(loss))
    worst = 0.0
    expected = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, float((full - expected[name]).abs().max()))
    return {"losses": losses, "worst_param_error": worst, "sharded": sharded}


def test_user_model_by_plan_trains_like_the_unsharded_model() -> None:
    for r in run_distributed(_train_both, 2, args=(4,), timeout=120):
        ref, tp = r["losses"]["ref"], r["losses"]["tp"]
        assert ref[-1] < ref[0]  # it trains
        for a, b in zip(ref, tp, strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (ref, tp)
        assert r["worst_param_error"] < 1e-5, r["worst_param_error"]
        # every planned module's weight is sharded: 1 + 2 x (4 + 2) + 1 weights, with biases
        assert "emb.weight" in r["sharded"] and "head.weight" in r["sharded"]
        assert "layers.1.mlp.down.weight" in r["sharded"]
        assert "layers.0.norm1.weight" not in r["sharded"]


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
