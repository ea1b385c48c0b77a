"""Does a resumed run continue the uninterrupted one bit for bit, and what does it cost?

The built-in trainer on ``--world`` real ranks (the test harness, one host): ``2 N`` steps
straight, then ``N`` steps resumed from the straight run's step-``N`` checkpoint in fresh
processes; prints the steps whose loss differs, whether the final parameters are equal, and the
seconds of the engine's DDP bucket priming on resume (``engine._setup.prime_ddp``) beside the
mean step. ``--no-prime`` replaces the priming by a no-op: the behaviour before it existed.

    python benchmarks/bench_resume_exact.py --world 3 --backend gloo [--no-prime]
    python benchmarks/bench_resume_exact.py --world 3 --backend auto --d-model 256 --n-layer 6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from torsh_distributed.checkpoint import CheckpointManager, step_dir_name
from torsh_distributed.models.gpt import GPT
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import with_checkpoints
from torsh_distributed.train import TrainConfig, preset, train


def _config(args: argparse.Namespace, directory: Path, **checkpoint: str) -> dict:
    cfg = preset("tiny")
    cfg.max_steps, cfg.batch_size, cfg.progress, cfg.eval_batches = 2 * args.n, 12, False, 1
    cfg.data.max_bytes, cfg.model.block_size = 200_000, 32
    if args.d_model:
        cfg.model.d_model = args.d_model
    if args.n_layer:
        cfg.model.n_layer = args.n_layer
    return with_checkpoints(cfg, directory, every=args.n, **checkpoint).to_dict()


def _run(config: dict, prime: bool) -> dict:
    from torsh_distributed.engine import _setup as S

    spent: list[float] = []
    original = S.prime_ddp

    def timed(*a: object, **k: object) -> bool:
        t = time.perf_counter()
        ran = original(*a, **k) if prime else False
        spent.append(time.perf_counter() - t)
        return ran

    S.prime_ddp = timed
    result = train(TrainConfig.from_dict(config))
    return {
        "losses": result.losses,
        "prime_s": sum(spent),
        "step_s": config["batch_size"] / result.samples_per_s,
        "params": result.num_params,
        "backend": result.backend,
    }


def _weights(config: dict, path: Path) -> dict[str, torch.Tensor]:
    model = GPT(TrainConfig.from_dict(config).model)
    assert CheckpointManager(path.parent).load(model=model, path=path) is not None
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--backend", default="gloo", help="gloo, auto (gloo+shm on one host)")
    parser.add_argument("--n", type=int, default=4, help="checkpoint interval; 2 N steps")
    parser.add_argument("--d-model", type=int, default=0, help="0 = the tiny preset's")
    parser.add_argument("--n-layer", type=int, default=0, help="0 = the tiny preset's")
    parser.add_argument("--no-prime", action="store_true", help="resume without priming")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        a = _config(args, base / "a")
        b = _config(args, base / "b", resume=str(base / "a" / step_dir_name(args.n)))
        kw = {"backend": args.backend, "timeout": 900}
        straight = run_distributed(_run, args.world, args=(a, True), **kw)[0]
        resumed = run_distributed(_run, args.world, args=(b, not args.no_prime), **kw)[0]
        last = step_dir_name(2 * args.n)
        wa, wb = _weights(a, base / "a" / last), _weights(b, base / "b" / last)
    pairs = zip(straight["losses"], resumed["losses"], strict=True)
    differ = [i + 1 for i, (x, y) in enumerate(pairs) if x != y]
    tensors = sum(not torch.equal(wa[k], wb[k]) for k in wa)
    print(
        f"world {args.world}, backend {resumed['backend']}, {resumed['params']} params, "
        f"prime {'off' if args.no_prime else 'on'}: losses differing at steps {differ or 'none'}, "
        f"final tensors differing {tensors} of {len(wa)}; priming on resume "
        f"{resumed['prime_s'] * 1e3:.0f} ms (rank 0), mean step {resumed['step_s'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
