"""Training the user's own model from the command line: factories named ``MODULE:FUNCTION``.

``torsh-dist train --model mypkg.nets:make_net --dataset mypkg.data:train_set`` names a function
returning the ``nn.Module`` and one returning a map-style dataset of ``(input, target)`` pairs
(``--loss`` a function ``(output, target) -> scalar``, cross-entropy by default; ``--tp-plan`` a
function returning a :class:`~torsh_distributed.parallel.tp_plan.TPPlan` or a dict of module
patterns to styles; ``--val-dataset`` a held-out set). ``MODULE`` is an importable module name
(the current directory is on the path) or a ``.py`` file. :meth:`UserFactories.check` imports
and calls them once in the launching process, on the ``meta`` device for the model, so a factory
that cannot be imported, returns the wrong type, or a split point that names no module is
reported before any rank starts.

``hf:`` values name Hugging Face inputs instead (:mod:`torsh_distributed.hf`): ``--model
hf:DIR`` a ``transformers`` causal LM (its FSDP units, TP plan and loss come from the model),
``--dataset hf:FILE`` a local text file tokenized with that model's tokenizer, ``--loss hf`` the
model's own loss function.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torsh_distributed._checks import factory_spec, is_file_module
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.engine.engine import Engine
from torsh_distributed.parallel.parallelize import check_init_coverage
from torsh_distributed.parallel.pipeline import check_split_points
from torsh_distributed.parallel.tp_plan import TPPlan, resolve_tp_plan

if TYPE_CHECKING:
    from torsh_distributed.hf.model import HFCausalLM

__all__ = ["UserFactories", "load_object"]


def load_object(spec: str, *, what: str) -> Any:
    """The object ``MODULE:NAME`` names; ``MODULE`` is a module name or a ``.py`` file.

    Raises:
        ValueError: a malformed spec, a module that cannot be imported, a missing name.
    """
    module_name, attr = factory_spec(spec, what=what)
    try:
        if is_file_module(module_name):
            path = Path(module_name)
            digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
            name = f"_torsh_user_{path.stem}_{digest}"  # two files of one name stay apart
            module = sys.modules.get(name)
            if module is None:
                loader = importlib.util.spec_from_file_location(name, path)
                assert loader is not None and loader.loader is not None
                module = importlib.util.module_from_spec(loader)
                sys.modules[name] = module
                loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's input to report
        raise ValueError(
            f"--{what} {spec}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--{what} {spec}: module {module_name!r} has no {attr!r}") from None


def _callable(spec: str, *, what: str) -> Callable[..., Any]:
    obj = load_object(spec, what=what)
    if not callable(obj):
        raise ValueError(f"--{what} {spec}: {type(obj).__name__} is not callable")
    return obj


def _call(spec: str, *, what: str) -> Any:
    """Call the factory ``spec`` names; its own exceptions become one ``ValueError`` line."""
    factory = _callable(spec, what=what)
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failed: report, don't trace
        raise ValueError(f"--{what} {spec} raised {type(exc).__name__}: {exc}") from exc


@dataclass(kw_only=True, slots=True)
class UserFactories:
    """The ``MODULE:FUNCTION`` names of a user run (see the module docstring)."""

    model: str
    """Function returning the ``nn.Module`` (called on every rank under the run's seed)."""
    dataset: str
    """Function returning the map-style training dataset of ``(input, target)`` pairs."""
    val_dataset: str = ""
    """Function returning the validation dataset; empty = no validation."""
    loss: str = ""
    """Function ``(output, target) -> scalar``; empty = cross-entropy."""
    tp_plan: str = ""
    """Function returning a ``TPPlan`` (or a dict of module patterns to styles) for ``--tp``."""

    def to_args(self) -> list[str]:
        """The command-line flags that reproduce this spec (for the launched ranks)."""
        out = ["--model", self.model, "--dataset", self.dataset]
        for flag, value in (
            ("--val-dataset", self.val_dataset),
            ("--loss", self.loss),
            ("--tp-plan", self.tp_plan),
        ):
            if value:
                out += [flag, value]
        return out

    def _hf(self) -> HFCausalLM | None:
        """The Hugging Face model ``--model hf:PATH`` names (``None`` for a factory)."""
        from torsh_distributed.hf import is_hf

        if not is_hf(self.model):
            return None
        from torsh_distributed.hf.model import load_hf_model

        return load_hf_model(self.model)

    def _hf_dataset(self, spec: str, what: str) -> Any:
        hf = self._hf()
        if hf is None:
            raise ValueError(
                f"--{what} {spec} is tokenized with the model's tokenizer: it needs --model hf:DIR"
            )
        from torsh_distributed.hf.data import load_packed

        max_positions = getattr(hf.config, "max_position_embeddings", None)
        return load_packed(
            spec, hf.tokenizer(), max_positions=max_positions,
            vocab_size=int(hf.config.vocab_size), what=what,
        )

    def _loss(self) -> Callable[[Any, Any], torch.Tensor] | None:
        """The loss: ``--loss hf`` (the model's own), a function, or the default (``None``:
        cross-entropy; for ``--model hf:`` ours on the logits)."""
        hf = self._hf()
        if self.loss == "hf":
            if hf is None:
                raise ValueError("--loss hf is the loss of a Hugging Face model: it needs --model hf:DIR")
            return hf.model_loss()
        if self.loss:
            return _callable(self.loss, what="loss")
        if hf is not None:
            from torsh_distributed.hf.model import lm_loss

            return lm_loss
        return None

    def _dataset(self, spec: str, what: str) -> Any:
        from torsh_distributed.hf import is_hf

        if is_hf(spec):
            return self._hf_dataset(spec, what)
        data = _call(spec, what=what)
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise ValueError(
                f"--{what} {spec} returned {type(data).__name__}, expected a map-style dataset "
                "(with __getitem__ and __len__)"
            )
        if len(data) == 0:
            raise ValueError(f"--{what} {spec} returned an empty dataset")
        item = data[0]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(
                f"--{what} {spec}: items must be (input, target) pairs, item 0 is "
                f"{type(item).__name__}"
            )
        return data

    def plan(self) -> TPPlan | None:
        """The plan ``--tp-plan`` names (its factory called); without it a Hugging Face model's
        own plan, translated; else ``None``."""
        if not self.tp_plan:
            hf = self._hf()
            return hf.tp_plan() if hf is not None else None
        plan = _call(self.tp_plan, what="tp-plan")
        if isinstance(plan, dict):
            plan = TPPlan(rules=plan)
        if not isinstance(plan, TPPlan):
            raise ValueError(
                f"--tp-plan {self.tp_plan} returned {type(plan).__name__}, expected a TPPlan or "
                "a dict of module patterns to styles"
            )
        return plan

    def check(self, config: EngineConfig) -> None:
        """Import and call every factory once (the model on ``meta``); validate what the
        parallel settings need of the model. No process group is needed.

        Raises:
            ValueError: naming the flag and what is wrong.
        """
        hf = self._hf()
        if hf is not None:
            model = hf.meta_model
        else:
            with torch.device("meta"):
                model = _call(self.model, what="model")
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"--model {self.model} returned {type(model).__name__}, expected a torch.nn.Module"
            )
        self._dataset(self.dataset, "dataset")
        if self.val_dataset:
            self._dataset(self.val_dataset, "val-dataset")
        self._loss()
        par = config.parallel
        if hf is not None and par.sequence_parallel and not self.tp_plan:
            raise ValueError(
                "--sequence-parallel: a Hugging Face model's own TP plan is translated without "
                "sequence parallelism; give --tp-plan MODULE:FUNCTION with sequence styles"
            )
        if par.tp > 1:
            plan = self.plan()
            if plan is None:
                raise ValueError(f"--tp {par.tp} needs --tp-plan MODULE:FUNCTION for a user model")
            resolve_tp_plan(model, plan, par.tp)
        elif self.tp_plan:
            raise ValueError("--tp-plan is given but --tp is 1")
        if par.pp > 1:
            check_split_points(model, par.split_points, num_stages=par.pp * par.virtual_stages)
        if par.meta_init:
            check_init_coverage(model)

    def engine(self, config: EngineConfig) -> Engine:
        """The engine for this run (on a rank: the factories are called here)."""
        hf = self._hf()
        dataset = self._dataset(self.dataset, "dataset")
        return Engine(
            hf.build if hf is not None else _callable(self.model, what="model"),
            dataset=dataset,
            val_dataset=self._dataset(self.val_dataset, "val-dataset") if self.val_dataset else None,
            loss_fn=self._loss(),
            config=config,
            tp_plan=self.plan() if config.parallel.tp > 1 else None,
            blocks=hf.blocks() if hf is not None else None,
            tokens_per_sample=int(getattr(dataset, "seq_len", 0) or 0),
            settings={"model": self.model, "dataset": self.dataset, "loss": self.loss},
            model_info=hf.model_info() if hf is not None else {"kind": "factory", "factory": self.model},
        )
