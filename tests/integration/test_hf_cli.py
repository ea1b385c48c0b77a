"""`torsh-dist train --model hf:DIR --dataset hf:FILE.jsonl` on a tiny Llama written by the test
(offline): ZeRO-3 on 2 ranks and TP 2 from the model's own plan train to the losses of one
process; `checkpoint export --format hf` of the 2-rank checkpoint loads in transformers with the
logits of our own loader; `torsh-dist serve` of the export answers the official `openai` client
with transformers' own greedy continuation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from torsh_distributed.hf.model import load_hf_model  # noqa: E402
from torsh_distributed.inference.load import load_model_state  # noqa: E402
from torsh_distributed.testing import find_free_port  # noqa: E402
from torsh_distributed.testing.cli import run_cli, start_cli
from torsh_distributed.testing.hf import write_jsonl, write_tiny_llama  # noqa: E402

QUICK = ["--max-steps", "4", "--batch-size", "8", "--eval-batches", "1", "--progress", "false",
         "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def hf_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("hf_cli")
    model = write_tiny_llama(root / "llama")
    data = f"hf:{write_jsonl(root / 'data.jsonl')},seq_len=16"
    return ["--model", f"hf:{model}", "--dataset", data, "--val-dataset", data]


def _train(out: Path, args: list[str]) -> dict:
    summary = out / "summary.json"
    proc = run_cli(
        ["train", *args, *QUICK, "--checkpoint-dir", str(out / "ckpt"), "--summary-json", str(summary)],
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(summary.read_text())


def _assert_same_losses(run: dict, one: dict) -> None:
    assert run["steps"] == one["steps"] == 4 and run["world_size"] == 2
    for key in ("initial_loss", "final_loss", "val_loss"):
        assert run[key] == pytest.approx(one[key], rel=1e-5), key


@pytest.fixture(scope="module")
def one_process(hf_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory.mktemp("one"), hf_args)


@pytest.fixture(scope="module")
def zero3(hf_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("zero3")
    return _train(out, ["--nproc-per-node", "2", "--zero-stage", "3", *hf_args]), out


def _export(run: Path, shard_size: str = "5GB") -> Path:
    out = run / "hf"
    proc = run_cli(
        ["checkpoint", "export", "--format", "hf", str(run / "ckpt"), str(out),
         "--max-shard-size", shard_size],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "saved by 2 rank(s)" in proc.stdout
    return out


def _assert_transformers_logits_equal_ours(exported: Path, checkpoint: Path, spec: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theirs = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    ours = load_hf_model(spec).build().eval()
    load_model_state(ours, checkpoint)
    ids = AutoTokenizer.from_pretrained(str(exported))(["the rank sends a shard"], return_tensors="pt")
    with torch.no_grad():
        expected = ours(ids["input_ids"]).logits
        got = theirs(ids["input_ids"]).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def exported(zero3: tuple[dict, Path]) -> Path:
    return _export(zero3[1], "40KB")


@pytest.mark.timeout(900)
def test_zero3_on_two_ranks_equals_one_process(zero3: tuple[dict, Path], one_process: dict):
    _assert_same_losses(zero3[0], one_process)


@pytest.mark.timeout(900)
def test_tp2_from_the_model_plan_equals_one_process_and_exports(
    hf_args: list[str], one_process: dict, tmp_path: Path
):
    two = _train(tmp_path, ["--nproc-per-node", "2", "--tp", "2", *hf_args])
    assert two["layout"]["tp"] == 2
    _assert_same_losses(two, one_process)
    _assert_transformers_logits_equal_ours(_export(tmp_path), tmp_path / "ckpt", hf_args[1])


@pytest.mark.timeout(900)
def test_zero3_export_is_sharded_and_loads_in_transformers_with_our_logits(
    hf_args: list[str], zero3: tuple[dict, Path], exported: Path
):
    assert (exported / "model.safetensors.index.json").is_file()  # 82 kB of weights: sharded
    assert len(list(exported.glob("model-*.safetensors"))) >= 2
    assert (exported / "tokenizer.json").is_file()
    _assert_transformers_logits_equal_ours(exported, zero3[1] / "ckpt", hf_args[1])


@pytest.mark.timeout(600)
def test_serve_answers_the_openai_client_as_transformers_generates(exported: Path, tmp_path: Path):
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = find_free_port()
    log = tmp_path / "serve.log"
    proc = start_cli(["serve", "--checkpoint", str(exported), "--port", str(port)], output=log)
    try:
        deadline = time.monotonic() + 240
        while "listening on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY",
                               max_retries=0, timeout=120)
        prompt = "the rank sends a shard of"
        answer = client.completions.create(model="hf", prompt=prompt, max_tokens=8, temperature=0)
        tok = AutoTokenizer.from_pretrained(str(exported))
        model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            reference = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
        assert answer.choices[0].text == tok.decode(reference[0, ids.shape[1]:])
        assert answer.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model="hf", messages=[{"role": "user", "content": "the optimizer"}], max_tokens=4,
            temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log.read_text()


@pytest.mark.timeout(300)
def test_generate_continues_a_prompt_as_transformers_does(exported: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = tmp_path / "gen.json"
    prompt = "the optimizer steps on"
    proc = run_cli(
        ["generate", "--checkpoint", str(exported), "--prompt", prompt,
         "--max-new-tokens", "8", "--temperature", "0", "--output", str(report)],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    tok = AutoTokenizer.from_pretrained(str(exported))
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # greedy; both stop at the tokenizer's end of sequence
        reference = model.generate(ids, max_new_tokens=8, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=0)
    assert got["tokens"] == reference[0, ids.shape[1]:].tolist()
