"""Federated learning on Flower: rounds whose clients are the engine, on any model.

The server and the clients are Flower's (SuperLink, SuperNodes, ``ServerApp``/``ClientApp`` over
its deployment engine); what this package adds is the client's local training with
:class:`~torsh_distributed.engine.Engine` (also as an N-rank data-parallel job), partitioners of
any dataset, the server's round loop with a deadline, checkpoints and metrics, privacy
accounting and compressed updates. See docs/federated.md.
"""

from __future__ import annotations

from torsh_distributed.federated.config import ClientConfig, FederatedConfig

__all__ = ["ClientConfig", "FederatedConfig"]
