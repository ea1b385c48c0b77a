"""DDP on ``gloo+shm``: how much gradient communication hides behind backward, asynchronous vs
synchronous operations, measured by the step monitor, side by side in the same processes.

Usage::

    python benchmarks/bench_shm_overlap.py --ranks 2 --rounds 3 --steps 10

Two ranks train the built-in GPT (``--d-model 384 --n-layer 4``: 7.3 M parameters, 29 MB of
float32 gradients a step, the trainer benchmark's model) under DDP (``--bucket-cap-mb``, torch's
default 25) on the ``gloo+shm`` default group. After 3 untimed steps, every round runs
``--steps`` steps in each of three modes, taking turns step by step (the order rotating):

- ``no comm``: ``ddp.no_sync()``, backward without any all-reduce: the compute alone;
- ``sync``: the group's progress queue switched to synchronous (``TORSH_SHM_ASYNC=0``: what
  every release before this one did): each bucket's all-reduce runs inside backward's hook;
- ``async``: the default: the buckets' all-reduces run on the group's progress thread.

Each (mode, round) has its own :class:`~torsh_distributed.monitor.step.StepMonitor` with the
model's parameters (so ``backward`` ends at the last gradient accumulated and ``comm_wait`` is
the communication left after it, the monitor's figure of what did not overlap); the report's
breakdown is the median over ranks. ``comm`` is the group's own count of seconds its
shared-memory operations ran (``progress.busy_s``) per step. Printed per round::

    exposed = step - step(no comm)          hidden = 1 - exposed / comm(sync)

with the monitor's ``backward`` and ``comm_wait``, and the monitor's own figure of the overlap:
``monitor: hidden = 1 - comm_wait / comm`` (asynchronous mode: the share of the communication
that ran before backward's last gradient; synchronous all-reduces block backward, so 0). On a
loaded host ``exposed`` also holds the ranks' skew (``no comm`` never waits for the peer).
``--burners-per-core B`` runs B busy-loop processes per core beside the ranks. Ranks run with
one intra-op thread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _burners  # noqa: E402

from torsh_distributed.models.config import ModelConfig  # noqa: E402
from torsh_distributed.models.gpt import GPT  # noqa: E402
from torsh_distributed.monitor.config import MonitorConfig  # noqa: E402
from torsh_distributed.monitor.step import StepMonitor  # noqa: E402
from torsh_distributed.testing import run_distributed  # noqa: E402

MODES = ("no comm", "sync", "async")


def _rank_body(args: dict) -> list[dict]:
    torch.set_num_threads(1)
    pg = dist.group.WORLD
    assert dist.get_backend() == "gloo+shm", dist.get_backend()
    torch.manual_seed(0)
    cfg = ModelConfig(
        block_size=args["block"], n_layer=args["n_layer"], n_head=6, d_model=args["d_model"]
    )
    model = GPT(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args["bucket_cap_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())
    batch, block = args["batch"], args["block"]

    def step(monitor: StepMonitor | None, index: int, mode: str) -> None:
        if monitor is not None:
            monitor.step_begin(index)
        x = torch.randint(0, 256, (batch, block + 1), generator=data)
        opt.zero_grad(set_to_none=True)
        quiet = ddp.no_sync() if mode == "no comm" else contextlib.nullcontext()
        with quiet:
            logits = ddp(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            if monitor is not None:
                monitor.phase("forward")
            loss.backward()
        if monitor is not None:
            monitor.phase("backward")  # after DDP's wait for the last bucket
        opt.step()
        if monitor is not None:
            monitor.phase("optimizer")
            monitor.step_end(index + 1, loss=loss.detach(), lr=1e-3)

    for i in range(3):  # untimed: DDP builds its buckets at the first steps
        step(None, i, "async")
    rows = []
    for r in range(args["rounds"]):
        monitors = {
            mode: StepMonitor(
                # aggregated once, in finish(), after the group's busy count was read
                MonitorConfig(enabled=True, every=args["steps"] + 1),
                params=list(model.parameters()),
                tokens_per_step=batch * block,
                echo=lambda _line: None,
            )
            for mode in MODES
        }
        comm = dict.fromkeys(MODES, 0.0)
        for i in range(args["steps"]):
            # the modes take turns step by step (a loaded host drifts within seconds)
            for mode in MODES[i % 3 :] + MODES[: i % 3]:
                pg.progress.asynchronous = mode != "sync"
                busy = pg.progress.busy_s
                step(monitors[mode], i, mode)
                comm[mode] += pg.progress.busy_s - busy
        for mode in MODES:
            report = monitors[mode].finish()
            mine = torch.tensor([comm[mode] / args["steps"]], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slower rank's count
            rows.append({"round": r, "mode": mode, "comm_s": mine.item(), **report["breakdown"]})
    pg.progress.asynchronous = True
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "| round | mode | step (ms) | backward (ms) | comm_wait (ms) | comm (ms) | monitor: hidden "
        "| exposed (ms) | hidden |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted({row["round"] for row in rows}):
        by = {row["mode"]: row for row in rows if row["round"] == r}
        base, sync_comm = by["no comm"]["step_time"], by["sync"]["comm_s"]
        for mode in MODES:
            row = by[mode]
            exposed = row["step_time"] - base
            hidden = "" if mode == "no comm" else f"{1 - exposed / sync_comm:.0%}"
            # the monitor's figure: communication that ran before backward's last gradient
            seen = {"no comm": "", "sync": "0 (blocking)"}.get(mode)
            if seen is None:
                seen = f"{1 - row['comm_wait'] / row['comm_s']:.0%}" if row["comm_s"] else ""
            lines.append(
                f"| {r} | {mode} | {row['step_time'] * 1e3:.1f} | {row['backward'] * 1e3:.1f} | "
                f"{row['comm_wait'] * 1e3:.1f} | {row['comm_s'] * 1e3:.1f} | {seen} | "
                f"{exposed * 1e3 if mode != 'no comm' else 0:.1f} | {hidden} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per mode and round")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    _burners.add_argument(parser)
    parser.add_argument("--json", default="", help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.rounds < 1 or args.steps < 1 or args.burners_per_core < 0:
        parser.error("--ranks >= 2, --rounds >= 1, --steps >= 1, --burners-per-core >= 0")
    with _burners.burning(args.burners_per_core) as burners:
        load_before = os.getloadavg()
        rows = run_distributed(
            _rank_body,
            args.ranks,
            args=(
                {
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "d_model": args.d_model,
                    "n_layer": args.n_layer,
                    "batch": args.batch_size,
                    "block": args.block_size,
                    "bucket_cap_mb": args.bucket_cap_mb,
                },
            ),
            backend="gloo+shm",
            timeout=1800,
            env={"OMP_NUM_THREADS": "1"},
        )[0]
    load_after = os.getloadavg()
    print(f"{args.ranks} ranks, {burners} burner process(es) beside them")
    print(_table(rows))
    print(f"load average (1/5/15 min) before: {load_before}, after: {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": [load_before, load_after]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
