"""The server side of privacy, compressed updates and monitoring, plugged into the round loop.

:class:`FederatedHooks` wraps the Flower strategy in Flower's DP wrapper
(``DifferentialPrivacyServerSideFixedClipping`` or ``...ClientSideFixedClipping``: clip each
update to ``C``, average, add Gaussian noise of std ``z C / m``), forces equal client weights
while DP is on (the mechanism's sensitivity assumes them), steps the privacy accountant once per
round that released an aggregate (sampling rate ``m / N``), and decodes compressed replies back to
full weights before the strategy sees them. The client side of both is in
:mod:`~torsh_distributed.federated.apps`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.server import RoundHooks
from torsh_distributed.federated.updates import LinkAdaptation, UpdateCodec, ctx_key, spec_of

__all__ = ["FederatedHooks", "WEIGHT_KEY"]

WEIGHT_KEY = "weight"
"""Metric the strategies weight by: the client's sample count, or 1 for every client under DP."""


class FederatedHooks(RoundHooks):
    """Privacy and compression for ``config`` (either may be off)."""

    def __init__(self, config: FederatedConfig) -> None:
        self.config = config
        self.privacy = config.privacy
        self.accountant: Any = None
        if self.privacy.enabled:
            from torsh_distributed.federated.privacy import PrivacyAccountant

            self.accountant = PrivacyAccountant(accountant=self.privacy.accountant)
        self.codecs: dict[str, UpdateCodec] = {}
        self.adaptive = LinkAdaptation(config.link_budget) if config.compression == "adaptive" else None
        self.epsilon = 0.0
        self.monitor: Any = None
        if config.metrics_port or config.dashboard_port:
            from torsh_distributed.federated.monitor import RoundMonitor

            self.monitor = RoundMonitor(
                job=Path(config.run_dir).name or "federated", rounds=config.rounds, clients=config.clients,
                metrics_port=config.metrics_port, dashboard_port=config.dashboard_port,
            )  # fmt: skip

    def on_round(self, record: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.round(record)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def wrap_strategy(self, strategy: Any) -> Any:
        if not self.privacy.enabled:
            return strategy
        from flwr.serverapp import strategy as fl

        wrapper = (
            fl.DifferentialPrivacyServerSideFixedClipping
            if self.privacy.clipping == "server"
            else fl.DifferentialPrivacyClientSideFixedClipping
        )
        wrapped = wrapper(
            strategy,
            noise_multiplier=self.privacy.noise_multiplier,
            clipping_norm=self.privacy.clipping_norm,
            num_sampled_clients=self.config.sampled_per_round,
        )
        wrapped.inner = strategy  # the round loop checkpoints the inner strategy's state
        return wrapped

    def _codec(self, spec: str) -> UpdateCodec:
        if spec not in self.codecs:
            self.codecs[spec] = UpdateCodec(spec, error_feedback=self.config.error_feedback, seed=self.config.seed)
        return self.codecs[spec]

    def configure(self, messages: list[Any]) -> dict[int, str]:
        """Give each message its client's method (``adaptive``); returns node -> method."""
        from flwr.app import ConfigRecord, RecordDict

        if self.adaptive is None:
            return {}
        chosen = {}
        for msg in messages:
            node = msg.metadata.dst_node_id
            chosen[node] = self.adaptive.method(node)
            content = msg.content  # shared by every message of the round: give each its own
            config = ConfigRecord({**content["config"], "compression": chosen[node]})
            msg.content = RecordDict({"arrays": content["arrays"], "config": config})
        return chosen

    def observe(self, node: int, link_s: float) -> None:
        """A client's link time this round (its turnaround minus its training)."""
        if self.adaptive is not None:
            self.adaptive.observe(node, link_s)

    def prepare(self, replies: list[Any], arrays: Any) -> list[Any]:
        from flwr.app import ArrayRecord

        global_state: dict[str, torch.Tensor] | None = None
        for reply in replies:
            content = reply.content
            if ctx_key() in content:  # a compressed update: back to weights
                if global_state is None:
                    global_state = arrays.to_torch_state_dict()
                payload = content["arrays"].to_torch_state_dict()
                ctx = str(content[ctx_key()]["json"])
                content["arrays"] = ArrayRecord(self._codec(spec_of(ctx)).decode(global_state, payload, ctx))
                del content[ctx_key()]
            if self.privacy.enabled:
                content["metrics"][WEIGHT_KEY] = 1.0
        return replies

    def round_metrics(self, server_round: int, answered: int, aggregated: bool) -> dict[str, Any]:
        if self.accountant is None:
            return {}
        if aggregated:
            rate = min(1.0, self.config.sampled_per_round / self.config.clients)
            self.accountant.step(noise_multiplier=self.privacy.noise_multiplier, sample_rate=rate)
            self.epsilon = self.accountant.epsilon(self.privacy.delta)
        return {"epsilon": self.epsilon, "delta": self.privacy.delta}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"compression": self.config.compression}
        if self.accountant is not None:
            out["epsilon"] = self.epsilon
            out["privacy"] = {
                "epsilon": self.epsilon,
                "delta": self.privacy.delta,
                "noise_multiplier": self.privacy.noise_multiplier,
                "clipping_norm": self.privacy.clipping_norm,
                "clipping": self.privacy.clipping,
                "accountant": self.privacy.accountant,
                "sample_rate": min(1.0, self.config.sampled_per_round / self.config.clients),
                "rounds_accounted": self.accountant.rounds,
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.accountant is not None:
            out.update(accountant=self.accountant.state_dict(), epsilon=self.epsilon)
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.accountant is not None and "accountant" in state:
            self.accountant.load_state_dict(state["accountant"])
            self.epsilon = float(state.get("epsilon", 0.0))
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
