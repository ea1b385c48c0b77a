"""Memory and step-time formulas of one parallel layout (the strategy planner's machinery).

Torch-free arithmetic. Every formula is documented in docs/planner.md; the short version:

* memory per device = model states (ZeRO formulas of :mod:`.memory` over the data-parallel
  ranks, after dividing the parameters by ``tp * pp``) + activations (Korthikanti et al. 2022's
  per-layer count: ``4h`` elements replicated over tp, ``12h/tp`` sharded, plus the attention
  scores unless flash attention) of the micro-batches a 1F1B stage holds + transients;
* step time = compute (``6 N + 12 L s h`` FLOPs per token, 8/6 of it with recomputation) +
  tensor-parallel all-reduces + expert all-to-alls + pipeline sends + bubble + data-parallel
  gradient exchange + optimizer step, none of it overlapped.

With a :class:`~torsh_distributed.plan.profile.Profile` (``cfg.profile``) each term it covers is
taken from measurements instead: compute = the profiled block time x layers per stage + the
profiled non-block parts, per micro-batch (at tp > 1 the block's all-reduces are inside it, so
``tp_comm`` is 0); the pipeline's fill and drain at the profiled speed of a rank alone
(:meth:`Profile.solo_ratio`: ranks sharing cores run faster while stages idle); the optimizer
step = profiled seconds per parameter x the parameters a rank steps (on a pipeline stage at
tp 1, the engine's model-parallel clipping's rate); collectives = the profiled ``alpha + bytes
* beta`` of a group of the profiled size; ZeRO-2/3 on this package's FSDP2 (``layout="fsdp2"``, tp 1, a group of the profiled size) = the profiled time a
block and the root unit take under FSDP2 beyond the plain ones, per micro-batch (hooks, copies
and re-sharding with the collectives), instead of the raw collectives. Terms the profile lacks
keep the analytic formula (the optimizer's is then 0: not modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torsh_distributed.plan.memory import model_state_bytes, transient_bytes

if TYPE_CHECKING:
    from torsh_distributed.plan._strategy_config import StrategyConfig
    from torsh_distributed.plan.profile import Profile

__all__ = ["Layout", "Link", "Estimate", "estimate", "split_params"]

_BUCKET_BYTES = 25e6  # DDP's default bucket: one latency per bucket


@dataclass(frozen=True, slots=True)
class Layout:
    """One point of the search: degrees, ZeRO stage, micro-batching, recomputation."""

    dp: int
    tp: int
    pp: int
    ep: int
    stage: int
    micro_batch: int
    microbatches: int
    """Micro-batches per optimizer step per data-parallel replica (gradient accumulation steps,
    or the pipeline's micro-batches)."""
    recompute: bool


@dataclass(frozen=True, slots=True)
class Link:
    """The link a process group's collectives run over, as one group sees it."""

    alpha: float
    bandwidth: float
    kind: str
    """``intra`` or ``inter``."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted memory (bytes per device) and step time (seconds) by term."""

    memory: dict[str, float]
    time: dict[str, float]


def split_params(cfg: StrategyConfig) -> tuple[float, float, float]:
    """``(dense, expert, active)`` parameters: experts are ``8 h^2`` each (4h hidden) in every
    layer; active counts ``top_k`` experts per token."""
    if not cfg.experts:
        return cfg.params, 0.0, cfg.params
    per_expert = 8.0 * cfg.hidden**2
    expert = cfg.layers * cfg.experts * per_expert
    dense = cfg.params - expert
    return dense, expert, dense + cfg.layers * cfg.top_k * per_expert


def _link(cfg: StrategyConfig, size: int, stride: int) -> Link:
    """The link of a group of ``size`` ranks ``stride`` apart (ranks numbered node by node).

    Inside a node: the intra-node bandwidth. Across nodes: every group with members on a node
    runs the same collective at the same time, so the node's inter-node bandwidth is shared by
    ``per_node / k`` groups, ``k`` being this group's members per node.
    """
    per_node = cfg.devices // cfg.nodes
    if size * stride <= per_node:
        return Link(alpha=cfg.intra_latency, bandwidth=cfg.intra_bw, kind="intra")
    k = max(1, min(size, per_node // stride)) if stride < per_node else 1
    share = cfg.inter_bw * k / per_node
    return Link(alpha=cfg.inter_latency, bandwidth=min(cfg.intra_bw, share), kind="inter")


def _all_reduce(n: int, nbytes: float, link: Link, count: float = 1.0) -> float:
    """Ring all-reduce: ``2 (n-1)`` steps of ``nbytes / n``; ``count`` collectives' latencies."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (count * link.alpha + nbytes / n / link.bandwidth)


def _half(n: int, nbytes: float, link: Link, count: float = 1.0) -> float:
    """Ring reduce-scatter, all-gather or all-to-all: ``n - 1`` steps of ``nbytes / n``."""
    if n <= 1:
        return 0.0
    return (n - 1) * (count * link.alpha + nbytes / n / link.bandwidth)


def _act_bytes(cfg: StrategyConfig) -> int:
    return 4 if cfg.dtype == "fp32" else 2


def _layer_activation(cfg: StrategyConfig, tp: int, micro_batch: int) -> float:
    """Bytes one layer saves for backward for one micro-batch (no recomputation)."""
    h, a, s, act = cfg.hidden, cfg.heads, cfg.seq_len, _act_bytes(cfg)
    per_token = act * (4 * h + 4)  # norm inputs, QKV input, MLP input, norm statistics
    per_token += act * 12 * h / tp  # q, k, v, attention output, GELU input and output
    if cfg.flash_attention:
        per_token += act * a / tp  # log-sum-exp per head
    else:  # softmax output (+ dropout mask and output) of the a x s scores per token
        per_token += a * s / tp * (act + (1 + act if cfg.dropout else 0))
    if cfg.dropout:
        per_token += 2 * h  # attention-output and MLP-output dropout masks, 1 byte each
    return per_token * micro_batch * s


def _activations(cfg: StrategyConfig, lay: Layout) -> float:
    """Peak activation bytes on the busiest pipeline stage (first: micro-batches in flight;
    last: the logits)."""
    s, h, act = cfg.seq_len, cfg.hidden, _act_bytes(cfg)
    tokens = lay.micro_batch * s
    layers = -(-cfg.layers // lay.pp)
    full = _layer_activation(cfg, lay.tp, lay.micro_batch)
    per_layer = act * h * tokens if lay.recompute else full  # recomputation keeps the input
    extra = full if lay.recompute else 0.0  # one layer recomputed at a time in backward
    in_flight = min(lay.pp, lay.microbatches)  # 1F1B: the first stage holds pp micro-batches
    first = in_flight * layers * per_layer + extra + 16 * tokens
    outside = tokens * (act * (2 * h + 4 + cfg.vocab / lay.tp) + 16)  # final norm, logits, ids
    last = layers * per_layer + extra + outside
    return max(first, last) if lay.pp > 1 else first + outside - 16 * tokens


def _memory(cfg: StrategyConfig, lay: Layout) -> dict[str, float]:
    dense, expert, _ = split_params(cfg)
    local_dense = dense / (lay.tp * lay.pp)
    local_expert = expert / (lay.ep * lay.tp * lay.pp)
    layout = "fsdp2" if cfg.layout == "fsdp2" else "paper"
    opt = cfg.optimizer
    states = model_state_bytes(
        local_dense, lay.dp * lay.ep, lay.stage, dtype=cfg.dtype, optimizer=opt, layout=layout
    ).total
    if local_expert:
        states += model_state_bytes(
            local_expert, lay.dp, lay.stage, dtype=cfg.dtype, optimizer=opt, layout=layout
        ).total
    local = local_dense + local_expert
    unit = local / (-(-cfg.layers // lay.pp))  # one layer's parameters (embeddings ignored)
    acts = _activations(cfg, lay)
    work = _act_bytes(cfg)
    memory = {"model_states": float(states), "activations": acts, "transient": 0.0}
    if cfg.layout == "fsdp2":  # what this package's DDP/FSDP2 hold besides the states
        ddp = lay.tp == 1 and lay.pp == 1 and lay.dp * lay.ep > 1
        if lay.stage >= 2 or ddp:
            units = [round(unit)] * (-(-cfg.layers // lay.pp))
            memory["transient"] = float(
                transient_bytes(
                    lay.stage, num_params=local, unit_params=units, root_params=0, dtype=cfg.dtype
                )
            )
        stepped = local / (lay.dp * lay.ep) if lay.stage >= 1 else local
        # the optimizer's foreach temporary (one fp32 buffer of the local state) after backward
        memory["optimizer_temp"] = 4 * stepped if opt != "sgd-plain" else 0.0
        peak = states + memory["transient"] + max(acts, memory["optimizer_temp"])
    else:
        if lay.stage == 3:  # the running and the prefetched layer, gathered
            memory["transient"] = 2 * unit * work
        peak = states + memory["transient"] + acts
    memory["reserve"] = cfg.reserve
    memory["total"] = peak + cfg.reserve
    return memory


def _time(cfg: StrategyConfig, lay: Layout) -> dict[str, float]:
    dense, expert, active = split_params(cfg)
    prof = cfg.profile
    s, h, act = cfg.seq_len, cfg.hidden, _act_bytes(cfg)
    layers = -(-cfg.layers // lay.pp)
    m = lay.microbatches
    micro_bytes = lay.micro_batch * s * h * act
    passes = 6 if lay.recompute else 4  # all-reduces per layer: 2 forward, 2 backward (+2)
    tp_link = _link(cfg, lay.tp, 1)
    measured = _profiled_compute(cfg, lay, prof) if prof is not None else None
    if measured is not None:  # the profiled block holds its tensor-parallel all-reduces
        compute, tp = measured, 0.0
    else:
        tokens = cfg.global_batch * s
        flops = tokens * (6 * active + 12 * cfg.layers * s * h)
        if lay.recompute:
            flops *= 8 / 6  # one more forward
        compute = flops / cfg.devices / cfg.device_flops
        tp = m * layers * passes * _all_reduce(lay.tp, micro_bytes, tp_link)
    ep = 0.0
    if lay.ep > 1:
        ep_link = _link(cfg, lay.ep, lay.tp)
        ep = m * layers * passes * _half(lay.ep, micro_bytes * cfg.top_k, ep_link)
    p2p = 0.0
    if lay.pp > 1:
        pp_link = _link(cfg, lay.pp, lay.tp * lay.ep * lay.dp)
        sent = micro_bytes / lay.tp if cfg.pp_scatter_gather else micro_bytes
        fit = prof.collective("p2p", 2) if prof is not None and pp_link.kind == "intra" else None
        if fit is not None:
            p2p = fit.time(2 * m * sent, 2 * m)
        else:
            p2p = 2 * m * (pp_link.alpha + sent / pp_link.bandwidth)
        if cfg.pp_scatter_gather and lay.tp > 1:  # the all-gather on the receiving side
            p2p += 2 * m * _half(lay.tp, micro_bytes, tp_link)
    bubble = (lay.pp - 1) / m * (compute + tp + ep)  # (pp-1) idle micro-batch slots
    if measured is not None and lay.pp > 1:
        # Of the (m + pp - 1) slots, 2 (pp - 1) (fill and drain) run with stages idle; where
        # ranks share cores those run at the profiled speed of a rank alone (ratio r): the
        # step is (m - pp + 1) busy slots + 2 (pp - 1) r = m + (pp - 1)(2 r - 1) busy slots.
        bubble *= 2 * prof.solo_ratio(lay.tp, lay.micro_batch) - 1  # type: ignore[union-attr]
    dp = _dp_time(
        cfg, lay, dense / (lay.tp * lay.pp), lay.dp * lay.ep, _link(cfg, lay.dp * lay.ep, lay.tp)
    )
    if expert:
        dp += _dp_time(
            cfg,
            lay,
            expert / (lay.ep * lay.tp * lay.pp),
            lay.dp,
            _link(cfg, lay.dp, lay.tp * lay.ep),
        )
    optimizer = 0.0
    if prof is not None:
        stepped = dense / (lay.tp * lay.pp) / (lay.dp * lay.ep if lay.stage >= 1 else 1)
        stepped += expert / (lay.ep * lay.tp * lay.pp) / (lay.dp if lay.stage >= 1 else 1)
        optimizer = (
            prof.optimizer_time(lay.tp, stepped, sharded=lay.stage >= 2, pipeline=lay.pp > 1) or 0.0
        )
    times = {
        "compute": compute,
        "tp_comm": tp,
        "ep_comm": ep,
        "pp_comm": p2p,
        "bubble": bubble,
        "dp_comm": dp,
        "optimizer": optimizer,
    }
    times["total"] = sum(times.values())
    return times


def _profiled_compute(cfg: StrategyConfig, lay: Layout, prof: Profile) -> float | None:
    """Busy time of the slowest pipeline stage from the profile (``None``: tp not profiled, or
    a MoE model, whose expert layers are not profiled). The non-block parts are all charged to
    one stage (the last: the head and loss dominate them)."""
    block = prof.block_time(lay.tp, lay.micro_batch)
    outside = prof.outside_time(lay.tp, lay.micro_batch)
    if block is None or outside is None or cfg.experts:
        return None
    if lay.recompute:
        block *= 4 / 3  # one more forward of a forward + backward of 3 forwards' work
    return lay.microbatches * (-(-cfg.layers // lay.pp) * block + outside)


def _dp_time(cfg: StrategyConfig, lay: Layout, params: float, n: int, link: Link) -> float:
    """Gradient exchange (and ZeRO-3's parameter gathers) of one step over ``n`` ranks.

    ``paper`` layout (ZeRO paper, DeepSpeed): stages 0-1 all-reduce once per step; stages 2-3
    reduce-scatter every micro-batch's gradients, stage 2 all-gathers the updated parameters
    once, stage 3 all-gathers them in every micro-batch's forward and backward (1.5x DP at one
    micro-batch). ``fsdp2`` (this package): gradients are accumulated unsharded and
    reduce-scattered once; stage 2 gathers once per micro-batch, stage 3 twice.
    """
    if n <= 1:
        return 0.0
    m = lay.microbatches
    grad = 4 if cfg.dtype == "fp32" or cfg.layout == "fsdp2" else 2
    param = _act_bytes(cfg)
    units = -(-cfg.layers // lay.pp) + 1  # one collective per layer (and the root) for stages 2-3
    prof = cfg.profile if link.kind == "intra" else None  # profiled on one machine
    if lay.stage <= 1:
        # this package's DDP: 25 MB buckets; the paper layout: one collective per layer, as
        # for stages 2-3, so that the stages differ only in bytes
        count = math.ceil(params * grad / _BUCKET_BYTES) if cfg.layout == "fsdp2" else units
        fit = prof.collective("all_reduce", n) if prof is not None else None
        if fit is not None:
            return fit.time(params * grad, max(1, count))
        return _all_reduce(n, params * grad, link, max(1, count))
    if cfg.layout == "fsdp2":
        scatters, gathers = 1, m if lay.stage == 2 else 2 * m
    else:
        scatters, gathers = m, 1 if lay.stage == 2 else 2 * m
    scatter = prof.collective("reduce_scatter", n) if prof is not None else None
    gather = prof.collective("all_gather", n) if prof is not None else None
    scatter_s = (
        scatter.time(params * grad, units) if scatter else _half(n, params * grad, link, units)
    )
    gather_s = (
        gather.time(params * param, units) if gather else _half(n, params * param, link, units)
    )
    measured = _fsdp_measured(cfg, lay, n, prof)
    if measured is not None:
        block, root = measured
        per_micro_batch = -(-cfg.layers // lay.pp) * block + root
        return max(0.0, m * per_micro_batch - (m - 1) * scatter_s)
    return scatters * scatter_s + gathers * gather_s


def _fsdp_measured(
    cfg: StrategyConfig, lay: Layout, n: int, prof: Profile | None
) -> tuple[float, float] | None:
    """The profiled FSDP2 ``(per block, root)`` overhead where it applies: this package's
    layout, tp 1 (the profiled blocks' parameters), a dense model, a group of the profiled
    size inside a node; else ``None``."""
    if prof is None or cfg.layout != "fsdp2" or lay.tp != 1 or cfg.experts or n != prof.ranks:
        return None
    return prof.fsdp_overhead(lay.stage, lay.micro_batch)


def estimate(cfg: StrategyConfig, lay: Layout) -> Estimate:
    """Memory and time of ``lay`` under ``cfg``."""
    return Estimate(memory=_memory(cfg, lay), time=_time(cfg, lay))
