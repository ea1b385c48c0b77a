"""A pre-started rank of the replica-group launcher (``ft.spare_group``).

A restarted group's fresh processes spent most of their rejoin starting the interpreter and
importing torch, torchft and the engine (12 of 15 s at load 3-10). The launcher keeps one group's
worth of these processes started ahead: each imports what every rank imports, then blocks on its
stdin. To restart a group the launcher writes one JSON line there, the rank's environment
(``RANK``, ``MASTER_PORT``, ``TORSH_FT_*``, ...); the process takes it and runs the worker command
as ``python`` would have (``-m module`` or a script path, with its arguments). End of input without
a line: not needed, exit 0.

Usage (the launcher's)::

    python -m torsh_distributed.ft._spare <worker command without the interpreter>
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys

_PREIMPORT = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",  # torch's optimizers import it at their first step
    "torchft",
    "torsh_distributed.engine.engine",
    "torsh_distributed.engine._ft",
    "torsh_distributed.ft._transport",
    "torsh_distributed.cli.train",
    "torsh_distributed.train.trainer",
)
"""What every rank imports before its first step (the built-in trainer's included: cheap)."""


def main(command: list[str]) -> int:
    if not command:
        raise SystemExit("usage: python -m torsh_distributed.ft._spare <worker command>")
    for name in _PREIMPORT:
        importlib.import_module(name)
    if command[0] == "-m":
        spec = importlib.util.find_spec(command[1])
        if spec is not None and spec.submodule_search_locations is not None:
            importlib.import_module(command[1])  # a package: its __init__ (never its __main__)
    line = sys.stdin.readline()
    if not line:
        return 0
    os.environ.clear()
    os.environ.update(json.loads(line))
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for the rest of its life
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.abspath(command[0]))  # as `python script.py`
        runpy.run_path(command[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
