"""``auto``: choose a method (or none) per bucket from a measured cost model; back off when the
loss becomes unstable.

1. **Probe** (``probe_repeats`` steps per candidate, after ``warmup_steps``): every bucket
   uses each candidate of the ladder ``none < fp16 < int8 < powersgd:4 < topk:0.01`` in turn;
   per bucket and candidate the compute seconds (compress + decompress), bytes, rounds and
   communication seconds are recorded.
2. **Cost model**: ``comm_s = latency * rounds + bytes / bandwidth`` is fitted (least squares
   over all probe exchanges); a bucket's predicted time with method ``m`` is
   ``compute_s(m) + latency * rounds(m) + bytes(m) / bandwidth``. The bucket takes the
   *lightest* method predicted within ``margin`` (default 10 %) of the cheapest one (a heavier
   method must earn its extra gradient error), and only if it beats ``none`` by ``margin``: on
   a fast link compression buys nothing and ``none`` stays. While probing, the ranks meet at a
   barrier before each timed exchange, so a peer still in its backward does not count as
   communication time (it did, and made topk:0.01 win by 2 % on loopback in some runs).
3. **Stability**: every ``window`` steps the coefficient of variation of the last ``window``
   losses is checked; if it exceeds ``cv_threshold`` while the loss is not falling, every
   bucket backs off one rung to lighter compression and never climbs above it again.

Rank 0 decides and broadcasts the choices, so every rank applies the same method to the same
bucket (a mismatch would deadlock the collectives). Each decision is logged and kept in
``decisions``. When a bucket changes method, the old method's error-feedback residual is
added to the bucket's next gradient, so no accumulated error is lost.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from torsh_distributed.compression.base import Comm, Compressor, Payload, Timer
from torsh_distributed.compression.spec import build_fixed

__all__ = ["Adaptive", "LADDER", "LADDER_ZSTD"]

log = logging.getLogger(__name__)

LADDER = ("none", "fp16", "int8", "powersgd:4", "topk:0.01")
# ``auto:zstd``: each gathered rung is followed by the same method with the lossless stage, which
# sends fewer bytes for more compute; it is chosen where the fitted link makes that pay (and the
# lighter, unstacked rung wins ties within the margin).
LADDER_ZSTD = ("none", "fp16", "int8", "zstd:int8", "powersgd:4", "topk:0.01", "zstd:topk:0.01")


class Adaptive(Compressor):
    """Per-bucket choice of method; see the module docstring.

    Args:
        ladder: Candidate specs from lightest to heaviest; the first must be ``none``.
        warmup_steps: Steps of ``none`` before probing (DDP's first step rebuilds buckets).
        probe_repeats: Steps per candidate while probing (the median is used).
        margin: A method must be predicted this fraction faster than ``none`` to be chosen.
        window: Losses in the stability window (and steps between checks).
        cv_threshold: Coefficient of variation (std / mean) above which the loss is unstable.
        seed: Seed of the candidates' random choices.
    """

    summable = False

    def __init__(
        self,
        *,
        ladder: Sequence[str] = LADDER,
        warmup_steps: int = 1,
        probe_repeats: int = 2,
        margin: float = 0.1,
        window: int = 20,
        cv_threshold: float = 0.25,
        seed: int = 0,
    ) -> None:
        if not ladder or ladder[0] != "none":
            raise ValueError(f"auto ladder must start with 'none', got {list(ladder)}")
        self.name = "auto"
        self.ladder = list(ladder)
        self.methods = [build_fixed(s, seed=seed) for s in self.ladder]
        self.warmup_steps, self.probe_repeats = warmup_steps, probe_repeats
        self.margin, self.window, self.cv_threshold = margin, window, cv_threshold
        self.step = 0
        self.choice: dict[int, int] = {}
        """Bucket -> ladder index chosen by the cost model (after probing)."""
        self.last: dict[int, int] = {}
        """Bucket -> ladder index it used in its last exchange."""
        self.ceiling = len(self.ladder) - 1
        self.samples: dict[tuple[int, int], list[tuple[float, int, int, float]]] = {}
        self.losses: list[float] = []
        self.decisions: list[str] = []
        self._pending: dict[int, torch.Tensor] = {}
        self._decided = False

    # -- the per-bucket exchange --
    def _current(self, key: int) -> int:
        probe_end = self.warmup_steps + self.probe_repeats * len(self.ladder)
        if self.step < self.warmup_steps:
            return 0
        if self.step < probe_end:
            return (self.step - self.warmup_steps) // self.probe_repeats
        return self.choice.get(key, 0)

    def reduce(
        self,
        tensor: torch.Tensor,
        comm: Comm,
        *,
        key: int = 0,
        timer: Timer | None = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.Tensor:
        timer = timer or Timer()
        idx = self._current(key)
        last = self.last.get(key)
        if last is not None and last != idx:
            residual = self.methods[last].take_residual(key)
            if residual is not None:
                self._pending[key] = residual
        self.last[key] = idx
        pending = self._pending.pop(key, None)
        if pending is not None and pending.shape == tensor.shape:
            tensor = tensor + pending
        before = (
            timer.compress.seconds + timer.decompress.seconds,
            comm.bytes_sent,
            comm.rounds,
            comm.comm_s,
        )
        if not self._decided:
            comm.barrier()  # time the exchange, not the slowest rank's backward
        out = self.methods[idx].reduce(tensor, comm, key=key, timer=timer, shapes=shapes)
        if not self._decided:
            sample = (
                timer.compress.seconds + timer.decompress.seconds - before[0],
                comm.bytes_sent - before[1],
                comm.rounds - before[2],
                comm.comm_s - before[3],
            )
            self.samples.setdefault((key, idx), []).append(sample)
        return out

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        idx = self._current(key)
        payload, ctx = self.methods[idx].compress(tensor, key=key)
        return payload, (idx, ctx)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        idx, inner = ctx
        return self.methods[idx].decompress(payload, inner)

    # -- decisions --
    def observe_loss(self, loss: float) -> None:
        """Feed the training loss of a step (the stability check uses rank 0's)."""
        self.losses.append(float(loss))
        del self.losses[: -self.window]

    def _fit(self) -> tuple[float, float]:
        """Least-squares ``comm_s = latency * rounds + bytes * sec_per_byte`` (both >= 0)."""
        rows = [(r, b, c) for samples in self.samples.values() for _, b, r, c in samples]
        srr = sum(r * r for r, _, _ in rows)
        sbb = sum(b * b for _, b, _ in rows)
        srb = sum(r * b for r, b, _ in rows)
        src = sum(r * c for r, _, c in rows)
        sbc = sum(b * c for _, b, c in rows)
        det = srr * sbb - srb * srb
        if det <= 0:
            return 0.0, (sbc / sbb if sbb else 0.0)
        lat = (src * sbb - sbc * srb) / det
        spb = (srr * sbc - srb * src) / det
        if lat < 0:
            lat, spb = 0.0, sbc / sbb
        if spb < 0:
            lat, spb = src / srr, 0.0
        return lat, spb

    def predict(self, key: int, idx: int, latency: float, sec_per_byte: float) -> float:
        samples = self.samples.get((key, idx))
        if not samples:
            return float("inf")
        compute = statistics.median(s[0] for s in samples)
        nbytes = statistics.median(s[1] for s in samples)
        rounds = statistics.median(s[2] for s in samples)
        return compute + latency * rounds + nbytes * sec_per_byte

    def _decide(self) -> dict[int, int]:
        latency, spb = self._fit()
        keys = sorted({k for k, _ in self.samples})
        choice = {}
        for key in keys:
            costs = [self.predict(key, i, latency, spb) for i in range(len(self.ladder))]
            cheapest = min(costs[: self.ceiling + 1])
            best = next(
                i for i in range(self.ceiling + 1) if costs[i] <= (1 + self.margin) * cheapest
            )
            if costs[best] > (1.0 - self.margin) * costs[0]:
                best = 0
            choice[key] = best
            self._log(
                f"bucket {key}: {self.ladder[best]} (predicted "
                + ", ".join(
                    f"{s} {c * 1e3:.2f} ms" for s, c in zip(self.ladder, costs, strict=True)
                )
                + f"; latency {latency * 1e3:.3f} ms, {1 / spb / 1e6 if spb else float('inf'):.1f} MB/s)"
            )
        return choice

    def _unstable(self) -> bool:
        if len(self.losses) < self.window:
            return False
        mean = statistics.fmean(self.losses)
        cv = statistics.pstdev(self.losses) / abs(mean) if mean else 0.0
        half = len(self.losses) // 2
        falling = statistics.fmean(self.losses[half:]) < statistics.fmean(self.losses[:half])
        return cv > self.cv_threshold and not falling

    def _log(self, text: str) -> None:
        line = f"auto step {self.step}: {text}"
        self.decisions.append(line)
        log.info(line)

    def step_end(self, comm: Comm, stats: Any = None) -> None:
        """End of a step (called by the hook on every rank): decide and broadcast when due."""
        self.step += 1
        probe_end = self.warmup_steps + self.probe_repeats * len(self.ladder)
        keys = sorted({k for k, _ in self.samples}) if self.samples else []
        if self.step == probe_end and not self._decided:
            choice = self._decide() if _is_main() else {}
            self._set(comm, keys, choice)
            self._decided = True
            self.samples.clear()
        elif self._decided and (self.step - probe_end) % self.window == 0:
            back = torch.tensor([1 if (_is_main() and self._unstable()) else 0], device=comm.device)
            comm.broadcast(back)
            if int(back) and self.ceiling > 0:
                self.ceiling = max(0, max((self.choice[k] for k in self._keys()), default=0) - 1)
                self._log(
                    f"loss unstable (cv over {self.window} steps > {self.cv_threshold}); "
                    f"backing off to at most {self.ladder[self.ceiling]}"
                )
                for k in self._keys():
                    self.choice[k] = min(self.choice[k], self.ceiling)
                self.losses.clear()

    def _keys(self) -> list[int]:
        return sorted(self.choice)

    def _set(self, comm: Comm, keys: list[int], choice: dict[int, int]) -> None:
        vec = torch.tensor([choice.get(k, 0) for k in keys], dtype=torch.int64, device=comm.device)
        comm.broadcast(vec)
        for k, v in zip(keys, vec.tolist(), strict=True):
            self.choice[k] = int(v)

    def reset_errors(self) -> None:
        self._pending.clear()
        for m in self.methods:
            m.reset_errors()

    def take_residual(self, key: int) -> torch.Tensor | None:
        last = self.last.get(key)
        return None if last is None else self.methods[last].take_residual(key)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "choice": {str(k): v for k, v in self.choice.items()},
            "last": {str(k): v for k, v in self.last.items()},
            "ceiling": self.ceiling,
            "decided": self._decided,
            "samples": {f"{k}/{i}": [list(s) for s in v] for (k, i), v in self.samples.items()},
            "losses": list(self.losses),
            "decisions": list(self.decisions),
            "pending": {str(k): v.clone() for k, v in self._pending.items()},
            "methods": [m.state_dict() for m in self.methods],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.choice = {int(k): int(v) for k, v in state["choice"].items()}
        self.last = {int(k): int(v) for k, v in state["last"].items()}
        self.ceiling = int(state["ceiling"])
        self._decided = bool(state["decided"])
        self.samples = {
            (int(k.split("/")[0]), int(k.split("/")[1])): [tuple(s) for s in v]  # type: ignore[misc]
            for k, v in state["samples"].items()
        }
        self.losses = [float(x) for x in state["losses"]]
        self.decisions = [str(x) for x in state["decisions"]]
        self._pending = {int(k): v.clone() for k, v in state["pending"].items()}
        for m, s in zip(self.methods, state["methods"], strict=True):
            m.load_state_dict(s)


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
