"""Serving a training checkpoint until a signal: what ``torsh-dist serve`` runs on each rank.

:func:`serve_checkpoint` loads the built-in GPT of a checkpoint (whole in one process, or its
shards on each rank of a ``tp``-rank job started by the launcher), then on the first rank runs an
:class:`~torsh_distributed.inference.server.InferenceServer` and on the others
:func:`~torsh_distributed.inference.server.follow`, until ``SIGTERM`` or ``SIGINT``.

Shutdown: the first rank stops accepting connections, answers what is queued with 503, finishes
the batch being decoded and sends the other ranks a ``stop``; they return and every rank exits
0. A rank that is signalled but never hears ``stop`` (the first rank died) exits after
:data:`GRACE_S` seconds rather than wait on a collective that cannot complete.

:func:`read_token` reads the shared secret from an environment variable or a file, so that it
never appears on a command line (which other users of the host can read).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.inference._server_config import read_token
from torsh_distributed.inference.chat import PYTHON_COMMENTS, ChatTemplate
from torsh_distributed.inference.generate import TextGenerator
from torsh_distributed.inference.load import find_checkpoint, load_gpt, read_gpt_config
from torsh_distributed.inference.server import InferenceServer, ServerConfig, follow
from torsh_distributed.runtime import world

__all__ = ["GRACE_S", "read_token", "check_checkpoint", "serve_checkpoint"]

GRACE_S = 10.0
"""Seconds a signalled non-serving rank waits for the serving rank's ``stop``."""


def check_checkpoint(checkpoint: str | os.PathLike[str], *, tp: int) -> Path:
    """The checkpoint directory ``checkpoint`` names (see
    :func:`~torsh_distributed.inference.load.find_checkpoint`), checked for serving at ``tp``:
    resolved once, so every rank loads the same step.

    A Hugging Face model directory or a checkpoint of a ``--model hf:`` run is served by
    :mod:`torsh_distributed.hf.serving` (``tp`` 1).

    Raises:
        FileNotFoundError, ValueError: no valid checkpoint; a model without a recorded
            configuration; ``tp`` that does not divide its heads; an MoE model with ``tp > 1``;
            a Hugging Face model with ``tp > 1``.
    """
    from torsh_distributed.hf.serving import is_hf_source

    if is_hf_source(checkpoint):
        if tp > 1:
            raise ValueError("--tp > 1 serves the built-in GPT; a Hugging Face model serves with --tp 1")
        return Path(checkpoint) if (Path(checkpoint) / "config.json").is_file() else find_checkpoint(checkpoint)
    path = find_checkpoint(checkpoint)
    config, moe = read_gpt_config(path)
    if tp > 1 and config.n_head % tp:
        raise ValueError(f"--tp {tp} must divide the model's n_head={config.n_head}")
    if tp > 1 and moe is not None and moe.num_experts:
        raise ValueError("--tp > 1 serves the dense GPT only; an MoE checkpoint serves with --tp 1")
    return path


def _load(
    path: Path, *, tp: int, dtype: torch.dtype | None
) -> tuple[TextGenerator, dict[str, Any], ChatTemplate]:
    runtime = world.current()
    device = runtime.device if runtime is not None else torch.device("cpu")
    from torsh_distributed.hf.serving import is_hf_source, load_hf_for_serving

    if is_hf_source(path):
        return load_hf_for_serving(path, dtype=dtype, device=device)
    mesh = None
    if tp > 1:
        from torsh_distributed.comm.dims import ParallelDims

        dims = ParallelDims(tp=tp, world_size=tp, device_type=device.type).build()
        assert dims.mesh is not None
        mesh = dims.mesh["tp"]
    model, config, info = load_gpt(path, device=device, dtype=dtype, tp_mesh=mesh)
    model_info = {
        "checkpoint": str(info.path),
        "step": info.step,
        "config": dict(info.model.get("config") or {}),
        "tokenizer": dict(info.model.get("tokenizer") or {"kind": "bytes"}),
        "dtype": str(dtype or torch.float32).removeprefix("torch."),
        "context": config.block_size,
    }
    return TextGenerator(model), model_info, PYTHON_COMMENTS


def _until_signal(alive: Callable[[], bool]) -> signal.Signals | None:
    """Block until SIGTERM/SIGINT (returned) or until ``alive()`` turns false (``None``)."""
    got: list[signal.Signals] = []
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        got.append(signal.Signals(signum))
        stop.set()

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while alive() and not stop.wait(0.2):
            pass
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
    return got[0] if got else None


def serve_checkpoint(
    checkpoint: str | os.PathLike[str],
    config: ServerConfig,
    *,
    tp: int = 1,
    dtype: torch.dtype | None = None,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve ``checkpoint`` until SIGTERM or SIGINT; call it on every rank of a ``tp``-rank job
    (in one process for ``tp == 1``). Must run on the main thread (it handles the signals).

    Args:
        checkpoint: A run's ``--checkpoint-dir`` (its newest valid step) or one step directory.
        config: The server's address, token and batching (used on the first rank).
        tp: Tensor-parallel degree: the job's world size; the model is sharded over it.
        dtype: Cast the weights (``torch.bfloat16`` halves memory); ``None`` keeps fp32.
        announce: Receives one line once the server listens (default: print it).

    Returns:
        0 after a signal; 1 when the model worker died (e.g. another rank failed).

    Raises:
        FileNotFoundError, ValueError: see :func:`check_checkpoint`; a job whose world size is
            not ``tp``.
        OSError: the address cannot be bound.
    """
    path = check_checkpoint(checkpoint, tp=tp)
    owned = tp > 1 and not world.is_initialized()
    if tp > 1:
        runtime = world.init()
        if runtime.world_size != tp:
            raise ValueError(
                f"--tp {tp} needs a job of {tp} ranks, this one has {runtime.world_size}"
            )
    rank = world.rank() if tp > 1 else 0
    try:
        generator, model_info, template = _load(path, tp=tp, dtype=dtype)
        if rank == 0:
            return _serve(
                generator, config, model_info, tp=tp, announce=announce or print, template=template
            )
        return _follow(generator)
    finally:
        if owned:
            world.shutdown()


def _serve(
    generator: TextGenerator,
    config: ServerConfig,
    model_info: dict[str, Any],
    *,
    tp: int,
    announce: Callable[[str], None],
    template: ChatTemplate = PYTHON_COMMENTS,
) -> int:
    server = InferenceServer(generator, config, model_info=model_info, chat_template=template)
    try:
        announce(
            f"torsh-dist serve: listening on {server.url} (checkpoint {model_info['checkpoint']}, "
            f"step {model_info['step']}, tp {tp}, max batch {config.max_batch_size}, "
            f"{'token required' if config.token else 'no token'}, "
            f"{'TLS' if config.tls_cert else 'plain HTTP'})"
        )
        sys.stdout.flush()
        got = _until_signal(lambda: server.healthy)
    finally:
        server.close()
    if got is None:
        print(f"torsh-dist serve: stopped: {server.failure!r}", file=sys.stderr, flush=True)
        return 1
    print(f"torsh-dist serve: {got.name}: stopped cleanly", flush=True)
    return 0


def _follow(generator: TextGenerator) -> int:
    failure: list[BaseException] = []

    def run() -> None:
        try:
            follow(generator)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="torsh-serve-follow", daemon=True)
    thread.start()
    got = _until_signal(thread.is_alive)
    if got is not None:
        thread.join(GRACE_S)  # the serving rank sends `stop` when it closes
        if thread.is_alive():
            print(
                f"torsh-dist serve: {got.name} and no stop from the serving rank within "
                f"{GRACE_S:.0f} s; exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + int(got))  # a thread stuck in a collective cannot be joined
    if failure:
        raise failure[0]
    return 0
