// Address math and checks of the DFlashKVCompact plugin, shared by the CUDA
// kernels (src/cuda/kv_compact_kernels.cu) and the CPU library.
//
// Both layouts are TensorRT-LLM's own; the formulas are transcribed from
// NVIDIA/TensorRT-LLM (see docs/plugins.md for the full citations):
//
// * Linear (contiguous) cache, one buffer per layer, KVLinearBuffer in
//   cpp/tensorrt_llm/kernels/kvCacheUtils.h: [batch, 2 (K,V), heads, max_seq, head]
//   getRowPtr(kv, seq) = data + seq * bytesPerSeq * 2 + kv * bytesPerSeq,
//   getKVLocalIdx(token, head, dims, ch) = head * maxSeqLen * dims + token * dims + ch.
//
// * Paged cache, KVBlockArray in the same header, with the per-layer pool base of
//   cpp/tensorrt_llm/plugins/gptAttentionPlugin/gptAttentionPlugin.cpp (enqueueSome):
//   block offsets [num_pools, batch, 2, max_blocks_per_seq] of KVCacheIndex,
//   layer base = pool_pointers[pool * 2 + {0 primary, 1 secondary}]
//                + layerIdxInCachePool * 2 * bytesPerBlock,
//   getRowPtr(kv, seq) = offsets + seq * maxBlocksPerSeq * 2 + kv * maxBlocksPerSeq,
//   block = layer base + offsets[token >> log2(tokensPerBlock)].get() * bytesPerBlock,
//   within a block [heads, tokensPerBlock, head]:
//   head * tokensPerBlock * dims + (token & (tokensPerBlock - 1)) * dims + ch.
//
// Everything here works in bytes: `headBytes` = head size * element size, so any
// cache dtype (fp16, bf16, fp8, fp32) is moved exactly.
#pragma once

#include "dflash/common.h"

namespace dflash
{

// KVCacheIndex (cpp/include/tensorrt_llm/kernels/kvCacheIndex.h) keeps the pool
// type in the top two bits of an int32 and the block index in the rest. Older
// releases used only the top bit as a "secondary pool" flag; both encodings agree
// that 0 in the top bits means the primary (GPU) pool and that the index fits in
// the low 30 bits, which is all this code relies on.
constexpr int32_t kKVCacheIndexPoolTypeShift = 30;
constexpr uint32_t kKVCacheIndexPoolTypeMask = 0xC0000000u;
constexpr int32_t kKVCacheIndexMask = 0x3FFFFFFF;

DFLASH_HD int32_t blockIndexOf(int32_t rawOffset)
{
    return rawOffset & kKVCacheIndexMask;
}

DFLASH_HD bool isPrimaryBlock(int32_t rawOffset)
{
    return (static_cast<uint32_t>(rawOffset) & kKVCacheIndexPoolTypeMask) == 0u;
}

DFLASH_HD bool isPowerOfTwo(int32_t value)
{
    return value > 0 && (value & (value - 1)) == 0;
}

DFLASH_HD int32_t log2OfPowerOfTwo(int32_t value)
{
    int32_t log2 = 0;
    while ((1 << log2) < value)
    {
        ++log2;
    }
    return log2;
}

// ----------------------------------------------------------------------- linear

//! Byte offset of (seq, kv, head, token) inside one layer's linear buffer.
DFLASH_HD int64_t linearSlotByteOffset(
    int32_t seq, int32_t kv, int32_t head, int32_t token, int32_t numHeads, int32_t maxSeqLen, int32_t headBytes)
{
    return (((static_cast<int64_t>(seq) * 2 + kv) * numHeads + head) * maxSeqLen + token)
        * static_cast<int64_t>(headBytes);
}

// ------------------------------------------------------------------------ paged

//! Bytes of one K (or V) block of one layer: [heads, tokensPerBlock, head].
DFLASH_HD int64_t pagedBytesPerBlock(int32_t tokensPerBlock, int32_t numHeads, int32_t headBytes)
{
    return static_cast<int64_t>(tokensPerBlock) * numHeads * headBytes;
}

//! Index of the first block-offset entry of (seq, kv) inside one pool's
//! [batch, 2, maxBlocksPerSeq] slice (KVBlockArray::getRowPtr).
DFLASH_HD int64_t pagedOffsetRowStart(int32_t seq, int32_t kv, int32_t maxBlocksPerSeq)
{
    return (static_cast<int64_t>(seq) * 2 + kv) * maxBlocksPerSeq;
}

//! Byte offset of (head, token) inside the block that holds `token`.
DFLASH_HD int64_t pagedInBlockByteOffset(int32_t head, int32_t token, int32_t tokensPerBlock, int32_t headBytes)
{
    return (static_cast<int64_t>(head) * tokensPerBlock + (token & (tokensPerBlock - 1)))
        * static_cast<int64_t>(headBytes);
}

//! Address of (head, token) for one sequence's K or V row of block offsets.
//! `primaryBase` / `secondaryBase` are the layer bases (pool pointer + layer offset).
DFLASH_HD char* pagedSlotAddress(char* primaryBase, char* secondaryBase, int32_t const* offsetRow, int32_t head,
    int32_t token, int32_t tokensPerBlock, int32_t tokensPerBlockLog2, int64_t bytesPerBlock, int32_t headBytes)
{
    int32_t const raw = offsetRow[token >> tokensPerBlockLog2];
    char* base = isPrimaryBlock(raw) ? primaryBase : secondaryBase;
    return base + static_cast<int64_t>(blockIndexOf(raw)) * bytesPerBlock
        + pagedInBlockByteOffset(head, token, tokensPerBlock, headBytes);
}

// ----------------------------------------------------------------------- checks

//! Check one sequence's accepted path against tree.compaction_indices' contract:
//! 0 <= numAccepted <= maxAccepted (0 = nothing to move, e.g. a context request),
//! accepted[0] == 0, strictly increasing, past + accepted[last] < capacity.
DFLASH_HD int32_t validateAcceptedRow(int32_t const* accepted, int32_t numAccepted, int32_t maxAccepted,
    int32_t pastLength, int64_t capacity, int32_t* badIndex, int64_t* badValue)
{
    *badIndex = -1;
    *badValue = pastLength;
    if (pastLength < 0)
    {
        return DFLASH_ERR_PAST_LENGTH_OUT_OF_RANGE;
    }
    *badValue = numAccepted;
    if (numAccepted < 0 || numAccepted > maxAccepted)
    {
        return DFLASH_ERR_NUM_ACCEPTED_OUT_OF_RANGE;
    }
    if (numAccepted == 0)
    {
        *badValue = 0;
        return DFLASH_OK;
    }
    *badIndex = 0;
    *badValue = accepted[0];
    if (accepted[0] != 0)
    {
        return DFLASH_ERR_ACCEPTED_ROOT;
    }
    for (int32_t i = 1; i < numAccepted; ++i)
    {
        *badIndex = i;
        *badValue = accepted[i];
        if (accepted[i] <= accepted[i - 1])
        {
            return DFLASH_ERR_ACCEPTED_NOT_INCREASING;
        }
    }
    int32_t const last = numAccepted - 1;
    *badIndex = last;
    *badValue = static_cast<int64_t>(pastLength) + accepted[last];
    if (static_cast<int64_t>(pastLength) + accepted[last] >= capacity)
    {
        return DFLASH_ERR_SLOT_OUT_OF_RANGE;
    }
    *badIndex = -1;
    *badValue = 0;
    return DFLASH_OK;
}

} // namespace dflash
