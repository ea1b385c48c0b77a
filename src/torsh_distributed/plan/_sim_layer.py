"""Per-micro-batch costs of one transformer layer (and the logits) on one device.

A GPT layer as Megatron-LM runs it, tensor-parallel over ``tp`` ranks (Shoeybi et al. 2019):
layer norm, QKV GEMM, attention core (two batched GEMMs and a fused softmax + dropout, or one
flash kernel), output projection, all-reduce, dropout + residual, layer norm, FC1 + GELU, FC2,
all-reduce, dropout + residual. Backward: two GEMMs per forward GEMM (input and weight
gradients), twice the element-wise bytes, two all-reduces. With sequence parallelism
(Korthikanti et al. 2022) each all-reduce becomes a reduce-scatter + all-gather (same ring bytes)
and the norms, dropouts and residuals run on ``1/tp`` of the tokens. The tp collectives block
the compute stream (Megatron-LM 2021 does not overlap them); their seconds are kept apart for
the breakdown. Recomputation: ``full`` reruns the layer's forward (collectives included) before
its backward; ``selective`` reruns only the attention core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torsh_distributed.plan._sim_device import DeviceModel
    from torsh_distributed.plan._sim_layout import SimLayout
    from torsh_distributed.plan._sim_network import Network
    from torsh_distributed.plan._strategy_config import StrategyConfig

__all__ = ["LayerCost", "layer_cost", "logits_cost", "layer_flops", "logits_flops"]


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Seconds of one layer for one micro-batch on one device."""

    forward: float
    """Forward compute (kernels only)."""
    backward: float
    """Backward compute, recomputation included."""
    forward_comm: float
    """Blocking tp (and ep) collectives of the forward."""
    backward_comm: float
    """Blocking tp (and ep) collectives of the backward, the recomputed forward's included."""

    @property
    def f(self) -> float:
        return self.forward + self.forward_comm

    @property
    def b(self) -> float:
        return self.backward + self.backward_comm


def layer_flops(cfg: StrategyConfig, lay: SimLayout, ffn: int, tokens: float) -> float:
    """Forward FLOPs of one layer for ``tokens`` tokens, Megatron's count (Narayanan et al. 2021,
    eq. 3: ``24 h^2 (1 + s / 6h)`` per token at ``ffn = 4h``, full (not causal-halved) attention
    scores); the MLP scales with ``ffn`` (x 1.5 gated), QKV with the key/value heads; with
    experts, ``top_k`` MLPs per token."""
    h, s = cfg.hidden, cfg.seq_len
    kv = lay.kv_heads or cfg.heads
    qkv = 2.0 * h * (h + 2 * kv * (h // cfg.heads))
    mlp = 2.0 * h * ffn * (3 if lay.gated_mlp else 2) * (cfg.top_k if cfg.experts else 1)
    return tokens * (qkv + 2.0 * h * h + mlp + 4.0 * s * h)


def logits_flops(cfg: StrategyConfig, tokens: float) -> float:
    """Forward FLOPs of the logits GEMM (``2 h V`` per token)."""
    return tokens * 2.0 * cfg.hidden * cfg.vocab


def _attention(
    cfg: StrategyConfig, lay: SimLayout, dev: DeviceModel, act: int
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one micro-batch on one device."""
    b, s, h = lay.micro_batch, cfg.seq_len, cfg.hidden
    heads = cfg.heads / lay.tp
    d = h // cfg.heads
    if cfg.flash_attention:
        # causal: half of the 4 s^2 d FLOPs per head are masked out; backward 2.5x forward
        # (FlashAttention-2) or as measured
        fwd = dev.flash(b * heads * 2.0 * s * s * d)
        return fwd, dev.flash_backward * fwd
    scores = b * heads * s * s
    qk = dev.gemm(s, s, d, batch=b * heads, dtype_bytes=act)
    av = dev.gemm(s, d, s, batch=b * heads, dtype_bytes=act)
    # fused scale + mask + softmax (read, write), dropout (read, write, 1-byte mask)
    soft_f = dev.elementwise(scores * (2 * act + (2 * act + 1 if cfg.dropout else 0)))
    soft_b = dev.elementwise(scores * (3 * act + (2 * act + 1 if cfg.dropout else 0)))
    qk_b = dev.gemm(s, d, s, batch=b * heads, dtype_bytes=act) * 2
    av_b = dev.gemm(s, s, d, batch=b * heads, dtype_bytes=act) + dev.gemm(
        s, d, s, batch=b * heads, dtype_bytes=act
    )
    return qk + soft_f + av, qk_b + soft_b + av_b


def _gemm_fb(dev: DeviceModel, m: float, n: float, k: float, act: int) -> tuple[float, float]:
    """(forward, backward) of ``y = x W``, ``x: m x k``, ``W: k x n``: backward is
    ``dx = dy W^T`` (m x n x k -> m x k) and ``dW = x^T dy`` (k x m x n)."""
    fwd = dev.gemm(m, n, k, dtype_bytes=act)
    bwd = dev.gemm(m, k, n, dtype_bytes=act) + dev.gemm(k, n, m, dtype_bytes=act)
    return fwd, bwd


def layer_cost(
    cfg: StrategyConfig, lay: SimLayout, dev: DeviceModel, net: Network, ffn: int
) -> LayerCost:
    """Costs of one layer for one micro-batch (see the module docstring)."""
    act = 4 if cfg.dtype == "fp32" else 2
    b, s, h, t = lay.micro_batch, cfg.seq_len, cfg.hidden, lay.tp
    tokens = b * s
    local = tokens / t if lay.sequence_parallel else tokens  # tokens of norms/dropout/residual
    gemms_f = gemms_b = 0.0
    kv = lay.kv_heads or cfg.heads
    qkv = (h + 2 * kv * (h // cfg.heads)) / t
    for n, k in ((qkv, h), (h, h / t)):  # QKV, output projection
        f, bw = _gemm_fb(dev, tokens, n, k, act)
        gemms_f, gemms_b = gemms_f + f, gemms_b + bw
    mlp_tokens = tokens * (cfg.top_k if cfg.experts else 1)
    up = 2 * ffn if lay.gated_mlp else ffn
    for n, k in ((up / t, h), (h, ffn / t)):  # FC1 (gate + up), FC2 (experts: top_k copies)
        f, bw = _gemm_fb(dev, mlp_tokens, n, k, act)
        gemms_f, gemms_b = gemms_f + f, gemms_b + bw
    attn_f, attn_b = _attention(cfg, lay, dev, act)
    mask = 1 if cfg.dropout else 0
    # 2 norms (read, write), 2 dropout + residual (read 2, write 1, mask), GELU on ffn/t (read,
    # write) or SwiGLU (read 2, write 1)
    gelu = (3 if lay.gated_mlp else 2) * act
    elem = local * h * (2 * 2 * act + 2 * (3 * act + mask)) + mlp_tokens * ffn / t * gelu
    fwd = gemms_f + attn_f + dev.elementwise(elem)
    bwd = gemms_b + attn_b + dev.elementwise(2 * elem)
    comm = 0.0
    if t > 1:  # 2 all-reduces (or RS + AG pairs of the same ring bytes) per pass
        nbytes = tokens * h * act
        if lay.sequence_parallel:
            one = net.collective("reduce_scatter", nbytes, t, 1) + net.collective(
                "all_gather", nbytes, t, 1
            )
        else:
            one = net.collective("all_reduce", nbytes, t, 1)
        comm = 2 * one
    if cfg.experts and lay.ep > 1:  # dispatch and combine all-to-alls per pass
        comm += 2 * net.collective("all_to_all", mlp_tokens * h * act, lay.ep, t)
    back_comm = comm
    if lay.recompute == "full":
        bwd += fwd
        back_comm += comm
    elif lay.recompute == "selective":
        bwd += attn_f
    return LayerCost(forward=fwd, backward=bwd, forward_comm=comm, backward_comm=back_comm)


def logits_cost(cfg: StrategyConfig, lay: SimLayout, dev: DeviceModel) -> tuple[float, float]:
    """(forward, backward) seconds of the final norm, the vocabulary-parallel logits GEMM and the
    cross-entropy (softmax over ``V / tp`` logits per token) on the last pipeline stage."""
    act = 4 if cfg.dtype == "fp32" else 2
    tokens = lay.micro_batch * cfg.seq_len
    f, bw = _gemm_fb(dev, tokens, cfg.vocab / lay.tp, cfg.hidden, act)
    loss = dev.elementwise(tokens * cfg.vocab / lay.tp * (act + 4))  # logits read, fp32 softmax
    norm = dev.elementwise(tokens * cfg.hidden * 2 * act)
    return f + loss + norm, bw + 2 * loss + 2 * norm
