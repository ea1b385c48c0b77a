"""`torsh-dist generate` and `torsh-dist infer` on a checkpoint that `torsh-dist train` wrote at
tp 2, through the real launcher.

generate: the JSON output holds the completion, its tokens and timings, and greedy tokens equal
the library's :func:`generate` on the model :func:`load_gpt` returns; ``--tp 2`` decodes the
tokens of ``--tp 1`` (fp64). infer: 2 ranks (batches of 3) write exactly the file of 1 rank
(batches of 4), in input order, each prompt's tokens those of the library with its derived
seed; a run whose rank 1 is SIGKILLed after its first batch leaves no output, and the rerun
(on 1 rank) computes only the prompts without a result and writes the uninterrupted run's file;
``--nproc-per-node 4 --tp 2`` (2 replicas of a model sharded over 2 ranks) writes the file of 1
rank too. Bad input is refused before any rank starts, naming the line, and so are ``--tp``
layouts that cannot work.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.cli.main import main
from torsh_distributed.testing.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TRAIN = [
    "train",
    "--nproc-per-node",
    "2",
    "--tp",
    "2",
    "--preset",
    "tiny",
    "--data.max-bytes",
    "200000",
    "--max-steps",
    "6",
    "--batch-size",
    "8",
    "--eval-batches",
    "1",
    "--progress",
    "false",
]
PROMPTS = [
    "def main():\n",
    "import os\n",
    "class A:\n",
    "    return ",
    "for i in range(",
    "# a comment\n",
    "x = ",
    "if __name__",
    "print(",
    "while True:\n",
    "try:\n",
]
SAMPLING = [
    "--max-new-tokens",
    "12",
    "--temperature",
    "0.9",
    "--top-k",
    "50",
    "--seed",
    "3",
    "--dtype",
    "float64",
]


def _cli(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=timeout, env={**os.environ, **(env or {})})  # a warm process


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inference-cli")
    _ok(_cli([*TRAIN, "--checkpoint-dir", str(root / "ckpt")]))
    return root / "ckpt"


@pytest.fixture(scope="module")
def prompts(ckpt: Path) -> Path:
    path = ckpt.parent / "prompts.jsonl"
    lines = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    lines[2].update(temperature=0, max_new_tokens=20)  # greedy, longer
    lines[5].update(seed=123, stop=["\n"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _infer(ckpt: Path, prompts: Path, out: Path, *extra: str, **kw: Any):
    return _cli(
        [
            "infer",
            "--checkpoint",
            str(ckpt),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--summary-json",
            str(out.with_suffix(".summary.json")),
            *SAMPLING,
            *extra,
        ],
        **kw,
    )


@pytest.fixture(scope="module")
def one_rank(ckpt: Path, prompts: Path) -> Path:
    out = ckpt.parent / "one.jsonl"
    _ok(_infer(ckpt, prompts, out, "--batch-size", "4"))
    return out


GREEDY = [
    "--prompt",
    r"def main():\n",
    "--max-new-tokens",
    "40",
    "--temperature",
    "0",
    "--dtype",
    "float64",
]


@pytest.fixture(scope="module")
def greedy(ckpt: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = ckpt.parent / "greedy" / "sample.json"
    proc = _ok(_cli(["generate", "--checkpoint", str(ckpt), *GREEDY, "--output", str(out)]))
    assert [p.name for p in out.parent.iterdir()] == ["sample.json"]
    return proc, json.loads(out.read_text())


def test_generate_writes_json_and_matches_the_library(ckpt: Path, greedy):
    import torch

    from torsh_distributed.inference import SamplingConfig, decode_bytes, encode_bytes, generate
    from torsh_distributed.inference.load import load_gpt

    proc, report = greedy
    assert report["prompt"] == "def main():\n" and report["step"] == 6 and report["tp"] == 1
    model, _, _ = load_gpt(ckpt, dtype=torch.float64)
    expected = generate(
        model, encode_bytes("def main():\n"), SamplingConfig(temperature=0, max_new_tokens=40)
    )
    assert report["tokens"] == expected.tokens and report["num_tokens"] == 40
    assert report["completion"] == decode_bytes(expected.tokens)
    assert report["stop_reason"] == "max_tokens"
    assert report["time_to_first_token_s"] > 0 and report["time_per_output_token_s"] > 0
    assert proc.stdout == "def main():\n" + report["completion"] + "\n"
    assert "40 tokens (max_tokens)" in proc.stderr and "ms/token" in proc.stderr


def test_tp2_decodes_the_tokens_of_tp1(ckpt: Path, greedy, tmp_path: Path):
    one, tp1 = greedy
    two = _ok(
        _cli(
            [
                "generate",
                "--checkpoint",
                str(ckpt / "step_00000006"),
                *GREEDY,
                "--tp",
                "2",
                "--output",
                str(tmp_path / "tp2.json"),
            ]
        )
    )
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert tp2["tp"] == 2 and tp2["tokens"] == tp1["tokens"] and len(tp1["tokens"]) == 40
    assert two.stdout == one.stdout  # the launching process prints, without rank prefixes


def test_two_ranks_write_the_one_rank_output(ckpt: Path, prompts: Path, one_rank: Path):
    from torsh_distributed.inference import SamplingConfig, generate
    from torsh_distributed.inference._batch import prompt_seed
    from torsh_distributed.inference.load import load_gpt
    from torsh_distributed.inference.text import decode_bytes, encode_bytes

    out = ckpt.parent / "two.jsonl"
    proc = _ok(_infer(ckpt, prompts, out, "--nproc-per-node", "2", "--batch-size", "3"))
    assert out.read_bytes() == one_rank.read_bytes()
    assert "[rank0]: infer: 100%" in proc.stdout and "[rank1]" not in proc.stdout
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["computed"] == len(PROMPTS) and summary["skipped"] == 0
    assert summary["world_size"] == 2 and not out.with_name("two.jsonl.parts").exists()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["id"], r["prompt"]) for r in rows] == [
        (i, f"p{i}", p) for i, p in enumerate(PROMPTS)
    ]
    model, _, _ = load_gpt(ckpt, dtype=__import__("torch").float64)
    for i in (0, 2, 5):  # derived seed; greedy override; own seed with a stop string
        seed = 123 if i == 5 else prompt_seed(3, i)
        config = SamplingConfig(
            max_new_tokens=20 if i == 2 else 12,
            temperature=0 if i == 2 else 0.9,
            top_k=50,
            seed=seed,
            stop_strings=("\n",) if i == 5 else (),
        )
        expected = generate(model, encode_bytes(PROMPTS[i]), config, decode=decode_bytes)
        assert rows[i]["tokens"] == expected.tokens and rows[i]["seed"] == seed, i
        assert rows[i]["completion"] == expected.text
        assert rows[i]["stop_reason"] == expected.stop_reason


def test_tp2_replicas_write_the_one_rank_output(ckpt: Path, prompts: Path, one_rank: Path):
    out = ckpt.parent / "tp2.jsonl"
    proc = _ok(
        _infer(ckpt, prompts, out, "--nproc-per-node", "4", "--tp", "2", "--batch-size", "3")
    )
    assert out.read_bytes() == one_rank.read_bytes()  # fp64: sampled and greedy lines alike
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert (summary["world_size"], summary["tp"], summary["computed"]) == (4, 2, len(PROMPTS))
    assert "on 4 rank(s) (dp 2 x tp 2)" in proc.stdout


def test_a_killed_run_resumes_with_only_the_rest(ckpt: Path, prompts: Path, one_rank: Path):
    out = ckpt.parent / "resumed.jsonl"
    parts = out.with_name("resumed.jsonl.parts")
    killed = _infer(
        ckpt,
        prompts,
        out,
        "--nproc-per-node",
        "2",
        "--batch-size",
        "2",
        env={"TORSH_FAULT": "kill:rank=1:step=1"},
    )
    assert killed.returncode != 0 and "failed" in killed.stderr, killed.stderr[-3000:]
    assert not out.exists() and not list(out.parent.glob(".resumed*"))
    done = [json.loads(line) for p in parts.glob("rank_*.jsonl") for line in p.open()]
    assert 2 <= len(done) < len(PROMPTS)  # rank 1's first batch at least; not everything
    with open(parts / "rank_1.jsonl", "a") as fp:
        fp.write('{"index": 10, "key": "')  # as if killed in the middle of a write
    proc = _ok(_infer(ckpt, prompts, out, "--batch-size", "2"))  # resumed on one rank
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert (summary["skipped"], summary["computed"]) == (len(done), len(PROMPTS) - len(done))
    assert f"{len(done)} done earlier" in proc.stdout
    assert out.read_bytes() == one_rank.read_bytes() and not parts.exists()


BAD = [
    ('{"prompt": "a"}\n{"prompt": "b"\n', "prompts.jsonl:2: not valid JSON"),
    ('{"id": 1}\n', "prompts.jsonl:1: needs a non-empty string 'prompt'"),
    ("\n", "holds no prompts"),
    (
        json.dumps({"prompt": "x" * 65}) + "\n",
        "prompts.jsonl:1: the prompt has 65 tokens, more than the model's context of 64",
    ),
]


@pytest.mark.parametrize(("text", "match"), BAD)
def test_bad_input_is_refused_before_any_rank_starts(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, match: str
):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    code = main(
        [
            "infer",
            "--checkpoint",
            str(ckpt),
            "--input",
            str(path),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--nproc-per-node",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and match in err, err
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--tp", "3"], "tp=3 must divide the model's n_head=2"),
        (["--tp", "0"], "tp must be an int >= 1, got 0"),
        (["--tp", "2", "--nproc-per-node", "3"], "--nproc-per-node 3 must be a multiple of --tp 2"),
    ],
)
def test_infer_refuses_a_tp_layout_that_cannot_work(
    ckpt: Path,
    prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    match: str,
):
    out = tmp_path / "out.jsonl"
    code = main(
        ["infer", "--checkpoint", str(ckpt), "--input", str(prompts), "--output", str(out), *flags]
    )
    err = capsys.readouterr().err
    assert code == 2 and match in err, err
    assert list(tmp_path.iterdir()) == []  # refused before any rank started


def test_generate_refuses_what_it_cannot_do(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    cases = [
        (["--checkpoint", str(tmp_path / "none"), "--prompt", "a"], "no such checkpoint directory"),
        (
            ["--checkpoint", str(ckpt), "--prompt", "a", "--tp", "3"],
            "tp=3 must divide the model's n_head=2",
        ),
        (["--checkpoint", str(ckpt), "--prompt", "a" * 65], "the prompt has 65 tokens"),
        (["--checkpoint", str(ckpt), "--prompt", "a", "--top-p", "0"], "sampling.top_p must be in"),
    ]
    for args, match in cases:
        assert main(["generate", *args]) == 2
        assert match in capsys.readouterr().err, match
