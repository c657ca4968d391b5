"""The drafter's output head: its logits over the draft vocabulary, on a CPU through oneDNN.

Every DFlash proposer (eager, static-cache, LoRA injection, DFlash2) ends with ``hidden @ W.T`` over the
target's lm_head rows (the reduced draft vocabulary where the drafter has one), for the ``block - 1`` positions
of each row's block. A draft only proposes: the target verifies every node, so the draft's logits need not be
any particular GEMM's bit for bit; only their speed and their ranking matter.

On a CPU in float32 that product is the draft's largest cost, and MKL's sgemm takes the slow road at those
shapes: for a few rows and a weight far larger than the L2 cache it re-reads the weight every few rows (see
``target.BlockedLinear``), and for the static drafter's ``[rows, block - 1, H]`` view (a slice of the block) it
runs one GEMM per row. On the 2-core AMD EPYC the shipped drafter's head (26,040 x 576) costs 20 ms at 7 rows
(one row's block) through ``matmul`` and 4.4 ms through oneDNN's linear; for that view of 16 rows 91 ms against
18 ms (a whole draft: 21 -> 8 ms at 1 row, 110-124 -> 39-45 ms at 16). So on a CPU, for float32,
:class:`DraftHead` runs oneDNN's linear (the op torch's own CPU compiler lowers linears to), checked once against
``matmul`` on the weight itself; anywhere else, or where that op is missing or disagrees, plain ``matmul``. The
verifier's numbers are never touched.
"""

from __future__ import annotations

import warnings

import torch

#: How far oneDNN's logits may stray from ``matmul``'s at the check (relative to the largest logit): rounding
#: of a different summation order, never a different product.
CHECK_TOLERANCE = 1e-4


def _onednn_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")


class DraftHead:
    """``hidden [..., H] -> logits [..., V]`` over ``weight [V, H]`` (never copied: a view of the lm_head or the
    draft vocabulary's rows). ``backend`` says which route it takes: ``"onednn"`` or ``"matmul"``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.backend = "onednn" if self._onednn_agrees() else "matmul"

    def _onednn_agrees(self) -> bool:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            return False
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        probe = torch.linspace(-1.0, 1.0, 3 * w.shape[1], dtype=w.dtype).view(3, w.shape[1])
        try:
            with torch.inference_mode():
                fast, plain = _onednn_linear(probe, w), probe @ w.T
        except RuntimeError:
            return False
        scale = float(plain.abs().max()) or 1.0
        return fast.shape == plain.shape and float((fast - plain).abs().max()) <= CHECK_TOLERANCE * scale

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.weight.device, self.weight.dtype)
        if self.backend == "onednn":
            try:
                return _onednn_linear(hidden, self.weight)
            except RuntimeError as error:  # a shape or mode the check did not cover: matmul from now on
                warnings.warn(f"oneDNN draft head failed ({error}); using matmul", RuntimeWarning, stacklevel=2)
                self.backend = "matmul"
        return hidden @ self.weight.T
