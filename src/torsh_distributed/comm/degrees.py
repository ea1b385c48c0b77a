"""Parallel degrees against a world size, without torch: what :class:`~.dims.ParallelDims`
validates at construction, callable by ``torsh-dist train`` before anything heavy is imported."""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["AXES", "WorldSizeMismatch", "check_degrees", "resolve_degrees"]

AXES = ("pp", "dp", "ep", "tp")
"""Mesh axes, outermost first: ``tp`` is innermost so its ranks are neighbours (same node)."""


class _Degrees(Protocol):
    dp: int
    tp: int
    pp: int
    ep: int


class WorldSizeMismatch(ValueError):
    """Valid degrees whose product does not fit the world size (a caller that checks against a
    part of the world, such as one replica group, can say so)."""


def resolve_degrees(degrees: dict[str, int], world_size: int) -> dict[str, int]:
    """The degrees of every axis in :data:`AXES`, one ``-1`` ("the rest") filled in.

    Raises:
        ValueError: a degree that is not a positive int or -1, two ``-1``, or a product that
            does not divide (or equal) ``world_size``.
    """
    for name in AXES:
        value = degrees[name]
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"{name} must be a positive int or -1 (the rest), got {value!r}")
    described = " * ".join(f"{n}={degrees[n]}" for n in AXES)
    free = [n for n in AXES if degrees[n] == -1]
    if len(free) > 1:
        raise ValueError(f"only one degree may be -1, got {', '.join(free)}")
    fixed = math.prod(degrees[n] for n in AXES if degrees[n] != -1)
    resolved = {n: degrees[n] for n in AXES}
    if free:
        if world_size % fixed:
            raise WorldSizeMismatch(
                f"world size {world_size} is not divisible by the fixed degrees "
                f"({described} = {fixed}); {free[0]} cannot fill the rest"
            )
        resolved[free[0]] = world_size // fixed
    elif fixed != world_size:
        raise WorldSizeMismatch(
            f"dp * tp * pp * ep = {described} = {fixed} != world size {world_size}; "
            "use -1 for one degree to take the rest"
        )
    return resolved


def check_degrees(config: _Degrees, world_size: int) -> dict[str, int]:
    """:func:`resolve_degrees` of a config's ``dp``/``tp``/``pp``/``ep``, the error saying which
    world size they were checked against."""
    try:
        return resolve_degrees({n: getattr(config, n) for n in AXES}, world_size)
    except WorldSizeMismatch as exc:
        raise WorldSizeMismatch(f"parallel degrees do not match the world size: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"invalid parallel degrees: {exc}") from None
