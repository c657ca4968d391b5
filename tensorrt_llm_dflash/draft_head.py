"""The drafter's output head and its own linear layers: on a float32 CPU through oneDNN.

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

The drafter's own layers (its context projection, attention projections and MLPs) are small weights of a few
rows a call, the same slow road at a smaller scale: :class:`DraftLinears` runs them through oneDNN too, during
a draft call only (the modules are never changed outside it, so training and every other caller see plain
``nn.Linear``). On the 2-core EPYC, one row's draft of the shipped drafter: context extension 1.13 -> 0.56 ms,
the block's two layers 2.97 -> 1.96 ms (in-process, medians of 30, scratch).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

#: How far oneDNN's logits may stray from ``matmul``'s at the check (relative to the largest logit): rounding
#: of a different summation order, never a different product.
CHECK_TOLERANCE = 1e-4


def _onednn_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")


def onednn_agrees(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear can take ``weight`` [out, in] here: a float32 CPU matrix, the op present, and its
    product on three probe rows within ``CHECK_TOLERANCE`` of ``matmul``'s."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    w = weight.detach()
    probe = torch.linspace(-1.0, 1.0, 3 * w.shape[1], dtype=w.dtype).view(3, w.shape[1])
    try:
        with torch.inference_mode():
            fast, plain = _onednn_linear(probe, w), probe @ w.T
    except RuntimeError:
        return False
    scale = float(plain.abs().max()) or 1.0
    return fast.shape == plain.shape and float((fast - plain).abs().max()) <= CHECK_TOLERANCE * scale


class DraftHead:
    """``hidden [..., H] -> logits [..., V]`` over ``weight [V, H]`` (never copied: a view of the lm_head or the
    draft vocabulary's rows). ``backend`` says which route it takes: ``"onednn"`` or ``"matmul"``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.backend = "onednn" if onednn_agrees(self.weight) else "matmul"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.weight.device, self.weight.dtype)
        if self.backend == "onednn":
            try:
                return _onednn_linear(hidden, self.weight)
            except RuntimeError as error:  # a shape or mode the check did not cover: matmul from now on
                warnings.warn(f"oneDNN draft head failed ({error}); using matmul", RuntimeWarning, stacklevel=2)
                self.backend = "matmul"
        return hidden @ self.weight.T


class DraftLinears:
    """A drafter's plain ``nn.Linear`` layers through oneDNN, installed for the length of a draft call.

    Built once per proposer: every plain bias-free ``nn.Linear`` (no subclass, no forward of its own) whose weight
    passes :func:`onednn_agrees`; none on any other device or dtype. :meth:`installed` swaps their forwards for
    oneDNN's linear and restores them on the way out, also on error. A call that oneDNN refuses (a shape or mode
    the check did not cover, autograd on) warns once and takes ``F.linear`` for that layer from then on.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules()
                       if type(m) is nn.Linear and "forward" not in m.__dict__ and m.bias is None
                       and onednn_agrees(m.weight)]

    @property
    def backend(self) -> str:
        return "onednn" if self.layers else "linear"

    def _forward(self, layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        failed = False

        def forward(x: torch.Tensor) -> torch.Tensor:
            nonlocal failed
            if not failed:
                try:
                    return _onednn_linear(x, layer.weight.detach())
                except RuntimeError as error:
                    warnings.warn(f"oneDNN draft layer failed ({error}); using F.linear for it", RuntimeWarning,
                                  stacklevel=2)
                    failed = True
                    self.layers = [m for m in self.layers if m is not layer]
            return nn.functional.linear(x, layer.weight)
        return forward

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        swapped: list[nn.Linear] = []
        try:
            for layer in self.layers:
                if "forward" in layer.__dict__:  # someone else's forward (a hook) came since: leave it
                    continue
                layer.forward = self._forward(layer)
                swapped.append(layer)
            yield
        finally:
            for layer in swapped:
                layer.__dict__.pop("forward", None)
