"""Horovod's helper functions: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object`` and ``allgather_object``.

Trust: ``broadcast_object`` and ``allgather_object`` (and ``broadcast_optimizer_state``, which
sends the non-tensor state with ``broadcast_object``) unpickle bytes received from the other
ranks of the job, as Horovod does. Unpickling runs arbitrary code, so this is only as safe as
every process of the job and the network between them (see docs/horovod.md).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torsh_distributed.compat.horovod._basics import check_process_set, global_process_set, rank
from torsh_distributed.compat.horovod._movement import allgather, broadcast_, broadcast_async_
from torsh_distributed.compat.horovod._optimizer import local_step

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle  # type: ignore[assignment]

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place.

    Args:
        params: ``model.state_dict()`` (a mapping, sent in sorted key order),
            ``model.named_parameters()`` or ``model.parameters()`` (in their order).
        root_rank: The rank whose values everyone gets.

    Raises:
        TypeError: an entry is not a tensor (say, a module's extra state).
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor")
    handles = [broadcast_async_(p, root_rank, name) for name, p in items]
    for handle in handles:
        handle.wait()


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """``root_rank``'s ``obj``, pickled there and unpickled on every other rank.

    Trust: the other ranks unpickle what ``root_rank`` sent (see the module docstring).
    """
    check_process_set(process_set)
    name = name or type(obj).__name__
    if rank() == root_rank:
        buf = io.BytesIO()
        _pickler.dump(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        broadcast_(length, root_rank, f"{name}.sz")
    else:
        length = torch.zeros(1, dtype=torch.int64)
        broadcast_(length, root_rank, f"{name}.sz")
        payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast_(payload, root_rank, f"{name}.t")
    if rank() != root_rank:
        obj = pickle.loads(payload.numpy().tobytes())
    return obj


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled and unpickled; see the module docstring)."""
    name = name or type(obj).__name__
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), f"{name}.sz").tolist()
    gathered = allgather(payload, f"{name}.t").numpy().tobytes()
    out, start = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[start : start + n]))
        start += n
    return out


# -- optimizer state ----------------------------------------------------------------------------
def _create_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's initialisation of an empty optimizer state: a step on zero gradients.

    Unlike Horovod, the parameters and gradients are put back afterwards, so a weight-decayed
    optimizer does not move the parameters.
    """
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            saved.append((p, p.detach().clone(), p.grad))
            grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam) or (
                isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
            ):
                grad = grad.to_sparse()
            p.grad = grad
    try:
        local_step(optimizer)
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                p.grad = grad


def _describe(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Structure of the state (tensor shapes and dtypes, plain values) and the group options."""
    groups, state = [], []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
        per_param = []
        for p in group["params"]:
            entry = optimizer.state.get(p)
            if entry is None:
                per_param.append(None)
                continue
            desc = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    where = "cpu" if value.device.type == "cpu" else "param"
                    desc[key] = ("tensor", tuple(value.shape), value.dtype, where)
                else:
                    desc[key] = ("value", value)
            per_param.append(desc)
        state.append(per_param)
    return {"groups": groups, "state": state}


def _layout(optimizer: torch.optim.Optimizer) -> list[list[tuple[int, ...]]]:
    return [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Make every rank's optimizer state and options equal to ``root_rank``'s, bit for bit.

    A rank whose state is empty (no step yet) first creates it as Horovod does, by a step on zero
    gradients (parameters and gradients are restored afterwards); then the state is rebuilt to
    ``root_rank``'s structure (entries it lacks are created, extra ones dropped) and every tensor
    (momentum buffers, Adam moments, step counts) is broadcast in place. Options (lr, momentum,
    ...) and non-tensor values are sent with :func:`broadcast_object`. Collective.

    Args:
        optimizer: A ``torch.optim.Optimizer`` or a :func:`DistributedOptimizer` (stepped without
            reduction here).
        root_rank: The rank whose state everyone gets.
        model: Used to find sparse embeddings (their zero gradients must be sparse).

    Raises:
        ValueError: ``torch.optim.LBFGS`` (as in Horovod), or the ranks' optimizers differ in
            parameter groups or shapes (raised on every rank).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    layouts = allgather_object(_layout(optimizer), "optimizer.layout")
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(
            "broadcast_optimizer_state: the ranks' optimizers differ in parameter groups or "
            f"parameter shapes ({layouts})"
        )
    if not optimizer.state:
        _create_state(optimizer, model)
    desc = broadcast_object(
        _describe(optimizer) if rank() == root_rank else None, root_rank, "optimizer.state"
    )
    tensors: list[torch.Tensor] = []
    for gi, group in enumerate(optimizer.param_groups):
        if rank() != root_rank:
            for key, value in desc["groups"][gi].items():
                group[key] = value
        for pi, p in enumerate(group["params"]):
            wanted = desc["state"][gi][pi]
            if wanted is None:
                optimizer.state.pop(p, None)
                continue
            entry = optimizer.state[p]  # a defaultdict: created when missing
            for key in [k for k in entry if k not in wanted]:
                del entry[key]
            for key in sorted(wanted, key=str):
                kind, *info = wanted[key]
                if kind == "value":
                    entry[key] = info[0]
                    continue
                shape, dtype, where = info
                device = torch.device("cpu") if where == "cpu" else p.device
                current = entry.get(key)
                if not (
                    isinstance(current, torch.Tensor)
                    and tuple(current.shape) == shape
                    and current.dtype == dtype
                    and current.device == device
                ):
                    current = entry[key] = torch.zeros(shape, dtype=dtype, device=device)
                tensors.append(current)
    handles = [broadcast_async_(t, root_rank, "optimizer.state") for t in tensors]
    for handle in handles:
        handle.wait()
