"""Multi-process test helpers: run a function on N real ranks with timeouts and tracebacks."""

from torsh_distributed.testing.harness import (
    RankFailedError,
    distributed_test,
    find_free_port,
    run_distributed,
)

__all__ = ["RankFailedError", "distributed_test", "find_free_port", "run_distributed"]
