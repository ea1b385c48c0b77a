"""The engine's batch prefetch (CUDA only): the next step's batch is fetched once the step's
kernels are queued and handed over exactly once, to that step; anything else fetches anew."""

from __future__ import annotations

import torch

from torsh_distributed.engine._setup import Prefetch, to_device


def _recorder() -> tuple[list[tuple[int, bool]], Prefetch, Prefetch]:
    calls: list[tuple[int, bool]] = []

    def fetch(step: int, non_blocking: bool) -> tuple[int, bool]:
        calls.append((step, non_blocking))
        return step, non_blocking

    cuda = Prefetch(fetch, device=torch.device("cuda"), max_steps=3)  # fetch is ours: no CUDA used
    cpu = Prefetch(fetch, device=torch.device("cpu"), max_steps=3)
    return calls, cuda, cpu


def test_cuda_prefetches_the_next_step_once_and_never_past_the_end():
    calls, cuda, _ = _recorder()
    assert cuda.take(0) == (0, False)  # nothing held for the first step
    assert cuda.ahead(1) is True
    assert cuda.take(1) == (1, True)  # the prefetched batch, copied without blocking
    assert cuda.take(1) == (1, False)  # handed over once: a second take fetches again
    cuda.ahead(2)
    assert cuda.take(0) == (0, False)  # another step (a resume): fetched anew, the held dropped
    assert cuda.take(2) == (2, False)
    assert cuda.ahead(3) is False  # past max_steps: nothing fetched
    assert calls == [(0, False), (1, True), (1, False), (2, True), (0, False), (2, False)]


def test_cpu_never_fetches_ahead():
    calls, _, cpu = _recorder()
    assert cpu.ahead(1) is False  # the monitor then records no extra data phase
    assert calls == []
    assert cpu.take(1) == (1, False)


def test_to_device_keeps_structure_and_copies_on_cpu():
    batch = {"x": torch.ones(2), "meta": [torch.zeros(1), "name"]}
    moved = to_device(batch, torch.device("cpu"), non_blocking=True)
    assert moved["meta"][1] == "name" and torch.equal(moved["x"], batch["x"])
