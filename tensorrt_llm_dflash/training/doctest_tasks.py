"""Code-completion prompts in HumanEval's *format*, on tasks that are not HumanEval's.

HumanEval prompts are a ``typing`` import, a type-annotated ``def`` line and a docstring
with ``>>>`` examples. A target answering one usually restates that code and then echoes
the examples (``print(f([1.0, 2.0], 0.5))``): long stretches that copy the prompt. The
stdlib prompts in :mod:`.prompts` have real signatures and docs but no typed signatures and
no examples, so a drafter trained only on them sees little of that copying.

Each task here is a small, hand-written function with its own description and a reference
implementation; the examples in a prompt are random inputs *run through that
implementation*, so every ``>>>`` line is correct (the tests run each prompt as a doctest).
The tasks were chosen to avoid HumanEval's 164 problems: different names (checked by
:func:`.prompts.check_no_overlap`) and different behaviour (none computes what a HumanEval
problem computes).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lamp", "code", "green", "north", "music", "paper",
         "quiet", "storm", "bread", "light", "ocean", "pixel", "table", "zebra", "honey", "sun", "map", "key"]


def _ints(rng: random.Random, low: int = -9, high: int = 20, max_len: int = 7) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(0, max_len))]


def _words(rng: random.Random, max_len: int = 5) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(0, max_len))]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def _mixed_text(rng: random.Random) -> str:
    pool = string.ascii_letters[:8] + string.digits[:5] + " ,.!?"
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))


def _counts(rng: random.Random) -> dict[str, int]:
    return {w: rng.randint(0, 5) for w in rng.sample(WORDS, rng.randint(0, 4))}


@dataclass(frozen=True)
class DoctestTask:
    names: tuple[str, ...]  # alternative function names
    params: str  # the annotated parameter list
    returns: str  # the annotated return type
    doc: str  # what the function does, one or two sentences
    reference: Callable[..., Any]  # computes the examples' expected values
    sample_args: Callable[[random.Random], tuple]  # random arguments for one example


def _chunk_sums(numbers: list[int], size: int) -> list[int]:
    return [sum(numbers[i : i + size]) for i in range(0, len(numbers), size)]


def _count_runs(numbers: list[int]) -> int:
    return sum(1 for i, x in enumerate(numbers) if i == 0 or numbers[i - 1] != x)


def _interleave(a: list[int], b: list[int]) -> list[int]:
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b):] + b[len(a):]


def _split_at_zero(numbers: list[int]) -> list[list[int]]:
    parts: list[list[int]] = [[]]
    for x in numbers:
        if x == 0:
            parts.append([])
        else:
            parts[-1].append(x)
    return parts


def _swap_pairs(text: str) -> str:
    chars = list(text)
    for i in range(0, len(chars) - 1, 2):
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
    return "".join(chars)


def _camel_to_snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _dedupe_words(text: str) -> str:
    seen: list[str] = []
    for w in text.split():
        if w not in seen:
            seen.append(w)
    return " ".join(seen)


def _seconds_to_hms(seconds: int) -> str:
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _word_frequencies(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in text.split():
        out[w] = out.get(w, 0) + 1
    return out


def _pair(rng: random.Random) -> tuple:
    return _ints(rng), _ints(rng)


TASKS: list[DoctestTask] = [
    # Lists of integers.
    DoctestTask(("count_negatives", "negative_count"), "numbers: List[int]", "int",
                "Return how many numbers in the list are strictly below zero.",
                lambda n: sum(x < 0 for x in n), lambda r: (_ints(r),)),
    DoctestTask(("sum_of_multiples", "sum_divisible_by"), "numbers: List[int], k: int", "int",
                "Return the sum of the numbers that are divisible by k.",
                lambda n, k: sum(x for x in n if x % k == 0), lambda r: (_ints(r), r.randint(2, 5))),
    DoctestTask(("clamp_all", "clip_values"), "numbers: List[int], low: int, high: int", "List[int]",
                "Limit every number to the range [low, high]: smaller numbers become low, larger ones high.",
                lambda n, lo, hi: [min(max(x, lo), hi) for x in n], lambda r: (_ints(r), r.randint(-5, 2), r.randint(3, 12))),
    DoctestTask(("running_total", "cumulative_sums"), "numbers: List[int]", "List[int]",
                "Return the list of running totals: element i is the sum of the first i + 1 numbers.",
                lambda n: [sum(n[: i + 1]) for i in range(len(n))], lambda r: (_ints(r),)),
    DoctestTask(("neighbour_differences", "step_sizes"), "numbers: List[int]", "List[int]",
                "Return the difference between each number and the one before it (one element shorter).",
                lambda n: [b - a for a, b in zip(n, n[1:])], lambda r: (_ints(r),)),
    DoctestTask(("index_of_largest", "argmax_index"), "numbers: List[int]", "int",
                "Return the index of the first occurrence of the largest number, or -1 for an empty list.",
                lambda n: n.index(max(n)) if n else -1, lambda r: (_ints(r),)),
    DoctestTask(("count_above", "how_many_above"), "numbers: List[int], threshold: int", "int",
                "Count the numbers that are strictly greater than threshold.",
                lambda n, t: sum(x > t for x in n), lambda r: (_ints(r), r.randint(0, 10))),
    DoctestTask(("replace_negatives", "zero_out_negatives"), "numbers: List[int], value: int", "List[int]",
                "Return a copy of the list where every negative number is replaced by value.",
                lambda n, v: [v if x < 0 else x for x in n], lambda r: (_ints(r), r.randint(0, 3))),
    DoctestTask(("rotate_left", "shift_left"), "numbers: List[int], k: int", "List[int]",
                "Rotate the list k places to the left; an empty list stays empty.",
                lambda n, k: n[k % len(n):] + n[: k % len(n)] if n else [], lambda r: (_ints(r), r.randint(0, 9))),
    DoctestTask(("chunk_sums", "sum_in_groups"), "numbers: List[int], size: int", "List[int]",
                "Split the list into consecutive groups of size elements (the last may be shorter) "
                "and return the sum of each group.",
                _chunk_sums, lambda r: (_ints(r), r.randint(1, 4))),
    DoctestTask(("value_spread", "range_width"), "numbers: List[int]", "int",
                "Return the largest number minus the smallest one, or 0 for an empty list.",
                lambda n: max(n) - min(n) if n else 0, lambda r: (_ints(r),)),
    DoctestTask(("alternate_signs", "flip_every_other"), "numbers: List[int]", "List[int]",
                "Negate the numbers at odd indices and keep the others.",
                lambda n: [-x if i % 2 else x for i, x in enumerate(n)], lambda r: (_ints(r),)),
    DoctestTask(("count_runs", "number_of_runs"), "numbers: List[int]", "int",
                "Count the maximal runs of equal neighbouring numbers.",
                _count_runs, lambda r: (_ints(r, 0, 3),)),
    DoctestTask(("last_index_of", "rfind_value"), "numbers: List[int], value: int", "int",
                "Return the index of the last occurrence of value, or -1 if it does not occur.",
                lambda n, v: max((i for i, x in enumerate(n) if x == v), default=-1),
                lambda r: (_ints(r, 0, 5), r.randint(0, 5))),
    DoctestTask(("interleave", "zip_merge"), "first: List[int], second: List[int]", "List[int]",
                "Take elements alternately from first and second; append what is left of the longer list.",
                _interleave, _pair),
    DoctestTask(("elementwise_max", "pairwise_maximum"), "first: List[int], second: List[int]", "List[int]",
                "Return the larger of the two numbers at each index, up to the length of the shorter list.",
                lambda a, b: [max(x, y) for x, y in zip(a, b)], _pair),
    DoctestTask(("drop_every_nth", "remove_each_nth"), "numbers: List[int], n: int", "List[int]",
                "Remove every n-th element (the n-th, the 2n-th, ...), counting from 1.",
                lambda xs, n: [x for i, x in enumerate(xs, 1) if i % n], lambda r: (_ints(r), r.randint(2, 4))),
    DoctestTask(("split_at_zeros", "segments_between_zeros"), "numbers: List[int]", "List[List[int]]",
                "Split the list at every zero; the zeros themselves are dropped.",
                _split_at_zero, lambda r: (_ints(r, 0, 4),)),
    DoctestTask(("square_the_odds", "square_odd_values"), "numbers: List[int]", "List[int]",
                "Square every odd number and leave even numbers unchanged.",
                lambda n: [x * x if x % 2 else x for x in n], lambda r: (_ints(r),)),
    DoctestTask(("mean_of_positives", "positive_average"), "numbers: List[float]", "float",
                "Return the mean of the positive numbers, or 0.0 if there are none.",
                lambda n: sum(x for x in n if x > 0) / max(1, sum(x > 0 for x in n)),
                lambda r: ([float(x) for x in _ints(r)],)),
    DoctestTask(("count_in_range", "between_count"), "numbers: List[int], low: int, high: int", "int",
                "Count the numbers x with low <= x <= high.",
                lambda n, lo, hi: sum(lo <= x <= hi for x in n), lambda r: (_ints(r), r.randint(-3, 3), r.randint(4, 12))),
    DoctestTask(("smallest_and_largest", "min_and_max"), "numbers: List[int]", "Tuple[int, int]",
                "Return (smallest, largest) of a non-empty list.",
                lambda n: (min(n), max(n)), lambda r: ([r.randint(-9, 20) for _ in range(r.randint(1, 7))],)),
    DoctestTask(("split_even_odd", "evens_and_odds"), "numbers: List[int]", "Tuple[List[int], List[int]]",
                "Return (even numbers, odd numbers), each in their original order.",
                lambda n: ([x for x in n if x % 2 == 0], [x for x in n if x % 2]), lambda r: (_ints(r),)),
    # Strings.
    DoctestTask(("count_char", "occurrences_of"), "text: str, char: str", "int",
                "Return how many times the single character char occurs in text.",
                lambda t, c: t.count(c), lambda r: (_text(r), r.choice("aeorst"))),
    DoctestTask(("reverse_each_word", "mirror_words"), "text: str", "str",
                "Reverse the letters of every word but keep the words in their order.",
                lambda t: " ".join(w[::-1] for w in t.split()), lambda r: (_text(r),)),
    DoctestTask(("initials", "first_letters"), "text: str", "str",
                "Return the upper-cased first letter of every word, joined together.",
                lambda t: "".join(w[0].upper() for w in t.split()), lambda r: (_text(r),)),
    DoctestTask(("stretch_chars", "repeat_each_char"), "text: str, n: int", "str",
                "Repeat every character of text n times.",
                lambda t, n: "".join(c * n for c in t), lambda r: (r.choice(WORDS), r.randint(1, 3))),
    DoctestTask(("mask_digits", "hide_numbers"), "text: str", "str",
                "Replace every digit in text with '#'.",
                lambda t: "".join("#" if c.isdigit() else c for c in t), lambda r: (_mixed_text(r),)),
    DoctestTask(("longest_word_length", "max_word_length"), "text: str", "int",
                "Return the length of the longest word in text (0 for a text without words).",
                lambda t: max((len(w) for w in t.split()), default=0), lambda r: (_text(r),)),
    DoctestTask(("count_words_starting_with", "words_beginning_with"), "text: str, letter: str", "int",
                "Count the words of text that start with letter.",
                lambda t, c: sum(w.startswith(c) for w in t.split()), lambda r: (_text(r), r.choice("aclmprst"))),
    DoctestTask(("remove_char", "delete_character"), "text: str, char: str", "str",
                "Return text with every occurrence of char removed.",
                lambda t, c: t.replace(c, ""), lambda r: (_text(r), r.choice("aeiorst "))),
    DoctestTask(("swap_pairs", "swap_adjacent_chars"), "text: str", "str",
                "Swap the characters at positions 0 and 1, 2 and 3, and so on; an odd last character stays.",
                _swap_pairs, lambda r: (r.choice(WORDS),)),
    DoctestTask(("camel_to_snake", "to_snake_case"), "name: str", "str",
                "Convert a camelCase or PascalCase name to snake_case.",
                _camel_to_snake, lambda r: ("".join(w.capitalize() if i or r.random() < 0.5 else w
                                                    for i, w in enumerate(_text(r).split())),)),
    DoctestTask(("shortest_word", "first_shortest"), "words: List[str]", "str",
                "Return the first of the shortest words in a non-empty list.",
                lambda ws: min(ws, key=len), lambda r: ([r.choice(WORDS) for _ in range(r.randint(1, 5))],)),
    DoctestTask(("words_longer_than", "long_words"), "words: List[str], n: int", "List[str]",
                "Return the words with more than n characters, in their original order.",
                lambda ws, n: [w for w in ws if len(w) > n], lambda r: (_words(r), r.randint(3, 5))),
    DoctestTask(("char_positions", "indices_of_char"), "text: str, char: str", "List[int]",
                "Return every index at which char occurs in text.",
                lambda t, c: [i for i, x in enumerate(t) if x == c], lambda r: (_text(r), r.choice("aeo "))),
    DoctestTask(("strip_punctuation", "remove_punctuation"), "text: str", "str",
                "Remove the characters , . ! and ? from text.",
                lambda t: "".join(c for c in t if c not in ",.!?"), lambda r: (_mixed_text(r),)),
    DoctestTask(("pad_left", "left_pad"), "text: str, width: int, fill: str", "str",
                "Prepend fill characters until text is width characters long; longer texts are unchanged.",
                lambda t, w, f: t.rjust(w, f), lambda r: (r.choice(WORDS), r.randint(3, 8), r.choice("*0-."))),
    DoctestTask(("middle_char", "center_character"), "text: str", "str",
                "Return the middle character of text, or the middle two for an even length ('' for '').",
                lambda t: t[(len(t) - 1) // 2 : len(t) // 2 + 1], lambda r: (r.choice(WORDS + [""]),)),
    DoctestTask(("dedupe_words", "drop_repeated_words"), "text: str", "str",
                "Keep only the first occurrence of each word, joined by single spaces.",
                _dedupe_words, lambda r: (" ".join(r.choice(WORDS[:5]) for _ in range(r.randint(1, 6))),)),
    DoctestTask(("word_lengths", "lengths_of_words"), "words: List[str]", "List[int]",
                "Return the length of every word.",
                lambda ws: [len(w) for w in ws], lambda r: (_words(r),)),
    # Integers.
    DoctestTask(("sum_of_proper_divisors", "aliquot_sum"), "n: int", "int",
                "Return the sum of the divisors of n that are smaller than n (n >= 1).",
                lambda n: sum(d for d in range(1, n) if n % d == 0), lambda r: (r.randint(1, 40),)),
    DoctestTask(("triangular_number", "nth_triangular"), "n: int", "int",
                "Return 1 + 2 + ... + n, or 0 for n <= 0.",
                lambda n: max(n, 0) * (max(n, 0) + 1) // 2, lambda r: (r.randint(-2, 30),)),
    DoctestTask(("next_multiple", "round_up_to_multiple"), "n: int, k: int", "int",
                "Return the smallest multiple of k that is greater than or equal to n (k > 0).",
                lambda n, k: -(-n // k) * k, lambda r: (r.randint(-10, 50), r.randint(1, 9))),
    DoctestTask(("reverse_digits", "mirror_number"), "n: int", "int",
                "Reverse the decimal digits of a non-negative integer (leading zeros vanish).",
                lambda n: int(str(n)[::-1]), lambda r: (r.randint(0, 99999),)),
    DoctestTask(("trailing_zeros", "count_trailing_zeros"), "n: int", "int",
                "Count the zeros at the end of the decimal form of a positive integer.",
                lambda n: len(str(n)) - len(str(n).rstrip("0")), lambda r: (r.randint(1, 99) * 10 ** r.randint(0, 4),)),
    DoctestTask(("celsius_to_fahrenheit", "to_fahrenheit"), "celsius: float", "float",
                "Convert a temperature from degrees Celsius to degrees Fahrenheit.",
                lambda c: c * 9 / 5 + 32, lambda r: (float(r.randint(-40, 100)),)),
    DoctestTask(("seconds_to_hms", "format_duration"), "seconds: int", "str",
                "Format a number of seconds as 'h:mm:ss'.",
                _seconds_to_hms, lambda r: (r.randint(0, 20000),)),
    DoctestTask(("count_set_bits", "popcount"), "n: int", "int",
                "Return the number of 1 bits in the binary form of a non-negative integer.",
                lambda n: bin(n).count("1"), lambda r: (r.randint(0, 300),)),
    # Dictionaries.
    DoctestTask(("keys_with_value", "find_keys"), "counts: Dict[str, int], value: int", "List[str]",
                "Return the keys whose value equals value, in insertion order.",
                lambda d, v: [k for k, x in d.items() if x == v], lambda r: (_counts(r), r.randint(0, 5))),
    DoctestTask(("merge_counts", "add_counters"), "first: Dict[str, int], second: Dict[str, int]", "Dict[str, int]",
                "Merge two word counts, adding the values of keys found in both.",
                _merge_counts, lambda r: (_counts(r), _counts(r))),
    DoctestTask(("word_frequencies", "count_each_word"), "text: str", "Dict[str, int]",
                "Map every word of text to the number of times it occurs.",
                _word_frequencies, lambda r: (" ".join(r.choice(WORDS[:4]) for _ in range(r.randint(0, 6))),)),
    DoctestTask(("total_count", "sum_of_counts"), "counts: Dict[str, int]", "int",
                "Return the sum of all the values.",
                lambda d: sum(d.values()), lambda r: (_counts(r),)),
]

# How the docstring opens, and what (if anything) introduces the examples: HumanEval mixes them.
_DOC_OPENINGS = ('""" {doc}', '"""{doc}', '"""\n    {doc}')
_EXAMPLE_INTROS = ("", "\n    Examples:", "\n    For example:")


def _typing_names(text: str) -> list[str]:
    return [name for name in ("Dict", "List", "Optional", "Tuple") if f"{name}[" in text]


def render(task: DoctestTask, name: str, rng: random.Random, num_examples: int) -> str:
    """One HumanEval-format prompt: typing import, typed def, docstring with examples."""
    signature = f"def {name}({task.params}) -> {task.returns}:"
    lines = [rng.choice(_DOC_OPENINGS).format(doc=task.doc) + rng.choice(_EXAMPLE_INTROS)]
    seen: set[str] = set()
    for _ in range(num_examples * 4):  # random inputs can repeat; try a few more
        args = task.sample_args(rng)
        call = f"{name}({', '.join(repr(a) for a in args)})"
        if call in seen:
            continue
        seen.add(call)
        lines.append(f"    >>> {call}\n    {task.reference(*args)!r}")
        if len(seen) == num_examples:
            break
    body = "\n".join(lines) + '\n    """\n'
    names = _typing_names(signature)
    header = f"from typing import {', '.join(names)}\n\n\n" if names else ""
    return f"{header}{signature}\n    {body}"


def doctest_prompts(per_task: int = 16, seed: int = 0, exclude_names: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``per_task`` distinct prompts for every task (names alternate; examples, docstring style
    and example count are random), skipping names in ``exclude_names``; deterministic for a seed."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for task in TASKS:
        names = [n for n in task.names if n not in exclude_names]
        made: set[str] = set()
        for i in range(4 * per_task if names else 0):  # small input spaces can repeat a prompt
            made.add(render(task, names[i % len(names)], rng, num_examples=rng.randint(1, 3)))
            if len(made) == per_task:
                break
        prompts += sorted(made)
    return prompts
