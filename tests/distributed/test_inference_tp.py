"""Tensor-parallel decoding gives the tokens of one process.

On 2 ranks, the built-in GPT (fp64, random init under a fixed seed) sharded by
:func:`~torsh_distributed.models.gpt_tp.gpt_tp_plan` (head gathered, and loss-parallel with
vocabulary-sharded logits) generates 64 greedy tokens identical to the unsharded model's; its
cached logits at every position are those of the unsharded model's full forward within 1e-10;
its KV cache holds half the heads; seeded sampling and batched generation match too, and every
rank returns the same results. A user model (TinyLM by its plan) decodes by recomputation under
TP alike. A sequence-parallel plan is refused with a clear error on every rank (no hang).
"""

from __future__ import annotations

import torch

from torsh_distributed.testing import run_distributed

TOL = 1e-10
SHAPE = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 80, "vocab_size": 256}
PROMPT = [ord(c) for c in "def main():\n    "]  # 16 tokens: 16 + 64 new = block_size


def _decode_tp() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torsh_distributed.inference import KVCache, SamplingConfig, generate, generate_batch
    from torsh_distributed.inference.generate import find_tp_group
    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.models.gpt_tp import gpt_tp_plan
    from torsh_distributed.parallel.tp_plan import apply_tp_plan
    from torsh_distributed.testing.models import TinyLM, tiny_lm_plan

    torch.set_num_threads(1)  # two ranks on a small machine: intra-op threads only contend
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = ModelConfig(**SHAPE)
    torch.manual_seed(0)
    ref = GPT(cfg).double()
    greedy = SamplingConfig(temperature=0, max_new_tokens=64)
    sampled = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, seed=11, max_new_tokens=32)
    prompts = [PROMPT, PROMPT[:5], PROMPT[:11]]
    short = SamplingConfig(temperature=0, max_new_tokens=20)
    out: dict = {
        "ref_greedy": generate(ref, PROMPT, greedy).tokens,
        "ref_sampled": generate(ref, PROMPT, sampled).tokens,
        "ref_batch": [generate(ref, p, short).tokens for p in prompts],
    }
    for name, loss_parallel in (("gathered", False), ("loss_parallel", True)):
        torch.manual_seed(0)
        model = apply_tp_plan(GPT(cfg).double(), mesh, gpt_tp_plan(loss_parallel=loss_parallel))
        result = generate(model, PROMPT, greedy)
        # the logits of the cached TP forward at every position against the unsharded forward
        seq = torch.tensor([PROMPT + result.tokens[:-1]])  # 79 tokens: all the model saw
        cache = KVCache(batch_size=1, max_len=seq.shape[1])
        with torch.no_grad():
            pieces = [model.forward_cached(seq[:, :16], cache)]
            pieces += [
                model.forward_cached(seq[:, i : i + 1], cache) for i in range(16, seq.shape[1])
            ]
            pieces = [p.full_tensor() if isinstance(p, DTensor) else p for p in pieces]
            error = float((torch.cat(pieces, dim=1) - ref(seq)).abs().max())
        out[name] = {
            "greedy": result.tokens,
            "stop": result.stop_reason,
            "logit_error": error,
            "cache_heads": cache.layer(0).keys.shape[1],
            "group_size": dist.get_world_size(find_tp_group(model)),
            "sampled": generate(model, PROMPT, sampled).tokens,
            "batch": [r.tokens for r in generate_batch(model, prompts, short)],
        }
    torch.manual_seed(0)
    tiny_ref = TinyLM(vocab=64, seq=32).double()
    torch.manual_seed(0)
    tiny = apply_tp_plan(TinyLM(vocab=64, seq=32).double(), mesh, tiny_lm_plan())
    tiny_prompts = [[1, 2, 3, 4, 5], [9, 8]]
    tiny_cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    out["tiny"] = (
        [r.tokens for r in generate_batch(tiny_ref, tiny_prompts, tiny_cfg)],
        [r.tokens for r in generate_batch(tiny, tiny_prompts, tiny_cfg)],
    )
    torch.manual_seed(0)
    sp = apply_tp_plan(GPT(cfg).double(), mesh, gpt_tp_plan(sequence_parallel=True))
    try:
        generate(sp, PROMPT, greedy)
        out["sp_error"] = ""
    except ValueError as exc:
        out["sp_error"] = str(exc)
    return out


def test_tp2_decodes_like_one_process() -> None:
    results = run_distributed(_decode_tp, 2, timeout=180)
    for rank, r in enumerate(results):
        assert len(r["ref_greedy"]) == 64
        for name in ("gathered", "loss_parallel"):
            tp = r[name]
            where = f"rank {rank}, {name}"
            assert tp["greedy"] == r["ref_greedy"], where
            assert tp["stop"] == "max_tokens", where
            assert tp["logit_error"] < TOL, f"{where}: {tp['logit_error']}"
            assert tp["cache_heads"] == SHAPE["n_head"] // 2, where  # the cache is sharded too
            assert tp["group_size"] == 2, where  # the ranks agree over the model's tp mesh
            assert tp["sampled"] == r["ref_sampled"], where
            assert tp["batch"] == r["ref_batch"], where
        assert r["tiny"][0] == r["tiny"][1], f"rank {rank}: TinyLM under TP"
        assert "does not support sequence parallelism" in r["sp_error"]
    # every rank returns the same tokens
    for name in ("gathered", "loss_parallel"):
        for key in ("greedy", "sampled", "batch"):
            assert results[0][name][key] == results[1][name][key], f"ranks disagree: {name} {key}"
