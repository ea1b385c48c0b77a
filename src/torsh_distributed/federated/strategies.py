"""Flower's strategies for a run's config, and their state for the server's checkpoints.

The strategies are Flower's own (``flwr.serverapp.strategy``): FedAvg, FedProx, FedAdam, FedYogi,
FedAdagrad, FedAvgM. Their server-side state (FedOpt's moments ``m_t``/``v_t``, FedAvgM's momentum,
the arrays they were last configured with) lives in attributes; :func:`strategy_state` and
:func:`load_strategy_state` turn it into tensors and back, so a resumed server continues the same
optimizer trajectory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torsh_distributed.federated.config import FederatedConfig

__all__ = ["build_strategy", "load_strategy_state", "strategy_state", "user_strategy"]

_STATE_ATTRS = ("m_t", "v_t", "momentum_vector")


def build_strategy(config: FederatedConfig) -> Any:
    """The Flower strategy ``config.strategy`` names, sampling ``config.fraction`` of the
    connected clients (at least ``min_clients``) and weighting by each client's sample count."""
    from flwr.serverapp import strategy as fl

    common: dict[str, Any] = {
        "fraction_train": config.fraction,
        "fraction_evaluate": config.fraction_evaluate,  # 0: only the server evaluates
        "min_train_nodes": config.min_clients,
        "min_evaluate_nodes": 1 if config.fraction_evaluate else 0,
        "min_available_nodes": config.min_clients,
        "weighted_by_key": "weight",  # the sample count; 1 for every client under DP
    }
    name = config.strategy
    if config.user_strategy:
        return user_strategy(name, common)
    if name == "fedavg":
        return fl.FedAvg(**common)
    if name == "fedprox":
        return fl.FedProx(**common, proximal_mu=config.proximal_mu)
    if name == "fedavgm":
        return fl.FedAvgM(**common, server_learning_rate=1.0, server_momentum=config.server_momentum)
    opt = {"eta": config.server_lr, "eta_l": config.client.lr, "tau": config.tau}
    if name == "fedadam":
        return fl.FedAdam(**common, **opt)
    if name == "fedyogi":
        return fl.FedYogi(**common, **opt)
    if name == "fedadagrad":
        return fl.FedAdagrad(**common, **opt)
    raise ValueError(f"unknown strategy {name!r}")  # FederatedConfig refuses it first


def user_strategy(spec: str, settings: dict[str, Any]) -> Any:
    """The Flower ``Strategy`` the user's factory ``spec`` (MODULE:FUNCTION) returns, called with
    those of ``settings`` its signature names (all of them with ``**kwargs``).

    Raises:
        ValueError: the factory cannot be loaded, raises, or returns no Flower ``Strategy``.
    """
    import inspect

    from flwr.serverapp.strategy import Strategy

    from torsh_distributed.engine.user import _callable

    factory = _callable(spec, what="strategy")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: call it bare
        params = {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = dict(settings)
    else:
        kwargs = {k: v for k, v in settings.items() if k in params}
    try:
        strategy = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's factory failed: one line, not a trace
        raise ValueError(f"--strategy {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(strategy, Strategy):
        raise ValueError(
            f"--strategy {spec} returned {type(strategy).__name__}, not a Flower Strategy "
            "(flwr.serverapp.strategy.Strategy, e.g. a FedAvg subclass)"
        )
    return strategy


def _to_tensors(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        return {k: _to_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_tensors(v) for v in value]
    raise TypeError(f"strategy state of type {type(value).__name__} cannot be checkpointed")


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    return [_to_numpy(v) for v in value]


def strategy_state(strategy: Any) -> dict[str, Any]:
    """The strategy's server-side optimizer state as tensors (empty for FedAvg/FedProx)."""
    return {
        name: _to_tensors(getattr(strategy, name))
        for name in _STATE_ATTRS
        if getattr(strategy, name, None) is not None
    }


def load_strategy_state(strategy: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`strategy_state` saved.

    Raises:
        ValueError: the state holds attributes this strategy does not have (another strategy).
    """
    for name, value in state.items():
        if name not in _STATE_ATTRS or not hasattr(strategy, name):
            raise ValueError(
                f"the checkpoint's server state has {name!r}, which {type(strategy).__name__} "
                "does not keep: it was written by another strategy"
            )
        setattr(strategy, name, _to_numpy(value))
