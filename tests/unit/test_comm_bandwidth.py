"""The link estimator's alpha-beta fit on synthetic timings, the auto partition, tensor partitioning."""

from __future__ import annotations

import random

import pytest

from torsh_distributed.comm.bandwidth import BandwidthEstimator, choose_partition
from torsh_distributed.comm.config import CommConfig
from torsh_distributed.parallel._chunks import plan_chunks

MBIT = 1e6 / 8  # bytes/s per Mbit/s


def _feed(
    est: BandwidthEstimator, *, rate_mbit: float, alpha: float, noise: float, seed: int
) -> None:
    rng = random.Random(seed)
    algbw = rate_mbit * MBIT / est.bus_factor
    for _ in range(200):
        messages = rng.randint(1, 12)
        nbytes = sum(rng.choice([4_096, 65_536, 300_000, 1 << 20]) for _ in range(messages))
        seconds = alpha * messages + nbytes / algbw
        est.add(nbytes, seconds * (1 + rng.uniform(-noise, noise)), messages=messages)


@pytest.mark.parametrize(
    ("rate", "alpha", "world"), [(100, 3e-4, 2), (1000, 5e-5, 2), (10_000, 2e-3, 4)]
)
def test_fit_recovers_rate_and_latency(rate: float, alpha: float, world: int) -> None:
    est = BandwidthEstimator(world_size=world)
    _feed(est, rate_mbit=rate, alpha=alpha, noise=0.02, seed=rate)
    link = est.estimate()
    assert link is not None  # can fail: estimate() is None when the fit has too few busy periods
    assert link.bandwidth_mbit == pytest.approx(rate, rel=0.05)  # the acceptance asks 10 %
    assert link.alpha_s == pytest.approx(alpha, rel=0.25, abs=2e-5)
    assert link.to_dict()["latency_ms"] == pytest.approx(link.alpha_s * 1e3, abs=1e-4)


def test_outliers_from_a_busy_host_are_dropped() -> None:
    est = BandwidthEstimator(world_size=2)
    _feed(est, rate_mbit=100, alpha=2e-4, noise=0.01, seed=1)
    for _ in range(15):  # stretched 5x by a descheduled rank
        est.add(1 << 20, 5 * (1 << 20) / (100 * MBIT), messages=1)
    link = est.estimate()
    assert link is not None and link.bandwidth_mbit == pytest.approx(100, rel=0.05)


def test_bus_factor_and_too_little_data() -> None:
    est = BandwidthEstimator(world_size=4)
    assert est.bus_factor == pytest.approx(1.5)
    for _ in range(10):
        est.add(1000, 0.01)
    assert est.estimate() is None, "one message size cannot separate latency from bandwidth"
    est.add(0, 0.0)  # a clock that did not move is ignored
    assert len(est) == 10
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        BandwidthEstimator(world_size=1)


def test_noise_that_hides_the_sizes_falls_back_to_the_aggregate_rate() -> None:
    est = BandwidthEstimator(world_size=2)
    for nbytes, seconds in [(1000, 0.02), (2000, 0.01), (1000, 0.02), (2000, 0.01), (1500, 0.015)]:
        est.add(nbytes, seconds)
    link = est.estimate()
    assert link is not None and link.alpha_s == 0
    assert link.bandwidth_bytes_s == pytest.approx(7500 / 0.075)


def test_auto_partition_from_the_link() -> None:
    est = BandwidthEstimator(world_size=2)
    _feed(est, rate_mbit=100, alpha=3e-4, noise=0.0, seed=3)
    link = est.estimate()
    assert link is not None  # can fail: estimate() is None when the fit has too few busy periods
    partition, credit = choose_partition(link, world_size=2, total_bytes=13 << 20)
    assert partition == 256 << 10 and credit == 512 << 10  # the floor: 9 alpha B is 34 KB
    slow = BandwidthEstimator(world_size=2)
    _feed(slow, rate_mbit=1000, alpha=5e-3, noise=0.0, seed=4)  # high latency: 9 alpha B = 5.6 MB
    far = slow.estimate()
    assert far is not None  # can fail: estimate() is None when the fit has too few busy periods
    partition, credit = choose_partition(far, world_size=2, total_bytes=200 << 20)
    assert partition == 4 << 20 and credit >= 2 * partition
    partition, _ = choose_partition(far, world_size=2, total_bytes=4 << 20)
    assert partition == 512 << 10, "at most an eighth of the model"


def test_chunks_cut_big_tensors_and_merge_small_ones() -> None:
    layout = plan_chunks([10, 3, 25, 2, 2, 8, 0], 8)
    assert layout.sizes == (8, 5, 8, 8, 8, 5, 8)
    assert layout.of_param == ((0, 1), (1,), (2, 3, 4, 5), (5,), (5,), (6,), ())
    covered = {}
    for pieces in layout.chunks:
        for piece in pieces:
            covered.setdefault(piece.param, []).append((piece.start, piece.length))
    for param, numel in enumerate([10, 3, 25, 2, 2, 8]):
        assert sum(length for _, length in covered[param]) == numel
    with pytest.raises(ValueError, match="partition must be >= 1"):
        plan_chunks([4], 0)


def test_config_refuses_bad_schedule_settings() -> None:
    with pytest.raises(ValueError, match="--comm-schedule must be one of fifo, priority"):
        CommConfig(exchange_schedule="lifo")
    with pytest.raises(ValueError, match="partition_kb applies to --comm-schedule priority only"):
        CommConfig(partition_kb=64)
    with pytest.raises(ValueError, match="credit_kb .* must be >= comm.partition_kb"):
        CommConfig(exchange_schedule="priority", partition_kb=512, credit_kb=256)
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match=r"--zero-stage 2 .* cannot run with --grad-clip 1.0"):
        EngineConfig(
            comm=CommConfig(exchange_schedule="priority"), parallel=ParallelConfig(zero_stage=2)
        )
    with pytest.raises(ValueError, match=r"--zero-stage 2 .* cannot run with --meta-init"):
        EngineConfig(
            comm=CommConfig(exchange_schedule="priority"),
            parallel=ParallelConfig(zero_stage=2, meta_init=True),
            optim=OptimConfig(grad_clip=0.0),
        )
    with pytest.raises(ValueError, match="cannot run with --zero-stage 3"):
        EngineConfig(
            comm=CommConfig(exchange_schedule="priority"), parallel=ParallelConfig(zero_stage=3)
        )


def test_latency_fit_given_the_bandwidth_where_the_full_fit_cannot_split() -> None:
    """Periods of equal chunks (count and bytes proportional, as the exchange makes them), each
    shortened by a shaper's burst: the full fit has no unique split of time, but given the
    probed bandwidth the latency is fitted (the burst goes to the per-period offset);
    ``achieved_bytes_s`` is the bytes over seconds."""
    est = BandwidthEstimator(world_size=2)
    rate, alpha, chunk, burst = 1000 * MBIT, 8e-4, 1 << 20, (256 << 10) / (1000 * MBIT)
    rng = random.Random(3)
    counts = [rng.randint(1, 6) for _ in range(100)]
    for k in counts:
        seconds = alpha * k + k * chunk / rate - burst
        est.add(k * chunk, seconds * (1 + rng.uniform(-0.01, 0.01)), messages=k)
    blind = est.estimate()  # proportional regressors: the full fit loses the latency
    assert blind is not None and blind.alpha_s < alpha / 2, blind
    link = est.estimate(bandwidth_bytes_s=rate)
    assert link is not None and link.source == "probe+fit"
    assert link.bandwidth_mbit == pytest.approx(1000)
    assert link.alpha_s == pytest.approx(alpha, rel=0.1)
    achieved = est.achieved_bytes_s()
    total = sum(counts)
    expected = total * chunk / (total * (alpha + chunk / rate) - len(counts) * burst)
    assert achieved is not None and achieved == pytest.approx(expected, rel=0.03)
    with pytest.raises(ValueError, match="bandwidth_bytes_s"):
        est.estimate(bandwidth_bytes_s=0.0)
    assert BandwidthEstimator(world_size=2).achieved_bytes_s() is None
