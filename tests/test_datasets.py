"""Training on the user's own data (--dataset): the three JSONL shapes, bad lines, the loss
mask on assistant tokens, the truncation rule, and train_dflash end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from tiny_dirs import char_tokenizer, save_tiny_target_dir
from tiny_models import tiny_target

from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.training import data as data_module
from tensorrt_llm_dflash.training.data import (
    Generated,
    build_conversation_data,
    build_distillation_data,
    chat_prompt_ids,
    load_distillation_data,
)
from tensorrt_llm_dflash.training.datasets import (
    Conversation,
    assistant_spans,
    parse_line,
    read_dataset,
    render,
    tokenize_for_dataset_answers,
)

#: Role-marked chat template for the char tokenizer: a generation prompt ("a:") and an end of
#: turn ("<eos>", the stop token) followed by template glue ("\n").
ROLE_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
MULTI_TURN = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"},
              {"role": "assistant", "content": "ok then"}]
SHAPES = {
    "openai": {"messages": MULTI_TURN},
    "sharegpt": {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                   {"from": "gpt", "value": "hello there"}, {"from": "user", "value": "more"},
                                   {"from": "assistant", "value": "ok then"}]},
    "sharegpt_top_system": {"system": "be brief", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}, {"from": "human", "value": "more"},
        {"from": "gpt", "value": "ok then"}]},
}
TINY = ["--max_new_tokens", "4", "--train_minutes", "0", "--max_steps", "3", "--log_every", "1",
        "--num_feature_layers", "2", "--threads", "1", "--data_minutes", "0"]


def _example():
    return load_example("train_dflash")


@pytest.fixture(scope="module")
def train_dflash():
    return _example()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target_dir(tmp_path_factory.mktemp("datasets") / "target")


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _role_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _pieces(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Expected (ids, loss mask) from (text, carries loss) pieces."""
    ids, mask = [], []
    for text, loss in pieces:
        piece = _ids(tok, text)
        ids += piece
        mask += [loss] * len(piece)
    return ids, mask


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_parses_into_the_same_messages(shape):
    conv = parse_line(json.dumps(SHAPES[shape]), 7)
    assert list(conv.messages) == MULTI_TURN and conv.line == 7


def test_plain_lines_parse_with_response_completion_or_no_answer():
    user = {"role": "user", "content": "write code"}
    answer = {"role": "assistant", "content": "def f(): pass"}
    assert list(parse_line('{"prompt": "write code", "response": "def f(): pass"}', 1).messages) == [user, answer]
    assert list(parse_line('{"prompt": "write code", "completion": "def f(): pass"}', 1).messages) == [user, answer]
    assert list(parse_line('{"prompt": "write code", "id": 5}', 1).messages) == [user]
    openai = {"messages": [{"role": "user", "content": "write code"}, {"role": "assistant", "content": "def f(): pass"}]}
    assert parse_line(json.dumps(openai), 1).messages == parse_line('{"prompt": "write code", "response": "def f(): '
                                                                    'pass"}', 1).messages


def test_regeneration_segments_replace_the_assistant_turns():
    conv = Conversation(tuple(MULTI_TURN), 1)
    assert conv.regeneration_segments() == [MULTI_TURN[:2], [MULTI_TURN[3]]]
    trailing_user = Conversation(tuple(MULTI_TURN[:3] + [{"role": "user", "content": "and"}]), 1)
    assert trailing_user.regeneration_segments() == [MULTI_TURN[:2], [{"role": "user", "content": "and"}]]
    assert trailing_user.for_dataset_answers() == MULTI_TURN[:3]


BAD_LINES = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got a list"),
    ('{"text": "a"}', "unknown shape"),
    ('{"prompt": "a", "messages": []}', "ambiguous shape"),
    ('{"prompt": 7}', "'prompt' must be a string, got a number"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"prompt": "a", "response": "b", "completion": "c"}', "both 'response' and 'completion'"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"messages": []}', "'messages' is an empty list"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "unknown role 'tool'"),
    ('{"messages": [{"role": "user"}]}', "message 1 has no 'content' field"),
    ('{"messages": [{"role": "user", "content": ["a"]}]}', "message 1's content must be a string, got a list"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}', "no user turn"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]}',
     "an assistant turn before the first user turn"),
    ('{"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]}',
     "a system message after the conversation started"),
    ('{"conversations": [{"from": "bot", "value": "x"}]}', "unknown 'from' 'bot'"),
    ('{"conversations": [{"from": "human", "value": ""}]}', "turn 1's value is empty"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_a_malformed_line_names_its_reason(line, reason):
    with pytest.raises(DFlashInputError, match=None) as err:
        parse_line(line, 1)
    assert reason in str(err.value)


def test_dataset_answers_need_an_assistant_turn():
    parse_line('{"prompt": "a"}', 1, "regenerate")
    with pytest.raises(DFlashInputError, match="no assistant turn"):
        parse_line('{"prompt": "a"}', 1, "dataset")


def test_file_level_errors_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DFlashInputError, match="empty.jsonl' is empty"):
        read_dataset(empty)
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text('{"prompt": "a"}\n', encoding="utf-16")
    with pytest.raises(DFlashInputError, match=r"utf16.jsonl: the file is UTF-16 \(little-endian\) encoded"):
        read_dataset(utf16)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DFlashInputError, match="latin.jsonl:2: not valid UTF-8"):
        read_dataset(latin)
    all_bad = _write(tmp_path / "bad.jsonl", ["nope", "[]"])
    with pytest.raises(DFlashInputError, match="holds no valid conversation: all 2 lines are bad "
                                               r"\(first: line 1: not valid JSON"):
        read_dataset(all_bad)


def _mixed_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "mixed.jsonl", [
        SHAPES["openai"], "", "{not json", {"prompt": "write code", "response": "def f(): pass"},
        {"messages": [{"role": "tool", "content": "x"}]}, SHAPES["sharegpt"], {"prompt": ""}])


def test_bad_lines_are_reported_by_number_and_skipped_then_strict_refuses(tmp_path, train_dflash, capsys,
                                                                          monkeypatch):
    path = _mixed_file(tmp_path)
    dataset = read_dataset(path)
    assert [c.line for c in dataset.conversations] == [1, 4, 6] and dataset.lines == 6
    assert [b.line for b in dataset.bad] == [3, 5, 7]
    assert dataset.summary() == f"{path}: skipped 3 of 6 lines (first: line 3: not valid JSON (Expecting property " \
                                "name enclosed in double quotes at column 2))"

    def trap(*_a, **_k):
        raise AssertionError("a model load was reached")

    monkeypatch.setattr(train_dflash, "load_target", trap)
    argv = ["--dataset", str(path), "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "work"), *TINY]
    with pytest.raises(AssertionError, match="model load"):  # default: report, skip, go on to load the target
        train_dflash.main(argv)
    err = capsys.readouterr().err
    assert f"{path}:3: not valid JSON" in err and f"{path}:5: message 1: unknown role 'tool'" in err
    assert f"{path}:7: 'prompt' is empty: skipped" in err
    assert f"{path}: skipped 3 of 6 lines (first: line 3: not valid JSON" in err

    assert train_dflash.main([*argv, "--strict"]) == 2  # refused before the (trapped) load
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:3: not valid JSON") and "--strict" in lines[0]
    assert not (tmp_path / "work").exists()


def test_unusable_files_and_flags_exit_2_with_one_line_before_the_model_loads(tmp_path, train_dflash, capsys,
                                                                               monkeypatch):
    monkeypatch.setattr(train_dflash, "load_target", lambda *a, **k: (_ for _ in ()).throw(AssertionError("load")))
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text('{"prompt": "a"}\n', encoding="utf-16")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    answerless = _write(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    base = ["--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "work")]
    for extra, words in ((["--dataset", str(utf16)], "UTF-16"), (["--dataset", str(empty)], "is empty"),
                         (["--dataset", str(answerless), "--answers", "dataset"], "holds no valid conversation"),
                         (["--dataset", str(tmp_path / "missing.jsonl")], "--dataset"),
                         (["--dataset", str(answerless), "--max_seq_len", "8"], "--max_seq_len"),
                         (["--dataset", str(answerless), "--answers", "maybe"], "--answers"),
                         (["--answers", "dataset"], "--answers"), (["--strict"], "--strict"),
                         (["--max_seq_len", "64"], "--max_seq_len")):
        try:
            code = train_dflash.main([*base, *extra])
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, (extra, err)


# ------------------------------------------------------------------ assistant tokens and the loss mask


def test_assistant_tokens_by_prefix_rendering_with_the_stock_char_template():
    """The stock template renders "content\\n" per message with no generation prompt: an
    answer's tokens are its content and the newline that ends its turn."""
    tok = char_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids = render(tok, messages, add_generation_prompt=False)
    assert ids == _ids(tok, "hi\nyo\n")
    (span,) = assistant_spans(tok, messages, ids)
    assert (span.start, span.end, span.cut) == (3, 6, 6)


def test_dataset_answers_loss_mask_is_exactly_the_assistant_tokens():
    tok = _role_tokenizer()
    t = tokenize_for_dataset_answers(tok, Conversation(tuple(MULTI_TURN), 1), 4096, stop_ids={1})
    ids, mask = _pieces(tok, [("s:be brief<eos>\nu:hi<eos>\na:", False), ("hello there<eos>", True),
                              ("\nu:more<eos>\na:", False), ("ok then<eos>", True), ("\n", False)])
    assert t.input_ids == ids and t.loss_mask == mask and not t.truncated
    assert t.answer_start == mask.index(True)
    # Without stop ids the template glue after the end of turn is part of the span.
    spans = assistant_spans(tok, MULTI_TURN, ids)
    assert [ids[s.end - 1] for s in spans] == _ids(tok, "\n\n")


def test_a_turn_the_template_renders_differently_in_context_gets_no_loss():
    """A template that shortens middle assistant turns once later turns follow them: that turn's
    renders are not prefixes of the conversation, so it is left without loss (and counted)."""
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{% if m['role'] == 'assistant' and loop.index0 > 2 "
                         "and not loop.last %}{{ m['content'][:2] }}{% else %}{{ m['content'] }}{% endif %}<eos>\n"
                         "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    messages = MULTI_TURN + [{"role": "user", "content": "last"}, {"role": "assistant", "content": "bye"}]
    t = tokenize_for_dataset_answers(tok, Conversation(tuple(messages), 1), 4096, stop_ids={1})
    ids, mask = _pieces(tok, [("s:be brief<eos>\nu:hi<eos>\na:", False), ("hello there<eos>", True),
                              ("\nu:more<eos>\na:ok<eos>\nu:last<eos>\na:", False), ("bye<eos>", True),
                              ("\n", False)])
    assert t.input_ids == ids and t.loss_mask == mask and t.turns_without_loss == 1


def _scripted_generation(tok, answer_text: str, calls: list):
    """generate_with_hidden_states stand-in: every answer is ``answer_text`` (tokens), features zeros."""
    def generate(model, prompt_ids, layer_ids, max_new_tokens, stop_ids, pad_id):
        calls.append([list(p) for p in prompt_ids])
        answer = _ids(tok, answer_text)[:max_new_tokens]
        width = len(layer_ids) * model.config.hidden_size
        return [Generated(answer, torch.zeros(len(p) + len(answer), width, dtype=torch.bfloat16),
                          torch.zeros(len(p) + len(answer), model.config.hidden_size, dtype=torch.bfloat16))
                for p in prompt_ids]
    return generate


@pytest.fixture(scope="module")
def tiny_model():
    model = tiny_target("qwen3", seed=3, vocab=64, layers=2, dtype=torch.float32, max_positions=512)
    model.generation_config.eos_token_id = 1  # <eos>: the role template's end of turn
    return model


def test_regenerate_loss_mask_covers_the_targets_answers_turn_by_turn(tmp_path, tiny_model, monkeypatch):
    tok = _role_tokenizer()
    calls = []
    monkeypatch.setattr(data_module, "generate_with_hidden_states", _scripted_generation(tok, "sure<eos>", calls))
    meta = build_conversation_data(tmp_path, tiny_model, tok, [Conversation(tuple(MULTI_TURN), 1)], [0, 1],
                                   answers="regenerate", max_seq_len=4096, max_new_tokens=16)
    # The dataset's answers were replaced; the target's first answer is the context of its second.
    assert calls == [[_ids(tok, "s:be brief<eos>\nu:hi<eos>\na:")],
                     [_ids(tok, "s:be brief<eos>\nu:hi<eos>\na:sure<eos>\nu:more<eos>\na:")]]
    (seq,) = load_distillation_data(tmp_path)
    ids, mask = _pieces(tok, [("s:be brief<eos>\nu:hi<eos>\na:", False), ("sure<eos>", True),
                              ("\nu:more<eos>\na:", False), ("sure<eos>", True)])
    assert seq.input_ids.tolist() == ids and seq.loss_mask.tolist() == mask
    assert meta["answer_tokens"] == sum(mask) and meta["sequences"] == 1


def test_dataset_answers_shards_hold_the_mask_and_the_features_of_a_full_forward(tmp_path, tiny_model):
    tok = _role_tokenizer()
    build_conversation_data(tmp_path, tiny_model, tok, [Conversation(tuple(MULTI_TURN), 1)], [0, 1],
                            answers="dataset", max_seq_len=4096)
    (seq,) = load_distillation_data(tmp_path, with_final_hidden=True)
    expected = tokenize_for_dataset_answers(tok, Conversation(tuple(MULTI_TURN), 1), 4096, stop_ids={1})
    assert seq.input_ids.tolist() == expected.input_ids and seq.loss_mask.tolist() == expected.loss_mask
    ref = data_module.capture_hidden_states(tiny_model, [expected.input_ids], [0, 1], 0)[0]
    torch.testing.assert_close(seq.features, ref[0])
    shard = torch.load(next(tmp_path.glob("shard_*.pt")))
    assert {"prompt_index", "input_ids", "answer_start", "features", "final_hidden", "loss_mask"} <= set(shard)
    assert shard["answer_start"] == [expected.answer_start] and shard["source_line"] == [1]


def test_old_shards_without_a_loss_mask_load_from_answer_start(tmp_path):
    torch.save({"prompt_index": [0], "input_ids": [torch.arange(6, dtype=torch.int32)], "answer_start": [4],
                "features": [torch.zeros(6, 4)], "final_hidden": [torch.zeros(6, 2)]}, tmp_path / "shard_00000.pt")
    (seq,) = load_distillation_data(tmp_path)
    assert seq.loss_mask.tolist() == [False] * 4 + [True] * 2


# ------------------------------------------------------------------ truncation


def test_truncation_drops_whole_turns_then_cuts_the_first_answer_then_skips():
    tok = _role_tokenizer()
    conv = Conversation(tuple(MULTI_TURN), 1)
    full = tokenize_for_dataset_answers(tok, conv, 4096, stop_ids={1})
    first_turn = _ids(tok, "s:be brief<eos>\nu:hi<eos>\na:hello there<eos>\n")
    prompt = len(_ids(tok, "s:be brief<eos>\nu:hi<eos>\na:"))
    # Fits: untouched.
    assert tokenize_for_dataset_answers(tok, conv, len(full.input_ids), {1}).input_ids == full.input_ids
    # One token short: the second turn goes whole; the sequence ends at the first turn's boundary.
    t = tokenize_for_dataset_answers(tok, conv, len(full.input_ids) - 1, {1})
    assert t.input_ids == first_turn and t.truncated
    assert t.loss_mask == [False] * prompt + [True] * len(_ids(tok, "hello there<eos>")) + [False]
    # Shorter than the first turn: the first answer's tokens are cut.
    t = tokenize_for_dataset_answers(tok, conv, prompt + 3, {1})
    assert t.input_ids == first_turn[: prompt + 3] and t.loss_mask == [False] * prompt + [True] * 3
    # The prompt alone leaves no room for an answer token: skipped, with the reason.
    with pytest.raises(DFlashInputError, match=f"its prompt \\({prompt} tokens before the first answer\\) leaves "
                                               f"no room for an answer within --max_seq_len {prompt}"):
        tokenize_for_dataset_answers(tok, conv, prompt, {1})


def test_regenerate_truncation_follows_the_same_rule(tmp_path, tiny_model, monkeypatch, capsys):
    tok = _role_tokenizer()
    monkeypatch.setattr(data_module, "generate_with_hidden_states", _scripted_generation(tok, "sure<eos>", []))
    prompt1 = len(_ids(tok, "s:be brief<eos>\nu:hi<eos>\na:"))
    turn1 = prompt1 + len(_ids(tok, "sure<eos>"))
    long_prompt = Conversation(({"role": "user", "content": "x" * 40},), 2)
    convs = [Conversation(tuple(MULTI_TURN), 1), long_prompt]
    meta = build_conversation_data(tmp_path / "a", tiny_model, tok, convs, [0, 1], answers="regenerate",
                                   max_seq_len=turn1 + 5, max_new_tokens=16, source="chats.jsonl")
    out = capsys.readouterr().out
    assert "chats.jsonl:2: its prompt (46 tokens) leaves no room for an answer within --max_seq_len" in out
    assert "skipped 1 conversations at tokenization (first: line 2:" in out
    (seq,) = load_distillation_data(tmp_path / "a")  # the second turn would pass the limit: dropped whole
    assert seq.input_ids.tolist() == _ids(tok, "s:be brief<eos>\nu:hi<eos>\na:sure<eos>")
    assert meta["skipped_conversations"] == 1 and meta["truncated"] == 1 and meta["turns_dropped"] == 1
    assert json.loads((tmp_path / "a" / "skipped_conversations.json").read_text())["skipped"][0]["line"] == 2
    build_conversation_data(tmp_path / "b", tiny_model, tok, convs[:1], [0, 1], answers="regenerate",
                            max_seq_len=prompt1 + 2, max_new_tokens=16)
    (seq,) = load_distillation_data(tmp_path / "b")  # the first answer is cut
    assert seq.input_ids.tolist() == _ids(tok, "s:be brief<eos>\nu:hi<eos>\na:su")
    assert seq.loss_mask.tolist() == [False] * prompt1 + [True, True]
    with pytest.raises(DFlashInputError, match="chats.jsonl:2: its prompt .*--strict"):
        build_conversation_data(tmp_path / "c", tiny_model, tok, convs, [0, 1], max_seq_len=turn1 + 5,
                                strict=True, source="chats.jsonl")


def test_a_resumed_data_stage_skips_the_conversations_shards_hold(tmp_path, tiny_model):
    tok = _role_tokenizer()
    convs = [parse_line(json.dumps({"prompt": p, "response": "ok"}), i + 1) for i, p in enumerate(["a", "b", "a"])]
    build_conversation_data(tmp_path, tiny_model, tok, convs[:2], [0, 1], answers="dataset", batch_size=1)
    meta = build_conversation_data(tmp_path, tiny_model, tok, convs, [0, 1], answers="dataset", batch_size=1)
    # Only the duplicate of "a" was new: each copy a shard holds counts once.
    assert meta["sequences"] == 3 and meta["batches"] == 3
    meta = build_conversation_data(tmp_path, tiny_model, tok, convs, [0, 1], answers="dataset", batch_size=1)
    assert meta["batches"] == 3


# ------------------------------------------------------------------ end to end


def test_train_on_a_dataset_end_to_end_in_both_answer_modes(tmp_path, target_dir, train_dflash, capsys):
    from tensorrt_llm_dflash.drafter import load_dflash_drafter

    path = _write(tmp_path / "chats.jsonl", [
        SHAPES["openai"], SHAPES["sharegpt"], {"prompt": "write code", "response": "def f(): pass"},
        {"prompt": "what is 2 + 2"}, "broken"])
    for answers in ("regenerate", "dataset"):
        work, out = tmp_path / f"work_{answers}", tmp_path / f"drafter_{answers}"
        argv = ["--target_model_dir", str(target_dir), "--dataset", str(path), "--answers", answers,
                "--max_seq_len", "256", "--work_dir", str(work), "--output_dir", str(out), *TINY]
        assert train_dflash.main(argv) == 0
        captured = capsys.readouterr()
        assert f"{path}:5: not valid JSON" in captured.err
        listed = json.loads((work / "dataset_bad_lines.json").read_text())
        assert listed["lines"] == 5 and [b["line"] for b in listed["bad"]] == ([5] if answers == "regenerate" else [4, 5])
        drafter = load_dflash_drafter(out)
        assert drafter.config.target_layer_ids == json.loads((work / "fingerprint.json").read_text())["data"][
            "layer_ids"]
        sequences = load_distillation_data(work / "data")
        fingerprint = json.loads((work / "fingerprint.json").read_text())["data"]
        assert fingerprint["dataset_sha256"] == read_dataset(path).sha256 and fingerprint["answers"] == answers
        assert fingerprint["max_seq_len"] == 256 and fingerprint["prompt_set"] == "dataset"
        card = json.loads((out / "training_metrics.json").read_text())
        if answers == "regenerate":
            assert len(sequences) == 4 and fingerprint["max_new_tokens"] == 4
        else:  # the answerless plain line is a bad line here
            assert len(sequences) == 3 and "max_new_tokens" not in fingerprint
            assert "line 4: no assistant turn" in captured.err
        assert card["data"]["dataset_sha256"] == fingerprint["dataset_sha256"] and card["data"]["answers"] == answers
        assert card["data"]["bad_lines_skipped"] == (1 if answers == "regenerate" else 2)
    # Another recipe on the same work dir is refused by name.
    argv[argv.index("--answers") + 1] = "regenerate"
    assert train_dflash.main(argv) == 2
    assert "data.answers 'dataset' (recorded) != 'regenerate' (now)" in capsys.readouterr().err
    _write(path, [SHAPES["openai"]])
    argv[argv.index("--answers") + 1] = "dataset"
    assert train_dflash.main(argv) == 2
    assert "data.dataset_sha256" in capsys.readouterr().err


def test_without_dataset_the_built_in_path_is_unchanged(tmp_path, target_dir, train_dflash, capsys):
    """No --dataset: the shards hold what build_distillation_data gives when called the old
    way (the built-in prompts, chat template, greedy answers), the fingerprint's data section
    is as before, and the old keys are all there."""
    from tensorrt_llm_dflash.target import load_target
    from tensorrt_llm_dflash.training.prompts import build_prompt_set

    work = tmp_path / "work"
    assert train_dflash.main(["--target_model_dir", str(target_dir), "--num_prompts", "3", "--work_dir", str(work),
                              "--output_dir", str(tmp_path / "out"), "--chat_share", "0", *TINY]) == 0
    capsys.readouterr()
    fingerprint = json.loads((work / "fingerprint.json").read_text())["data"]
    assert fingerprint == {"layer_ids": fingerprint["layer_ids"], "max_new_tokens": 4, "prompt_set": "built-in"}
    model, tok = load_target(target_dir)
    prompts = build_prompt_set(3)
    build_distillation_data(tmp_path / "old_way", model, tok, prompts, fingerprint["layer_ids"], max_new_tokens=4,
                            batch_size=48)
    (new_shard,), (old_shard,) = sorted(work.glob("data/shard_*.pt")), sorted(tmp_path.glob("old_way/shard_*.pt"))
    new, old = torch.load(new_shard), torch.load(old_shard)
    assert set(new) == {"prompt_index", "input_ids", "answer_start", "features", "final_hidden", "loss_mask"}
    assert new["prompt_index"] == old["prompt_index"] and new["answer_start"] == old["answer_start"]
    for key in ("input_ids", "features", "final_hidden"):
        assert all(torch.equal(a, b) for a, b in zip(new[key], old[key]))
    # The old recipe by hand: chat-templated prompts, shortest first, one batch of greedy answers.
    encoded = sorted(((i, chat_prompt_ids(tok, p)) for i, p in enumerate(prompts)), key=lambda item: len(item[1]))
    assert new["prompt_index"] == [i for i, _ in encoded]
    answers = data_module.generate_with_hidden_states(model, [p for _, p in encoded], fingerprint["layer_ids"], 4,
                                                      set(), 0)
    for (_, prompt), g, ids, start, mask in zip(encoded, answers, new["input_ids"], new["answer_start"],
                                                new["loss_mask"]):
        assert ids.tolist() == prompt + g.answer and start == len(prompt)
        assert mask.tolist() == [False] * start + [True] * (len(ids) - start)


def test_built_in_set_with_chat_regenerates_every_user_turn(tmp_path, target_dir, train_dflash, capsys):
    """The default built-in set mixes chat in: multi-turn conversations get an answer per user
    turn, loss on every answer; the fingerprint records the share."""
    from tensorrt_llm_dflash.training.prompts import build_builtin_conversations

    work = tmp_path / "work"
    turns = build_builtin_conversations(0.5, 40)
    multi = [i for i, c in enumerate(turns) if len(c) > 1]
    assert multi, "the first 40 built-in conversations hold a multi-turn one"
    n = max(multi[0] + 1, 3)
    assert train_dflash.main(["--target_model_dir", str(target_dir), "--num_prompts", str(n), "--work_dir", str(work),
                              "--output_dir", str(tmp_path / "out"), *TINY]) == 0
    capsys.readouterr()
    assert json.loads((work / "fingerprint.json").read_text())["data"]["chat_share"] == 0.5
    shards = [torch.load(f) for f in sorted(work.glob("data/shard_*.pt"))]
    rows = [(i, m) for shard in shards for i, m in zip(shard["prompt_index"], shard["loss_mask"])]
    assert sorted(i for i, _ in rows) == list(range(n))
    mask = dict(rows)[multi[0]].tolist()
    answers = sum(1 for a, b in zip([False] + mask, mask) if b and not a)
    assert answers == 2, f"a two-turn conversation has two answers with loss, got {answers}"


def test_init_drafter_starts_from_its_weights_and_refuses_another_shape(tmp_path, target_dir, train_dflash, capsys):
    from tensorrt_llm_dflash.drafter import load_dflash_drafter

    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--target_model_dir", str(target_dir), "--num_prompts", "3", *TINY, "--max_steps", "1"]
    assert train_dflash.main([*common, "--work_dir", str(tmp_path / "w1"), "--output_dir", str(first)]) == 0
    assert train_dflash.main([*common, "--work_dir", str(tmp_path / "w2"), "--output_dir", str(second), "--lr", "1e-9",
                              "--init_drafter", str(first)]) == 0
    a, b = load_dflash_drafter(first).state_dict(), load_dflash_drafter(second).state_dict()
    for name in ("layers.0.mlp.up_proj.weight", "fc.weight"):
        assert torch.allclose(a[name], b[name], atol=1e-2), name
    fingerprint = json.loads((tmp_path / "w2" / "fingerprint.json").read_text())["drafter"]
    assert len(fingerprint["init_drafter"]) == 64
    capsys.readouterr()
    assert train_dflash.main([*common, "--work_dir", str(tmp_path / "w3"), "--output_dir", str(tmp_path / "third"),
                              "--block_size", "4", "--init_drafter", str(first)]) == 2
    err = capsys.readouterr().err
    assert "--init_drafter" in err and "block_size is 8" in err and "has 4" in err


def test_training_on_a_single_sequence_is_refused_by_name(tmp_path, target_dir, train_dflash, capsys):
    assert train_dflash.main(["--target_model_dir", str(target_dir), "--num_prompts", "1", "--work_dir",
                              str(tmp_path / "w"), "--output_dir", str(tmp_path / "o"), *TINY]) == 2
    assert "training needs at least 2" in capsys.readouterr().err


def test_bf16_data_precision_answers_with_a_bf16_copy_and_is_fingerprinted(tmp_path, target_dir, train_dflash,
                                                                           capsys):
    """--data_precision bf16: the shards hold exactly what a bf16 copy of the target answers
    (tokens and features), training and export still run on the fp32 target, the work dir
    records the precision (an fp32 resume is refused by name) and the model card says it."""
    from tensorrt_llm_dflash.target import load_target
    from tensorrt_llm_dflash.training.prompts import build_prompt_set

    work = tmp_path / "work"
    argv = ["--target_model_dir", str(target_dir), "--num_prompts", "3", "--work_dir", str(work),
            "--output_dir", str(tmp_path / "out"), "--chat_share", "0", *TINY]
    assert train_dflash.main([*argv, "--data_precision", "bf16"]) == 0
    capsys.readouterr()
    assert json.loads((work / "fingerprint.json").read_text())["data"]["data_precision"] == "bf16"
    card = json.loads((tmp_path / "out" / "training_metrics.json").read_text())
    assert card["data"]["data_precision"] == "bf16"
    model, tok = load_target(target_dir)
    prompts = build_prompt_set(3)
    layer_ids = json.loads((work / "fingerprint.json").read_text())["data"]["layer_ids"]
    by_hand = train_dflash.data_stage_model(model, "bf16")
    assert by_hand.dtype == torch.bfloat16 and model.dtype == torch.float32, "the fp32 target is left as it was"
    build_distillation_data(tmp_path / "bf16_by_hand", by_hand, tok, prompts, layer_ids, max_new_tokens=4,
                            batch_size=48)
    build_distillation_data(tmp_path / "fp32", model, tok, prompts, layer_ids, max_new_tokens=4, batch_size=48)
    (shard,), (expected,), (fp32,) = (sorted(d.glob("shard_*.pt")) for d in
                                      (work / "data", tmp_path / "bf16_by_hand", tmp_path / "fp32"))
    shard, expected, fp32 = torch.load(shard), torch.load(expected), torch.load(fp32)
    for key in ("input_ids", "features", "final_hidden"):
        assert all(torch.equal(a, b) for a, b in zip(shard[key], expected[key])), key
    assert not all(torch.equal(a, b) for a, b in zip(shard["features"], fp32["features"])), \
        "the bf16 answers' features differ from fp32's: the flag reached the data stage"
    assert train_dflash.main(argv) == 2
    assert "data.data_precision" in capsys.readouterr().err


def test_heldout_tau_scores_drafters_on_conversations_no_data_stage_reaches(tmp_path, target_dir, capsys):
    """examples/heldout_tau.py: the held-out conversations are the tail of the data stage's
    order (disjoint from the head a budgeted run answers), and every drafter gets chat and
    code chain tau from the same cached answers."""
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    heldout = load_example("heldout_tau")
    conversations, is_code = heldout.heldout_conversations(0.6, 40)
    head, _ = heldout.heldout_conversations(0.6, 12117)
    assert {c.key for c in conversations} == {c.key for c in head[-40:]} and any(is_code) and not all(is_code)
    model, _ = load_target(target_dir, dtype=torch.float32)
    dirs = []
    for seed in (0, 1):
        dirs.append(tmp_path / f"d{seed}")
        save_dflash_drafter(tiny_drafter(model, block_size=4, seed=seed), dirs[-1], dtype=torch.float32)
    out = tmp_path / "heldout.json"
    argv = ["--target_model_dir", str(target_dir), "--work_dir", str(tmp_path / "w"), "--num_conversations", "6",
            "--max_new_tokens", "4", "--threads", "1", "--output_json", str(out),
            "--drafters", f"a={dirs[0]}", f"b={dirs[1]}"]
    assert heldout.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"a", "b"}
    for scores in results.values():
        assert sum(group["sequences"] for group in scores.values()) == 6
        assert all(1.0 <= group["chain_tau"] <= 4.0 for group in scores.values())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        heldout.main([*argv[:-3], "--drafters", "no_equals_sign"])
    assert exc.value.code == 2 and "--drafters: 'no_equals_sign' is not NAME=DIR" in capsys.readouterr().err


def test_extra_data_trains_on_both_work_dirs_and_refuses_another_target_layout(tmp_path, target_dir, train_dflash,
                                                                               capsys):
    """--extra_data: the earlier work dir's sequences join this one's in training, recorded in
    the fingerprint and the model card; a dir with other target layers is refused before the
    data stage, a path that is no work dir at parse time."""
    first = tmp_path / "built_in"
    assert train_dflash.main(["--target_model_dir", str(target_dir), "--num_prompts", "3", "--work_dir", str(first),
                              "--output_dir", str(tmp_path / "out_first"), "--chat_share", "0", *TINY]) == 0
    path = _write(tmp_path / "chats.jsonl", [SHAPES["openai"], {"prompt": "write code"}])
    second, out = tmp_path / "own", tmp_path / "out_both"
    argv = ["--target_model_dir", str(target_dir), "--dataset", str(path), "--work_dir", str(second),
            "--output_dir", str(out), "--extra_data", str(first), *TINY]
    capsys.readouterr()
    assert train_dflash.main(argv) == 0
    assert f"data: 2 sequences here + 3 from --extra_data {first.resolve()} (3)" in capsys.readouterr().out
    card = json.loads((out / "training_metrics.json").read_text())["data"]["extra_data"]
    recorded_first = json.loads((first / "fingerprint.json").read_text())
    answer_tokens = sum(int(s.loss_mask.sum()) for s in load_distillation_data(first / "data"))
    assert card == [{"work_dir": str(first.resolve()), "data": recorded_first["data"], "sequences": 3,
                     "answer_tokens": answer_tokens}]
    assert json.loads((second / "fingerprint.json").read_text())["drafter"]["extra_data"] == [
        {"work_dir": str(first.resolve()), "target": recorded_first["target"], "data": recorded_first["data"]}]

    other_layers = tmp_path / "three_layers"
    three = [*TINY[:TINY.index("--num_feature_layers")], *TINY[TINY.index("--num_feature_layers") + 2:],
             "--num_feature_layers", "3"]
    assert train_dflash.main(["--target_model_dir", str(target_dir), "--num_prompts", "2", "--chat_share", "0",
                              "--work_dir", str(other_layers), "--output_dir", str(tmp_path / "out3"), *three]) == 0
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert train_dflash.main([*argv[:argv.index("--work_dir")], "--work_dir", str(refused), "--output_dir",
                              str(tmp_path / "out_refused"), "--extra_data", str(other_layers), *TINY]) == 2
    err = capsys.readouterr().err
    assert f"--extra_data {str(other_layers)!r} holds the hidden states of target layers" in err
    assert not (refused / "data").exists()  # refused before the data stage
    for bad in (str(tmp_path), str(second)):
        with pytest.raises(SystemExit) as exit_info:
            train_dflash.main([*argv[:argv.index("--extra_data")], "--extra_data", bad, *TINY])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is not a train_dflash work dir" in err and "is --work_dir itself" in err
