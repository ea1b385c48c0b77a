"""ZeRO-3 (FSDP2) on your own transformer, built on the meta device: no rank holds it whole.

    torsh-dist run --nproc-per-node 2 examples/zero3.py --max-steps 40

``zero_stage=3`` shards parameters, gradients and optimizer state over the data-parallel ranks;
each block of ``model.layers`` (found automatically: the longest list of same-typed modules) is
one FSDP unit, gathered just before it runs. ``meta_init`` builds the model without memory,
shards it, then allocates and initialises only the local shards (``reset_parameters``).
The memory line after step 1 compares measured model states with the ZeRO formulas.
"""

from __future__ import annotations

import argparse

from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.testing.models import TinyLM, token_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args()
    config = EngineConfig(max_steps=args.max_steps, batch_size=32)
    config.parallel.zero_stage = 3
    config.parallel.meta_init = True
    config.parallel.activation_checkpointing = "full"
    result = Engine(
        lambda: TinyLM(n_layer=4, d_model=64),
        dataset=token_data(n=2048),
        val_dataset=token_data(n=256, seed=1),
        config=config,
        tokens_per_sample=16,
    ).fit()
    print(f"final loss {result.final_loss:.4f}; model states per rank "
          f"{result.memory['model_state_bytes_per_rank']['total']} B")


if __name__ == "__main__":
    main()
