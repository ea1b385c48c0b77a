"""Per-rank resume state as JSON: RNG states (python, numpy, torch, CUDA) and data position.

Everything here is plain JSON (byte states as base64) so that loading it can never execute code.

Data position. The trainer's sampler (:func:`torsh_distributed.data.corpus.sample_batch`) is a
pure function of ``(seed, step, global batch)``: the global batch of a step is drawn once and rank
``r`` of ``n`` takes an equal slice of it. The step therefore *is* the position, and it does not
depend on the world size: resuming step ``s`` at any number of ranks draws the same global batches
``s, s+1, ...`` that the original run would have drawn, so no sample is lost or repeated. That holds
only if seed and global batch are unchanged, which :func:`check_data_position` enforces.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["capture_rng", "restore_rng", "data_position", "check_data_position"]


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as a JSON-serialisable dict."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    data: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        data["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return data


def restore_rng(data: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`.

    Raises:
        CheckpointError: the states are malformed.
    """
    try:
        version, state, gauss = data["python"]
        random.setstate((int(version), tuple(int(x) for x in state), gauss))
        kind, keys, pos, has_gauss, cached = data["numpy"]
        np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_unb64(data["torch"]))
        if "cuda" in data and torch.cuda.is_available():
            states = [_unb64(s) for s in data["cuda"]]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"malformed RNG state: {type(exc).__name__}: {exc}", operation="checkpoint.load"
        ) from exc


def data_position(
    *, step: int, seed: int, batch_size: int, num_train_tokens: int
) -> dict[str, Any]:
    """The data position after ``step`` optimizer steps, as saved in a checkpoint."""
    samples = step * batch_size
    return {
        "step": step,
        "seed": seed,
        "global_batch": batch_size,
        "samples_seen": samples,
        # Windows are drawn with replacement, so an "epoch" is nominal: tokens seen / corpus size.
        "epoch": samples // max(num_train_tokens, 1),
    }


def check_data_position(saved: dict[str, Any], *, seed: int, batch_size: int) -> int:
    """The step to resume at; ``CheckpointError`` if the sample order would not continue.

    Raises:
        CheckpointError: seed or global batch differ from the run that saved the checkpoint.
    """
    for key, now in (("seed", seed), ("global_batch", batch_size)):
        if saved.get(key) != now:
            raise CheckpointError(
                f"the checkpoint was written with {key}={saved.get(key)} but this run has "
                f"{key}={now}; resuming would change the sample order",
                operation="checkpoint.resume",
                fix=f"run with the same {key} (the world size may change; the global batch may not)"
                " or pass --resume never",
            )
    return int(saved["step"])
