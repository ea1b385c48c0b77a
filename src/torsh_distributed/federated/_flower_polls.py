"""Flower's idle polls, shortened: a federation's rounds do not wait out Flower's 3-second sleeps.

Flower 1.42 moves every message by polling, and two of its polls sleep a hard-coded 3 s when
they find nothing:

* the SuperNode asks the SuperLink for a message, and sleeps 3 s when there is none
  (``supernode/start_client_internal.py:263``), so a message sent while it sleeps waits up to 3 s;
* the ServerApp pushes a round's messages, then asks for the replies every 3 s until all are in
  (``superlink/grid/http_grid.py:412``), so a round that the clients finish in 0.2 s takes 3 s.

A third, the SuperExec asking its SuperNode for a ClientApp to start, sleeps
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s (1 by default; Flower's own setting, set here too). With
few clients and short local work, these sleeps were most of a round (docs/benchmarks.md,
"Federated rounds and Flower's polls"). Each poll is one small request to a SuperLink or
SuperNode on this host or the federation's network: at 0.25 s, four per second per node while
it idles.

The sleeps are shortened where they are, in the processes this package starts: the SuperNode
runs as ``python -m torsh_distributed.federated._flower_polls flower-supernode ARGS`` (Flower's
own ``flower_supernode`` main), and the ServerApps forked warm by
:mod:`~torsh_distributed.federated._warm_node` get the same before Flower's main runs. In each,
the module's ``time`` is replaced by :class:`PollClock`: ``time`` itself but for a
``sleep(3)``, which sleeps the poll interval. A Flower whose source no longer holds that sleep is
left as it is, and says so once in its log: nothing else changes how Flower behaves.

The interval comes from ``TORSH_FLOWER_POLL_S`` (set by
:class:`~torsh_distributed.federated.deploy.Federation` and
:func:`~torsh_distributed.federated.deploy.join` from their ``poll_s``; ``3`` is Flower's own).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

__all__ = [
    "DEFAULT_POLL_S",
    "FLOWER_IDLE_S",
    "POLL_ENV",
    "SERVERAPP_SITE",
    "SUPEREXEC_POLL_ENV",
    "SUPERNODE_SITE",
    "PollClock",
    "check_poll",
    "main",
    "poll_from_env",
    "shorten_idle_polls",
]

POLL_ENV = "TORSH_FLOWER_POLL_S"
SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
DEFAULT_POLL_S = 0.25
"""Seconds between an idle SuperNode's, ServerApp's and SuperExec's polls (chosen by
``benchmarks/bench_federated_polls.py``)."""
FLOWER_IDLE_S = 3.0
"""Flower's hard-coded idle sleep in the two sites below."""
SUPERNODE_SITE = "flwr.supernode.start_client_internal"
SERVERAPP_SITE = "flwr.superlink.grid.http_grid"
_FLOWER_SLEEP = "time.sleep(3)"
_log = logging.getLogger(__name__)


def check_poll(poll_s: float, *, name: str = "poll_s") -> float:
    """``poll_s`` if it is a number of seconds in (0, 3], else a ValueError naming ``name``."""
    if (
        not isinstance(poll_s, int | float)
        or isinstance(poll_s, bool)
        or not 0 < poll_s <= FLOWER_IDLE_S
    ):
        raise ValueError(
            f"{name} must be seconds in (0, {FLOWER_IDLE_S:g}] (3 = Flower's own), got {poll_s!r}"
        )
    return float(poll_s)


def poll_from_env(env: Mapping[str, str] = os.environ) -> float | None:
    """The interval ``TORSH_FLOWER_POLL_S`` asks for; None when unset."""
    raw = env.get(POLL_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{POLL_ENV}={raw!r} is not a number of seconds") from None
    return check_poll(value, name=POLL_ENV)


class PollClock:
    """Stands for the ``time`` module inside one Flower module: every attribute is ``time``'s,
    except that ``sleep(3)`` (Flower's idle poll) sleeps ``poll_s``."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = check_poll(poll_s)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self.poll_s if seconds == FLOWER_IDLE_S else seconds)


def shorten_idle_polls(poll_s: float | None, sites: tuple[str, ...]) -> list[str]:
    """Make the Flower modules ``sites`` sleep ``poll_s`` where they sleep 3 s idle; returns the
    sites changed. ``None`` (no interval asked for) or 3 (Flower's own) changes nothing. A site
    whose source lacks ``time.sleep(3)`` or that does not use the ``time`` module is left as it
    is (logged): that Flower polls as it chose."""
    if poll_s is None:
        return []
    poll_s = check_poll(poll_s)
    if poll_s == FLOWER_IDLE_S:
        return []
    changed = []
    for site in sites:
        module: ModuleType = importlib.import_module(site)
        current = getattr(module, "time", None)
        if isinstance(current, PollClock):
            current.poll_s = poll_s
            changed.append(site)
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            source = ""
        if current is not time or _FLOWER_SLEEP not in source:
            _log.warning(
                "%s: no %s idle poll in this Flower; its polls are left as Flower has them",
                site,
                _FLOWER_SLEEP,
            )
            continue
        module.time = PollClock(poll_s)  # type: ignore[attr-defined]
        changed.append(site)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python -m torsh_distributed.federated._flower_polls flower-supernode ARGS...``: Flower's
    SuperNode, idle-polling every ``TORSH_FLOWER_POLL_S`` s (unset: Flower's own 3 s)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or Path(args[0]).name != "flower-supernode":
        print(
            "usage: python -m torsh_distributed.federated._flower_polls flower-supernode ARGS...",
            file=sys.stderr,
        )
        return 2
    from torsh_distributed.elastic import _warm

    script = Path(sys.executable).parent / "flower-supernode"
    sys.argv = [str(script) if script.exists() else "flower-supernode", *args[1:]]
    _warm.set_title([sys.executable, *sys.argv])  # `ps` shows the SuperNode as Flower starts it
    shorten_idle_polls(poll_from_env(), (SUPERNODE_SITE,))
    from flwr.supernode.cli import flower_supernode

    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
