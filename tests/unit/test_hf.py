"""The Hugging Face glue in one process: the model's TP plan translated (and refused where it
cannot be), FSDP units from ``_no_split_modules``, the packed data set, both losses, and the
refusals of ``hf:`` inputs that do not fit together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from torsh_distributed.engine.config import EngineConfig  # noqa: E402
from torsh_distributed.engine.user import UserFactories  # noqa: E402
from torsh_distributed.hf.data import PackedTokens, load_packed, parse_dataset_spec  # noqa: E402
from torsh_distributed.hf.model import (  # noqa: E402
    lm_loss,
    load_hf_model,
    no_split_blocks,
    translate_tp_plan,
)
from torsh_distributed.parallel.tp_plan import resolve_tp_plan  # noqa: E402
from torsh_distributed.testing.hf import write_jsonl, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    write_jsonl(root / "data.jsonl")
    return write_tiny_llama(root / "llama")


def test_the_model_plan_is_translated_style_by_style(tiny: Path):
    hf = load_hf_model(f"hf:{tiny}")
    plan = hf.tp_plan()
    assert plan.rules["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.rules["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan.rules["model.embed_tokens"] == "embedding"
    assert plan.rules["lm_head"] == "colwise_replicate"
    resolved = resolve_tp_plan(hf.meta_model, plan, 2)
    assert len(resolved) == 2 + 2 * 7  # embedding, head, 7 projections per layer


def test_untranslated_styles_and_shapes_are_refused_with_the_reason(tiny: Path):
    model = load_hf_model(f"hf:{tiny}").meta_model
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.gate_proj': 'packed_colwise' \(a fused"):
        translate_tp_plan(model, {"model.layers.*.mlp.gate_proj": "packed_colwise"})
    with pytest.raises(ValueError, match="'future_style' \\(a style transformers added"):
        translate_tp_plan(model, {"lm_head": "future_style"})
    with pytest.raises(ValueError, match="ships no tensor-parallel plan"):
        translate_tp_plan(model, {})
    plan = translate_tp_plan(model)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        resolve_tp_plan(model, plan, 4)
    model.config.tie_word_embeddings = True
    try:
        with pytest.raises(ValueError, match="ties its input and output embeddings"):
            resolve_tp_plan(model, translate_tp_plan(model), 2)
    finally:
        model.config.tie_word_embeddings = False


def test_fsdp_units_come_from_no_split_modules(tiny: Path):
    model = load_hf_model(f"hf:{tiny}").meta_model
    assert no_split_blocks(model) == "model.layers"
    model._no_split_modules = ["LlamaRMSNorm"]  # no container holds only these
    try:
        assert no_split_blocks(model) is None
    finally:
        del model._no_split_modules


def test_packed_windows_are_consecutive_next_token_pairs(tiny: Path):
    hf = load_hf_model(f"hf:{tiny}")
    spec = f"hf:{tiny.parent / 'data.jsonl'},seq_len=16"
    too_long = f"hf:{tiny.parent / 'data.jsonl'},seq_len=65"  # not spec.replace: the path may hold "16"
    data = load_packed(spec, hf.tokenizer(), max_positions=64, vocab_size=32)
    assert isinstance(data, PackedTokens) and data.seq_len == 16
    x0, y0 = data[0]
    x1, _ = data[1]
    assert torch.equal(x0[1:], y0[:-1]) and int(y0[-1]) == int(x1[0])
    assert len(data) == (data.tokens.numel() - 1) // 16
    assert (data.tokens == hf.tokenizer().eos_token_id).sum() == 64  # one per document
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 64"):
        load_packed(too_long, hf.tokenizer(), max_positions=64, vocab_size=32)
    with pytest.raises(ValueError, match="beyond the model's vocab_size 8"):
        load_packed(spec, hf.tokenizer(), max_positions=64, vocab_size=8)
    with pytest.raises(ValueError, match="has no column 'body'"):
        load_packed(spec + ",field=body", hf.tokenizer(), max_positions=64, vocab_size=32)


def test_a_text_file_packs_like_the_same_lines_in_jsonl(tiny: Path, tmp_path: Path):
    hf = load_hf_model(f"hf:{tiny}")
    lines = [json.loads(t)["text"] for t in (tiny.parent / "data.jsonl").read_text().splitlines()]
    (tmp_path / "data.txt").write_text("\n".join(lines) + "\n")
    from_jsonl = load_packed(f"hf:{tiny.parent / 'data.jsonl'},seq_len=16", hf.tokenizer(),
                             max_positions=64, vocab_size=32)
    from_text = load_packed(f"hf:{tmp_path / 'data.txt'},seq_len=16", hf.tokenizer(),
                            max_positions=64, vocab_size=32)
    assert torch.equal(from_text.tokens, from_jsonl.tokens)


@pytest.mark.parametrize(
    ("suffix", "message"),
    [(",seq_len=0", "seq_len must be a positive integer"), (",stride=2", "unknown option 'stride=2'")],
)
def test_dataset_spec_errors(tiny: Path, suffix: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_dataset_spec(f"hf:{tiny.parent / 'data.jsonl'}{suffix}")


def test_dataset_spec_needs_a_known_file(tmp_path: Path):
    with pytest.raises(ValueError, match="no such file"):
        parse_dataset_spec(f"hf:{tmp_path / 'missing.jsonl'}")
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ValueError, match=".xml is not a data file this reads"):
        parse_dataset_spec(f"hf:{tmp_path / 'data.xml'}")


def test_our_loss_equals_the_model_loss(tiny: Path):
    hf = load_hf_model(f"hf:{tiny}")
    torch.manual_seed(0)
    model = hf.build()
    x = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        out = model(x[:, :-1])
        full = model(x, labels=x).loss
    ours, theirs = lm_loss(out, x[:, 1:]), hf.model_loss()(out, x[:, 1:])
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert float(ours) == pytest.approx(float(full), rel=1e-5)  # HF shifts the labels itself


def test_hf_inputs_that_do_not_fit_together_are_refused(tiny: Path, tmp_path: Path):
    data = f"hf:{tiny.parent / 'data.jsonl'},seq_len=16"
    config = EngineConfig(max_steps=1, batch_size=4)
    with pytest.raises(ValueError, match="needs --model hf:DIR"):
        UserFactories(model="torsh_distributed.testing.models:tiny_lm", dataset=data).check(config)
    with pytest.raises(ValueError, match="--loss hf is the loss of a Hugging Face model"):
        UserFactories(model="torsh_distributed.testing.models:tiny_lm",
                      dataset="torsh_distributed.testing.models:token_data", loss="hf").check(config)
    with pytest.raises(ValueError, match="not a save_pretrained directory"):
        UserFactories(model=f"hf:{tmp_path}", dataset=data).check(config)
    UserFactories(model=f"hf:{tiny / 'config.json'}", dataset=data, loss="hf").check(config)
    config.parallel.tp, config.parallel.sequence_parallel = 2, True
    with pytest.raises(ValueError, match="translated without sequence parallelism"):
        UserFactories(model=f"hf:{tiny}", dataset=data).check(config)


def test_cached_decoding_of_a_transformers_model_equals_its_forward(tiny: Path):
    from torsh_distributed.hf.generate import HFCausalLMAdapter
    from torsh_distributed.inference.cache import KVCache
    from torsh_distributed.inference.config import SamplingConfig
    from torsh_distributed.inference.generate import generate_batch

    torch.manual_seed(0)
    adapter = HFCausalLMAdapter(load_hf_model(f"hf:{tiny}").build()).eval()
    x = torch.tensor([[3, 4, 5, 6, 7, 8]])
    cache = KVCache(batch_size=1, max_len=16)
    with torch.no_grad():
        full = adapter(x)
        parts = [adapter.forward_cached(x[:, :3], cache)]  # prefill, then one token at a time
        parts += [adapter.forward_cached(x[:, i : i + 1], cache) for i in range(3, 6)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    prompts = [[3, 4, 5, 6], [9, 10]]  # left-padded together
    config = SamplingConfig(max_new_tokens=6)
    cached = generate_batch(adapter, prompts, [config] * 2, cache=True)
    plain = generate_batch(adapter, prompts, [config] * 2, cache=False)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]
