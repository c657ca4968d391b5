"""Graph-building helpers for the engine tests (used inside an active stand-in)."""

from __future__ import annotations


def old_layout_tree_mask(tree_mask, padded: bool):
    """plugins.tree_mask, then cut to the layout the plugin produced before the fix: rows of
    ceil(N / 32) words, offsets N wide. ``padded`` keeps the mask inside a buffer of 2 * N rows."""
    from tensorrt_llm.functional import concat, constant, expand, shape, slice

    def compact(parents, lengths, *, max_nodes):
        import numpy as np

        packed, offsets, lengths_out = tree_mask(parents, lengths, max_nodes=max_nodes)
        n = shape(parents, 1)
        words = (n + 31) // 32
        packed = slice(packed, [0, 0], concat([shape(packed, 0), words]))
        if padded:
            zeros = expand(constant(np.zeros((1, 1), np.int32)), concat([shape(packed, 0), words]))
            packed = concat([packed, zeros], dim=0)
        offsets = slice(offsets, [0, 0], concat([shape(offsets, 0), n]))
        return packed, offsets, lengths_out

    return compact
