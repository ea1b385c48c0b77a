"""Gradient codecs on CUDA tensors: every deterministic compressor's round trip, the int8 ZeRO block
codec and the 1-bit sign codec give on the GPU what they give on the CPU; the stochastic ones
(natural, ternary, stochastic int8) draw on the GPU's own generator, so they are checked for being
seeded, valid and as unbiased as on the CPU; and DDP with our compression hooks trains on CUDA
tensors across two ranks that share the one GPU over Gloo (NCCL refuses two ranks on one device).
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from torsh_distributed.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]

METHODS = ["fp16", "bf16", "int8", "topk:0.01", "randomk:0.01", "threshold:0.01", "sign:vote",
           "sign", "bimodal", "sketch:0.1", "powersgd:4"]
STOCHASTIC = ["natural", "ternary", "int8-stochastic"]


def _build(method: str, seed: int = 0):  # noqa: ANN202
    from torsh_distributed.compression.build import build_compressor

    if method == "int8-stochastic":
        return build_compressor("int8", error_feedback=False, stochastic_rounding=True, seed=seed)
    return build_compressor(method, error_feedback=False, seed=seed)


def _round_trip(method: str, x: torch.Tensor) -> torch.Tensor:
    comp = _build(method)
    kwargs = {"shapes": [torch.Size([64, x.numel() // 64])]} if method.startswith("powersgd") else {}
    payload, ctx = comp.compress(x.clone(), key=3, **kwargs)
    for part in payload:
        assert part.device == x.device, f"{method}: payload part on {part.device}, not {x.device}"
    return comp.decompress(payload, ctx)


@pytest.mark.parametrize("method", METHODS)
def test_codec_round_trip_on_cuda_matches_cpu(method: str):
    from torsh_distributed.compression.spec import parse_spec

    try:
        parse_spec(method)
    except ValueError as exc:
        pytest.skip(f"{method}: not a method of this build ({exc})")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 1000, generator=g) * torch.rand(64 * 1000, generator=g)
    cpu = _round_trip(method, x)
    gpu = _round_trip(method, x.cuda())
    assert gpu.device.type == "cuda"
    tol = 1e-3 if method.startswith("powersgd") else 1e-5
    if method.startswith("sketch"):
        # CUDA's index_add is atomic: the sums of a cell come in any order, so estimates differ
        # in the last bits and an entry at the heavy-hitter boundary may swap with its neighbour
        wrong = ~torch.isclose(gpu.cpu(), cpu, rtol=tol, atol=tol * float(x.abs().max()))
        assert int(wrong.sum()) <= x.numel() // 1000, int(wrong.sum())
        return
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=tol, atol=tol * float(x.abs().max()))


def _valid(method: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` is one of the values the method may round ``x`` to."""
    ax, ay = x.abs(), y.abs()
    assert bool(((y == 0) | (torch.sign(y) == torch.sign(x))).all()), f"{method}: a sign flipped"
    if method == "natural":  # 2^a <= |x| < 2^(a+1) rounds to 2^a or 2^(a+1)
        nz = x != 0
        low = torch.exp2(torch.floor(torch.log2(ax[nz])))
        assert bool(((ay[nz] == low) | (ay[nz] == 2 * low)).all()), "natural: not a bracketing power"
        assert bool((y[~nz] == 0).all())
    elif method == "ternary":  # 0 or the block's max magnitude
        scale = ax.view(-1, 256).amax(dim=1).repeat_interleave(256)
        assert bool(((ay == 0) | torch.isclose(ay, scale)).all()), "ternary: not in {-s, 0, s}"
    else:  # int8, stochastic: floor or ceil of x / scale
        step = float(ax.max()) / 127
        assert float((y - x).abs().max()) <= step * (1 + 1e-5), "int8: more than one step away"


@pytest.mark.parametrize("method", STOCHASTIC)
def test_stochastic_codec_draws_on_the_gpu_seeded_valid_and_unbiased(method: str):
    """The draws run on CUDA's generator (no CPU draw and copy): the same seed gives the same codes,
    every value is a legal rounding of its entry, and the mean of 200 draws approaches ``x`` as
    closely as on the CPU (a biased rounding would stay ~10 % away)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 1000, generator=g) * torch.rand(64 * 1000, generator=g)
    x[:50] = 0.0
    xg = x.cuda()
    first, again = _build(method, seed=5), _build(method, seed=5)
    pa, ca = first.compress(xg.clone(), key=3)
    pb, _ = again.compress(xg.clone(), key=3)
    for part_a, part_b in zip(pa, pb, strict=True):
        assert part_a.device.type == "cuda"
        assert torch.equal(part_a, part_b), f"{method}: the same seed drew different codes"
    cpu_codes, _ = _build(method, seed=5).compress(x.clone(), key=3)
    # drawn by CUDA's generator, not the CPU's stream copied over (what the codec did before)
    assert not torch.equal(pa[0].cpu(), cpu_codes[0]), f"{method}: the CPU's draws"
    _valid(method, xg, first.decompress(pa, ca))
    errors = {}
    for device in ("cpu", "cuda"):
        comp, xd = _build(method, seed=1), x.to(device)
        total = torch.zeros_like(xd)
        for _ in range(200):
            payload, ctx = comp.compress(xd.clone(), key=0)
            total += comp.decompress(payload, ctx)
        errors[device] = float((total / 200 - xd).norm() / xd.norm())
    assert errors["cpu"] < 0.15, errors  # natural 0.02, ternary 0.10, int8 0.0014 (CPU, measured)
    assert errors["cuda"] < 1.5 * errors["cpu"], errors


def test_int8_zero_block_codec_on_cuda_matches_cpu():
    from torsh_distributed.parallel._quantized_zero import (
        block_amax,
        block_dequantize,
        block_ids,
        block_quantize,
    )

    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 3000, generator=g)
    ids, num = block_ids([1000, 7, 1993], 256)
    codes, scale = block_quantize(rows, ids, num)
    codes_g, scale_g = block_quantize(rows.cuda(), ids.cuda(), num)
    views = block_amax(rows.cuda(), [1000, 7, 1993], 256)  # reshaped amax = the scatter's
    assert torch.equal((views / 127.0).clamp_min(torch.finfo(torch.float32).tiny), scale_g)
    # CUDA divides by the scalar 127 as a multiplication by its reciprocal: scales within an ulp
    torch.testing.assert_close(scale_g.cpu(), scale, rtol=2e-7, atol=0)
    assert float((codes_g.cpu().int() - codes.int()).abs().max()) <= 1
    back = block_dequantize(codes_g, scale_g, ids.cuda())
    torch.testing.assert_close(back.cpu(), block_dequantize(codes, scale, ids))


def test_onebit_layout_and_codec_on_cuda():
    from torsh_distributed.compression._onebit import FlatLayout, _decode_signs

    tensors = [torch.randn(300), torch.randn(7), torch.randn(1000)]
    layouts = {d: FlatLayout([t.numel() for t in tensors], block=256, world_size=2, device=d)
               for d in ("cpu", "cuda")}
    flats = {d: layouts[d].flatten([t.to(d) for t in tensors]) for d in layouts}
    assert flats["cuda"].device.type == "cuda" and layouts["cuda"].mask.device.type == "cuda"
    torch.testing.assert_close(flats["cuda"].cpu(), flats["cpu"])
    decoded = {}
    for d, lay in layouts.items():
        x = flats[d]
        scales = (x.abs() * lay.mask).view(-1, lay.block).sum(dim=1) / lay.counts
        decoded[d] = _decode_signs(x >= 0, scales, lay.block) * lay.mask
    torch.testing.assert_close(decoded["cuda"].cpu(), decoded["cpu"])


def _ddp_hooks(method: str, device: str) -> list[float]:
    import torch.distributed as dist

    from torsh_distributed.compression import register_compression
    from torsh_distributed.parallel import apply_ddp
    from torsh_distributed.testing.models import TinyLM, token_data

    dev = torch.device(device)
    torch.manual_seed(0)
    model = TinyLM(d_model=64).to(dev)
    ddp = apply_ddp(model)
    hook = register_compression(ddp, method)
    assert hook is not None  # can fail: register_compression returns None for one rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = token_data(n=64)
    rank = dist.get_rank()
    losses = []
    for step in range(6):
        idx = [(step * 8 + rank * 4 + i) % len(data) for i in range(4)]
        x = torch.stack([data[i][0] for i in idx]).to(dev)
        y = torch.stack([data[i][1] for i in idx]).to(dev)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("method", ["int8", "powersgd:2", "topk:0.1"])
def test_ddp_compression_hooks_on_cuda_over_gloo(method: str):
    """Two ranks on the one GPU, Gloo carrying CUDA tensors: DDP's reducer and our hook run on
    CUDA buckets; the losses follow the same run on the CPU."""
    gpu = run_distributed(_ddp_hooks, 2, args=(method, "cuda:0"), backend="gloo", timeout=240)
    cpu = run_distributed(_ddp_hooks, 2, args=(method, "cpu"), backend="gloo", timeout=240)
    for g_losses, c_losses in zip(gpu, cpu, strict=True):
        assert g_losses == pytest.approx(c_losses, rel=2e-3)
    assert gpu[0][-1] < gpu[0][0]
