#!/usr/bin/env python
"""Generate with a target model and a DFlash drafter: autoregressive, DFlash chain or DDTree.

Flag names follow TensorRT-LLM's examples/run.py where they exist. With no model flags
it runs the embedded SmolLM2-135M-Instruct target with the shipped demo drafter.

    python examples/run.py --input_text "Write a Python function that reverses a string."
    python examples/run.py --speculative_decoding_mode none --input_text "Hi" --max_output_len 32
    python examples/run.py --ddtree_budget 16 ...     # a fixed DDTree budget instead of the cost-aware tree
    python examples/run.py --ddtree_budget 0 ...      # DFlash chain
    python examples/run.py --engine_dir ENGINE --tokenizer_dir TARGET ...   # TensorRT-LLM engine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.compat import chat_token_ids  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError, DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.precision import guarantee, low_precision_warning  # noqa: E402
from tensorrt_llm_dflash.tree import MAX_DDTREE_BUDGET  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16", "float64"]
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."
#: The file that marks a LoRA-inject adapter dir (lora_inject.CONFIG_NAME; not imported here: parsing stays light).
LORA_INJECT_CONFIG = "dflash_lora_inject.json"
#: Longest generation accepted on the command line; the target's own limit is checked after loading.
MAX_OUTPUT_LEN = 1 << 20


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Exactness by --dtype: " + "; ".join(guarantee(d) for d in DTYPES) + ".")
    ap.add_argument("--speculative_decoding_mode", choices=["none", "dflash"], default="dflash")
    ap.add_argument("--backend", choices=["pytorch", "trt"], default=None,
                    help="pytorch (transformers) or trt (a TensorRT-LLM engine; implied by --engine_dir)")
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF causal-LM dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft_model_dir", type=cli.existing_dir, default=None,
                    help="DFlash drafter dir (default: the shipped demo drafter)")
    ap.add_argument("--draft_type", choices=["dflash", "lora_inject"], default="dflash",
                    help="lora_inject: --draft_model_dir is a LoRA-inject adapter (docs/lora_inject.md)")
    ap.add_argument("--engine_dir", type=cli.existing_dir, default=None,
                    help="TensorRT-LLM engine dir (implies --backend trt)")
    ap.add_argument("--tokenizer_dir", type=cli.existing_path, default=None, help="tokenizer for --engine_dir")
    ap.add_argument("--use_py_session", action="store_true", help="accepted for TensorRT-LLM compatibility")
    # extend: a second --input_text adds its prompts (the store action silently dropped the first ones).
    ap.add_argument("--input_text", type=cli.utf8_text, nargs="+", action="extend", default=None,
                    help=f"one or more prompts; the flag may be repeated (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--no_chat_template", action="store_true", help="send the text as-is")
    ap.add_argument("--max_output_len", type=cli.integer(1, MAX_OUTPUT_LEN), default=128)
    ap.add_argument("--ddtree_budget", type=cli.integer(0, MAX_DDTREE_BUDGET), default=None,
                    help="a fixed DDTree node budget; 0 = DFlash chain (default: the cost-aware tree: each step "
                         "verifies the number of nodes that maximises expected tokens per second on this machine, "
                         "with prompt-lookup branches, and skips drafting when it does not pay)")
    ap.add_argument("--max_tree_nodes", type=cli.integer(1, MAX_DDTREE_BUDGET), default=None,
                    help="cost-aware tree: the largest tree it may verify (default 64, or the engine's max_draft_len)")
    ap.add_argument("--no_lookup", action="store_true", help="cost-aware tree: no prompt-lookup branches")
    ap.add_argument("--recalibrate", action="store_true",
                    help="cost-aware tree: measure this machine's verify cost curve again and start the acceptance "
                         "calibration from its priors (both are kept between runs: the curve per machine, target and "
                         "drafter, the calibration per target and drafter)")
    ap.add_argument("--runtime", choices=["eager", "graphed"], default=None,
                    help="PyTorch backend: eager, or graphed (static state, each step's stages replayed as CUDA "
                         "graphs on CUDA, the same code eagerly on the CPU; with no --ddtree_budget the cost-aware "
                         "tree runs on the device). Default: graphed on CUDA, where it measured 3.1x the eager "
                         "runtime (H100, BENCHMARKS.md), eager on the CPU, where eager is the faster")
    ap.add_argument("--temperature", type=cli.number(0.0), default=0.0, help="0 = greedy")
    ap.add_argument("--top_p", type=cli.number(0.0, 1.0, low_open=True), default=1.0)
    ap.add_argument("--top_k", type=cli.integer(0), default=0, help="0 disables top-k")
    ap.add_argument("--random_seed", type=cli.seed, default=0,
                    help="the sampling seed at --temperature > 0: token t is drawn with uniforms keyed by the "
                         "seed and t, so the same seed gives the same output in every mode and runtime, plain "
                         "sampling's own (in float32 up to near-ties, as greedy output; a DFlash2 chain, "
                         "--ddtree_budget 0, draws its own drafts: its samples repeat in that mode only)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="float32/float64: greedy output equals the target's own, token for token; "
                         "float16/bfloat16: not guaranteed (see below)")
    ap.add_argument("--device", type=cli.device, default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--threads", type=cli.threads, default=None, help="torch CPU threads")
    ap.add_argument("--output_json", type=cli.output_file, default=None,
                    help="results, rewritten (atomically) after every prompt, so an interrupted run keeps its work")
    ap.add_argument("--streaming", action="store_true", help="print text as tokens are committed")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.input_text is None:
        args.input_text = [DEFAULT_PROMPT]
    if args.backend is None:
        args.backend = "trt" if args.engine_dir else "pytorch"
    if args.backend == "trt":
        if args.engine_dir is None:
            cli.refuse(ap, "--backend", "'trt' needs --engine_dir")
        cli.require_module(ap, "--engine_dir", "tensorrt_llm",
                           "pip install -r requirements-trtllm.txt on a machine with a GPU; docs/trtllm_engine.md")
        if args.draft_type != "dflash":
            cli.refuse(ap, "--draft_type", f"{args.draft_type!r} runs only with --backend pytorch")
        # An engine holds its own target, drafter and dtype: these would be ignored (the server refuses them too).
        for flag, given in (("--target_model_dir", args.target_model_dir is not None),
                            ("--draft_model_dir", args.draft_model_dir is not None),
                            ("--dtype", args.dtype != "float32")):
            if given:
                cli.refuse(ap, flag, "applies to --backend pytorch: an engine holds its own target, drafter and dtype")
        from tensorrt_llm_dflash.trtllm.runner import missing_tokenizer

        problem = missing_tokenizer(args.engine_dir, args.tokenizer_dir)
        if problem:
            cli.refuse(ap, "--tokenizer_dir", problem)
    else:
        # The PyTorch backend loads --target_model_dir (or the embedded target) and its own tokenizer: an engine or
        # an engine's tokenizer given here would be ignored, so the run would not be the one asked for.
        for flag, given in (("--engine_dir", args.engine_dir is not None),
                            ("--tokenizer_dir", args.tokenizer_dir is not None)):
            if given:
                cli.refuse(ap, flag, "applies to --backend trt (a TensorRT-LLM engine)")
    if args.draft_model_dir is not None and args.backend == "pytorch":
        # A drafter given with the wrong --draft_type is refused by that flag now, not by a missing file after the
        # target has loaded (the other way round, build_pytorch names the flag).
        if args.draft_type == "lora_inject" and not (Path(args.draft_model_dir) / LORA_INJECT_CONFIG).is_file():
            hint = ("; it has a config.json, as a DFlash or DFlash2 drafter has: drop --draft_type lora_inject"
                    if (Path(args.draft_model_dir) / "config.json").is_file() else "")
            cli.refuse(ap, "--draft_type", f"'lora_inject' needs a LoRA-inject adapter dir (one with "
                                           f"{LORA_INJECT_CONFIG}), and --draft_model_dir {args.draft_model_dir!r} "
                                           f"has none{hint}")
    if args.speculative_decoding_mode == "none":
        # Without a drafter every step verifies one token: a budget or a drafter would be ignored.
        for flag, given in (("--ddtree_budget", args.ddtree_budget is not None),
                            ("--draft_model_dir", args.draft_model_dir is not None)):
            if given:
                cli.refuse(ap, flag, "needs --speculative_decoding_mode dflash (there is no drafter in 'none')")
    if args.runtime == "graphed":
        if args.backend != "pytorch" or args.draft_type != "dflash":
            cli.refuse(ap, "--runtime", "'graphed' runs the PyTorch backend with a DFlash drafter (or none)")
        if args.recalibrate:
            cli.refuse(ap, "--recalibrate", "the eager runtime keeps its cost curve and calibration between runs; "
                                            "--runtime graphed measures its step costs at every start")
    args.runtime_given = args.runtime is not None
    if args.runtime is None:
        args.runtime = default_runtime(args)
    policy_flags = [f for f, given in (("--max_tree_nodes", args.max_tree_nodes is not None),
                                       ("--no_lookup", args.no_lookup), ("--recalibrate", args.recalibrate)) if given]
    for flag in policy_flags:
        if args.ddtree_budget is not None:
            cli.refuse(ap, flag, "applies to the cost-aware tree, not to a fixed --ddtree_budget")
        if args.speculative_decoding_mode == "none" or args.draft_type != "dflash":
            cli.refuse(ap, flag, "applies to the cost-aware tree of a DFlash drafter (--draft_type dflash, "
                                 "--speculative_decoding_mode dflash)")
    return args


def default_runtime(args: argparse.Namespace) -> str:
    """graphed on CUDA (the PyTorch backend, a DFlash drafter or none): on an H100 it ran the default cost-aware tree
    at 376 tok/s against the eager runtime's 120 (BENCHMARKS.md, "On a GPU"); eager elsewhere, and for what only the
    eager runtime does (--recalibrate; a DFlash2 drafter falls back to it from its config, build_pytorch)."""
    if args.backend != "pytorch" or args.draft_type != "dflash" or args.recalibrate:
        return "eager"
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "graphed" if str(device).startswith("cuda") else "eager"


def graphed_policy_buckets(max_tree_nodes: int | None, device: str = "cuda") -> tuple[int, ...]:
    """The graphed cost-aware tree's sizes on ``device``, those of at most ``--max_tree_nodes`` nodes (AR stays)."""
    from tensorrt_llm_dflash.device_policy import default_policy_buckets

    sizes = default_policy_buckets(device)
    if max_tree_nodes is None:
        return sizes
    return tuple(b for b in sizes if b <= max(2, max_tree_nodes))


def uses_policy(args: argparse.Namespace, proposer: object | None) -> bool:
    """The default: a DFlash (or DFlash2) drafter with no fixed --ddtree_budget runs the cost-aware tree (eager
    runtime; over a DFlash2 drafter it sizes the selector's own tree)."""
    return (proposer is not None and args.ddtree_budget is None and args.draft_type == "dflash"
            and args.runtime == "eager")


def make_policy(args: argparse.Namespace, verifier: object, proposer: object):
    from tensorrt_llm_dflash.policy import DEFAULT_MAX_NODES, default_policy

    engine_cap = getattr(verifier, "max_draft_len", None)
    max_nodes = args.max_tree_nodes or (min(DEFAULT_MAX_NODES, engine_cap) if engine_cap else DEFAULT_MAX_NODES)
    if engine_cap is not None and max_nodes > engine_cap:
        raise DFlashInputError(f"--max_tree_nodes={max_nodes} exceeds the engine's max_draft_len={engine_cap}")
    return default_policy(verifier, proposer, max_nodes, lookup=not args.no_lookup, recalibrate=args.recalibrate,
                          log=lambda line: print(line, file=sys.stderr, flush=True), persist=True)


def build_pytorch(args: argparse.Namespace):
    """(verifier, proposer or None, tokenizer, stop ids, default budget)."""
    import torch

    from tensorrt_llm_dflash.assets import DEMO_DDTREE_BUDGET, resolve_drafter_dir
    from tensorrt_llm_dflash.decode import stop_ids
    from tensorrt_llm_dflash.dflash2 import DFlash2Config, check_drafter_checkpoint, load_drafter, proposer_for_target
    from tensorrt_llm_dflash.target import HFTargetVerifier, check_drafter_fits_target_dir, load_target, target_dims

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_output_fits_target_config(args.max_output_len, args.target_model_dir)
    draft_dir = None
    if args.speculative_decoding_mode == "dflash":
        draft_dir = resolve_drafter_dir(args.draft_model_dir, args.target_model_dir,
                                        "run with --speculative_decoding_mode none")
        if (Path(draft_dir) / LORA_INJECT_CONFIG).is_file():  # else: "has no config.json", with no way forward
            raise DFlashInputError(f"--draft_model_dir {str(draft_dir)!r} is a LoRA-inject adapter (it has "
                                   f"{LORA_INJECT_CONFIG}): pass --draft_type lora_inject")
        # A malformed drafter (DFlash or DFlash2; config, tensor names and shapes) is refused before any load.
        draft_config = check_drafter_checkpoint(draft_dir)
        if args.runtime == "graphed" and isinstance(draft_config, DFlash2Config):
            # The graphed runtime runs DFlash drafts only: refuse (or, by default, fall back) before any load.
            if args.runtime_given:
                raise DFlashInputError(f"--runtime graphed runs DFlash drafters, not DFlash2 (the drafter {draft_dir} "
                                       "is a DFlash2 drafter): use --runtime eager")
            args.runtime = "eager"
        check_drafter_fits_target_dir(getattr(draft_config, "base", draft_config), args.target_model_dir)
    # The drafter loads first: what only its weights show (a wrong dtype, NaN, a d2t out of range) is refused in
    # seconds, not after the target's load.
    drafter = load_drafter(draft_dir, dtype=dtype, device=device) if draft_dir is not None else None
    model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=device)
    proposer = None
    if drafter is not None:
        drafter.config.validate_for_target(**target_dims(model))
        proposer = proposer_for_target(drafter, model)
        layer_ids = drafter.config.target_layer_ids
    else:
        layer_ids = []
    verifier = HFTargetVerifier(model, layer_ids)
    return verifier, proposer, tokenizer, stop_ids(model.generation_config.eos_token_id), DEMO_DDTREE_BUDGET


def check_output_fits_target_config(max_output_len: int, target_model_dir: str | None) -> None:
    """--max_output_len that no prompt leaves room for, refused from the target's config.json before its weights
    load (each prompt is checked against the same limit once loaded)."""
    from tensorrt_llm_dflash.config import is_integer
    from tensorrt_llm_dflash.target import check_target_config

    if target_model_dir is None or not (Path(target_model_dir) / "config.json").is_file():
        return
    limit = check_target_config(Path(target_model_dir)).get("max_position_embeddings")
    if is_integer(limit) and max_output_len >= limit:
        raise DFlashInputError(f"--max_output_len={max_output_len} leaves no room for a prompt: the target's "
                               f"max_position_embeddings={limit} (--target_model_dir {target_model_dir!r}); at "
                               f"most {limit - 1} new tokens fit after a 1-token prompt")


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return chat_token_ids(tokenizer, [{"role": "user", "content": text}])
    return tokenizer(text)["input_ids"]


def note_missing_chat_template(tokenizer, chat: bool) -> None:
    """A tokenizer without a chat template gets the text as-is (a base model; the engine demo pair's documented
    commands rely on it); say so, since the chat template is otherwise applied unless --no_chat_template."""
    if chat and not getattr(tokenizer, "chat_template", None):
        print("note: the target's tokenizer has no chat template: the text is sent as-is (as --no_chat_template "
              "would)", file=sys.stderr)


class ResultsFile:
    """``--output_json``: rewritten atomically after every prompt, so a refused prompt, an
    error or Ctrl-C keeps every generation finished before it."""

    def __init__(self, path: str | None, mode: str) -> None:
        self.path, self.mode, self.outputs = path, mode, []

    def add(self, output: dict) -> None:
        self.outputs.append(output)
        self.write("running")

    def write(self, status: str) -> None:
        if self.path:
            from tensorrt_llm_dflash.files import atomic_write_json

            atomic_write_json(self.path, {"mode": self.mode, "status": status, "outputs": self.outputs})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = ResultsFile(args.output_json, "")
    try:
        import torch

        from tensorrt_llm_dflash.decode import speculative_generate
        from tensorrt_llm_dflash.sampling import SamplingParams
        from tensorrt_llm_dflash.streaming import IncrementalDetokenizer

        if args.threads:
            torch.set_num_threads(args.threads)
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.random_seed)
        if args.backend == "trt":
            from tensorrt_llm_dflash.trtllm.runner import batch_rows, build_trt_runtime, read_engine_config

            dtype = str(read_engine_config(args.engine_dir)["pretrained_config"].get("dtype", args.dtype))
            # Several prompts share the engine's step loop when its --max_batch_size allows (trtllm/batch.py).
            verifier, proposer, tokenizer, stops, default_budget = build_trt_runtime(args, rows=batch_rows(args))
        elif args.draft_type == "lora_inject":
            from tensorrt_llm_dflash.lora_inject import build_run_pytorch

            dtype = args.dtype
            verifier, proposer, tokenizer, stops, default_budget = build_run_pytorch(args)
        else:
            dtype = args.dtype
            verifier, proposer, tokenizer, stops, default_budget = build_pytorch(args)
        warning = low_precision_warning(dtype, proposer is not None)
        if warning:
            print(warning, file=sys.stderr)
        budget = 0 if proposer is None else (default_budget if args.ddtree_budget is None else args.ddtree_budget)
        graphed_cost_aware = args.runtime == "graphed" and proposer is not None and args.ddtree_budget is None
        # Every prompt is encoded and checked before anything else runs: the cost-aware tree's first run measures
        # this machine's verify costs (minutes on a real target), time a prompt that cannot run would waste. The
        # mode is named in full once the policy is built; an error before that saves the results under this one.
        dflash2 = getattr(proposer, "selects_tokens", False)  # its chain and tree are the selector's, not DDTree
        fixed_mode = ("autoregressive" if proposer is None else
                      ("DFlash2 chain" if dflash2 else "DFlash chain") if budget == 0 else
                      f"{'DFlash2 tree' if dflash2 else 'DDTree'} budget {budget}")
        results.mode = "cost-aware tree" if graphed_cost_aware or uses_policy(args, proposer) else fixed_mode
        note_missing_chat_template(tokenizer, not args.no_chat_template)
        prompts = [encode(tokenizer, text, not args.no_chat_template) for text in args.input_text]
        for text, ids in zip(args.input_text, prompts):
            check_prompt_fits(len(ids), args.max_output_len, int(getattr(verifier, "max_positions", 1 << 30)),
                              text, getattr(verifier, "max_positions_name", "the target's max_position_embeddings"))
            if hasattr(verifier, "check_prompt_len"):  # an engine: what one context pass takes (--max_input_len)
                try:
                    verifier.check_prompt_len(len(ids))
                except DFlashInputError as err:
                    raise DFlashInputError(f"--input_text {text[:40]!r}: {err}") from None
        policy = make_policy(args, verifier, proposer) if uses_policy(args, proposer) else None
        generate = speculative_generate
        if args.runtime == "graphed":
            from tensorrt_llm_dflash.graphed import GraphedDecoder

            # No --ddtree_budget: the cost-aware tree on the device (budget None), what the benchmark's default is
            # on CUDA.
            decoder = GraphedDecoder(verifier.model, proposer.model if proposer is not None else None,
                                     budget=None if graphed_cost_aware else budget, lookup=not args.no_lookup,
                                     policy_buckets=graphed_policy_buckets(args.max_tree_nodes,
                                                                           str(verifier.model.device)))

            def generate(_verifier, _proposer, prompt, max_new, sampling, stops, _budget, on_tokens=None,
                         policy=None):
                return decoder.generate(prompt, max_new, sampling, stops, on_tokens=on_tokens)
        if policy is not None:
            tree_kind = "DFlash2 tree" if dflash2 else "DDTree"
            mode = f"cost-aware {tree_kind} (<= {policy.config.max_nodes} nodes" + (
                ", lookup branches)" if policy.config.lookup else ")")
        elif graphed_cost_aware:
            mode = (f"cost-aware DDTree (<= {max(decoder.sizes()) - 1} nodes"
                    + (", lookup branches" if decoder.lookup else "") + "), graphed runtime")
        else:
            mode = fixed_mode
            if args.runtime == "graphed":
                mode += ", graphed runtime"
        results.mode = mode
        if args.runtime == "graphed":  # every graph (and step cost) the prompts need, before the first one's clock
            decoder.reserve(max(len(ids) for ids in prompts), args.max_output_len)
            decoder.prepare(sampling)
        results.write("running")
        batched = None
        if args.backend == "trt" and verifier.rows > 1 and policy is None:  # the engine's rows: one step loop
            from tensorrt_llm_dflash.trtllm.batch import run_prompts

            print(f"running {len(prompts)} prompts {verifier.rows} at a time in one step loop (the engine's "
                  f"max_batch_size is {verifier.max_batch_size})", file=sys.stderr)
            batched = run_prompts(verifier, budget, prompts, args.max_output_len, sampling, stops)
        for text, prompt in zip(args.input_text, prompts):
            stream = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)

            def on_tokens(tokens: list[int], stream: IncrementalDetokenizer = stream) -> None:
                print(stream.push(tokens), end="", flush=True)

            if args.streaming:
                print(f"\n[{mode}] {text!r}\n", flush=True)
            t0 = time.perf_counter()
            if batched is not None:
                result = next(batched)
                elapsed = result.stats.total_seconds  # from its prefill to its last token
            else:
                result = generate(
                    verifier, proposer, prompt, args.max_output_len, sampling, stops, budget,
                    on_tokens=on_tokens if args.streaming else None, policy=policy,
                )
                elapsed = time.perf_counter() - t0
            if policy is not None:
                policy.save_calibration()  # after every prompt: the next run (or an interrupted one) keeps it
            text_out = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            stats = result.stats
            if args.streaming:
                print(stream.flush(), end="", flush=True)
                if stream.diverged:
                    print(f"\nwarning: the tokenizer rewrote text already printed; the generated text is:\n"
                          f"{text_out}", file=sys.stderr)
            else:
                print(f"\n[{mode}] {text!r}\n{text_out}")
            stage = ", ".join(f"{k} {v:.2f}s" for k, v in stats.stage_seconds.items() if v > 0)
            chosen = ""
            if (policy is not None or graphed_cost_aware) and stats.steps:
                chosen = (f"; mean tree {sum(stats.tree_sizes) / stats.steps - 1:.1f} draft nodes, drafted on "
                          f"{sum(stats.drafted)}/{stats.steps} steps, {stats.lookup_tokens} tokens from lookup only")
            print(f"\n-- {stats.new_tokens} tokens in {elapsed:.2f}s ({stats.tokens_per_second:.1f} tok/s), "
                  f"{stats.steps} target steps, mean tau {stats.mean_acceptance_length:.2f}{chosen}; {stage}")
            results.add({
                "prompt": text,
                "output_ids": result.output_ids,
                "output_text": text_out,
                "finish_reason": result.finish_reason,
                "stats": stats.to_dict(),
            })
        results.write("complete")
        if args.output_json:
            print(f"wrote {args.output_json}")
    except DFlashError as err:
        cli.print_error(err)
        _saved(results, "error")
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted after {len(results.outputs)} of {len(args.input_text)} prompt(s)", file=sys.stderr)
        _saved(results, "interrupted")
        return 130
    return 0


def check_prompt_fits(prompt_len: int, max_output_len: int, limit: int, text: str,
                      limit_name: str = "the target's max_position_embeddings") -> None:
    """Refuse a prompt that cannot be generated from, naming the flag to change: --input_text when the prompt alone
    leaves no room for a token, else --max_output_len (the target's own message names its max_new_tokens, a name
    this command line does not have)."""
    from tensorrt_llm_dflash.target import check_prompt_fits as fits

    try:
        fits(prompt_len, max_output_len, limit, limit_name)
    except DFlashInputError as err:
        if 1 <= prompt_len < limit:
            raise DFlashInputError(
                f"--max_output_len={max_output_len}: the {prompt_len}-token prompt {text[:40]!r} + "
                f"{max_output_len} new tokens = {prompt_len + max_output_len} exceeds {limit_name}={limit}; at "
                f"most {limit - prompt_len} new tokens fit after it") from None
        if prompt_len >= limit:  # no --max_output_len helps: say so, not the target's "max_new_tokens"
            raise DFlashInputError(
                f"--input_text {text[:40]!r}: the {prompt_len}-token prompt leaves no room for a new token within "
                f"{limit_name}={limit}; at most {limit - 1} prompt tokens fit") from None
        raise DFlashInputError(f"--input_text {text[:40]!r}: {err}") from None


def _saved(results: ResultsFile, status: str) -> None:
    if results.path and results.mode:
        results.write(status)
        print(f"saved {len(results.outputs)} finished generation(s) to {results.path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
