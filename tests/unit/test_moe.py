"""The MoE layer in one process: config validation, routing against a token-by-token loop, the
balancing losses against their closed forms, capacity dropping, bias balancing, meta init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torsh_distributed.parallel.expert import apply_ep, reduce_expert_grads, update_moe_biases
from torsh_distributed.parallel.moe import GroupedExperts, MoE, MoEConfig, moe_losses

D = torch.float64


def _cfg(**kw: object) -> MoEConfig:
    base: dict[str, object] = {"num_experts": 4, "d_model": 6, "d_hidden": 10, "top_k": 2}
    base.update(kw)
    return MoEConfig(**base)  # type: ignore[arg-type]


def _layer(seed: int = 0, **kw: object) -> MoE:
    torch.manual_seed(seed)
    return MoE(_cfg(**kw), dtype=D)


def _expert(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ m.experts.w1[e]) @ m.experts.w2[e]


def _loop_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token, dropless: selection on score + bias, weights = raw scores."""
    cfg = m.config
    flat = x.reshape(-1, cfg.d_model)
    rows = []
    for t in range(flat.shape[0]):
        logits = m.router.weight @ flat[t]
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + m.expert_bias).topk(cfg.top_k).indices.tolist()
        y = sum(scores[e] * _expert(m, e, flat[t]) for e in chosen)
        if m.shared is not None:
            y = y + m.shared(flat[t])
        rows.append(y)
    return torch.stack(rows).reshape(x.shape)


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_experts": 0}, "num_experts must be an int >= 1"),
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"top_k": 5}, r"top_k \(5\) must not exceed num_experts \(4\)"),
        ({"d_model": 0}, "d_model must be"),
        ({"d_hidden": 2.5}, "d_hidden must be"),
        ({"score": "relu"}, "score must be one of softmax, sigmoid, got 'relu'"),
        ({"num_shared_experts": -1}, "num_shared_experts must be an int >= 0"),
        ({"capacity_factor": -0.5}, "capacity_factor must be a finite number >= 0"),
        ({"capacity_factor": math.inf}, "capacity_factor must be a finite"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef must be"),
        ({"z_loss_coef": -1e-3}, "z_loss_coef must be"),
        ({"bias_update_rate": -0.1}, "bias_update_rate must be"),
    ],
)
def test_config_rejects_bad_values(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_config_requires_the_sizes() -> None:
    with pytest.raises(TypeError):
        MoEConfig(num_experts=4, d_model=8)  # type: ignore[call-arg]


def test_capacity_formula() -> None:
    cfg = _cfg(capacity_factor=1.25)  # ceil(1.25 * T * 2 / 4)
    assert [cfg.capacity(t) for t in (0, 1, 8, 10)] == [0, 1, 5, 7]
    # 1.1 * 40 / 4 is 11.000000000000002 in floating point: still 11 slots
    assert _cfg(capacity_factor=1.1, num_experts=4, top_k=1).capacity(40) == 11
    assert _cfg().capacity(100) == 0  # dropless


# -- routing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 2])
def test_output_equals_token_by_token_mixture(score: str, shared: int) -> None:
    m = _layer(score=score, num_shared_experts=shared)
    x = torch.randn(2, 5, 6, dtype=D)
    y = m(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, _loop_reference(m, x), rtol=0, atol=1e-12)
    if shared:
        assert m.shared is not None and m.shared.w1.out_features == shared * 10
        without = m.shared
        m.shared = None
        assert (m(x) - y).abs().max() > 1e-3  # the shared experts contribute
        m.shared = without
    else:
        assert m.shared is None


def test_sigmoid_and_softmax_weights_differ() -> None:
    x = torch.randn(7, 6, dtype=D)
    soft, sig = _layer(score="softmax"), _layer(score="sigmoid")  # same seed, same weights
    assert torch.equal(soft.router.weight, sig.router.weight)
    assert not torch.allclose(soft(x), sig(x))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_loss_closed_forms(score: str) -> None:
    m = _layer(score=score, aux_loss_coef=0.03, z_loss_coef=0.002, top_k=2)
    x = torch.randn(9, 6, dtype=D)
    m(x)
    logits = (x @ m.router.weight.T).detach()
    E, T, k = 4, 9, 2
    if score == "softmax":
        probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
        scores = probs
    else:
        scores = 1 / (1 + (-logits).exp())
        probs = scores / scores.sum(-1, keepdim=True)
    counts = [0] * E
    for t in range(T):
        for e in scores[t].topk(k).indices.tolist():
            counts[e] += 1
    aux = 0.03 * E * sum(counts[e] / (T * k) * probs[:, e].mean().item() for e in range(E))
    z = 0.002 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T
    assert m.aux_loss is not None and m.z_loss is not None and m.loss is not None
    assert m.aux_loss.item() == pytest.approx(aux, rel=1e-12)
    assert m.z_loss.item() == pytest.approx(z, rel=1e-12)
    assert m.loss.item() == pytest.approx(aux + z, rel=1e-12)
    assert m.aux_loss.requires_grad and m.z_loss.requires_grad
    m.aux_loss.backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0


def test_moe_losses_sums_every_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MoE(_cfg(z_loss_coef=1e-3), dtype=D), MoE(_cfg(), dtype=D))
    assert moe_losses(model).item() == 0.0  # nothing ran yet
    model(torch.randn(5, 6, dtype=D))
    first, second = model[0].loss, model[1].loss
    assert first is not None and second is not None
    assert moe_losses(model).item() == pytest.approx((first + second).item(), rel=1e-15)
    assert moe_losses(nn.Linear(2, 2)).item() == 0.0


def test_empty_input_and_shape_check() -> None:
    m = _layer(capacity_factor=1.0)
    y = m(torch.zeros(0, 6, dtype=D))
    assert y.shape == (0, 6)
    assert m.aux_loss is not None and m.aux_loss.item() == 0.0
    assert m.stats is not None and m.stats.dropped == 0
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 6\]"):
        m(torch.zeros(3, 5, dtype=D))


# -- capacity ----------------------------------------------------------------------------------
def test_tokens_conserved_under_capacity() -> None:
    m = _layer(capacity_factor=0.5)
    x = torch.randn(40, 6, dtype=D)
    m(x)
    stats = m.stats
    assert stats is not None  # can fail: stats is None when forward recorded no routing
    capacity = m.config.capacity(40)  # ceil(0.5 * 40 * 2 / 4) = 10
    assert capacity == 10
    assert sum(stats.routed_per_expert) == 40 * 2
    assert stats.dropped > 0
    assert sum(stats.tokens_per_expert) == 40 * 2 - stats.dropped
    assert stats.tokens_per_expert == [min(r, capacity) for r in stats.routed_per_expert]


def test_dropping_keeps_the_highest_probability_tokens() -> None:
    # Two experts, top-1, router = identity: token [v, 0] goes to expert 0 with p = sigmoid(v).
    m = _layer(num_experts=2, top_k=1, d_model=2, capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(2, dtype=D))
    v = [0.5, 2.0, 1.0, 3.0, 1.0, 0.2]  # capacity = ceil(6 * 1 / 2) = 3
    x = torch.tensor([[a, 0.0] for a in v], dtype=D)
    y = m(x)
    kept = [t for t in range(6) if y[t].abs().sum() > 0]
    assert kept == [1, 2, 3]  # the 3 highest p; the tie (tokens 2 and 4) goes to the earlier one
    stats = m.stats
    assert stats is not None  # can fail: stats is None when forward recorded no routing
    assert stats.tokens_per_expert == [3, 0] and stats.routed_per_expert == [6, 0]
    assert stats.dropped == 3
    for t in kept:
        p = torch.sigmoid(torch.tensor(v[t], dtype=D))
        torch.testing.assert_close(y[t], p * _expert(m, 0, x[t]), rtol=0, atol=1e-14)
    # Reversed, the tie goes to the other token (now the earlier one): original tokens 3, 1, 4.
    assert m(x.flip(0)).abs().sum(1).nonzero().flatten().tolist() == [1, 2, 4]


def test_dropless_never_drops_a_skewed_batch() -> None:
    m = _layer(num_shared_experts=1)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0].fill_(1.0)
        m.router.weight[1].fill_(0.5)
    x = torch.rand(30, 6, dtype=D) + 0.1  # everyone prefers experts 0 and 1
    y = m(x)
    stats = m.stats
    assert stats is not None  # can fail: stats is None when forward recorded no routing
    assert stats.routed_per_expert == [30, 30, 0, 0] and stats.tokens_per_expert == [30, 30, 0, 0]
    assert stats.dropped == 0 and stats.load_cv == pytest.approx(1.0)
    torch.testing.assert_close(y, _loop_reference(m, x), rtol=0, atol=1e-12)


# -- aux-loss-free balancing ---------------------------------------------------------------------
def _skewed(rate: float) -> MoE:
    """Top-1, every positive input prefers expert 0."""
    m = _layer(bias_update_rate=rate, top_k=1, score="sigmoid")
    with torch.no_grad():
        m.router.weight.mul_(0.1)
        m.router.weight[0] += 0.3  # expert 0 wins for positive inputs
    return m


def test_bias_update_moves_load_toward_balance() -> None:
    m = _layer(bias_update_rate=0.01, top_k=2, score="sigmoid")
    with torch.no_grad():
        m.router.weight[0] += 0.4  # expert 0 is overloaded
    m.train()
    x = torch.randn(256, 6, dtype=D, generator=torch.Generator().manual_seed(1)) + 0.5
    cvs = []
    for _ in range(30):
        m(x)
        stats = m.stats
        assert stats is not None  # can fail: stats is None when forward recorded no routing
        cvs.append(stats.load_cv)
        update_moe_biases(m)
    assert cvs[0] > 0.4
    assert max(cvs[-5:]) < 0.1 * cvs[0], cvs
    assert m.expert_bias[0] == m.expert_bias.min() and m.expert_bias[0] < 0


def test_bias_update_needs_training_forwards() -> None:
    m = _skewed(0.1)
    m.eval()
    m(torch.rand(16, 6, dtype=D))
    assert m.load is None
    update_moe_biases(m)
    assert torch.equal(m.expert_bias, torch.zeros(4, dtype=torch.float32))


def test_bias_is_not_a_parameter_and_leaves_gradients_alone() -> None:
    m = _skewed(0.05)
    m.train()
    assert "expert_bias" not in dict(m.named_parameters())
    assert "expert_bias" in m.state_dict()
    x = torch.rand(20, 6, dtype=D)
    m(x).square().sum().backward()
    before = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    update_moe_biases(m)
    assert m.expert_bias.abs().sum() > 0 and not m.expert_bias.requires_grad
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, before[n]), n  # type: ignore[arg-type]


def test_bias_changes_selection_but_not_weights_or_gradient() -> None:
    m = _layer(top_k=2)
    with torch.no_grad():
        m.expert_bias[3] = 10.0  # expert 3 is always selected
    x = torch.randn(8, 6, dtype=D)
    y = m(x)
    stats = m.stats
    assert stats is not None and stats.routed_per_expert[3] == 8
    ref = _loop_reference(m, x)  # weights = unbiased probabilities of the biased selection
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(y.square().sum(), m.router.weight)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), m.router.weight)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


# -- initialisation ------------------------------------------------------------------------------
def test_meta_init_then_reset_equals_eager_init() -> None:
    cfg = _cfg(num_shared_experts=1, bias_update_rate=0.01)
    eager = MoE(cfg, dtype=D)
    torch.manual_seed(7)
    eager.reset_parameters()
    meta = MoE(cfg, device="meta", dtype=D)
    assert meta.experts.w1.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    expected = eager.state_dict()
    for name, value in meta.state_dict().items():
        assert torch.equal(value, expected[name]), name
    torch.manual_seed(8)
    meta.reset_parameters()
    assert not torch.equal(meta.experts.w1, eager.experts.w1)  # the seed matters


def test_sharded_experts_initialise_as_their_slice() -> None:
    full = GroupedExperts(6, 4, 5, dtype=D)
    torch.manual_seed(3)
    full.reset_parameters()
    part = GroupedExperts(6, 4, 5, device="meta", dtype=D).keep_(2, 4)
    part.to_empty(device="cpu")
    torch.manual_seed(3)
    part.reset_parameters()
    assert part.num_local_experts == 2 and part.expert_offset == 2
    assert torch.equal(part.w1, full.w1[2:4]) and torch.equal(part.w2, full.w2[2:4])
    with pytest.raises(ValueError, match="already sharded"):
        part.keep_(0, 1)
    with pytest.raises(ValueError, match=r"0 <= start < stop <= 6"):
        GroupedExperts(6, 4, 5).keep_(4, 7)


def test_grouped_experts_checks_counts() -> None:
    experts = GroupedExperts(3, 4, 5)
    with pytest.raises(ValueError, match="tokens_per_expert must have 3 entries summing to 4"):
        experts(torch.zeros(4, 4), torch.tensor([1, 1, 1]))


# -- expert-parallel entry points without a process group -----------------------------------------
def test_apply_ep_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="apply_ep needs a running process group"):
        apply_ep(_layer())


def test_reduce_expert_grads_divides_by_dp_times_ep() -> None:
    p = nn.Parameter(torch.ones(3, dtype=D))
    p.grad = torch.full((3,), 6.0, dtype=D)
    reduce_expert_grads([p], group=None, dp=1, ep=3)  # one replica: no communication
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    for bad, match in (
        ({"dp": 0, "ep": 1}, "dp must be an int >= 1"),
        ({"dp": 1, "ep": 0}, "ep must"),
    ):
        with pytest.raises(ValueError, match=match):
            reduce_expert_grads([p], group=None, **bad)  # type: ignore[arg-type]
