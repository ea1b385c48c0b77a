"""Imported last by a forkserver's preload: moves every object the preload created into the
garbage collector's permanent generation (:func:`gc.freeze`), before any child is forked.

A process forked from a server that imported torch inherits about 300,000 tracked objects. Each
full collection in the child (:func:`torsh_distributed.runtime.world.shutdown` runs one; the
interpreter runs them as a child allocates) then walks all of them, 0.15 CPU seconds on the 2-core
VM, and writes to their headers, copying the pages they live on. Frozen, they are skipped: the
child collects only what it created itself. This is what :func:`gc.freeze` is documented for.
Nothing is lost: frozen objects are still freed when their references go; only a cycle among
them is never collected, and the server keeps them all alive anyway.

The stdlib's forkserver takes module names to preload, so this is a module: put
``"torsh_distributed.runtime._gc_freeze"`` last in the list, by name: importing this module
anywhere else would freeze that process's objects.
"""

from __future__ import annotations

import gc

__all__: list[str] = []

gc.collect()  # what is garbage now is not frozen with the rest
gc.freeze()
