"""Elastic launching: ``launch`` runs a script on N processes per node through torch's agent.

``torsh-dist run`` is the command-line face of :func:`launch`; :class:`LaunchOptions` mirrors
torchrun's flags.
"""

from torsh_distributed.elastic.launch import LaunchOptions, launch

__all__ = ["LaunchOptions", "launch"]
