// Per-row logic of the DFlashTreeMask plugin, shared by the CUDA kernel
// (src/cuda/tree_mask_kernels.cu) and the CPU library (src/cpu/dflash_cpu.cpp).
//
// Contract (identical to tensorrt_llm_dflash.tree.batched_tree_inputs), in the layout
// TensorRT-LLM's gpt attention plugin reads (see docs/plugins.md for the kernel sources):
//   parents [batch, N] int32, -1 at the root (index 0), parents[i] < i otherwise;
//   lengths [batch] int32, 1 <= lengths[b] <= N; entries past the length are padding.
//   M = max_nodes >= N: the engine's spec_decoding_max_generation_length (max_draft_len + 1).
//   packed  [batch * N, ceil(M/32)] int32, rows packed tightly: node i of sequence b is
//           row cu[b] + i with cu the exclusive prefix sum of lengths; word w, bit k (LSB
//           first) is set iff node 32w+k is i itself or an ancestor of i; the rows from
//           sum(lengths) on are zero. The XQA kernels read row r at r * ceil(M/32) words.
//   offsets [batch, M] int32: the depth of each node (root = 0); zero past the length.
#pragma once

#include "dflash/common.h"

namespace dflash
{

//! Words of one packed-mask row for a tree row of `numNodes` entries.
DFLASH_HD int32_t maskWordsFor(int32_t numNodes)
{
    return (numNodes + 31) / 32;
}

//! Check one padded parents row. Returns DFLASH_OK or the first error, with the
//! offending node index / value in *badIndex / *badValue (-1 / length for length errors).
//! The checks follow tree.validate_parents, with "parent out of range" split from
//! "parent not before its child" so the message can say which.
DFLASH_HD int32_t validateTreeRow(
    int32_t const* parents, int32_t rowNodes, int32_t length, int32_t* badIndex, int64_t* badValue)
{
    *badIndex = -1;
    *badValue = length;
    if (length < 1 || length > rowNodes)
    {
        return DFLASH_ERR_LENGTH_OUT_OF_RANGE;
    }
    if (parents[0] != -1)
    {
        *badIndex = 0;
        *badValue = parents[0];
        return DFLASH_ERR_ROOT_PARENT;
    }
    for (int32_t node = 1; node < length; ++node)
    {
        int32_t const parent = parents[node];
        *badIndex = node;
        *badValue = parent;
        if (parent < 0)
        {
            return DFLASH_ERR_NEGATIVE_PARENT;
        }
        if (parent >= length)
        {
            return DFLASH_ERR_PARENT_OUT_OF_RANGE;
        }
        if (parent >= node)
        {
            return DFLASH_ERR_PARENT_NOT_BEFORE_CHILD;
        }
    }
    *badIndex = -1;
    *badValue = 0;
    return DFLASH_OK;
}

//! Depth of `node` (root = 0), following parents only while they precede their child.
DFLASH_HD int32_t nodeDepth(int32_t const* parents, int32_t node)
{
    int32_t depth = 0;
    int32_t current = node;
    while (true)
    {
        int32_t const parent = parents[current];
        if (parent < 0 || parent >= current)
        {
            return depth;
        }
        current = parent;
        ++depth;
    }
}

//! A sequence's generation length clamped to 0..numNodes (a kernel must not trust it).
DFLASH_HD int32_t clampedLength(int32_t const* lengths, int32_t seq, int32_t numNodes)
{
    int32_t const length = lengths[seq];
    return length < 0 ? 0 : (length > numNodes ? numNodes : length);
}

//! Which (sequence, node) output row `row` of the tightly packed mask belongs to.
//! Returns false for a row past the last sequence's last node (a zero row).
DFLASH_HD bool packedRowOwner(
    int32_t const* lengths, int32_t batch, int32_t numNodes, int64_t row, int32_t* seq, int32_t* node)
{
    int64_t begin = 0;
    for (int32_t s = 0; s < batch; ++s)
    {
        int32_t const length = clampedLength(lengths, s, numNodes);
        if (row < begin + length)
        {
            *seq = s;
            *node = static_cast<int32_t>(row - begin);
            return true;
        }
        begin += length;
    }
    return false;
}

//! Build the packed ancestor row of `node` into words[0..numWords) and return its depth.
//!
//! Walks node -> parent -> ... -> root, setting one bit per visited node. The walk
//! only follows a parent p with 0 <= p < current node, so it always terminates and
//! never reads outside parents[0..node]; on a validated tree that is exactly the
//! ancestor chain. (The GPU path cannot report errors, so this must stay memory safe
//! on any input.) numWords must be >= maskWordsFor(node + 1).
DFLASH_HD int32_t buildMaskRow(int32_t const* parents, int32_t node, uint32_t* words, int32_t numWords)
{
    for (int32_t w = 0; w < numWords; ++w)
    {
        words[w] = 0u;
    }
    int32_t depth = 0;
    int32_t current = node;
    while (true)
    {
        words[current >> 5] |= 1u << (current & 31);
        int32_t const parent = parents[current];
        if (parent < 0 || parent >= current)
        {
            return depth;
        }
        current = parent;
        ++depth;
    }
}

} // namespace dflash
