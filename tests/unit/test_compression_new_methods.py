"""The estimators of natural compression, bimodal quantisation, count-sketch and the zstd stage:
unbiasedness where claimed, the documented error bounds, the lossless round trip, the specs and
auto's choice of a stacked rung."""

from __future__ import annotations

import io
import math

import pytest
import torch

from torsh_distributed.compression import (
    Adaptive,
    Bimodal,
    Comm,
    CountSketch,
    ErrorFeedback,
    Natural,
    SignSGD,
    Zstd,
    build_compressor,
    parse_spec,
)
from torsh_distributed.compression.adaptive import LADDER_ZSTD
from torsh_distributed.compression.lossless import decode, encode
from torsh_distributed.compression.quantize import Int8


def _grad(n: int = 4099, seed: int = 0) -> torch.Tensor:
    """Gradient-like: normal entries whose scales spread over four decades, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 0, n)[torch.randperm(n, generator=g)]
    x[::97] = 0.0
    return x


def test_natural_is_unbiased_with_variance_at_most_an_eighth():
    x = _grad(1000)
    comp = Natural(seed=1)
    draws = 1500
    total = torch.zeros_like(x, dtype=torch.float64)
    sq_error = 0.0
    for _ in range(draws):
        payload, ctx = comp.compress(x)
        y = comp.decompress(payload, ctx)
        total += y.double()
        sq_error += float(((y - x) ** 2).sum())
    variance = sq_error / draws
    assert variance <= x.square().sum() / 8  # Horvath et al., Theorem 1: omega = 1/8
    # per entry, the mean of the draws is within 5 standard errors of x (bias would exceed it)
    per_entry_sd = (x.abs() / (2 * math.sqrt(2))).double() / math.sqrt(draws)
    bias = (total / draws - x.double()).abs()
    assert bool((bias <= 5 * per_entry_sd + 1e-12).all()), float((bias / per_entry_sd).max())


def test_natural_sends_signed_powers_of_two_in_one_byte_each():
    x = _grad()
    payload, ctx = Natural(seed=2).compress(x)
    assert payload[0].dtype == torch.uint8 and payload[0].numel() == x.numel()
    assert payload[1].numel() == 1
    y = Natural().decompress(payload, ctx)
    assert bool((y[x == 0] == 0).all())
    nonzero = y[y != 0]
    mantissa, _ = torch.frexp(nonzero.abs())
    assert bool((mantissa == 0.5).all())  # exact powers of two
    assert bool((torch.sign(nonzero) == torch.sign(x[y != 0])).all())
    # each entry lands on one of the two powers of two around it
    ratio = y[y != 0].abs() / x[y != 0].abs()
    assert bool((ratio > 0.5).all()) and bool((ratio < 2.0).all())


def test_natural_stays_unbiased_for_entries_far_below_the_largest():
    # 1e-40 is an fp32 denormal 2^133 below 1.0: it rounds to 0 or the smallest code (2^-126)
    comp = Natural(seed=5)
    for tiny in (1e-40, 3e-38):
        x = torch.cat([torch.ones(1), torch.full((50_000,), tiny)])
        means = []
        for _ in range(20):
            payload, ctx = comp.compress(x)
            y = comp.decompress(payload, ctx)
            assert bool(torch.isfinite(y).all()) and float(y[0]) in (1.0, 2.0)
            means.append(float(y[1:].double().mean()))
        assert sum(means) / len(means) == pytest.approx(tiny, rel=0.06)  # 5 sd at 1e-40


def test_natural_replays_after_state_restore():
    x = _grad()
    a = Natural(seed=5)
    a.compress(x, key=3)
    state = a.state_dict()
    first = a.compress(x, key=3)[0][0]
    b = Natural(seed=0)
    b.load_state_dict(state)
    assert torch.equal(b.compress(x, key=3)[0][0], first)


def test_bimodal_is_the_least_squares_projection_on_the_sign_bins():
    x = _grad(4099)
    comp = Bimodal(block=256)
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    err, norm, kept = float((x - y).square().sum()), float(x.square().sum()), float(y.square().sum())
    assert err == pytest.approx(norm - kept, rel=1e-4)  # orthogonal projection
    assert err <= (1 - 1 / (2 * 256)) * norm
    sign = SignSGD(block=256)
    s_payload, s_ctx = sign.compress(x)
    assert err <= float((x - sign.decompress(s_payload, s_ctx)).square().sum())
    # each block decodes to two levels: the means of its non-negative and negative entries
    block = x[:256]
    assert float(y[:256][block >= 0][0]) == pytest.approx(float(block[block >= 0].mean()), rel=1e-5)
    assert float(y[:256][block < 0][0]) == pytest.approx(float(block[block < 0].mean()), rel=1e-5)
    nbytes = sum(t.numel() * t.element_size() for t in payload)
    assert nbytes == math.ceil(4099 / 8) + 8 * math.ceil(4099 / 256)


def test_count_sketch_single_row_estimate_is_unbiased_with_variance_over_columns():
    x = _grad(2000)
    seeds = 300
    total = torch.zeros_like(x, dtype=torch.float64)
    sq = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(seeds):
        comp = CountSketch(0.2, rows=1, seed=seed)
        est = comp.estimate(comp.sketch(x, 0), x.numel(), 0).double()
        total += est
        sq += (est - x.double()) ** 2
    columns = CountSketch(0.2, rows=1).columns(x.numel())
    # Var(estimate_j) = sum_{i != j} x_i^2 / columns: the mean squared error is within 20 % of it
    bound = float((x.square().sum() - x.square()).double().mean()) / columns
    assert float(sq.mean()) / seeds == pytest.approx(bound, rel=0.2)
    sd = math.sqrt(bound / seeds)
    assert float((total / seeds - x.double()).abs().max()) < 5 * sd


def test_count_sketch_finds_heavy_hitters_and_keeps_exact_books():
    n = 20_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    spikes = torch.arange(0, n, 997)[:20]
    x[spikes] = torch.linspace(1, 2, spikes.numel())
    comp = CountSketch(0.05, rows=3, seed=4)
    payload, ctx = comp.compress(x)
    assert payload[0].numel() == 3 * comp.columns(n)
    y = comp.decompress(payload, ctx)
    assert torch.allclose(y[spikes], x[spikes], atol=0.05)  # median of 3 rows
    # through reduce (a world of one): sent + residual == sum of gradients, every step
    comm = Comm()
    total, sent = torch.zeros(n), torch.zeros(n)
    for step in range(5):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + step))
        total += g
        sent += comp.reduce(g.clone(), comm, key=1)
    assert torch.allclose(sent + comp.errors[1], total, atol=1e-4)
    state = comp.state_dict()
    again = CountSketch(0.05, rows=3, seed=4)
    again.load_state_dict(state)
    g = torch.randn(n)
    assert torch.equal(again.reduce(g.clone(), comm, key=1), comp.reduce(g.clone(), comm, key=1))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32]
)
def test_byte_stream_round_trip_is_exact(dtype):
    t = (torch.randn(1000) * 50).to(dtype)
    out = decode(encode([t, torch.empty(0, dtype=dtype), t[:3].clone()]))
    assert [o.dtype for o in out] == [dtype] * 3
    assert torch.equal(out[0].view(torch.uint8), t.view(torch.uint8)) and out[1].numel() == 0


@pytest.mark.parametrize("spec", ["int8", "topk:0.05", "sign", "natural", "bimodal", "none"])
def test_zstd_stage_is_lossless_after_any_method(spec):
    x = _grad()
    plain = build_compressor(spec, seed=3)
    stacked = build_compressor(f"zstd:{spec}", seed=3)
    assert isinstance(stacked, Zstd) and stacked.name == f"zstd:{plain.name}"
    p_payload, p_ctx = plain.compress(x.clone(), key=0)
    s_payload, s_ctx = stacked.compress(x.clone(), key=0)
    assert torch.equal(stacked.decompress(s_payload, s_ctx), plain.decompress(p_payload, p_ctx))
    if isinstance(plain, ErrorFeedback):  # the residual (inside the stage) is the same too
        assert torch.equal(stacked.inner.residuals[0], plain.residuals[0])
    # reduce in a world of one: the stacked method's exchange gives the plain one's result
    assert torch.equal(
        build_compressor(f"zstd:{spec}", seed=9).reduce(x.clone(), Comm()),
        build_compressor(spec, seed=9).reduce(x.clone(), Comm()),
    )


def test_zstd_shrinks_int8_codes_of_a_gradient():
    stacked = Zstd(Int8())
    payload, _ = stacked.compress(_grad(65_536))
    assert payload[0].numel() < 0.8 * 65_540  # int8 codes of spread-out magnitudes: mostly small
    assert stacked.packed_bytes == payload[0].numel() and stacked.raw_bytes > stacked.packed_bytes


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("zstd", "zstd needs a value"),
        ("zstd:powersgd:2", r"zstd \(lossless\) stacks after a method that sends one payload"),
        ("zstd:sketch:0.1", "not sketch"),
        ("sketch:0", r"ratio must be in \(0, 1\]"),
        ("natural:2", "unknown compression spec"),
    ],
)
def test_new_bad_specs_raise_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


@pytest.mark.parametrize(
    "spec", ["natural", "bimodal", "sketch:0.1", "zstd:int8", "zstd:topk:0.01", "auto:zstd"]
)
def test_new_specs_parse_round_trip_and_build(spec):
    parsed = parse_spec(spec)
    assert parse_spec(str(parsed)) == parsed and str(parsed) == spec
    comp = build_compressor(spec, seed=1)
    assert comp.name == spec
    if spec == "auto:zstd":
        assert comp.ladder == list(LADDER_ZSTD)
    blob = io.BytesIO()
    torch.save(comp.state_dict(), blob)  # checkpointable


def test_error_feedback_defaults_of_the_new_methods():
    assert isinstance(build_compressor("bimodal"), ErrorFeedback)  # biased, as in 1-bit SGD
    assert not isinstance(build_compressor("natural"), ErrorFeedback)  # unbiased
    assert build_compressor("sketch:0.1").error_feedback is True
    assert build_compressor("sketch:0.1", error_feedback=False).error_feedback is False


def test_auto_zstd_stacks_the_lossless_stage_only_where_the_link_pays_for_it():
    # zstd:int8 sends 30 % fewer bytes than int8 for 3 ms more compute per bucket
    ladder = list(LADDER_ZSTD)
    compute = dict.fromkeys(range(len(ladder)), 0.0)
    compute[ladder.index("int8")], compute[ladder.index("zstd:int8")] = 0.001, 0.004
    for name in ("powersgd:4", "topk:0.01", "zstd:topk:0.01"):
        compute[ladder.index(name)] = 10.0  # out of the running
    nbytes = {i: 4_000_000 for i in range(len(ladder))}
    nbytes[ladder.index("fp16")] = 2_000_000
    nbytes[ladder.index("int8")] = 1_000_000
    nbytes[ladder.index("zstd:int8")] = 700_000

    def decide(sec_per_byte: float) -> set[str]:
        auto = Adaptive(ladder=ladder)
        for key in (0, 1):
            for i in range(len(ladder)):
                auto.samples[(key, i)] = [(compute[i], nbytes[i], 1, nbytes[i] * sec_per_byte)] * 2
        return {ladder[i] for i in auto._decide().values()}

    assert decide(1 / 12.5e6) == {"zstd:int8"}  # 100 Mbit/s: 24 ms saved for 3 ms
    assert decide(1 / 1e9) == {"fp16"}  # 1 GB/s: 0.3 ms saved does not pay for 3 ms


def test_zero_int8_refusals_and_ignored_settings_are_stated():
    from torsh_distributed.compression import CompressionConfig
    from torsh_distributed.engine._compression import GradCompression

    with pytest.raises(ValueError, match=r"--compression sketch:0.1 applies to DDP .* Use "
                       r"--compression int8 with --zero-stage 3 .* or --zero-stage 0"):
        GradCompression(CompressionConfig(method="sketch:0.1"), zero_stage=3)
    from torsh_distributed.engine._compression import check_compression

    # the engine's plan (run by the CLI before launching) refuses int8 collectives with tp/pp
    with pytest.raises(ValueError, match=r"needs tp 1 and pp 1; .* use --zero-stage 0"):
        check_compression(CompressionConfig(method="int8"), zero_stage=3, model_parallel=True)
    check_compression(CompressionConfig(method="int8"), zero_stage=0, model_parallel=True)
    comp = GradCompression(CompressionConfig(method="int8"), zero_stage=2)
    with pytest.raises(ValueError, match="needs tp 1 and pp 1; with tensor or pipeline"):
        comp.attach_flat(None)
    with pytest.warns(UserWarning, match="--compression-warmup is ignored with --zero-stage 2"):
        GradCompression(CompressionConfig(method="int8", warmup_steps=5), zero_stage=2)
    with pytest.raises(ValueError, match="quantised collectives need a model sharded by FSDP2"):
        from torsh_distributed.parallel.sharded import quantize_collectives

        quantize_collectives(torch.nn.Linear(2, 2))


def test_deepspeed_zero_quantized_keys_map_to_int8_collectives():
    from torsh_distributed.compat.deepspeed import import_deepspeed
    from torsh_distributed.train import TrainConfig

    ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                "zero_quantized_gradients": True}}
    cfg, report = import_deepspeed(ds, TrainConfig(), world_size=2)
    assert cfg.compression.method == "int8" and cfg.parallel.zero_stage == 3
    status = {e.key: e.status for e in report.entries}
    assert status["zero_optimization.zero_quantized_weights"] == "mapped"
    assert status["zero_optimization.zero_quantized_gradients"] == "mapped"
    ds = {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}}
    cfg, report = import_deepspeed(ds, TrainConfig(), world_size=2)
    assert cfg.compression.method == "none"
    [entry] = [e for e in report.entries if e.key.endswith("zero_quantized_gradients")]
    assert entry.status == "unsupported" and "stage 2-3" in entry.note


def test_block_quantiser_keeps_blocks_inside_parameters():
    from torsh_distributed.parallel._quantized_zero import (
        block_dequantize,
        block_ids,
        block_quantize,
    )

    ids, num_blocks = block_ids([3, 300, 5], 256)
    assert num_blocks == 4 and ids[:3].tolist() == [0, 0, 0] and ids[-5:].tolist() == [3] * 5
    # a LayerNorm-like segment of ones beside small weights: the small ones keep their precision
    x = torch.cat([torch.ones(3), torch.randn(300) * 0.02, torch.ones(5)]).view(1, -1)
    y = block_dequantize(*block_quantize(x, ids, num_blocks), ids)
    small = x[0, 3:303]
    assert float((y[0, 3:303] - small).abs().max()) <= float(small.abs().max()) / 254 + 1e-7
    flat_ids, flat_blocks = block_ids([308], 256)  # blocks over the flat buffer: much worse
    z = block_dequantize(*block_quantize(x, flat_ids, flat_blocks), flat_ids)
    assert float((z[0, 3:256] - small[:253]).abs().max()) > 10 * float((y[0, 3:256] - small[:253]).abs().max())


@pytest.mark.parametrize(
    "sizes", [[3, 300, 5], [0, 256, 0, 257, 1], [512], [255], [5000, 0, 4001], [9000]]
)
def test_block_amax_by_views_equals_the_scatter(sizes: list[int]):
    """The quantised collectives pass the segment sizes: their maxima come from reshaped views
    (for segments of >= 4096 entries on average), and must be exactly the atomic scatter's."""
    from torsh_distributed.parallel._quantized_zero import block_amax, block_ids, block_quantize

    ids, num_blocks = block_ids(sizes, 256)
    g = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(3, sum(sizes), generator=g) * torch.rand(3, 1, generator=g)
    x[1, : min(4, x.shape[1])] = 0.0
    codes, scale = block_quantize(x, ids, num_blocks)  # the scatter
    views = block_amax(x, sizes, 256)
    assert views.shape == (3, num_blocks)
    assert torch.equal((views / 127.0).clamp_min(torch.finfo(torch.float32).tiny), scale)
    both = block_quantize(x, ids, num_blocks, sizes=sizes, block=256)  # views where they pay
    assert torch.equal(both[0], codes) and torch.equal(both[1], scale)
    with pytest.raises(ValueError, match="block sizes add up to"):
        block_quantize(x, ids, num_blocks, sizes=[*sizes, 1], block=256)


def test_stream_draws_on_the_asked_device_or_falls_back_to_the_cpu():
    """``Stream.next(key, device)``: a CPU device (or none) gives the CPU generator of the same
    seed; a device without a generator of its own (``meta``) falls back to the CPU one."""
    from torsh_distributed.compression._rng import Stream

    plain, cpu, meta = Stream(3).next(5), Stream(3).next(5, torch.device("cpu")), \
        Stream(3).next(5, torch.device("meta"))
    assert cpu.device.type == "cpu" and meta.device.type == "cpu"
    draws = [torch.rand(4, generator=g) for g in (plain, cpu, meta)]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])
    stream = Stream(3)
    first, second = stream.next(5), stream.next(5)
    assert not torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=second))
