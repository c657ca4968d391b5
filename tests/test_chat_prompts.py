"""The packaged chat benchmark prompt set (``--dataset chat``) and the ``category`` key of prompt files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tensorrt_llm_dflash import bench
from tensorrt_llm_dflash.errors import DFlashInputError


def test_chat_set_loads_with_every_category():
    prompts = bench.load_prompts(bench.CHAT)
    assert len(prompts) >= 30
    assert all(p.ids is None and isinstance(p.text, str) and p.text.strip() for p in prompts)
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(bench.CHAT_CATEGORIES), counts
    assert all(counts[c] >= 4 for c in bench.CHAT_CATEGORIES), counts
    normalized = [" ".join(p.text.lower().split()) for p in prompts]
    assert len(set(normalized)) == len(normalized), "duplicate prompts"


def test_chat_set_first_prompts_cover_every_category():
    """The benchmark takes the first --num_prompts prompts: a short run still sees every category."""
    first = bench.load_prompts(bench.CHAT, len(bench.CHAT_CATEGORIES))
    assert {p.category for p in first} == set(bench.CHAT_CATEGORIES)


def test_chat_set_file_is_plain_utf8_jsonl_shipped_as_package_data():
    path = bench.CHAT_PROMPTS_FILE
    assert path.name == "chat_prompts.jsonl"
    lines = path.read_bytes().decode("utf-8").splitlines()
    assert all(line.strip() for line in lines)
    assert all(set(json.loads(line)) == {"prompt", "category"} for line in lines)
    # pyproject.toml ships tensorrt_llm_dflash/assets/**/* as package data.
    package = path.parents[1]
    assert path in set(package.glob("assets/**/*"))
    assert '"assets/**/*"' in (package.parent / "pyproject.toml").read_text()


def test_category_key_is_kept_and_optional(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "category": "poem"}\n{"prompt": "b"}\n{"prompt_ids": [1], "category": "x"}\n')
    assert [(p.text, p.ids, p.category) for p in bench.load_prompts(str(path))] == [
        ("a", None, "poem"), ("b", None, None), (None, [1], "x")]


@pytest.mark.parametrize("bad", ['{"prompt": "a", "category": 3}', '{"prompt": "a", "category": ""}'])
def test_bad_category_names_its_line(tmp_path, bad):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + bad + "\n")
    with pytest.raises(DFlashInputError, match=r"p\.jsonl:2: 'category' must be a non-empty string"):
        bench.load_prompts(str(path))


def test_cli_accepts_dataset_chat(tmp_path, capsys):
    from example_cli import load_example

    benchmark = load_example("benchmark")
    args = benchmark.parse_args(["--dataset", "chat", "--methods", "ar", "--output_dir", str(tmp_path)])
    assert args.dataset == bench.CHAT
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    assert "'chat'" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        benchmark.parse_args(["--dataset", "chatt", "--methods", "ar", "--output_dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "neither 'humaneval', 'chat' nor a JSONL file" in capsys.readouterr().err
