"""Small user models and datasets for tests and examples: NOT the built-in GPT, other module names.

* :func:`mlp` — an ``nn.Sequential`` classifier (pipeline-splittable by entry names ``"2"``...);
* :func:`cnn` — a small convolutional classifier (no repeated blocks: FSDP shards it whole);
* :class:`TinyLM` — a pre-norm transformer language model whose blocks live in ``layers`` and
  whose attention projections are separate ``q``/``k``/``v``/``o`` linears, written to the
  pipeline contract (its forward skips modules a stage does not hold) and to the tensor-parallel
  one (it reshapes by ``-1`` heads, so a rank with ``n_head / tp`` heads works);
* :class:`PlainNet` and :class:`GatedNet` — classifiers whose forward is written the ordinary way
  (``return self.out(self.layers(...))``: it does NOT skip modules a pipeline stage lacks); a
  pipeline split traces ``PlainNet`` and refuses ``GatedNet`` (data-dependent control flow);
* :class:`SkewedMoENet` — a classifier around one :class:`~torsh_distributed.parallel.moe.MoE`
  layer whose selection bias sends every token to the first half of the experts;
* deterministic synthetic datasets of ``(input, target)`` pairs.

Everything is a pure function of its arguments and the global seed, so every rank builds the
same model and data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from torsh_distributed.parallel.moe import MoE, MoEConfig
from torsh_distributed.parallel.tp_plan import TPPlan

__all__ = [
    "GatedNet",
    "PlainNet",
    "SkewedMoENet",
    "TinyLM",
    "PairDataset",
    "mlp",
    "cnn",
    "tiny_lm",
    "classification_data",
    "image_data",
    "token_data",
    "tiny_lm_plan",
    "plain_net",
    "gated_net",
]


class PairDataset(Dataset):
    """``(inputs[i], targets[i])`` pairs of two tensors with the same first dimension."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


def mlp(d_in: int = 16, hidden: int = 32, classes: int = 4) -> nn.Sequential:
    """Linear -> ReLU -> Linear -> ReLU -> Linear."""
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def cnn(classes: int = 4) -> nn.Module:
    """Two 3x3 convolutions and a linear head on 1 x 8 x 8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, classes),
    )


def classification_data(n: int = 256, d_in: int = 16, classes: int = 4, seed: int = 0) -> PairDataset:
    """Gaussian inputs labelled by a fixed random linear map (learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, classes, generator=g)
    return PairDataset(x, (x @ w).argmax(dim=1))


def image_data(n: int = 128, classes: int = 4, seed: int = 0) -> PairDataset:
    """1 x 8 x 8 noise images; the label is the brightest quadrant."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    quadrants = x.reshape(n, 1, 2, 4, 2, 4).sum(dim=(1, 3, 5)).reshape(n, 4)
    return PairDataset(x, quadrants.argmax(dim=1) % classes)


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            proj(x).reshape(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """Token embedding, ``layers`` of pre-norm blocks, final norm, output projection.

    Pipeline contract: a stage lacks some of ``embed``/``pos``/``norm``/``out`` (set to ``None``)
    and holds a slice of ``layers``; the forward skips what is missing and passes hidden states.
    """

    def __init__(
        self, vocab: int = 64, d_model: int = 32, n_head: int = 4, n_layer: int = 4, seq: int = 16
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.layers = nn.ModuleList(_Layer(d_model, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) matrices, zero biases, unit norms; deeper output scales down."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * len(self.layers)) if name.endswith(("o.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + (self.pos(positions) if self.pos is not None else 0)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.out(x) if self.out is not None else x


def tiny_lm(n_layer: int = 4) -> TinyLM:
    """A 4-layer, 32-wide :class:`TinyLM` over a 64-token vocabulary, context 16."""
    return TinyLM(n_layer=n_layer)


def token_data(n: int = 256, vocab: int = 64, seq: int = 16, seed: int = 0) -> PairDataset:
    """Next-token pairs from a noisy repeating sequence (learnable)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (starts + steps * torch.arange(seq + 1)) % vocab
    return PairDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def tiny_lm_plan() -> TPPlan:
    """Megatron's layout for :class:`TinyLM`: q/k/v and fc1 column-wise, o and fc2 row-wise."""
    return TPPlan(
        rules={
            "layers.*.attn.q": "colwise",
            "layers.*.attn.k": "colwise",
            "layers.*.attn.v": "colwise",
            "layers.*.attn.o": "rowwise",
            "layers.*.fc1": "colwise",
            "layers.*.fc2": "rowwise",
        }
    )


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class PlainNet(nn.Module):
    """``stem -> relu -> layers (residual blocks) -> + stem's output -> out``, with an ordinary
    forward that calls every module (no ``None`` checks) and a skip connection around ``layers``
    (a pipeline stage ending inside ``layers`` must also pass the stem's output on)."""

    def __init__(self, d_in: int = 16, width: int = 32, classes: int = 4, n_layer: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.layers = nn.Sequential(*(_Residual(width) for _ in range(n_layer)))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.out(self.layers(h) + h)


class GatedNet(PlainNet):
    """:class:`PlainNet` whose forward branches in Python on a tensor's value (``torch.export``
    cannot trace it) and does not skip ``None`` modules: a pipeline split must refuse it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = self.layers(h) if float(h.mean()) > 1.0 else self.layers(2 * h)
        return self.out(h)


def plain_net() -> PlainNet:
    return PlainNet()


def gated_net() -> GatedNet:
    return GatedNet()


class SkewedMoENet(nn.Module):
    """``Linear(d_in, d_model) -> relu -> MoE -> Linear(d_model, classes)`` with a deliberately
    skewed router: the selection bias (+1 for the first half of the experts, -1 for the rest;
    router scores lie in (0, 1)) sends every token to experts ``0 .. E/2 - 1``, which expert
    parallelism places on the first ranks. For testing and measuring load rebalancing."""

    def __init__(
        self,
        d_in: int = 16,
        d_model: int = 16,
        d_hidden: int = 32,
        classes: int = 4,
        num_experts: int = 4,
        top_k: int = 1,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.moe = MoE(
            MoEConfig(num_experts=num_experts, d_model=d_model, d_hidden=d_hidden, top_k=top_k)
        )
        self.out = nn.Linear(d_model, classes)
        half = num_experts // 2
        with torch.no_grad():
            self.moe.expert_bias.copy_(
                torch.tensor([1.0] * half + [-1.0] * (num_experts - half))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.relu(self.inp(x))))
