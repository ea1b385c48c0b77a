"""The checkpoint manager: verified, atomically committed, optionally asynchronous DCP checkpoints.

Layout of ``directory``::

    step_00000020/            committed: DCP shards (__R_0.distcp), .metadata, rank_RRRRR.json,
                              rank_RRRRR.pt (per-rank tensors, when given),
                              meta.json, manifest.json (SHA-256 of every file), COMMITTED
    .tmp-step_00000030/       being written (or left behind by a kill): never loaded

A save (every rank calls :meth:`CheckpointManager.save` at the same step):

1. each rank writes ``rank_R.json`` (its RNG states and any per-rank JSON) and, when given,
   ``rank_R.pt`` (per-rank tensors such as gradient-compression residuals; ``torch.save``, read
   back with ``weights_only=True``) into the temporary directory, rank 0 also ``meta.json`` (step, world size, config hash, metric, the caller's JSON);
2. model and optimizer state come from ``torch.distributed.checkpoint.state_dict.get_state_dict``
   (so DDP, FSDP2 and ZeRO-sharded models all work, and a checkpoint reshards on load) and are written
   by ``dcp.save``, or by ``dcp.async_save`` whose only cost to the training loop is the copy into
   host memory ("staging");
3. when DCP has finished, every rank has written its files (DCP's coordinator gathers every rank's
   write results before writing ``.metadata``), so rank 0 hashes every file into ``manifest.json``,
   writes the ``COMMITTED`` marker and renames the directory to its final name. Then old
   checkpoints are pruned (:mod:`~torsh_distributed.checkpoint.retention`).

A kill at any moment leaves either a committed, verifiable checkpoint or a ``.tmp-`` directory that
is ignored and removed by the next manager. Loading verifies the chosen checkpoint first; a missing,
partial or corrupt checkpoint is reported (file and reason) and the next older one is tried.

Requires a file system every rank sees at the same path (one node, or a shared mount), unless
``peer_replicas`` is set: then each host keeps its own directory and its ranks' files are
replicated to other hosts (:mod:`~torsh_distributed.checkpoint.peer`).
Background saves run collectives on a dedicated Gloo group so they never interleave with the
training loop's collectives on the default group.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torsh_distributed.checkpoint import manifest, retention
from torsh_distributed.checkpoint._safe import SafeFileSystemReader
from torsh_distributed.checkpoint._settings import check_settings, flatten_settings
from torsh_distributed.checkpoint._state import (
    ReusedBuffersStager,
    fingerprint,
    is_zero1,
    refill_hyperparameters,
    zero1_optim_state,
)
from torsh_distributed.checkpoint.catalog import CheckpointInfo, latest_valid, scan, step_dir_name
from torsh_distributed.checkpoint.peer import PeerReplicator
from torsh_distributed.checkpoint.resume import capture_rng, restore_rng
from torsh_distributed.comm.dims import side_group
from torsh_distributed.runtime.errors import CheckpointError

__all__ = [
    "CheckpointManager", "CheckpointInfo", "LoadedCheckpoint", "latest_valid", "step_dir_name",
    "scan",
]

log = logging.getLogger(__name__)

# A world of one is a supported case, not a mistake worth a warning on every save.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load` restored."""

    path: Path
    """The checkpoint directory loaded."""
    step: int
    """Step to continue from."""
    meta: dict[str, Any]
    """``meta.json``; ``meta["extra"]`` holds the JSON given to :meth:`CheckpointManager.save`."""
    rank_state: dict[str, Any] | None
    """This rank's JSON from the save, or ``None`` when the world size changed."""
    rank_tensors: dict[str, Any] | None
    """This rank's ``rank_tensors`` from the save; ``None`` when the world size changed or
    none were saved."""
    rng_restored: bool
    """False when the world size changed (RNG states are per rank and were left alone)."""
    skipped: list[str] = field(default_factory=list)
    """Descriptions of newer checkpoints that were invalid and skipped."""
    changed_settings: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """``{name: (saved, now)}`` of the settings this run changed (see ``settings``)."""


def _rank_tensors_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _default_group_lacks_cpu() -> bool:
    """An NCCL-only default group (e.g. one CUDA rank): DCP's ``async_save`` needs a group with a
    CPU backend even when it runs no collective, so the save gets a Gloo group of its own."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


class CheckpointManager:
    """Save, commit, verify, prune and load checkpoints of one training run.

    Construct it on every rank (collectively: it creates process groups). Every rank must call
    :meth:`due`, :meth:`save` and :meth:`load` at the same points of the program.

    Args:
        directory: Root of the checkpoints; created if missing.
        keep_last: Keep the newest N committed checkpoints; 0 = keep all.
        keep_best: Also keep the N with the lowest ``metric``.
        every_steps: :meth:`due` is true every N steps; 0 = not by steps.
        every_s: :meth:`due` is true when N seconds passed since the last save (rank 0's clock,
            broadcast, so ranks agree); 0 = not by time. Costs one tiny broadcast per step.
        async_save: Write in the background; the caller waits only for the host copy. Costs
            a host-memory copy of this rank's state while the write is in flight.
        config_hash: Stored in ``meta.json``; :meth:`load` warns when it differs.
        settings: What ``config_hash`` hashes (JSON, nested or not), stored in ``meta.json`` so
            that the warning names the settings that differ (``optim.lr 0.003 -> 0.01``).
        expected_changes: Flattened setting names that may change between a save and a load
            without a warning (still returned in ``LoadedCheckpoint.changed_settings``).
        layout: How this run lays out tensors that DCP cannot convert by itself (the built-in
            model's fused ``qkv`` rows are permuted per tensor-parallel degree: ``{"tp": 2}``);
            stored in ``meta.json``. :meth:`load` refuses a checkpoint with another layout
            before reading any tensor (missing = ``{}``, the plain layout).
        peer_replicas: 0 = ``directory`` is one file system that every rank sees. ``k >= 1`` =
            each host has a directory of its own, and every rank's files are also kept by ``k``
            other hosts (:mod:`~torsh_distributed.checkpoint.peer`), so a resume survives the
            loss of up to ``k`` hosts' directories. Costs ``k`` times each rank's shard bytes on
            the network and on other disks per save, in the background; needs ``k + 1`` hosts.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 3,
        keep_best: int = 0,
        every_steps: int = 0,
        every_s: float = 0.0,
        async_save: bool = True,
        config_hash: str = "",
        layout: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
        expected_changes: Collection[str] = (),
        peer_replicas: int = 0,
    ) -> None:
        if keep_last < 0 or keep_best < 0 or every_steps < 0 or every_s < 0:
            raise ValueError("keep_last, keep_best, every_steps and every_s must be >= 0")
        if peer_replicas < 0:
            raise ValueError(f"peer_replicas must be >= 0, got {peer_replicas}")
        self.directory = Path(directory)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.every_steps, self.every_s = every_steps, every_s
        self.async_save = async_save
        self.config_hash = config_hash
        self.layout = dict(layout or {})
        self.settings = flatten_settings(settings) if settings is not None else None
        self.expected_changes = frozenset(expected_changes)
        self.rank = dist.get_rank() if _distributed() else 0
        self.world_size = dist.get_world_size() if _distributed() else 1
        # Background saves and main-thread control messages each get their own Gloo group: two
        # threads must never issue collectives on one group (Gloo would pair them up wrongly).
        self._save_group = (
            side_group("checkpoint-save") if _distributed() or _default_group_lacks_cpu() else None
        )
        self._ctl_group = side_group("checkpoint-control") if _distributed() else None
        self._peer: PeerReplicator | None = None
        if peer_replicas:
            if self._ctl_group is None:
                raise ValueError(
                    "peer_replicas needs a distributed job on several hosts; this one has 1 rank"
                )
            try:
                self._peer = PeerReplicator(
                    self.directory, replicas=peer_replicas, group=self._ctl_group
                )
            except ValueError as exc:
                raise CheckpointError(str(exc), rank=self.rank, operation="checkpoint.init") from None
        self._pending: threading.Event | None = None
        self._error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self.num_saves = 0
        self.total_stall_s = 0.0
        self.last_stall_s = 0.0
        self.last_committed_step: int | None = None
        # Between saves the state-dict view of model/optimizer (references to their tensors) and
        # the host buffers async saves stage into are reused: rebuilding both costs more than the
        # copy itself for small models. A changed tensor set (see _state.fingerprint) rebuilds them.
        self._cache: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._stager: ReusedBuffersStager | None = None
        # With peer replicas every host owns its directory; otherwise rank 0 owns the shared one.
        if self._peer.is_lead if self._peer is not None else self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{_TMP_PREFIX}*"):
                log.info("removing partial checkpoint %s (a save that never committed)", stale)
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()
        if self._peer is not None and self._ctl_group is not None:
            self._peer.check_distinct(self._ctl_group)

    @property
    def peer(self) -> PeerReplicator | None:
        """The replicator when ``peer_replicas`` is set (its ``stats`` count the bytes moved)."""
        return self._peer

    # --- control -------------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self._ctl_group is not None:
            dist.barrier(group=self._ctl_group)

    def _broadcast_int(self, value: int) -> int:
        if self._ctl_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, src=0, group=self._ctl_group)
        return int(tensor.item())

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` steps (same answer on every rank; collective if timed)."""
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        if not self.every_s:
            return by_steps
        by_time = time.monotonic() - self._last_save_time >= self.every_s
        return bool(self._broadcast_int(int(by_steps or by_time)))

    # --- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        rank_tensors: Mapping[str, Any] | None = None,
        metric: float | None = None,
        blocking: bool | None = None,
    ) -> float:
        """Checkpoint ``step`` (collective); returns the seconds the caller was blocked.

        Args:
            step: Optimizer steps done; names the checkpoint.
            model: The (possibly DDP/FSDP-wrapped) model.
            optimizer: Its optimizer, or ``None``.
            extra: JSON-serialisable run state (rank 0's is stored): data position, losses, ...
            rank_state: JSON-serialisable per-rank state, returned by :meth:`load` on that rank.
            rank_tensors: Per-rank state holding tensors (dicts, lists, numbers, strings and
                tensors only), written synchronously with ``torch.save`` and returned by
                :meth:`load` on the same rank at the same world size.
            metric: Lower is better; used by ``keep_best``.
            blocking: Override ``async_save`` for this save (``True`` = synchronous).

        Raises:
            CheckpointError: a previous background save failed, or this one could not be written.
        """
        started = time.perf_counter()
        self.wait()  # at most one save in flight; also surfaces a background failure
        final = self.directory / step_dir_name(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            rank_file = {
                "rank": self.rank,
                "world_size": self.world_size,
                "rng": capture_rng(),
                "state": dict(rank_state or {}),
            }
            (tmp / f"rank_{self.rank:05d}.json").write_text(json.dumps(rank_file))
            if rank_tensors:
                torch.save(dict(rank_tensors), tmp / _rank_tensors_file(self.rank))
            if self.rank == 0:
                meta = {
                    "format": manifest.FORMAT_VERSION,
                    "step": step,
                    "world_size": self.world_size,
                    "config_hash": self.config_hash,
                    **({"settings": self.settings} if self.settings is not None else {}),
                    "layout": self.layout,
                    "metric": metric,
                    "time": time.time(),
                    "torch": torch.__version__,
                    "extra": dict(extra or {}),
                }
                (tmp / manifest.META).write_text(json.dumps(meta, indent=1))
            state = self._cached_state_dict(model, optimizer)
            writer = FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
            is_async = self.async_save if blocking is None else not blocking
            if is_async:
                if self._stager is None:
                    self._stager = ReusedBuffersStager()
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    async_stager=self._stager,
                    process_group=self._save_group,
                    no_dist=self.world_size == 1,
                )
                # The commit runs in DCP's writer thread once the write is done (no extra thread).
                done = threading.Event()
                self._pending = done
                future.add_done_callback(
                    lambda fut: self._finish_async(fut, tmp, final, step, metric, done)
                )
            else:
                dcp.save(
                    state,
                    storage_writer=writer,
                    process_group=self._save_group,
                    no_dist=self.world_size == 1,
                )
                self._commit(tmp, final, step, metric)
                if self._peer is None:
                    # every rank returns once rank 0 committed: a rank that dies right after a
                    # synchronous save (and the agent stopping rank 0) cannot lose that save
                    self._barrier()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - disk full, permissions, a dead peer, ...
            raise CheckpointError(
                f"could not write checkpoint {final}: {type(exc).__name__}: {exc}",
                rank=self.rank,
                operation="checkpoint.save",
                fix="check free space and permissions of the checkpoint directory",
            ) from exc
        self._last_save_time = time.monotonic()
        stall = time.perf_counter() - started
        self.num_saves += 1
        self.last_stall_s = stall
        self.total_stall_s += stall
        return stall

    def _cached_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        key = fingerprint(model, optimizer)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._state_dict(model, optimizer))
            self._stager = None  # staged buffers have the old structure
        state = self._cache[1]
        groups = state.get("optim", {}).get("param_groups")
        if groups is not None and optimizer is not None:  # hyper-parameters change (lr schedule)
            for cached, live in zip(groups, optimizer.param_groups, strict=True):
                cached.update({k: v for k, v in live.items() if k != "params"})
        return state

    @staticmethod
    def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        if is_zero1(optimizer):
            return {
                "model": get_model_state_dict(model),
                "optim": zero1_optim_state(model, optimizer),
            }
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _finish_async(
        self,
        future: Future[Any],
        tmp: Path,
        final: Path,
        step: int,
        metric: float | None,
        done: threading.Event,
    ) -> None:
        try:
            future.result()
            self._commit(tmp, final, step, metric)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by wait()
            self._error = exc
        finally:
            done.set()

    def _commit(self, tmp: Path, final: Path, step: int, metric: float | None) -> None:
        """Rank 0: manifest, marker, rename, prune. Runs after every rank finished writing.
        With peer replicas: every host, after the replication (collective on the save group)."""
        if self._peer is not None and self._save_group is not None:
            self._peer.commit(tmp, final, step, self._save_group)
            if self._peer.is_lead:
                self._prune()
        elif self.rank == 0:
            digest = manifest.write_manifest(tmp)
            manifest.write_marker(tmp, step=step, manifest_sha256=digest)
            if final.exists():
                shutil.rmtree(final)  # an older save of the same step (after a restart)
            tmp.rename(final)
            self._prune()
        self.last_committed_step = step

    def _prune(self) -> None:
        if not self.keep_last:
            return
        infos = [i for i in scan(self.directory, deep=False) if (i.path / manifest.MARKER).exists()]
        metrics = {}
        for info in infos:
            try:
                metrics[info.step] = json.loads((info.path / manifest.META).read_text())["metric"]
            except (OSError, ValueError, KeyError):
                metrics[info.step] = None
        doomed = retention.to_delete(
            metrics.items(), keep_last=self.keep_last, keep_best=self.keep_best
        )
        for info in infos:
            if info.step in doomed:
                shutil.rmtree(info.path, ignore_errors=True)

    def wait(self) -> None:
        """Block until the background save (if any) is committed; re-raise its failure."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise CheckpointError(
                f"background checkpoint save failed: {type(exc).__name__}: {exc}",
                rank=self.rank,
                operation="checkpoint.save",
            ) from exc

    def close(self) -> None:
        """Finish the pending save; the manager can still load afterwards."""
        self.wait()
        self._cache, self._stager = None, None

    # --- loading -------------------------------------------------------------------------------

    def _choose(self, path: str | Path | None) -> tuple[Path | None, list[str]]:
        """Rank 0 verifies and picks; the choice is broadcast as a step number (-1: none)."""
        skipped: list[str] = []
        chosen = -1
        error = ""
        if self.rank == 0:
            if path is not None:
                verdict = manifest.verify(path)
                if verdict.valid:
                    chosen = int(verdict.meta["step"]) if verdict.meta else -1
                else:
                    error = verdict.describe()
            else:
                best, bad = latest_valid(self.directory)
                chosen = best.step if best is not None else -1
                for info in bad:
                    line = f"{info.path}: INVALID ({info.file}): {info.reason}"
                    skipped.append(line)
                    warnings.warn(f"skipping checkpoint {line}", stacklevel=3)
        chosen = self._broadcast_int(-2 if error else chosen)
        if chosen == -2:
            raise CheckpointError(
                error or f"checkpoint {path} is invalid (see rank 0)",
                rank=self.rank,
                operation="checkpoint.load",
                fix="run `torsh-dist checkpoint verify` on it, or resume from another checkpoint",
            )
        if chosen < 0:
            return None, skipped
        return (Path(path) if path is not None else self.directory / step_dir_name(chosen)), skipped

    def load(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | Path | None = None,
    ) -> LoadedCheckpoint | None:
        """Restore the newest valid checkpoint (or ``path``) into ``model``/``optimizer``.

        Collective. Model and optimizer may be wrapped and sharded differently from when they
        were saved, and the world size may differ (DCP reshards); per-rank RNG states are then
        left alone (``rng_restored=False``).

        Returns:
            What was loaded, or ``None`` when there is no valid checkpoint (``path`` not given).

        Raises:
            CheckpointError: ``path`` is invalid, or reading it failed.
        """
        self.wait()
        self._cache, self._stager = None, None  # loading may replace optimizer state tensors
        peer_skipped: list[str] = []
        if self._peer is not None and self._ctl_group is not None and path is None:
            # every host first assembles a complete local copy of the newest restorable step
            step, peer_skipped = self._peer.restore(self._ctl_group)
            if step is None:
                return None
            path = self.directory / step_dir_name(step)
        chosen, skipped = self._choose(path)
        skipped = peer_skipped + skipped
        if chosen is None:
            return None
        meta = json.loads((chosen / manifest.META).read_text())
        saved_layout = meta.get("layout") or {}
        if saved_layout != self.layout:
            raise CheckpointError(
                f"checkpoint {chosen} stores tensors in layout {saved_layout or 'plain'}, this "
                f"run uses {self.layout or 'plain'}; loading it would scramble them silently",
                rank=self.rank,
                operation="checkpoint.load",
                fix="resume with the tensor-parallel degree it was saved with (--tp); data, "
                "pipeline degree and world size may differ",
            )
        try:
            state = self._state_dict(model, optimizer)
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(chosen)),
                process_group=self._ctl_group,
                no_dist=self._ctl_group is None,
            )
            if optimizer is None or is_zero1(optimizer):
                set_model_state_dict(model, state["model"])  # ZeRO-1 state was loaded in place
            else:
                hyper = [
                    {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
                ]
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )
                refill_hyperparameters(optimizer, hyper)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - report which checkpoint failed
            raise CheckpointError(
                f"could not load checkpoint {chosen}: {type(exc).__name__}: {exc}",
                rank=self.rank,
                operation="checkpoint.load",
                fix="the model/optimizer must match the ones saved (same shapes and names)",
            ) from exc
        changes = check_settings(
            meta,
            path=chosen,
            config_hash=self.config_hash,
            settings=self.settings,
            expected=self.expected_changes,
        )
        same_world = meta.get("world_size") == self.world_size
        rank_state = rank_tensors = None
        if same_world:
            rank_file = json.loads((chosen / f"rank_{self.rank:05d}.json").read_text())
            restore_rng(rank_file["rng"])
            rank_state = rank_file.get("state")
            tensors_file = chosen / _rank_tensors_file(self.rank)
            if tensors_file.exists():  # verified by the manifest; plain data only, never code
                rank_tensors = torch.load(tensors_file, map_location="cpu", weights_only=True)
        self._last_save_time = time.monotonic()
        return LoadedCheckpoint(
            path=chosen,
            step=int(meta["step"]),
            meta=meta,
            rank_state=rank_state,
            rank_tensors=rank_tensors,
            rng_restored=same_world,
            skipped=skipped,
            changed_settings=changes,
        )

