"""Generation from a training checkpoint as a job: what ``torsh-dist generate`` runs.

:class:`GenerateJob` says what to generate (checkpoint, prompt, sampling, tensor-parallel degree,
dtype, output file); :func:`plan_generate` checks it and resolves the checkpoint once, before
any rank starts; :func:`run_generate` runs it on every rank of a ``tp``-rank job (or in one
process) and returns a :class:`GenerateReport` on rank 0, which also writes it to ``output``.
Batch inference over a JSONL file is :mod:`~torsh_distributed.inference.batch`.

Every rank of a tensor-parallel job loads its shards of the same checkpoint (any saved layout,
:func:`~torsh_distributed.inference.load.load_gpt`) onto the ``tp`` mesh of a
:class:`~torsh_distributed.comm.dims.ParallelDims` and decodes the same prompt with the same
settings; the tokens agree across ranks (see :mod:`~torsh_distributed.inference.generate`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from torsh_distributed.checkpoint.manifest import atomic_write_text
from torsh_distributed.inference.config import DTYPE_NAMES
from torsh_distributed.inference.generate import TextGenerator
from torsh_distributed.inference.load import LoadInfo, find_checkpoint, load_gpt, read_gpt_config
from torsh_distributed.inference.sampling import SamplingConfig
from torsh_distributed.inference.text import encode_bytes
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT
from torsh_distributed.runtime import world

__all__ = [
    "DTYPES",
    "GenerateJob",
    "GenerateReport",
    "plan_generate",
    "run_generate",
    "check_job_fields",
    "job_from_json",
    "job_to_json",
    "check_model",
    "load_for_job",
]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""The ``dtype`` names a job accepts and their torch dtypes."""


def check_job_fields(checkpoint: str, dtype: str, sampling: object) -> None:
    """ValueError unless ``checkpoint`` is a non-empty path and ``dtype`` one of :data:`DTYPES`;
    TypeError unless ``sampling`` is a :class:`SamplingConfig`."""
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ValueError("checkpoint must name a run's --checkpoint-dir or a step directory")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")


J = TypeVar("J")


def job_to_json(job: Any) -> str:
    """A job dataclass as JSON (what the launched ranks receive)."""
    return json.dumps(dataclasses.asdict(job))


def job_from_json(cls: type[J], text: str) -> J:
    """The job of :func:`job_to_json` output, its sampling rebuilt and everything validated."""
    data = json.loads(text)
    data["sampling"] = SamplingConfig.from_dict(data.get("sampling", {}))
    return cls(**data)


@dataclass(kw_only=True, slots=True)
class GenerateJob:
    """One prompt continued by the GPT of a training checkpoint."""

    checkpoint: str
    """A run's ``--checkpoint-dir`` (its newest valid checkpoint) or one ``step_XXXXXXXX``
    directory; any dp / ZeRO / tp / pp / ep layout."""
    prompt: str
    """The text to continue (byte-level tokens: one per UTF-8 byte)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Length, temperature (0 = greedy), top-k / top-p, seed and stops."""
    tp: int = 1
    """Tensor-parallel ranks that decode together (each holds ``1/tp`` of the heads and MLP).
    On CPU a small model decodes fastest at 1: every token costs several collectives."""
    dtype: str = "float32"
    """Weights' dtype after loading: ``float32`` (the trainer's), ``bfloat16`` / ``float16``
    (half the memory, logits differ in the last bits) or ``float64`` (exact comparisons)."""
    output: str = ""
    """Write the :class:`GenerateReport` here as JSON (atomically); empty = no file."""

    def __post_init__(self) -> None:
        check_job_fields(self.checkpoint, self.dtype, self.sampling)
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ValueError("prompt must be a non-empty string")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")

    def to_json(self) -> str:
        return job_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> GenerateJob:
        return job_from_json(cls, text)


@dataclass(kw_only=True, slots=True)
class GenerateReport:
    """What one generation produced, and how long it took (rank 0's clock)."""

    checkpoint: str
    """The step directory loaded."""
    step: int
    """The training step it holds."""
    prompt: str
    completion: str
    """The decoded continuation (cut before a stop string, without a final stop token)."""
    tokens: list[int]
    """The generated token ids."""
    stop_reason: str
    """``max_tokens``, ``stop_token``, ``stop_string`` or ``max_length`` (the context is full)."""
    time_to_first_token_s: float
    """Prefill and the first sample."""
    time_per_output_token_s: float | None
    """Mean seconds per token after the first (``None`` with one token)."""
    total_time_s: float
    """All decoding (not loading)."""
    load_time_s: float
    """Finding, verifying and reading the checkpoint."""
    tp: int
    dtype: str
    sampling: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["num_tokens"] = len(self.tokens)
        data["tokens_per_s"] = len(self.tokens) / self.total_time_s if self.total_time_s else None
        return data


def check_model(config: ModelConfig, *, tp: int = 1) -> None:
    """Refuse models the byte tokenizer or the tensor-parallel plan cannot serve.

    Raises:
        ValueError: a vocabulary other than the 256 bytes; ``n_head`` not divisible by ``tp``.
    """
    if config.vocab_size != 256:
        raise ValueError(
            f"the checkpoint's model has vocab_size {config.vocab_size}; generation from the "
            "command line uses the byte-level tokenizer, which needs 256"
        )
    if tp > 1 and config.n_head % tp:
        raise ValueError(f"tp={tp} must divide the model's n_head={config.n_head}")


def plan_generate(job: GenerateJob) -> GenerateJob:
    """``job`` checked against its checkpoint, with ``checkpoint`` resolved to one step
    directory (so every rank loads the same one even if the run saves another meanwhile).

    Raises:
        FileNotFoundError, ValueError: no valid checkpoint (see
            :func:`~torsh_distributed.inference.load.find_checkpoint`); a prompt longer than
            the model's context; see :func:`check_model`.
    """
    from torsh_distributed.hf.serving import is_hf_source

    if is_hf_source(job.checkpoint):  # a Hugging Face directory or a --model hf: checkpoint
        if job.tp > 1:
            raise ValueError("tp > 1 decodes the built-in GPT; a Hugging Face model decodes with tp 1")
        whole = (Path(job.checkpoint) / "config.json").is_file()
        return dataclasses.replace(
            job, checkpoint=job.checkpoint if whole else str(find_checkpoint(job.checkpoint))
        )
    path = str(find_checkpoint(job.checkpoint))
    config, _ = read_gpt_config(path)
    check_model(config, tp=job.tp)
    length = len(encode_bytes(job.prompt))
    if length > config.block_size:
        raise ValueError(
            f"the prompt has {length} tokens, more than the model's context of {config.block_size}"
        )
    return dataclasses.replace(job, checkpoint=path)


def load_for_job(
    checkpoint: str, *, dtype: str, device: torch.device, tp: int, world_size: int
) -> tuple[GPT, ModelConfig, LoadInfo]:
    """The GPT of ``checkpoint`` on this rank: whole, or sharded over the ``tp`` axis of the
    running job's ``dp x tp`` mesh (``dp = world_size / tp`` replicas; ``world_size`` must be a
    multiple of ``tp``, and every rank of the job must call this)."""
    mesh = None
    if tp > 1:
        if world_size % tp:
            raise ValueError(
                f"tp={tp} needs a job of a multiple of {tp} ranks, this one has {world_size}"
            )
        from torsh_distributed.comm.dims import ParallelDims

        dims = ParallelDims(tp=tp, world_size=world_size, device_type=device.type).build()
        assert dims.mesh is not None
        mesh = dims.mesh["tp"]
    cast = None if dtype == "float32" else DTYPES[dtype]
    return load_gpt(checkpoint, device=device, dtype=cast, tp_mesh=mesh)


def run_generate(job: GenerateJob) -> GenerateReport | None:
    """Run ``job`` on this rank (every rank of a ``job.tp``-rank job calls it; one process when
    ``tp == 1``). Starts the process group from the launcher's environment if none runs.

    Returns:
        The report on rank 0 (also written to ``job.output`` when set); ``None`` elsewhere.

    Raises:
        ValueError: see :func:`plan_generate`; a job whose world size is not ``job.tp``.
    """
    job = plan_generate(job)
    owned = not world.is_initialized()
    runtime = world.init()
    try:
        if runtime.world_size != job.tp:
            raise ValueError(
                f"tp={job.tp} needs a job of {job.tp} ranks, this one has {runtime.world_size}"
            )
        started = time.perf_counter()
        from torsh_distributed.hf.serving import is_hf_source, load_hf_for_serving

        sampling = job.sampling
        if is_hf_source(job.checkpoint):
            cast = None if job.dtype == "float32" else DTYPES[job.dtype]
            generator, hf_info, _ = load_hf_for_serving(
                job.checkpoint, dtype=cast, device=runtime.device
            )
            where, step = str(hf_info["checkpoint"]), int(hf_info["step"])
            if hf_info["eos_id"] is not None:  # the model's end of sequence ends the completion
                sampling = dataclasses.replace(
                    sampling, stop_tokens=(*sampling.stop_tokens, int(hf_info["eos_id"]))
                )
        else:
            model, _, info = load_for_job(
                job.checkpoint,
                dtype=job.dtype,
                device=runtime.device,
                tp=job.tp,
                world_size=runtime.world_size,
            )
            generator, where, step = TextGenerator(model), str(info.path), info.step
        load_time = time.perf_counter() - started
        [result] = generator.generate([job.prompt], sampling)
    finally:
        if owned:
            world.shutdown()
    if runtime.rank != 0:
        return None
    assert result.text is not None
    report = GenerateReport(
        checkpoint=where,
        step=step,
        prompt=job.prompt,
        completion=result.text,
        tokens=result.tokens,
        stop_reason=result.stop_reason,
        time_to_first_token_s=result.time_to_first_token_s,
        time_per_output_token_s=result.time_per_output_token_s,
        total_time_s=result.total_time_s,
        load_time_s=load_time,
        tp=job.tp,
        dtype=job.dtype,
        sampling=dataclasses.asdict(job.sampling),
    )
    if job.output:
        out = Path(job.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
    return report
