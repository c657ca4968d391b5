"""IncrementalDetokenizer: streamed text concatenates to the final decode, for every way of
splitting the ids into pushes. Tokenizers: the embedded SmolLM2 one (byte-level BPE, clean-up of
tokenization spaces on) and a Llama-style byte-fallback SentencePiece BPE built here, offline."""

from __future__ import annotations

import random
import string
from functools import cache

import pytest

from tensorrt_llm_dflash import streaming
from tensorrt_llm_dflash.streaming import IncrementalDetokenizer

FFFD = "\ufffd"

TEXTS = {
    "emoji_run": "Party 🎉" + "🎉" * 12 + " done",
    "emoji": "Family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵🏳️‍🌈, skin 👍🏽👋🏿, hearts ❤️💔 and 🎉🔥✅ end 😀",
    "cjk": "你好，世界！今天天气很好。日本語のテキスト、カタカナ。한국어 문장입니다. 汉字 and ASCII 混合。",
    "accents": "Café crème, señor, smørbrød, naïve Ærø; combining: e\u0301 n\u0303 o\u0308 a\u030a. Über ß ø!",
    "code": 'def f(x):\n    if x > 0:\n        return "héllo 🎉"\n\treturn None\n\n\n  # 注释 done\nprint(f(1))  \n',
    "mixed": "I do n't know , he said . It 's 42 °C — très chaud 🔥 火 ! Ok ? x ' y ' . we 're done\n\n",
}


def byte_fallback_tokenizer(clean_up: bool):
    """A small Llama-style tokenizer: BPE with byte_fallback, a Metaspace pre-tokenizer, and the
    Replace / ByteFallback / Fuse / Strip decoder chain of Llama's tokenizer.json. Characters outside
    the vocabulary (emoji, most CJK, ø, newline, tab) are encoded as <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    chars = ["▁", *string.ascii_letters, *string.digits, *string.punctuation, "é", "ñ", "你", "好"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a"), ("e", "r"), ("o", "n"),
              ("▁", "d"), ("▁d", "o"), ("▁", "▁"), ("▁▁", "▁▁"), ("n", "'"), ("n'", "t")]  # fmt: skip
    pieces = specials + byte_tokens + chars + ["".join(m) for m in merges]
    assert len(set(pieces)) == len(pieces)
    model = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)},
        merges=merges,
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=clean_up,
    )


@cache
def _tokenizer(name: str):
    if name == "smollm2":
        from tensorrt_llm_dflash.target import load_tokenizer

        return load_tokenizer()
    return byte_fallback_tokenizer(clean_up=name == "byte_fallback_cleanup")


@pytest.fixture(scope="module")
def smollm2():
    return _tokenizer("smollm2")


@pytest.fixture(scope="module")
def byte_fallback():
    return _tokenizer("byte_fallback")


@pytest.fixture(scope="module", params=["smollm2", "byte_fallback", "byte_fallback_cleanup"])
def tok(request):
    return _tokenizer(request.param)


def chunkings(n: int, seeds: int = 20):
    """(name, chunk sizes) summing to n: one token at a time, everything at once, and random sizes."""
    yield "one_at_a_time", [1] * n
    yield "whole", [n]
    for seed in range(seeds):
        rng = random.Random(seed)
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.choice([1, 1, 2, 3, 4, 5, 8])))
            left -= sizes[-1]
        yield f"seed{seed}", sizes


def stream(tokenizer, ids, sizes, skip_special_tokens=True):
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces, start = [], 0
    for size in sizes:
        pieces.append(det.push(ids[start : start + size]))
        start += size
    pieces.append(det.flush())
    return pieces, det


def check_all_chunkings(tokenizer, ids, skip_special_tokens=True, seeds=20):
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    for name, sizes in chunkings(len(ids), seeds):
        pieces, det = stream(tokenizer, ids, sizes, skip_special_tokens)
        assert "".join(pieces) == expected, name
        assert not det.diverged, name
        if FFFD not in expected:
            assert not any(FFFD in p for p in pieces), (name, pieces)
    return expected


def old_rule(tokenizer, ids):
    """examples/run.py --streaming before this module: the new part of the full decode, sliced by the
    length of the previous decode."""
    streamed, out = [], []
    for t in ids:
        before = tokenizer.decode(streamed, skip_special_tokens=True)
        streamed.append(t)
        out.append(tokenizer.decode(streamed, skip_special_tokens=True)[len(before) :])
    return "".join(out)


def test_tokenizers_split_characters_across_tokens(smollm2, byte_fallback):
    # The premise of the tests: a prefix of the ids decodes to U+FFFD inside a character.
    for tokenizer in (smollm2, byte_fallback):
        ids = tokenizer.encode("🎉 你好世界", add_special_tokens=False)
        assert any(tokenizer.decode(ids[:k]).endswith(FFFD) for k in range(1, len(ids)))
    tokens = byte_fallback.convert_ids_to_tokens(byte_fallback.encode("a 🎉", add_special_tokens=False))
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    # The same for a character that only becomes undecodable again (ByteFallback decodes a run of byte
    # tokens as a whole): the next byte turns the finished "世" back into replacement characters.
    ids = byte_fallback.encode("世界", add_special_tokens=False)  # "▁", then 3 + 3 byte tokens
    assert byte_fallback.decode(ids[:4]) == "世"
    assert byte_fallback.decode(ids[:5]) == FFFD * 4


@pytest.mark.parametrize("text", list(TEXTS), ids=list(TEXTS))
def test_every_chunking_concatenates_to_decode(tok, text):
    ids = tok.encode(TEXTS[text], add_special_tokens=False)
    expected = check_all_chunkings(tok, ids)
    assert FFFD not in expected


def test_old_rule_loses_emoji_and_incremental_detokenizer_does_not(smollm2):
    ids = smollm2.encode(TEXTS["emoji_run"], add_special_tokens=False)
    expected = smollm2.decode(ids, skip_special_tokens=True)
    assert expected.count("🎉") == 13
    old = old_rule(smollm2, ids)
    assert old != expected
    assert "🎉" not in old and old.count(FFFD) == 13  # the defect: replacement characters, no emoji
    pieces, det = stream(smollm2, ids, [1] * len(ids))
    assert "".join(pieces) == expected and not det.diverged


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_mid_stream(tok, skip_special_tokens):
    def enc(s):
        return tok.encode(s, add_special_tokens=False)

    specials = [i for i in tok.all_special_ids if i != tok.unk_token_id]
    eos = tok.eos_token_id
    ids = enc("Hello 🎉 wor") + [eos] + enc("ld , 你好") + [eos, eos] + enc(" café") + specials * 6 + enc(" x 😀 .")
    expected = check_all_chunkings(tok, ids, skip_special_tokens, seeds=10)
    assert (tok.eos_token in expected) is not skip_special_tokens


def test_random_token_ids_smollm2(smollm2):
    # Any ids a model may emit, including invalid UTF-8 byte runs and special tokens.
    rng = random.Random(0)
    vocab = len(smollm2)
    for seed in range(8):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(20, 120))]
        for skip in (True, False):
            expected = smollm2.decode(ids, skip_special_tokens=skip)
            for name, sizes in chunkings(len(ids), seeds=4):
                pieces, det = stream(smollm2, ids, sizes, skip)
                assert "".join(pieces) == expected, (seed, skip, name)
                assert not det.diverged


def test_random_valid_streams_byte_fallback(byte_fallback):
    # Random vocabulary pieces mixed with the byte tokens of complete characters.
    rng = random.Random(1)
    plain = [i for i, p in enumerate(byte_fallback.convert_ids_to_tokens(range(len(byte_fallback))))
             if not p.startswith("<")]  # fmt: skip
    chars = "🎉😀👍🏽🇫🇷世界ø€\n\t "
    for _ in range(10):
        ids = []
        for _ in range(rng.randint(10, 60)):
            if rng.random() < 0.4:
                ids += byte_fallback.encode(rng.choice(chars), add_special_tokens=False)
            else:
                ids.append(rng.choice(plain))
        check_all_chunkings(byte_fallback, ids, seeds=4)


def test_text_already_returned_rewritten_sets_diverged(byte_fallback):
    # ByteFallback decodes a run of byte tokens as a whole: a stray continuation byte turns the
    # earlier "A B C" into replacement characters after "A B" was returned. No streamer can take
    # printed text back. flush returns the rest of the final text, and diverged says so.
    ids = byte_fallback.convert_tokens_to_ids(["<0x41>", "<0x20>", "<0x42>", "<0x20>", "<0x43>", "<0x80>"])
    det = IncrementalDetokenizer(byte_fallback)
    pieces = [det.push([i]) for i in ids]
    assert "".join(pieces) == "A B"
    assert det.diverged
    final = byte_fallback.decode(ids)
    assert final == FFFD * 6
    assert det.flush() == final[len("A B") :]
    assert det.diverged


def test_transient_divergence_recovers(byte_fallback):
    # "世" is returned, the first byte of "界" makes the decode "����" for a moment, and "界"
    # completes it: the stream continues and the total is exact.
    ids = byte_fallback.encode("世界 ok", add_special_tokens=False)
    det = IncrementalDetokenizer(byte_fallback)
    pieces = [det.push(ids[:4])]
    assert pieces == ["世"]
    pieces.append(det.push(ids[4:5]))
    assert pieces[-1] == "" and det.diverged
    pieces += [det.push(ids[5:7]), det.push(ids[7:]), det.flush()]
    assert not det.diverged and "".join(pieces) == "世界 ok"


def test_hold_back_rule(smollm2):
    det = IncrementalDetokenizer(smollm2)
    ids = smollm2.encode("I do n't", add_special_tokens=False)
    go = smollm2.encode(" go\n", add_special_tokens=False)
    *head, last = ids
    # " n" is held: where the tokenizer cleans up spaces (transformers 4.57 does, "I don't"; 5.x no
    # longer does, "I do n't") its space may vanish once "'t" arrives.
    assert det.push(head) == "I do"
    tail = det.push([last])
    assert tail in ("", "n't", " n't")
    tail += det.push(go)
    assert tail.endswith("'t go\n")  # a newline ends a line: nothing is held past it
    assert "I do" + tail == smollm2.decode(ids + go)
    assert det.push(smollm2.encode("你好", add_special_tokens=False)) == "你好"  # a complete non-ASCII char
    assert det.flush() == ""
    assert IncrementalDetokenizer(smollm2).flush() == "" and det.push([]) == ""


def test_decode_work_per_push_stays_bounded(smollm2):
    # A full decode per push is O(n^2) over a generation; the window keeps each decode short.
    lengths = []

    class Counting:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return smollm2.decode(ids, **kwargs)

    text = (TEXTS["mixed"] + TEXTS["code"] + TEXTS["accents"] + TEXTS["cjk"] + TEXTS["emoji"]) * 10
    ids = smollm2.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    det = IncrementalDetokenizer(Counting())
    pieces = [det.push([i]) for i in ids]
    full_decodes = sum(1 for n in lengths if n >= len(ids) // 4)
    pieces.append(det.flush())
    assert "".join(pieces) == smollm2.decode(ids, skip_special_tokens=True)
    assert sum(lengths) < 40 * len(ids)
    assert full_decodes < len(ids) // 20  # resyncs (clean-up removed a space) are rare


def test_long_run_of_skipped_special_tokens(byte_fallback):
    # 20 skipped tokens: the window's context decodes to nothing, so its first space cannot be told
    # from the one the Strip decoder drops from a first token; the detokenizer decodes it all instead.
    def enc(s):
        return byte_fallback.encode(s, add_special_tokens=False)

    eos = byte_fallback.eos_token_id
    ids = enc("a b") + [eos] * 20 + enc(" c d") + [eos] * 20 + enc("  e")
    assert byte_fallback.decode(ids, skip_special_tokens=True) == "a b c d  e"
    check_all_chunkings(byte_fallback, ids, seeds=10)


def test_byte_fallback_run_is_printed_character_by_character(byte_fallback):
    # Characters made of byte tokens are printed as each one completes, not at the end of the run:
    # the window start moves back to a character boundary.
    text = "世界汉字测试边界" * 3
    ids = byte_fallback.encode(text, add_special_tokens=False)
    tokens = byte_fallback.convert_ids_to_tokens(ids)
    assert tokens[0] == "▁" and all(t.startswith("<0x") for t in tokens[1:]) and len(ids) == 1 + 3 * len(text)
    det = IncrementalDetokenizer(byte_fallback)
    printed = det.push(ids[:1])
    for k in range(len(text)):
        printed += det.push(ids[1 + 3 * k : 4 + 3 * k])
        assert printed == text[: k + 1]
    assert det.flush() == ""


def test_window_inside_a_character_falls_back_to_full_decode(byte_fallback, monkeypatch):
    # With no back-off the window starts inside a byte run and decodes it as U+FFFD. The
    # replacement characters in the new text send the detokenizer to a full decode, which is exact.
    import tensorrt_llm_dflash.streaming as streaming

    monkeypatch.setattr(streaming, "_MAX_BACKOFF", 0)
    ids = byte_fallback.encode("世界汉字测试边界 ok " * 2, add_special_tokens=False)
    check_all_chunkings(byte_fallback, ids, seeds=4)


@pytest.mark.parametrize("text", ["https://example.com/" + "a1b2c3d4" * 40, "x=" + "QUJDREVGR0g=" * 30,
                                  "see https://example.com/" + "path/" * 60 + " done"])
def test_text_without_whitespace_streams_as_it_is_decoded(smollm2, text):
    """A URL, base64 or minified code has no whitespace: the last word was held back whole, so an answer of such
    text streamed nothing until it ended. At most _MAX_HELD_WORD characters are held now; the concatenation is
    still the full decode."""
    ids = smollm2.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(smollm2)
    returned = ""
    for i, token in enumerate(ids):
        returned += det.push([token])
        decoded = smollm2.decode(ids[: i + 1])
        assert len(decoded) - len(returned) <= streaming._MAX_HELD_WORD, (i, decoded, returned)
    assert returned + det.flush() == smollm2.decode(ids) and not det.diverged
    check_all_chunkings(smollm2, ids, seeds=5)
