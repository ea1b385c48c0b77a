"""Elastic training: ``launch`` runs a script on N processes per node through torch's agent, and
:class:`ElasticState` / :func:`run` let a user's own loop continue after a restart.

``torsh-dist run`` is the command-line face of :func:`launch`; :class:`LaunchOptions` mirrors
torchrun's flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torsh_distributed.elastic.launch import LaunchOptions, launch

if TYPE_CHECKING:
    from torsh_distributed.elastic.state import ElasticState, run

__all__ = ["ElasticState", "LaunchOptions", "launch", "run"]

_STATE = ("ElasticState", "run")


def __getattr__(name: str) -> Any:
    # Imported on first use: the state needs the checkpoint manager (torch.distributed.checkpoint,
    # about 0.5 s to import), which `torsh-dist run` does not, and it imports this package first.
    if name in _STATE:
        from torsh_distributed.elastic import state

        return getattr(state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
