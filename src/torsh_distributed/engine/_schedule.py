"""The engine's ``--comm-schedule priority`` (private).

:func:`priority_wrap` puts the model in
:class:`~torsh_distributed.parallel.priority.PriorityDataParallel` where DDP would go;
:class:`CommSchedule` is what the loop calls: :meth:`~CommSchedule.submit` after backward (in
place of exchange, clipping and ``optimizer.step()``), :meth:`~CommSchedule.wait` before
anything reads the parameters or the optimizer outside a forward (checkpoints, the end), and
:meth:`~CommSchedule.after_step` to report the measured link to the monitor. With ``fifo`` it
is inert (``on`` is False) and DDP does what it always did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torsh_distributed.comm.dims import side_group
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.parallel.priority import PriorityDataParallel
from torsh_distributed.runtime import world

__all__ = ["METRICS", "CommSchedule", "priority_wrap"]

METRICS = ("comm_bandwidth_mbit", "comm_latency_ms")
"""Custom monitor metrics of the priority exchange's link estimate (Prometheus:
``torsh_custom{name="comm_bandwidth_mbit"}``)."""


def priority_wrap(model: nn.Module, config: EngineConfig) -> PriorityDataParallel:
    """``model`` (plain data parallelism or ZeRO-2, dp > 1) in a :class:`PriorityDataParallel`
    over a group of its own (its thread's collectives must not interleave with the loop's)."""
    main = world.rank() == 0
    if config.optim.grad_clip and main:
        warnings.warn(
            f"--comm-schedule priority with --grad-clip {config.optim.grad_clip}: every update "
            "needs the global gradient norm, so updates wait for the whole exchange (chunks are "
            "still sent first-layer-first); --grad-clip 0 lets the next forward overlap it",
            stacklevel=2,
        )
    return PriorityDataParallel(
        model,
        group=side_group("priority_dp"),
        partition_bytes=config.comm.partition_kb * 1024,
        credit_bytes=config.comm.credit_kb * 1024,
        zero_stage=config.parallel.zero_stage,
        log=print if main else (lambda _: None),
    )


class CommSchedule:
    """The loop's calls into the priority exchange (inert when ``forward`` is not one).

    Args:
        forward: The module the loop calls for forward.
        optimizer: The run's optimizer (bound to the exchange: it steps per chunk).
        grad_clip: ``optim.grad_clip`` (0 = none).
    """

    def __init__(
        self, forward: nn.Module | None, optimizer: torch.optim.Optimizer, *, grad_clip: float
    ) -> None:
        self.model = forward if isinstance(forward, PriorityDataParallel) else None
        self.on = self.model is not None
        if self.model is not None:
            self.model.bind(optimizer, grad_clip=grad_clip)

    def submit(self) -> torch.Tensor | None:
        """After backward: the exchange and updates proceed in the background; the gradient
        norm of the last step that clipped (one step late), or ``None``."""
        assert self.model is not None
        self.model.submit()
        return self.model.last_grad_norm

    def wait(self) -> None:
        """Every update of the last step applied (no-op when off)."""
        if self.model is not None:
            self.model.wait()

    @contextlib.contextmanager
    def drained(
        self, inner: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> Iterator[None]:
        """``inner()`` entered after the last step's updates (wraps a checkpoint save)."""
        self.wait()
        with inner():
            yield

    def after_step(self, log: Callable[[str, float], None] | None) -> None:
        """Report the link estimate (if any yet) as custom metrics through ``log``."""
        if self.model is None or log is None:
            return
        link = self.model.link
        if link is not None:
            log("comm_bandwidth_mbit", link.bandwidth_mbit)
            log("comm_latency_ms", link.alpha_s * 1e3)

    def summary(self) -> dict[str, Any]:
        """The summary's ``comm`` block with ``priority``: ``schedule``, the partition, credit,
        chunks, ``bandwidth`` (the link fit) and the ``auto`` decisions; {} with ``fifo``."""
        if self.model is None:
            return {}
        return self.model.summary()

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
