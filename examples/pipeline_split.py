"""Pipeline parallelism of your own model, split at module names.

    torsh-dist run --nproc-per-node 2 examples/pipeline_split.py --max-steps 40
    torsh-dist run --nproc-per-node 4 examples/pipeline_split.py --split layers.1   # dp 2 x pp 2

``pp_split="layers.2"`` starts the second stage at ``layers.2``: stage 0 keeps what comes before
the blocks (the embeddings) and ``layers.0-1``, stage 1 ``layers.2-3`` and what comes after (final
norm, output). The model's forward skips the modules a stage does not hold (``TinyLM``'s does:
``if self.embed is not None``). Each stage keeps the unsplit model's parameter names, so a
checkpoint is the whole model, loadable at another pipeline degree. The 1F1B schedule runs 4
micro-batches per step.
"""

from __future__ import annotations

import argparse

from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.testing.models import TinyLM, token_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--split", default="layers.2")
    args = parser.parse_args()
    config = EngineConfig(max_steps=args.max_steps, batch_size=32)
    config.parallel.pp = 2
    config.parallel.pp_split = args.split
    config.parallel.microbatches = 4
    result = Engine(
        TinyLM, dataset=token_data(n=2048), val_dataset=token_data(n=256, seed=1), config=config
    ).fit()
    print(f"final loss {result.final_loss:.4f}, layout {result.layout}")


if __name__ == "__main__":
    main()
