"""World-size independent, resumable sampling for any map-style dataset.

The design is one rule: the *global* batch of step ``s`` is a pure function of the sampler's
settings and ``s``, and rank ``r`` of ``n`` takes the contiguous rows ``[r*B/n, (r+1)*B/n)`` of
it (:func:`shard`). Consequences:

* runs at any world size see the same samples per step, so a data-parallel run is comparable
  to (and, up to float reduction order, equal to) single-process training on the same batch;
* the step alone is the data position: a run saved at step ``s`` on 4 ranks resumes at step
  ``s`` on 2 ranks (or 1, or 8) and draws exactly the batches the original run would have drawn;
* no process needs to talk to another to agree on the data.

Two samplers implement :class:`GlobalSampler`: :class:`EpochSampler` (shuffled epochs without
replacement, what users expect of a ``DataLoader``) and :class:`ReplacementSampler` (i.i.d. with
replacement, bit-identical to the built-in trainer's
:func:`torsh_distributed.data.corpus.sample_batch`). :func:`fetch` turns indices into a batch the
way a ``DataLoader`` would; :class:`DistributedBatchSampler` plugs the rule into a user's own
``DataLoader(dataset, batch_sampler=...)`` loop and carries the position in its state dict.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.utils.data import Sampler, default_collate

__all__ = [
    "GlobalSampler",
    "EpochSampler",
    "ReplacementSampler",
    "DistributedBatchSampler",
    "shard",
    "fetch",
    "check_sampler_state",
]

_SEED_MIX = 1_000_003  # the built-in trainer's historic mix of (seed, step); do not change


@runtime_checkable
class GlobalSampler(Protocol):
    """Chooses the whole global batch of every step, as a pure function of settings and step.

    Implementations must return the same indices for the same ``(settings, step)`` in every
    process and every run; that is what makes batches independent of the world size and the
    step a complete data position.
    """

    @property
    def global_batch(self) -> int:
        """Samples per step, summed over all data-parallel ranks."""
        ...

    def indices(self, step: int) -> torch.Tensor:
        """The global batch of 0-based ``step``: an int64 tensor of ``global_batch`` indices."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The settings that must match on resume (kind, seed, global batch, dataset size...)."""
        ...


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


def _generator(seed: int, counter: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _SEED_MIX + counter)


class _Sampler:
    """What both samplers hold: the dataset length, the global batch and the seed."""

    __slots__ = ("_num_samples", "_global_batch", "_seed")

    def __init__(self, num_samples: int, *, global_batch: int, seed: int) -> None:
        _check_count("num_samples", num_samples)
        _check_count("global_batch", global_batch)
        _check_seed(seed)
        self._num_samples = num_samples
        self._global_batch = global_batch
        self._seed = seed

    @property
    def num_samples(self) -> int:
        """Dataset length (indices are drawn from ``[0, num_samples)``)."""
        return self._num_samples

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks."""
        return self._global_batch

    @property
    def seed(self) -> int:
        """Seed of the sample order."""
        return self._seed


class EpochSampler(_Sampler):
    """Shuffled epochs without replacement; the last partial batch of each epoch is dropped.

    Step ``s`` belongs to epoch ``s // batches_per_epoch``; epoch ``e`` is the permutation
    ``torch.randperm(num_samples)`` drawn from a generator seeded with ``seed * 1_000_003 + e``
    (identity order when ``shuffle`` is false), and step ``s`` takes the slice
    ``[(s % batches_per_epoch) * global_batch, +global_batch)`` of it. Every index therefore
    appears at most once per epoch, and exactly once when ``global_batch`` divides
    ``num_samples``. Epochs never end: step numbers past one epoch simply continue in the next.

    Args:
        num_samples: Dataset length (``len(dataset)``).
        global_batch: Samples per step over all ranks. Must divide by the number of ranks that
            will :func:`shard` it; up to ``global_batch - 1`` samples per epoch go unused.
        seed: Fixes every epoch's order; change it to get a different stream.
        shuffle: False visits ``0, 1, 2, ...`` in order every epoch (evaluation, debugging).

    Raises:
        ValueError: ``num_samples`` or ``global_batch`` is < 1, or ``num_samples`` is smaller than
            ``global_batch`` (an epoch would hold no batch).
    """

    __slots__ = ("_shuffle", "_cache")

    def __init__(
        self, num_samples: int, *, global_batch: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        super().__init__(num_samples, global_batch=global_batch, seed=seed)
        if num_samples < global_batch:
            raise ValueError(
                f"num_samples {num_samples} is smaller than global_batch {global_batch}: "
                "an epoch would hold no full batch (the last partial batch is dropped)"
            )
        self._shuffle = bool(shuffle)
        # One permutation is kept: consecutive steps reuse it instead of redrawing O(N) work.
        self._cache: tuple[int, torch.Tensor] | None = None

    @property
    def shuffle(self) -> bool:
        """Whether epochs are shuffled."""
        return self._shuffle

    @property
    def batches_per_epoch(self) -> int:
        """Steps per epoch: ``num_samples // global_batch``."""
        return self._num_samples // self._global_batch

    def epoch_of(self, step: int) -> int:
        """The 0-based epoch that ``step`` belongs to."""
        _check_step(step)
        return step // self.batches_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self._shuffle:
            order = torch.randperm(self._num_samples, generator=_generator(self._seed, epoch))
        else:
            order = torch.arange(self._num_samples, dtype=torch.int64)
        self._cache = (epoch, order)
        return order

    def indices(self, step: int) -> torch.Tensor:
        """The global batch of ``step`` (a new int64 tensor of ``global_batch`` indices)."""
        _check_step(step)
        epoch, position = divmod(step, self.batches_per_epoch)
        start = position * self._global_batch
        return self._permutation(epoch)[start : start + self._global_batch].clone()

    def state_dict(self) -> dict[str, Any]:
        """Settings that must match on resume."""
        return {
            "kind": "epoch",
            "num_samples": self._num_samples,
            "global_batch": self._global_batch,
            "seed": self._seed,
            "shuffle": self._shuffle,
        }

    def __repr__(self) -> str:
        return (
            f"EpochSampler({self._num_samples}, global_batch={self._global_batch}, "
            f"seed={self._seed}, shuffle={self._shuffle})"
        )


class ReplacementSampler(_Sampler):
    """Independent uniform draws with replacement: the built-in trainer's sampling.

    ``indices(step)`` is ``torch.randint(0, num_samples, (global_batch,))`` from a generator
    seeded with ``seed * 1_000_003 + step``, bit-identical to the window starts that
    :func:`torsh_distributed.data.corpus.sample_batch` draws when
    ``num_samples = tokens.numel() - block_size - 1``
    (``len(TokenWindows(tokens, block_size))``). There are no epochs: a sample may repeat
    within a batch and across steps, and the stream never runs out.

    Args:
        num_samples: Dataset length; indices are drawn from ``[0, num_samples)``.
        global_batch: Samples per step over all ranks.
        seed: Fixes the stream; seed and step together fix a batch.

    Raises:
        ValueError: ``num_samples`` or ``global_batch`` is < 1.
    """

    __slots__ = ()

    def __init__(self, num_samples: int, *, global_batch: int, seed: int = 0) -> None:
        super().__init__(num_samples, global_batch=global_batch, seed=seed)

    def indices(self, step: int) -> torch.Tensor:
        """The global batch of ``step`` (an int64 tensor of ``global_batch`` indices)."""
        _check_step(step)
        return torch.randint(
            0, self._num_samples, (self._global_batch,), generator=_generator(self._seed, step)
        )

    def state_dict(self) -> dict[str, Any]:
        """Settings that must match on resume."""
        return {
            "kind": "replacement",
            "num_samples": self._num_samples,
            "global_batch": self._global_batch,
            "seed": self._seed,
        }

    def __repr__(self) -> str:
        return (
            f"ReplacementSampler({self._num_samples}, global_batch={self._global_batch}, "
            f"seed={self._seed})"
        )


def shard(indices: torch.Tensor, *, rank: int, num_ranks: int) -> torch.Tensor:
    """Rank ``rank`` of ``num_ranks``'s contiguous share of a global batch.

    Rank ``r`` takes rows ``[r*B/n, (r+1)*B/n)``, so concatenating the shards in rank order gives
    back the global batch whatever ``n`` is.

    Args:
        indices: The global batch (1-D), e.g. :meth:`GlobalSampler.indices`.
        rank: This rank's index among the data-parallel ranks (not the global rank when other
            parallel dimensions are in use).
        num_ranks: Number of data-parallel ranks.

    Returns:
        A view of ``B / num_ranks`` rows of ``indices``.

    Raises:
        ValueError: ``indices`` is not 1-D, ``num_ranks`` < 1, ``rank`` outside
            ``[0, num_ranks)``, or the global batch does not divide by ``num_ranks``.
    """
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    _check_count("num_ranks", num_ranks)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    global_batch = indices.numel()
    if global_batch % num_ranks:
        raise ValueError(
            f"global batch {global_batch} is not divisible by num_ranks {num_ranks}; "
            "pick a global batch that is a multiple of the number of data-parallel ranks"
        )
    per_rank = global_batch // num_ranks
    return indices[rank * per_rank : (rank + 1) * per_rank]


def fetch(
    dataset: Any,
    indices: torch.Tensor | Sequence[int],
    *,
    collate: Callable[[list[Any]], Any] | None = None,
) -> Any:
    """The batch a ``DataLoader`` would build from ``indices``, in this process.

    Items come from ``dataset.__getitems__(list_of_indices)`` when the dataset defines it (torch's
    batched-fetch protocol, one vectorised call), else from ``[dataset[i] for i in indices]``; then
    ``collate`` merges them. With the default :func:`torch.utils.data.default_collate`, items that
    are tuples ``(x, y)`` become a **list** ``[X, Y]`` of stacked tensors (torch's behaviour, kept
    so that results equal a ``DataLoader``'s), dicts become dicts of stacked tensors.

    Args:
        dataset: A map-style dataset.
        indices: 1-D tensor or sequence of ints, e.g. a :func:`shard` of a global batch.
        collate: Merges the list of items; ``None`` means ``default_collate``. Pass ``list`` (or
            ``lambda items: items``) to get the items themselves.

    Raises:
        ValueError: ``indices`` is a tensor that is not 1-D.
    """
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        keys: list[int] = indices.tolist()
    else:
        keys = [int(i) for i in indices]
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(keys) if getitems else [dataset[i] for i in keys]
    return (collate or default_collate)(items)


def check_sampler_state(sampler: GlobalSampler, saved: Mapping[str, Any]) -> None:
    """Raise unless ``saved`` (a ``sampler.state_dict()`` from a checkpoint) matches ``sampler``.

    Args:
        sampler: The sampler of the resumed run.
        saved: The sampler state stored by the original run.

    Raises:
        ValueError: naming every differing setting, e.g. ``global_batch 32 in the checkpoint,
            16 now``. The number of ranks is never one of them: it may change on resume.
    """
    now = sampler.state_dict()
    missing = object()
    differences = []
    for key in [*saved, *(k for k in now if k not in saved)]:
        old, new = saved.get(key, missing), now.get(key, missing)
        if old != new:
            shown_old = "absent" if old is missing else repr(old)
            shown_new = "absent" if new is missing else repr(new)
            differences.append(f"{key} {shown_old} in the checkpoint, {shown_new} now")
    if differences:
        raise ValueError(
            "the data sampler's settings differ from the checkpoint's: "
            + "; ".join(differences)
            + " (a resumed run must keep the data settings; only the number of ranks may change)"
        )


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DistributedBatchSampler(Sampler[list[int]]):
    """This rank's share of a :class:`GlobalSampler`'s batches, for a user's own loop.

    Use as ``DataLoader(dataset, batch_sampler=DistributedBatchSampler(...))``. Each iteration
    yields this rank's index list for steps ``step, step + 1, ...`` and advances :attr:`step` as
    each batch is handed out, so :meth:`state_dict` saved after a training step resumes at the
    next batch, at any world size.

    With ``num_steps=None`` and an epoch-based sampler, one iteration runs to the end of the
    current epoch (a full epoch from an epoch boundary, the rest of it after a mid-epoch resume),
    and the next iteration starts the next epoch: ``for epoch in ...: for batch in loader`` works
    without ``set_epoch``. With ``num_steps`` set, iteration runs until step ``num_steps``
    (an absolute step count, like ``max_steps``) and then yields nothing more.

    Caveat: a ``DataLoader`` with ``num_workers > 0`` draws indices ahead of the loop (up to
    ``num_workers * prefetch_factor`` batches), so :attr:`step` runs ahead of the batches actually
    trained on. Set ``batch_sampler.step`` to your own count of finished steps before calling
    :meth:`state_dict` (with ``num_workers=0`` the two agree).

    Args:
        sampler: The global stream. ``None`` builds an :class:`EpochSampler` from
            ``dataset_len``, ``global_batch``, ``seed`` and ``shuffle``.
        dataset_len: Dataset length, only without ``sampler``.
        global_batch: Samples per step over all ranks, only without ``sampler``.
        seed: Seed of the :class:`EpochSampler`; ignored (with a warning) with ``sampler``.
        shuffle: Shuffle the :class:`EpochSampler`; ignored (with a warning) with ``sampler``.
        rank: This rank among the data-parallel ranks; default: the process group's rank, else
            0. Pass it (and ``num_ranks``) when tensor/pipeline parallelism makes the
            data-parallel rank differ from the global rank.
        num_ranks: Number of data-parallel ranks; default: the process group's size, else 1.
            Giving it without ``rank`` is an error unless it equals the group's size.
        num_steps: Stop at this absolute step. Required for samplers without epochs
            (:class:`ReplacementSampler`), whose stream never ends.

    Raises:
        ValueError: neither or both of ``sampler`` and ``dataset_len``/``global_batch``; a bad
            rank, ``num_ranks`` or ``num_steps``; a global batch not divisible by ``num_ranks``;
            ``num_steps=None`` for a sampler without ``batches_per_epoch``.
    """

    def __init__(
        self,
        sampler: GlobalSampler | None = None,
        *,
        dataset_len: int | None = None,
        global_batch: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        num_ranks: int | None = None,
        num_steps: int | None = None,
    ) -> None:
        super().__init__()
        if sampler is None:
            if dataset_len is None or global_batch is None:
                raise ValueError(
                    "pass either a sampler or both dataset_len and global_batch "
                    f"(got dataset_len={dataset_len}, global_batch={global_batch})"
                )
            sampler = EpochSampler(
                dataset_len, global_batch=global_batch, seed=seed, shuffle=shuffle
            )
        else:
            if dataset_len is not None or global_batch is not None:
                raise ValueError(
                    "pass either a sampler or dataset_len and global_batch, not both "
                    f"(got dataset_len={dataset_len}, global_batch={global_batch} with {sampler!r})"
                )
            if not isinstance(sampler, GlobalSampler):
                raise TypeError(
                    f"sampler must implement GlobalSampler (global_batch, indices, state_dict), "
                    f"got {type(sampler).__name__}"
                )
            if seed != 0 or shuffle is not True:
                warnings.warn(
                    f"seed={seed} and shuffle={shuffle} are ignored: the given sampler "
                    f"{sampler!r} fixes the order",
                    stacklevel=2,
                )
        group_rank, group_size = _world()
        if rank is None and num_ranks is not None and num_ranks != group_size:
            raise ValueError(
                f"num_ranks {num_ranks} differs from the process group's {group_size} ranks: "
                "pass rank too (this process's data-parallel rank)"
            )
        num_ranks = group_size if num_ranks is None else num_ranks
        rank = group_rank if rank is None else rank
        _check_count("num_ranks", num_ranks)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
        if sampler.global_batch % num_ranks:
            raise ValueError(
                f"global_batch {sampler.global_batch} is not divisible by num_ranks {num_ranks}"
            )
        if num_steps is None and not hasattr(sampler, "batches_per_epoch"):
            raise ValueError(
                f"num_steps is required for {type(sampler).__name__}, whose stream has no epochs"
            )
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        self._sampler: GlobalSampler = sampler
        self._rank = rank
        self._num_ranks = num_ranks
        self._num_steps = num_steps
        self._step = 0

    @property
    def sampler(self) -> GlobalSampler:
        """The global stream this rank takes its share of."""
        return self._sampler

    @property
    def rank(self) -> int:
        """This rank among the data-parallel ranks."""
        return self._rank

    @property
    def num_ranks(self) -> int:
        """Number of data-parallel ranks."""
        return self._num_ranks

    @property
    def num_steps(self) -> int | None:
        """Absolute step to stop at; ``None``: at each epoch's end."""
        return self._num_steps

    @property
    def step(self) -> int:
        """The next step to yield (= batches handed out so far, counting resumed ones)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        _check_step(value)
        self._step = value

    def _end(self) -> int:
        if self._num_steps is not None:
            return self._num_steps
        per_epoch: int = self._sampler.batches_per_epoch  # type: ignore[attr-defined]
        return (self._step // per_epoch + 1) * per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        end = self._end()
        while self._step < end:
            mine = shard(
                self._sampler.indices(self._step), rank=self._rank, num_ranks=self._num_ranks
            )
            # Counted before the caller sees it: a state saved after this step resumes after it.
            self._step += 1
            yield mine.tolist()

    def __len__(self) -> int:
        """Steps left in this iteration (to ``num_steps``, or to the end of the current epoch)."""
        return max(self._end() - self._step, 0)

    def state_dict(self) -> dict[str, Any]:
        """``{"step": ..., "sampler": sampler settings}``; ranks are not part of it."""
        return {"step": self._step, "sampler": self._sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved :meth:`state_dict`, possibly saved at another world size.

        Raises:
            ValueError: ``state`` lacks ``step`` or ``sampler``, ``step`` is negative, or the
                sampler settings differ (each differing setting is named).
        """
        for key in ("step", "sampler"):
            if key not in state:
                raise ValueError(f"sampler state has no {key!r} entry (keys: {sorted(state)})")
        check_sampler_state(self._sampler, state["sampler"])
        self.step = state["step"]

    def __repr__(self) -> str:
        return (
            f"DistributedBatchSampler({self._sampler!r}, rank={self._rank}, "
            f"num_ranks={self._num_ranks}, num_steps={self._num_steps}, step={self._step})"
        )
