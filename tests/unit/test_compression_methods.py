"""Every compressor: error bounds of decompress(compress(x)), error-feedback bookkeeping,
determinism given a seed, state round trips, byte counts (property tests with hypothesis)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh_distributed.compression import (
    EF21,
    Cast,
    Comm,
    ErrorFeedback,
    Int8,
    PowerSGD,
    RandomK,
    SignSGD,
    Ternary,
    Threshold,
    TopK,
    build_compressor,
    payload_bytes,
)
from torsh_distributed.compression._bits import pack, unpack

SETTINGS = settings(max_examples=30, deadline=None)
floats = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
vectors = st.lists(floats, min_size=1, max_size=257).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


def fixed(n: int) -> st.SearchStrategy[torch.Tensor]:
    return st.lists(floats, min_size=n, max_size=n).map(lambda xs: torch.tensor(xs, dtype=torch.float32))
seeds = st.integers(0, 2**31 - 1)

ALL_SPECS = [
    "fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "threshold:1", "sign", "sign:vote",
    "ternary", "powersgd:2", "ef21:topk:0.1",
]


def roundtrip(comp, x, key=0):
    payload, ctx = comp.compress(x.clone(), key=key)
    return payload, comp.decompress(payload, ctx)


@SETTINGS
@given(vectors)
def test_fp16_relative_error(x):
    _, d = roundtrip(Cast(torch.float16), x)
    assert d.dtype == x.dtype and d.shape == x.shape
    assert torch.all((d - x).abs() <= 2**-11 * x.abs() + 2**-24)


@SETTINGS
@given(vectors)
def test_bf16_relative_error(x):
    _, d = roundtrip(Cast(torch.bfloat16), x)
    assert torch.all((d - x).abs() <= 2**-8 * x.abs() + 1e-38)


def test_fp16_clamps_instead_of_overflowing():
    _, d = roundtrip(Cast(torch.float16), torch.tensor([1e6, -1e6]))
    assert torch.isfinite(d).all() and d.tolist() == [65504.0, -65504.0]


@SETTINGS
@given(vectors, st.booleans(), seeds)
def test_int8_error_below_one_step(x, stochastic, seed):
    payload, d = roundtrip(Int8(stochastic=stochastic, seed=seed), x)
    scale = float(payload[1])
    bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-5) + 1e-30
    assert payload[0].dtype == torch.int8 and payload_bytes(payload) == x.numel() + 4
    assert torch.all((d - x).abs() <= bound)


def test_int8_stochastic_rounding_is_unbiased():
    x = torch.linspace(-1, 1, 101)
    comp = Int8(stochastic=True, seed=3)
    mean = torch.stack([roundtrip(comp, x)[1] for _ in range(2000)]).mean(0)
    assert torch.allclose(mean, x, atol=0.15 / 127 * 4)
    biased = roundtrip(Int8(), x)[1]
    assert not torch.equal(mean, biased)


@SETTINGS
@given(vectors, st.floats(0.01, 1.0))
def test_topk_keeps_the_largest_exactly(x, ratio):
    payload, d = roundtrip(TopK(ratio), x)
    k = min(x.numel(), max(1, math.ceil(ratio * x.numel())))
    assert payload[0].numel() == k and payload_bytes(payload) == 8 * k
    kept = d != 0
    assert torch.equal(d[kept], x[kept])
    smallest_kept = x[payload[0].long()].abs().min()
    assert torch.all(x[~kept].abs() <= smallest_kept)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.2])
@pytest.mark.parametrize("kind", ["normal", "heavy_tail", "ties", "block"])
def test_top_indices_selects_what_torch_topk_selects_on_large_buckets(kind, ratio):
    from torsh_distributed.compression.sparsify import top_indices

    n = 600_000
    g = torch.Generator().manual_seed(7)
    x = {
        "normal": lambda: torch.randn(n, generator=g),
        "heavy_tail": lambda: torch.randn(n, generator=g) ** 5,
        "ties": lambda: torch.randint(0, 4, (n,), generator=g).float(),
        # the large entries sit in one block the strided sample barely sees: the fallback path
        "block": lambda: torch.cat([torch.zeros(n - n // 50), 1 + torch.rand(n // 50, generator=g)]),
    }[kind]().abs()
    k = math.ceil(ratio * n)
    idx = top_indices(x, k)
    ref = torch.topk(x, k, sorted=False)
    assert idx.numel() == k and idx.unique().numel() == k
    assert torch.equal(x[idx].sort().values, ref.values.sort().values)
    if kind in ("normal", "heavy_tail"):  # no ties: the very same entries
        assert torch.equal(idx.sort().values, ref.indices.sort().values)


@SETTINGS
@given(vectors, st.floats(0.01, 1.0), seeds)
def test_randomk_sends_exact_values_at_shared_indices(x, ratio, seed):
    a, b = RandomK(ratio, seed=seed), RandomK(ratio, seed=seed)
    pa, ctx_a = a.compress(x, key=3)
    _, ctx_b = b.compress(-x, key=3)  # another rank: other values, the same indices
    assert torch.equal(ctx_a[2], ctx_b[2])
    d = a.decompress(pa, ctx_a)
    sent = torch.zeros_like(x, dtype=torch.bool)
    sent[ctx_a[2]] = True
    assert torch.equal(d[sent], x[sent]) and torch.all(d[~sent] == 0)
    assert pa[0].numel() == min(x.numel(), max(1, math.ceil(ratio * x.numel())))


@SETTINGS
@given(vectors, st.floats(1e-3, 100.0))
def test_threshold_sends_exactly_the_large_entries(x, tau):
    _, d = roundtrip(Threshold(tau), x)
    big = x.abs() >= tau
    assert torch.equal(d[big], x[big]) and torch.all(d[~big] == 0)


@SETTINGS
@given(vectors, st.integers(1, 64))
def test_sign_is_scaled_sign_per_block(x, block):
    payload, d = roundtrip(SignSGD(block=block), x)
    n = x.numel()
    scale = torch.stack([x[i : i + block].abs().mean() for i in range(0, n, block)])
    expected = torch.where(x >= 0, 1.0, -1.0) * scale.repeat_interleave(block)[:n]
    assert torch.allclose(d, expected)
    assert payload_bytes(payload) == -(-n // 8) + 4 * -(-n // block)


def test_majority_vote_combines_signs():
    comp = SignSGD(vote=True)
    decoded = [torch.tensor([1.0, -1.0, 2.0]), torch.tensor([1.0, 1.0, -2.0]), torch.tensor([3.0, -3.0, -3.0])]
    out = comp.combine(decoded)
    scale = sum(float(d.abs().mean()) for d in decoded) / 3
    assert torch.allclose(out, torch.tensor([1.0, -1.0, -1.0]) * scale)


@SETTINGS
@given(vectors, seeds, st.integers(1, 64))
def test_ternary_values_and_bound(x, seed, block):
    payload, d = roundtrip(Ternary(seed=seed, block=block), x)
    n = x.numel()
    s = torch.stack([x[i : i + block].abs().max() for i in range(0, n, block)]).repeat_interleave(block)[:n]
    assert torch.all((d == 0) | (d.abs() == s))
    assert torch.all((d - x).abs() <= s * (1 + 1e-6))
    assert torch.all((d == 0) | (torch.sign(d) == torch.sign(x)))
    assert payload_bytes(payload) == -(-n // 4) + 4 * -(-n // block)


def test_ternary_is_unbiased():
    x = torch.linspace(-1, 1, 64)
    comp = Ternary(seed=0)
    mean = torch.stack([roundtrip(comp, x)[1] for _ in range(4000)]).mean(0)
    assert torch.allclose(mean, x, atol=0.06)


@SETTINGS
@given(st.integers(2, 24), st.integers(2, 24), st.integers(1, 4), seeds)
def test_powersgd_is_a_projection(rows, cols, rank, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=g)
    comp = PowerSGD(rank, min_compression_rate=0.0, seed=seed)
    payload, ctx = comp.compress(m.reshape(-1), shapes=[m.shape])
    d = comp.decompress(payload, ctx).view(rows, cols)
    assert (d - m).norm() <= m.norm() * (1 + 1e-4)


def test_powersgd_warm_start_converges_to_the_best_low_rank():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 30, generator=g))
    v, _ = torch.linalg.qr(torch.randn(30, 30, generator=g))
    sigma = torch.tensor([10.0, 6.0] + [1.0 / (i + 1) for i in range(28)])
    m = u @ torch.diag(sigma) @ v.t()
    best = float(sigma[2:].norm() / sigma.norm())  # Eckart-Young: the optimal rank-2 error
    comp = PowerSGD(2, seed=1)
    errors = []
    for _ in range(15):
        payload, ctx = comp.compress(m.reshape(-1), shapes=[m.shape])
        errors.append(float((comp.decompress(payload, ctx).view_as(m) - m).norm() / m.norm()))
    assert errors[-1] == pytest.approx(best, rel=1e-3) and errors[0] > errors[-1], errors


def test_powersgd_sends_vectors_uncompressed_and_counts_factor_bytes():
    comp = PowerSGD(2, seed=0)
    shapes = [torch.Size([64, 32]), torch.Size([32])]
    x = torch.randn(64 * 32 + 32)
    payload, ctx = comp.compress(x, shapes=shapes)
    d = comp.decompress(payload, ctx)
    assert torch.equal(d[-32:], x[-32:])
    assert payload_bytes(payload) == 4 * (32 + 64 * 2 + 32 * 2)


@SETTINGS
@given(vectors, seeds)
def test_ef21_estimate_gets_closer(x, seed):
    comp = EF21(TopK(0.2))
    comp.local[0] = torch.zeros_like(x)
    before = x.norm()
    comp.compress(x, key=0)
    assert (x - comp.local[0]).norm() <= before * (1 + 1e-6)


@pytest.mark.parametrize("spec", ["topk:0.1", "randomk:0.1", "threshold:1"])
@SETTINGS
@given(st.lists(fixed(33), min_size=1, max_size=5), seeds)
def test_error_feedback_is_exact_for_sparsifiers(spec, grads, seed):
    comp = build_compressor(spec, seed=seed)
    assert isinstance(comp, ErrorFeedback)
    residual = torch.zeros(33)
    for g in grads:
        payload, ctx = comp.compress(g, key=0)
        sent = comp.inner.decompress(payload, ctx)
        assert torch.equal(sent + comp.residuals[0], g + residual)  # bitwise
        residual = comp.residuals[0]


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "sign", "ternary", "topk:0.05"])
@SETTINGS
@given(st.lists(fixed(40), min_size=1, max_size=6), seeds)
def test_error_feedback_telescopes_to_the_accumulated_gradient(spec, grads, seed):
    comp = ErrorFeedback(build_compressor(spec, seed=seed, error_feedback=False))
    total_sent = torch.zeros(40, dtype=torch.float64)
    for g in grads:
        payload, ctx = comp.compress(g, key=0)
        total_sent += comp.decompress(payload, ctx).double()
    accumulated = torch.stack(grads).double().sum(0)
    scale = float(torch.stack(grads).abs().max()) * len(grads) + 1e-30
    assert torch.allclose(total_sent + comp.residuals[0].double(), accumulated, atol=1e-5 * scale, rtol=0)


def test_powersgd_error_feedback_closes_in_a_world_of_one():
    comp = PowerSGD(1, seed=0)
    m = torch.randn(20 * 10)
    out = comp.reduce(m.clone(), Comm(), key=0, shapes=[torch.Size([20, 10])])
    assert torch.allclose(out + comp.residuals[0], m, atol=1e-6)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_deterministic_given_seed_and_state_round_trip(spec):
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(300, generator=gen) for _ in range(6)]
    shapes = [torch.Size([20, 15])]

    def run(comp, gs):
        return [comp.reduce(g.clone(), Comm(), key=0, shapes=shapes) for g in gs]

    a, b = build_compressor(spec, seed=5), build_compressor(spec, seed=5)
    for x, y in zip(run(a, grads), run(b, grads), strict=True):
        assert torch.equal(x, y)
    # save mid-way, restore into a fresh compressor: the continuation is identical
    first = build_compressor(spec, seed=5)
    run(first, grads[:3])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    restored = build_compressor(spec, seed=5)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    for x, y in zip(run(first, grads[3:]), run(restored, grads[3:]), strict=True):
        assert torch.equal(x, y)


@SETTINGS
@given(st.lists(st.integers(0, 3), max_size=100), st.sampled_from([1, 2]))
def test_bit_packing_round_trips(codes, bits):
    t = torch.tensor([c % (1 << bits) for c in codes], dtype=torch.uint8)
    packed = pack(t, bits)
    assert packed.numel() == -(-t.numel() * bits // 8)
    assert torch.equal(unpack(packed, bits, t.numel()), t)


def test_world_of_one_sends_nothing():
    comm = Comm()
    out = build_compressor("topk:0.5").reduce(torch.ones(10), comm)
    assert comm.bytes_sent == 0 and out.shape == (10,)
