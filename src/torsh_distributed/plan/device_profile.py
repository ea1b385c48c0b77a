"""A measured device model for the step simulator (``torsh-dist plan profile``): a CPU host.

The simulator's device model (:mod:`._sim_device`) is a roofline calibrated on published GPU
runs. On a machine we can time, :func:`measure` replaces it by what the machine does, kernel by
kernel, before (and apart from) any training run it will predict (SimAI's approach: measured
kernel times, simulated communication and schedule):

* every GEMM shape the simulator asks for (found by simulating the given layouts with a device
  model that records the shapes), each timed with ``torch.matmul`` (batched where the simulator
  batches), forward shapes and the two backward shapes alike;
* the element-wise rate: one layer's two layer norms, GELU and two residual adds, forward and
  backward, on one micro-batch's activations, as the bytes the simulator counts for them
  (forward once, backward twice) per second (on a CPU GELU's backward dominates: compute, not
  bytes, so the rate holds for this layer shape, not in general);
* fused attention (``scaled_dot_product_attention``, causal): its rate against the fastest GEMM
  (``attn_eff``) and its backward over its forward;
* the optimizer step as the engine runs it (gradient clipping + ``AdamW(foreach=True)``) per
  parameter;
* for ZeRO-3 layouts, when :func:`time_kernels` runs in the ranks of a process group of two or
  more (``benchmarks/bench_sim_netlab.py`` times them in place; :func:`measure`'s copies form
  no group and leave it 0): FSDP2's own cost per unit, one transformer block's
  linear layers and norms at the first layout's micro-batch, ``fully_shard``-ed as the engine's
  ZeRO-3 does (``reshard_after_forward=True``) against the same block unsharded, less a raw
  all-gather and reduce-scatter of its bytes: copies in and out of FSDP2's buffers, DTensor
  dispatch, hooks, the optimizer step on DTensor shards, and the wait for the peer at each of
  its blocking collectives (on a CPU, where FSDP2 has no streams). The simulator adds it per
  unit in forward and in backward (``fsdp_forward_s``, ``fsdp_backward_s``); the link's time
  comes from the network model as before. The optimizer step on the unit's DTensor shards,
  beyond a plain step of as many parameters, gradient clipping included (on DTensors its norm
  is a collective), is added once per step (``fsdp_optimizer_s``). These differences of noisy
  times take at least 5 repeats each.

``processes`` copies time the same kernels at once, started together at every kernel: where the
simulated devices are ranks sharing one host's cores, each runs at the shared rate. Per kernel
the median over ``repeats``, then the mean over the copies. ``peak_flops`` is the fastest GEMM's
rate (so MFU reads as a share of the best this host did). A CPU has no streams: the device
model says so (``streams=False``), and the simulator blocks on FSDP2's collectives. Torch is imported by :func:`measure`
only; :func:`load` and :func:`from_dict` are torch-free.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torsh_distributed.plan._sim_device import DeviceModel

if TYPE_CHECKING:
    from torsh_distributed.plan._sim_layout import SimLayout
    from torsh_distributed.plan._strategy_config import StrategyConfig

__all__ = [
    "from_dict",
    "gemm_shapes",
    "kernel_spec",
    "load",
    "measure",
    "summarise",
    "time_kernels",
]

_FIELDS = ("peak_flops", "hbm_bw", "attn_eff", "flash_backward", "optimizer_per_param")
_FSDP_FIELDS = ("fsdp_forward_s", "fsdp_backward_s", "fsdp_optimizer_s")


class _Recording(dict):  # type: ignore[type-arg]
    """A ``measured`` table that records every key the simulator looks up and has none."""

    def __init__(self) -> None:
        super().__init__()
        self.keys_seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.keys_seen.add(key)
        return default


def gemm_shapes(cfg: StrategyConfig, layouts: Sequence[SimLayout]) -> list[str]:
    """The GEMM keys (:func:`~._sim_device.gemm_key`) the simulator asks for when it costs one
    layer and the logits of ``layouts`` on ``cfg`` (found by costing them on a device model that
    records its look-ups)."""
    from torsh_distributed.plan._sim_layer import layer_cost, logits_cost
    from torsh_distributed.plan._sim_network import Network

    rec = _Recording()
    dev = DeviceModel(
        name="recording", peak_flops=1e12, hbm_bw=1e10, sms=1, quantise=False, measured=rec
    )
    for lay in layouts:
        layer_cost(cfg, lay, dev, Network(cfg), lay.ffn_hidden or 4 * cfg.hidden)
        logits_cost(cfg, lay, dev)
    return sorted(rec.keys_seen)


def _parse(key: str) -> tuple[int, int, int, int, int]:
    shape, _, nbytes = key.partition(":")
    m, n, k, batch = (int(float(x)) for x in shape.split("x"))
    return m, n, k, batch, int(nbytes)


def time_kernels(spec: dict[str, Any], sync: Any) -> dict[str, Any]:
    """Time ``spec``'s kernels (:func:`kernel_spec`) in this process; ``sync()`` before every
    timed run starts the copies together (a barrier). Torch threads are set by the caller."""
    import torch
    import torch.nn.functional as F

    dtype = torch.float32 if spec["act"] == 4 else torch.bfloat16
    repeats = spec["repeats"]

    def timed(fn: Any, repeats: int = repeats) -> float:
        fn()  # warm-up
        runs = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    out: dict[str, Any] = {"gemm": {}}
    for key in spec["gemms"]:
        m, n, k, batch, _ = _parse(key)
        shape_a = (batch, m, k) if batch > 1 else (m, k)
        shape_b = (batch, k, n) if batch > 1 else (k, n)
        a, b = torch.randn(shape_a, dtype=dtype), torch.randn(shape_b, dtype=dtype)
        out["gemm"][key] = timed(lambda a=a, b=b: torch.matmul(a, b))
    tokens, h, ffn = spec["tokens"], spec["hidden"], spec["ffn"]
    x = torch.randn(tokens, h, dtype=dtype, requires_grad=True)
    u = torch.randn(tokens, ffn, dtype=dtype, requires_grad=True)
    r = torch.randn(tokens, h, dtype=dtype, requires_grad=True)
    norm = torch.nn.LayerNorm(h).to(dtype)

    def elementwise() -> None:  # one layer's: 2 norms, GELU, 2 residual adds
        y = norm(x)
        z = norm(y + r)
        (z + x).sum().backward()
        F.gelu(u).sum().backward()

    out["elementwise_s"] = timed(elementwise)
    b, heads, s, d = spec["attention"]
    q, k_, v = (torch.randn(b, heads, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    out["flash_f"] = timed(
        lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).detach()
    )
    out["flash_fb"] = timed(
        lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).sum().backward()
    )
    params = [
        torch.nn.Parameter(torch.randn(n, dtype=torch.float32)) for n in spec["optimizer_tensors"]
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    optim = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()

    out["optimizer_s"] = timed(step)
    if spec.get("fsdp"):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # differences of noisy times: at least 5 repeats, more than the kernels may take
            out.update(_time_fsdp_unit(spec, lambda fn: timed(fn, max(repeats, 5)), dtype))
    return out


def _block(h: int, ffn: int, dtype: Any) -> Any:
    """One transformer block's parameters (4 linear layers with biases, 2 layer norms) and a
    forward that uses each once: the unit FSDP2 wraps in the engine's ZeRO-3."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc, self.out = nn.Linear(h, ffn), nn.Linear(ffn, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.proj(self.qkv(self.n1(x))[..., :h])
            return x + self.out(torch.nn.functional.gelu(self.fc(self.n2(x))))

    return Block().to(dtype)


def _time_fsdp_unit(spec: dict[str, Any], timed: Any, dtype: Any) -> dict[str, float]:
    """FSDP2's own seconds per unit: forward, backward and the optimizer step (module
    docstring); in a process group of >= 2 ranks, every rank calling it. The differences are
    returned as measured (noise can make one negative): :func:`summarise` averages the ranks'
    and clamps at 0 after."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tokens, h, ffn = spec["tokens"], spec["hidden"], spec["ffn"]
    world = dist.get_world_size()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plain = _block(h, ffn, dtype)
        x = torch.randn(tokens, h, dtype=dtype)
    sharded = copy.deepcopy(plain)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=True)

    def fwd(module: Any) -> Any:
        return lambda: module(x).sum().detach()

    def fwd_bwd(module: Any) -> Any:
        def run() -> None:
            module.zero_grad(set_to_none=True)
            module(x).sum().backward()

        return run

    numel = sum(p.numel() for p in plain.parameters())
    shard = torch.zeros(-(-numel // world), dtype=dtype)
    full = torch.zeros(shard.numel() * world, dtype=dtype)
    gathered = timed(lambda: dist.all_gather_single(full, shard))
    scattered = timed(lambda: dist.reduce_scatter_single(shard, full))
    f_plain, f_sharded = timed(fwd(plain)), timed(fwd(sharded))
    fb_plain, fb_sharded = timed(fwd_bwd(plain)), timed(fwd_bwd(sharded))
    steps = []
    for module in (plain, sharded):  # gradients from the last fwd_bwd stay for the steps
        optim = torch.optim.AdamW(module.parameters(), lr=1e-9, foreach=True)

        def step(module: Any = module, optim: Any = optim) -> None:  # as the engine steps
            torch.nn.utils.clip_grad_norm_(list(module.parameters()), 1.0)  # DTensor: a collective
            optim.step()

        steps.append(timed(step))
    forward = f_sharded - f_plain - gathered
    # a unit's backward gathers again and reduce-scatters; its forward is in both times
    return {
        "fsdp_forward_s": forward,
        "fsdp_backward_s": fb_sharded - fb_plain - 2 * gathered - scattered - forward,
        "fsdp_optimizer_s": steps[1] - steps[0] / world,
        "fsdp_raw_gather_s": gathered,
        "fsdp_raw_scatter_s": scattered,
    }


def _worker(rank: int, barrier: Any, queue: Any, spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(rank)
    queue.put((rank, time_kernels(spec, barrier.wait)))


def kernel_spec(
    cfg: StrategyConfig, layouts: Sequence[SimLayout], *, threads: int = 1, repeats: int = 5
) -> dict[str, Any]:
    """What :func:`time_kernels` times for simulating ``layouts`` on ``cfg``: their GEMM shapes,
    and the element-wise and attention kernels at the first layout's micro-batch."""
    if threads < 1 or repeats < 1:
        raise ValueError("--threads and --repeats must be >= 1")
    if not layouts:
        raise ValueError("a device profile needs at least one layout")
    lay = layouts[0]
    return {
        "gemms": gemm_shapes(cfg, layouts),
        "act": 4 if cfg.dtype == "fp32" else 2,
        "threads": threads,
        "repeats": repeats,
        "tokens": lay.micro_batch * cfg.seq_len,
        "hidden": cfg.hidden,
        "ffn": lay.ffn_hidden or 4 * cfg.hidden,
        "attention": (lay.micro_batch, cfg.heads, cfg.seq_len, cfg.hidden // cfg.heads),
        "optimizer_tensors": [cfg.hidden * cfg.hidden] * 4 + [cfg.hidden] * 8,
        "fsdp": any(lay.zero_stage == 3 for lay in layouts),
    }


def summarise(
    spec: dict[str, Any], results: Sequence[dict[str, Any]], *, source: str, dtype: str
) -> dict[str, Any]:
    """The profile (:func:`from_dict`'s input) of the copies' :func:`time_kernels` results:
    per kernel the mean over the copies of their medians."""

    def mean(get: Any) -> float:
        return statistics.fmean(get(res) for res in results)

    gemm = {key: mean(lambda r, key=key: r["gemm"][key]) for key in spec["gemms"]}
    peak = max(
        (2.0 * math.prod(_parse(key)[:4]) / t for key, t in gemm.items() if t > 0), default=1e9
    )
    act, tokens, h, ffn = spec["act"], spec["tokens"], spec["hidden"], spec["ffn"]
    # the element-wise bytes as the simulator counts them: forward once, backward twice
    fwd_bytes = act * tokens * (2 * 2 * h + 2 * 3 * h + 2 * ffn)
    b, heads, s, d = spec["attention"]
    flash_f = mean(lambda r: r["flash_f"])
    flash_fb = mean(lambda r: r["flash_fb"])
    return {
        "name": "cpu",
        "peak_flops": peak,
        "hbm_bw": 3 * fwd_bytes / mean(lambda r: r["elementwise_s"]),
        "attn_eff": min(1.0, b * heads * 2.0 * s * s * d / flash_f / peak),
        "flash_backward": max(0.0, (flash_fb - flash_f) / flash_f),
        "optimizer_per_param": mean(lambda r: r["optimizer_s"]) / sum(spec["optimizer_tensors"]),
        **{  # means of the ranks' differences, then clamped: noise is not a negative cost
            key: max(0.0, mean(lambda r, key=key: r[key]))
            for key in _FSDP_FIELDS + ("fsdp_raw_gather_s", "fsdp_raw_scatter_s")
            if all(key in r for r in results)
        },
        "measured": gemm,
        "source": source,
        "dtype": dtype,
        "hidden": h,
        "seq_len": s,
    }


def measure(
    cfg: StrategyConfig,
    layouts: Sequence[SimLayout],
    *,
    processes: int = 1,
    threads: int = 1,
    repeats: int = 5,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Time this host's kernels for simulating ``layouts`` on ``cfg`` (module docstring).

    Args:
        cfg: The model and batch (``plan strategy``'s inputs); ``cfg.dtype`` picks fp32 or bf16.
        layouts: The layouts to be simulated: their GEMM shapes are timed, the element-wise and
            attention kernels at the first one's micro-batch.
        processes: Copies timing at once (the ranks that share this host's cores).
        threads: Torch threads per copy (as each rank runs).
        repeats: Timed runs per kernel (median), after one warm-up.
        timeout: Seconds before the copies are killed and a ``TimeoutError`` raised.

    Returns:
        A JSON-able profile: the :class:`~._sim_device.DeviceModel` fields (:func:`from_dict`),
        the raw timings and how they were taken (``source``, ``loadavg`` before and after).
    """
    import multiprocessing as mp

    if processes < 1:
        raise ValueError("--processes must be >= 1")
    spec = kernel_spec(cfg, layouts, threads=threads, repeats=repeats)
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, barrier, queue, spec)) for r in range(processes)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < processes:
            left = deadline - time.monotonic()
            if left <= 0 or any(p.exitcode not in (None, 0) for p in procs):
                raise TimeoutError(
                    f"plan profile: {processes - len(results)} measuring process(es) did not "
                    f"finish (exit codes {[p.exitcode for p in procs]})"
                )
            try:
                rank, out = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: keep waiting for the deadline
                continue
            results[rank] = out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    source = (
        f"torsh-dist plan profile: {processes} process(es) x {threads} thread(s), "
        f"{repeats} repeats (median), {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    return summarise(spec, list(results.values()), source=source, dtype=cfg.dtype)


def from_dict(data: dict[str, Any]) -> DeviceModel:
    """The :class:`~._sim_device.DeviceModel` of a :func:`measure` profile."""
    missing = [k for k in (*_FIELDS, "measured") if k not in data]
    if missing:
        raise ValueError(f"device profile lacks {', '.join(missing)} (written by plan profile?)")
    try:
        values = {k: float(data[k]) for k in _FIELDS}
        measured = {str(k): float(v) for k, v in dict(data["measured"]).items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"device profile: {exc}") from None
    if min(values["peak_flops"], values["hbm_bw"], values["attn_eff"]) <= 0:
        raise ValueError("device profile: peak_flops, hbm_bw and attn_eff must be > 0")
    try:
        fsdp = {k: float(data.get(k, 0.0)) for k in _FSDP_FIELDS}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"device profile: {exc}") from None
    if min(fsdp.values()) < 0:
        raise ValueError(f"device profile: {', '.join(_FSDP_FIELDS)} must be >= 0")
    base = DeviceModel(name=str(data.get("name", "cpu")), peak_flops=1.0, hbm_bw=1.0, sms=1)
    return replace(
        base,
        gemm_eff=1.0,
        mem_eff=1.0,
        quantise=False,
        streams=False,
        measured=measured,
        source=str(data.get("source", "")),
        **values,
        **fsdp,
    )


def load(path: str) -> DeviceModel:
    """:func:`from_dict` of a JSON file; ``ValueError`` naming the file if it cannot be read."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--device-profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--device-profile {path}: not a JSON object")
    try:
        return from_dict(data)
    except ValueError as exc:
        raise ValueError(f"--device-profile {path}: {exc}") from None
