"""Batch inference over a JSONL file, data- and tensor-parallel, resumable after a crash: what
``torsh-dist infer`` runs.

:func:`run_infer` runs on every rank of the job. The job's ranks form ``dp = world_size / tp``
groups of :attr:`InferJob.tp` consecutive ranks (the ``dp x tp`` mesh of
:class:`~torsh_distributed.comm.dims.ParallelDims`, ``tp`` innermost). Each group holds the
model (whole at ``tp = 1``; sharded by the GPT's tensor-parallel plan over the group's ranks
otherwise, for a model that does not fit one rank), takes its contiguous share of the prompts
not yet done and decodes it in batches of :attr:`InferJob.batch_size` through
:class:`~torsh_distributed.inference.generate.TextGenerator`: the ranks of a group run the same
batches and agree on every token (see :mod:`~torsh_distributed.inference.generate`); the
group's first rank writes the results.

**Resumable.** A group's first rank appends each finished batch to its part file
(``<output>.parts/rank_<R>.jsonl``, ``R`` its global rank), flushed and fsync'ed, before starting the next. A rerun
with the same input and output reads every part file (rank 0, before any rank writes), keeps
the results whose key matches (the prompt's index, its input line, its sampling settings and
the checkpoint: see :mod:`~torsh_distributed.inference._batch`) and computes only the rest,
on any number of ranks. Only when every prompt is done does rank 0 write ``output``, in input
order, through a temporary file and a rename, and remove the part files: ``output`` never
exists half-written.

**Reproducible.** A prompt without its own ``seed`` samples with a seed derived from the run's
seed and its index (:func:`~torsh_distributed.inference._batch.prompt_seed`), and a row's tokens
do not depend on its batch (see :mod:`~torsh_distributed.inference.generate`), so the output
does not depend on the number of ranks, the batch size or where a crashed run stopped; nor on
``tp``, up to floating-point rounding (a sharded matrix product sums in another order, which
can flip a choice only between tokens whose logits tie to within that rounding).

The ranks exchange one small all-reduce per round of batches (the progress count); a rank that
dies makes the others fail at the next round rather than finish and wait. Several nodes need
the output's directory on a shared filesystem (rank 0 reads every rank's part file).

Fault injection (tests, benchmarks): ``TORSH_FAULT=kill:rank=R:step=K`` makes rank R SIGKILL
itself once its K-th batch is flushed (:mod:`~torsh_distributed.checkpoint.faults`; a batch is
a step here).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.checkpoint import faults
from torsh_distributed.inference._batch import (
    PartWriter,
    PromptItem,
    parts_dir,
    read_prompts,
    scan_parts,
    write_jsonl_atomic,
)
from torsh_distributed.inference.generate import GenerationResult, TextGenerator
from torsh_distributed.inference.jobs import (
    check_job_fields,
    check_model,
    job_from_json,
    job_to_json,
    load_for_job,
)
from torsh_distributed.inference.load import find_checkpoint, read_gpt_config
from torsh_distributed.inference.sampling import SamplingConfig
from torsh_distributed.inference.text import encode_bytes
from torsh_distributed.runtime import world
from torsh_distributed.runtime.errors import TorshDistributedError

__all__ = ["InferJob", "InferSummary", "Progress", "plan_infer", "run_infer", "shares"]

Progress = Callable[[int, int], None]
"""``(prompts done, prompts to do)``, called on rank 0 at the start and after every round."""


@dataclass(kw_only=True, slots=True)
class InferJob:
    """A JSONL file of prompts completed by the GPT of a training checkpoint."""

    checkpoint: str
    """A run's ``--checkpoint-dir`` (its newest valid checkpoint) or one step directory."""
    input: str
    """JSONL: one object per line with ``prompt`` and optionally ``id`` and per-line
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``."""
    output: str
    """JSONL written (whole, atomically) when every prompt is done, in input order."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Settings of every line that does not give its own; ``seed`` is the run's base seed."""
    batch_size: int = 16
    """Prompts a rank decodes together: more amortises each step over more rows, costs KV-cache
    memory and makes short completions wait for the longest of their batch. Results are
    flushed per batch, so it is also the most work a crash loses per rank."""
    dtype: str = "float32"
    """Weights' dtype (``float32``, ``bfloat16``, ``float16``, ``float64``)."""
    tp: int = 1
    """Tensor-parallel ranks per model replica: each holds ``1/tp`` of the heads and MLP (for a
    model too big for one rank); the job's world size must be a multiple of it. Every token
    costs a few collectives within the group, so a model that fits one rank completes a file
    faster as ``tp`` data-parallel replicas."""
    summary_json: str = ""
    """Also write the :class:`InferSummary` here as JSON; empty = no file."""

    def __post_init__(self) -> None:
        check_job_fields(self.checkpoint, self.dtype, self.sampling)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        for name in ("input", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a file path")
        if Path(self.input).resolve() == Path(self.output).resolve():
            raise ValueError(f"output must differ from input ({self.input})")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size}")

    def to_json(self) -> str:
        return job_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> InferJob:
        return job_from_json(cls, text)


@dataclass(kw_only=True, slots=True)
class InferSummary:
    """What a run did (rank 0)."""

    prompts: int
    """Prompts in the input."""
    skipped: int
    """Prompts whose results an earlier, interrupted run had already written."""
    computed: int
    """Prompts decoded by this run (all ranks)."""
    generated_tokens: int
    """Tokens this run generated (all ranks)."""
    wall_time_s: float
    """From the start of decoding to the output written (loading not included)."""
    tokens_per_s: float
    """``generated_tokens / wall_time_s``."""
    world_size: int
    tp: int
    """Ranks per model replica (``world_size / tp`` replicas decoded in parallel)."""
    output: str
    checkpoint: str
    """The step directory the results come from."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_infer(job: InferJob) -> tuple[InferJob, list[PromptItem]]:
    """``job`` with its checkpoint resolved to one step directory, and its prompts parsed and
    checked against the model's context: every input error before any rank starts.

    Raises:
        FileNotFoundError, ValueError: the checkpoint (see
            :func:`~torsh_distributed.inference.load.find_checkpoint`), ``tp`` not dividing the
            model's heads, the input (``FILE:LINE`` of a malformed line, a missing ``prompt``,
            a bad setting, a prompt longer than the model's context; an empty input).
    """
    path = str(find_checkpoint(job.checkpoint))
    config, _ = read_gpt_config(path)
    check_model(config, tp=job.tp)
    items = read_prompts(
        job.input,
        job.sampling,
        checkpoint=path,
        count_tokens=lambda text: len(encode_bytes(text)),
        max_seq_len=config.block_size,
    )
    return dataclasses.replace(job, checkpoint=path), items


def shares(pending: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's contiguous share of ``pending`` (sizes differ by at most one)."""
    n = len(pending)
    return [
        list(pending[r * n // world_size : (r + 1) * n // world_size]) for r in range(world_size)
    ]


def _record(item: PromptItem, result: GenerationResult) -> dict[str, Any]:
    record: dict[str, Any] = {"index": item.index}
    if item.id is not None:
        record["id"] = item.id
    record.update(
        prompt=item.prompt,
        completion=result.text,
        tokens=result.tokens,
        stop_reason=result.stop_reason,
        seed=item.sampling.seed,
    )
    return record


def _pending(rank: int, world_size: int, items: list[PromptItem], parts: Path) -> list[int]:
    """Rank 0 reads the part files before anyone writes, and tells every rank what is left."""
    pending: list[Any] = [None]
    if rank == 0:
        done = scan_parts(parts, {i.index: i.key for i in items})
        pending[0] = [i.index for i in items if i.index not in done]
    if world_size > 1:
        dist.broadcast_object_list(pending, src=0)
    return list(pending[0])


def run_infer(job: InferJob, *, progress: Progress | None = None) -> InferSummary | None:
    """Run ``job`` on this rank (every rank of the job calls it; one process is a job of one).
    Starts the process group from the launcher's environment if none runs.

    Args:
        job: What to do.
        progress: Called on rank 0 with ``(done, total)`` prompts of this run.

    Returns:
        The summary on rank 0 (also written to ``job.summary_json`` when set); ``None`` elsewhere.

    Raises:
        FileNotFoundError, ValueError: see :func:`plan_infer`; a world size that is not a
            multiple of ``job.tp``.
    """
    owned = not world.is_initialized()
    runtime = world.init()
    try:
        rank, size = runtime.rank, runtime.world_size
        if size % job.tp:
            raise ValueError(f"tp={job.tp} must divide the job's world size {size}")
        with warnings.catch_warnings():
            if rank != 0:
                warnings.simplefilter("ignore")  # one copy of each input warning
            job, items = plan_infer(job)
        model, _, _ = load_for_job(
            job.checkpoint, dtype=job.dtype, device=runtime.device, tp=job.tp, world_size=size
        )
        # ParallelDims puts tp innermost: the group of rank r is dp rank r // tp
        replica, leader = rank // job.tp, rank % job.tp == 0
        started = time.perf_counter()
        parts = parts_dir(job.output)
        pending = _pending(rank, size, items, parts)
        all_shares = shares(pending, size // job.tp)
        writer = PartWriter(parts, rank) if pending and leader else None
        generator = TextGenerator(
            model, max_batch_size=job.batch_size, tp_group="auto" if job.tp > 1 else None
        )
        counts = _decode(job, items, all_shares, rank, replica, size, writer, generator, progress)
        summary = None
        if rank == 0:
            summary = _finish(job, items, parts, pending, counts, started, size)
        if size > 1:
            dist.barrier()  # the other ranks exit only once the output exists
        return summary
    finally:
        if owned:
            world.shutdown()


def _decode(
    job: InferJob,
    items: list[PromptItem],
    all_shares: list[list[int]],
    rank: int,
    replica: int,
    size: int,
    writer: PartWriter | None,
    generator: TextGenerator,
    progress: Progress | None,
) -> tuple[int, int]:
    """Decode this rank's replica's share batch by batch (only the writing rank of each replica
    records and counts it); returns ``(prompts, tokens)`` of all replicas."""
    mine = all_shares[replica]
    total = sum(len(s) for s in all_shares)
    rounds = max(math.ceil(len(s) / job.batch_size) for s in all_shares)
    active = faults.active()
    done = torch.zeros(2, dtype=torch.long)
    if progress is not None and rank == 0:
        progress(0, total)
    for k in range(rounds):
        batch = [items[i] for i in mine[k * job.batch_size : (k + 1) * job.batch_size]]
        count = torch.zeros(2, dtype=torch.long)
        if batch:
            results = generator.generate([b.prompt for b in batch], [b.sampling for b in batch])
            if writer is not None:
                writer.append(
                    {**_record(b, r), "key": b.key} for b, r in zip(batch, results, strict=True)
                )
                count += torch.tensor([len(batch), sum(len(r.tokens) for r in results)])
            faults.on_step_end(k + 1, rank, active)  # TORSH_FAULT=kill:rank=R:step=K (tests)
        if size > 1:
            dist.all_reduce(count)
        done += count
        if progress is not None and rank == 0:
            progress(int(done[0]), total)
    return int(done[0]), int(done[1])


def _finish(
    job: InferJob,
    items: list[PromptItem],
    parts: Path,
    pending: list[int],
    counts: tuple[int, int],
    started: float,
    size: int,
) -> InferSummary:
    results = scan_parts(parts, {i.index: i.key for i in items})
    missing = [i.index for i in items if i.index not in results]
    if missing:
        raise TorshDistributedError(
            f"{len(missing)} prompt(s) have no result in {parts} after every rank finished "
            f"(first: index {missing[0]}); {job.output} was not written",
            operation="infer",
        )
    records = []
    for item in items:
        record = dict(results[item.index])
        record.pop("key")
        records.append(record)
    write_jsonl_atomic(Path(job.output), records)
    shutil.rmtree(parts, ignore_errors=True)
    wall = time.perf_counter() - started
    summary = InferSummary(
        prompts=len(items),
        skipped=len(items) - len(pending),
        computed=counts[0],
        generated_tokens=counts[1],
        wall_time_s=wall,
        tokens_per_s=counts[1] / wall if wall > 0 else 0.0,
        world_size=size,
        tp=job.tp,
        output=job.output,
        checkpoint=job.checkpoint,
    )
    if job.summary_json:
        from torsh_distributed.checkpoint.manifest import atomic_write_text

        out = Path(job.summary_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary
