"""Replica groups only: the healthy group's stall, the restarted group's rejoin by phase, and the
per-step cost of torchft against the same job without replica groups.

Narrower than ``bench_ft.py`` (no full-restart runs): the job is the same ``torsh-dist train
--nproc-per-node 4 --zero-stage 2 --preset tiny`` and the kill is the same SIGKILL of rank 3 (group
1) after step ``--kill-step``. Printed per kill run: the healthy group's stall (the gap between its
commits around the kill, less its median step), the rejoin time and where it went (the restarted
group's event lines: back-off, start-up and imports, model and group, torchft's manager, first
quorum call, quorum and live state). With ``--clean``, also a clean run with and without replica
groups, side by side, and where the replica-groups run's time went (quorum, cross-group
all-reduce, commit vote: totals over all steps of the reporting rank). Extra ``--ft.*`` flags go
to the replica-groups runs (``--ft-arg=--ft.heartbeat-timeout-s --ft-arg=1.0``). ``--vs-torchft``
runs each kill also with torchft's own lighthouse and no spare group (how the launcher worked
before), interleaved. The spare group is started once both groups are up and takes a few
seconds to import: a kill before that (``--kill-step`` small) finds it still importing.

Usage::

    python benchmarks/bench_ft_recovery.py [--kills 2] [--steps 160] [--kill-step 60] [--clean]
        [--vs-torchft] [--ft-arg ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ft import _job  # noqa: E402

BEFORE = ("--ft.lighthouse", "torchft", "--ft.spare-group", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=1, help="kill runs")
    parser.add_argument("--clean", action="store_true", help="also clean runs, with and without")
    parser.add_argument("--ft-arg", action="append", default=[], help="extra flag (repeat)")
    parser.add_argument(
        "--vs-torchft",
        action="store_true",
        help="each kill run also with torchft's lighthouse and no spare group, interleaved",
    )
    args = parser.parse_args()
    extra = tuple(args.ft_arg)
    common = {"kill_step": args.kill_step, "every": 0, "steps": args.steps, "extra": extra}
    loads = [os.getloadavg()[0]]
    if args.clean:
        for mode in ("none", "replica groups"):
            out = _job(mode, kill=False, **common)
            loads.append(os.getloadavg()[0])
            print(
                f"clean, {mode}: wall {out['wall_s']:.1f} s (training {out['fit_s']:.1f} s), "
                f"final loss {out['final_loss']:.4f}, "
                f"torchft time {json.dumps(out.get('ft_time_s'))} (load {loads[-1]:.1f})",
                flush=True,
            )
    variants = {"": extra}
    if args.vs_torchft:  # before this change: torchft's lighthouse, fresh processes
        variants = {"torchft lighthouse, no spare": (*extra, *BEFORE), "default": extra}
    for _ in range(args.kills):
        for name, flags in variants.items():  # interleaved: both see the same load drift
            out = _job("replica groups", kill=True, **{**common, "extra": flags})
            loads.append(os.getloadavg()[0])
            failure = out["failures"][0]
            phases = failure.get("rejoin_phases_s", {})
            print(
                f"kill{f' ({name})' if name else ''}: stall {out['stall_s']} s "
                f"({out['stall_steps']} steps of {out['median_step_s']:.3f} s; quorum back "
                f"{failure.get('quorum_after_death_s')} s and commit "
                f"{failure.get('commit_after_death_s')} s after the launcher saw the death), "
                f"rejoin {out['recovery_s']} s at step {out['rejoined_step']}, phases (s after "
                f"the death) {json.dumps(phases)}, failures {len(out['failures'])}, wall "
                f"{out['wall_s']:.1f} s (load {loads[-1]:.1f})",
                flush=True,
            )
    print(f"load average (1 min): {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
