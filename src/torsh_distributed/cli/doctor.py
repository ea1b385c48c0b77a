"""``torsh-dist doctor``: this host's GPUs, NICs and the NCCL/Gloo settings they call for.

Reads ``/sys/class/net``, ``/sys/class/infiniband`` and ``nvidia-smi topo -m`` (or recorded
copies: ``--sysfs-root DIR --topo FILE``) and prints each setting with its reason
(docs/topology.md). Changes nothing; ``--env`` prints ``export`` lines to source.
"""

from __future__ import annotations

import argparse
import json

from torsh_distributed.runtime.topology import diagnose, format_env, format_report, load_topology

__all__ = ["register"]

_EPILOG = """\
examples:
  torsh-dist doctor                                  # this host: /sys and nvidia-smi topo -m
  eval "$(torsh-dist doctor --env)"                  # export the settings into this shell
  torsh-dist doctor --json | jq .env
  torsh-dist doctor --sysfs-root tests/data/topology/h100-sxm-8gpu-ndr/root \\
      --topo tests/data/topology/h100-sxm-8gpu-ndr/topo.txt
"""


def _doctor(args: argparse.Namespace) -> int:
    live = args.sysfs_root == "/"
    topo, note = load_topology(args.topo, live=live)
    report = diagnose(sysfs_root=args.sysfs_root, topo=topo, topo_note=note)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif args.env:
        print(format_env(report))
    else:
        print(format_report(report))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``doctor`` command."""
    parser = sub.add_parser(
        "doctor",
        help="GPU interconnect, NICs and the NCCL/Gloo settings they call for, each with a reason",
        description=(
            "Report this host's GPU links (nvidia-smi topo -m), network interfaces and\n"
            "InfiniBand/RoCE ports (sysfs), and the launch environment they call for:\n"
            "NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_DISABLE, each GPU's\n"
            "nearest NIC and NUMA node, with a one-line reason per setting (docs/topology.md).\n"
            "Nothing is changed."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sysfs-root", metavar="DIR", default="/",
        help="read DIR/sys/class/... instead of /sys (a recorded machine); nvidia-smi is then "
             "not run: give --topo",
    )
    parser.add_argument(
        "--topo", metavar="FILE",
        help="the saved output of `nvidia-smi topo -m` (default: run it when on PATH)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--env", action="store_true", help="print `export VAR=value  # reason` lines")
    out.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.set_defaults(handler=_doctor)
