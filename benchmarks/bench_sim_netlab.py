"""Step simulator vs our own runs on network-namespace hosts (issue 40, item 4).

The same simulator that predicts published GPU runs (``torsh-dist plan simulate``) predicts the
steady step time of ``torsh-dist train``'s engine on ``--hosts`` namespace hosts (1 rank x 1
thread each, Gloo between hosts over ``tc``-limited links), in three layouts: ``ddp`` (DDP,
overlapped 25 MB buckets), ``zero3`` (FSDP2, one unit per block, prefetch) and ``pp2`` (2
pipeline stages, 1F1B, 4 micro-batches; with 4 hosts x dp 2). Model: the built-in GPT, 4 layers,
width 384, 4 heads, context 128, fp32 AdamW, global batch ``--batch``.

What the prediction uses, measured apart from the training runs and never fitted to them:

* the device model (``torsh-dist plan profile``'s kernels, ``device_profile.time_kernels``):
  every GEMM shape of the layout, the element-wise rate, fused attention, the optimizer step,
  timed by the run's own ranks at once (they share the cores) just before and just after each
  run, so that the profile sees the machine's load of that moment (other engineers' jobs run
  here); the prediction is the mean of the two;
* the link: a one-way Gloo send between two lab hosts at 64 kB and 8 MB, fitted as ``alpha +
  bytes / bandwidth`` (``--inter-latency``, ``--inter-bw``); beside it the prediction from the
  nominal rate (the ``tc`` rate, alpha 100 us) and from a link fitted to all-gathers
  (:func:`_collective_link`).

Measured: the engine's steady step as its step monitor times it (``--monitor --monitor-every
1`` on a ``--steps`` run: every step timed, the first left out, the slower rank's mean),
``--rounds`` rounds with the layouts' order rotated, median; the load average (1 min) before
every run, reported per layout (median and range). Printed beside it, the measure this script
used before 2026-11-29: the loop time of the ``--steps`` run minus a 1-step run of the same
layout just after it, over ``steps - 1``. That assumed the two runs' first steps cost the same;
for ZeRO-3 they do not: the first ZeRO-3 ``train()`` of a process pays 0.6-1.1 s once in its
step 0, so the difference read ~0.45 s a step too slow (the last table shows it per round).

    sudo .venv/bin/python benchmarks/bench_sim_netlab.py --hosts 2 --rates 100,0 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = {"n_layer": 4, "d_model": 384, "n_head": 4, "block_size": 128}
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"zero_stage": 0},
    "zero3": {"zero_stage": 3},
    "pp2": {"pp": 2, "microbatches": 4},
}


def _train_config(name: str, steps: int, batch: int) -> Any:
    from torsh_distributed.train import TrainConfig, preset

    cfg = preset("tiny").to_dict()
    cfg["model"].update(SHAPE)
    cfg.update(
        max_steps=steps,
        batch_size=batch,
        progress=False,
        eval_batches=1,
        threads=1,
        backend="gloo",
    )
    cfg["data"]["max_bytes"] = 300_000
    cfg["optim"]["warmup_steps"] = 1
    cfg["parallel"].update(LAYOUTS[name])
    return TrainConfig.from_dict(cfg)


def _sim_layouts(hosts: int, batch: int) -> dict[str, Any]:
    from torsh_distributed.plan.simulate import SimLayout

    per_replica = batch // hosts
    return {
        "ddp": SimLayout(micro_batch=per_replica, dp_overlap=True, backend="gloo"),
        "zero3": SimLayout(micro_batch=per_replica, zero_stage=3, backend="gloo"),
        "pp2": SimLayout(
            pp=2, micro_batch=batch // (hosts // 2) // 4, dp_overlap=True, backend="gloo"
        ),
    }


def _strategy(hosts: int, batch: int, num_params: int, bw: float, alpha: float) -> Any:
    from torsh_distributed.plan.strategy import StrategyConfig

    return StrategyConfig(
        params=num_params,
        layers=SHAPE["n_layer"],
        hidden=SHAPE["d_model"],
        heads=SHAPE["n_head"],
        seq_len=SHAPE["block_size"],
        vocab=256,
        devices=hosts,
        nodes=hosts,
        device_memory=24e9,
        intra_bw=1e12,
        inter_bw=bw,
        inter_latency=alpha,
        global_batch=batch,
        dtype="fp32",
        optimizer="adam",
        device="cpu",
        device_flops=1e10,  # unused: the simulator takes the measured device model
        flash_attention=True,
        dropout=False,
        layout="fsdp2",
    )


def _num_params() -> int:
    from torsh_distributed.models.gpt import GPT

    return sum(p.numel() for p in GPT(_train_config("ddp", 1, 16).model).parameters())


# -- the ranks ---------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_distributed.plan.device_profile import kernel_spec, summarise, time_kernels
    from torsh_distributed.train import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {"link": None, "runs": {}}
    if args.link:  # one-way send between host 0 and host 1, two sizes
        secs = []
        for nbytes in (64 << 10, 8 << 20):
            buf = torch.zeros(nbytes // 4)
            runs = []
            for i in range(7):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf[:1], 1)  # the ack: a few bytes back
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf[:1], 0)
                if i >= 2:
                    runs.append(time.perf_counter() - start)
            secs.append(statistics.median(runs))
        beta = (secs[1] - secs[0]) / ((8 << 20) - (64 << 10))
        out["link"] = {"alpha": max(secs[0] - (64 << 10) * beta, 1e-6) / 2, "bw": 1 / beta}
        out["link_collective"] = _collective_link()
    cfg = _strategy(dist.get_world_size(), args.batch, _num_params(), 12.5e6, 1e-4)
    lays = _sim_layouts(dist.get_world_size(), args.batch)

    def profile(name: str) -> dict[str, Any]:
        """This layout's kernels timed by every rank at once, just before or after its run."""
        spec = kernel_spec(cfg, [lays[name]], repeats=args.profile_repeats)
        mine = time_kernels(spec, dist.barrier)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        load = os.getloadavg()[0]
        return summarise(spec, every, source=f"in the run's ranks, load {load:.1f}", dtype="fp32")

    for name in args.order.split(","):
        before = profile(name)
        load = os.getloadavg()[0]
        watched = _train_config(name, args.steps, args.batch)
        report = Path(tempfile.mkdtemp(prefix="torsh-simlab-mon-")) / "report.json"
        watched.monitor.enabled, watched.monitor.every = True, 1
        watched.monitor.report_json = str(report)  # written by rank 0
        full = train(watched)
        one = train(_train_config(name, 1, args.batch))
        after = profile(name)
        loop = args.batch * args.steps / full.samples_per_s
        steady = (loop - args.batch / one.samples_per_s) / (args.steps - 1)
        t = torch.tensor([steady])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        monitored = None
        if rank == 0:  # every step timed, the first left out; the slower rank's mean
            ranks = json.loads(report.read_text())["per_rank"]
            monitored = max(r["step_time"] for r in ranks)
        shutil.rmtree(report.parent, ignore_errors=True)
        out["runs"][name] = {
            "steady_s": float(t),
            "monitor_step_s": monitored,
            "first_step_s": loop - (args.steps - 1) * monitored if monitored else None,
            "one_step_run_s": args.batch / one.samples_per_s,
            "load": load,
            "load_after": os.getloadavg()[0],
            "params": full.num_params,
            "profiles": [before, after],
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    # leave together: a rank tearing Gloo down while its peer still holds the connections can
    # abort the peer at exit ("terminate called without an active exception", seen once here)
    dist.barrier()
    dist.destroy_process_group()


def _collective_link() -> dict[str, float]:
    """The link as the ring collectives see it: ``all_gather_into_tensor`` at 1, 4 and 8 MB.

    Fitted to the simulator's ring model, ``(n - 1) (alpha + B / (n bw))``. On a link whose
    bandwidth is the CPU's (veth, no ``tc``) a ring step sends and receives at once, which a
    one-way send never does: the two fits differ there, not on a ``tc``-limited link.
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    sizes = (1 << 20, 4 << 20, 8 << 20)  # whole gathered tensor, bytes
    secs = []
    for nbytes in sizes:
        mine = torch.ones(nbytes // 4 // n)
        full = torch.empty(mine.numel() * n)
        runs = []
        for i in range(14):  # 5 warm-ups: the sockets' buffers grow over the first calls
            dist.barrier()
            start = time.perf_counter()
            gather(full, mine)
            if i >= 5:
                runs.append(time.perf_counter() - start)
        secs.append(statistics.median(runs) / (n - 1))  # one ring step
    per = [b / n for b in sizes]
    fit = statistics.linear_regression(per, secs)  # step = alpha + per / bw
    slope, alpha = fit.slope, fit.intercept
    return {"alpha": max(alpha, 1e-6), "bw": 1 / slope}


def _lab(hosts: int, rate: float, net: int) -> Any:
    from netlab import NetLab

    lab = NetLab(hosts=hosts, rate_mbit=rate, net=net)
    # our own namespace names ("sim" + pid): other benchmarks' cleanup_stale() removes "tdl*"
    lab.tag = f"sim{os.getpid() % 100000}"
    lab.switch = f"{lab.tag}sw"
    lab.namespaces = [f"{lab.tag}h{i}" for i in range(hosts)]
    return lab


def _round(lab: Any, hosts: int, order: list[str], link: bool, args: argparse.Namespace) -> Any:
    out = Path(tempfile.mkdtemp(prefix="torsh-simlab-")) / "round.json"
    forward = [
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--order={','.join(order)}",
        f"--profile-repeats={args.profile_repeats}",
    ]
    procs = []
    for rank in range(hosts):
        env = lab.rank_env(rank=rank, world_size=hosts, ranks_per_host=1, master_port=29671)
        cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
        if link:
            cmd.append("--link")
        procs.append(lab.popen(rank, cmd, env=env, stdout=subprocess.DEVNULL))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"ranks failed with exit codes {codes}")
    return json.loads(out.read_text())


def _predict(
    profile: dict[str, Any], hosts: int, batch: int, params: int, bw: float, alpha: float
) -> dict[str, Any]:
    from torsh_distributed.plan.device_profile import from_dict
    from torsh_distributed.plan.simulate import simulate

    cfg = _strategy(hosts, batch, params, bw, alpha)
    dev = from_dict(profile)
    return {n: simulate(cfg, lay, device=dev) for n, lay in _sim_layouts(hosts, batch).items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts (2 or 4)")
    parser.add_argument("--rates", default="100,0", help="link Mbit/s, comma-separated; 0 = none")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--order", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from netlab import available

    reason = available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    if args.hosts not in (2, 4) or args.batch % (4 * args.hosts) or args.steps < 2:
        parser.error("--hosts 2 or 4, --batch a multiple of 4 x hosts, --steps >= 2")
    names = args.layouts.split(",")
    params = _num_params()
    started = time.time()
    results: dict[str, Any] = {"rates": {}}
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        rounds = []
        with _lab(args.hosts, rate, 140 + i) as lab:
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                rounds.append(_round(lab, args.hosts, order, r == 0, args))
                print(
                    f"  {rate:g} Mbit/s round {r + 1}: "
                    + ", ".join(
                        f"{n} {rounds[-1]['runs'][n]['monitor_step_s']:.3f} s" for n in names
                    ),
                    flush=True,
                )
        link, clink = rounds[0]["link"], rounds[0]["link_collective"]
        nominal_bw = rate * 1e6 / 8 if rate else link["bw"]
        rows = {}
        for n in names:
            runs = [x["runs"][n] for x in rounds]
            steps = [run["monitor_step_s"] for run in runs]  # what every error is against
            loads = [run["load"] for run in runs] + [run["load_after"] for run in runs]

            def predicted(bw: float, alpha: float, run: dict[str, Any], n: str = n) -> Any:
                """Mean of the predictions from the profiles just before and after the run."""
                res = [
                    _predict(prof, args.hosts, args.batch, params, bw, alpha)[n]
                    for prof in run["profiles"]
                ]
                return statistics.fmean(x.step_s for x in res), res[0]

            pred = [predicted(link["bw"], link["alpha"], run) for run in runs]
            nom = [predicted(nominal_bw, 1e-4, run)[0] for run in runs]
            coll = [predicted(clink["bw"], clink["alpha"], run)[0] for run in runs]
            pred_s = [x[0] for x in pred]
            med, pmed, nmed = (statistics.median(v) for v in (steps, pred_s, nom))
            rows[n] = {
                "measured_s": med,
                "rounds_s": steps,
                "load": loads,
                "predicted_s": pmed,
                "predicted_rounds_s": pred_s,
                "round_errors": [p / m - 1 for p, m in zip(pred_s, steps, strict=True)],
                "error": pmed / med - 1,
                "nominal_s": nmed,
                "nominal_error": nmed / med - 1,
                "difference_s": statistics.median(run["steady_s"] for run in runs),
                "difference_rounds_s": [run["steady_s"] for run in runs],
                "first_step_s": [run["first_step_s"] for run in runs],
                "one_step_run_s": [run["one_step_run_s"] for run in runs],
                "collective_link_s": statistics.median(coll),
                "collective_link_error": statistics.median(coll) / med - 1,
                "collective_link_round_errors": [
                    p / m - 1 for p, m in zip(coll, steps, strict=True)
                ],
                "breakdown_s": pred[len(pred) // 2][1].breakdown,
                "profiles": [run["profiles"] for run in runs],
            }
        results["rates"][f"{rate:g}"] = {"link": link, "link_collective": clink, "rows": rows}
    print(
        f"\n{args.hosts} hosts x 1 rank x 1 thread, GPT {SHAPE}, {params:,} params, fp32 AdamW, "
        f"global batch {args.batch}, {args.steps}-step runs x {args.rounds} rounds; "
        f"{time.time() - started:.0f} s in all"
    )
    print(
        "| link | layout | measured steady step (rounds) | load 1-min (median, range) | "
        "predicted (measured link) | error | predicted (nominal link) | error | predicted "
        "breakdown (compute / bubble / dp comm exposed / optimizer) | error per round |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---|---|")
    for rate, res in results["rates"].items():
        link = res["link"]
        label = f"{rate} Mbit/s" if rate != "0" else "unlimited"
        label += f" (measured {link['bw'] * 8 / 1e6:.0f} Mbit/s, {link['alpha'] * 1e6:.0f} us)"
        for n, row in res["rows"].items():
            b = row["breakdown_s"]
            print(
                f"| {label} | {n} | {row['measured_s']:.3f} s "
                f"({', '.join(f'{x:.2f}' for x in row['rounds_s'])}) | "
                f"{statistics.median(row['load']):.1f} ({min(row['load']):.1f}-"
                f"{max(row['load']):.1f}) | {row['predicted_s']:.3f} s | {row['error']:+.1%} | "
                f"{row['nominal_s']:.3f} s | {row['nominal_error']:+.1%} | "
                f"{b['compute']:.2f} / {b['bubble_and_wait']:.2f} / {b['dp_comm_exposed']:.2f} / "
                f"{b['optimizer']:.3f} | "
                + ", ".join(f"{e:+.0%}" for e in row["round_errors"])
                + " |"
            )
    print(
        "\n| link | link fitted from all-gathers | layout | measured steady step | predicted | "
        "error | error per round |"
    )
    print("|---|---|---|---:|---:|---:|---|")
    for rate, res in results["rates"].items():
        clink = res["link_collective"]
        fitted = f"{clink['bw'] * 8 / 1e6:.0f} Mbit/s, {clink['alpha'] * 1e6:.0f} us"
        for n, row in res["rows"].items():
            print(
                f"| {rate if rate != '0' else 'unlimited'} | {fitted} | {n} | "
                f"{row['measured_s']:.3f} s | {row['collective_link_s']:.3f} s | "
                f"{row['collective_link_error']:+.1%} | "
                + ", ".join(f"{e:+.0%}" for e in row["collective_link_round_errors"])
                + " |"
            )
    print(
        "\n| link | layout | step by the monitor | 3-step minus 1-step run (rounds) | "
        "step 0 of the 3-step run / the 1-step run (s) |"
    )
    print("|---|---|---:|---:|---|")
    for rate, res in results["rates"].items():
        for n, row in res["rows"].items():
            firsts = ", ".join(
                f"{a:.2f} / {b:.2f}"
                for a, b in zip(row["first_step_s"], row["one_step_run_s"], strict=True)
            )
            print(
                f"| {rate if rate != '0' else 'unlimited'} | {n} | {row['measured_s']:.3f} s | "
                f"{row['difference_s']:.3f} s "
                f"({', '.join(f'{x:.2f}' for x in row['difference_rounds_s'])}) | {firsts} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
