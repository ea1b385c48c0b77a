"""Horovod's ``DistributedOptimizer``: all-reduce each gradient once it has been accumulated
``backward_passes_per_step`` times, then step.

Like Horovod (``horovod/torch/optimizer.py``), :func:`DistributedOptimizer` returns an instance of
a new subclass of the wrapped optimizer's class built on the same ``param_groups`` (so
``isinstance(opt, torch.optim.SGD)`` holds, LR schedulers work, and the state starts empty).
A hook after gradient accumulation (``register_post_accumulate_grad_hook``) counts the backward
passes of each parameter; when the count reaches ``backward_passes_per_step`` its gradient is
compressed and an asynchronous all-reduce starts, overlapping the rest of backward. ``step()``
(or ``synchronize()``) reduces what is left, waits, and writes the results into ``p.grad``.

Semantics kept from Horovod: gradients are *summed* locally over the passes, then reduced with
``op`` (Average divides by the world size only, not by the number of passes: scale the loss if
you want a mean over passes); ``gradient_predivide_factor`` ``f`` scales by ``1/f`` before the sum
and ``f/size`` after; a parameter whose gradient was not computed contributes zeros; a backward
pass beyond ``backward_passes_per_step`` before ``step()`` and ``zero_grad()`` between backward and
step raise ``AssertionError``; a world of one registers no hooks.

One deliberate difference: Horovod starts each all-reduce when its hook fires and matches ranks
by tensor name; torch.distributed matches collectives by order, so ours start in one fixed order
(the reverse of the parameter order, which is roughly backward order): a gradient that is ready
early waits for the ones before it in that order. Results are identical; overlap is a little
smaller when backward visits parameters in an unusual order.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torsh_distributed.compat.horovod._adasum import check_adasum_world
from torsh_distributed.compat.horovod._allreduce import allreduce_async_
from torsh_distributed.compat.horovod._basics import Op, check_process_set, resolve_op, size
from torsh_distributed.compat.horovod._compression import NoneCompressor, TorshCompression
from torsh_distributed.compat.horovod._handles import Handle, done, guard
from torsh_distributed.compat.horovod._movement import sparse_allreduce_async

__all__ = ["DistributedOptimizer", "is_distributed_optimizer", "local_step"]

_TOO_MANY = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_REDUCED = object()  # context of a gradient our compressor already exchanged and decoded
_ZERO_GRAD = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


def _named(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, Any]]:
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [
            (f"allreduce.noname.{i}.{j}", v)
            for i, group in enumerate(optimizer.param_groups)
            for j, v in enumerate(group["params"])
        ]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced "
            "by model.named_parameters()."
        )
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}"
        )
    named_ids = {id(v) for _, v in named}
    unnamed = [id(v) for g in optimizer.param_groups for v in g["params"] if id(v) not in named_ids]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            f"Python object ids: {', '.join(str(i) for i in unnamed)}"
        )
    return named


class _Common:
    """What both wrappers share: names, pass counting, hooks and the fixed launch order."""

    param_groups: list[dict[str, Any]]

    def _hvd_common(
        self, named: list[tuple[str, Any]], compression: Any, backward_passes_per_step: int
    ) -> None:
        self._compression = compression
        self._parameter_names = {v: k for k, v in named}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named}
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._order: list[torch.Tensor] = list(reversed(params))
        self._index = {p: i for i, p in enumerate(self._order)}
        self._handles: dict[torch.Tensor, tuple[Handle, Any]] = {}
        self._ready: set[torch.Tensor] = set()
        self._next = 0
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles: list[Any] = []

    def _register_hooks(self) -> None:
        ref = weakref.ref(self)

        def make(p: torch.Tensor) -> Any:
            def hook(_: torch.Tensor) -> None:
                owner = ref()
                if owner is not None:
                    owner._on_grad(p)

            return hook

        for p in self._order:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(make(p)))

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._ready.add(p)
            while self._next < len(self._order) and self._order[self._next] in self._ready:
                self._launch(self._order[self._next])
                self._next += 1

    _launch: Callable[[torch.Tensor], None]
    """Start reducing ``p``'s gradient (each optimizer class defines it)."""

    def _launch_rest(self) -> None:
        while self._next < len(self._order):
            self._launch(self._order[self._next])
            self._next += 1

    def _reset_passes(self) -> None:
        self._handles.clear()
        self._ready.clear()
        self._next = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate before the reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _pending(self) -> bool:
        return bool(self._handles) or any(
            d != self.backward_passes_per_step for d in self._allreduce_delay.values()
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused between ``backward()`` and ``step()``/``synchronize()``."""
        if self._pending():
            raise AssertionError(_ZERO_GRAD)
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state and forget any reduction in progress (as Horovod does)."""
        self._reset_passes()
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)  # type: ignore[misc]


class _DistributedOptimizer(_Common):
    """Mixed in front of the user's optimizer class (see the module docstring)."""

    def __init__(
        self,
        params: Any,
        named: list[tuple[str, Any]],
        compression: Any,
        backward_passes_per_step: int,
        op: Op,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
    ) -> None:
        super().__init__(params)  # type: ignore[call-arg]
        self._hvd_common(named, compression, backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        if size() > 1:
            self._register_hooks()
        else:
            self._order = []  # a world of one reduces nothing (Horovod registers no hooks)

    def _launch(self, p: torch.Tensor) -> None:
        if p.grad is None:  # not computed here; another rank may have it (dynamic graphs)
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                handle = sparse_allreduce_async(grad, name, self.op)
                self._handles[p] = (handle, _REDUCED)  # not compressed (as in Horovod)
                return
            grad = grad.to_dense()
        pre, post = 1.0, 1.0
        if self.op is Op.AVERAGE:
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        if isinstance(self._compression, TorshCompression):
            with guard("allreduce"):
                out = self._compression.reduce(
                    grad,
                    op=self.op,
                    prescale_factor=pre,
                    postscale_factor=post,
                    key=self._index[p],
                )
            self._handles[p] = (done(out, operation="allreduce", name=name), _REDUCED)
            return
        compressed, ctx = self._compression.compress(grad)
        handle = allreduce_async_(
            compressed, name=name, op=self.op, prescale_factor=pre, postscale_factor=post
        )
        self._handles[p] = (handle, ctx)

    def synchronize(self) -> None:
        """Reduce the gradients not reduced yet, wait for all, and write them into ``p.grad``."""
        self._launch_rest()
        try:
            for p, (handle, ctx) in self._handles.items():
                output = handle.wait()
                assert p.grad is not None
                if ctx is not _REDUCED:
                    output = self._compression.decompress(output, ctx)
                if p.grad.is_sparse:
                    if not output.is_sparse:
                        output = output.to_sparse()
                    p.grad.zero_().add_(output)
                else:
                    p.grad.set_(output)
        finally:
            self._reset_passes()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` first, e.g.
        to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside :meth:`skip_synchronize`), then take the wrapped step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]


class _DistributedAdasumOptimizer(_Common):
    """Adasum of the local *updates* (Horovod's delta optimizer).

    When a parameter's gradient is ready, the wrapped optimizer steps that parameter alone from a
    copy ``start``; the update ``delta = new - start`` is what ranks combine with Adasum, and
    ``step()`` sets the parameter to ``start + adasum(deltas)``. Hyperparameters are not scaled by
    the world size (Adasum adapts). The exchanges run in ``step()``, in the fixed order.
    """

    def __init__(
        self,
        params: Any,
        named: list[tuple[str, Any]],
        compression: Any,
        backward_passes_per_step: int,
    ) -> None:
        super().__init__(params)  # type: ignore[call-arg]
        self._hvd_common(named, compression, backward_passes_per_step)
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._deltas: dict[torch.Tensor, tuple[torch.Tensor, Any]] = {}
        with torch.no_grad():
            for p in self._order:
                p.grad = torch.zeros_like(p)
        self._register_hooks()

    def _launch(self, p: torch.Tensor) -> None:
        start = self._starting_models[p]
        stashed = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p] if any(p is v for v in g["params"]) else []
            with torch.no_grad():
                start.copy_(p)
            super().step()  # type: ignore[misc]
            with torch.no_grad():
                p.sub_(start)  # p now holds this rank's update
        finally:
            for g, params in zip(self.param_groups, stashed, strict=True):
                g["params"] = params
        compressed, ctx = self._compression.compress(p.detach())
        self._deltas[p] = (compressed, ctx)
        self._handles[p] = (done(None, operation="adasum"), ctx)

    def _reset_passes(self) -> None:
        super()._reset_passes()
        self._deltas.clear()

    def synchronize(self) -> None:
        """Nothing to do: the Adasum exchange happens in ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        """Take the local steps not taken yet, combine the updates with Adasum, apply them."""
        loss = closure() if closure is not None else None
        self._launch_rest()
        try:
            for p in self._order:
                compressed, ctx = self._deltas.pop(p)
                allreduce_async_(compressed, op=Op.ADASUM).wait()
                delta = self._compression.decompress(compressed, ctx)
                with torch.no_grad():
                    start = self._starting_models[p]
                    start.add_(delta)
                    p.copy_(start)
        finally:
            self._reset_passes()
        return loss


def is_distributed_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` came from :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _Common)


def local_step(optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's own ``step()``, without any reduction (used to create state)."""
    if isinstance(optimizer, _Common):
        base = next(c for c in type(optimizer).__mro__[1:] if not issubclass(c, _Common))
        base.step(optimizer)
    else:
        optimizer.step()


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = NoneCompressor,
    backward_passes_per_step: int = 1,
    op: Any = Op.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` averages the gradients over all ranks first.

    Args:
        optimizer: Any ``torch.optim.Optimizer``; the result is an instance of a subclass of its
            class built on its ``param_groups`` (its state, if any, is not carried over).
        named_parameters: ``model.named_parameters()``; names label the reductions. Without it
            parameters are named by position.
        compression: ``Compression.none`` (default), ``Compression.fp16`` (halves the bytes,
            sums in fp16) or ``Compression.torsh(spec)`` (any fixed method of ours, exchanged
            blocking in the fixed order).
        backward_passes_per_step: Backward passes whose gradients are summed locally before one
            reduction. Trade-off: fewer, larger exchanges vs. a larger effective batch.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (power-of-two worlds; combines updates).
        gradient_predivide_factor: With Average, scale by ``1/f`` before the sum and ``f/size``
            after (guards fp16 sums against overflow); Average only.
        num_groups: Horovod's deprecated alias of ``groups``.
        groups: Horovod's explicit fusion groups: not supported (``None`` or 0 only); reductions
            here are per tensor.
        sparse_as_dense: Reduce sparse gradients as dense tensors instead of all-gathering their
            indices and values.
        process_set: Only the global process set.

    Raises:
        ValueError: bad names, ``backward_passes_per_step <= 0``, a predivide factor with an op
            other than Average.
        NotImplementedError: ``groups``, a process set, or Adasum on a world that is not a power
            of two.
    """
    check_process_set(process_set)
    rop = resolve_op(op)
    if rop not in (Op.AVERAGE, Op.SUM, Op.ADASUM):
        raise ValueError(f"DistributedOptimizer op must be Average, Sum or Adasum, got {rop.name}")
    if gradient_predivide_factor != 1.0 and rop is not Op.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if groups or num_groups:
        raise NotImplementedError(
            "DistributedOptimizer(groups=/num_groups=) is not supported: gradients are reduced "
            "per tensor in a fixed order; drop the argument"
        )
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _Common):
        raise ValueError("optimizer is already a DistributedOptimizer")
    named = _named(optimizer, named_parameters)
    base = type(optimizer)
    if rop is Op.ADASUM and size() > 1:
        check_adasum_world(size())
        if isinstance(compression, TorshCompression):
            raise ValueError("Adasum combines updates; use Compression.none or Compression.fp16")
        cls = type(base.__name__, (_DistributedAdasumOptimizer, base), {})
        return cls(optimizer.param_groups, named, compression, backward_passes_per_step)
    cls = type(base.__name__, (_DistributedOptimizer, base), {})
    return cls(
        optimizer.param_groups,
        named,
        compression,
        backward_passes_per_step,
        rop,
        gradient_predivide_factor,
        sparse_as_dense,
    )
