"""Loading a training checkpoint for inference: any layout it was saved in, into a whole model
in one process or into a tensor-parallel model on N ranks.

``torsh-dist train --checkpoint-dir DIR`` writes ``DIR/step_XXXXXXXX/`` directories (see
:mod:`~torsh_distributed.checkpoint.manager`). Each holds model and optimizer state written by
``torch.distributed.checkpoint`` (DCP) under the names of the whole, unwrapped model: DCP's
state-dict API removes DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` and activation
checkpointing's ``_checkpoint_wrapped_module.``; pipeline ranks save their stages under the
unsplit model's names; ZeRO/FSDP2 shards, tensor-parallel shards and expert-parallel experts are
stored as one global tensor per name. So one name and one global shape per tensor, whatever the
run's dp / ZeRO / tp / pp / ep degrees, and DCP reads any of them into any target layout:
:func:`load_model_state` reads into a plain model in one process (no process group needed), or
into a model whose parameters are ``DTensor`` shards, each rank reading only its own shard.

One exception: the built-in GPT's tensor-parallel plan re-orders the rows of every fused ``qkv``
projection so that each rank's contiguous shard holds its own heads
(:func:`~torsh_distributed.models.gpt_tp.permute_qkv`), and a tp > 1 run saves them in that order;
its ``meta.json`` says so (``"layout": {"tp": N}``). Loading converts them: back to the plain
order for a plain model, or to the order of the target's own tensor-parallel degree.

The trainer records what the model is in ``meta.json`` (``extra["model"]``, see
:func:`~torsh_distributed.models.config.gpt_model_info`): :func:`load_gpt` rebuilds the built-in
GPT from it. Checkpoints written before that was recorded load with an explicit ``config=``.

Safety: the checkpoint is verified first (SHA-256 of every file against its manifest); DCP's
metadata is unpickled with an allow-list of plain data classes and tensors go through
``torch.load(weights_only=True)`` (:class:`~torsh_distributed.checkpoint._safe.SafeFileSystemReader`),
so nothing in a checkpoint directory can execute code. Optimizer state is never read.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torsh_distributed.checkpoint import manifest
from torsh_distributed.checkpoint._safe import SafeFileSystemReader
from torsh_distributed.checkpoint.catalog import check_loadable_path, is_step_dir
from torsh_distributed.checkpoint.manager import latest_valid
from torsh_distributed.models.config import (
    GPT_KIND,
    ModelConfig,
    MoESection,
    gpt_config_from_info,
)
from torsh_distributed.models.gpt import GPT
from torsh_distributed.models.gpt_tp import gpt_tp_plan
from torsh_distributed.parallel.tensor import qkv_permutation
from torsh_distributed.parallel.tp_plan import apply_tp_plan
from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["LoadInfo", "find_checkpoint", "read_gpt_config", "load_gpt", "load_model_state"]

_PREFIX = "model."  # the manager saves {"model": ..., "optim": ...}
_QKV = re.compile(r"(?:.+\.)?blocks\.[^.]+\.attn\.qkv\.(?:weight|bias)\Z")


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """What was loaded, from where."""

    path: Path
    """The checkpoint (``.../step_XXXXXXXX``) read."""
    step: int
    """Optimizer steps the run had done when it saved it."""
    world_size: int
    """World size of the run that saved it."""
    layout: dict[str, Any]
    """Its tensor layout (``{"tp": N}``: the GPT's qkv rows in tensor-parallel order; ``{}``)."""
    model: dict[str, Any]
    """What the trainer recorded about the model (``{}`` in checkpoints older than that): for
    the built-in GPT its ``config``, ``moe`` section and ``tokenizer`` (``{"kind": "bytes"}``)."""
    skipped: tuple[str, ...] = ()
    """Newer checkpoints of the directory that were invalid (path, file and reason each)."""
    missing: tuple[str, ...] = ()
    """Names of the model not in the checkpoint, left as they were (``strict=False`` only)."""
    unexpected: tuple[str, ...] = ()
    """Names in the checkpoint the model does not have (``strict=False`` only)."""


@dataclass(frozen=True, slots=True)
class _Found:
    path: Path
    meta: dict[str, Any]
    skipped: tuple[str, ...]

    def model_info(self) -> dict[str, Any]:
        return dict(self.meta.get("extra", {}).get("model") or {})


def _find(path: str | Path) -> _Found:
    root = check_loadable_path(path)
    if is_step_dir(root):
        verdict = manifest.verify(root)
        if not verdict.valid:
            foreign = not (root / manifest.MANIFEST).exists() and (root / ".metadata").exists()
            raise ValueError(
                f"checkpoint {verdict.describe()}; "
                + (
                    "a DCP directory without the manifest torsh-dist's checkpoints carry (not "
                    "written by torsh-dist train?) cannot be verified, so it is not loaded"
                    if foreign
                    else f"load the run's directory ({root.parent}) to take its newest valid "
                    "checkpoint instead"
                )
            )
        assert verdict.meta is not None
        return _Found(path=root, meta=verdict.meta, skipped=())
    best, bad = latest_valid(root)
    skipped = tuple(f"{i.path}: INVALID ({i.file}): {i.reason}" for i in bad)
    if best is None and skipped:
        raise ValueError(
            f"no valid checkpoint in {root}: every one failed verification:\n  "
            + "\n  ".join(skipped)
        )
    if best is None:  # the directory changed since check_loadable_path
        raise FileNotFoundError(f"no checkpoint in {root}: its step_XXXXXXXX directories are gone")
    for line in skipped:
        warnings.warn(f"skipping checkpoint {line}", stacklevel=3)
    assert best.meta is not None
    return _Found(path=best.path, meta=best.meta, skipped=skipped)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: the newest valid ``step_*`` of a run's checkpoint directory
    (newer invalid ones are skipped with a warning), or ``path`` itself when it is one step's
    directory. Every file is re-hashed against the manifest.

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no checkpoint (empty, only
            unfinished saves, not a checkpoint directory).
        ValueError: ``path`` is a file; every checkpoint in it is invalid (each reason listed);
            the step directory given is invalid (partial, truncated, corrupt).
    """
    return _find(path).path


def _gpt_config(
    found: _Found, config: ModelConfig | None, moe: MoESection | None
) -> tuple[ModelConfig, MoESection | None]:
    info = found.model_info()
    kind = info.get("kind")
    if info and kind != GPT_KIND:
        raise ValueError(
            f"checkpoint {found.path} holds a {kind} model ({info.get('factory', '?')}), not the "
            "built-in GPT: build it and use load_model_state(model, path)"
        )
    if config is None:
        if not info:
            raise ValueError(
                f"checkpoint {found.path} does not record the model's configuration (saved by an "
                "older torsh-distributed): pass config=ModelConfig(...) (and moe=MoESection(...) "
                "for an MoE model) with the shape it was trained with (--preset and --model.* "
                "flags of the run)"
            )
        saved, saved_moe = gpt_config_from_info(info)
        return saved, moe if moe is not None else saved_moe
    if info:
        saved, saved_moe = gpt_config_from_info(info)
        if saved != config:
            warnings.warn(
                f"config given differs from the one checkpoint {found.path} records ({saved}); "
                "using the one given",
                stacklevel=3,
            )
        if moe is None:
            moe = saved_moe
    return config, moe


def read_gpt_config(path: str | Path) -> tuple[ModelConfig, MoESection | None]:
    """The built-in GPT's shape and MoE section (``None``: dense) that a checkpoint records,
    e.g. to build the model and shard it yourself before :func:`load_model_state`.

    Raises:
        FileNotFoundError, ValueError: see :func:`find_checkpoint`; the checkpoint holds another
            model, or does not record its configuration.
    """
    return _gpt_config(_find(path), None, None)


def load_gpt(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    config: ModelConfig | None = None,
    moe: MoESection | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[GPT, ModelConfig, LoadInfo]:
    """The built-in GPT of a training checkpoint, in eval mode, ready to generate.

    Args:
        path: A run's ``--checkpoint-dir`` (its newest valid checkpoint is taken) or one
            ``step_XXXXXXXX`` directory. Any dp / ZeRO / tp / pp / ep layout.
        device: Where the model lives.
        dtype: Cast floating-point parameters and buffers after loading (``torch.bfloat16``
            halves memory; logits then differ from the fp32 ones in the last bits); ``None``
            keeps fp32, the precision the trainer's master weights have.
        config: The model's shape. ``None`` = the one the checkpoint records; required for
            checkpoints that do not record it.
        moe: The MoE section; ``None`` = the recorded one (dense when none is recorded).
        tp_mesh: Shard the model over this 1-D mesh with the GPT's tensor-parallel plan (logits
            gathered on every rank, no sequence parallelism) before loading; every rank of the
            mesh calls this with the same arguments, and each reads only its shards. ``None`` =
            the whole model in this process.

    Returns:
        ``(model, config, info)``.

    Raises:
        FileNotFoundError, ValueError: see :func:`find_checkpoint`; the checkpoint holds another
            model or no recorded configuration (pass ``config``); shapes that do not match.
        CheckpointError: reading the checkpoint failed.
    """
    found = _find(path)
    config, moe = _gpt_config(found, config, moe)
    with torch.device(device):
        model = GPT(config, moe=moe)
    if tp_mesh is not None:
        apply_tp_plan(model, tp_mesh, gpt_tp_plan())
    info = _load(model, found, layout=None, strict=True)
    if dtype is not None:
        model.to(dtype=dtype)
    model.eval()
    return model, config, info


def load_model_state(
    model: nn.Module,
    path: str | Path,
    *,
    layout: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> LoadInfo:
    """Load a training checkpoint's model weights into ``model``, in place.

    ``model`` is the one trained (any ``nn.Module`` whose names and shapes match the
    checkpoint's), plain or wrapped, or sharded: a model parallelized by a TP plan (its
    parameters ``DTensor`` shards over a mesh) reads only its shards on each rank, whatever the
    layout the checkpoint was saved in. No collective: ranks may call it independently.

    Args:
        model: The model to fill.
        path: A run's ``--checkpoint-dir`` (its newest valid checkpoint) or one step directory.
        layout: ``model``'s tensor layout, where a TP plan's ``prepare`` step re-ordered rows:
            ``{"tp": N}`` for a model sharded by such a plan over N ranks, ``{}`` for a plain one.
            ``None`` = inferred: for the built-in GPT from its ``qkv`` shards (a GPT whose qkv is
            sharded over N ranks has its rows in the order for N), ``{}`` otherwise. A
            checkpoint saved in another layout is converted for the GPT and refused for other
            models (whose ``prepare`` this function cannot invert).
        strict: Refuse names missing on either side (``False``: load the names both have and
            report the rest in the result).

    Returns:
        What was loaded, from where.

    Raises:
        FileNotFoundError, ValueError: see :func:`find_checkpoint`; names or shapes that do not
            match; a layout that cannot be converted.
        CheckpointError: reading the checkpoint failed.
    """
    return _load(model, _find(path), layout=layout, strict=strict)


def _perm(layout: Mapping[str, Any], rows: int) -> torch.Tensor | None:
    """Row order of a qkv tensor with ``rows`` rows stored in ``layout`` (``None``: plain)."""
    tp = int(layout.get("tp", 1))
    return qkv_permutation(rows // 3, tp) if tp > 1 else None


def _infer_layout(model: nn.Module, state: Mapping[str, Any], gpt: bool) -> dict[str, Any]:
    """The GPT's layout from its qkv weight: rows sharded over a mesh dim named ``tp`` (or
    over an unnamed 1-D mesh in a model without FSDP2, whose row shards are not TP)."""
    if not gpt:
        return {}
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    for name, value in state.items():
        if not (_QKV.match(name) and name.endswith("weight") and isinstance(value, DTensor)):
            continue
        mesh, placements = value.device_mesh, value.placements
        names = mesh.mesh_dim_names or ()
        dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
        if names:
            dims = [i for i in dims if names[i] == "tp"]
        elif mesh.ndim > 1:
            raise ValueError(
                f"cannot tell which dim of {name}'s {mesh.ndim}-D mesh is tensor parallelism (it "
                "has no dim names): name them (mesh_dim_names=(..., 'tp')) or pass layout="
            )
        elif fsdp:
            dims = []  # FSDP2's own 1-D mesh: its row shards are not tensor parallelism
        if dims and mesh.size(dims[0]) > 1:
            return {"tp": mesh.size(dims[0])}
        return {}
    return {}


def _check_names(
    found: _Found, state: Mapping[str, Any], saved: Mapping[str, Any], strict: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    missing = tuple(k for k in state if k not in saved)
    unexpected = tuple(k for k in saved if k not in state)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:8])}")
        raise ValueError(
            f"checkpoint {found.path} does not match the model's names ({'; '.join(parts)}"
            f"{' ...' if max(len(missing), len(unexpected)) > 8 else ''}); build the model the "
            "run trained (same class and shape), or pass strict=False to load the names both have"
        )
    wrong = [
        f"{k} {tuple(saved[k].size)} in the checkpoint, {tuple(v.shape)} in the model"
        for k, v in state.items()
        if k in saved and isinstance(saved[k], TensorStorageMetadata) and torch.is_tensor(v)
        and tuple(saved[k].size) != tuple(v.shape)
    ]
    if wrong:
        raise ValueError(
            f"checkpoint {found.path} has other shapes than the model: {'; '.join(wrong[:5])}; "
            "build the model with the shape the run trained"
        )
    return missing, unexpected


def _load(
    model: nn.Module, found: _Found, *, layout: Mapping[str, Any] | None, strict: bool
) -> LoadInfo:
    info = found.model_info()
    saved_layout = dict(found.meta.get("layout") or {})
    metadata = SafeFileSystemReader(str(found.path)).read_metadata()
    saved = {
        k[len(_PREFIX) :]: v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(_PREFIX)
    }
    state = get_model_state_dict(model)  # names without wrapper prefixes; DTensors stay shards
    missing, unexpected = _check_names(found, state, saved, strict)
    # the layouts only concern the GPT's qkv rows (the engine's TP plans without prepare
    # leave the layout plain); a checkpoint that records no model is taken as a GPT if it has them
    gpt = info.get("kind") == GPT_KIND or (not info and any(_QKV.match(k) for k in saved))
    target = dict(layout) if layout is not None else _infer_layout(model, state, gpt)
    convert: list[str] = []
    if target != saved_layout:
        if not gpt or set(saved_layout) - {"tp"} or set(target) - {"tp"}:
            raise ValueError(
                f"checkpoint {found.path} stores tensors in layout {saved_layout or 'plain'} (a "
                f"TP plan's prepare step re-ordered them), the model is in layout "
                f"{target or 'plain'}; only the built-in GPT's layouts are converted: load it "
                f"into a model sharded by the same plan over the same degree "
                f"(layout={saved_layout})"
            )
        convert = [k for k in state if k in saved and _QKV.match(k)]
    direct = {k: v for k, v in state.items() if k in saved and k not in convert}
    full = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in convert}
    try:
        for part in (direct, full):
            if part:
                dcp.load(
                    {_PREFIX[:-1]: part},
                    storage_reader=SafeFileSystemReader(str(found.path)),
                    no_dist=True,  # each rank reads its own shards: nothing to agree on
                )
    except Exception as exc:  # noqa: BLE001 - name the checkpoint that failed
        raise CheckpointError(
            f"could not read checkpoint {found.path}: {type(exc).__name__}: {exc}",
            operation="checkpoint.load",
        ) from exc
    with torch.no_grad():
        for name, tensor in full.items():
            rows = tensor.shape[0]
            if (order := _perm(saved_layout, rows)) is not None:
                tensor = tensor[order.argsort()]  # the plain order
            if (order := _perm(target, rows)) is not None:
                tensor = tensor[order]
            dest = state[name]
            if isinstance(dest, DTensor):
                shard = distribute_tensor(
                    tensor.to(dest.device), dest.device_mesh, dest.placements, src_data_rank=None
                )  # src_data_rank=None: every rank cuts its own piece, no communication
                dest.to_local().copy_(shard.to_local())
            else:
                dest.copy_(tensor)
    set_model_state_dict(model, state)
    return LoadInfo(
        path=found.path,
        step=int(found.meta["step"]),
        world_size=int(found.meta.get("world_size", 1)),
        layout=saved_layout,
        model=info,
        skipped=found.skipped,
        missing=missing,
        unexpected=unexpected,
    )
