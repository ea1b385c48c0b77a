"""Gradient compression for data parallelism: one :class:`Compressor` interface, the methods,
error feedback, the adaptive mode and the DDP hook adapters. See docs/compression.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.compression.adaptive import Adaptive
    from torsh_distributed.compression.base import (
        Comm,
        Compressor,
        ErrorFeedback,
        Identity,
        Timer,
        payload_bytes,
    )
    from torsh_distributed.compression.bimodal import Bimodal
    from torsh_distributed.compression.build import build_compressor
    from torsh_distributed.compression.config import CompressionConfig
    from torsh_distributed.compression.ef21 import EF21
    from torsh_distributed.compression.hooks import (
        CompressionHook,
        StepStats,
        compression_hook,
        find_compression,
        prime_buckets,
        register_compression,
    )
    from torsh_distributed.compression.lossless import Zstd
    from torsh_distributed.compression.natural import Natural
    from torsh_distributed.compression.powersgd import PowerSGD
    from torsh_distributed.compression.quantize import Cast, Int8
    from torsh_distributed.compression.sign import SignSGD, Ternary
    from torsh_distributed.compression.sketch import CountSketch
    from torsh_distributed.compression.sparsify import RandomK, Threshold, TopK
    from torsh_distributed.compression.spec import Spec, parse_spec

__all__ = [
    "EF21",
    "Adaptive",
    "Bimodal",
    "Cast",
    "Comm",
    "CompressionConfig",
    "CompressionHook",
    "Compressor",
    "CountSketch",
    "ErrorFeedback",
    "Identity",
    "Int8",
    "Natural",
    "PowerSGD",
    "RandomK",
    "SignSGD",
    "Spec",
    "StepStats",
    "Ternary",
    "Threshold",
    "Timer",
    "TopK",
    "Zstd",
    "build_compressor",
    "compression_hook",
    "find_compression",
    "parse_spec",
    "payload_bytes",
    "prime_buckets",
    "register_compression",
]

# On first use: the compressors import torch; the trainer's config needs only compression.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "adaptive": ("Adaptive",),
        "base": ("Comm", "Compressor", "ErrorFeedback", "Identity", "Timer", "payload_bytes"),
        "bimodal": ("Bimodal",),
        "build": ("build_compressor",),
        "config": ("CompressionConfig",),
        "ef21": ("EF21",),
        "hooks": (
            "CompressionHook", "StepStats", "compression_hook", "find_compression", "prime_buckets",
            "register_compression",
        ),
        "lossless": ("Zstd",),
        "natural": ("Natural",),
        "powersgd": ("PowerSGD",),
        "quantize": ("Cast", "Int8"),
        "sign": ("SignSGD", "Ternary"),
        "sketch": ("CountSketch",),
        "sparsify": ("RandomK", "Threshold", "TopK"),
        "spec": ("Spec", "parse_spec"),
    },
)
