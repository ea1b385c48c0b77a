"""The built-in trainer: a GPT-style byte-level model on Python's own source, run by the engine.

One call, :func:`train`, runs on every rank. It reads the corpus, and hands the engine the GPT
factory, the corpus's token windows (drawn with replacement, a pure function of the seed and the
step, so every world size sees the same samples), the next-token loss, the GPT's tensor-parallel
plan and its activation-memory formula. Everything else (parallelism, compression, checkpoints,
monitoring, the loop) is the engine's, the same as for any user model.
"""

from __future__ import annotations

import dataclasses

from torsh_distributed.data.corpus import TokenWindows, load_corpus
from torsh_distributed.engine.engine import Engine
from torsh_distributed.engine.result import TrainResult
from torsh_distributed.models.config import gpt_model_info
from torsh_distributed.models.gpt import GPT, lm_loss
from torsh_distributed.models.gpt_tp import check_gpt_tp, gpt_tp_plan
from torsh_distributed.plan.memory import activation_bytes
from torsh_distributed.train.config import TrainConfig

__all__ = ["TrainResult", "train", "gpt_engine"]


def gpt_engine(config: TrainConfig) -> Engine:
    """The engine set up for the built-in GPT and corpus as ``config`` describes.

    Raises:
        ValueError: a shape that does not shard over ``parallel.tp``; a corpus too small.
    """
    model, par = config.model, config.parallel
    if par.tp > 1:
        if config.moe.enabled:
            raise ValueError(
                "moe.num_experts > 0 with parallel.tp > 1 is not built yet (the GPT's TP plan "
                "shards the dense MLP); use --ep for the experts"
            )
        check_gpt_tp(model, tp=par.tp, sequence_parallel=par.sequence_parallel)
    corpus = load_corpus(config.data, min_tokens=model.block_size + 2)
    every = par.checkpoint_every

    def activations(per_rank_batch: int) -> int:
        return activation_bytes(
            n_layer=model.n_layer,
            d_model=model.d_model,
            n_head=model.n_head,
            seq_len=model.block_size,
            batch=per_rank_batch,
            vocab_size=model.vocab_size,
            checkpointed_layers=len(range(0, model.n_layer, every)) if every else 0,
            dtype_bytes=4 if par.param_dtype == "fp32" else 2,
        )

    return Engine(
        lambda: GPT(model, moe=config.moe),
        dataset=TokenWindows(corpus.train, model.block_size),
        val_dataset=TokenWindows(corpus.val, model.block_size),
        config=config,
        loss_fn=lm_loss,
        sampler="replacement",
        tp_plan=(
            gpt_tp_plan(sequence_parallel=par.sequence_parallel, loss_parallel=par.pp == 1)
            if par.tp > 1
            else None
        ),
        blocks="blocks",
        tokens_per_sample=model.block_size,
        activation_bytes=activations,
        settings={
            "model": dataclasses.asdict(model),
            "data": dataclasses.asdict(config.data),
            "moe": dataclasses.asdict(config.moe),
        },
        model_info=gpt_model_info(model, config.moe),
        describe=(
            f" x {model.block_size} tokens, corpus {corpus.train.numel() / 1e6:.2f}M train / "
            f"{corpus.val.numel() / 1e6:.2f}M val bytes from {corpus.num_files} files"
        ),
    )


def train(config: TrainConfig) -> TrainResult:
    """Train the built-in model as ``config`` describes, on this rank (see the module docstring).

    Uses the process group if one is running; otherwise starts one from the environment (a world
    of one when not launched) and shuts it down at the end.

    Raises:
        ValueError: the global batch does not divide across the data-parallel ranks, a setting
            does not fit the world size, or the corpus is too small.
    """
    return gpt_engine(config).fit()
