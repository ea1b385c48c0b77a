"""Seeded random streams that replay identically after ``load_state_dict``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Stream"]


class Stream:
    """A generator per (bucket, draw): draw ``i`` of bucket ``key`` is seeded by ``(seed, key, i)``.

    Re-seeding per draw (instead of carrying a generator's state) makes the stream a function of
    three integers, so checkpoints store only counters and every rank that shares ``seed`` draws
    the same numbers (RandomK relies on it).

    ``next(key, device)`` seeds a generator *on that device*, so a draw over a CUDA bucket runs
    on the GPU (CUDA's Philox): deterministic given the seed and the device type, but not the
    CPU's numbers. Drawing on the CPU and copying cost ~100 ms per 16.7 M entries on an H200,
    100x the codec itself (docs/gpu.md). A device without its own generator draws on the CPU.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.counters: dict[int, int] = {}

    def next(self, key: int, device: torch.device | None = None) -> torch.Generator:
        """The generator of the next draw of bucket ``key``, on ``device`` (default: the CPU);
        draw with ``device=generator.device``."""
        i = self.counters.get(key, 0)
        self.counters[key] = i + 1
        g = torch.Generator()
        if device is not None and device.type != "cpu":
            try:
                g = torch.Generator(device=device)
            except RuntimeError:  # no generator of its own (the draw runs on the CPU)
                pass
        g.manual_seed((self.seed * 1_000_003 + key * 10_007 + i) % (2**63 - 1))
        return g

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "counters": {str(k): v for k, v in self.counters.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.counters = {int(k): int(v) for k, v in state["counters"].items()}
