"""``torsh-dist energy report RUN``: the energy and carbon of a finished run.

``RUN`` is the ``--summary-json`` file of ``torsh-dist train`` or a directory holding it (the
newest JSON with an ``energy`` block is read). Prints the job's energy (joules, per step / sample
/ token, average power, the meter and whether it measured or estimated), its carbon (grams CO2e
and where the intensity came from) and one row per rank; ``--plot FILE`` also draws each rank's
power over time and its energy (needs matplotlib). ``--json`` prints the two blocks as JSON.
"""

from __future__ import annotations

import argparse
import json

from torsh_distributed.energy.report import find_summary, format_report, load_summary, plot_report

__all__ = ["register"]

_EPILOG = """\
examples:
  torsh-dist train --nproc-per-node 2 --preset tiny --carbon.region DEU --summary-json runs/a/summary.json
  torsh-dist energy report runs/a                     # the newest summary under runs/a
  torsh-dist energy report runs/a/summary.json --plot runs/a/energy.png
  torsh-dist energy report runs/a --json | jq .carbon.grams
"""


def _report(args: argparse.Namespace) -> int:
    path = find_summary(args.run)
    data = load_summary(path)
    if args.json:
        print(json.dumps({"energy": data["energy"], "carbon": data.get("carbon", {})}, indent=2))
    else:
        print(format_report(data, path=path))
    if args.plot:
        print(f"energy plot written to {plot_report(data, args.plot)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``energy`` command and its ``report`` subcommand."""
    parser = sub.add_parser(
        "energy",
        help="energy and carbon of a finished run (joules per step and token, grams CO2e, by rank)",
        description="Energy and carbon of training runs (docs/energy.md).",
    )
    actions = parser.add_subparsers(dest="energy_command", metavar="ACTION")
    actions.required = True
    report = actions.add_parser(
        "report",
        help="the energy/carbon report of a run's --summary-json",
        description=(
            "Report the energy (measured by RAPL or NVML, or estimated from CPU time: always\n"
            "labelled) and the carbon of a finished run, for the job and for every rank, from the\n"
            "JSON summary torsh-dist train wrote with --summary-json (docs/energy.md)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("run", metavar="RUN", help="a --summary-json file, or a directory holding one")
    report.add_argument("--plot", metavar="FILE", help="also write each rank's power and energy to this PNG (.svg, .pdf)")
    report.add_argument("--json", action="store_true", help="print the energy and carbon blocks as JSON")
    report.set_defaults(handler=_report)
