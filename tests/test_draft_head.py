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
