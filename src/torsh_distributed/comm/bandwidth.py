"""Link bandwidth and latency estimated from the collectives' own timings (torch-free).

Every all-reduce the priority scheduler issues during training is a measurement: ``k``
messages of ``n`` bytes per rank in all held the link for ``t`` seconds. An alpha-beta model
``t = alpha * k + n / B`` fitted by least squares over periods of several sizes gives the
per-message latency ``alpha`` and the algorithm bandwidth ``B``; the link rate is the *bus* bandwidth
``B * 2 (p - 1) / p`` (a ring all-reduce sends ``2 (p - 1) / p`` of the message over each
rank's link, the convention of nccl-tests' ``busbw``). On 2 ranks it equals ``B``.

The estimator is fed by :class:`~torsh_distributed.parallel.priority.PriorityDataParallel`
(payload chunks and the small readiness messages give the spread of sizes the fit needs) and
read by the monitor (``comm_bandwidth_mbit``, ``comm_latency_ms``), the summary
(``comm.bandwidth``) and the ``auto`` partition and credit (:func:`choose_partition`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["BandwidthEstimator", "LinkEstimate", "choose_partition"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkEstimate:
    """One fit of the alpha-beta model."""

    alpha_s: float
    """Per-message latency (seconds): the intercept of time against message size."""
    bandwidth_bytes_s: float
    """Bus bandwidth (bytes/s on each rank's link): ``2 (p - 1) / p`` bytes per byte reduced,
    divided by the fitted seconds per byte."""
    samples: int
    """Messages the fit used (after dropping outliers)."""
    sizes: int
    """Distinct message sizes among them (one size cannot separate latency from bandwidth)."""
    source: str = "fit"
    """``fit``: both from the passive fit; ``probe``: both from :func:`~.link_probe.probe_group_link`;
    ``probe+fit``: the bandwidth from a probe, the latency fitted on the periods."""

    @property
    def bandwidth_mbit(self) -> float:
        """The bus bandwidth in Mbit/s (the unit of ``tc ... rate``)."""
        return self.bandwidth_bytes_s * 8 / 1e6

    def to_dict(self) -> dict[str, float | int]:
        return {
            "bandwidth_mbit": round(self.bandwidth_mbit, 3),
            "bandwidth_bytes_s": round(self.bandwidth_bytes_s, 1),
            "latency_ms": round(self.alpha_s * 1e3, 4),
            "samples": self.samples,
            "sizes": self.sizes,
            "source": self.source,
        }


class BandwidthEstimator:
    """Alpha-beta fit over the last ``window`` samples of all-reduce traffic.

    A sample is a *busy period*: ``messages`` all-reduces of ``nbytes`` in all that kept the
    link busy for ``seconds`` (from the first one's start to the last one's end, each issued
    before the previous ended). Periods rather than single messages because the backend runs
    several messages at once (Gloo has two worker threads): the time of one of them is shared
    with its neighbours, the time of the period is not. The model is
    ``seconds = alpha * messages + nbytes / B``, fitted by least squares.

    Args:
        world_size: Ranks taking part in the all-reduces (sets the bus factor ``2 (p - 1) / p``).
        window: Samples kept; older ones are forgotten, so a link that changes is followed
            within about ``window`` periods (larger = steadier, slower to follow).
    """

    def __init__(self, *, world_size: int, window: int = 256) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 for a link estimate, got {world_size}")
        if window < 4:
            raise ValueError(f"window must be >= 4, got {window}")
        self.world_size = world_size
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.total_bytes = 0
        self.total_seconds = 0.0

    @property
    def bus_factor(self) -> float:
        return 2 * (self.world_size - 1) / self.world_size

    def add(self, nbytes: int, seconds: float, *, messages: int = 1) -> None:
        """Record that ``messages`` all-reduces of ``nbytes`` per rank in all held the link
        for ``seconds``."""
        if messages < 1 or nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
            return  # a clock that did not move says nothing
        self._samples.append((float(messages), float(nbytes), float(seconds)))
        self.total_bytes += nbytes
        self.total_seconds += seconds

    def __len__(self) -> int:
        return len(self._samples)

    def achieved_bytes_s(self) -> float | None:
        """Bus bytes per second of the periods in the window, bytes over seconds (latency
        included, no outlier dropped): what the exchange got from the link, not what the link
        can give; ``None`` without periods."""
        samples = list(self._samples)
        seconds = sum(t for _, _, t in samples)
        if not samples or seconds <= 0:
            return None
        return self.bus_factor * sum(n for _, n, _ in samples) / seconds

    def estimate(self, *, bandwidth_bytes_s: float | None = None) -> LinkEstimate | None:
        """The fit, or ``None`` with fewer than 4 samples or fewer than 2 distinct sizes (the
        full fit only; with ``bandwidth_bytes_s`` there is always an estimate).

        With ``bandwidth_bytes_s`` (a bus bandwidth measured apart, e.g. by
        :func:`~.link_probe.probe_group_link`) only the latency is fitted: ``alpha`` and a
        per-period offset ``c`` minimise ``sum (t - n / B - c - alpha k)^2`` (``alpha >= 0``),
        refitted once without the periods further than 4 median absolute deviations. This is well conditioned where the full fit is not:
        the exchange's periods are made of similar chunks, so a period's message count and its
        bytes are nearly proportional and the full fit cannot split time between them.

        Least squares, refitted once without the samples further than 4 median absolute
        deviations from the fit (a period stretched by a busy host). A fit that is not
        physical (a slope that is not positive; a negative latency is clamped to 0 and the
        slope refitted) falls back to the aggregate rate with zero latency.
        """
        samples = list(self._samples)
        if bandwidth_bytes_s is not None:
            return self._latency_only(samples, bandwidth_bytes_s)
        if len(samples) < 4 or len({n for _, n, _ in samples}) < 2:
            return None
        fit = _fit(samples)
        if fit is not None:
            residuals = [abs(t - fit[0] * k - fit[1] * n) for k, n, t in samples]
            mad = sorted(residuals)[len(residuals) // 2]
            kept = [s for s, r in zip(samples, residuals, strict=True) if r <= 4 * mad + 1e-12]
            if len(kept) >= 4 and len({n for _, n, _ in kept}) >= 2 and len(kept) < len(samples):
                refit = _fit(kept)
                if refit is not None:
                    fit, samples = refit, kept
        if fit is None or fit[1] <= 0:
            rate = sum(n for _, n, _ in samples) / sum(t for _, _, t in samples)
            fit = (0.0, 1.0 / rate)
        alpha, slope = fit
        return LinkEstimate(
            alpha_s=alpha,
            bandwidth_bytes_s=self.bus_factor / slope,
            samples=len(samples),
            sizes=len({n for _, n, _ in samples}),
        )

    def _latency_only(
        self, samples: list[tuple[float, float, float]], bandwidth_bytes_s: float
    ) -> LinkEstimate:
        if not bandwidth_bytes_s > 0:
            raise ValueError(f"bandwidth_bytes_s must be > 0, got {bandwidth_bytes_s}")
        slope = self.bus_factor / bandwidth_bytes_s  # seconds per byte reduced
        rows = [(k, t - slope * n) for k, n, t in samples]  # time beyond the bytes' own
        offset, alpha = _line(rows)
        if len(rows) >= 4:
            residuals = [abs(y - offset - alpha * k) for k, y in rows]
            mad = sorted(residuals)[len(residuals) // 2]
            kept = [
                (s, r) for s, r in zip(samples, rows, strict=True)
                if abs(r[1] - offset - alpha * r[0]) <= 4 * mad + 1e-12
            ]  # fmt: skip
            if len(kept) >= 4 and len(kept) < len(rows):
                samples = [s for s, _ in kept]
                offset, alpha = _line([r for _, r in kept])
        return LinkEstimate(
            alpha_s=alpha,
            bandwidth_bytes_s=bandwidth_bytes_s,
            samples=len(samples),
            sizes=len({n for _, n, _ in samples}),
            source="probe+fit" if samples else "probe",
        )


def _line(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """``(offset, alpha)`` of ``y = offset + alpha * k`` by least squares, ``alpha >= 0``.

    The offset is a per-period constant: the start-up of a period, less what a shaper's
    bucket, refilled in the idle gap before it, lets through at once (negative at 100 Mbit
    behind ``tbf``'s 256 KiB burst). Without it the burst would read as a smaller latency."""
    if not rows:
        return 0.0, 0.0
    mean_k = sum(k for k, _ in rows) / len(rows)
    mean_y = sum(y for _, y in rows) / len(rows)
    var = sum((k - mean_k) ** 2 for k, _ in rows)
    alpha = sum((k - mean_k) * (y - mean_y) for k, y in rows) / var if var > 0 else 0.0
    if var == 0:  # one count only: offset and alpha cannot be told apart; all in alpha
        alpha = max(mean_y / mean_k, 0.0) if mean_k else 0.0
    elif alpha < 0:  # no cost per message: all in the offset
        alpha = 0.0
    return mean_y - alpha * mean_k, alpha


def _fit(samples: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(alpha, slope)`` of ``t = alpha * k + slope * n``; ``None`` when the two
    regressors are proportional (alpha and bandwidth cannot be told apart)."""
    skk = sum(k * k for k, _, _ in samples)
    skn = sum(k * n for k, n, _ in samples)
    snn = sum(n * n for _, n, _ in samples)
    skt = sum(k * t for k, _, t in samples)
    snt = sum(n * t for _, n, t in samples)
    det = skk * snn - skn * skn
    if det <= 1e-12 * skk * snn:
        return None
    alpha = (skt * snn - snt * skn) / det
    slope = (skk * snt - skn * skt) / det
    if alpha < 0:  # a latency cannot be negative: the best fit through zero latency
        alpha, slope = 0.0, snt / snn
    return alpha, slope


def choose_partition(
    link: LinkEstimate, *, world_size: int, total_bytes: int, efficiency: float = 0.9
) -> tuple[int, int]:
    """``auto``: (partition bytes, credit bytes) for a link.

    A chunk of ``n`` bytes costs ``alpha + n / B``; it reaches ``efficiency`` of the bandwidth
    when ``n >= efficiency / (1 - efficiency) * alpha * B``. Smaller chunks let a high-priority
    gradient overtake sooner (ByteScheduler's trade-off), so the partition is that bound rounded
    up to a power of two, within [256 KiB, 4 MiB] (below 256 KiB the host's own cost per message,
    copies and Python, which the link fit does not see, dominates on CPU), at least 1/64 and at
    most 1/8 of the model. The credit (bytes in flight) keeps the link busy across one message's
    latency: two partitions, and at least the bandwidth-delay product.
    """
    if not 0 < efficiency < 1:
        raise ValueError(f"efficiency must be in (0, 1), got {efficiency}")
    algbw = link.bandwidth_bytes_s / (2 * (world_size - 1) / world_size)
    need = efficiency / (1 - efficiency) * link.alpha_s * algbw
    partition = max(need, 256 << 10, total_bytes / 64)
    partition = 1 << math.ceil(math.log2(partition))
    partition = min(partition, 4 << 20, max(256 << 10, _pow2_floor(total_bytes // 8)))
    credit = max(2 * partition, _pow2_ceil(int(link.alpha_s * algbw)))
    return partition, credit


def _pow2_floor(n: int) -> int:
    return 1 << max(n.bit_length() - 1, 0)


def _pow2_ceil(n: int) -> int:
    return 1 << max((n - 1).bit_length(), 0)
