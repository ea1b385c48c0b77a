"""An active probe of a group's link: a queue of all-reduces that keeps the link busy.

The passive fit (:class:`~torsh_distributed.comm.bandwidth.BandwidthEstimator`) reads the link
from the training exchange's own busy periods. Those periods are only link-bound when the link
is the bottleneck: at 1 Gbit on a 2-core host they are a few MB cut by the credit window and
host work, each after an idle gap in which a shaper's bucket refills, and the fit read 53-186 %
of the link (docs/benchmarks.md, issue 41). The probe asks the link directly: one warm-up
all-reduce of 1 MiB (it sizes the rest), then ``reps`` times 12 all-reduces issued at once,
each sized so that the 12 take about ``target_s`` (at least 128 KiB). Queued, they leave the
link no idle moment, so a shaper's bucket stays empty and a burst cannot shorten any of them
but the first; the time per message is the least-squares slope of their completion times
against their index, the first two left out (start-up; Gloo runs two at once). The median
repetition counts. Every rank issues the same sizes (agreed through an all-reduce of the
warm-up's time) and the per-message times are averaged over the ranks, so every rank returns
the same estimate. ``alpha_s`` is the warm-up's time beyond its bytes (0 when a burst made it
shorter): a rough figure; the exchange fits its own per-message cost on its periods
(:meth:`~torsh_distributed.comm.bandwidth.BandwidthEstimator.estimate` with the bandwidth).

Cost, measured quiet on the network lab (2 hosts x 1 rank, ``tc tbf``): 0.47-0.49 s at
100 Mbit, 0.18-0.36 s at 1 Gbit with the defaults; it read 96.1-97.3 % of 100 Mbit and
96.7-97.5 % of 1 Gbit (payload: TCP/IP headers and the ACKs take the rest of the frame rate
``tc`` counts). Collectives on ``group`` only.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torsh_distributed.comm.bandwidth import LinkEstimate

__all__ = ["probe_group_link"]

_WARMUP = 1 << 20
_ALIGN = 64 << 10
_MIN_MESSAGE = 128 << 10
_QUEUED = 12
"""All-reduces issued at once per repetition: the link never idles between them, so a shaper's
bucket stays empty and a burst cannot shorten one of them."""
_SKIP = 2
"""Completions left out of the slope: the first ones carry the start-up (and the burst of a
bucket that refilled before the repetition); Gloo runs two at once, so two."""


def probe_group_link(
    group: dist.ProcessGroup | None = None,
    *,
    target_s: float = 0.1,
    reps: int = 3,
    max_bytes: int = 64 << 20,
    device: torch.device | str = "cpu",
) -> LinkEstimate:
    """Measure ``group``'s link with all-reduces; a collective (every rank of ``group`` calls it).

    Args:
        group: The process group (``None``: the default group). Use a group nothing else
            issues collectives on at the same time, or the probe measures both.
        target_s: Link time of one repetition's 12 all-reduces (sizes them: at least 128 KiB
            each, at most ``max_bytes`` in all). Longer: steadier against a host's scheduling
            noise, dearer.
        reps: Repetitions; the median one counts.
        max_bytes: Cap on one repetition's bytes (memory: 12 buffers of 1/12 of it).
        device: Where the buffers live (the group's backend must accept it).

    Returns:
        The link estimate: ``alpha_s`` (per-message latency) and the bus bandwidth (bytes/s
        on each rank's link, ``2 (p - 1) / p`` bytes per byte reduced), ``samples`` the
        all-reduces timed, ``sizes`` 1, ``source`` ``probe``.
    """
    if not target_s > 0:
        raise ValueError(f"target_s must be > 0, got {target_s}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if max_bytes < _WARMUP:
        raise ValueError(f"max_bytes must be >= {_WARMUP} (1 MiB), got {max_bytes}")
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"a link probe needs a group of >= 2 ranks, got {world}")
    warm_buf = torch.zeros(_WARMUP // 4, dtype=torch.float32, device=device)
    start = time.perf_counter()
    dist.all_reduce(warm_buf, group=group)
    _sync(warm_buf)
    warm = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)  # every rank the same sizes
    size = int(_WARMUP * target_s / (_QUEUED * max(float(warm.item()), 1e-9)))
    size = min(max(size // _ALIGN * _ALIGN, _MIN_MESSAGE), max_bytes // _QUEUED // _ALIGN * _ALIGN)
    bufs = [torch.zeros(size // 4, dtype=torch.float32, device=device) for _ in range(_QUEUED)]
    per_message = []
    for _ in range(reps):
        stamps: list[float] = []
        works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs]
        for work, buf in zip(works, bufs, strict=True):  # they end in order (two at a time)
            work.wait()
            _sync(buf)  # on CUDA wait() only orders streams: wait for the kernel itself
            stamps.append(time.perf_counter())
        per_message.append(_slope(stamps[_SKIP:]))
    mine = sorted(per_message)[len(per_message) // 2]
    both = torch.tensor([mine, float(warm.item())], dtype=torch.float64, device=device)
    dist.all_reduce(both, group=group)
    seconds, t_warm = (both / world).tolist()
    if not seconds > 0:
        raise RuntimeError(f"the link probe measured no time per message ({seconds} s)")
    bandwidth = size / seconds  # algorithm bandwidth: bytes reduced per second
    return LinkEstimate(
        alpha_s=max(t_warm - _WARMUP / bandwidth, 0.0),
        bandwidth_bytes_s=2 * (world - 1) / world * bandwidth,
        samples=reps * _QUEUED,
        sizes=1,
        source="probe",
    )


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _slope(stamps: list[float]) -> float:
    """Least-squares seconds per message of completion times against their index."""
    n = len(stamps)
    mean_i, mean_t = (n - 1) / 2, sum(stamps) / n
    num = sum((i - mean_i) * (t - mean_t) for i, t in enumerate(stamps))
    return num / sum((i - mean_i) ** 2 for i in range(n))
