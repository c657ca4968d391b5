"""The drafter's output head (draft_head.DraftHead): oneDNN on a float32 CPU weight, matmul anywhere else, and
every proposer scores its block through it."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_dflash import draft_head
from tensorrt_llm_dflash.draft_head import DraftHead
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.static_state import StaticDrafter
from tests.tiny_models import tiny_drafter, tiny_target

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _weight(rows: int = 300, cols: int = 48, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0), dtype=dtype)


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN (mkldnn) linear")
def test_a_float32_cpu_head_runs_onednn_and_ranks_as_matmul_does():
    weight = _weight()
    head = DraftHead(weight)
    assert head.backend == "onednn"
    gen = torch.Generator().manual_seed(1)
    block = torch.randn(3, 8, weight.shape[1], generator=gen)
    for hidden in (block[0, 1:], block[:, 1:], block.reshape(-1, weight.shape[1])):  # views, as the proposers pass
        got, plain = head(hidden), hidden @ weight.T
        assert got.shape == plain.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), plain.argmax(-1))


def test_float64_and_other_dtypes_stay_on_matmul_bit_for_bit():
    for dtype in (torch.float64, torch.bfloat16):
        weight = _weight(dtype=dtype)
        head = DraftHead(weight)
        assert head.backend == "matmul"
        hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(2), dtype=dtype)
        assert torch.equal(head(hidden), hidden @ weight.T)


def test_a_head_that_disagrees_at_the_check_is_never_used(monkeypatch):
    monkeypatch.setattr(draft_head, "_onednn_linear", lambda hidden, weight: (hidden @ weight.T) + 1.0)
    head = DraftHead(_weight())
    assert head.backend == "matmul"
    hidden = torch.randn(4, 48, generator=torch.Generator().manual_seed(3))
    assert torch.equal(head(hidden), hidden @ head.weight.T)


def test_a_head_that_fails_later_falls_back_to_matmul_with_a_warning(monkeypatch):
    head = DraftHead(_weight())
    head.backend = "onednn"  # as the check left it where oneDNN exists

    def broken(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("unsupported shape")

    monkeypatch.setattr(draft_head, "_onednn_linear", broken)
    hidden = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(4))
    with pytest.warns(RuntimeWarning, match="oneDNN draft head failed .*unsupported shape.*matmul"):
        got = head(hidden)
    assert head.backend == "matmul"
    assert torch.equal(got, hidden @ head.weight.T)


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN (mkldnn) linear")
def test_the_eager_and_static_drafters_score_through_the_same_head():
    """Both proposers of a float32 target take the oneDNN head, and their block logits agree with plain matmul's."""
    target = tiny_target("qwen3", seed=0, vocab=48, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, seed=1, layers=1)
    eager = DFlashProposer.for_target(drafter, target)
    static = StaticDrafter(drafter, target.get_input_embeddings(), target.get_output_embeddings(), capacity=32)
    assert eager.head.backend == static.head.backend == "onednn"
    feats = torch.randn(5, drafter.config.num_context_features, generator=torch.Generator().manual_seed(5))
    got = eager.propose(3, feats)
    eager.reset()
    eager.head = DraftHead(eager.head.weight)
    eager.head.backend = "matmul"
    torch.testing.assert_close(got, eager.propose(3, feats), rtol=1e-5, atol=1e-5)
    static.extend(feats[None], torch.zeros(1, dtype=torch.long))
    drafted = static.draft(torch.tensor([3]), torch.tensor([5]))[0]
    torch.testing.assert_close(drafted, got, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the drafter's own layers


def _plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN (mkldnn) linear")
def test_the_drafters_layers_run_onednn_only_inside_a_draft_call(monkeypatch):
    """Every plain linear of a float32 drafter goes through oneDNN during propose/extend/draft, and the modules are
    the model's own again afterwards (training and any other caller see nn.Linear)."""
    target = tiny_target("qwen3", seed=0, vocab=48, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, seed=1, layers=2)
    linears = _plain_linears(drafter)
    assert linears
    eager = DFlashProposer.for_target(drafter, target)
    static = StaticDrafter(drafter, target.get_input_embeddings(), target.get_output_embeddings(), capacity=32)
    assert eager.linears.backend == static.linears.backend == "onednn"
    assert {id(m) for m in eager.linears.layers} == {id(m) for m in linears}
    seen: list[torch.Size] = []
    real = draft_head._onednn_linear
    monkeypatch.setattr(draft_head, "_onednn_linear", lambda x, w: seen.append(w.shape) or real(x, w))
    feats = torch.randn(5, drafter.config.num_context_features, generator=torch.Generator().manual_seed(6))
    got = eager.propose(3, feats)
    weights = {m.weight.shape for m in linears}
    assert weights <= set(seen)  # every layer's weight went through oneDNN (the head's too)
    assert all("forward" not in m.__dict__ for m in linears)
    seen.clear()
    static.extend(feats[None], torch.zeros(1, dtype=torch.long))
    drafted = static.draft(torch.tensor([3]), torch.tensor([5]))[0]
    assert weights <= set(seen)
    assert all("forward" not in m.__dict__ for m in linears)
    # The same drafts as the model's own nn.Linear layers give, to float32 rounding, with the same ranking.
    plain = DFlashProposer.for_target(drafter, target)
    plain.linears.layers = []
    want = plain.propose(3, feats)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(drafted, want, rtol=1e-4, atol=1e-4)


def test_a_float64_drafter_keeps_its_own_layers(monkeypatch):
    """No oneDNN anywhere in a float64 draft (it would round as float32 never does): the layers are nn.Linear's."""
    target = tiny_target("llama", seed=0, vocab=48, dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=4, seed=1, layers=1)
    eager = DFlashProposer.for_target(drafter, target)
    static = StaticDrafter(drafter, target.get_input_embeddings(), target.get_output_embeddings(), capacity=32)
    assert eager.linears.backend == static.linears.backend == "linear"
    assert eager.linears.layers == static.linears.layers == []

    def never(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise AssertionError("oneDNN called on a float64 drafter")

    monkeypatch.setattr(draft_head, "_onednn_linear", never)
    feats = torch.randn(4, drafter.config.num_context_features, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(7))
    eager.propose(2, feats)
    static.extend(feats[None], torch.zeros(1, dtype=torch.long))
    static.draft(torch.tensor([2]), torch.tensor([4]))


def test_a_drafter_layer_that_fails_falls_back_to_linear_with_one_warning(monkeypatch):
    target = tiny_target("qwen3", seed=0, vocab=48, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, seed=1, layers=1)
    linears = _plain_linears(drafter)
    layers = draft_head.DraftLinears(drafter)
    layers.layers = list(linears)  # as the check leaves them where oneDNN exists

    def broken(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("unsupported mode")

    monkeypatch.setattr(draft_head, "_onednn_linear", broken)
    x = torch.randn(3, linears[0].in_features, generator=torch.Generator().manual_seed(8))
    with pytest.warns(RuntimeWarning, match="oneDNN draft layer failed .*unsupported mode.*F.linear") as caught:
        with layers.installed():
            first, second = linears[0](x), linears[0](x)
    assert len([w for w in caught if "draft layer" in str(w.message)]) == 1  # once, then F.linear for good
    assert torch.equal(first, torch.nn.functional.linear(x, linears[0].weight)) and torch.equal(first, second)
    assert all(m is not linears[0] for m in layers.layers) and len(layers.layers) == len(linears) - 1
    assert "forward" not in linears[0].__dict__


def test_a_layer_whose_check_disagrees_is_not_taken(monkeypatch):
    monkeypatch.setattr(draft_head, "_onednn_linear", lambda x, w: (x @ w.T) + 1.0)
    target = tiny_target("qwen3", seed=0, vocab=48, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, seed=1, layers=1)
    assert draft_head.DraftLinears(drafter).layers == []
