"""The facade's hot-path flag, in a module of its own so that debug mode and the profiler (which the
facade imports) can clear it without an import cycle.

``HOT[0]`` is True once :func:`torsh_distributed.comm._facade.plain` has found neither debug mode
nor the profiler on; every facade op then reads one list item instead of calling ``plain()``
(measured: about 4 us less per call straight after a barrier, when caches are cold). Turning debug
mode or the profiler on or off clears it, and the next call asks ``plain()`` again.
"""

from __future__ import annotations

HOT: list[bool] = [False]


def invalidate() -> None:
    """Debug mode or the profiler changed state: the next facade call re-checks ``plain()``."""
    HOT[0] = False
