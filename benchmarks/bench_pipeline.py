"""Pipeline bubble fraction and peak stashed activations per schedule, measured side by side.

Runs GPipe, 1F1B and interleaved 1F1B on ``--pp`` CPU ranks (one thread each) over the same GPT
and batch in one process group. Each stage's ``forward_one_chunk`` / ``backward_one_chunk`` and
the loss are timed (busy). Every rank starts a step at a barrier; the step time T is the slowest
rank's. The bubble of a rank is ``1 - busy / T`` (time spent waiting on peers, sending, or idle
after its last backward), and two figures are compared with the theory ``(p-1)/(m+p-1)``
(interleaved: ``(p-1)/(v*m+p-1)``), averaged over steps:

* **mean of ranks**: the device-idle fraction of the whole pipeline;
* **busiest rank**: the idle fraction of the rank with the most compute. The theory assumes equal
  stages; on two shared cores the same stage modules run 5-20 % slower on one rank than on the
  other (they take the same time alone), and a faster rank idles while it waits for the slower
  one, which is imbalance, not the schedule. The busiest rank's idle time is what the schedule
  (and the messages) leave.

The peak number of micro-batches whose forward has run and whose backward has not (their
activations are stashed) is counted per rank: GPipe stashes ``m``, 1F1B at most ``p``.

    python benchmarks/bench_pipeline.py --pp 2 --microbatches 4 --virtual-stages 2

Prints a markdown table. Communication time is part of the measured bubble (the theory
assumes free messages and equal stages), so on a loaded machine the measured value is higher.
The busy imbalance column (most / least busy rank, the same stage work) shows how unequal the
cores were during the row; ``bench_core_balance.py`` measures that for the bare cores.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT, lm_loss
from torsh_distributed.parallel.pipeline import build_pipeline
from torsh_distributed.testing import run_distributed


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
            split_points=None,  # even: n_layer must divide into pp (x v for interleaved)
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
        busy, walls = [], []
        for step in range(steps + 1):  # step 0: shape inference and warm-up, not counted
            dist.barrier()
            meter.busy, meter.peak = 0.0, 0
            t0 = time.perf_counter()
            runner.step(x, y)
            if step:
                walls.append(time.perf_counter() - t0)
                busy.append(meter.busy)
        out[name] = {
            "busy": busy,
            "wall": walls,
            "theory": (pp - 1) / (v * microbatches + pp - 1),
            "peak": meter.peak,
            "v": v,
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
        "| schedule | v | bubble, mean of ranks | bubble, busiest rank | theory | mean/theory "
        "| busiest/theory | busy imbalance | peak stashed micro-batches (per rank) | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in schedules:
        rows = [r[name] for r in results]
        mean, busiest, step_s, imbalance = _bubbles(rows)
        theory = rows[0]["theory"]
        peaks = ", ".join(str(int(r["peak"])) for r in rows)
        print(
            f"| {name} | {int(rows[0]['v'])} | {mean:.3f} | {busiest:.3f} | {theory:.3f} "
            f"| {mean / theory:.2f} | {busiest / theory:.2f} | {imbalance:.3f} | {peaks} "
            f"| {step_s:.2f} |"
        )


def _bubbles(rows: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """Per step, T = the slowest rank's step time (every rank starts at a barrier): the mean over
    ranks of ``1 - busy / T``, the busiest rank's ``1 - busy / T``, T, and the busy imbalance
    (most / least busy rank: the same stage work, so 1.0 on equal cores); averaged over steps."""
    steps = len(rows[0]["wall"])
    mean = busiest = total = imbalance = 0.0
    for i in range(steps):
        t = max(r["wall"][i] for r in rows)
        busy = [r["busy"][i] for r in rows]
        mean += sum(1.0 - b / t for b in busy) / len(busy)
        busiest += 1.0 - max(busy) / t
        total += t
        imbalance += max(busy) / min(busy)
    return mean / steps, busiest / steps, total / steps, imbalance / steps


if __name__ == "__main__":
    main()
