#!/usr/bin/env python
"""Profile one target verify pass (HFTargetVerifier.compile_tree / verify) at several tree sizes.

Loads the target (default: the embedded SmolLM2-135M-Instruct, float32), prefills a
HumanEval-like chat prompt (~200 tokens), then times verify passes of a chain and of a
bushy DDTree (synthetic draft log-probs) at 1, 9 and 33 nodes. After every pass the KV
cache is cropped back, so the context length stays constant. Cases are interleaved and
repeated; medians are reported.

Then a per-component breakdown, from forward hooks and timing wrappers (perf_counter):
embedding, HF's mask building, RoPE tables, per layer (norms, q/k/v and o projections,
RoPE, KV-cache update, SDPA, the rest of attention, MLP GEMMs, MLP activation, residual
adds), final norm, lm_head, feature-capture hooks, and the rest (Python / HF glue, the
difference to the plain wall time of the same pass). The instrumented passes are slower
than the plain ones by the hooks' own cost; "other" includes it.

    python examples/profile_verify.py                      # torch's default thread count
    python examples/profile_verify.py --threads 1 --reps 40
    python examples/profile_verify.py --compare            # fast paths off vs on, interleaved

``--compare`` times the reference path (``HFTargetVerifier(..., fast=False)``: the model's
own nn.Linear / SDPA calls) against the fast one, in the same process and interleaved, and
reports the largest difference of their verify logits (0: bit-identical).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.compat import chat_token_ids, crop_cache  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError, DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.tree import MAX_DDTREE_BUDGET  # noqa: E402

PROMPT = '''Complete the following Python function. Return only the code.

from typing import List


def separate_paren_groups(paren_string: str) -> List[str]:
    """ Input to this function is a string containing multiple groups of nested parentheses.
    Your goal is to separate those groups into separate strings and return the list of those.
    Separate groups are balanced (each open brace is properly closed) and not nested within each other.
    Ignore any spaces in the input string.
    >>> separate_paren_groups('( ) (( )) (( )( ))')
    ['()', '(())', '(()())']
    """


def truncate_number(number: float) -> float:
    """ Return the decimal part of a positive floating point number.
    >>> truncate_number(3.5)
    0.5
    """
'''

#: Target layers whose hidden states the shipped demo drafter reads (captured by hooks).
DEMO_LAYER_IDS = "1,8,14,20,27"


#: The largest tree profiled: the DDTree's node budget limit, plus its root.
MAX_NODES = MAX_DDTREE_BUDGET + 1
MAX_REPS = 1_000_000
#: Longest context accepted on the command line; the target's own limit is checked after loading.
MAX_CONTEXT_TOKENS = 1 << 20


def int_list(low: int, high: int, empty: bool) -> Callable[[str], list[int]]:
    """Comma-separated integers in low..high, none twice (``empty``: '' is the empty list)."""
    item = cli.integer(low, high)

    def parse(text: str) -> list[int]:
        values = [item(part) for part in text.split(",") if part.strip() or not empty]
        if not values and not empty:
            raise argparse.ArgumentTypeError(f"needs at least one integer in {low}..{high}, got {text!r}")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"lists {', '.join(map(str, repeated))} more than once")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--threads", type=cli.threads, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--nodes", type=int_list(1, MAX_NODES, empty=False), default="1,9,33",
                    help=f"tree sizes, comma-separated, each in 1..{MAX_NODES}")
    ap.add_argument("--reps", type=cli.integer(1, MAX_REPS), default=30, help="timed repetitions per case")
    ap.add_argument("--warmup", type=cli.integer(0, MAX_REPS), default=3)
    ap.add_argument("--context_tokens", type=cli.integer(1, MAX_CONTEXT_TOKENS), default=None,
                    help="cut or repeat the prompt to this many tokens (default: the prompt as is)")
    ap.add_argument("--layer_ids", type=int_list(0, 1 << 16, empty=True), default=DEMO_LAYER_IDS,
                    help=f"captured layers, comma-separated ('' for none; default {DEMO_LAYER_IDS}: the shipped "
                         "drafter's, which fit SmolLM2-135M's 30 layers)")
    ap.add_argument("--no_breakdown", action="store_true", help="only the plain wall times")
    ap.add_argument("--compare", action="store_true", help="reference path vs fast path, interleaved")
    return ap.parse_args(argv)


def check_fits(model, args: argparse.Namespace, context: int) -> None:
    """What only the loaded target can tell: the captured layers exist, the largest tree's distinct tokens fit the
    vocabulary, and the context plus that tree fits the target's positions."""
    from tensorrt_llm_dflash.target import max_positions

    layers = int(model.config.num_hidden_layers)
    bad = [i for i in args.layer_ids if i >= layers]
    if bad:
        raise DFlashInputError(f"--layer_ids {','.join(map(str, args.layer_ids))}: {bad} outside the target's layers "
                               f"0..{layers - 1} (give layers of this target, or '' for none)")
    vocab, largest = int(model.config.vocab_size), max(args.nodes)
    if max(4, largest) > vocab:
        raise DFlashInputError(f"--nodes {largest}: a tree of that size draws {max(4, largest)} distinct tokens per "
                               f"depth, more than the target's vocabulary of {vocab}")
    if context + largest > max_positions(model):
        raise DFlashInputError(f"--context_tokens {context} + a tree of {largest} nodes (--nodes) exceeds the "
                               f"target's max_position_embeddings={max_positions(model)}")


# --------------------------------------------------------------------------- trees


def make_trees(sizes: list[int], vocab: int, seed: int = 0) -> dict[str, object]:
    """{case name: DraftTree}: one chain and (for n > 2) one bushy DDTree of exactly n nodes."""
    from tensorrt_llm_dflash.tree import build_chain, build_ddtree

    rng = np.random.default_rng(seed)
    trees = {}
    for n in sizes:
        if n == 1:
            trees["n=1"] = build_chain(int(rng.integers(vocab)), [])
            continue
        trees[f"chain {n}"] = build_chain(int(rng.integers(vocab)), rng.integers(0, vocab, n - 1))
        if n > 2:
            depth, k = 7, max(4, n)  # a block-8 drafter's 7 depths; k wide enough for n - 1 nodes
            # Flat-ish marginals: the best-first search spreads over several depths and ranks.
            logp = np.sort(np.log(rng.dirichlet(np.full(k, 0.7), size=depth)), axis=1)[:, ::-1]
            tokens = np.stack([rng.choice(vocab, k, replace=False) for _ in range(depth)])
            tree = build_ddtree(int(rng.integers(vocab)), logp, tokens, n - 1)
            assert tree.num_nodes == n, (n, tree.num_nodes)
            trees[f"tree {n}"] = tree
    return trees


def tree_shape(tree) -> str:
    return f"depth {tree.max_depth}, {int(np.sum(np.bincount(tree.parents[1:] + 1) > 1))} branching nodes"


# ------------------------------------------------------------------------- timing


def verify_once(verifier, tree) -> tuple[float, float, torch.Tensor]:
    """(compile seconds, verify seconds, logits); the cache is cropped back afterwards."""
    t0 = time.perf_counter()
    compiled = verifier.compile_tree(tree)
    t1 = time.perf_counter()
    logits, _features = verifier.verify(compiled)
    verifier.synchronize()
    t2 = time.perf_counter()
    crop_cache(verifier.cache, verifier.past_len)
    return t1 - t0, t2 - t1, logits


class Breakdown:
    """Seconds per component, from module hooks and wrapped functions (perf_counter)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._start: dict[int, float] = {}
        self._undo: list = []

    def module(self, module: torch.nn.Module, name: str) -> None:
        key = id(module)

        def pre(_m, _args):
            self._start[key] = time.perf_counter()

        def post(_m, _args, _out):
            self.seconds[name] += time.perf_counter() - self._start.pop(key)

        # prepend: the timer wraps the verifier's own capture hooks too (timed separately)
        h1 = module.register_forward_pre_hook(pre, prepend=True)
        h2 = module.register_forward_hook(post)
        self._undo += [h1.remove, h2.remove]

    def timed(self, fn, name: str):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t

        return wrapper

    def patch(self, owner, attr: str, name: str, mapping: bool = False) -> None:
        if mapping:
            had_local = attr in owner._local_mapping
            old = owner[attr]
            owner[attr] = self.timed(old, name)
            self._undo.append(lambda: owner.__setitem__(attr, old) if had_local else owner.__delitem__(attr))
        else:
            old = owner.__dict__.get(attr)
            setattr(owner, attr, self.timed(getattr(owner, attr), name))
            self._undo.append(lambda: setattr(owner, attr, old) if old is not None else delattr(owner, attr))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


@contextlib.contextmanager
def instrumented(verifier):
    """Hooks and wrappers on the model and the verifier's cache; everything is undone on exit."""
    import transformers.masking_utils as masking
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import tensorrt_llm_dflash.target as target_module

    model = verifier.model
    decoder = model.get_decoder()
    modeling = sys.modules[type(decoder).__module__]
    b = Breakdown()
    b.module(decoder.embed_tokens, "embedding")
    if hasattr(decoder, "rotary_emb"):
        b.module(decoder.rotary_emb, "rope tables")
    for fn in ("create_causal_mask", "create_sliding_window_causal_mask"):
        if hasattr(modeling, fn):
            b.patch(modeling, fn, "HF mask building")
        elif hasattr(masking, fn):
            b.patch(masking, fn, "HF mask building")
    if hasattr(modeling, "apply_rotary_pos_emb"):
        b.patch(modeling, "apply_rotary_pos_emb", "layer: rope")
    b.patch(ALL_ATTENTION_FUNCTIONS, model.config._attn_implementation, "layer: sdpa", mapping=True)
    b.patch(target_module, "sdpa_gqa_attention", "layer: sdpa")  # what the fast path installs instead
    b.patch(verifier.cache, "update", "layer: kv cache update")
    for layer in decoder.layers:
        b.module(layer, "_layer")
        b.module(layer.self_attn, "_attn")
        b.module(layer.mlp, "_mlp")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            b.module(getattr(layer, norm), "layer: norms")
        for proj in ("q_proj", "k_proj", "v_proj"):
            b.module(getattr(layer.self_attn, proj), "layer: q/k/v proj")
        b.module(layer.self_attn.o_proj, "layer: o proj")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if hasattr(layer.mlp, proj):
                b.module(getattr(layer.mlp, proj), "layer: mlp gemms")
        # the verifier's feature-capture hook, if any
        for hid, hook in list(layer._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").startswith("HFTargetVerifier"):
                layer._forward_hooks[hid] = b.timed(hook, "feature capture hooks")
                b._undo.append(lambda d=layer._forward_hooks, k=hid, h=hook: d.__setitem__(k, h))
    b.module(decoder.norm, "final norm")
    b.module(model.get_output_embeddings(), "lm_head")
    try:
        yield b
    finally:
        b.close()


def component_rows(seconds: dict[str, float]) -> dict[str, float]:
    """Derived rows: attention and MLP remainders, residual adds."""
    s = dict(seconds)
    attn = s.pop("_attn", 0.0)
    mlp = s.pop("_mlp", 0.0)
    layer = s.pop("_layer", 0.0)
    capture = s.get("feature capture hooks", 0.0)
    attn_parts = sum(s.get(k, 0.0) for k in ("layer: q/k/v proj", "layer: o proj", "layer: rope",
                                              "layer: kv cache update", "layer: sdpa"))
    s["layer: attn reshapes etc"] = attn - attn_parts
    s["layer: mlp act * up"] = mlp - s.get("layer: mlp gemms", 0.0)
    s["layer: residual adds etc"] = layer - capture - attn - mlp - s.get("layer: norms", 0.0)
    return s


ROW_ORDER = [
    "tree compile (mask)", "embedding", "HF mask building", "rope tables",
    "layer: norms", "layer: q/k/v proj", "layer: rope", "layer: kv cache update", "layer: sdpa",
    "layer: attn reshapes etc", "layer: o proj", "layer: mlp gemms", "layer: mlp act * up",
    "layer: residual adds etc", "final norm", "lm_head", "feature capture hooks",
]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return profile(args)
    except DFlashError as err:  # a target that does not load, or that the flags do not fit
        cli.print_error(err)
        return 2


@torch.no_grad()  # scoped: a global set_grad_enabled(False) outlived an in-process main() (training afterwards broke)
def profile(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    from tensorrt_llm_dflash.target import HFTargetVerifier, load_target

    model, tokenizer = load_target(args.target_model_dir)
    ids = chat_token_ids(tokenizer, [{"role": "user", "content": PROMPT}])
    if args.context_tokens:
        ids = (ids * (args.context_tokens // len(ids) + 1))[: args.context_tokens]
    check_fits(model, args, len(ids))
    layer_ids = args.layer_ids
    verifier = HFTargetVerifier(model, layer_ids)
    verifier.prefill(ids)
    trees = make_trees(args.nodes, int(model.config.vocab_size))
    layers = len(verifier._layers)
    print(f"target: {model.config.model_type}, {layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, {model.dtype}; context {len(ids)} tokens; "
          f"threads {torch.get_num_threads()}; captured layers {layer_ids}")
    for name, tree in trees.items():
        print(f"  {name}: {tree_shape(tree)}")

    variants = [("reference", False), ("fast", True)] if args.compare else [("as built", verifier.fast)]
    for vname, fast in variants:
        verifier.fast = fast
        print(f"  [{vname}] fast={fast}: fast paths {verifier.fast_paths()}")
    wall = {(v, c): [] for v, _ in variants for c in trees}
    compile_s = {(v, c): [] for v, _ in variants for c in trees}
    logits = {}
    for rep in range(args.warmup + args.reps):
        for vname, fast in variants:
            verifier.fast = fast
            for case, tree in trees.items():
                tc, tv, lg = verify_once(verifier, tree)
                if rep == 0:  # whatever --warmup is (0: the first pass is timed too)
                    logits[vname, case] = lg.clone()
                if rep >= args.warmup:
                    wall[vname, case].append(tv)
                    compile_s[vname, case].append(tc)
    print(f"\nverify wall time, median of {args.reps} (ms); (x) = ratio to n=1 of the same variant")
    others = [v for v, _ in variants[1:]] if args.compare else []
    head = f"{'case':<10}" + "".join(f"{v:>22}" for v, _ in variants)
    head += "".join(f"{v + '/ref':>12}{'max|dlogit|':>13}" for v in others)
    print(head)
    first = next(iter(trees))
    for case in trees:
        line = f"{case:<10}"
        for vname, _ in variants:
            med = statistics.median(wall[vname, case]) * 1e3
            base = statistics.median(wall[vname, first]) * 1e3
            line += f"{med:>14.1f} ({med / base:4.2f}x)"
        for vname in others:
            ratio = statistics.median(wall[vname, case]) / statistics.median(wall["reference", case])
            diff = (logits[vname, case] - logits["reference", case]).abs().max().item()
            line += f"{ratio:>12.2f}{diff:>13.1e}"
        print(line)
    if others:
        print("(max|dlogit|: fast vs reference logits of the same verify; 0 = bit-identical)")

    if args.no_breakdown:
        return 0
    for vname, fast in variants:
        verifier.fast = fast
        table: dict[str, dict[str, float]] = {}
        totals: dict[str, float] = {}
        for case, tree in trees.items():
            for _ in range(args.warmup):
                verify_once(verifier, tree)
            with instrumented(verifier) as b:
                inst_wall = []
                for _ in range(args.reps):
                    tc, tv, _lg = verify_once(verifier, tree)
                    inst_wall.append(tv)
                    b.seconds["tree compile (mask)"] += tc
            rows = {k: v / args.reps * 1e3 for k, v in component_rows(b.seconds).items()}
            plain = statistics.median(wall[vname, case]) * 1e3
            mean_inst = statistics.fmean(inst_wall) * 1e3
            rows["other (Python/HF glue, hooks)"] = mean_inst - sum(v for k, v in rows.items()
                                                                    if k != "tree compile (mask)")
            table[case] = rows
            totals[case] = (plain, mean_inst)
        print(f"\nbreakdown [{vname}] (ms per verify, mean of {args.reps} instrumented passes; "
              f"'layer:' rows are summed over {layers} layers)")
        print(f"{'component':<32}" + "".join(f"{c:>11}" for c in trees) + f"{'per layer @' + first:>16}")
        names = [r for r in ROW_ORDER if any(r in t for t in table.values())]
        names += ["other (Python/HF glue, hooks)"]
        for r in names:
            line = f"{r:<32}" + "".join(f"{table[c].get(r, 0.0):>11.2f}" for c in trees)
            if r.startswith("layer:"):
                line += f"{table[first].get(r, 0.0) / layers:>16.3f}"
            print(line)
        print(f"{'= instrumented verify':<32}" + "".join(f"{totals[c][1]:>11.2f}" for c in trees))
        print(f"{'plain verify (median)':<32}" + "".join(f"{totals[c][0]:>11.2f}" for c in trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
