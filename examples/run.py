#!/usr/bin/env python
"""Generate with a target model and a DFlash drafter: autoregressive, DFlash chain or DDTree.

Flag names follow TensorRT-LLM's examples/run.py where they exist. With no model flags
it runs the embedded SmolLM2-135M-Instruct target with the shipped demo drafter.

    python examples/run.py --input_text "Write a Python function that reverses a string."
    python examples/run.py --speculative_decoding_mode none --input_text "Hi" --max_output_len 32
    python examples/run.py --ddtree_budget 0 ...      # DFlash chain instead of DDTree
    python examples/run.py --engine_dir ENGINE --tokenizer_dir TARGET ...   # TensorRT-LLM engine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative_decoding_mode", choices=["none", "dflash"], default="dflash")
    ap.add_argument("--backend", choices=["pytorch", "trt"], default=None,
                    help="pytorch (transformers) or trt (a TensorRT-LLM engine; implied by --engine_dir)")
    ap.add_argument("--target_model_dir", default=None, help="HF causal-LM dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft_model_dir", default=None, help="DFlash drafter dir (default: the shipped demo drafter)")
    ap.add_argument("--draft_type", choices=["dflash", "lora_inject"], default="dflash",
                    help="lora_inject: --draft_model_dir is a LoRA-inject adapter (docs/lora_inject.md)")
    ap.add_argument("--engine_dir", default=None, help="TensorRT-LLM engine dir (implies --backend trt)")
    ap.add_argument("--tokenizer_dir", default=None, help="tokenizer for --engine_dir")
    ap.add_argument("--use_py_session", action="store_true", help="accepted for TensorRT-LLM compatibility")
    ap.add_argument("--input_text", nargs="+", default=["Write a Python function that checks whether a number is prime."])
    ap.add_argument("--no_chat_template", action="store_true", help="send the text as-is")
    ap.add_argument("--max_output_len", type=int, default=128)
    ap.add_argument("--ddtree_budget", type=int, default=None,
                    help="DDTree node budget; 0 = DFlash chain (default: tuned for the demo drafter)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--random_seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default="float32")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--output_json", default=None)
    ap.add_argument("--streaming", action="store_true", help="print tokens as they are committed")
    args = ap.parse_args(argv)
    if args.backend is None:
        args.backend = "trt" if args.engine_dir else "pytorch"
    return args


def build_pytorch(args: argparse.Namespace):
    """(verifier, proposer or None, tokenizer, stop ids, default budget)."""
    import torch

    from tensorrt_llm_dflash.assets import DEMO_DDTREE_BUDGET, resolve_drafter_dir
    from tensorrt_llm_dflash.drafter import load_dflash_drafter
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.target import HFTargetVerifier, load_target, target_dims

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=device)
    proposer = None
    if args.speculative_decoding_mode == "dflash":
        draft_dir = resolve_drafter_dir(args.draft_model_dir, args.target_model_dir,
                                        "run with --speculative_decoding_mode none")
        drafter = load_dflash_drafter(draft_dir, dtype=dtype, device=device)
        drafter.config.validate_for_target(**target_dims(model))
        proposer = DFlashProposer.for_target(drafter, model)
        layer_ids = drafter.config.target_layer_ids
    else:
        layer_ids = []
    verifier = HFTargetVerifier(model, layer_ids)
    stops = model.generation_config.eos_token_id
    stops = [] if stops is None else (list(stops) if isinstance(stops, (list, tuple)) else [stops])
    return verifier, proposer, tokenizer, stops, DEMO_DDTREE_BUDGET


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch

        from tensorrt_llm_dflash.decode import speculative_generate
        from tensorrt_llm_dflash.sampling import SamplingParams
        from tensorrt_llm_dflash.tree import validate_budget

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.ddtree_budget is not None:
            validate_budget(args.ddtree_budget)
        if args.backend == "trt":
            from tensorrt_llm_dflash.trtllm.runner import build_trt_runtime

            verifier, proposer, tokenizer, stops, default_budget = build_trt_runtime(args)
        elif args.draft_type == "lora_inject":
            from tensorrt_llm_dflash.lora_inject import build_run_pytorch

            verifier, proposer, tokenizer, stops, default_budget = build_run_pytorch(args)
        else:
            verifier, proposer, tokenizer, stops, default_budget = build_pytorch(args)
        budget = 0 if proposer is None else (default_budget if args.ddtree_budget is None else args.ddtree_budget)
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.random_seed)
        mode = "autoregressive" if proposer is None else ("DFlash chain" if budget == 0 else f"DDTree budget {budget}")
        outputs = []
        for text in args.input_text:
            prompt = encode(tokenizer, text, not args.no_chat_template)
            streamed: list[int] = []

            def on_tokens(tokens: list[int], streamed: list[int] = streamed) -> None:
                before = tokenizer.decode(streamed, skip_special_tokens=True)
                streamed.extend(tokens)
                print(tokenizer.decode(streamed, skip_special_tokens=True)[len(before):], end="", flush=True)

            if args.streaming:
                print(f"\n[{mode}] {text!r}\n", flush=True)
            t0 = time.perf_counter()
            result = speculative_generate(
                verifier, proposer, prompt, args.max_output_len, sampling, stops, budget,
                on_tokens=on_tokens if args.streaming else None,
            )
            elapsed = time.perf_counter() - t0
            text_out = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            stats = result.stats
            if not args.streaming:
                print(f"\n[{mode}] {text!r}\n{text_out}")
            stage = ", ".join(f"{k} {v:.2f}s" for k, v in stats.stage_seconds.items() if v > 0)
            print(f"\n-- {stats.new_tokens} tokens in {elapsed:.2f}s ({stats.tokens_per_second:.1f} tok/s), "
                  f"{stats.steps} target steps, mean tau {stats.mean_acceptance_length:.2f}; {stage}")
            outputs.append({
                "prompt": text,
                "output_ids": result.output_ids,
                "output_text": text_out,
                "finish_reason": result.finish_reason,
                "stats": stats.to_dict(),
            })
        if args.output_json:
            Path(args.output_json).write_text(json.dumps({"mode": mode, "outputs": outputs}, indent=2) + "\n")
            print(f"wrote {args.output_json}")
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
