"""Your own model, data parallel with gradient compression, through the engine.

    torsh-dist run --nproc-per-node 2 examples/ddp_compression.py --max-steps 60

Any ``nn.Module``, loss and map-style dataset of ``(input, target)`` pairs: the engine wraps the
model in DDP, registers the PowerSGD communication hook (rank 4, with error feedback), and runs
the loop: learning-rate schedule, clipping, evaluation, progress bar, summary. The global batch is
split across the ranks, so 1, 2 or 4 ranks see the same samples per step.
"""

from __future__ import annotations

import argparse

from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.testing.models import classification_data, mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--compression", default="powersgd:4")
    args = parser.parse_args()
    config = EngineConfig(max_steps=args.max_steps, batch_size=64, eval_every=20)
    config.optim.lr = 1e-2
    config.compression.method = args.compression
    engine = Engine(
        lambda: mlp(d_in=16, hidden=64, classes=4),
        dataset=classification_data(n=4096),
        val_dataset=classification_data(n=512, seed=1),
        config=config,
    )
    result = engine.fit()
    print(f"final loss {result.final_loss:.4f}, validation {result.val_loss:.4f}, "
          f"compression ratio {result.compression.get('ratio', 1.0):.1f}x")


if __name__ == "__main__":
    main()
