"""The verifier's CPU fast paths (target.CpuFastPaths): blocked linears and GQA attention with a mask.

Both must leave every number as the model's own modules compute it:

* ``BlockedLinear`` is bit-identical to ``F.linear`` for the embedded target's shapes at
  M = 1..130 rows (every count to 32, then a stride, and the ends of the blocked range 1..128; 1 and 2
  threads) on every CPU: each row count takes the route its run-time check found bit-identical there
  (``bmm``, ``loop`` or ``F.linear``). Which routes a CPU allows is reported (``-s`` prints them), never
  asserted: it is the BLAS's choice.
* ``sdpa_gqa_attention`` is bit-identical to transformers' ``sdpa_attention_forward``.
* The fast paths are taken in prefill and verify and leave the model as they found it;
  verify logits, features and KV caches equal the reference path's bit for bit (float32
  and float64), so greedy speculative output still equals AR output.
* The embedded SmolLM2 target (slow): the same, and the shipped drafter's chain and DDTree
  outputs equal AR and transformers' generate for 64 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import NoisyOracleProposer, Top2Proposer, hf_greedy, tiny_target

import tensorrt_llm_dflash.target as target_mod
from tensorrt_llm_dflash.compat import chat_token_ids, crop_cache
from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.target import (
    BLOCKED_ROWS,
    ROUTES,
    BlockedLinear,
    CpuFastPaths,
    HFTargetVerifier,
    sdpa_gqa_attention,
)
from tensorrt_llm_dflash.tree import build_chain, build_ddtree


def linear_module(out_features: int, in_features: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).eval()


@pytest.fixture
def threads():
    """Set torch's thread count for one test (conftest runs tests with one thread)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- BlockedLinear

#: SmolLM2-135M's MLP and lm_head weights (out, in).
SMOLLM2_SHAPES = [(1536, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES)
def test_blocked_linear_is_bit_identical_to_linear_whichever_route(threads, num_threads, shape, record_property):
    """The contract on every CPU: the forward equals F.linear bit for bit at every row count, and each
    route it takes is itself bit-identical there. Which routes a CPU allows is reported, not asserted."""
    threads(num_threads)
    module = linear_module(*shape)
    fast = BlockedLinear(module)
    x = torch.randn(1, BLOCKED_ROWS.stop + 2, shape[1], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        routes = fast.routes()
        record_property("routes", routes)
        print(f"[routes] {shape} x{num_threads}: {routes}")
        assert set(routes) == set(BLOCKED_ROWS) and set(routes.values()) <= set(ROUTES)
        if shape[0] * shape[1] < target_mod.LOOP_MIN_WEIGHT_ELEMENTS:
            assert "loop" not in routes.values()  # one mm per block is for weights far beyond L2 only
        for m in [*range(1, 33), *range(33, BLOCKED_ROWS.stop, 7), *range(BLOCKED_ROWS.stop - 2, BLOCKED_ROWS.stop + 2)]:
            ref = F.linear(x[:, :m], module.weight)
            route = routes.get(m, "linear")
            if route != "linear":
                taken = fast.blocked if route == "bmm" else fast.looped
                assert torch.equal(taken(x[0, :m]), ref[0]), (shape, m, route)
            assert torch.equal(fast(x[:, :m]), ref), (shape, m, route)


@pytest.mark.parametrize("route", ["bmm", "loop"])
def test_each_route_computes_the_product(route):
    """Both blocked formulations compute x @ W.T (to rounding) whether or not a CPU makes them bit-identical."""
    fast = BlockedLinear(linear_module(1000, 576))  # 7 blocks of 128 + 104 remaining rows
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = fast.blocked(x) if route == "bmm" else fast.looped(x)
    torch.testing.assert_close(out, F.linear(x, fast.module.weight), rtol=1e-5, atol=1e-5)


def test_blocked_block_size_and_remainder():
    fast = BlockedLinear(linear_module(1000, 576))  # 1000 = 7 blocks of 128 + 104 rows
    assert fast.block == 128
    assert BlockedLinear(linear_module(576, 1536)).block == 64
    assert BlockedLinear(linear_module(8, 4096)).block == 8  # never more rows than the weight has
    x = torch.randn(9, 576)
    with torch.inference_mode():
        out = fast.blocked(x)
    torch.testing.assert_close(out, F.linear(x, fast.module.weight), rtol=1e-5, atol=1e-5)


def _route_key(fast: BlockedLinear, m: int) -> tuple:
    w = fast.module.weight
    return (tuple(w.shape), w.dtype, torch.get_num_threads(), fast.block, m)


def test_the_route_follows_the_run_time_check(monkeypatch):
    """Whatever this CPU's BLAS does, the forward calls the route the check recorded, and only for 1..128 rows."""
    module = linear_module(1536, 576)
    fast = BlockedLinear(module)
    calls = []
    for name in ("blocked", "looped"):
        original = getattr(BlockedLinear, name)
        monkeypatch.setattr(BlockedLinear, name,
                            lambda self, rows, _n=name, _f=original: calls.append((_n, len(rows))) or _f(self, rows))
    with torch.inference_mode():
        for route, expected in (("bmm", [("blocked", 9)]), ("loop", [("looped", 9)]), ("linear", [])):
            monkeypatch.setitem(target_mod._BLOCKED_ROUTE, _route_key(fast, 9), route)
            calls.clear()
            fast(torch.randn(9, 576))
            assert calls == expected, route
        monkeypatch.setitem(target_mod._BLOCKED_ROUTE, _route_key(fast, 9), "bmm")
        calls.clear()
        # rows outside 1..128, non-contiguous rows: F.linear, and no check runs for them
        for x in (torch.randn(0, 576), torch.randn(129, 576), torch.randn(200, 576), torch.randn(576, 9).t()):
            assert torch.equal(fast(x), F.linear(x, module.weight))
        assert calls == []
        assert fast.route(0) == fast.route(129) == "linear"


def test_the_check_takes_the_first_bit_identical_route(monkeypatch):
    """bmm if it is bit-identical, else loop (large weights only), else linear: driven by a fake BLAS result."""
    def check(bmm_exact: bool, loop_exact: bool, rows: int, cols: int) -> str:
        target_mod._BLOCKED_ROUTE.clear()
        fast = BlockedLinear(linear_module(rows, cols))
        exact = lambda self, x: F.linear(x, self.module.weight)  # noqa: E731
        off = lambda self, x: F.linear(x, self.module.weight) + 1.0  # noqa: E731
        monkeypatch.setattr(BlockedLinear, "blocked", exact if bmm_exact else off)
        monkeypatch.setattr(BlockedLinear, "looped", exact if loop_exact else off)
        return fast.route(9)

    monkeypatch.setattr(target_mod, "LOOP_MIN_WEIGHT_ELEMENTS", 1536 * 576)
    assert check(True, True, 1536, 576) == "bmm"
    assert check(False, True, 1536, 576) == "loop"
    assert check(False, False, 1536, 576) == "linear"
    assert check(False, True, 576, 1535) == "linear"  # below the loop threshold: not tried
    target_mod._BLOCKED_ROUTE.clear()


def test_blocked_follows_a_replaced_weight():
    module = linear_module(1536, 576)
    fast = BlockedLinear(module)
    x = torch.randn(9, 576)
    with torch.inference_mode():
        fast(x)
    module.weight = torch.nn.Parameter(torch.randn(1536, 576))
    with torch.inference_mode():
        assert torch.equal(fast(x), F.linear(x, module.weight))
    with torch.no_grad():
        module.weight.data = torch.randn(1536, 576)  # new storage under the same Parameter
        module.weight.mul_(2.0)  # in place: the blocks are views, they see it
    with torch.inference_mode():
        assert torch.equal(fast(x), F.linear(x, module.weight))


def test_blocked_supports_only_plain_float32_cpu_linears():
    class MyLinear(torch.nn.Linear):
        pass

    assert BlockedLinear.supports(linear_module(8, 8))
    assert not BlockedLinear.supports(linear_module(8, 8, bias=True))
    assert not BlockedLinear.supports(linear_module(8, 8).double())
    assert not BlockedLinear.supports(MyLinear(8, 8))
    hooked = linear_module(8, 8)
    hooked.forward = lambda x: x  # someone else's forward (accelerate hooks do this)
    assert not BlockedLinear.supports(hooked)
    assert not BlockedLinear.supports(torch.nn.Embedding(8, 8))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 9, 33])
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool"])
def test_sdpa_gqa_is_bit_identical_to_transformers(dtype, n, mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(n)
    # No mask means a prefill (transformers builds one whenever there is a past): no past then.
    past = 0 if mask_kind == "none" and n > 1 else 57
    length = past + n
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    module.is_causal = True
    q = torch.randn(1, 9, n, 64, generator=gen, dtype=dtype)
    k = torch.randn(1, 3, length, 64, generator=gen, dtype=dtype)
    v = torch.randn(1, 3, length, 64, generator=gen, dtype=dtype)
    mask = longer = None
    if mask_kind != "none":
        allowed = torch.rand(n, length + 5, generator=gen) < 0.7
        allowed[:, 0] = True
        if mask_kind == "bool":
            longer = allowed[None, None]
        else:
            longer = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
        mask = longer[..., :length]
    with torch.inference_mode():
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
        out, _ = sdpa_gqa_attention(module, q, k, v, mask, scaling=0.125)
        assert torch.equal(out, ref)
        if longer is not None:
            # transformers 4.57 built masks over the whole static cache and cut them to the keys here
            # (5.x builds them to size and no longer cuts): a longer mask still gives the same output.
            cut, _ = sdpa_gqa_attention(module, q, k, v, longer, scaling=0.125)
            assert torch.equal(cut, ref)


# ------------------------------------------------------------------- the verifier


def fp32_target(arch: str = "llama", seed: int = 0):
    return tiny_target(arch, seed=seed, vocab=64, layers=4, hidden=32, dtype=torch.float32)


@pytest.fixture
def every_linear(monkeypatch):
    """Tiny targets' weights are far below the size threshold: route every linear through BlockedLinear."""
    monkeypatch.setattr(target_mod, "BLOCKED_MIN_WEIGHT_ELEMENTS", 0)


def bushy_tree(root: int, vocab: int, budget: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logp = np.sort(np.log(rng.dirichlet(np.full(6, 0.7), size=4)), axis=1)[:, ::-1]
    tokens = np.stack([rng.choice(vocab, 6, replace=False) for _ in range(4)])
    return build_ddtree(root, logp, tokens, budget)


def verify_logits(verifier, prompt, tree):
    verifier.prefill(prompt)
    return verifier.verify(verifier.compile_tree(tree))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_path_is_taken_and_undone(every_linear, arch, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # Which row counts may block is the CPU's business (test_blocked_linear_is_bit_identical_...): here every
    # count in 4..15 takes the bmm route, so the count of blocked calls below is the same on every machine.
    # (The shipped range, 1..128, holds every tree these tiny targets verify; 4..15 lets them straddle it.)
    monkeypatch.setattr(target_mod, "BLOCKED_ROWS", range(4, 16))
    monkeypatch.setattr(BlockedLinear, "route", lambda self, m: "bmm" if m in target_mod.BLOCKED_ROWS else "linear")
    model = fp32_target(arch)
    verifier = HFTargetVerifier(model, [1, 2])
    assert verifier.fast_paths() == ["blocked_linear", "sdpa_gqa"]
    calls = {"blocked": 0, "attn": 0}
    blocked, attn = BlockedLinear.blocked, target_mod.sdpa_gqa_attention

    def counting_blocked(self, rows):
        calls["blocked"] += 1
        return blocked(self, rows)

    def counting_attn(*args, **kwargs):
        calls["attn"] += 1
        return attn(*args, **kwargs)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockedLinear, "blocked", counting_blocked)
        mp.setattr(target_mod, "sdpa_gqa_attention", counting_attn)
        verifier.prefill([3, 5, 7, 11, 13, 17])  # 6 rows: every linear but the lm_head (1 row) blocks
        assert calls == {"blocked": len(linears) - 1, "attn": 4}
        for tree, blocks in ((build_chain(2, []), 0), (build_chain(2, [4, 6, 8, 10, 12, 14, 16, 18]), len(linears)),
                             (bushy_tree(2, 64, 12), len(linears)), (bushy_tree(2, 64, 20), 0)):
            calls.update(blocked=0, attn=0)
            verifier.verify(verifier.compile_tree(tree))
            crop_cache(verifier.cache, verifier.past_len)
            assert calls == {"blocked": blocks, "attn": 4}, tree.num_nodes
    # the model is left as it was found: no instance forward, no attention override
    assert all("forward" not in m.__dict__ for m in linears)
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    # outside the verifier, and with fast=False, the model runs its own modules
    calls.update(blocked=0, attn=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockedLinear, "blocked", counting_blocked)
        mp.setattr(target_mod, "sdpa_gqa_attention", counting_attn)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]]))
        verifier.fast = False
        assert verifier.fast_paths() == []
        verifier.prefill([3, 5, 7, 11, 13, 17])
    assert calls == {"blocked": 0, "attn": 0}


def test_fast_paths_apply_to_float32_cpu_models_only():
    model = fp32_target()
    assert CpuFastPaths(model).names() == ["sdpa_gqa"]  # 32x32 weights: below the blocked-linear threshold
    assert HFTargetVerifier(tiny_target("llama", dtype=torch.float64), []).fast_paths() == []


def test_fast_path_restores_the_model_after_an_error(every_linear):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = fp32_target()
    verifier = HFTargetVerifier(model, [])
    verifier.prefill([1, 2, 3])
    bad = verifier.compile_tree(build_chain(2, [3, 4, 5, 6]))
    bad["input_ids"] = bad["input_ids"].clone()
    bad["input_ids"][0, 1] = 10**6  # outside the embedding: the forward raises
    with pytest.raises(IndexError):
        verifier.verify(bad)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def assert_same_verify(model, prompt, trees, layer_ids):
    for tree in trees:
        fast, ref = HFTargetVerifier(model, layer_ids), HFTargetVerifier(model, layer_ids, fast=False)
        (lf, ff), (lr, fr) = verify_logits(fast, prompt, tree), verify_logits(ref, prompt, tree)
        assert torch.equal(lf, lr) and torch.equal(ff, fr), tree.num_nodes
        for (k, v), (rk, rv) in zip(fast.cache_tensors(), ref.cache_tensors(), strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_verify_is_bit_identical_float32(every_linear, arch):
    model = fp32_target(arch, seed=3)
    trees = (build_chain(4, []), build_chain(4, [6, 1, 40, 3, 3, 9, 12, 50]), bushy_tree(4, 64, 8, seed=1),
             bushy_tree(4, 64, 14, seed=2), bushy_tree(4, 64, 24, seed=3))
    assert_same_verify(model, [5, 9, 13, 2, 7, 33, 21, 8], trees, [1, 3])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_verify_is_bit_identical_float64(arch):
    model = tiny_target(arch, seed=4, dtype=torch.float64)  # only the attention path applies
    trees = (build_chain(4, []), build_chain(4, [6, 1, 40, 3]), bushy_tree(4, 64, 12, seed=2))
    assert_same_verify(model, [5, 9, 13, 2, 7], trees, [0, 2])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [0, 1, 6, 16])
def test_float32_speculative_equals_ar_with_fast_paths(every_linear, seed, budget):
    model = fp32_target("qwen3" if seed % 2 else "llama", seed=seed)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(2, 64, 6)]
    n = 40
    ar = speculative_generate(HFTargetVerifier(model, []), None, prompt, n).output_ids
    assert ar == hf_greedy(model, prompt, n)
    for proposer_cls in (NoisyOracleProposer, Top2Proposer):
        proposer = proposer_cls(prompt + ar, block_size=9, vocab=64, seed=seed)
        result = speculative_generate(HFTargetVerifier(model, [1, 3]), proposer, prompt, n, ddtree_budget=budget)
        assert result.output_ids == ar, (proposer_cls.__name__, budget)


# ------------------------------------------------------------------- the embedded target

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Complete the function:\n\ndef fizzbuzz(n: int) -> list[str]:\n    \"\"\"FizzBuzz from 1 to n.\"\"\"\n",
    "Explain in two sentences what a hash table is.",
]


@pytest.fixture(scope="module")
def smollm2():
    from tensorrt_llm_dflash.target import load_target

    try:
        return load_target(None)
    except Exception as err:  # noqa: BLE001 - report the reason, the setup script installs it
        pytest.fail(f"embedded target unavailable: {err}")


@pytest.mark.slow
@pytest.mark.parametrize("num_threads", [1, 2])
def test_smollm2_fast_verify_is_bit_identical(smollm2, threads, num_threads):
    threads(num_threads)
    model, tok = smollm2
    prompt = chat_token_ids(tok, [{"role": "user", "content": PROMPTS[0]}])
    paths = CpuFastPaths(model)
    assert "sdpa_gqa" in paths.names()
    # Reported, not asserted: which row counts a blocked route serves is the CPU's BLAS's choice.
    print(f"[fast paths] x{num_threads}: {paths.names()}; blocked routes {paths.blocked_routes()}")
    rng = np.random.default_rng(0)
    trees = (build_chain(28, []), build_chain(28, rng.integers(0, 49152, 8)), bushy_tree(28, 49152, 8, seed=3),
             bushy_tree(28, 49152, 14, seed=4), bushy_tree(28, 49152, 32, seed=5))
    assert_same_verify(model, prompt, trees, [1, 8, 14, 20, 27])


@pytest.mark.slow
def test_smollm2_demo_drafter_is_lossless_with_fast_paths(smollm2):
    from tensorrt_llm_dflash.assets import demo_drafter_dir
    from tensorrt_llm_dflash.drafter import load_dflash_drafter
    from tensorrt_llm_dflash.proposer import DFlashProposer

    model, tok = smollm2
    drafter = load_dflash_drafter(str(demo_drafter_dir()), dtype=torch.float32)
    proposer = DFlashProposer.for_target(drafter, model)
    n = 64
    stops = [model.generation_config.eos_token_id]
    for text in PROMPTS:
        prompt = chat_token_ids(tok, [{"role": "user", "content": text}])
        ar = speculative_generate(HFTargetVerifier(model, []), None, prompt, n, stop_token_ids=stops).output_ids
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        assert ar == hf[0, len(prompt):].tolist(), text
        for budget in (0, 8, 32):
            verifier = HFTargetVerifier(model, drafter.config.target_layer_ids)
            out = speculative_generate(verifier, proposer, prompt, n, stop_token_ids=stops, ddtree_budget=budget)
            assert out.output_ids == ar, (text, budget)
            assert out.stats.steps < len(ar)
