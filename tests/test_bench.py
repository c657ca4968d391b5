"""The benchmark harness: prompt files, method parsing, the aggregation math, a tiny end-to-end run."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm_dflash import bench
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- prompt files


def test_jsonl_good_file_keeps_order_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "a"}', "", '{"prompt": "b", "extra": 1}', '{"prompt_ids": [5, 6]}'])
    prompts = bench.load_prompts(str(path))
    assert [(p.text, p.ids) for p in prompts] == [("a", None), ("b", None), (None, [5, 6])]
    assert [p.text for p in bench.load_prompts(str(path), num_prompts=2)] == ["a", "b"]


@pytest.mark.parametrize("bad, line_no, words", [
    ('{"prompt": "a", }', 3, "not valid JSON"),
    ('["prompt"]', 3, "expected a JSON object"),
    ('{"text": "a"}', 3, "no 'prompt' field"),
    ('{"prompt": 7}', 3, "non-empty string"),
    ('{"prompt_ids": [1, -2]}', 3, "prompt_ids"),
])
def test_jsonl_malformed_line_names_its_number(tmp_path, bad, line_no, words):
    path = write_lines(tmp_path, ['{"prompt": "ok"}', "", bad, '{"prompt": "after"}'])
    with pytest.raises(DFlashInputError) as err:
        bench.load_prompts(str(path))
    assert f"prompts.jsonl:{line_no}:" in str(err.value)
    assert words in str(err.value)


def test_dataset_errors(tmp_path):
    with pytest.raises(DFlashInputError, match="neither 'humaneval', 'chat' nor an existing"):
        bench.load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DFlashInputError, match="holds no prompts"):
        bench.load_prompts(str(write_lines(tmp_path, ["", ""])))
    with pytest.raises(DFlashInputError, match="num_prompts=0"):
        bench.load_prompts("humaneval", 0)


@pytest.mark.parametrize("encoding, name", [
    ("utf-16", "UTF-16 (little-endian)"),  # Python writes the byte-order mark
    ("utf-32", "UTF-32 (little-endian)"),
])
def test_jsonl_in_utf16_or_utf32_is_refused_by_name(tmp_path, encoding, name):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n', encoding=encoding)
    with pytest.raises(DFlashInputError) as err:  # was a raw UnicodeDecodeError
        bench.load_prompts(str(path))
    assert str(path) in str(err.value) and name in str(err.value) and "must be UTF-8" in str(err.value)


def test_jsonl_big_endian_utf16_and_bomless_utf16_are_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xfe\xff" + '{"prompt": "a"}\n'.encode("utf-16-be"))
    with pytest.raises(DFlashInputError, match=r"UTF-16 \(big-endian\)"):
        bench.load_prompts(str(path))
    # Without a byte-order mark, ASCII in UTF-16 is valid UTF-8 full of NUL bytes.
    path.write_bytes('{"prompt": "a"}\n{"prompt": "b"}\n'.encode("utf-16-le"))
    with pytest.raises(DFlashInputError) as err:
        bench.load_prompts(str(path))
    assert "prompts.jsonl:1:" in str(err.value) and "UTF-16 or UTF-32" in str(err.value)


def test_jsonl_not_utf8_names_the_line_and_byte(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DFlashInputError) as err:
        bench.load_prompts(str(path))
    message = str(err.value)
    assert "prompts.jsonl:2:" in message and "not valid UTF-8" in message and "0xe9" in message
    assert "column 16" in message


def test_jsonl_utf8_byte_order_mark_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9"}\r\n\r\n{"prompt_ids": [1]}\r\n'.encode("utf-8"))
    assert [(p.text, p.ids) for p in bench.load_prompts(str(path))] == [("caf\u00e9", None), (None, [1])]


def test_jsonl_directory_or_unreadable_file_is_a_named_error(tmp_path, monkeypatch):
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(DFlashInputError, match="is a directory"):
        bench.load_prompts(str(folder))
    (tmp_path / "readable").mkdir()
    path = write_lines(tmp_path / "readable", ['{"prompt": "a"}'])
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)  # as root, chmod 000 would not stop the read
    with pytest.raises(DFlashInputError) as err:
        bench.load_prompts(str(path))
    assert str(path) in str(err.value) and "cannot be read: Permission denied" in str(err.value)


def test_humaneval_first_prompts_in_file_order():
    prompts = bench.load_prompts("humaneval", 2)
    assert len(prompts) == 2
    assert "def has_close_elements" in prompts[0].text  # HumanEval/0
    assert "def separate_paren_groups" in prompts[1].text  # HumanEval/1


def test_encode_prompt_ids_pass_through_text_needs_a_tokenizer():
    assert bench.encode_prompt(None, bench.Prompt(ids=[3, 4]), chat_template=True) == [3, 4]
    with pytest.raises(bench.BenchError, match="tokenizer"):
        bench.encode_prompt(None, bench.Prompt(text="hi"), chat_template=True)


# ---------------------------------------------------------------------------- methods


def test_parse_methods():
    methods = bench.parse_methods(["ar", "hf,pld", "pld:4", "dflash", "ddtree:8", "ddtree:64"])
    assert [(m.kind, m.param, m.label) for m in methods] == [
        ("ar", None, "ar"), ("hf", None, "hf"), ("pld", bench.DEFAULT_PLD_TOKENS, "pld"), ("pld", 4, "pld:4"),
        ("dflash", None, "dflash"), ("ddtree", 8, "ddtree:8"), ("ddtree", 64, "ddtree:64"),
    ]
    assert bench.needs_drafter(methods) and not bench.needs_drafter(methods[:4])


@pytest.mark.parametrize("text, words", [
    ("ddtree", "needs a node budget"),
    ("ddtree:", "empty parameter"),
    ("ddtree:x", "must be an integer"),
    ("ddtree:-3", "out of range"),
    ("ddtree:5000", "out of range"),
    ("ddtree:0", "write dflash"),
    ("dflash:4", "takes no parameter"),
    ("pld:0", "1..256"),
    ("eagle", "unknown method"),
])
def test_parse_method_errors(text, words):
    with pytest.raises(DFlashInputError, match=words):
        bench.parse_method(text)


def test_duplicate_methods_are_refused():
    with pytest.raises(DFlashInputError, match="more than once"):
        bench.parse_methods(["ddtree:8", "ar", "ddtree:8"])
    with pytest.raises(DFlashInputError, match="more than once"):
        bench.parse_methods(["pld", f"pld:{bench.DEFAULT_PLD_TOKENS}"])


def test_registry_adds_a_method_in_a_few_lines(monkeypatch):
    # The shape a later drafter (e.g. lora_inject / lora_inject_ddtree:B) takes.
    monkeypatch.setitem(bench.METHOD_KINDS, "toy", bench.MethodKind(
        bench.run_runtime, bench.no_param("toy"), build_proposer=lambda ctx: None, budget_family="toy"))
    monkeypatch.setitem(bench.METHOD_KINDS, "toy_ddtree", bench.MethodKind(
        bench.run_runtime, bench.budget_param("toy_ddtree", "toy"), build_proposer=lambda ctx: None,
        budget=lambda m: m.param, budget_family="toy"))
    chain, tree = bench.parse_methods(["toy", "toy_ddtree:12"])
    assert (tree.kind, tree.param, chain.param) == ("toy_ddtree", 12, None)
    assert bench.needs_drafter([tree])
    assert {"toy", "toy_ddtree"} <= set(bench.method_syntax())
    with pytest.raises(DFlashInputError, match="write toy instead"):
        bench.parse_method("toy_ddtree:0")


# ---------------------------------------------------------------------------- aggregation


def record(index, tokens, seconds, taus, verify, draft=0.0, prefill=0.0):
    stages = dict.fromkeys(bench.STAGES, 0.0)
    stages.update(verify=verify, draft=draft, prefill=prefill)
    return bench.RequestRecord(index, list(range(tokens)), seconds, list(taus), stages)


def test_prompt_tau_spread_is_the_mean_and_standard_error_over_prompts():
    # Per-prompt taus 1.5 (from [1, 2]), 3.0 and 4.5 (one long prompt must not outweigh the others).
    records = [record(0, 3, 1.0, [1, 2], 0.5), record(1, 3, 1.0, [3], 0.5), record(2, 9, 1.0, [4, 5] * 5, 0.5)]
    mean, se = bench.prompt_tau_spread(records)
    assert mean == pytest.approx(3.0)
    assert se == pytest.approx(np.std([1.5, 3.0, 4.5], ddof=1) / np.sqrt(3)) and se == pytest.approx(0.866, abs=1e-3)
    with pytest.raises(bench.BenchError, match="at least 2 prompts"):
        bench.prompt_tau_spread([records[0], record(1, 0, 1.0, [], 0.0)])


def test_compare_runs_reports_change_and_z(tmp_path, capsys):
    import compare_runs

    def write(name, taus_per_prompt):
        rows = [dataclasses.asdict(record(i, 4, 1.0, taus, 0.5)) for i, taus in enumerate(taus_per_prompt)]
        path = tmp_path / name
        path.write_text(json.dumps({"per_prompt": {"ar": rows, "dflash": rows}}))
        return str(path)

    before = write("before.json", [[1, 1], [2, 2], [3, 3]])  # mean 2, se 1/sqrt(3)
    after = write("after.json", [[2, 2], [3, 3], [4, 4]])  # mean 3, same se
    assert compare_runs.main([before, after]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[2].startswith("| dflash |")  # ar is the baseline, not compared
    assert "| 2.00 +- 0.58 | 3.00 +- 0.58 | +1.00 | +1.2 |" in lines[2]  # z = 1 / hypot(0.577, 0.577)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:  # refused by argument: status 2, one line, no traceback
        compare_runs.main([str(tmp_path / "bad.json"), after])
    assert exit_info.value.code == 2 and "argument before: " in capsys.readouterr().err


def test_aggregation_math_on_hand_made_numbers():
    records = {
        "ar": [record(0, 10, 1.0, [1] * 9, 0.8), record(1, 10, 1.0, [1] * 9, 0.8)],
        "hf": [record(0, 10, 1.25, [1] * 9, 0.9), record(1, 10, 1.25, [1] * 9, 0.9)],
        "ddtree:8": [record(0, 10, 0.5, [3, 3, 3], 0.15, draft=0.2, prefill=0.05),
                     record(1, 10, 0.5, [2, 4], 0.10, draft=0.2, prefill=0.05)],
    }
    methods = bench.parse_methods(list(records))
    summary = bench.summarize(records, methods, greedy=False)
    assert summary["baseline"] == "ar"  # 10 tok/s beats hf's 8 tok/s
    tree = summary["methods"]["ddtree:8"]
    assert tree["tokens_per_second"] == pytest.approx(20.0)
    assert tree["tau_mean"] == pytest.approx(3.0)
    assert tree["tau_histogram"] == {2: 1, 3: 3, 4: 1}
    assert tree["speedup"] == pytest.approx(2.0)
    assert tree["verify_step_seconds"] == pytest.approx(0.05)
    assert tree["ideal_speedup"] == pytest.approx(3.0 * 0.1 / 0.05)  # tau x (AR s/token / verify s/step)
    assert tree["efficiency"] == pytest.approx(2.0 / 6.0)
    fractions = tree["stage_fractions"]
    assert fractions["draft"] == pytest.approx(0.4) and fractions["verify"] == pytest.approx(0.25)
    assert fractions["other"] == pytest.approx(1 - 0.4 - 0.25 - 0.1)
    assert sum(fractions.values()) == pytest.approx(1.0)
    assert summary["methods"]["hf"]["speedup"] == pytest.approx(0.8)
    # T > 0: this runtime's methods against its AR as a match rate (transformers' hf draws otherwise: unchecked).
    assert summary["sampled"] and summary["output_check"] == "match_rate" and summary["output_reference"] == "ar"
    assert tree["outputs_match"] is True and summary["methods"]["hf"]["outputs_match"] is None

    # Make hf the faster baseline: every speedup is now measured against it.
    for r in records["hf"]:
        r.seconds = 0.8
    summary = bench.summarize(records, methods, greedy=False)
    assert summary["baseline"] == "hf"
    assert summary["methods"]["ddtree:8"]["speedup"] == pytest.approx(20.0 / 12.5)
    assert summary["methods"]["ddtree:8"]["ideal_speedup"] == pytest.approx(3.0 * 0.08 / 0.05)


def brute_force_copyable(prompt, output, taus):
    tokens, flags, last = prompt + output, [], len(prompt)
    for tau in taus:
        if last >= len(tokens):
            break
        pair = (tokens[last - 1], tokens[last])
        flags.append(any((tokens[j], tokens[j + 1]) == pair for j in range(last - 1)))
        last += tau
    return flags


@pytest.mark.parametrize("seed", range(20))
def test_copyable_steps_match_a_brute_force_scan(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 4, size=int(rng.integers(1, 9))).tolist()
    taus = rng.integers(1, 5, size=int(rng.integers(1, 8))).tolist()
    output = rng.integers(0, 4, size=1 + sum(taus) - int(rng.integers(0, 3))).tolist()
    assert bench.copyable_steps(prompt, output, taus) == brute_force_copyable(prompt, output, taus)


def test_copyable_split_of_tau_on_a_hand_made_case():
    # Prompt "5 6 7"; output "5 6 9 9 9": step 0 ends at the first output 5 (bigram 7,5: new),
    # step 1 (after 2 tokens) at 9 (bigram 6,9: new), step 2 at the second 9 (9,9: new), step 3 at
    # the third 9 ((9,9) seen before).
    assert bench.copyable_steps([5, 6, 7], [5, 6, 9, 9, 9], [2, 1, 1, 1]) == [False, False, False, True]
    assert bench.copyable_steps([5, 6], [5, 6, 5], [2]) == [False]
    assert bench.copyable_steps([5, 6, 5], [6, 1], [1]) == [True]
    r = record(0, 6, 1.0, [1, 3, 2], 0.5)
    r.copyable = [True, False, True]
    summary = bench.summarize_method([r])
    assert summary["tau_copyable"] == pytest.approx(1.5) and summary["tau_elsewhere"] == pytest.approx(3.0)
    assert summary["copyable_step_fraction"] == pytest.approx(2 / 3)


def test_no_baseline_means_no_speedup():
    records = {"dflash": [record(0, 10, 1.0, [2] * 5, 0.5)]}
    summary = bench.summarize(records, bench.parse_methods(["dflash"]), greedy=True)
    assert summary["baseline"] is None and summary["methods"]["dflash"]["speedup"] is None
    assert summary["all_outputs_match"] is None  # nothing to compare with


def test_output_mismatch_is_recorded_and_reported_loudly():
    good = [record(0, 6, 1.0, [1] * 5, 0.5), record(1, 6, 1.0, [1] * 5, 0.5)]
    bad = [record(0, 6, 1.0, [2, 3], 0.5), record(1, 6, 1.0, [2, 3], 0.5)]
    bad[1].output_ids[4] = 99
    records = {"ar": good, "dflash": bad}
    summary = bench.summarize(records, bench.parse_methods(["ar", "dflash"]), greedy=True)
    assert summary["all_outputs_match"] is False
    assert summary["methods"]["ar"]["outputs_match"] is True
    assert summary["methods"]["dflash"]["mismatches"] == [
        {"prompt_index": 1, "first_difference": 4, "tokens": 6, "reference_tokens": 6}]
    (line,) = bench.mismatch_lines(summary)
    assert "MISMATCH" in line and "dflash" in line and "prompt 1" in line
    assert "Output check FAILED" in bench.results_markdown(summary, {}, [])


def mismatching_records():
    """ar and dflash agree on prompt 0; dflash differs on prompt 1 at token 4, ddtree:8 on both (at 2 and 4)."""
    good = [record(0, 6, 1.0, [1] * 5, 0.5), record(1, 6, 1.0, [1] * 5, 0.5)]
    chain = [record(0, 6, 1.0, [2, 3], 0.5), record(1, 6, 1.0, [2, 3], 0.5)]
    chain[1].output_ids[4] = 99
    tree = [record(0, 6, 1.0, [3, 2], 0.5), record(1, 6, 1.0, [3, 2], 0.5)]
    tree[0].output_ids[2] = 99
    tree[1].output_ids[4] = 99
    return {"ar": good, "dflash": chain, "ddtree:8": tree}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "bf16"])
def test_low_precision_reports_a_match_rate_not_a_failure(dtype):
    import torch

    records = mismatching_records()
    methods = bench.parse_methods(list(records))
    for given in (dtype, getattr(torch, bench.precision.canonical_dtype(dtype))):
        summary = bench.summarize(records, methods, greedy=True, dtype=given)
        assert summary["dtype"] == bench.precision.canonical_dtype(dtype)
        assert summary["output_check"] == "match_rate" and summary["output_reference"] == "ar"
        m = summary["methods"]
        assert (m["ar"]["match_rate"], m["dflash"]["match_rate"], m["ddtree:8"]["match_rate"]) == (1.0, 0.5, 0.0)
        assert m["ar"]["mean_first_difference"] is None
        assert m["dflash"]["mean_first_difference"] == 4.0 and m["ddtree:8"]["mean_first_difference"] == 3.0
        assert len(m["ddtree:8"]["mismatches"]) == 2  # the facts stay in results.json
        assert summary["all_outputs_match"] is False
        assert bench.mismatch_lines(summary) == []  # examples/benchmark.py exits 0
    markdown = bench.results_markdown(summary, {"config": {"dtype": summary["dtype"]}}, [])
    assert "FAILED" not in markdown and "**NO**" not in markdown
    assert "outputs = AR: match rate | mean first diff" in markdown
    assert "| 1/2 (50%) | 4.0 |" in markdown and "| 0/2 (0%) | 3.0 |" in markdown and "| 2/2 (100%) | - |" in markdown
    assert "not pass/fail" in markdown and "not guaranteed" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # header, rule and rows have the same columns


@pytest.mark.parametrize("dtype", ["float32", "float64", None])
def test_exact_dtypes_keep_the_pass_fail_check(dtype):
    records = mismatching_records()
    methods = bench.parse_methods(list(records))
    kwargs = {} if dtype is None else {"dtype": dtype}
    summary = bench.summarize(records, methods, greedy=True, **kwargs)  # the default is float32
    assert summary["output_check"] == "exact" and summary["dtype"] == (dtype or "float32")
    assert len(bench.mismatch_lines(summary)) == 3
    markdown = bench.results_markdown(summary, {}, [])
    assert "Output check FAILED" in markdown and "| **NO** |" in markdown and "match rate" not in markdown
    # A results.json written before output_check existed is still pass/fail.
    old = {k: v for k, v in summary.items() if k != "output_check"}
    assert len(bench.mismatch_lines(old)) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_is_checked_as_a_match_rate_in_every_dtype(dtype):
    """At T > 0 the draws are keyed by seed and index, so each method samples AR's tokens up to rounding, which can
    move a draw across a token's boundary in any dtype below float64's precision: a rate, never a failure."""
    records = mismatching_records()
    summary = bench.summarize(records, bench.parse_methods(list(records)), greedy=False, dtype=dtype)
    assert summary["output_check"] == "match_rate" and summary["all_outputs_match"] is False
    assert summary["methods"]["dflash"]["match_rate"] == 0.5 and summary["methods"]["ddtree:8"]["match_rate"] == 0
    assert bench.mismatch_lines(summary) == []
    markdown = bench.results_markdown(summary, {}, [])
    assert "keyed by the prompt's seed" in markdown and "| 1/2 (50%) | 4.0 |" in markdown
    # Without this runtime's AR in the run there is nothing to compare with (hf samples otherwise).
    records["hf"] = records.pop("ar")
    summary = bench.summarize(records, bench.parse_methods(list(records)), greedy=False, dtype=dtype)
    assert summary["output_check"] is None and summary["methods"]["dflash"]["match_rate"] is None
    assert "not applicable (no `ar` or `ar-graph` reference" in bench.results_markdown(summary, {}, [])


def test_summarize_refuses_an_unknown_dtype():
    records = mismatching_records()
    with pytest.raises(DFlashInputError, match="int8"):
        bench.summarize(records, bench.parse_methods(list(records)), greedy=True, dtype="int8")


@pytest.mark.parametrize("no_warmup, says, never", [
    (True, "No warm-up (--no_warmup)", "One warm-up prompt"),
    (False, "One warm-up prompt per method, untimed.", "No warm-up"),
])
def test_results_md_states_the_warmup_the_config_ran(no_warmup, says, never):
    records = {"ar": [record(0, 6, 1.0, [1] * 5, 0.5)]}
    summary = bench.summarize(records, bench.parse_methods(["ar"]), greedy=True)
    markdown = bench.results_markdown(summary, {"config": {"no_warmup": no_warmup, "dtype": "float32"}}, [])
    assert says in markdown and never not in markdown and "dtype float32" in markdown


# ---------------------------------------------------------------------------- precision statement


def test_precision_guarantee_per_dtype():
    import torch

    from tensorrt_llm_dflash import precision

    assert set(precision.EXACT_DTYPES) == {"float32", "float64"}
    assert set(precision.LOW_PRECISION_DTYPES) == {"float16", "bfloat16"}
    for name in precision.EXACT_DTYPES:
        line = precision.guarantee(name)
        assert "\n" not in line and name in line and "equals the target's own greedy output" in line
        assert precision.is_exact(name) and precision.low_precision_warning(name, speculative=True) is None
    for name in precision.LOW_PRECISION_DTYPES:
        line = precision.guarantee(name)
        assert "\n" not in line and "not guaranteed" in line and "near" in line
        assert not precision.is_exact(name)
        warning = precision.low_precision_warning(name, speculative=True)
        assert warning.startswith("warning:") and f"--dtype {name}" in warning and "float32" in warning
        assert "\n" not in warning
        assert precision.low_precision_warning(name, speculative=False) is None  # AR is its own reference
    assert precision.canonical_dtype(torch.bfloat16) == precision.canonical_dtype("bf16") == "bfloat16"
    assert precision.canonical_dtype("torch.float16") == precision.canonical_dtype("half") == "float16"
    assert precision.guarantee(torch.float32) == precision.guarantee("fp32")
    with pytest.raises(DFlashInputError, match="int8"):
        precision.guarantee("int8")


def test_readme_states_the_dtype_caveat():
    from tensorrt_llm_dflash import precision

    readme = (ROOT / "README.md").read_text()
    assert "Exactness by dtype" in readme and "bfloat16" in readme
    assert "tensorrt_llm_dflash/precision.py" in readme
    assert precision.__doc__ and "Can bf16 verification be made exact" in precision.__doc__


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_pair():
    from tiny_models import tiny_drafter, tiny_target

    target = tiny_target("qwen3", seed=3, vocab=48, layers=4, hidden=32)
    return target, tiny_drafter(target, block_size=4, seed=3)


def tiny_prompts(tmp_path: Path) -> list[list[int]]:
    path = write_lines(tmp_path, [json.dumps({"prompt_ids": [2, 7, 9, 4, 7, 9, 4, 11]}),
                                  json.dumps({"prompt_ids": [5, 6, 5, 6, 5, 6]})])
    return [bench.encode_prompt(None, p, chat_template=True) for p in bench.load_prompts(str(path))]


class OracleByPrompt:
    """A proposer that knows each prompt's greedy continuation (noisy, top-2 fallback).

    The random tiny drafter accepts almost nothing; this one makes the run commit several
    tokens per step (KV compaction, tau > 1) through a method registered like any other.
    The first context after ``reset`` is the prompt, identified by its length.
    """

    block_size, target_layer_ids = 4, [1]

    def __init__(self, sequences: dict[int, list[int]], vocab: int) -> None:
        from tiny_models import NoisyOracleProposer

        self.by_length = {n: NoisyOracleProposer(seq, self.block_size, vocab, noise=0.3) for n, seq in sequences.items()}
        self.current = None

    def reset(self) -> None:
        self.current = None

    def propose(self, root_token, new_context):
        if self.current is None:
            self.current = self.by_length[int(new_context.shape[0])]
            self.current.reset()
        return self.current.propose(root_token, new_context)


def test_tiny_end_to_end_greedy(tiny_pair, tmp_path, monkeypatch):
    from tiny_models import hf_greedy

    target, drafter = tiny_pair
    prompts = tiny_prompts(tmp_path)
    oracle = OracleByPrompt({len(p): p + hf_greedy(target, p, 16) for p in prompts}, target.config.vocab_size)
    monkeypatch.setitem(bench.METHOD_KINDS, "oracle_ddtree", bench.MethodKind(
        bench.run_runtime, bench.budget_param("oracle_ddtree", "none"), build_proposer=lambda ctx: oracle,
        budget=lambda m: m.param, budget_family="oracle"))
    methods = bench.parse_methods(["ar", "hf", "pld:3", "dflash", "ddtree:4", "ddtree:8", "oracle_ddtree:6"])
    ctx = bench.BenchContext(target, 12, SamplingParams(), drafter=drafter)
    records = bench.run_benchmark(ctx, methods, prompts, progress=False)
    summary = bench.summarize(records, methods, greedy=True)
    assert summary["output_reference"] == "ar"
    assert summary["all_outputs_match"] is True, bench.mismatch_lines(summary)
    assert summary["baseline"] in ("ar", "hf")
    for label, s in summary["methods"].items():
        assert s["prompts"] == 2 and s["new_tokens"] == 24, label  # warm-up excluded, no EOS
        # Every committed token but the prompt forward's is in one tau sample.
        rows = records[label]
        assert sum(s["tau_histogram"].values()) == s["target_steps"]
        first = [r.new_tokens - sum(r.acceptance_lengths) for r in rows]
        assert all(f >= 1 for f in first), label
        if label != "pld:3":
            assert first == [1, 1], label  # only pld may commit several tokens in the prompt forward
    for label in ("ar", "hf"):
        assert summary["methods"][label]["tau_histogram"] == {1: 22}
        assert summary["methods"][label]["mean_tree_size"] == 1.0
    assert 1.0 < summary["methods"]["ddtree:8"]["mean_tree_size"] <= 9.0
    assert 3.0 < summary["methods"]["dflash"]["mean_tree_size"] <= 4.0  # root + up to 3 drafted (fewer at the end)
    pld = records["pld:3"]
    assert all(len(r.tree_sizes) == len(r.acceptance_lengths) for r in pld)
    assert all(1 <= a <= n <= 4 for r in pld for a, n in zip(r.acceptance_lengths, r.tree_sizes))
    assert summary["methods"]["oracle_ddtree:6"]["tau_mean"] > 2.0  # multi-token commits were checked
    for label in ("dflash", "ddtree:4", "ddtree:8"):
        s = summary["methods"][label]
        assert s["stage_seconds"]["draft"] > 0 and s["stage_seconds"]["verify"] > 0
        assert s["ideal_speedup"] > 0 and s["efficiency"] > 0

    run_info = {"command": "python examples/benchmark.py (test)", "machine": bench.machine_info(),
                "config": {"dataset": "tiny", "num_prompts": 2}}
    written = bench.write_results(tmp_path / "out", summary, records, run_info)
    names = {p.name for p in written}
    assert names == {"results.json", "results.md", "speedup_tau_vs_budget.png", "tau_histogram.png",
                     "stage_breakdown.png"}
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = bench.read_results(tmp_path / "out" / "results.json")
    assert doc["all_outputs_match"] is True
    assert doc["machine"]["torch"] and doc["command"].startswith("python examples/benchmark.py")
    assert [r["output_ids"] for r in doc["per_prompt"]["ddtree:8"]] == [r.output_ids for r in records["ar"]]
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| ddtree:8 |" in markdown and "every output equals `ar`" in markdown
    assert "![tau_histogram](tau_histogram.png)" in markdown


def test_tiny_sampling_is_seeded_and_samples_ars_tokens(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    methods = bench.parse_methods(["ar", "hf", "pld:3", "ddtree:4"])
    ctx = bench.BenchContext(target, 10, SamplingParams(temperature=1.0, top_k=20), drafter=drafter)
    prompts = tiny_prompts(tmp_path)
    first = bench.run_benchmark(ctx, methods, prompts, seed=5, warmup=False, progress=False)
    again = bench.run_benchmark(ctx, methods, prompts, seed=5, warmup=False, progress=False)
    for label in first:
        assert [r.output_ids for r in first[label]] == [r.output_ids for r in again[label]], label
    summary = bench.summarize(first, methods, greedy=False)
    # float64: ddtree:4 samples ar's own tokens for each prompt's seed; transformers' methods are not compared.
    assert summary["all_outputs_match"] is True and summary["methods"]["ddtree:4"]["outputs_match"] is True
    assert summary["methods"]["hf"]["outputs_match"] is None and summary["methods"]["pld:3"]["outputs_match"] is None
    assert len({tuple(r.output_ids) for r in first["ar"]}) > 1


def small_results(tmp_path):
    records = {"ar": [record(0, 6, 1.0, [1] * 5, 0.5)], "ddtree:8": [record(0, 6, 0.5, [2, 3], 0.2)]}
    summary = bench.summarize(records, bench.parse_methods(list(records)), greedy=True)
    return summary, records, {"command": "test", "config": {"no_warmup": False}}


def test_write_results_replaces_each_file_by_rename(tmp_path):
    import os

    summary, records, run_info = small_results(tmp_path)
    out = tmp_path / "out"
    first = bench.write_results(out, summary, records, run_info)
    inodes = {p.name: os.stat(p).st_ino for p in first}
    again = bench.write_results(out, summary, records, run_info)
    assert [p.name for p in again] == [p.name for p in first]
    for p in again:  # a new file renamed into place, not the old one rewritten
        assert os.stat(p).st_ino != inodes[p.name], p.name
    assert sorted(p.name for p in out.iterdir()) == sorted(inodes)  # no temporaries left
    assert again[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_kill_while_writing_results_leaves_the_previous_file(tmp_path, monkeypatch):
    from tensorrt_llm_dflash import files

    summary, records, run_info = small_results(tmp_path)
    out = tmp_path / "out"
    bench.write_results(out, summary, records, run_info)
    before = (out / "results.md").read_text()
    real = files._write_stream

    def killed(f, write):
        if ".results.md" in Path(f.name).name:
            f.write("# half a fi")
            raise KeyboardInterrupt
        real(f, write)

    monkeypatch.setattr(files, "_write_stream", killed)
    run_info["command"] = "the second run"
    with pytest.raises(KeyboardInterrupt):
        bench.write_results(out, summary, records, run_info)
    assert (out / "results.md").read_text() == before
    assert json.loads((out / "results.json").read_text())["command"] == "the second run"  # written before the kill
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_tiny_end_to_end_in_bfloat16_reports_match_rates(tiny_pair, tmp_path):
    import copy

    import torch

    target, drafter = (copy.deepcopy(m).to(torch.bfloat16) for m in tiny_pair)
    methods = bench.parse_methods(["ar", "dflash", "ddtree:8"])
    ctx = bench.BenchContext(target, 12, SamplingParams(), drafter=drafter)
    records = bench.run_benchmark(ctx, methods, tiny_prompts(tmp_path), warmup=False, progress=False)
    summary = bench.summarize(records, methods, greedy=True, dtype=target.dtype)
    assert summary["dtype"] == "bfloat16" and summary["output_check"] == "match_rate"
    assert summary["methods"]["ar"]["match_rate"] == 1.0
    for label in ("dflash", "ddtree:8"):
        s = summary["methods"][label]
        assert s["match_rate"] == 1 - len(s["mismatches"]) / 2
    assert bench.mismatch_lines(summary) == []
    run_info = {"command": "test", "config": {"dtype": "bfloat16", "no_warmup": True}}
    bench.write_results(tmp_path / "out", summary, records, run_info)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["output_check"] == "match_rate" and "not guaranteed" in doc["output_guarantee"]
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| ar |" in markdown and "(100%) | - |" in markdown and "No warm-up" in markdown


# ---------------------------------------------------------------------------- CLI


def test_cli_rejects_bad_input_before_loading_models(tmp_path, capsys):
    import benchmark

    with pytest.raises(SystemExit) as exit_:  # refused by the argument parser
        benchmark.main(["--methods", "ar", "ddtree:-1", "--output_dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "argument --methods" in (err := capsys.readouterr().err) and "ddtree:-1" in err
    bad = write_lines(tmp_path, ['{"prompt": "ok"}', "{oops"])
    assert benchmark.main(["--dataset", str(bad), "--methods", "ar", "--output_dir", str(tmp_path)]) == 2
    assert "prompts.jsonl:2:" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_cli_explains_how_to_get_a_drafter(tmp_path, capsys, monkeypatch):
    import benchmark

    import tensorrt_llm_dflash.assets as assets

    monkeypatch.setattr(assets, "demo_drafter_dir", lambda: None)
    assert benchmark.main(["--methods", "ar", "dflash", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train one with" in err and "train_dflash.py" in err
    assert benchmark.main(["--target_model_dir", str(tmp_path), "--methods", "dflash"]) == 2
    assert "--draft_model_dir is required" in capsys.readouterr().err


def save_tiny_target_dir(target, path: Path) -> Path:
    """A loadable target directory: weights, config and a word-level tokenizer with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(target.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w2", pad_token="w0")
    fast.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                          "{% if add_generation_prompt %}w5{% endif %}")
    target.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_cli_end_to_end_on_tiny_model_dirs(tiny_pair, tmp_path, capsys):
    import benchmark

    from tensorrt_llm_dflash.drafter import save_dflash_drafter

    target, drafter = tiny_pair
    target_dir = save_tiny_target_dir(target, tmp_path / "target")
    save_dflash_drafter(drafter, tmp_path / "drafter", dtype=target.dtype)
    data = write_lines(tmp_path, [json.dumps({"prompt": "w7 w9 w4 w7 w9 w4"}), json.dumps({"prompt": "w6 w8"}),
                                  json.dumps({"prompt": "never used"})])
    out = tmp_path / "out"
    argv = ["--dataset", str(data), "--num_prompts", "2", "--max_output_len", "8", "--dtype", "float64",
            "--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "drafter"),
            "--methods", "ar", "hf", "pld", "dflash", "ddtree:4", "--no_progress", "--output_dir", str(out)]
    assert benchmark.main(argv) == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["all_outputs_match"] is True and doc["output_reference"] == "ar"
    assert doc["config"]["chat_template"] is True
    assert doc["config"]["prompt_tokens"] == [9, 5]  # "w3 <prompt> w4 w5": the template was applied
    assert doc["command"] == "python examples/benchmark.py " + " ".join(argv)
    assert list(doc["methods"]) == ["ar", "hf", "pld", "dflash", "ddtree:4"]
    assert all(m["new_tokens"] == 16 for m in doc["methods"].values())
    assert "| ddtree:4 |" in capsys.readouterr().out


def test_default_and_auto_methods_run_the_cost_aware_tree(tiny_pair, tmp_path, monkeypatch):
    """``default`` is run.py's default (the cost-aware tree with lookup branches): lossless,
    and the report says what it resolved to, what it predicted and chose."""
    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))
    target, drafter = tiny_pair
    prompts = tiny_prompts(tmp_path)
    methods = bench.parse_methods(["ar", "default", "auto:4"])
    assert [m.param for m in methods] == [None, None, 4]
    ctx = bench.BenchContext(target, 12, SamplingParams(), drafter=drafter)
    records = bench.run_benchmark(ctx, methods, prompts, progress=False)
    summary = bench.summarize(records, methods, greedy=True)
    assert summary["all_outputs_match"] is True, bench.mismatch_lines(summary)
    default = summary["methods"]["default"]
    assert "cost-aware DDTree" in default["resolves_to"] and "run.py" in default["resolves_to"]
    assert default["predicted_decode_tokens_per_second"] > 0 and default["measured_decode_tokens_per_second"] > 0
    assert sum(default["chosen_nodes_histogram"].values()) == default["target_steps"]
    assert 0 <= default["lookup_token_share"] <= 1 and 0 < default["drafted_step_share"] <= 1
    assert max(summary["methods"]["auto:4"]["chosen_nodes_histogram"]) <= 4
    assert "drafted_step_share" not in summary["methods"]["ar"]
    markdown = bench.results_markdown(summary, {"config": {}}, [])
    assert "| default | cost-aware DDTree" in markdown and "predicted tok/s" in markdown
    assert list((tmp_path / "cache" / "costs").glob("*.json")), "the cost curve is cached"
    for bad in ("default:3", "auto:0", "auto:x"):
        with pytest.raises(DFlashInputError):
            bench.parse_methods([bad])


def test_tau_by_category_groups_steps_by_the_prompt_category():
    rows = [bench.RequestRecord(0, [1, 2, 3], 1.0, [1, 3], {}), bench.RequestRecord(1, [4], 1.0, [2], {}),
            bench.RequestRecord(2, [5], 1.0, [4], {})]
    assert bench.tau_by_category(rows, ["story", "poem", "story"]) == {"poem": 2.0, "story": 8 / 3}
    assert bench.tau_by_category(rows, [None, None, None]) == {}


@pytest.mark.parametrize("dtype,exit_code", [("bfloat16", 0), ("float16", 0), ("float32", 1)])
def test_cli_exit_code_follows_the_dtype_rule(tiny_pair, tmp_path, monkeypatch, capsys, dtype, exit_code):
    """A T=0 output that differs from AR fails the run (exit 1) only where equality is guaranteed
    (float32/float64); in bf16/fp16 it is reported as a match rate and the run succeeds."""
    import benchmark
    import torch

    from tensorrt_llm_dflash.drafter import save_dflash_drafter

    target, drafter = tiny_pair
    target_dir = save_tiny_target_dir(target, tmp_path / "target")
    save_dflash_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    data = write_lines(tmp_path, [json.dumps({"prompt": "w7 w9 w4 w7 w9 w4"}), json.dumps({"prompt": "w6 w8"})])
    real = bench.run_benchmark

    def one_output_differs(*args, **kwargs):
        records = real(*args, **kwargs)
        first = records["dflash"][0]
        first.output_ids[-1] = (first.output_ids[-1] + 1) % target.config.vocab_size  # forced, deterministic
        return records

    monkeypatch.setattr(bench, "run_benchmark", one_output_differs)
    out = tmp_path / "out"
    argv = ["--dataset", str(data), "--num_prompts", "2", "--max_output_len", "6", "--dtype", dtype,
            "--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "drafter"),
            "--methods", "ar", "dflash", "--no_progress", "--no_warmup", "--output_dir", str(out)]
    assert benchmark.main(argv) == exit_code
    err = capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["methods"]["dflash"]["match_rate"] == 0.5
    assert ("OUTPUT MISMATCH" in err) == (exit_code == 1)


def test_hf_static_baseline_is_never_compiled(tiny_pair):
    """transformers compiles a static-cache generate with mode="reduce-overhead" wherever its rule says
    so (CUDA by default): minutes, and on an H100 it failed. hf-static is transformers' static cache,
    uncompiled; the CUDA-graph baseline is the project's ar-graph."""
    from transformers import StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    target, _ = tiny_pair
    ctx = bench.BenchContext(target, 8, SamplingParams())
    config = bench.transformers_generation_config(ctx, bench.parse_methods(["hf-static"])[0])
    assert config.cache_implementation == "static" and config.disable_compile is True
    # transformers' own rule, made to say "compile" on this CPU as it does on CUDA: still not compiled.
    config.compile_config = CompileConfig()
    config.compile_config._compile_all_devices = True
    cache = StaticCache(config=target.config, max_cache_len=16)
    kwargs = {"cache": cache, "past_key_values": cache}
    assert target._valid_auto_compile_criteria(kwargs, config) is False
    config.disable_compile = False  # the same call without the setting would compile: the check can fail
    assert target._valid_auto_compile_criteria(kwargs, config) is True
    # The other transformers baselines keep their dynamic cache.
    assert bench.transformers_generation_config(ctx, bench.parse_methods(["hf"])[0]).cache_implementation is None


def test_results_pack_the_per_prompt_records_and_read_back(tiny_pair, tmp_path):
    """results.json keeps its summary as plain JSON and the per-prompt records gzip-packed (a tenth of
    the size); read_results restores them, and runs written before packing still read."""
    target, drafter = tiny_pair
    methods = bench.parse_methods(["ar", "dflash"])
    ctx = bench.BenchContext(target, 8, SamplingParams(), drafter=drafter)
    records = bench.run_benchmark(ctx, methods, tiny_prompts(tmp_path), warmup=False, progress=False)
    summary = bench.summarize(records, methods, greedy=True)
    bench.write_results(tmp_path / "out", summary, records, {"command": "test", "config": {}})
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "per_prompt" not in on_disk and on_disk["methods"]["dflash"]["outputs_match"] is True
    doc = bench.read_results(tmp_path / "out" / "results.json")
    assert doc["per_prompt"] == json.loads(json.dumps({k: [dataclasses.asdict(r) for r in v]
                                                       for k, v in records.items()}))
    assert bench.read_records(tmp_path / "out" / "results.json") == records
    plain = {**{k: v for k, v in on_disk.items() if k != bench.PER_PROMPT_PACKED}, "per_prompt": doc["per_prompt"]}
    (tmp_path / "old.json").write_text(json.dumps(plain))
    assert bench.read_records(tmp_path / "old.json") == records
    on_disk[bench.PER_PROMPT_PACKED] = on_disk[bench.PER_PROMPT_PACKED][:-8]  # truncated: refused by name
    (tmp_path / "bad.json").write_text(json.dumps(on_disk))
    with pytest.raises(DFlashInputError, match="bad.json: not a results.json"):
        bench.read_results(tmp_path / "bad.json")


def test_committed_benchmark_records_read():
    """Every results.json under benchmarks/ reads, records and all (the README's numbers come from them)."""
    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*/results.json"))
    assert files
    for path in files:
        records = bench.read_records(path)
        assert records and all(rows for rows in records.values()), path


def test_cli_benchmarks_a_dflash2_drafter(tiny_pair, tmp_path, capsys):
    """examples/benchmark.py loads a DFlash2 drafter directory (z-lab layout) like a DFlash one: the chain is
    the selector's greedy chain, ddtree:B the DFlash2 tree, and every float64 output equals AR."""
    import benchmark
    from tiny_models import tiny_dflash2_drafter

    from tensorrt_llm_dflash.dflash2.loader import save_dflash2_drafter

    target, _ = tiny_pair
    target_dir = save_tiny_target_dir(target, tmp_path / "target")
    save_dflash2_drafter(tiny_dflash2_drafter(target, block_size=4, seed=1), tmp_path / "drafter",
                         dtype=target.dtype)
    data = write_lines(tmp_path, [json.dumps({"prompt": "w7 w9 w4 w7 w9 w4"}), json.dumps({"prompt": "w6 w8"})])
    out = tmp_path / "out"
    argv = ["--dataset", str(data), "--num_prompts", "2", "--max_output_len", "8", "--dtype", "float64",
            "--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "drafter"),
            "--methods", "ar", "dflash", "ddtree:4", "--no_progress", "--no_warmup", "--output_dir", str(out)]
    assert benchmark.main(argv) == 0, capsys.readouterr().err
    doc = bench.read_results(out / "results.json")
    assert doc["all_outputs_match"] is True and doc["output_reference"] == "ar"
    assert all(m["new_tokens"] == 16 for m in doc["methods"].values())


def test_default_runs_what_run_py_runs_on_each_device(monkeypatch):
    """``default`` is run.py's default: the graphed cost-aware tree on CUDA, the eager one elsewhere."""
    import types

    import torch

    calls: list[str] = []
    monkeypatch.setattr(bench, "run_graphed", lambda ctx, method, prompt, seed: calls.append("graphed"))
    monkeypatch.setattr(bench, "run_runtime", lambda ctx, method, prompt, seed: calls.append("eager"))
    for kind in ("cuda", "cpu"):
        bench.run_default(types.SimpleNamespace(model=types.SimpleNamespace(device=torch.device(kind))), None, [1], 0)
    assert calls == ["graphed", "eager"]


def test_auto_graph_reports_drafted_steps_and_lookup_tokens(tiny_pair, tmp_path, monkeypatch):
    """The graphed cost-aware tree's records carry what the eager one's do: which steps drafted, lookup-only tokens.
    Its step costs are flat here (trees pay), so steps draft whatever this machine's timing: on measured costs a
    tiny target can make AR win, and after a probe that loses the next one is up to 64 steps away."""
    from tensorrt_llm_dflash import graphed

    class FlatCosts(graphed.GraphedDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "policy_costs": lambda bucket, size: 1.0 + 1e-3 * size,
                                       "refine_costs": False})

    monkeypatch.setattr(graphed, "GraphedDecoder", FlatCosts)
    target, drafter = tiny_pair
    methods = bench.parse_methods(["ar", "auto-graph"])
    ctx = bench.BenchContext(target, 12, SamplingParams(), drafter=drafter)
    records = bench.run_benchmark(ctx, methods, tiny_prompts(tmp_path), progress=False)
    summary = bench.summarize(records, methods, greedy=True)
    assert summary["all_outputs_match"] is True, bench.mismatch_lines(summary)
    auto = summary["methods"]["auto-graph"]
    assert 0 < auto["drafted_step_share"] <= 1 and 0 <= auto["lookup_token_share"] <= 1
    assert all(len(r.drafted) == len(r.acceptance_lengths) for r in records["auto-graph"])


# ---------------------------------------------------------------------------- LoRA-inject, paths, --help


def test_lora_inject_methods_need_no_dflash_drafter(tmp_path, capsys, monkeypatch):
    """--methods ar lora_inject with a target of one's own and --lora_inject_dir (docs/lora_inject.md): the adapter is
    the drafter, so no --draft_model_dir is asked for and no DFlash drafter is loaded or recorded; one given anyway
    is refused as unused."""
    import benchmark
    from tiny_models import tiny_target

    from tensorrt_llm_dflash.lora_inject import DFlashLoRAInjectDraftModel, LoRAInjectConfig

    monkeypatch.setattr(bench, "METHOD_KINDS", dict(bench.METHOD_KINDS))  # --lora_inject_dir registers methods
    target = tiny_target("qwen3", seed=3, vocab=48, layers=4, hidden=32)
    target_dir = save_tiny_target_dir(target, tmp_path / "target")
    config = LoRAInjectConfig.for_target(target, 4, 47, lora_rank=4, lora_alpha=8.0)
    DFlashLoRAInjectDraftModel(target, config).save_pretrained(tmp_path / "adapter")
    data = write_lines(tmp_path, [json.dumps({"prompt": "w7 w9 w4 w7 w9 w4"})])
    out = tmp_path / "out"
    argv = ["--dataset", str(data), "--num_prompts", "1", "--max_output_len", "4", "--target_model_dir",
            str(target_dir), "--lora_inject_dir", str(tmp_path / "adapter"), "--methods", "ar", "lora_inject",
            "--no_progress", "--no_warmup", "--output_dir", str(out)]
    assert benchmark.main(argv) == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["drafter"] is None and doc["all_outputs_match"] is True
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args([*argv, "--draft_model_dir", str(tmp_path / "adapter")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --draft_model_dir: no method given drafts with it" in err, err


def test_results_store_absolute_paths_so_copy_split_works_from_anywhere(tiny_pair, tmp_path, capsys, monkeypatch):
    """Paths typed relative to the run's directory are stored absolute in results.json's config (the command keeps
    them as typed), so copy_split.py finds the tokenizer and prompts from another directory."""
    import benchmark
    from example_cli import load_example

    from tensorrt_llm_dflash.drafter import save_dflash_drafter

    target, drafter = tiny_pair
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_tiny_target_dir(target, run_dir / "target")
    save_dflash_drafter(drafter, run_dir / "drafter", dtype=target.dtype)
    write_lines(run_dir, [json.dumps({"prompt": "w7 w9 w4 w7 w9 w4"}), json.dumps({"prompt": "w6 w8"})])
    monkeypatch.chdir(run_dir)
    argv = ["--dataset", "prompts.jsonl", "--num_prompts", "2", "--max_output_len", "4", "--dtype", "float64",
            "--target_model_dir", "target", "--draft_model_dir", "drafter", "--methods", "ar", "dflash",
            "--no_progress", "--no_warmup", "--output_dir", "out"]
    assert benchmark.main(argv) == 0, capsys.readouterr().err
    doc = json.loads((run_dir / "out" / "results.json").read_text())
    config = doc["config"]
    assert config["dataset"] == str(run_dir / "prompts.jsonl") and config["target_model_dir"] == str(run_dir / "target")
    assert config["draft_model_dir"] == config["drafter"] == str(run_dir / "drafter")
    assert config["target"] == str(run_dir / "target") and config["output_dir"] == str(run_dir / "out")
    assert doc["command"] == "python examples/benchmark.py " + " ".join(argv)  # as typed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert load_example("copy_split").main([str(run_dir / "out" / "results.json")]) == 0
    assert "| dflash |" in capsys.readouterr().out


def test_help_shows_the_gpu_command_apart_from_the_prose(capsys):
    """The docstring's 'On a GPU' command ends on its own line (a bare backslash at a line's end in a non-raw
    docstring joined it with the next sentence)."""
    import benchmark

    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    command = next(i for i, line in enumerate(lines) if line.startswith("python examples/benchmark.py --device cuda"))
    assert lines[command].endswith("\\") and lines[command + 1] == ("dflash-graph ddtree-graph:16 ddtree-graph:32 "
                                                                     "--output_dir bench/gpu")
