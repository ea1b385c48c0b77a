"""Package exports imported on first use (PEP 562), so that importing a package costs nothing
until one of its names is needed.

Most packages here re-export classes whose modules import torch (2-3 s quiet, 20-40 s on a
loaded host), while the command line only needs their torch-free configs and option parsers to
print ``--help`` or refuse bad input. A package lists where each name lives; the type checker
reads the same imports under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, where: Mapping[str, Sequence[str]], *, submodules: Sequence[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, resolving each name from its module.

    Args:
        package: The package's ``__name__``.
        where: Submodule (relative to ``package``) -> the names it exports. A resolved name is
            stored in the package, so the import cost is paid once and later lookups are plain.
        submodules: Submodules that are themselves exports (``comm.collectives``).

    A name that is also the name of its submodule (``inference.generate``, the function in
    ``inference/generate.py``) stays the exported object: the import system binds a submodule
    to its package's attribute once the submodule is loaded, and the package then takes the
    export from it instead (the submodule stays in ``sys.modules``).
    """
    module_of = {name: module for module, names in where.items() for name in names}
    shadowed = frozenset(name for name, module in module_of.items() if name == module)
    if shadowed:
        sys.modules[package].__class__ = type(
            "_ShadowingPackage", (_ShadowingPackage,), {"_shadowed": shadowed}
        )

    def __getattr__(name: str) -> Any:
        if name in submodules:  # importing binds it to the package
            return importlib.import_module(f"{package}.{name}")
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *module_of, *submodules})

    return __getattr__, __dir__


class _ShadowingPackage(types.ModuleType):
    """A package whose attribute ``name`` is the object ``name`` of its submodule ``name``."""

    _shadowed: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._shadowed and isinstance(value, types.ModuleType):
            value = getattr(value, name)  # the submodule was just loaded: bind its export
        super().__setattr__(name, value)
