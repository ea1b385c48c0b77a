"""Pipeline bubble fraction and peak stashed activations per schedule, measured side by side.

Runs GPipe, 1F1B and interleaved 1F1B on ``--pp`` CPU ranks (one thread each) over the same GPT
and batch in one process group. Each stage's ``forward_one_chunk`` / ``backward_one_chunk`` and
the loss are timed: the bubble of a rank is ``1 - busy / step wall time`` (time spent waiting on
peers or idle), averaged over ranks and steps, and compared with the theory
``(p-1)/(m+p-1)`` (interleaved: ``(p-1)/(v*m+p-1)``). The peak number of micro-batches whose
forward has run and whose backward has not (their activations are stashed) is counted per rank:
GPipe stashes ``m``, 1F1B at most ``p``.

    python benchmarks/bench_pipeline.py --pp 2 --microbatches 4 --virtual-stages 2

Prints a markdown table. Communication time is part of the measured bubble (the theory
assumes free messages and equal stages), so on a loaded machine the measured value is higher.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.parallel.pipeline import build_pipeline, lm_loss
from torsh_distributed.testing import run_distributed
from torsh_distributed.train.config import ModelConfig
from torsh_distributed.train.model import GPT


class _Meter:
    """Busy seconds and in-flight micro-batches of this rank's stages."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.in_flight = 0
        self.peak = 0

    def wrap(self, fn: Any, delta: int) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
                self.in_flight += delta
                self.peak = max(self.peak, self.in_flight)

        return timed


def _rank(
    schedules: list[str],
    pp: int,
    microbatches: int,
    virtual: int,
    mb_size: int,
    steps: int,
    n_layer: int,
    d_model: int,
    block: int,
) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = ModelConfig(block_size=block, n_layer=n_layer, n_head=4, d_model=d_model)
    out: dict[str, dict[str, float]] = {}
    batch = microbatches * mb_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, block), generator=gen)
    y = torch.randint(0, 256, (batch, block), generator=gen)
    for name in schedules:
        v = virtual if name == "interleaved" else 1
        torch.manual_seed(0)
        meter = _Meter()

        def loss_fn(
            logits: torch.Tensor, target: torch.Tensor, meter: _Meter = meter
        ) -> torch.Tensor:
            return meter.wrap(lm_loss, 0)(logits, target)

        runner = build_pipeline(
            GPT(cfg),
            pp_rank=rank,
            pp=pp,
            group=None,
            device=torch.device("cpu"),
            schedule=name,
            microbatches=microbatches,
            virtual_stages=v,
            loss_fn=loss_fn,
        )
        for stage in runner.stages:
            stage.forward_one_chunk = meter.wrap(stage.forward_one_chunk, +1)  # type: ignore[method-assign]
            stage.backward_one_chunk = meter.wrap(stage.backward_one_chunk, -1)  # type: ignore[method-assign]
        bubbles = []
        for step in range(steps + 1):  # step 0: shape inference and warm-up, not counted
            dist.barrier()
            meter.busy, meter.peak = 0.0, 0
            t0 = time.perf_counter()
            runner.step(x, y)
            wall = time.perf_counter() - t0
            if step:
                bubbles.append(1.0 - meter.busy / wall)
        theory = (pp - 1) / (v * microbatches + pp - 1)
        out[name] = {
            "bubble": sum(bubbles) / len(bubbles),
            "theory": theory,
            "peak": meter.peak,
            "v": v,
            "step_s": wall,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    schedules = ["gpipe", "1f1b", "interleaved"]
    results = run_distributed(
        _rank,
        args.pp,
        args=(
            schedules,
            args.pp,
            args.microbatches,
            args.virtual_stages,
            args.microbatch_size,
            args.steps,
            args.n_layer,
            args.d_model,
            args.block_size,
        ),
        timeout=600,
    )
    p, m = args.pp, args.microbatches
    print(
        f"pp={p}, microbatches={m}, microbatch {args.microbatch_size}x{args.block_size} tokens, "
        f"GPT {args.n_layer} layers d_model {args.d_model}, {args.steps} steps, 1 thread/rank\n"
    )
    print(
        "| schedule | v | bubble measured | bubble theory | measured/theory | peak stashed micro-batches (per rank) | step s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in schedules:
        rows = [r[name] for r in results]
        bubble = sum(r["bubble"] for r in rows) / len(rows)
        theory = rows[0]["theory"]
        peaks = ", ".join(str(int(r["peak"])) for r in rows)
        step_s = max(r["step_s"] for r in rows)
        print(
            f"| {name} | {int(rows[0]['v'])} | {bubble:.3f} | {theory:.3f} | {bubble / theory:.2f} "
            f"| {peaks} | {step_s:.2f} |"
        )


if __name__ == "__main__":
    main()
