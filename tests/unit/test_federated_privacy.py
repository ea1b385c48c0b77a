"""Client-level DP: the accountant against Opacus's own analysis, clipping, noise, the config."""

from __future__ import annotations

import json
import math

import pytest
import torch
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from torsh_distributed.federated.privacy import (
    PrivacyAccountant,
    PrivacyConfig,
    add_gaussian_noise,
    clip_update,
    noise_std,
    private_mean,
)

# Opacus's RDPAccountant.DEFAULT_ALPHAS, written out so that the test does not use the class
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def _reference_epsilon(runs: list[tuple[float, float, int]], delta: float) -> float:
    rdp = sum(compute_rdp(q=q, noise_multiplier=z, steps=n, orders=ORDERS) for z, q, n in runs)
    eps, _ = get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
    return float(eps)


def test_epsilon_equals_opacus_analysis_for_the_same_noise_rate_and_rounds():
    acc = PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0
    runs = [(1.1, 0.5, 3), (0.8, 0.5, 2), (1.1, 1.0, 4)]
    for z, q, n in runs:
        for _ in range(n):
            acc.step(noise_multiplier=z, sample_rate=q)
    assert acc.rounds == 9 and acc.history == runs
    assert acc.epsilon(1e-5) == pytest.approx(_reference_epsilon(runs, 1e-5), rel=1e-12)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    def eps(z: float, rounds: int, rate: float) -> float:
        acc = PrivacyAccountant()
        for _ in range(rounds):
            acc.step(noise_multiplier=z, sample_rate=rate)
        return acc.epsilon(1e-5)

    # a subsampled epsilon costs Opacus ~0.1 s; full participation is a closed form
    assert 0 < eps(1.0, 1, 0.3) < eps(1.0, 5, 0.3) < eps(1.0, 5, 1.0)
    assert 0 < eps(1.0, 2, 1.0) < eps(1.0, 5, 1.0) < eps(1.0, 20, 1.0)
    assert eps(0.7, 10, 1.0) > eps(1.0, 10, 1.0) > eps(2.0, 10, 1.0) > 0


def test_state_round_trip_continues_the_same_epsilon():
    full = PrivacyAccountant()
    first = PrivacyAccountant()
    for _ in range(3):
        full.step(noise_multiplier=1.0, sample_rate=0.25)
        first.step(noise_multiplier=1.0, sample_rate=0.25)
    full.step(noise_multiplier=2.0, sample_rate=1.0)
    first.step(noise_multiplier=2.0, sample_rate=1.0)
    state = json.loads(json.dumps(first.state_dict()))  # a server's checkpoint is JSON
    resumed = PrivacyAccountant()
    resumed.load_state_dict(state)
    for _ in range(2):
        full.step(noise_multiplier=2.0, sample_rate=1.0)
        resumed.step(noise_multiplier=2.0, sample_rate=1.0)
    assert resumed.history == full.history == [(1.0, 0.25, 3), (2.0, 1.0, 3)]
    assert resumed.rounds == 6
    assert resumed.epsilon(1e-5) == full.epsilon(1e-5) > 0
    with pytest.raises(ValueError, match="accountant 'rdp' cannot be loaded into the 'prv'"):
        PrivacyAccountant(accountant="prv").load_state_dict(state)


def test_prv_accountant_is_tighter_than_rdp():
    rdp, prv = PrivacyAccountant(accountant="rdp"), PrivacyAccountant(accountant="prv")
    for acc in (rdp, prv):
        for _ in range(5):
            acc.step(noise_multiplier=1.0, sample_rate=1.0)
    assert 0 < prv.epsilon(1e-5) <= rdp.epsilon(1e-5)


def test_accountant_refuses_bad_input():
    acc = PrivacyAccountant()
    with pytest.raises(ValueError, match="noise_multiplier must be > 0"):
        acc.step(noise_multiplier=0.0, sample_rate=0.5)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        acc.step(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="delta must be in"):
        acc.epsilon(0.0)
    with pytest.raises(ValueError, match="accountant must be one of rdp, prv"):
        PrivacyAccountant(accountant="gdp")


def test_clip_update_scales_to_the_norm_and_keeps_direction():
    update = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = clip_update(update, 1.0)
    assert norm == pytest.approx(5.0)
    assert torch.allclose(clipped["w"], torch.tensor([0.6, 0.0]))
    assert torch.allclose(clipped["b"], torch.tensor([0.8]))
    assert update["w"][0] == 3.0, "the input is not modified"
    inside, norm = clip_update([torch.tensor([3.0, 0.0]), torch.tensor([4.0])], 10.0)
    assert norm == pytest.approx(5.0) and isinstance(inside, list)
    assert torch.equal(inside[0], torch.tensor([3.0, 0.0]))
    zero, norm = clip_update([torch.zeros(3)], 1.0)
    assert norm == 0.0 and torch.equal(zero[0], torch.zeros(3))
    with pytest.raises(TypeError, match="num_batches_tracked"):
        clip_update({"n": torch.tensor(3)}, 1.0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_update(update, 0.0)


def _check_std(samples: torch.Tensor, std: float) -> None:
    n = samples.numel()
    # standard errors: of the mean, sigma / sqrt(n); of the sample std, about sigma / sqrt(2n)
    assert abs(float(samples.mean())) < 5 * std / math.sqrt(n)
    assert abs(float(samples.std()) - std) < 5 * std / math.sqrt(2 * n)


def test_gaussian_noise_has_the_requested_std():
    gen = torch.Generator().manual_seed(0)
    base = {"a": torch.full((100_000,), 2.0), "b": torch.zeros(300, 200)}
    noisy = add_gaussian_noise(base, std=0.3, generator=gen)
    _check_std(torch.cat([noisy["a"] - 2.0, noisy["b"].flatten()]), 0.3)
    again = add_gaussian_noise(base, std=0.3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again["a"], noisy["a"])
    assert torch.equal(base["a"], torch.full((100_000,), 2.0))


def test_noise_std_matches_flower_and_private_mean_adds_it():
    from flwr.supercore.differential_privacy import compute_stdv

    assert noise_std(noise_multiplier=1.3, clipping_norm=0.7, num_sampled_clients=5) == \
        compute_stdv(1.3, 0.7, 5)
    assert PrivacyConfig(noise_multiplier=1.3, clipping_norm=0.7, delta=1e-5).noise_std(5) == \
        compute_stdv(1.3, 0.7, 5)
    # four clients, each far outside the ball: clipped to norm 1 along its own direction
    updates = [[torch.full((20_000,), 10.0 * (k + 1))] for k in range(4)]
    mean, norms = private_mean(updates, clipping_norm=1.0, noise_multiplier=2.0,
                               generator=torch.Generator().manual_seed(1))
    assert norms == pytest.approx([10.0 * (k + 1) * math.sqrt(20_000) for k in range(4)])
    clipped_value = 1.0 / math.sqrt(20_000)  # every clipped update is this constant vector
    _check_std(mean[0] - clipped_value, 2.0 * 1.0 / 4)
    exact, _ = private_mean(updates, clipping_norm=1.0, noise_multiplier=0.0)
    assert torch.allclose(exact[0], torch.full((20_000,), clipped_value))
    # named updates are averaged by name, whatever their order
    named = [{"w": torch.tensor([1.0]), "b": torch.tensor([0.0])},
             {"b": torch.tensor([0.0]), "w": torch.tensor([0.5])}]
    by_name, norms = private_mean(named, clipping_norm=10.0, noise_multiplier=0.0)
    assert norms == [1.0, 0.5] and by_name == {"w": torch.tensor([0.75]), "b": torch.tensor([0.0])}


def test_privacy_config_validates_each_field():
    assert not PrivacyConfig().enabled
    cfg = PrivacyConfig(noise_multiplier=1.0, delta=1e-5, clipping="client", accountant="prv")
    assert cfg.enabled and cfg.noise_std(4) == 0.25
    with pytest.raises(ValueError, match="DP without a delta: .*privacy.delta"):
        PrivacyConfig(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="privacy.delta must be in"):
        PrivacyConfig(noise_multiplier=1.0, delta=1.0)
    with pytest.raises(ValueError, match="privacy.noise_multiplier must be >= 0"):
        PrivacyConfig(noise_multiplier=-1.0, delta=1e-5)
    with pytest.raises(ValueError, match="privacy.clipping_norm must be > 0"):
        PrivacyConfig(noise_multiplier=1.0, clipping_norm=0.0, delta=1e-5)
    with pytest.raises(ValueError, match="privacy.clipping must be one of server, client"):
        PrivacyConfig(clipping="both")
    with pytest.raises(ValueError, match="privacy.accountant must be one of rdp, prv"):
        PrivacyConfig(accountant="gdp")
    with pytest.warns(UserWarning, match="privacy.delta 1e-05 is ignored"):
        PrivacyConfig(delta=1e-5)
