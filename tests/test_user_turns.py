"""User turns the target writes itself (training/user_turns.py, examples/write_user_turns.py):
where the user's text begins, what is dropped and why, determinism, and the CLI's file."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from example_cli import load_example
from tiny_dirs import char_tokenizer, save_tiny_target_dir
from tiny_models import tiny_target

from tensorrt_llm_dflash.errors import DFlashConfigError
from tensorrt_llm_dflash.training.datasets import read_dataset, render
from tensorrt_llm_dflash.training.user_turns import user_turn_prefix, write_user_turns

#: Role-marked template: "u:" opens a user turn, "<eos>" (id 1) ends every turn.
ROLE_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
EOS = 1


def _tokenizer():
    tok = char_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


def test_the_prefix_is_the_template_up_to_the_users_text():
    tok = _tokenizer()
    prefix = user_turn_prefix(tok)
    assert tok.decode(prefix) == "u:"
    full = render(tok, [{"role": "user", "content": "hello there"}], add_generation_prompt=False)
    assert full[: len(prefix)] == prefix and tok.decode(full[len(prefix):]).startswith("hello there")


def test_a_template_that_changes_the_users_text_is_refused():
    tok = char_tokenizer()  # its template lowercases every message
    with pytest.raises(DFlashConfigError, match="does not place a user's message verbatim"):
        user_turn_prefix(tok)


class _ScriptedWriter:
    """A stand-in model whose generate() returns the prefix + the scripted rows, batch by batch."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows
        self.generation_config = SimpleNamespace(eos_token_id=EOS, pad_token_id=None)
        self.calls = 0
        self._param = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        yield self._param

    def generate(self, input_ids, **kwargs):
        assert kwargs["do_sample"] and kwargs["eos_token_id"] == [EOS]
        batch = input_ids.shape[0]
        rows = self.rows[self.calls * batch:(self.calls + 1) * batch]
        self.calls += 1
        width = max(len(r) for r in rows)
        body = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, body], dim=1)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_each_drop_reason_and_the_kept_turns_in_order():
    tok = _tokenizer()
    benchmark = "write a function that returns the sum of two numbers please"
    rows = [
        _ids(tok, "how do i keep basil alive indoors") + [EOS],
        _ids(tok, "this turn never ends because the model ran out of tokens"),  # no EOS: unfinished
        _ids(tok, "what is a") + [0] + _ids(tok, " token") + [EOS],  # <unk> is a special id: template token
        _ids(tok, "hi there") + [EOS],  # 2 words: too short
        _ids(tok, "how do i keep  basil alive\nindoors ") + [EOS],  # the same turn but for spacing: duplicate
        _ids(tok, "can you write a function that returns the sum of two numbers") + [EOS],  # benchmark 8-gram
        _ids(tok, "plan a cheap weekend in lisbon for two") + [EOS],
        _ids(tok, "never reached: the count is met") + [EOS],
    ]
    written = write_user_turns(_ScriptedWriter(rows), tok, 2, batch_size=4, exclude=[benchmark])
    assert written.turns == ["how do i keep basil alive indoors", "plan a cheap weekend in lisbon for two"]
    assert dict(written.dropped) == {"unfinished": 1, "template token": 1, "too short": 1, "duplicate": 1,
                                     "benchmark overlap": 1}
    assert written.batches == 2
    assert written.summary() == ("2 user turns kept of 7 written (dropped: unfinished 1, template token 1, too short 1, "
                                 "duplicate 1, benchmark overlap 1)")


def test_a_turn_in_avoid_is_a_duplicate_up_to_case_and_spacing():
    tok = _tokenizer()
    rows = [_ids(tok, "how do i keep basil alive indoors") + [EOS], _ids(tok, "plan a cheap weekend in lisbon") + [EOS]]
    written = write_user_turns(_ScriptedWriter(rows), tok, 1, batch_size=2,
                               avoid=["How do I keep basil\n alive indoors"])
    assert written.turns == ["plan a cheap weekend in lisbon"] and dict(written.dropped) == {"duplicate": 1}


def test_the_batch_limit_stops_a_writer_that_keeps_nothing():
    tok = _tokenizer()
    model = _ScriptedWriter([_ids(tok, "no end") for _ in range(40)])
    written = write_user_turns(model, tok, 3, batch_size=2, max_batches=5)
    assert written.turns == [] and written.batches == 5 and written.dropped["unfinished"] == 10


def test_real_sampling_is_deterministic_and_leaves_the_global_rng_alone():
    tok = _tokenizer()
    model = tiny_target("qwen3", seed=5, vocab=64, layers=2, dtype=torch.float32, max_positions=256)
    model.generation_config.eos_token_id = EOS
    kwargs = dict(seed=3, max_new_tokens=24, batch_size=8, min_words=1, max_batches=3)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = write_user_turns(model, tok, 5, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), before)
    again = write_user_turns(model, tok, 5, **kwargs)
    other = write_user_turns(model, tok, 5, **{**kwargs, "seed": 4})
    assert first.turns == again.turns and first.dropped == again.dropped
    assert first.turns != other.turns or first.dropped != other.dropped
    written = sum(first.dropped.values()) + len(first.turns)
    assert 0 < written <= 24  # 3 batches of 8 at most


@pytest.fixture(scope="module")
def role_target_dir(tmp_path_factory):
    path = save_tiny_target_dir(tmp_path_factory.mktemp("user_turns") / "target", layers=2)
    _tokenizer().save_pretrained(path)
    config = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() \
        else {}
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return path


def test_the_cli_writes_openai_lines_that_train_dflash_reads(tmp_path, role_target_dir, capsys):
    cli = load_example("write_user_turns")
    out = tmp_path / "turns.jsonl"
    argv = ["--target_model_dir", str(role_target_dir), "--output", str(out), "--num_turns", "4", "--min_words", "1",
            "--max_new_tokens", "48", "--batch_size", "16", "--threads", "1"]
    code = cli.main(argv)
    captured = capsys.readouterr()
    if code != 0:  # a random tiny model may end too few turns; the message says so and nothing is written
        assert "no user turn was kept" in captured.err and not out.exists()
        pytest.fail(f"the tiny target kept no turn: {captured.err}")
    lines = out.read_text().splitlines()
    assert 1 <= len(lines) <= 4 and f"wrote {out}" in captured.out
    dataset = read_dataset(out)
    assert not dataset.bad and [c.messages[0]["role"] for c in dataset.conversations] == ["user"] * len(lines)
    assert [json.loads(line)["messages"][0]["content"] for line in lines] == [
        c.messages[0]["content"] for c in dataset.conversations]


def test_avoid_keeps_a_second_file_clear_of_the_first(tmp_path, role_target_dir, capsys):
    cli = load_example("write_user_turns")
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    argv = ["--target_model_dir", str(role_target_dir), "--num_turns", "3", "--min_words", "1", "--max_new_tokens", "48",
            "--batch_size", "8", "--threads", "1"]
    assert cli.main([*argv, "--output", str(first)]) == 0, capsys.readouterr().err
    # The same seed writes the same first batch again: every turn of it is now a duplicate.
    code = cli.main([*argv, "--output", str(second), "--avoid", str(first)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    turns = [[json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()]
             for path in (first, second)]
    assert turns[1] and not set(turns[0]) & set(turns[1])
    assert "duplicate" in captured.out


def test_a_bad_avoid_file_exits_2_naming_the_flag_before_any_model_loads(tmp_path, capsys, monkeypatch):
    cli = load_example("write_user_turns")
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert cli.main(["--output", str(tmp_path / "t.jsonl"), "--avoid", str(empty)]) == 2
    assert f"--avoid {str(empty)!r} is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--output", str(tmp_path / "t.jsonl"), "--avoid", str(tmp_path / "missing.jsonl")])
    assert exit_info.value.code == 2 and "--avoid" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,message", [
    ("--temperature", "0", "--temperature"),
    ("--top_p", "1.5", "--top_p"),
    ("--num_turns", "0", "--num_turns"),
])
def test_bad_flags_exit_2_naming_the_flag_before_any_model_loads(tmp_path, flag, value, message, capsys,
                                                                  monkeypatch):
    cli = load_example("write_user_turns")
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--output", str(tmp_path / "t.jsonl"), flag, value])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
