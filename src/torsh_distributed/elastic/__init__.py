"""Elastic training: ``launch`` runs a script on N processes per node through torch's agent, and
:class:`ElasticState` / :func:`run` let a user's own loop continue after a restart.

``torsh-dist run`` is the command-line face of :func:`launch`; :class:`LaunchOptions` mirrors
torchrun's flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.elastic._options import LaunchOptions
    from torsh_distributed.elastic.launch import launch
    from torsh_distributed.elastic.state import ElasticState, run

__all__ = ["ElasticState", "LaunchOptions", "launch", "run"]

# Imported on first use: launch needs torch's elastic agent and the state the checkpoint manager
# (torch.distributed.checkpoint), neither of which `torsh-dist run --help` or a refused flag needs.
__getattr__, __dir__ = exports(
    __name__, {"_options": ("LaunchOptions",), "launch": ("launch",), "state": ("ElasticState", "run")}
)
