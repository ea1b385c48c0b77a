"""What a federated run trains: the model, one client's share of the data, the loss, and the
server's evaluation of the global model.

Everything here is a pure function of the :class:`~torsh_distributed.federated.config.FederatedConfig`
and a client's partition id, so that a client process (on any host) rebuilds exactly its share
from the JSON the server sends: the built-in byte-level GPT on the standard library's source split
by package, or the user's ``--model``/``--dataset``/``--loss`` factories split by ``partition``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset

from torsh_distributed.federated.config import FederatedConfig, TaskConfig

__all__ = ["ClientData", "Task", "evaluate"]

_EVAL_BATCHES = 8
_EVAL_BATCH = 32


@dataclass(frozen=True, slots=True)
class ClientData:
    """One client's training set and what it is (for the logs and the summary)."""

    dataset: Any
    """Map-style dataset of ``(input, target)`` pairs."""
    describe: str
    """E.g. ``3 packages (json, email, ...)`` or ``412 samples, labels {0: 40, ...}``."""


class Task:
    """Builds the run's model, data and loss from its config (on the server and on each client)."""

    def __init__(self, config: FederatedConfig) -> None:
        self.config = config
        self.task: TaskConfig = config.task
        self._factories: Any = None
        if not self.task.builtin:
            from torsh_distributed.engine.user import UserFactories

            self._factories = UserFactories(
                model=self.task.model,
                dataset=self.task.dataset,
                val_dataset=self.task.val_dataset,
                loss=self.task.loss,
            )

    # --- the model -------------------------------------------------------------------------

    def model(self) -> nn.Module:
        """A fresh model, seeded by ``config.seed`` (the server's initial global model)."""
        torch.manual_seed(self.config.seed)
        if self.task.builtin:
            from torsh_distributed.models.config import ModelConfig
            from torsh_distributed.models.gpt import GPT

            return GPT(ModelConfig(block_size=self.task.block_size))
        from torsh_distributed.engine.user import _callable

        model = _callable(self.task.model, what="model")()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {self.task.model} returned {type(model).__name__}, not an nn.Module")
        return model

    def loss(self) -> Callable[[Any, Any], torch.Tensor]:
        if self.task.builtin:
            from torsh_distributed.models.gpt import lm_loss

            return lm_loss
        if self.task.loss:
            from torsh_distributed.engine.user import _callable

            return _callable(self.task.loss, what="loss")
        from torsh_distributed.engine.engine import default_loss

        return default_loss

    @property
    def sampler(self) -> str:
        """The engine's sampler: windows of the corpus are drawn, user data is shuffled."""
        return "replacement" if self.task.builtin else "epoch"

    @property
    def tokens_per_sample(self) -> int:
        return self.task.block_size if self.task.builtin else 0

    # --- the data --------------------------------------------------------------------------

    def client_data(self, partition_id: int) -> ClientData:
        """Client ``partition_id``'s share of the training data.

        Raises:
            ValueError: ``partition_id`` out of range, or a share too small for one batch.
        """
        cfg = self.config
        if not 0 <= partition_id < cfg.clients:
            raise ValueError(f"partition id {partition_id} is not in [0, {cfg.clients})")
        if self.task.builtin:
            return self._corpus_share(partition_id)
        from torsh_distributed.federated.partition import partition_indices

        data = self._factories._dataset(self.task.dataset, "dataset")
        parts = partition_indices(
            cfg.partition, data, num_clients=cfg.clients, seed=cfg.seed, alpha=cfg.alpha,
            min_size=cfg.client.batch_size,  # every client can fill one batch (or a clear error)
        )
        small = [(i, len(p)) for i, p in enumerate(parts) if len(p) < cfg.client.batch_size]
        if small:
            who, size = small[0]
            raise ValueError(
                f"the {cfg.partition} split gives client {who} {size} samples, fewer than one batch "
                f"(client.batch_size {cfg.client.batch_size}; {len(small)} such clients): use fewer "
                "clients, a smaller batch or another split"
            )
        mine = parts[partition_id]
        return ClientData(dataset=Subset(data, mine), describe=f"{len(mine)} samples")

    def _corpus_share(self, partition_id: int) -> ClientData:
        from torsh_distributed.data.corpus import TokenWindows

        cfg = self.config
        if cfg.partition == "package":
            from torsh_distributed.federated.partition import corpus_by_package

            split = corpus_by_package(cfg.clients, seed=cfg.seed, max_bytes=self.task.max_bytes)
            tokens = split.tokens[partition_id]
            packages = split.packages[partition_id]
            shown = ", ".join(packages[:4]) + (", ..." if len(packages) > 4 else "")
            describe = f"{tokens.numel():,} bytes of {len(packages)} packages ({shown})"
        else:  # iid: an equal contiguous cut of the corpus's training stream
            from torsh_distributed.data.config import DataConfig
            from torsh_distributed.data.corpus import load_corpus

            corpus = load_corpus(DataConfig(max_bytes=self.task.max_bytes * cfg.clients))
            per = corpus.train.numel() // cfg.clients
            tokens = corpus.train[partition_id * per : (partition_id + 1) * per]
            describe = f"{tokens.numel():,} bytes (iid cut {partition_id} of {cfg.clients})"
        return ClientData(dataset=TokenWindows(tokens, self.task.block_size), describe=describe)

    def val_dataset(self) -> Any:
        """The server's held-out set (the corpus's validation files; the user's ``--val-dataset``),
        or ``None``."""
        if self.task.builtin:
            from torsh_distributed.data.config import DataConfig
            from torsh_distributed.data.corpus import TokenWindows, load_corpus

            corpus = load_corpus(DataConfig(), min_tokens=self.task.block_size + 2)
            return TokenWindows(corpus.val, self.task.block_size)
        if self.task.val_dataset:
            return self._factories._dataset(self.task.val_dataset, "val-dataset")
        return None

    def local_steps(self, num_samples: int) -> int:
        """Optimizer steps of one round for a client holding ``num_samples`` samples."""
        client = self.config.client
        if client.local_epochs:
            return max(1, math.ceil(client.local_epochs * num_samples / client.batch_size))
        return client.local_steps


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    seed: int,
    batches: int = _EVAL_BATCHES,
    batch_size: int = _EVAL_BATCH,
) -> dict[str, float]:
    """Mean loss (and accuracy, for class scores against class labels) of ``model`` on a fixed
    sample of ``dataset``: the same ``batches * batch_size`` items every round."""
    from torch.utils.data import default_collate

    model.eval()
    gen = torch.Generator().manual_seed(seed)
    count = min(len(dataset), batches * batch_size)
    order = torch.randperm(len(dataset), generator=gen)[:count].tolist()
    total, correct, seen, weight = 0.0, 0, 0, 0
    for start in range(0, count, batch_size):
        idx = order[start : start + batch_size]
        getitems = getattr(dataset, "__getitems__", None)
        items = getitems(idx) if getitems is not None else [dataset[i] for i in idx]
        inputs, targets = default_collate(items)
        output = model(inputs)
        total += float(loss_fn(output, targets)) * len(idx)
        weight += len(idx)
        if isinstance(output, torch.Tensor) and output.dim() == 2 and targets.dim() == 1:
            correct += int((output.argmax(dim=1) == targets).sum())
            seen += len(idx)
    model.train()
    out = {"loss": total / max(weight, 1)}
    if seen:
        out["accuracy"] = correct / seen
    return out
