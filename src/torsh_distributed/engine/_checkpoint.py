"""The engine's checkpointing: the three calls the training loop makes.

``RunCheckpoint(section, ...)`` before the loop, ``resume()`` for the step to start at,
``step_end(step, losses)`` after every step, ``finish(step, losses)`` after the loop. What a
checkpoint holds besides model and optimizer: the data position (the step; see
:mod:`~torsh_distributed.checkpoint.resume`), the loss history (so a resumed run reports every
step), what the model is (``extra["model"]``: for the built-in GPT its shape, MoE section and
tokenizer, read back by :mod:`torsh_distributed.inference.load`), a hash of the settings that
change the computation, small JSON state that is equal on every rank (the fp16 loss scale) and
per-rank tensor state (gradient-compression residuals and PowerSGD factors, in ``rank_R.pt``).

What a resumed run says (main rank, at every verbosity): where it resumed (``resumed from PATH
at step S``, or ``resumed at step 0 (no checkpoint yet; N step(s) lost)``), what the restart lost,
and a changed ``max_steps`` as a schedule change rather than a configuration warning. Restarts,
lost steps and saves are totalled over every attempt of the job (kept in ``progress.json``; see
:mod:`~torsh_distributed.checkpoint.progress`) for the summary's ``checkpoint`` block.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torsh_distributed.checkpoint import faults
from torsh_distributed.checkpoint.config import CheckpointConfig
from torsh_distributed.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from torsh_distributed.checkpoint.progress import (
    Progress,
    attempt_entry,
    carried_attempts,
    describe_restart,
    job_attempt,
    membership_change,
    node_label,
    read_progress,
    record_progress,
)
from torsh_distributed.checkpoint.resume import check_data_position, data_position
from torsh_distributed.data.sampler import GlobalSampler, check_sampler_state
from torsh_distributed.engine.config import OptimConfig
from torsh_distributed.engine.optim import lr_at
from torsh_distributed.runtime import world

__all__ = ["RunCheckpoint", "settings_hash", "computation_settings"]

# The engine settings that change what is computed; the rest (progress, logging, backend, ...) do not.
_HASHED = ("optim", "max_steps", "batch_size", "seed")
# Settings a resume may change without a warning: a finished run continued with a larger
# --max-steps (reported as a schedule change instead).
_SCHEDULE = ("max_steps",)
_LR_RULE = ("lr_ref_batch", "lr_scaling")


def computation_settings(config: Any, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings of an ``EngineConfig`` that determine the computation, plus ``extra`` (the
    model's shape, the data: whatever the caller knows changes the result)."""
    data = config.to_dict()
    hashed = {k: data[k] for k in _HASHED}
    # the lr rule's inputs are not the computation: the scaled lr and warm-up it gave are (and
    # checkpoints written before the rule existed have neither key)
    hashed["optim"] = {k: v for k, v in hashed["optim"].items() if k not in _LR_RULE}
    return {**hashed, **dict(extra or {})}


def settings_hash(settings: Mapping[str, Any]) -> str:
    """Short SHA-256 of the settings that determine the computation (JSON-serialisable)."""
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RunCheckpoint:
    """Resume, periodic saves and the final save of the engine's loop.

    Args:
        section: The ``checkpoint`` section (drives everything here).
        seed: The run's seed (part of the data position).
        batch_size: The global batch (part of the data position).
        max_steps: The run's last step (no periodic save there: the final save covers it).
        settings: The settings that change the computation; their hash is stored, and resuming
            a checkpoint written under other settings warns (the data position, sampler and
            seed are checked strictly).
        model: The wrapped model the loop trains (DDP or sharded).
        optimizer: Its optimizer.
        num_samples: Size of the training set (for the nominal epoch).
        write: Prints a line on the main rank (the progress bar's ``write``).
        json_state: Further ``Stateful`` objects whose state is small, JSON-serialisable and the
            same on every rank (the fp16 loss scaler); stored in the checkpoint's metadata.
        rank_state: ``Stateful`` objects whose state differs per rank and holds tensors (the
            compression hook: residuals, PowerSGD factors); saved per rank and restored when the
            world size is unchanged (a resharded run starts them afresh and says so).
        layout: Tensor layout DCP cannot convert (see :class:`CheckpointManager`); a checkpoint
            saved with another one is refused on resume.
        sampler: The training sampler; its settings (kind, dataset size, seed, global batch)
            are saved, and a resume under other settings is refused (the data would not continue).
        model_info: JSON describing the model (how inference rebuilds it), saved as
            ``extra["model"]``; empty = not saved.
    """

    def __init__(
        self,
        section: CheckpointConfig,
        *,
        seed: int,
        batch_size: int,
        max_steps: int,
        settings: Mapping[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        num_samples: int,
        write: Callable[[str], None] | None = None,
        json_state: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        layout: Mapping[str, Any] | None = None,
        sampler: GlobalSampler | None = None,
        model_info: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_info = dict(model_info or {})
        self.seed, self.batch_size, self.max_steps = seed, batch_size, max_steps
        self.sampler = sampler
        self.json_state = dict(json_state or {})
        self.rank_state = {k: v for k, v in (rank_state or {}).items() if v is not None}
        self.section = section
        self.model, self.optimizer = model, optimizer
        self.num_samples = num_samples
        self.write = write or (lambda text: print(text, flush=True))
        self.rank = world.rank()
        self.is_main = self.rank == 0
        self.faults = faults.active()
        self.resumed_step: int | None = None
        self._first_step_logged = False
        self._saved_step: int | None = None
        self.around_save: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        """Wraps each save (the energy tracker's ``checkpoint`` phase)."""
        resume = self.section.resume
        directory = self.section.dir
        if not directory and resume not in ("auto", "never"):
            directory = str(Path(resume).parent)  # load only; nothing is saved without dir
        self.manager: CheckpointManager | None = None
        if directory:
            self.manager = CheckpointManager(
                directory,
                keep_last=self.section.keep_last,
                keep_best=self.section.keep_best,
                every_steps=self.section.every,
                every_s=self.section.every_s,
                async_save=self.section.async_save,
                config_hash=settings_hash(settings),
                layout=layout,
                settings=settings,
                expected_changes=_SCHEDULE,
                peer_replicas=self.section.peer_replicas,
            )
        self.saving = bool(self.section.dir)
        self.settings = dict(settings)
        self._members: list[dict[str, Any]] = []
        self.job, self.attempt = job_attempt()
        # the job's earlier attempts (from progress.json) and this one: the summary totals them
        self._attempts: list[dict[str, Any]] = []
        self._this = attempt_entry(self.attempt, resumed_step=0, lost_steps=0)

    def _gather_members(self) -> None:
        """Who runs this attempt (rank, node, host), for ``progress.json``: one collective."""
        me = {"rank": self.rank, "node": world.node_rank(), "host": node_label()}
        if world.world_size() == 1 or not torch.distributed.is_initialized():
            self._members = [me]
            return
        gathered: list[Any] = [None] * world.world_size()
        torch.distributed.all_gather_object(gathered, me)
        self._members = [m for m in gathered if m is not None]

    def resume(self) -> tuple[int, list[float]]:
        """Load the checkpoint ``--resume`` names; return the step to start at and past losses.

        Collective. The main rank says where the run resumed (also at step 0 after a restart
        that found no checkpoint) and what the restart lost.
        """
        if self.saving:
            self._gather_members()
        previous = read_progress(self.section.dir) if self.saving and self.is_main else None
        self._attempts = carried_attempts(previous, job=self.job, attempt=self.attempt)
        step, losses, loaded_from = 0, [], None
        if self.manager is not None and self.section.resume != "never":
            path = None if self.section.resume == "auto" else self.section.resume
            loaded = self.manager.load(model=self.model, optimizer=self.optimizer, path=path)
            if loaded is not None:
                step, losses = self._restore(loaded)
                loaded_from = loaded.path
        if self.is_main:
            self._announce(previous, step=step, loaded=loaded_from is not None)
        self._share_attempts()
        if self.saving and self.is_main:
            self._record(step)
        return step, losses

    def _restore(self, loaded: LoadedCheckpoint) -> tuple[int, list[float]]:
        """Check and restore what the engine keeps beside model and optimizer; say so."""
        extra: dict[str, Any] = loaded.meta.get("extra", {})
        step = check_data_position(
            extra.get("data", {}), seed=self.seed, batch_size=self.batch_size
        )
        if self.sampler is not None and "sampler" in extra:
            try:
                check_sampler_state(self.sampler, extra["sampler"])
            except ValueError as exc:
                raise ValueError(
                    f"checkpoint {loaded.path}: the data would not continue: {exc}; run with the "
                    "same data settings, or --resume never"
                ) from None
        if step > self.max_steps:
            raise ValueError(
                f"checkpoint {loaded.path} is at step {step}, beyond max_steps {self.max_steps}; "
                "raise --max-steps to continue it, or start afresh with --resume never"
            )
        losses = [float(x) for x in extra.get("losses", [])][:step]
        for name, obj in self.json_state.items():
            if name in extra.get("state", {}):
                obj.load_state_dict(extra["state"][name])
        missing = self._load_rank_state(loaded.rank_tensors or {})
        self.resumed_step = self._saved_step = step
        if self.is_main:
            for line in loaded.skipped:
                self.write(f"checkpoint: skipped {line}")
            saved_world = loaded.meta.get("world_size")
            note = (
                ""
                if loaded.rng_restored
                else (
                    f"; saved at world size {saved_world}, resharded to {world.world_size()} "
                    "(RNG states not restored)"
                )
            )
            self.write(f"checkpoint: resumed from {loaded.path} at step {step}{note}")
            if "max_steps" in loaded.changed_settings:
                self.write(f"checkpoint: {self._schedule_change(loaded, step)}")
            if missing:
                self.write(
                    f"checkpoint: {', '.join(missing)} state not in the checkpoint "
                    f"{'(per-rank state is not resharded)' if not loaded.rng_restored else ''}"
                    "; it starts afresh"
                )
            faults.log_event("resumed", rank=self.rank, step=step, path=str(loaded.path))
        return step, losses

    def _schedule_change(self, loaded: LoadedCheckpoint, step: int) -> str:
        """``max_steps 100 -> 200: continuing the schedule (...)``: what the new length does to
        the learning rate of the built-in schedule at the resumed step."""
        old, new = loaded.changed_settings["max_steps"]
        line = f"max_steps {old} -> {new}: continuing the schedule"
        if "lr_scheduler" in self.json_state:
            return line + " (your lr_scheduler continues from its saved state)"
        saved = loaded.meta.get("settings") or {}
        try:
            optim = OptimConfig(**self.settings["optim"])
            saved_optim = OptimConfig(
                **{k[len("optim.") :]: v for k, v in saved.items() if k.startswith("optim.")}
            )
            before = lr_at(step, optim=saved_optim, max_steps=int(old))
            after = lr_at(step, optim=optim, max_steps=int(new))
        except (KeyError, TypeError, ValueError):
            return line  # settings of another shape (a caller's own): nothing more to say
        if before == after:
            return line + f" (learning rate at step {step}: {after:.3g}, unchanged)"
        decay = "" if optim.schedule == "constant" else f"{optim.schedule} decay to step {new}; "
        return line + f" ({decay}learning rate at step {step}: {before:.3g} -> {after:.3g})"

    def _announce(self, previous: Progress | None, *, step: int, loaded: bool) -> None:
        """Main rank: what this attempt lost, and where it starts when no checkpoint was loaded."""
        world_size = world.world_size()
        if loaded:
            if previous is not None:
                lost, line = describe_restart(
                    previous, resumed_step=step, world_size=world_size, members=self._members
                )
                self._this["lost_steps"] = lost
                changed = membership_change(previous, world_size=world_size, members=self._members)
                if lost or changed or self.attempt:  # not a plain rerun of a finished run
                    self.write(f"checkpoint: {line}")
        elif self.manager is not None and self.section.resume != "never":
            if previous is None and self.attempt == 0:
                return  # a fresh run
            lost = previous.step if previous is not None else 0
            text = f"resumed at step 0 (no checkpoint yet; {lost} step(s) lost)"
            if previous is not None:
                text += (
                    f": the previous attempt reached step {previous.step} at world size "
                    f"{previous.world_size}"
                    + membership_change(previous, world_size=world_size, members=self._members)
                )
            self._this["lost_steps"] = lost
            self.write(f"checkpoint: {text}")
        elif self.attempt > 0:
            same_job = previous is not None and previous.job == self.job
            lost = previous.step if previous is not None and same_job else None
            why = "--resume never" if self.manager is not None else "no --checkpoint-dir"
            self._this["lost_steps"] = lost or 0
            counted = f"; {lost} step(s) lost" if lost is not None else ": every step is redone"
            self.write(f"checkpoint: restart {self.attempt} starts at step 0 ({why}{counted})")
        self._this["resumed_step"] = self._this["reached_step"] = step

    def _share_attempts(self) -> None:
        """Every rank gets the main rank's attempt history (one tiny broadcast), so the summary
        is the same everywhere."""
        if not self.saving or world.world_size() == 1 or not torch.distributed.is_initialized():
            return  # without progress.json there is no history: each rank's own figures hold
        box: list[Any] = [(self._attempts, self._this)]
        torch.distributed.broadcast_object_list(box, src=0)
        carried, this = box[0]
        self._attempts = carried
        self._this = {**this, "saves": self._this["saves"], "stall_s": self._this["stall_s"]}

    def _all_attempts(self) -> list[dict[str, Any]]:
        return [*self._attempts, self._this]

    def _record(self, step: int) -> None:
        """Main rank: ``progress.json`` with this attempt's figures brought up to date."""
        self._this["reached_step"] = step
        if self.manager is not None:
            self._this["saves"] = self.manager.num_saves
            self._this["stall_s"] = round(self.manager.total_stall_s, 4)
        record_progress(
            self.section.dir,
            step=step,
            world_size=world.world_size(),
            members=self._members,
            job=self.job,
            attempt=self.attempt,
            attempts=self._all_attempts(),
        )

    def _load_rank_state(self, saved: Mapping[str, Any]) -> list[str]:
        """Restore each ``rank_state`` object saved on this rank; return the names not found."""
        missing = []
        for name, obj in self.rank_state.items():
            if name not in saved:
                missing.append(name)
                continue
            try:
                obj.load_state_dict(saved[name])
            except ValueError as exc:  # e.g. saved with another compression method
                missing.append(f"{name} ({exc})")
        return missing

    def _save(self, step: int, losses: list[float], *, blocking: bool | None = None) -> None:
        with self.around_save():
            self._save_to_manager(step, losses, blocking)
        self._saved_step = step
        faults.on_save_started(step, self.rank, self.faults)

    def _save_to_manager(self, step: int, losses: list[float], blocking: bool | None) -> None:
        assert self.manager is not None
        tail = losses[-min(10, len(losses)) :]
        self.manager.save(
            step,
            model=self.model,
            optimizer=self.optimizer,
            extra={
                "data": data_position(
                    step=step,
                    seed=self.seed,
                    batch_size=self.batch_size,
                    num_train_tokens=self.num_samples,
                ),
                "losses": losses,
                "state": {name: obj.state_dict() for name, obj in self.json_state.items()},
                **({"sampler": self.sampler.state_dict()} if self.sampler is not None else {}),
                **({"model": self.model_info} if self.model_info else {}),
            },
            rank_tensors={name: obj.state_dict() for name, obj in self.rank_state.items()},
            metric=sum(tail) / len(tail) if tail else None,
            blocking=blocking,
        )

    def save_now(self, step: int, losses: list[float]) -> None:
        """Save at ``step`` now and wait for it (every rank; collective), unless checkpointing is
        off or ``step`` is saved already: before a pause (carbon-aware time shifting)."""
        if self.saving and self.manager is not None and self._saved_step != step:
            self._save(step, losses, blocking=True)
            if self.is_main:
                self._record(step)

    def step_end(self, step: int, losses: list[float]) -> None:
        """After ``step`` steps: save if due, then apply injected faults (tests only)."""
        if self.resumed_step is not None and not self._first_step_logged and self.is_main:
            faults.log_event("first_step", rank=self.rank, step=step)
        self._first_step_logged = True
        if self.saving and self.is_main:
            self._record(step)
        if self.saving and self.manager is not None and step < self.max_steps:
            if self.manager.due(step):
                self._save(step, losses)
                if self.is_main:
                    self._record(step)  # count the save, should the next step never come
        if self.faults:
            faults.on_step_end(step, self.rank, self.faults)

    def finish(self, step: int, losses: list[float]) -> None:
        """Save the final step (``save_final``) and wait until every save is committed."""
        if self.manager is None:
            return
        if self.saving and self.section.save_final and self._saved_step != step:
            self._save(step, losses)
        self.manager.close()
        if self.saving and self.is_main:
            self._record(step)
        totals = self.summary()
        if self.is_main and totals["saves"]:
            line = (
                f"checkpoint: {totals['saves']} save(s) to {self.section.dir}, training "
                f"blocked {totals['stall_s']:.3f} s in total "
                f"({'async' if self.section.async_save else 'sync'})"
            )
            if totals["restarts"]:
                line += (
                    f"; {totals['restarts']} restart(s), {totals['lost_steps']} step(s) lost "
                    "and recomputed over all attempts"
                )
            self.write(line)

    def close(self) -> None:
        """Wait for a pending asynchronous save (idempotent; the error path)."""
        if self.manager is not None:
            self.manager.close()

    def summary(self) -> dict[str, Any]:
        """Checkpoint figures for the run summary, totalled over every attempt of the job.

        ``saves`` and ``stall_s``: all attempts; ``resumed_step``: where this (the last) attempt
        started from a checkpoint (``None``: it did not); ``lost_steps``: steps recomputed after
        every restart; ``restarts``: elastic restarts; ``attempts``: one entry per attempt.
        """
        if self.manager is None:
            return {"restarts": self.attempt} if self.attempt else {}
        self._this["saves"] = self.manager.num_saves
        self._this["stall_s"] = round(self.manager.total_stall_s, 4)
        attempts = self._all_attempts()
        return {
            "saves": sum(int(a.get("saves", 0)) for a in attempts),
            "stall_s": round(sum(float(a.get("stall_s", 0.0)) for a in attempts), 4),
            "resumed_step": self.resumed_step,
            "lost_steps": sum(int(a.get("lost_steps", 0)) for a in attempts),
            "restarts": self.attempt,
            "attempts": [dict(a) for a in attempts],
        }
