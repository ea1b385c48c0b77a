"""Step simulator: what one training step of a given layout takes, event by event.

:func:`simulate` plays one optimizer step of a pinned layout (dp, tp, pp, ep; ZeRO stage;
micro-batch and count; GPipe, 1F1B, interleaved 1F1B or DeepSpeed's pipeline engine;
recomputation; sequence parallelism;
DDP buckets with or without overlap; ZeRO-3 gathers with or without prefetch) on one
representative device per pipeline rank (data-parallel replicas and tp ranks are symmetric):

* per-layer kernel costs from a device model (:mod:`._sim_device`: roofline with tile and wave
  quantisation; two efficiencies fitted on published runs), the tp/ep collectives blocking the
  compute stream (:mod:`._sim_layer`);
* the pipeline schedule played by an event engine (:mod:`._sim_schedule`), sends between ranks
  over the network model (:mod:`._sim_network`: the alpha-beta rings of
  :mod:`torsh_distributed.comm.cost_model` on intra-node links and shared NICs);
* per rank a communication stream: gradient buckets (all-reduce, or reduce-scatter from ZeRO-1
  on), overlapped with the last backward when ``dp_overlap``; ZeRO-2's reduce-scatter per
  micro-batch; ZeRO-3's per-layer parameter gathers in forward and backward (prefetched one
  layer ahead with ``fsdp_prefetch``) and per-layer reduce-scatters; the optimizer step
  (memory-bound Adam) after the gradients, then the parameter all-gather of ZeRO-1/2.

The step ends when the slowest rank has stepped. Memory per device is the strategy planner's
(:func:`torsh_distributed.plan._cost.estimate`: :func:`~.memory.model_state_bytes` and
Korthikanti et al.'s activations), scaled for sequence parallelism, selective recomputation and
the interleaved schedule's extra micro-batches in flight. FLOPs are Megatron-LM's count
(Narayanan et al. 2021, eq. 3: layers ``24 h^2 (1 + s/6h)`` per token and pass, logits ``2 h V``;
three passes, four with full recomputation) for ``tflops_per_device``; ``mfu`` uses the model
FLOPs (three passes, no recomputation) against the device's peak.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torsh_distributed.plan._cost import Layout, _layer_activation, estimate, split_params
from torsh_distributed.plan._sim_device import DeviceModel, device_model
from torsh_distributed.plan._sim_layer import layer_cost, layer_flops, logits_cost, logits_flops
from torsh_distributed.plan._sim_layout import RECOMPUTE, SimLayout
from torsh_distributed.plan._sim_network import Network
from torsh_distributed.plan._sim_schedule import (
    Pass,
    critical_path,
    held_layers,
    order,
    play,
    play_deepspeed,
)
from torsh_distributed.plan.memory import bytes_per_param

if TYPE_CHECKING:
    from torsh_distributed.plan._strategy_config import StrategyConfig
    from torsh_distributed.plan.strategy import Candidate, StrategyPlan

__all__ = [
    "RECOMPUTE",
    "SimLayout",
    "SimResult",
    "interleave_choices",
    "rank_by_simulation",
    "simulate",
    "split_layers",
]


@dataclass(slots=True)
class SimResult:
    """What one simulated step takes and holds."""

    layout: SimLayout
    dp: int
    microbatches: int
    step_s: float
    flops: float
    """Megatron-LM's FLOP count of the step (recomputed forward included with full recomputation)."""
    model_flops: float
    """FLOPs of the model without recomputation (three passes)."""
    devices: int
    peak_flops: float
    memory: dict[str, float]
    breakdown: dict[str, float]
    """Seconds on the slowest rank: compute, tp/ep comm, send wait and idle (bubble), exposed dp
    comm, optimizer, parameter all-gather."""
    path: list[dict[str, Any]]
    """The critical path, first to last: ``{"what", "rank", "start", "end"}``."""
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.step_s / self.devices / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.devices / self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "step_s": self.step_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "memory_per_device_gb": self.memory["total"] / 1e9,
            "layout": {
                "dp": self.dp,
                "tp": lay.tp,
                "pp": lay.pp,
                "ep": lay.ep,
                "zero_stage": lay.zero_stage,
                "micro_batch": lay.micro_batch,
                "microbatches": self.microbatches,
                "schedule": lay.schedule,
                "interleave": lay.interleave,
                "recompute": lay.recompute,
                "sequence_parallel": lay.sequence_parallel,
                "dp_overlap": lay.dp_overlap,
            },
            "flops_per_step": self.flops,
            "flop_count": "Megatron-LM (Narayanan et al. 2021, eq. 3); recomputed forward counted",
            "memory_bytes": self.memory,
            "breakdown_s": self.breakdown,
            "critical_path": _summarise(self.path),
        }

    def write_trace(self, path: str) -> None:
        """A Chrome trace (chrome://tracing, Perfetto) of the step: per pipeline rank a compute
        and a communication lane."""
        meta = [
            {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pipeline rank {r}"}}
            for r in range(self.layout.pp)
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)


def _summarise(path: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds of the critical path by kind, and its entries run-length merged."""
    by_kind: dict[str, float] = {}
    merged: list[dict[str, Any]] = []
    for entry in path:
        kind = entry["kind"]
        by_kind[kind] = by_kind.get(kind, 0.0) + entry["end"] - entry["start"]
        if merged and merged[-1]["kind"] == kind and merged[-1]["rank"] == entry["rank"]:
            merged[-1]["count"] += 1
            merged[-1]["end"] = entry["end"]
        else:
            merged.append({**entry, "count": 1})
    return {"seconds_by_kind": by_kind, "segments": merged}


def _check(cfg: StrategyConfig, lay: SimLayout) -> tuple[int, int]:
    """``(dp, microbatches)``; ``ValueError`` naming the flag for a layout that cannot run."""
    model = lay.tp * lay.pp * lay.ep
    if cfg.devices % model:
        raise ValueError(f"--tp x --pp x --ep = {model} does not divide --devices {cfg.devices}")
    dp = cfg.devices // model
    per_node = cfg.devices_per_node
    if per_node % lay.tp or cfg.heads % lay.tp:
        raise ValueError(
            f"--tp {lay.tp} must divide the {per_node} devices per node and --heads {cfg.heads}"
        )
    if cfg.layers < lay.pp:
        raise ValueError(f"--pp {lay.pp} exceeds --layers {cfg.layers}")
    # interleaved, the first and last chunk may hold only the embedding and the head (Llama 3,
    # section 3.3.2: one layer fewer on the first and last stage leaves those chunks empty)
    if lay.interleave > 1 and cfg.layers < lay.pp * lay.interleave - 2:
        raise ValueError(
            f"--pp x --interleave = {lay.pp * lay.interleave} exceeds --layers {cfg.layers} + 2 "
            "(only the first and last chunk may hold no layers)"
        )
    if lay.kv_heads and (cfg.heads % lay.kv_heads or lay.kv_heads % lay.tp):
        raise ValueError(
            f"--kv-heads {lay.kv_heads} must divide --heads {cfg.heads} and be divisible by --tp"
        )
    if lay.ep > 1 and (not cfg.experts or cfg.experts % lay.ep):
        raise ValueError(f"--ep {lay.ep} needs --experts divisible by it (got {cfg.experts})")
    replicas = dp * lay.ep
    if cfg.global_batch % (replicas * lay.micro_batch):
        raise ValueError(
            f"--global-batch {cfg.global_batch} is not divisible by dp x ep x --micro-batch "
            f"= {replicas} x {lay.micro_batch}"
        )
    m = cfg.global_batch // (replicas * lay.micro_batch)
    if lay.schedule == "interleaved" and m % lay.pp:
        raise ValueError(
            f"--interleave needs the micro-batches per step ({m}) to be a multiple of --pp {lay.pp}"
        )
    if lay.zero_stage and replicas == 1:
        raise ValueError("--zero-stage > 0 needs data parallelism (dp x ep > 1)")
    return dp, m


def _memory(cfg: StrategyConfig, lay: SimLayout, dp: int, m: int) -> dict[str, float]:
    """The planner's memory (``_cost``), its activations scaled for what it does not model:
    sequence parallelism (the ``4h`` replicated elements per token sharded), selective
    recomputation (no attention scores kept) and interleaving: the busiest rank holds the layers
    of up to ``2 (p - 1) + (v - 1) p + 1`` chunk-micro-batches instead of ``p`` stage-micro-batches,
    counted by walking the schedule with each chunk's own layers (:func:`held_layers`: an empty
    first or last chunk holds none)."""
    base = Layout(
        dp=dp,
        tp=lay.tp,
        pp=lay.pp,
        ep=lay.ep,
        stage=lay.zero_stage,
        micro_batch=lay.micro_batch,
        microbatches=m,
        recompute=lay.recompute == "full",
    )
    mem = dict(estimate(cfg, base).memory)
    if lay.recompute != "full":
        full = _layer_activation(cfg, lay.tp, lay.micro_batch)
        kept = full
        tokens = lay.micro_batch * cfg.seq_len
        act = 4 if cfg.dtype == "fp32" else 2
        if lay.sequence_parallel and lay.tp > 1:
            kept -= act * 4 * cfg.hidden * (1 - 1 / lay.tp) * tokens
        if lay.recompute == "selective" and not cfg.flash_attention:
            per = act + (1 + act if cfg.dropout else 0)
            kept -= cfg.heads * cfg.seq_len / lay.tp * per * tokens
        mem["activations"] *= kept / full
    if lay.schedule == "interleaved" and lay.pp > 1:
        p, v = lay.pp, lay.interleave
        # from the second group of p micro-batches on the held layers repeat: 2 p of them say it
        walk = order("interleaved", p=p, m=min(m, 2 * p), v=v)
        held = held_layers(walk, split_layers(cfg.layers, p * v))
        mem["activations"] *= held / -(-cfg.layers // p) / min(p, m)  # the planner's stage count
    parts = ("model_states", "transient", "activations", "reserve")
    peak = sum(mem[k] for k in parts)
    if cfg.layout == "fsdp2":
        peak += max(0.0, mem.get("optimizer_temp", 0.0) - mem["activations"])
    mem["total"] = peak
    return mem


def simulate(
    cfg: StrategyConfig,
    lay: SimLayout,
    *,
    device: DeviceModel | None = None,
    trace: bool = False,
) -> SimResult:
    """Simulate one optimizer step of ``lay`` on ``cfg``'s model and cluster (module docstring).

    Args:
        cfg: Model, cluster and batch (``plan strategy``'s inputs); its ``device`` picks the
            device model, its bandwidths and latencies the network.
        lay: The layout and how it runs.
        device: A device model to use instead of ``cfg.device``'s calibrated one.
        trace: Keep every kernel-level event for :meth:`SimResult.write_trace` (costs memory on
            thousands of micro-batches).
    """
    dp, m = _check(cfg, lay)
    dev = device or device_model(cfg.device)
    net = Network(
        cfg, topology=lay.topology, oversubscription=lay.oversubscription, backend=lay.backend
    )
    ffn = lay.ffn_hidden or 4 * cfg.hidden
    p, v = lay.pp, lay.interleave
    counts = split_layers(cfg.layers, p * v)
    cost = layer_cost(cfg, lay, dev, net, ffn)
    head_f, head_b = logits_cost(cfg, lay, dev)
    act = 4 if cfg.dtype == "fp32" else 2
    dense, expert, _ = split_params(cfg)
    dense_local, expert_local = dense / (lay.tp * p), expert / (lay.ep * lay.tp * p)
    local = dense_local + expert_local
    p_bytes, g_bytes, k_bytes = bytes_per_param(cfg.dtype, cfg.optimizer)
    replicas = dp * lay.ep
    layer_params = local / (cfg.layers // p)
    events: list[dict[str, Any]] = []
    comm_free = [0.0] * p

    def comm(r: int, name: str, ready: float, seconds: float) -> float:
        start = max(comm_free[r], ready)
        comm_free[r] = start + seconds
        if trace and seconds > 0:
            events.append(_event(name, r, "comm", start, seconds))
        return comm_free[r]

    def run(ps: Pass, start: float) -> float:
        forward = ps.kind == "F"
        last = ps.chunk * p + ps.rank == p * v - 1
        layer_s = cost.f if forward else cost.b
        zero3 = lay.zero_stage == 3 and replicas > 1
        gather = (
            net.collective("all_gather", layer_params * act, replicas, lay.tp) if zero3 else 0.0
        )
        scatter = net.collective("reduce_scatter", layer_params * g_bytes, replicas, lay.tp)
        t = start
        if zero3 and not dev.streams:  # no streams: each gather and reduce-scatter blocks
            return _blocking(ps, counts[ps.chunk * p + ps.rank], start, gather, scatter, last)
        ready = comm(ps.rank, "all-gather params", start, gather) if zero3 else start
        per_chunk = counts[ps.chunk * p + ps.rank]
        for i in range(per_chunk):
            layer_start = max(t, ready)
            more = zero3 and i + 1 < per_chunk
            if more and lay.fsdp_prefetch:  # the next layer's gather runs under this layer
                ready = comm(ps.rank, "all-gather params", layer_start, gather)
            t = layer_start + layer_s
            if zero3 and not forward:
                comm(ps.rank, "reduce-scatter grads", t, scatter)
            if more and not lay.fsdp_prefetch:
                ready = comm(ps.rank, "all-gather params", t, gather)
        if last:
            t += head_f if forward else head_b
        if not forward and lay.zero_stage == 2:
            nbytes = local / v * g_bytes
            comm(
                ps.rank,
                "reduce-scatter grads",
                t,
                net.collective("reduce_scatter", nbytes, replicas, lay.tp),
            )
        if trace:
            events.append(
                _event(f"{ps.kind} mb{ps.mb} c{ps.chunk}", ps.rank, "compute", start, t - start)
            )
        return t

    def _blocking(
        ps: Pass, layers: int, start: float, gather: float, scatter: float, last: bool
    ) -> float:
        forward = ps.kind == "F"
        layer_s = (cost.f if forward else cost.b) + gather + (0.0 if forward else scatter)
        layer_s += dev.fsdp_forward_s if forward else dev.fsdp_backward_s  # measured, CPU
        t = start + layers * layer_s
        if last:
            t += head_f if forward else head_b
        if trace:
            events.append(
                _event(f"{ps.kind} mb{ps.mb} c{ps.chunk}", ps.rank, "compute", start, t - start)
            )
        return t

    sent = lay.micro_batch * cfg.seq_len * cfg.hidden * act
    if lay.sequence_parallel or cfg.pp_scatter_gather:
        sent /= lay.tp
    stride = lay.tp * lay.ep * dp

    def send(dep: Pass) -> float:
        seconds = net.p2p(sent, stride)
        if trace:
            events.append(_event(f"send {dep.kind} mb{dep.mb}", dep.rank, "p2p", dep.end, seconds))
        return seconds

    if lay.schedule == "deepspeed":
        passes = play_deepspeed(p=p, m=m, run=run, send=send)
    else:
        passes = play(order(lay.schedule, p=p, m=m, v=v), v=v, run=run, send=send)
    ends: list[float] = []
    tails: list[list[dict[str, Any]]] = []
    exposed: list[float] = []
    opt_params = local / (replicas if lay.zero_stage else 1)
    opt_s = dev.optimizer(opt_params, opt_params * (2 * k_bytes + g_bytes + p_bytes))
    if lay.zero_stage == 3 and replicas > 1 and not dev.streams:  # DTensor shards' step, measured
        opt_s += dev.fsdp_optimizer_s * max(
            sum(counts[c * p + r] for c in range(v)) for r in range(p)
        )
    for r in range(p):
        compute_end = passes[r][-1].end
        tail: list[dict[str, Any]] = []
        if lay.zero_stage <= 1 and replicas > 1:
            op = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
            lasts = [ps for ps in passes[r] if ps.kind == "B" and ps.mb == m - 1]
            work = sum(ps.end - ps.start for ps in lasts)
            # dense gradients over the dp x ep replicas, expert gradients over dp (stride tp ep)
            for params, size, step in (
                (dense_local, replicas, lay.tp),
                (expert_local, dp, lay.tp * lay.ep),
            ):
                total = params * g_bytes
                buckets = math.ceil(total / (lay.bucket_mb * 1e6)) if size > 1 else 0
                for k in range(buckets):
                    ready = compute_end
                    if (
                        lay.dp_overlap
                    ):  # bucket k is full once (k + 1) / buckets of the work is done
                        ready = _progress(lasts, work * (k + 1) / buckets)
                    seconds = net.collective(op, total / buckets, size, step)
                    comm(r, f"grad {op.replace('_', '-')}", ready, seconds)
        grads_done = max(compute_end, comm_free[r])
        exposed.append(grads_done - compute_end)
        if grads_done > compute_end:
            tail.append(
                {
                    "kind": "dp_comm",
                    "what": "gradient exchange",
                    "rank": r,
                    "start": compute_end,
                    "end": grads_done,
                }
            )
        end = grads_done + opt_s
        tail.append(
            {
                "kind": "optimizer",
                "what": "optimizer step",
                "rank": r,
                "start": grads_done,
                "end": end,
            }
        )
        if trace:
            events.append(_event("optimizer step", r, "compute", grads_done, opt_s))
        if lay.zero_stage in (1, 2) and replicas > 1:
            gather = net.collective("all_gather", local * p_bytes, replicas, lay.tp)
            end = comm(r, "all-gather params", end, gather)
            tail.append(
                {
                    "kind": "dp_comm",
                    "what": "parameter all-gather",
                    "rank": r,
                    "start": end - gather,
                    "end": end,
                }
            )
        ends.append(end)
        tails.append(tail)
    slowest = max(range(p), key=lambda r: ends[r])
    step = ends[slowest]
    path = [
        {
            "kind": "forward" if ps.kind == "F" else "backward",
            "what": f"{ps.kind} mb{ps.mb} chunk {ps.chunk}",
            "rank": ps.rank,
            "start": ps.start,
            "end": ps.end,
        }
        for ps in critical_path(passes[slowest][-1])
    ]
    sends = []
    for prev, nxt in zip(path, path[1:], strict=False):
        if nxt["start"] > prev["end"]:
            sends.append(
                {
                    "kind": "send",
                    "what": "p2p",
                    "rank": prev["rank"],
                    "start": prev["end"],
                    "end": nxt["start"],
                }
            )
    path = sorted(path + sends, key=lambda e: (e["start"], e["end"])) + tails[slowest]
    tokens = cfg.global_batch * cfg.seq_len
    per_layer = layer_flops(cfg, lay, ffn, tokens)
    passes_counted = 4 if lay.recompute == "full" else 3
    extra = 0.0
    if lay.recompute == "selective":
        extra = cfg.layers * tokens * 4.0 * cfg.seq_len * cfg.hidden
    head = logits_flops(cfg, tokens)
    flops = cfg.layers * per_layer * passes_counted + 3 * head + extra
    model_flops = cfg.layers * per_layer * 3 + 3 * head
    busy = sum(ps.end - ps.start for ps in passes[slowest])
    held = sum(counts[c * p + slowest] for c in range(v))
    tp_comm = m * held * (cost.forward_comm + cost.backward_comm)
    compute_end = passes[slowest][-1].end
    breakdown = {
        "compute": busy - tp_comm,
        "tp_ep_comm": tp_comm,
        "bubble_and_wait": compute_end - busy,
        "dp_comm_exposed": exposed[slowest],
        "optimizer": opt_s,
        "param_gather": step - compute_end - exposed[slowest] - opt_s,
    }
    breakdown = {k: v if abs(v) > 1e-9 * step else 0.0 for k, v in breakdown.items()}
    return SimResult(
        layout=lay,
        dp=dp,
        microbatches=m,
        step_s=step,
        flops=flops,
        model_flops=model_flops,
        devices=cfg.devices,
        peak_flops=dev.peak_flops,
        memory=_memory(cfg, lay, dp, m),
        breakdown=breakdown,
        path=path,
        events=events,
    )


def split_layers(layers: int, stages: int) -> list[int]:
    """Layers per virtual pipeline stage: even, the remainder to the middle stages first (the
    first holds the embedding, the last the logits: Megatron-DeepSpeed counts them as layers)."""
    base, rem = divmod(layers, stages)
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    counts = [base] * stages
    for i in order[:rem]:
        counts[i] += 1
    return counts


def _progress(passes: list[Pass], work: float) -> float:
    """When ``work`` seconds of the passes (run in order) are done."""
    for ps in passes:
        if work <= ps.end - ps.start:
            return ps.start + work
        work -= ps.end - ps.start
    return passes[-1].end


def _event(name: str, rank: int, lane: str, start: float, seconds: float) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": rank,
        "tid": lane,
        "ts": start * 1e6,
        "dur": seconds * 1e6,
    }


def interleave_choices(layers: int, pp: int) -> list[int]:
    """Chunks per pipeline rank worth trying for ``layers`` on ``pp`` stages (none for ``pp``
    < 2): 2 and 4 where there are enough layers, every divisor > 1 of ``layers // pp`` (equal
    chunks where ``pp`` divides the layers; Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage`` must divide them), and one layer per chunk with
    the first and last chunk holding only the embedding and the head (Llama 3's pipeline:
    ``pp v = layers + 2``)."""
    if pp < 2:
        return []
    per_stage = layers // pp
    choices = {v for v in (2, 4) if layers >= pp * v}
    choices |= {v for v in range(2, per_stage + 1) if per_stage % v == 0}
    if (layers + 2) % pp == 0 and (layers + 2) // pp > 1:
        choices.add((layers + 2) // pp)
    return sorted(choices)


def rank_by_simulation(
    plan: StrategyPlan,
    *,
    top: int = 20,
    explore: bool = False,
    **options: Any,
) -> list[tuple[Candidate, SimResult]]:
    """The planner's ``top`` candidates (fitting ones, in its order), each simulated as 1F1B
    with its ZeRO stage, micro-batch and recomputation (``options``: further
    :class:`SimLayout` fields for all), ranked by simulated step time, those that fit by the
    simulator's memory first.

    ``explore``: also try, per candidate, what the planner does not model: no recomputation
    where it chose full and recomputation was not pinned (``activation_checkpointing="full"``;
    the simulator's memory counts sequence parallelism's savings) and the
    interleaved schedule with the chunk counts of :func:`interleave_choices` (1F1B candidates
    whose micro-batches divide by pp), and twice the planner's micro-batch (the planner's cost
    model has no kernel efficiency, so it never prefers a larger one); keep the fastest variant
    that fits by the simulator's memory (else the planner's own).
    """
    memory = plan.config.device_memory
    out = []
    for cand in [c for c in plan.candidates if c.fits][:top]:
        lay = cand.layout
        base = {
            "tp": lay.tp,
            "pp": lay.pp,
            "ep": lay.ep,
            "zero_stage": lay.stage,
            "micro_batch": lay.micro_batch,
            **options,
        }
        own = simulate(
            plan.config, SimLayout(recompute="full" if lay.recompute else "none", **base)
        )
        best = own
        if explore:
            pinned = plan.config.activation_checkpointing == "full"  # --ac full pins it
            recomputes = (
                ["full", "none"] if lay.recompute and not pinned else [own.layout.recompute]
            )
            chunks = [1]
            if lay.pp > 1 and options.get("schedule", "1f1b") == "1f1b":
                chunks += interleave_choices(plan.config.layers, lay.pp)
            variants = [
                (recompute, v, micro)
                for recompute in recomputes
                for v in chunks
                for micro in (lay.micro_batch, 2 * lay.micro_batch)
            ]
            for recompute, v, micro in variants:
                try:
                    res = simulate(
                        plan.config,
                        SimLayout(
                            recompute=recompute,
                            interleave=v,
                            **{**base, "micro_batch": micro},
                        ),
                    )
                except ValueError:  # e.g. micro-batches not a multiple of pp
                    continue
                if res.memory["total"] <= memory and (
                    best.memory["total"] > memory or res.step_s < best.step_s
                ):
                    best = res
        out.append((cand, best))
    return sorted(out, key=lambda cs: (cs[1].memory["total"] > memory, cs[1].step_s))
