// The per-thread bodies of the CUDA kernels and the host-side launch plans.
//
// The __global__ functions in src/cuda/*.cu only translate blockIdx / threadIdx into
// arguments and call these bodies. src/cpu/gpu_emulation.cpp calls the very same
// bodies in a serial loop over the grid, so the tests check the kernels' indexing,
// layer chunking and vectorised copies on a machine without a GPU. (The emulation
// is exact because no two threads touch the same bytes: see the copy loops below.)
#pragma once

#include "dflash/kv_compact_core.h"
#include "dflash/tree_mask_core.h"

#include <cstddef>
#include <cstdint>

namespace dflash
{

constexpr int32_t kThreadsPerBlock = 128;

//! Layers handled by one compaction launch: their base pointers travel as a kernel
//! argument (no workspace, no host-to-device copy, CUDA-graph friendly). 32 layers
//! x 3 pointers x 8 bytes = 768 bytes of parameters, well under the 4 KiB limit.
constexpr int32_t kLayersPerLaunch = 32;

//! A `Bytes`-wide copy unit. Our own type rather than CUDA's uint4/uint2 so the CPU
//! build (no CUDA headers) can run the same bodies; alignas gives nvcc the
//! alignment it needs to emit 16/8-byte loads and stores.
template <int32_t Bytes>
struct alignas(Bytes) CopyUnit
{
    unsigned char bytes[Bytes];
};

struct LinearLayerChunk
{
    char* bases[kLayersPerLaunch]; //!< layer l's buffer [batch, 2, heads, maxSeqLen, headBytes]
};

struct PagedLayerChunk
{
    char* primary[kLayersPerLaunch];   //!< primary pool pointer + layer-in-pool offset
    char* secondary[kLayersPerLaunch]; //!< same for the secondary pool (may be null)
    int32_t const* blockOffsets[kLayersPerLaunch]; //!< this layer's pool slice [batch, 2, maxBlocksPerSeq]
};

// ------------------------------------------------------------------- tree mask

//! One thread `t` in [0, batch * maxNodes): writes packed output row t (when
//! t < batch * numNodes) and position-offset entry t. Every output element has exactly
//! one writer, so the zero rows and padding need no separate pass.
DFLASH_HD void treeMaskThread(int64_t t, int32_t const* parents, int32_t const* generationLengths, int32_t batch,
    int32_t numNodes, int32_t maxNodes, int32_t numWords, int32_t* packedMask, int32_t* positionOffsets,
    int32_t* lengthsOut)
{
    if (t < static_cast<int64_t>(batch) * numNodes)
    {
        uint32_t words[kMaxMaskWords];
        int32_t seq = 0;
        int32_t node = 0;
        if (packedRowOwner(generationLengths, batch, numNodes, t, &seq, &node))
        {
            buildMaskRow(parents + static_cast<int64_t>(seq) * numNodes, node, words, numWords);
        }
        else
        {
            for (int32_t w = 0; w < numWords; ++w)
            {
                words[w] = 0u;
            }
        }
        int32_t* outRow = packedMask + t * numWords;
        for (int32_t w = 0; w < numWords; ++w)
        {
            outRow[w] = static_cast<int32_t>(words[w]);
        }
    }
    int32_t const seq = static_cast<int32_t>(t / maxNodes);
    int32_t const node = static_cast<int32_t>(t % maxNodes);
    positionOffsets[t] = node < clampedLength(generationLengths, seq, numNodes)
        ? nodeDepth(parents + static_cast<int64_t>(seq) * numNodes, node)
        : 0;
    if (node == 0)
    {
        lengthsOut[seq] = generationLengths[seq];
    }
}

// ------------------------------------------------------------------ compaction

//! The sequence's path, or nullptr when there is nothing to move or the path breaks
//! the contract (skipped: a kernel cannot report errors).
DFLASH_HD int32_t const* acceptedPathOrNull(int32_t const* acceptedNodes, int32_t maxAccepted,
    int32_t const* numAccepted, int32_t const* pastLengths, int32_t seq, int64_t capacity)
{
    int32_t const* path = acceptedNodes + static_cast<int64_t>(seq) * maxAccepted;
    int32_t badIndex = -1;
    int64_t badValue = 0;
    int32_t const code
        = validateAcceptedRow(path, numAccepted[seq], maxAccepted, pastLengths[seq], capacity, &badIndex, &badValue);
    if (code != DFLASH_OK || numAccepted[seq] < 2)
    {
        return nullptr; // a lone root never moves
    }
    return path;
}

//! Block (seq, head, z = layer * 2 + kv), thread `thread` of `threads`: copies the
//! vector chunks thread, thread + threads, ... of every moved slot, in path order.
//! Each chunk belongs to one thread, so the in-place forward copy needs no barrier.
template <typename Vec>
DFLASH_HD void kvCompactLinearThread(int32_t seq, int32_t head, int32_t z, int32_t thread, int32_t threads,
    LinearLayerChunk const& layers, int32_t numKVHeads, int32_t maxSeqLen, int32_t headBytes,
    int32_t const* pastLengths, int32_t const* acceptedNodes, int32_t maxAccepted, int32_t const* numAccepted)
{
    int32_t const* path = acceptedPathOrNull(acceptedNodes, maxAccepted, numAccepted, pastLengths, seq, maxSeqLen);
    if (path == nullptr)
    {
        return;
    }
    int32_t const kv = z & 1;
    char* base = layers.bases[z >> 1];
    int32_t const past = pastLengths[seq];
    int32_t const count = numAccepted[seq];
    int32_t const vecsPerHead = headBytes / static_cast<int32_t>(sizeof(Vec));
    for (int32_t i = 1; i < count; ++i)
    {
        int32_t const node = path[i];
        if (node == i)
        {
            continue;
        }
        auto const* src = reinterpret_cast<Vec const*>(
            base + linearSlotByteOffset(seq, kv, head, past + node, numKVHeads, maxSeqLen, headBytes));
        auto* dst = reinterpret_cast<Vec*>(
            base + linearSlotByteOffset(seq, kv, head, past + i, numKVHeads, maxSeqLen, headBytes));
        for (int32_t c = thread; c < vecsPerHead; c += threads)
        {
            dst[c] = src[c];
        }
    }
}

template <typename Vec>
DFLASH_HD void kvCompactPagedThread(int32_t seq, int32_t head, int32_t z, int32_t thread, int32_t threads,
    PagedLayerChunk const& layers, int32_t maxBlocksPerSeq, int32_t tokensPerBlock, int32_t tokensPerBlockLog2,
    int32_t headBytes, int64_t bytesPerBlock, int32_t const* pastLengths, int32_t const* acceptedNodes,
    int32_t maxAccepted, int32_t const* numAccepted)
{
    int64_t const capacity = static_cast<int64_t>(maxBlocksPerSeq) * tokensPerBlock;
    int32_t const* path = acceptedPathOrNull(acceptedNodes, maxAccepted, numAccepted, pastLengths, seq, capacity);
    if (path == nullptr)
    {
        return;
    }
    int32_t const kv = z & 1;
    int32_t const layer = z >> 1;
    int32_t const* offsetRow = layers.blockOffsets[layer] + pagedOffsetRowStart(seq, kv, maxBlocksPerSeq);
    char* primaryBase = layers.primary[layer];
    char* secondaryBase = layers.secondary[layer];
    int32_t const past = pastLengths[seq];
    int32_t const count = numAccepted[seq];
    int32_t const vecsPerHead = headBytes / static_cast<int32_t>(sizeof(Vec));
    for (int32_t i = 1; i < count; ++i)
    {
        int32_t const node = path[i];
        if (node == i)
        {
            continue;
        }
        auto const* src = reinterpret_cast<Vec const*>(pagedSlotAddress(primaryBase, secondaryBase, offsetRow, head,
            past + node, tokensPerBlock, tokensPerBlockLog2, bytesPerBlock, headBytes));
        auto* dst = reinterpret_cast<Vec*>(pagedSlotAddress(primaryBase, secondaryBase, offsetRow, head, past + i,
            tokensPerBlock, tokensPerBlockLog2, bytesPerBlock, headBytes));
        for (int32_t c = thread; c < vecsPerHead; c += threads)
        {
            dst[c] = src[c];
        }
    }
}

// ------------------------------------------------------------ host launch plans

//! Widest copy unit (16, 8, 4, 2 or 1 bytes) that divides the head size and keeps
//! every base pointer aligned (block and slot offsets are multiples of headBytes).
inline int32_t copyUnitBytes(int32_t headBytes, char* const* bases, int32_t count)
{
    int32_t unit = 16;
    while (unit > 1)
    {
        bool aligned = headBytes % unit == 0;
        for (int32_t i = 0; aligned && i < count; ++i)
        {
            aligned = reinterpret_cast<uintptr_t>(bases[i]) % static_cast<uintptr_t>(unit) == 0;
        }
        if (aligned)
        {
            break;
        }
        unit >>= 1;
    }
    return unit;
}

//! Call launch(CopyUnit<unit>{}) for the unit chosen by copyUnitBytes.
template <typename Launch>
void dispatchCopyUnit(int32_t unit, Launch&& launch)
{
    switch (unit)
    {
    case 16: launch(CopyUnit<16>{}); break;
    case 8: launch(CopyUnit<8>{}); break;
    case 4: launch(CopyUnit<4>{}); break;
    case 2: launch(CopyUnit<2>{}); break;
    default: launch(CopyUnit<1>{}); break;
    }
}

//! Layers [first, first + count) of a linear-cache launch; returns the copy unit, or
//! 0 if a layer pointer is null.
inline int32_t planLinearChunk(
    void* const* hostLayerCaches, int32_t first, int32_t count, int32_t headBytes, LinearLayerChunk& chunk)
{
    chunk = LinearLayerChunk{};
    for (int32_t l = 0; l < count; ++l)
    {
        chunk.bases[l] = static_cast<char*>(hostLayerCaches[first + l]);
        if (chunk.bases[l] == nullptr)
        {
            return 0;
        }
    }
    return copyUnitBytes(headBytes, chunk.bases, count);
}

//! Layers [first, first + count) of a paged launch, with each layer's base computed as
//! in gptAttentionPlugin.cpp (pool pointer + layerIdxInCachePool * 2 * bytesPerBlock).
//! Returns the copy unit, or 0 if the pool mapping or a primary pool pointer is bad.
inline int32_t planPagedChunk(void* const* hostPoolPointers, int32_t const* hostPoolMapping, int32_t numPools,
    int32_t const* blockOffsets, int64_t poolStride, int64_t bytesPerBlock, int32_t first, int32_t count,
    int32_t headBytes, PagedLayerChunk& chunk)
{
    chunk = PagedLayerChunk{};
    char* alignmentProbe[2 * kLayersPerLaunch];
    int32_t probes = 0;
    for (int32_t l = 0; l < count; ++l)
    {
        int32_t const pool = hostPoolMapping[(first + l) * 2];
        int32_t const layerInPool = hostPoolMapping[(first + l) * 2 + 1];
        if (pool < 0 || pool >= numPools || layerInPool < 0 || hostPoolPointers[pool * 2] == nullptr)
        {
            return 0;
        }
        int64_t const layerOffset = static_cast<int64_t>(layerInPool) * 2 * bytesPerBlock;
        chunk.primary[l] = static_cast<char*>(hostPoolPointers[pool * 2]) + layerOffset;
        alignmentProbe[probes++] = chunk.primary[l];
        if (hostPoolPointers[pool * 2 + 1] != nullptr)
        {
            chunk.secondary[l] = static_cast<char*>(hostPoolPointers[pool * 2 + 1]) + layerOffset;
            alignmentProbe[probes++] = chunk.secondary[l];
        }
        chunk.blockOffsets[l] = blockOffsets + pool * poolStride;
    }
    return copyUnitBytes(headBytes, alignmentProbe, probes);
}

} // namespace dflash
