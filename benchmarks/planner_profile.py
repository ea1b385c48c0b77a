"""The workload of ``bench_planner.py`` and the planner's profile of this machine.

The built-in GPT (4 layers, width 384, 4 heads, context 128, fp32 AdamW) on 2 Gloo ranks (1
thread each) in four layouts: ``dp2 z0`` (DDP), ``dp2 z3`` (FSDP2), ``tp2`` and ``pp2`` (1F1B,
4 micro-batches). The profile (profile-guided planning, as Alpa, Galvatron and Metis do) is
measured on micro-benchmarks in processes of their own, before any training run; nothing in it
is fitted to the runs it predicts. See ``bench_planner.py`` for what is measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import statistics
import time
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2 z0": {"zero_stage": 0},
    "dp2 z3": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "microbatches": 4},
}
SHAPE = {"n_layer": 4, "d_model": 384, "n_head": 4, "block_size": 128}
NULL = {"n_layer": 2, "d_model": 8, "n_head": 2, "block_size": 128}
_M_MMAP_THRESHOLD = -3


def micro_batches(batch: int) -> tuple[int, int, int]:
    """The layouts' micro-batches at global batch ``batch``: pp2 (4 micro-batches), dp2, tp2."""
    return (batch // 4, batch // 2, batch)


def planner_layouts(batch: int) -> dict[str, dict[str, Any]]:
    """The same layouts for the planner: degrees, ZeRO stage, micro-batch."""
    pp_mb, dp_mb, tp_mb = micro_batches(batch)
    return {
        "dp2 z0": {"dp": 2, "stage": 0, "micro_batch": dp_mb},
        "dp2 z3": {"dp": 2, "stage": 3, "micro_batch": dp_mb},
        "tp2": {"dp": 1, "tp": 2, "micro_batch": tp_mb},
        "pp2": {"dp": 1, "pp": 2, "micro_batch": pp_mb},
    }


def mallopt() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(_M_MMAP_THRESHOLD, 65536)


def config(name: str, steps: int, shape: dict[str, int], batch: int) -> Any:
    """The training config of layout ``name`` (``LAYOUTS``)."""
    from torsh_distributed.train import TrainConfig, preset

    cfg = preset("tiny").to_dict()
    cfg["model"].update(shape)
    cfg.update(max_steps=steps, batch_size=batch, progress=False, eval_batches=1, threads=1)
    cfg["data"]["max_bytes"] = 300_000
    cfg["optim"]["warmup_steps"] = 1
    cfg["parallel"].update(LAYOUTS[name])
    return TrainConfig.from_dict(cfg)


def _timed(fn: Any, repeats: int, reset: Any = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after 2 warm-ups, every rank starting
    together; the slowest rank's median (it sets a collective step's pace)."""
    import torch
    import torch.distributed as dist

    runs = []
    for i in range(repeats + 2):
        if reset is not None:
            reset()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= 2:
            runs.append(time.perf_counter() - start)
    med = torch.tensor([statistics.median(runs)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _timed_solo(fn: Any, repeats: int, reset: Any = None) -> float:
    """Median seconds of ``fn()`` on rank 0 while the other ranks wait in a barrier (as a
    pipeline's idle stage waits in a receive), after 2 warm-ups; rank 0's median on every rank."""
    import torch
    import torch.distributed as dist

    runs = []
    for i in range(repeats + 2):
        if reset is not None:
            reset()
        dist.barrier()
        if dist.get_rank() == 0:
            start = time.perf_counter()
            fn()
            if i >= 2:
                runs.append(time.perf_counter() - start)
        dist.barrier()
    med = torch.tensor([statistics.median(runs) if runs else 0.0])
    dist.broadcast(med, 0)
    return float(med)


def _fit(sizes: tuple[int, int], secs: list[float]) -> dict[str, float]:
    """``alpha + bytes * beta`` through two measured sizes."""
    beta = max((secs[1] - secs[0]) / (sizes[1] - sizes[0]), 1e-13)
    return {"alpha": max(secs[0] - sizes[0] * beta, 1e-7), "beta": beta}


def _profile_collectives(repeats: int) -> dict[str, dict[str, float]]:
    """Raw Gloo collectives on 2 ranks, as the layouts call them: all-reduce (DDP buckets),
    reduce-scatter and all-gather of whole tensors (FSDP2), one-way send/recv (pipeline)."""
    import torch
    import torch.distributed as dist

    rank, sizes = dist.get_rank(), (4 << 10, 8 << 20)
    out: dict[str, dict[str, float]] = {}

    def collective(kind: str, nbytes: int) -> Any:
        full = torch.zeros(nbytes // 4)
        half = torch.zeros(nbytes // 8)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(full)
        if kind == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(half, full)
        if kind == "all_gather":
            return lambda: dist.all_gather_into_tensor(full, half)

        def ping_pong() -> None:  # two one-way messages
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            else:
                dist.recv(full, 0)
                dist.send(full, 0)

        return ping_pong

    for kind in ("all_reduce", "reduce_scatter", "all_gather", "p2p"):
        secs = [_timed(collective(kind, n), repeats) for n in sizes]
        if kind == "p2p":
            secs = [t / 2 for t in secs]
        out[kind] = _fit(sizes, secs)
    return out


def _profile_layers(tp: int, repeats: int, batch: int) -> dict[str, Any]:
    """One block's and the non-block parts' forward + backward per micro-batch, and one
    optimizer step (clipping + AdamW, as the engine runs it) per parameter, at ``tp``: tp 1 on
    each of the 2 ranks at once (as data-parallel replicas share the cores), and on one rank
    alone (as a pipeline stage runs in the fill and drain, the other waiting); tp 2 through the
    GPT's own plan on a 2-rank mesh."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.engine.optim import build_optimizer
    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.models.gpt_tp import gpt_tp_plan
    from torsh_distributed.parallel.tensor import clip_grad_norm_
    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    train_cfg = config("tp2" if tp > 1 else "dp2 z0", 1, SHAPE, batch)
    model_cfg = dataclasses.replace(train_cfg.model, n_layer=1)
    torch.manual_seed(0)
    gpt = GPT(model_cfg)
    ctx: Any = contextlib.nullcontext
    clip: Any = torch.nn.utils.clip_grad_norm_
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        dims = ParallelDims(tp=tp).build()
        apply_tp_plan(gpt, dims.mesh["tp"], gpt_tp_plan(loss_parallel=True))  # as at pp 1
        ctx, clip = loss_parallel, clip_grad_norm_
    block = gpt.blocks[0]
    seq, width, vocab = model_cfg.block_size, model_cfg.d_model, model_cfg.vocab_size
    out: dict[str, Any] = {"block": {}, "outside": {}, "solo": {}}

    def reset() -> None:
        gpt.zero_grad(set_to_none=True)

    for micro in micro_batches(batch):
        x = torch.randn(micro, seq, width, requires_grad=True)

        def fwd_bwd(x: Any = x) -> None:
            block(x).sum().backward()

        out["block"][micro] = _timed(fwd_bwd, repeats, reset)
        if tp == 1:
            out["solo"][micro] = _timed_solo(fwd_bwd, repeats, reset)
    block_params = list(block.parameters())
    block(torch.randn(micro_batches(batch)[0], seq, width)).sum().backward()  # gradients to step
    optim = build_optimizer(block, train_cfg.optim)
    if tp > 1:  # the engine's choice: foreach kernels reject DTensor/plain mixes
        for group in optim.param_groups:
            group["foreach"] = False
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in block_params)
    grip = train_cfg.optim.grad_clip

    def step() -> None:
        clip(block_params, grip)
        optim.step()

    out["optimizer"] = _timed(step, repeats) / local
    if tp == 1:  # a pipeline stage: the engine's model-parallel clipping, the norm summed over pp

        def stage_step() -> None:
            clip_grad_norm_(block_params, grip, pp_group=dist.group.WORLD)
            optim.step()

        out["optimizer_pipeline"] = _timed(stage_step, repeats) / local
    gpt.blocks = nn.ModuleList()  # what is left: embeddings, final norm, head, loss
    for micro in micro_batches(batch):
        idx = torch.randint(vocab, (micro, seq))

        def outside(idx: Any = idx) -> None:
            with ctx():
                lm_loss(gpt(idx), idx).backward()

        out["outside"][micro] = _timed(outside, repeats, reset)
    return out


def _profile_sharded_optimizer(repeats: int, batch: int) -> float:
    """Seconds per local parameter of the step on FSDP2 (ZeRO-3) shards of one block."""
    import torch

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.engine.optim import build_optimizer
    from torsh_distributed.models.gpt import Block
    from torsh_distributed.parallel.sharded import apply_fsdp

    train_cfg = config("dp2 z3", 1, SHAPE, batch)
    torch.manual_seed(0)
    block = Block(train_cfg.model)
    dims = ParallelDims(dp=2).build()
    apply_fsdp(block, dims.mesh["dp"], stage=3, units=[])
    cfg = train_cfg.model
    block(torch.randn(micro_batches(batch)[0], cfg.block_size, cfg.d_model)).sum().backward()
    params = list(block.parameters())
    optim = build_optimizer(block, train_cfg.optim)
    local = sum(p.to_local().numel() for p in params)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, train_cfg.optim.grad_clip)
        optim.step()

    return _timed(step, repeats) / local


def _profile_fsdp(repeats: int, batch: int) -> dict[str, Any]:
    """What a block and the root unit cost under FSDP2 beyond the plain model, per micro-batch,
    at ZeRO stages 2 and 3 (Galvatron-style: the layer timed as the strategy runs it).

    Side by side on the 2-rank group, every model once per repetition: the GPT with one block
    and with none (the root alone), plain (each rank its own replica) and parallelised by the
    engine's own ``parallelize`` (the block one unit, the root the rest). Block overhead =
    (wrapped 1 - wrapped 0) - (plain 1 - plain 0); root overhead = wrapped 0 - plain 0; medians
    of these differences over the repetitions. Hooks, copies into and out of the flat buffers,
    re-sharding and the collectives are all inside them."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.parallel.parallelize import parallelize

    train_cfg = config("dp2 z3", 1, SHAPE, batch)
    model_cfg = dataclasses.replace(train_cfg.model, n_layer=1)
    dims = ParallelDims(dp=2).build()
    stages = (2, 3)

    def build(blocks: int, stage: int) -> Any:
        torch.manual_seed(0)
        gpt = GPT(model_cfg)
        if not blocks:
            gpt.blocks = nn.ModuleList()
        if stage:
            par = dataclasses.replace(train_cfg.parallel, zero_stage=stage)
            with warnings.catch_warnings():  # the root alone: no blocks to wrap, as intended
                warnings.simplefilter("ignore", UserWarning)
                parallelize(gpt, dims, par)
        return gpt

    models = {(n, st): build(n, st) for st in (0, *stages) for n in (1, 0)}
    out: dict[str, Any] = {"block": {st: {} for st in stages}, "root": {st: {} for st in stages}}
    for micro in micro_batches(batch):
        idx = torch.randint(model_cfg.vocab_size, (micro, model_cfg.block_size))
        rows = []  # per repetition, every model once: a load change shifts the whole row
        for i in range(repeats + 2):  # 2 warm-ups (FSDP2's lazy initialisation)
            row = []
            for gpt in models.values():
                gpt.zero_grad(set_to_none=True)
                dist.barrier()
                start = time.perf_counter()
                lm_loss(gpt(idx), idx).backward()
                row.append(time.perf_counter() - start)
            if i >= 2:
                rows.append(row)
        secs = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)  # the slowest rank sets a collective's pace
        t = {key: secs[:, j] for j, key in enumerate(models)}
        plain_block = t[1, 0] - t[0, 0]
        for st in stages:  # medians of the paired differences; noise can make one negative
            block = statistics.median((t[1, st] - t[0, st] - plain_block).tolist())
            out["block"][st][micro] = max(0.0, block)
            out["root"][st][micro] = max(0.0, statistics.median((t[0, st] - t[0, 0]).tolist()))
    return out


def measure_profile(passes: int, repeats: int, batch: int) -> dict[str, Any]:
    """The planner's profile of this machine: micro-benchmarks only, no training run. Every
    quantity is measured in each of ``passes`` passes (medians over them), so that a change of
    the machine's load shifts them all alike."""
    import torch

    mallopt()  # the allocator as in the training runs (every tensor > 64 KiB mmapped)
    torch.set_num_threads(1)
    runs = []
    for _ in range(passes):
        runs.append(
            {
                "collectives": _profile_collectives(repeats),
                "layers": {tp: _profile_layers(tp, repeats, batch) for tp in (1, 2)},
                "optimizer_sharded": _profile_sharded_optimizer(repeats, batch),
                "fsdp": _profile_fsdp(repeats, batch),
            }
        )

    def med(path: tuple[Any, ...]) -> float:
        values = []
        for run in runs:
            for key in path:
                run = run[key]
            values.append(run)
        return statistics.median(values)

    coll = {
        k: {p: med(("collectives", k, p)) for p in ("alpha", "beta")}
        for k in runs[0]["collectives"]
    }
    layers = {
        tp: {
            "block": {b: med(("layers", tp, "block", b)) for b in micro_batches(batch)},
            "outside": {b: med(("layers", tp, "outside", b)) for b in micro_batches(batch)},
            "optimizer": med(("layers", tp, "optimizer")),
        }
        for tp in (1, 2)
    }
    fsdp = {
        part: {
            st: {b: med(("fsdp", part, st, b)) for b in micro_batches(batch)}
            for st in runs[0]["fsdp"][part]
        }
        for part in ("block", "root")
    }
    return {
        "collectives": coll,
        "layers": layers,
        "optimizer_sharded": med(("optimizer_sharded",)),
        "optimizer_pipeline": med(("layers", 1, "optimizer_pipeline")),
        "solo": {b: med(("layers", 1, "solo", b)) for b in micro_batches(batch)},
        "fsdp": fsdp,
    }


def steady_step(batch: int, steps: int, full: Any, one: Any) -> float:
    """Steady step seconds from a ``steps``-step run and a 1-step run (``TrainResult``s): the
    loop time minus the first step's (one-off allocations, optimizer state), over the rest."""
    loop = batch * steps / full.samples_per_s
    return (loop - batch / one.samples_per_s) / (steps - 1)


def runtime_steps(passes: int, steps: int, batch: int) -> dict[str, float]:
    """The training loop's own steady step time in each layout, on a negligible model (``NULL``,
    as the memory baseline): data, the loss all-reduce for logging, hooks, the schedule, the
    collectives' latencies; what the planner's per-model terms leave out. ``steps``-step run
    minus a 1-step run over ``steps - 1``, medians of ``passes`` passes, the slower rank's."""
    import torch
    import torch.distributed as dist

    from torsh_distributed.train import train

    mallopt()
    runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(passes):
        for name in LAYOUTS:
            full = train(config(name, steps, NULL, batch))
            one = train(config(name, 1, NULL, batch))
            runs[name].append(max(0.0, steady_step(batch, steps, full, one)))
    med = torch.tensor([statistics.median(runs[name]) for name in LAYOUTS])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return dict(zip(LAYOUTS, med.tolist(), strict=True))


def to_profile(raw: dict[str, Any], source: str) -> Any:
    """The :class:`Profile` of :func:`measure_profile`'s measurements."""
    from torsh_distributed.plan.profile import Collective, Profile

    layers = raw["layers"]
    return Profile(
        hidden=SHAPE["d_model"],
        seq_len=SHAPE["block_size"],
        ranks=2,
        block={tp: dict(v["block"]) for tp, v in layers.items()},
        outside={tp: dict(v["outside"]) for tp, v in layers.items()},
        optimizer={tp: v["optimizer"] for tp, v in layers.items()},
        optimizer_sharded=raw["optimizer_sharded"],
        optimizer_pipeline=raw["optimizer_pipeline"],
        solo=raw["solo"],
        fsdp_block=raw["fsdp"]["block"],
        fsdp_root=raw["fsdp"]["root"],
        **{k: Collective(**v) for k, v in raw["collectives"].items()},
        source=source,
    )


def print_profile(profile: Any) -> None:
    """One line per profiled quantity (milliseconds; links as alpha and GB/s)."""
    for tp in sorted(profile.block):
        blocks = ", ".join(f"mb{b} {t * 1e3:.0f}" for b, t in profile.block[tp].items())
        outside = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.outside[tp].items())
        print(
            f"profile tp{tp}: block fwd+bwd {blocks} ms; outside the blocks {outside} ms; "
            f"optimizer {profile.optimizer[tp] * 1e9:.2f} ns/param"
        )
    solo = ", ".join(f"mb{b} {t * 1e3:.0f}" for b, t in profile.solo.items())
    print(f"profile tp1, one rank alone (pipeline fill and drain): block fwd+bwd {solo} ms")
    print(
        f"profile ZeRO-3 shards: optimizer {profile.optimizer_sharded * 1e9:.2f} ns/param; "
        f"pipeline stage (tp1): optimizer {profile.optimizer_pipeline * 1e9:.2f} ns/param"
    )
    for st in sorted(profile.fsdp_block):
        blocks = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.fsdp_block[st].items())
        root = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.fsdp_root[st].items())
        print(f"profile FSDP2 ZeRO-{st} beyond plain: per block {blocks} ms; root {root} ms")
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "p2p"):
        c = getattr(profile, kind)
        print(f"profile {kind}: {c.alpha * 1e6:.0f} us + {1 / c.beta / 1e9:.2f} GB/s")
