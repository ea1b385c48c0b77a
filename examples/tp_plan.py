"""Tensor parallelism of your own transformer by a plan of module patterns.

    torsh-dist run --nproc-per-node 2 examples/tp_plan.py --max-steps 40

The plan names modules by pattern (``*`` = one path segment) and says how each is sharded over
the ``tp`` ranks: Megatron's layout, query/key/value and the first MLP layer column-wise (each rank
computes its own heads and its slice of the hidden layer), the attention output and the second
MLP layer row-wise (one all-reduce each). The plan is checked against the model before any
communication: a pattern that matches nothing or a width not divisible by ``tp`` is an error.
The attention reshapes by ``-1`` heads, so each rank works with ``n_head / tp`` of them.
"""

from __future__ import annotations

import argparse

from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.parallel import TPPlan
from torsh_distributed.testing.models import TinyLM, token_data

PLAN = TPPlan(
    rules={
        "layers.*.attn.q": "colwise",
        "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    }
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    config = EngineConfig(max_steps=args.max_steps, batch_size=32)
    config.parallel.tp = args.tp
    result = Engine(
        TinyLM, dataset=token_data(n=2048), val_dataset=token_data(n=256, seed=1),
        config=config, tp_plan=PLAN,
    ).fit()
    print(f"final loss {result.final_loss:.4f} with tp={args.tp}")


if __name__ == "__main__":
    main()
