"""Activations saved for backward and step time of tensor parallelism with and without Megatron-SP.

Runs TP and TP + sequence parallelism side by side on ``--tp`` CPU ranks (one thread each) over
the same GPT and batch in one process group (loss-parallel cross-entropy, as the trainer uses
with ``pp = 1``). Saved activations are measured in one forward under
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward, counted
once per storage (a tensor saved by two nodes, or a view of it, counts once), parameters
excluded, DTensors by their local shard. The bytes saved while a transformer block runs are
reported separately from those of the embeddings, final norm, head and loss. Step time is the
median wall time of forward, backward, the tensor-parallel gradient reduction and AdamW. A second
table times the collectives each variant issues per sub-layer on one ``batch x seq x d_model``
activation: one all-reduce (TP) against a reduce-scatter plus an all-gather (SP), the same
volume; on Gloo over loopback the pair is slower, which is most of SP's step-time cost here.

    python benchmarks/bench_sequence_parallel.py

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT
from torsh_distributed.models.gpt_tp import gpt_tp_plan
from torsh_distributed.parallel.tensor import reduce_partial_grads
from torsh_distributed.parallel.tp_plan import apply_tp_plan
from torsh_distributed.testing import run_distributed


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes on this rank."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    while type(t) is not torch.Tensor and hasattr(t, "elem"):  # AsyncCollectiveTensor
        t = t.elem
    return t


class _SavedBytes:
    """Bytes of the distinct storages autograd saves, split into blocks and the rest."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {_storage(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = {"blocks": 0, "other": 0}
        self.region = "other"
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: self._enter("blocks"))
            block.register_forward_hook(lambda *_: self._enter("other"))

    def _enter(self, region: str) -> None:
        self.region = region

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes[self.region] += storage.nbytes()
        return t


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the (vocabulary-sharded, under ``loss_parallel``) logits."""
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits  # forward may return (logits, _)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collectives(numel: int, reps: int) -> dict[str, float]:
    """Median milliseconds of an all-reduce vs a reduce-scatter + all-gather of ``numel`` floats."""
    tp = dist.get_world_size()
    buf, shard, full = torch.randn(numel), torch.empty(numel // tp), torch.empty(numel)
    ops = {
        "all-reduce": lambda: dist.all_reduce(buf),
        "reduce-scatter + all-gather": lambda: (_RS(shard, buf), _AG(full, shard)),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps + 2):  # alternate, two warm-up rounds
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}


def _rank(
    variants: list[str], batch: int, block: int, n_layer: int, d_model: int, n_head: int, steps: int
) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    cfg = ModelConfig(block_size=block, n_layer=n_layer, n_head=n_head, d_model=d_model)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, block), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, block), generator=gen)
    out: dict[str, dict[str, float]] = {}
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name in variants:
        torch.manual_seed(0)
        plan = gpt_tp_plan(sequence_parallel=name == "tp+sp", loss_parallel=True)
        model = apply_tp_plan(GPT(cfg), mesh, plan)
        meter = _SavedBytes(model)
        with loss_parallel(), torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            loss = _loss(model, x, y)
        with loss_parallel():
            loss.backward()
        runs[name] = model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        out[name] = {"blocks": meter.bytes["blocks"], "other": meter.bytes["other"]}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(steps + 1):  # variants alternate (a shared machine drifts); step 0 warms up
        for name, (model, optimizer) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with loss_parallel():
                loss = _loss(model, x, y)
                loss.backward()
            reduce_partial_grads(list(model.parameters()))
            optimizer.step()
            times[name].append(time.perf_counter() - t0)
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            out[name]["loss"] = float(loss.detach())
    for name in variants:
        out[name]["step_s"] = statistics.median(times[name][1:])
    out["collectives"] = _collectives(batch * block * d_model, reps=4 * steps)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    variants = ["tp", "tp+sp"]
    results = run_distributed(
        _rank,
        args.tp,
        args=(
            variants,
            args.batch_size,
            args.block_size,
            args.n_layer,
            args.d_model,
            args.n_head,
            args.steps,
        ),
        timeout=600,
    )
    print(
        f"tp={args.tp}, batch {args.batch_size} x {args.block_size} tokens, GPT {args.n_layer} "
        f"layers d_model {args.d_model} {args.n_head} heads, fp32, loss-parallel head, "
        f"median of {args.steps} steps, 1 thread/rank\n"
    )
    print(
        "| variant | saved activations per rank, MiB (blocks + rest) | per block, MiB "
        "| vs tp | step s (max over ranks) | last loss |"
    )
    print("|---|---|---|---|---|---|")
    base = results[0]["tp"]
    for name in variants:
        row: dict[str, Any] = results[0][name]
        if any(r[name]["blocks"] != row["blocks"] for r in results[1:]):
            raise AssertionError(f"{name}: ranks saved different amounts")
        total = row["blocks"] + row["other"]
        step_s = max(r[name]["step_s"] for r in results)
        print(
            f"| {name} | {_mib(total)} ({_mib(row['blocks'])} + {_mib(row['other'])}) "
            f"| {_mib(row['blocks'] / args.n_layer)} "
            f"| {total / (base['blocks'] + base['other']):.2f} | {step_s:.3f} | {row['loss']:.4f} |"
        )
    numel = args.batch_size * args.block_size * args.d_model
    print(
        f"\n| collective on {_mib(4 * numel)} MiB (one activation) | ms, median (max over ranks) |"
    )
    print("|---|---|")
    for name in results[0]["collectives"]:
        ms = max(r["collectives"][name] for r in results)
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
