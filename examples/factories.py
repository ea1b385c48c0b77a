"""Model, dataset and loss factories for ``torsh-dist train --model ... --dataset ...``.

    torsh-dist train --nproc-per-node 2 --model examples/factories.py:make_model \
        --dataset examples/factories.py:make_dataset --val-dataset examples/factories.py:make_val \
        --max-steps 50 --batch-size 32 --lr 3e-3

Each factory is a plain function: the model one returns an ``nn.Module`` (called on every rank
under the run's seed, so all ranks start identical), the dataset ones a map-style dataset of
``(input, target)`` pairs. Replace them with your own.
"""

from __future__ import annotations

import torch
from torch import nn

from torsh_distributed.testing.models import TinyLM, tiny_lm_plan, token_data


def make_model() -> nn.Module:
    """A 4-layer transformer language model whose blocks live in ``layers``."""
    return TinyLM(n_layer=4)


def make_dataset() -> torch.utils.data.Dataset:
    """Next-token pairs of a noisy repeating sequence."""
    return token_data(n=2048)


def make_val() -> torch.utils.data.Dataset:
    return token_data(n=256, seed=1)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (what ``--loss`` defaults to, written out)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def plan():  # noqa: ANN201 - a TPPlan
    """The tensor-parallel plan for ``--tp 2 --tp-plan examples/factories.py:plan``."""
    return tiny_lm_plan()
