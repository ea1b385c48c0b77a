"""Client-level differential privacy for federated rounds: the mechanism and its accountant.

The mechanism (DP-FedAvg, McMahan et al. 2018, "Learning differentially private recurrent
language models", with fixed clipping, Andrew et al.'s FlatClip):

1. Each round the server samples ``m`` of the ``N`` clients (sampling rate ``q = m / N``).
2. Each sampled client's update ``Delta_i = w_i - w_global`` is clipped to L2 norm ``C`` over
   all its tensors together: ``Delta_i * min(1, C / ||Delta_i||)`` (:func:`clip_update`), on
   the client (``clipping="client"``) or on the server (``clipping="server"``).
3. The server averages the ``m`` clipped updates with equal weights and adds Gaussian noise
   ``N(0, (z * C / m)^2)`` to every coordinate of the average (:func:`add_gaussian_noise`,
   :func:`noise_std`), ``z`` the noise multiplier. Adding or removing one client changes the
   sum of clipped updates by at most ``C``, so this is the Gaussian mechanism of noise
   multiplier ``z`` on the sum, scaled by ``1 / m``.

Per round this is the subsampled Gaussian mechanism with ``(z, q)``; over ``T`` rounds the
accountant composes ``T`` of them (:class:`PrivacyAccountant`, Opacus's RDP or PRV accountant)
and reports ``epsilon`` at a given ``delta``: the guarantee is about whether any one *client*
(all its data) took part, not any one example.

Matching Flower. ``flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping`` and
``DifferentialPrivacyClientSideFixedClipping`` (flwr 1.42, ``dp_fixed_clipping.py``) implement
exactly this mechanism: the server-side wrapper clips each reply's ``w_i - w_global`` to
``clipping_norm`` (``compute_clip_model_update``), the client-side one leaves it to the
client's ``fixedclipping_mod``; both then let the wrapped FedAvg aggregate and add
``N(0, std^2)`` to every coordinate of the aggregated *parameters* with
``std = noise_multiplier * clipping_norm / num_sampled_clients`` (``compute_stdv``). Noise on
``w_global + mean(Delta_i)`` is noise on the mean update, so :func:`noise_std` equals Flower's
``std`` and the accountant's noise multiplier is Flower's ``noise_multiplier``: build the
wrapper with ``noise_multiplier=z, clipping_norm=C, num_sampled_clients=m`` and call
``accountant.step(noise_multiplier=z, sample_rate=m / N)`` once per round that released an
aggregate. Two conditions of the guarantee that the wrapper does not enforce by itself:

* Equal weights. FedAvg weights replies by their example counts; the sensitivity ``C / m``
  holds only for the uniform mean (Flower's own accounted mode refuses unequal weights for this
  reason). Send the same weight from every client when DP is on.
* Sampling. Opacus's analysis of the sampled Gaussian assumes Poisson sampling with rate
  ``q``; Flower samples exactly ``m`` clients without replacement. Using ``q = m / N`` is the
  customary approximation (McMahan et al. 2018 use it); ``sample_rate=1.0`` (every client every
  round, or no credit for sampling at all) is exact, and is what Flower's own accountant does in
  the ``no-amplification`` mode its fixed-clipping wrappers require (that accountant needs
  Google's ``dp-accounting`` package, which ``flwr[dp]`` installs and we do not).

Torch and Opacus are imported by the functions that need them, so the config is torch-free.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACCOUNTANTS",
    "CLIPPING",
    "PrivacyAccountant",
    "PrivacyConfig",
    "add_gaussian_noise",
    "clip_update",
    "global_norm",
    "noise_std",
    "private_mean",
]

ACCOUNTANTS = ("rdp", "prv")
"""Opacus accountants :class:`PrivacyAccountant` can use."""

CLIPPING = ("server", "client")
"""Where client updates are clipped."""

Update = TypeVar("Update", "Mapping[str, torch.Tensor]", "Sequence[torch.Tensor]")


@dataclass(kw_only=True, slots=True)
class PrivacyConfig:
    """Client-level differential privacy (DP-FedAvg with fixed clipping); off by default."""

    noise_multiplier: float = 0.0
    """``z``: Gaussian noise of std ``z * clipping_norm / m`` on the mean of the ``m`` sampled
    clients' clipped updates; 0 = DP off. Bigger = smaller epsilon but a noisier model (about
    1.0 is a common start; with few clients per round the noise dominates the update)."""
    clipping_norm: float = 1.0
    """``C``: each client's update is scaled down to this L2 norm (over all its tensors). Small =
    more updates clipped (bias); large = more noise for the same epsilon, since noise scales
    with ``C``. Set it near the typical update norm."""
    delta: float = 0.0
    """The ``delta`` of the reported ``(epsilon, delta)``, in (0, 1); required when DP is on
    (0 = not given). Choose it well below ``1 / num_clients``."""
    clipping: str = "server"
    """``server``: the server clips the updates it receives (it sees them unclipped);
    ``client``: each client clips its own update before sending it (needed with secure
    aggregation, where the server never sees an individual update)."""
    accountant: str = "rdp"
    """``rdp`` (Renyi DP, Opacus's default: instant) or ``prv`` (privacy loss random variables,
    Gopi et al. 2021: tighter epsilon, ~0.1-0.5 s per query)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"privacy.noise_multiplier must be >= 0 (0 = DP off), got {self.noise_multiplier}"
            )
        if not (math.isfinite(self.clipping_norm) and self.clipping_norm > 0):
            raise ValueError(f"privacy.clipping_norm must be > 0, got {self.clipping_norm}")
        if not (math.isfinite(self.delta) and 0 <= self.delta < 1):
            raise ValueError(f"privacy.delta must be in (0, 1) (0 = not given), got {self.delta}")
        if self.clipping not in CLIPPING:
            raise ValueError(
                f"privacy.clipping must be one of {', '.join(CLIPPING)}, got {self.clipping!r}"
            )
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(
                f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, "
                f"got {self.accountant!r}"
            )
        if self.enabled and self.delta == 0:
            raise ValueError(
                f"DP without a delta: privacy.noise_multiplier {self.noise_multiplier:g} needs "
                "privacy.delta in (0, 1) for the (epsilon, delta) it reports, e.g. 1e-5 "
                "(well below 1 / number of clients)"
            )
        if not self.enabled and self.delta:
            warnings.warn(
                f"privacy.delta {self.delta:g} is ignored: DP is off (privacy.noise_multiplier 0)",
                stacklevel=3,
            )

    @property
    def enabled(self) -> bool:
        """True when noise is added (``noise_multiplier > 0``)."""
        return self.noise_multiplier > 0

    def noise_std(self, num_sampled_clients: int) -> float:
        """The std of the noise on the mean of ``num_sampled_clients`` clipped updates."""
        return noise_std(
            noise_multiplier=self.noise_multiplier,
            clipping_norm=self.clipping_norm,
            num_sampled_clients=num_sampled_clients,
        )


def noise_std(*, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int) -> float:
    """``z * C / m``: the per-coordinate std of the noise on the mean of ``m`` clipped updates
    (Flower's ``compute_stdv``)."""
    if num_sampled_clients < 1:
        raise ValueError(f"num_sampled_clients must be >= 1, got {num_sampled_clients}")
    return float(noise_multiplier * clipping_norm / num_sampled_clients)


# --- the accountant ---------------------------------------------------------------------------


class PrivacyAccountant:
    """The ``(epsilon, delta)`` spent by the rounds so far: Opacus's accountant, with plain state.

    One :meth:`step` per round that released a noisy aggregate. The state is the history of
    ``(noise_multiplier, sample_rate, rounds)`` runs, so a resumed server that loads it reports
    the same epsilon as one that never stopped.

    Args:
        accountant: ``rdp`` (``opacus.accountants.RDPAccountant``) or ``prv``
            (``opacus.accountants.PRVAccountant``: tighter, slower).

    Raises:
        ValueError: unknown ``accountant``.
    """

    def __init__(self, *, accountant: str = "rdp") -> None:
        if accountant not in ACCOUNTANTS:
            raise ValueError(
                f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}"
            )
        from opacus.accountants import PRVAccountant, RDPAccountant

        self.mechanism = accountant
        self._impl: Any = RDPAccountant() if accountant == "rdp" else PRVAccountant()

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``(noise_multiplier, sample_rate, rounds)`` runs, oldest first (a copy)."""
        return [(float(z), float(q), int(n)) for z, q, n in self._impl.history]

    @property
    def rounds(self) -> int:
        """Rounds accounted so far."""
        return sum(n for _, _, n in self._impl.history)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Account one round: the subsampled Gaussian mechanism with ``(z, q)``.

        Args:
            noise_multiplier: ``z`` of the round (the noise std on the mean is ``z * C / m``).
            sample_rate: ``q = m / N``, sampled clients over all clients; 1.0 = no credit
                for sampling (exact with full participation; see the module docstring).

        Raises:
            ValueError: ``noise_multiplier`` <= 0 (no noise: epsilon is infinite) or
                ``sample_rate`` outside (0, 1].
        """
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(
                "noise_multiplier must be > 0 to account a round (0 = no privacy), "
                f"got {noise_multiplier}"
            )
        if not (math.isfinite(sample_rate) and 0 < sample_rate <= 1):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self._impl.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    def epsilon(self, delta: float) -> float:
        """The ``epsilon`` spent so far at ``delta`` (0.0 before the first round).

        Raises:
            ValueError: ``delta`` outside (0, 1).
        """
        if not (math.isfinite(delta) and 0 < delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if not self._impl.history:
            return 0.0
        with warnings.catch_warnings():
            # PRV at sample_rate 1 takes log(0) on a branch np.where then discards.
            warnings.simplefilter("ignore", RuntimeWarning)
            return float(self._impl.get_epsilon(delta))

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``{"accountant": "rdp", "history": [[z, q, rounds], ...]}``."""
        return {"accountant": self.mechanism, "history": [list(run) for run in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (also after a JSON round trip).

        Raises:
            ValueError: the state is of the other accountant or malformed.
        """
        if state.get("accountant") != self.mechanism:
            raise ValueError(
                f"privacy state of accountant {state.get('accountant')!r} cannot be loaded into "
                f"the {self.mechanism!r} accountant"
            )
        history = []
        for run in state.get("history", ()):
            z, q, n = run
            if not (z > 0 and 0 < q <= 1 and int(n) == n and n >= 1):
                raise ValueError(f"malformed privacy history entry {run!r}")
            history.append((float(z), float(q), int(n)))
        self._impl.history = history


# --- the mechanism ----------------------------------------------------------------------------


def _tensors(
    update: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(update, Mapping):
        items = list(update.items())
    else:
        items = [(str(i), t) for i, t in enumerate(update)]
    for name, tensor in items:
        if not tensor.is_floating_point():
            raise TypeError(
                f"tensor {name!r} has dtype {tensor.dtype}: clipping and noise apply to floating "
                "tensors only; leave integer buffers (e.g. BatchNorm's num_batches_tracked) out "
                "of the update"
            )
    return items


def _rebuild(update: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
             items: list[tuple[str, torch.Tensor]]) -> Any:
    if isinstance(update, Mapping):
        return dict(items)
    return [t for _, t in items]


def global_norm(update: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> float:
    """L2 norm of all tensors of ``update`` taken as one vector (accumulated in float64)."""
    import torch

    items = _tensors(update)
    if not items:
        return 0.0
    squares = [torch.linalg.vector_norm(t.detach().double()) ** 2 for _, t in items]
    return float(torch.stack(squares).sum().sqrt())


def clip_update(update: Update, max_norm: float) -> tuple[Update, float]:
    """Scale ``update`` so that its global L2 norm is at most ``max_norm``.

    The scale is ``min(1, max_norm / norm)`` for all tensors together (FlatClip, as Flower's
    ``clip_inputs_inplace``): directions are kept, and an update already inside the ball is
    returned unchanged in value.

    Args:
        update: Tensors by name, or a list of tensors (a client's ``w_i - w_global``). Not
            modified.
        max_norm: ``C``.

    Returns:
        The clipped update (new tensors, same container type) and the norm before clipping.

    Raises:
        ValueError: ``max_norm`` <= 0.
        TypeError: a tensor is not floating point.
    """
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norm = global_norm(update)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    items = [(name, t.detach() * scale) for name, t in _tensors(update)]
    return _rebuild(update, items), norm


def add_gaussian_noise(
    aggregate: Update, *, std: float, generator: torch.Generator | None = None
) -> Update:
    """``aggregate`` plus independent ``N(0, std^2)`` noise on every coordinate.

    Args:
        aggregate: The mean of the clipped updates (or the new global parameters, as Flower
            noises them). Not modified.
        std: :func:`noise_std` of the round; 0 returns copies.
        generator: Source of the noise (seed it for reproducible runs; ``None`` = torch's
            global generator). It must live on the tensors' device.

    Returns:
        New tensors, same container type.

    Raises:
        ValueError: ``std`` < 0.
        TypeError: a tensor is not floating point.
    """
    import torch

    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be >= 0, got {std}")
    items = []
    for name, t in _tensors(aggregate):
        noise = torch.randn(t.shape, generator=generator, dtype=t.dtype, device=t.device)
        items.append((name, t.detach() + std * noise))
    return _rebuild(aggregate, items)


def private_mean(
    updates: Sequence[Update],
    *,
    clipping_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
) -> tuple[Update, list[float]]:
    """The whole mechanism of one round on the server: clip each update, take the uniform mean,
    add ``N(0, (z * C / m)^2)``, for a path that aggregates without Flower's wrapper.

    Args:
        updates: The ``m`` sampled clients' updates (same names and shapes).
        clipping_norm: ``C``.
        noise_multiplier: ``z`` (0 = clipping only, no privacy).
        generator: Source of the noise.

    Returns:
        The noisy mean (same container type as the updates) and each update's norm before
        clipping (for monitoring the choice of ``C``).

    Raises:
        ValueError: no updates, or ``clipping_norm`` <= 0, or ``noise_multiplier`` < 0.
    """
    if not updates:
        raise ValueError("private_mean needs at least one update")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    clipped, norms = zip(*(clip_update(u, clipping_norm) for u in updates), strict=True)
    m = len(updates)
    mean: Any
    if isinstance(updates[0], Mapping):
        mean = {name: sum(c[name] for c in clipped) / m for name in updates[0]}
    else:
        mean = [sum(c[i] for c in clipped) / m for i in range(len(updates[0]))]
    std = noise_std(noise_multiplier=noise_multiplier, clipping_norm=clipping_norm,
                    num_sampled_clients=m)
    return add_gaussian_noise(mean, std=std, generator=generator), list(norms)
