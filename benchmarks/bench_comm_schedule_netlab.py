"""``--comm-schedule priority`` vs ``fifo`` (DDP) on the network lab: 2 hosts x 1 rank.

The same built-in GPT, from the same seed, trains twice side by side in the same two processes:
under DDP (``fifo``: buckets in backward order, then the optimizer step) and under
:class:`~torsh_distributed.parallel.priority.PriorityDataParallel` (``priority``: chunks sent
first-layer-first, per-chunk updates, the next forward overlapping the exchange). Each round
times ``--steps`` consecutive steps of one then the other (the order alternates per round, so
load drift hits both), the priority block ending with its last exchange drained. Reported: s/step
per round and schedule, the paired ratio per round, whether the losses are bit-identical, and
the link bandwidth the priority exchange measured from its own all-reduces against the ``tc`` rate.

``--zero-stage 2``: ``fifo`` is FSDP2 ZeRO-2 (``fully_shard(reshard_after_forward=False)``, one
unit per block, then the root; the optimizer over the shards), ``priority`` the same wrapper with
``zero_stage=2`` (reduce-scatter, shard step and all-gather per chunk, by priority).

Needs root (ip netns, tc); uses benchmarks/netlab::

    .venv/bin/python benchmarks/bench_comm_schedule_netlab.py --rate 100 --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _trace_messages(exchange: object) -> None:
    """``SCHED_TRACE=1``: keep every message's (chunk, issued, done, bytes), readiness
    messages (chunk -1) included, for studying the link estimate offline."""
    import time as _time

    trace: list = []
    complete = exchange._complete  # type: ignore[attr-defined]

    def traced(step, op, agreed):  # type: ignore[no-untyped-def]
        op.work.wait()
        done = op.done_at[0] if op.done_at else _time.perf_counter()
        trace.append((op.chunk, op.issued, done, op.nbytes))
        return complete(step, op, agreed)

    exchange._complete = traced  # type: ignore[attr-defined]
    exchange.trace = trace  # type: ignore[attr-defined]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_distributed.comm.dims import side_group
    from torsh_distributed.data.corpus import load_corpus, sample_batch
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.parallel.data import apply_ddp
    from torsh_distributed.parallel.priority import PriorityDataParallel
    from torsh_distributed.train.config import DataConfig, ModelConfig

    torch.set_num_threads(args.threads)
    if os.environ.get("SCHED_SWITCH_US"):
        sys.setswitchinterval(float(os.environ["SCHED_SWITCH_US"]) / 1e6)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    )
    corpus = load_corpus(DataConfig(max_bytes=2_000_000), min_tokens=args.block_size + 2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(
            corpus.train, seed=1, step=step, batch_size=args.batch_size * world,
            block_size=args.block_size, rank=rank, num_ranks=world,
        )  # fmt: skip

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=True)

    runs: dict = {}
    base_of: dict = {}
    phases: list = []  # (schedule, forward start, backward start, backward end) per step
    for schedule in ("fifo", "priority"):
        torch.manual_seed(0)  # the same initial weights on every rank (FSDP2 shards its own)
        base = GPT(mcfg)
        if schedule == "fifo" and args.zero_stage == 2:
            from torch.distributed.device_mesh import init_device_mesh

            from torsh_distributed.parallel.sharded import apply_fsdp

            units = list(base.blocks)[::-1]
            model = apply_fsdp(base, init_device_mesh("cpu", (world,)), stage=2, units=units)
            opt = optimizer(base)  # over the shards
        elif schedule == "fifo":
            opt = optimizer(base)
            model = apply_ddp(base, bucket_cap_mb=args.bucket_mb)
        else:
            opt = optimizer(base)
            model = PriorityDataParallel(
                base, group=side_group("priority_bench"), zero_stage=args.zero_stage,
                partition_bytes=args.partition_kb * 1024, credit_bytes=args.credit_kb * 1024,
            )  # fmt: skip
            model.bind(opt, grad_clip=args.grad_clip)
            if os.environ.get("SCHED_TRACE") and args.zero_stage == 0:
                _trace_messages(model._x)
        base_of[schedule] = base
        runs[schedule] = {"model": model, "opt": opt, "step": 0, "losses": [], "rounds": []}

    def train(schedule: str, steps: int) -> float:
        run = runs[schedule]
        model, opt = run["model"], run["opt"]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            if schedule == "fifo":
                opt.zero_grad(set_to_none=True)
            t_fwd = time.perf_counter()
            _, loss = model(*batch(run["step"]))
            t_bwd = time.perf_counter()
            loss.backward()
            phases.append((schedule, t_fwd, t_bwd, time.perf_counter()))
            if schedule == "fifo":
                if args.grad_clip:
                    torch.nn.utils.clip_grad_norm_(
                        list(base_of[schedule].parameters()), args.grad_clip
                    )
                opt.step()
            else:
                model.submit()
            run["losses"].append(loss.item())
            run["step"] += 1
        if schedule == "priority":
            model.wait()
        return (time.perf_counter() - t0) / steps

    for schedule in runs:  # warm-up (priority's auto partition is chosen after 3 steps)
        train(schedule, args.warmup)
    for r in range(args.rounds):
        order = ("fifo", "priority") if r % 2 == 0 else ("priority", "fifo")
        for schedule in order:
            runs[schedule]["rounds"].append(train(schedule, args.steps))
    prio = runs["priority"]["model"]
    summary = prio.summary()
    nparams = sum(p.numel() for p in base_of["priority"].parameters())
    out = {
        "params": nparams,
        "fifo": runs["fifo"]["rounds"],
        "priority": runs["priority"]["rounds"],
        "identical": runs["fifo"]["losses"] == runs["priority"]["losses"],
        "losses": runs["priority"]["losses"][-3:],
        "summary": summary,
        "samples": list(prio.estimator._samples) if os.environ.get("SCHED_SAMPLES") else [],
        "trace": getattr(prio._x, "trace", []),
        "phases": phases if os.environ.get("SCHED_TRACE") else [],
    }
    prio.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rate", type=float, default=100.0, help="link rate in Mbit/s; 0 = one host, loopback"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and schedule")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket (fifo)")
    parser.add_argument(
        "--zero-stage", type=int, default=0, choices=(0, 2),
        help="2: fifo = FSDP2 ZeRO-2, priority = zero_stage=2 (reduce-scatter / all-gather)",
    )  # fmt: skip
    parser.add_argument("--partition-kb", type=int, default=0, help="priority; 0 = auto")
    parser.add_argument("--credit-kb", type=int, default=0, help="priority; 0 = auto")
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=0.0,
        help="clip the global norm (priority's updates then wait for every chunk)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from netlab import NetLab, available

    reason = available()
    if reason and args.rate:
        print(f"skipped: {reason}")
        return 0
    names = (
        "rounds steps warmup d_model n_layer n_head block_size batch_size lr bucket_mb "
        "partition_kb credit_kb grad_clip threads zero_stage"
    ).split()
    forward = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]
    out = Path(tempfile.mkdtemp(prefix="torsh-sched-")) / "out.json"
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
    if not args.rate:  # --rate 0: one host, loopback (no lab)
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="29642", OMP_NUM_THREADS=str(args.threads))  # fmt: skip
            out_to = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out_to))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    else:
        with NetLab(hosts=2, rate_mbit=args.rate, net=41) as lab:
            procs = []
            for rank in range(2):
                env = lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29641)
                env["OMP_NUM_THREADS"] = str(args.threads)
                out_to = None if rank == 0 else subprocess.DEVNULL
                procs.append(lab.popen(rank, cmd, env=env, stdout=out_to))
            codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"ranks failed with exit codes {codes}")
        return 1
    res = json.loads(out.read_text())
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    bw = res["summary"]["bandwidth"]
    print(
        f"\n{'2 hosts x 1 rank at ' + format(args.rate, 'g') + ' Mbit/s' if args.rate else '1 host x 2 ranks (loopback)'}, {res['params'] / 1e6:.2f} M params "
        f"({res['params'] * 4 / 1e6:.1f} MB of fp32 gradients), batch {args.batch_size}/rank x "
        f"{args.block_size} tokens, {args.steps} steps per round, {os.cpu_count()} CPU cores, "
        f"{args.threads} torch thread/rank, grad clip {args.grad_clip:g}, load {' '.join(load_before)} -> {' '.join(load_after)}\n"
    )
    fifo_name = "FSDP2 ZeRO-2" if args.zero_stage == 2 else "DDP"
    print(f"zero stage {args.zero_stage}")
    print(f"| round | fifo ({fifo_name}) s/step | priority s/step | speed-up |")
    print("|---|---:|---:|---:|")
    ratios = []
    for r, (f, p) in enumerate(zip(res["fifo"], res["priority"], strict=True)):
        ratios.append(f / p)
        print(f"| {r + 1} | {f:.3f} | {p:.3f} | {f / p:.2f}x |")
    print(
        f"\nmedian speed-up {statistics.median(ratios):.2f}x; losses bit-identical: "
        f"{res['identical']}; partition {res['summary']['partition_kb']} KiB, credit "
        f"{res['summary']['credit_kb']} KiB, {res['summary']['chunks']} chunks"
    )
    if bw and args.rate:
        print(
            f"measured link: {bw['bandwidth_mbit']:.1f} Mbit/s ({bw['bandwidth_mbit'] / args.rate:.1%}"
            f" of the tc rate), latency {bw['latency_ms']:.2f} ms, {bw['samples']} periods, "
            f"source {bw.get('source', 'fit')}; the exchange achieved "
            f"{res['summary'].get('achieved_mbit') or 0:.1f} Mbit/s; "
            f"{res['summary'].get('probes', 0)} probe(s), {res['summary'].get('probe_seconds', 0)} s"
        )
    for line in res["summary"]["decisions"]:
        print(line)
    print("\n" + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
