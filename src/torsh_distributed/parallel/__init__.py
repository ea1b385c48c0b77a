"""Parallelism applied as functions that change a model in place and return it."""

from torsh_distributed.parallel.data import apply_ddp, unwrap

__all__ = ["apply_ddp", "unwrap"]
