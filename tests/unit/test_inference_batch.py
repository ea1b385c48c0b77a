"""The files behind batch inference: JSONL input checks (file and line in every error), per-prompt
seeds and keys, part files that survive a torn write, the atomic output; and the CLI's escapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_distributed.inference._batch import (
    PartWriter,
    parts_dir,
    prompt_seed,
    read_prompts,
    scan_parts,
    write_jsonl_atomic,
)
from torsh_distributed.inference.batch import InferJob, shares
from torsh_distributed.inference.jobs import GenerateJob
from torsh_distributed.inference.sampling import SamplingConfig

BASE = SamplingConfig(max_new_tokens=8, temperature=0.8, seed=5)


def _read(
    path: Path, *, base: SamplingConfig = BASE, checkpoint: str = "ck/step_1", limit: int = 32
):
    return read_prompts(path, base, checkpoint=checkpoint, count_tokens=len, max_seq_len=limit)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_lines_become_prompts_with_overrides_and_derived_seeds(tmp_path: Path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "a", "id": "x"}),
            "",
            json.dumps(
                {"prompt": "bb", "seed": 7, "max_new_tokens": 3, "stop": "\n", "temperature": 0}
            ),
            json.dumps({"prompt": "c", "stop": ["x", "y"], "top_k": 4, "top_p": 0.5}),
        ],
    )
    items = _read(path)
    assert [(i.index, i.line, i.prompt, i.id) for i in items] == [
        (0, 1, "a", "x"),
        (1, 3, "bb", None),
        (2, 4, "c", None),
    ]
    assert (
        items[0].sampling.seed == prompt_seed(5, 0) != prompt_seed(5, 2) == items[2].sampling.seed
    )
    assert items[1].sampling == SamplingConfig(
        max_new_tokens=3, temperature=0, seed=7, stop_strings=("\n",)
    )
    assert (items[2].sampling.top_k, items[2].sampling.top_p) == (4, 0.5)
    assert items[2].sampling.stop_strings == ("x", "y")
    assert len({i.key for i in items}) == 3


def test_prompt_seed_is_a_fixed_function_of_seed_and_index():
    assert prompt_seed(0, 0) == prompt_seed(0, 0)
    assert len({prompt_seed(s, i) for s in range(3) for i in range(50)}) == 150
    assert all(0 <= prompt_seed(2**64 - 1, i) < 2**64 for i in range(10))


def test_keys_change_with_the_line_the_settings_and_the_checkpoint(tmp_path: Path):
    path = _write(tmp_path, [json.dumps({"prompt": "a"}), json.dumps({"prompt": "b"})])
    keys = [i.key for i in _read(path)]
    assert keys == [i.key for i in _read(path)]
    assert (
        _read(path, base=SamplingConfig(max_new_tokens=9, temperature=0.8, seed=5))[0].key
        != keys[0]
    )
    assert (
        _read(path, base=SamplingConfig(max_new_tokens=8, temperature=0.8, seed=6))[0].key
        != keys[0]
    )
    assert _read(path, checkpoint="ck/step_2")[0].key != keys[0]
    changed = _write(tmp_path, [json.dumps({"prompt": "a"}), json.dumps({"prompt": "B"})])
    assert [i.key for i in _read(changed)] == [keys[0], _read(changed)[1].key] != keys


BAD = [
    (['{"prompt": "a"}', '{"prompt": "b"'], r"in\.jsonl:2: not valid JSON"),
    (['["a"]'], r"in\.jsonl:1: each line must be a JSON object"),
    (['{"prompt": "a"}', "", '{"text": "b"}'], r"in\.jsonl:3: needs a non-empty string 'prompt'"),
    (['{"prompt": ""}'], r"in\.jsonl:1: needs a non-empty string 'prompt'"),
    (['{"prompt": 3}'], r"in\.jsonl:1: needs a non-empty string 'prompt'"),
    (['{"prompt": "a", "top_p": 2}'], r"in\.jsonl:1: sampling\.top_p must be in \(0, 1\]"),
    (['{"prompt": "a", "stop": 3}'], r"in\.jsonl:1: 'stop' must be a string or a list"),
    (
        ['{"prompt": "' + "x" * 33 + '"}'],
        r"in\.jsonl:1: the prompt has 33 tokens, more than the "
        r"model's context of 32",
    ),
    (["", "  "], r"holds no prompts"),
]


@pytest.mark.parametrize(("lines", "match"), BAD)
def test_bad_input_names_file_and_line(tmp_path: Path, lines: list[str], match: str):
    with pytest.raises(ValueError, match=match):
        _read(_write(tmp_path, lines))


def test_missing_input_and_unused_fields(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no such input file"):
        _read(tmp_path / "nope.jsonl")
    with pytest.warns(UserWarning, match="fields answer are not used"):
        _read(_write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"})]))


def test_part_files_keep_complete_lines_only(tmp_path: Path):
    parts = parts_dir(tmp_path / "out.jsonl")
    assert parts == tmp_path / "out.jsonl.parts"
    keys = {0: "k0", 1: "k1", 2: "k2", 3: "k3"}
    writer = PartWriter(parts, 1)
    writer.append([{"index": 0, "key": "k0", "completion": "a"}])
    writer.append([{"index": 1, "key": "k1"}, {"index": 2, "key": "old"}])
    with open(parts / "rank_1.jsonl", "a") as fp:
        fp.write('{"index": 3, "key": "k3", "compl')  # killed mid-write
    (parts / "rank_0.jsonl").write_text('not json\n{"index": 3}\n')
    with pytest.warns(UserWarning, match="1 earlier result"):
        done = scan_parts(parts, keys)
    assert sorted(done) == [0, 1] and done[0]["completion"] == "a"
    PartWriter(parts, 1).append([{"index": 3, "key": "k3"}])  # cuts the torn line first
    lines = (parts / "rank_1.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)
    with pytest.warns(UserWarning):
        assert sorted(scan_parts(parts, keys)) == [0, 1, 3]
    assert scan_parts(tmp_path / "none", keys) == {}


def test_output_is_written_whole(tmp_path: Path):
    out = tmp_path / "sub" / "out.jsonl"
    write_jsonl_atomic(out, [{"a": 1}, {"b": "é"}])
    assert out.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]


def test_shares_are_contiguous_and_balanced():
    assert shares(list(range(7)), 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert shares([4, 9], 4) == [[], [4], [], [9]]
    assert sum(shares(list(range(100)), 8), []) == list(range(100))


def test_jobs_validate_and_round_trip():
    job = GenerateJob(
        checkpoint="ck", prompt="hi", sampling=SamplingConfig(stop_strings=("\n",)), tp=2
    )
    assert GenerateJob.from_json(job.to_json()) == job
    infer = InferJob(checkpoint="ck", input="a.jsonl", output="b.jsonl", batch_size=3, tp=2)
    assert InferJob.from_json(infer.to_json()) == infer
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        GenerateJob(checkpoint="ck", prompt="hi", tp=0)
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        GenerateJob(checkpoint="ck", prompt="")
    with pytest.raises(ValueError, match="dtype must be one of float32"):
        GenerateJob(checkpoint="ck", prompt="hi", dtype="int8")
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        InferJob(checkpoint="ck", input="a", output="b", batch_size=0)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        InferJob(checkpoint="ck", input="a", output="b", tp=0)
    with pytest.raises(ValueError, match="output must differ from input"):
        InferJob(checkpoint="ck", input="a.jsonl", output="./a.jsonl")


def test_cli_escapes():
    from torsh_distributed.cli.generate import unescape

    assert unescape(r"def f():\n\tpass\\n\x") == "def f():\n\tpass\\n\\x"
    assert unescape("plain") == "plain" and unescape("end\\") == "end\\"
