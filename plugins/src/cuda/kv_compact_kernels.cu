// CUDA kernels of the DFlashKVCompact plugin.
//
// Grid: x = sequence, y = KV head, z = (layer in this launch) * 2 + {0 K, 1 V}.
// Inside a block, thread t owns the vector chunks t, t + blockDim, ... of a head and
// walks the accepted path in order, so each byte is only ever touched by one thread
// and the in-place forward copy needs no synchronisation (see moveAcceptedSlots in
// src/cpu/dflash_cpu.cpp for why in-order copying is safe).

#include "dflash/cuda_kernels.h"
#include "dflash/kv_compact_core.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

constexpr int32_t kThreadsPerBlock = 128;

struct LinearLayerChunk
{
    char* bases[kLayersPerLaunch];
};

struct PagedLayerChunk
{
    char* primary[kLayersPerLaunch];   //!< primary pool pointer + layer-in-pool offset
    char* secondary[kLayersPerLaunch]; //!< same for the secondary pool (may be null)
    int32_t const* blockOffsets[kLayersPerLaunch]; //!< this layer's pool slice [batch, 2, maxBlocksPerSeq]
};

//! Shared per-block prologue: the sequence's path, or nullptr when there is nothing
//! to move or the path breaks the contract (skipped: the GPU cannot report errors).
__device__ int32_t const* acceptedPathOrNull(int32_t const* acceptedNodes, int32_t maxAccepted,
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

template <typename Vec>
__global__ void kvCompactLinearKernel(LinearLayerChunk layers, int32_t numKVHeads, int32_t maxSeqLen,
    int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes, int32_t maxAccepted,
    int32_t const* numAccepted)
{
    int32_t const seq = static_cast<int32_t>(blockIdx.x);
    int32_t const head = static_cast<int32_t>(blockIdx.y);
    int32_t const kv = static_cast<int32_t>(blockIdx.z & 1u);
    char* base = layers.bases[blockIdx.z >> 1];
    int32_t const* path = acceptedPathOrNull(acceptedNodes, maxAccepted, numAccepted, pastLengths, seq, maxSeqLen);
    if (path == nullptr)
    {
        return;
    }
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
        for (int32_t c = static_cast<int32_t>(threadIdx.x); c < vecsPerHead; c += static_cast<int32_t>(blockDim.x))
        {
            dst[c] = src[c];
        }
    }
}

template <typename Vec>
__global__ void kvCompactPagedKernel(PagedLayerChunk layers, int32_t maxBlocksPerSeq, int32_t tokensPerBlock,
    int32_t tokensPerBlockLog2, int32_t headBytes, int64_t bytesPerBlock, int32_t const* pastLengths,
    int32_t const* acceptedNodes, int32_t maxAccepted, int32_t const* numAccepted)
{
    int32_t const seq = static_cast<int32_t>(blockIdx.x);
    int32_t const head = static_cast<int32_t>(blockIdx.y);
    int32_t const kv = static_cast<int32_t>(blockIdx.z & 1u);
    int32_t const layer = static_cast<int32_t>(blockIdx.z >> 1);
    int64_t const capacity = static_cast<int64_t>(maxBlocksPerSeq) * tokensPerBlock;
    int32_t const* path = acceptedPathOrNull(acceptedNodes, maxAccepted, numAccepted, pastLengths, seq, capacity);
    if (path == nullptr)
    {
        return;
    }
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
        for (int32_t c = static_cast<int32_t>(threadIdx.x); c < vecsPerHead; c += static_cast<int32_t>(blockDim.x))
        {
            dst[c] = src[c];
        }
    }
}

__global__ void committedLengthsKernel(
    int32_t const* pastLengths, int32_t const* numAccepted, int32_t batch, int32_t* newLengths)
{
    int32_t const seq = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
    if (seq < batch)
    {
        newLengths[seq] = pastLengths[seq] + max(numAccepted[seq], 0);
    }
}

//! Widest copy unit (16, 8, 4, 2 or 1 bytes) that divides the head size and keeps
//! every base pointer aligned.
int32_t copyUnitBytes(int32_t headBytes, char* const* bases, int32_t count)
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

template <typename Launch>
cudaError_t dispatchCopyUnit(int32_t unit, Launch launch)
{
    switch (unit)
    {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
    }
    return cudaGetLastError();
}

} // namespace

cudaError_t launchCommittedLengths(int32_t const* pastLengths, int32_t const* numAccepted, int32_t batch,
    int32_t* newLengths, cudaStream_t stream)
{
    if (batch < 0)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    unsigned int const blocks = static_cast<unsigned int>((batch + kThreadsPerBlock - 1) / kThreadsPerBlock);
    committedLengthsKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(pastLengths, numAccepted, batch, newLengths);
    return cudaGetLastError();
}

cudaError_t launchKVCompactLinear(void* const* hostLayerCaches, int32_t numLayers, int32_t batch, int32_t numKVHeads,
    int32_t maxSeqLen, int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes,
    int32_t maxAccepted, int32_t const* numAccepted, cudaStream_t stream)
{
    if (hostLayerCaches == nullptr || numLayers < 1 || batch < 0 || numKVHeads < 1 || maxSeqLen < 1 || headBytes < 1
        || maxAccepted < 1)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    for (int32_t first = 0; first < numLayers; first += kLayersPerLaunch)
    {
        int32_t const count = numLayers - first < kLayersPerLaunch ? numLayers - first : kLayersPerLaunch;
        LinearLayerChunk chunk{};
        for (int32_t l = 0; l < count; ++l)
        {
            chunk.bases[l] = static_cast<char*>(hostLayerCaches[first + l]);
            if (chunk.bases[l] == nullptr)
            {
                return cudaErrorInvalidValue;
            }
        }
        dim3 const grid(static_cast<unsigned int>(batch), static_cast<unsigned int>(numKVHeads),
            static_cast<unsigned int>(count * 2));
        cudaError_t const status = dispatchCopyUnit(copyUnitBytes(headBytes, chunk.bases, count),
            [&](auto unit)
            {
                kvCompactLinearKernel<decltype(unit)><<<grid, kThreadsPerBlock, 0, stream>>>(chunk, numKVHeads,
                    maxSeqLen, headBytes, pastLengths, acceptedNodes, maxAccepted, numAccepted);
            });
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

cudaError_t launchKVCompactPaged(void* const* hostPoolPointers, int32_t const* hostPoolMapping, int32_t numPools,
    int32_t numLayers, int32_t const* blockOffsets, int32_t batch, int32_t maxBlocksPerSeq, int32_t tokensPerBlock,
    int32_t numKVHeads, int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes,
    int32_t maxAccepted, int32_t const* numAccepted, cudaStream_t stream)
{
    if (hostPoolPointers == nullptr || hostPoolMapping == nullptr || blockOffsets == nullptr || numPools < 1
        || numLayers < 1 || batch < 0 || maxBlocksPerSeq < 1 || !isPowerOfTwo(tokensPerBlock) || numKVHeads < 1
        || headBytes < 1 || maxAccepted < 1)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    int64_t const bytesPerBlock = pagedBytesPerBlock(tokensPerBlock, numKVHeads, headBytes);
    int64_t const poolStride = static_cast<int64_t>(batch) * 2 * maxBlocksPerSeq;
    int32_t const tokensPerBlockLog2 = log2OfPowerOfTwo(tokensPerBlock);
    for (int32_t first = 0; first < numLayers; first += kLayersPerLaunch)
    {
        int32_t const count = numLayers - first < kLayersPerLaunch ? numLayers - first : kLayersPerLaunch;
        PagedLayerChunk chunk{};
        char* alignmentProbe[2 * kLayersPerLaunch];
        int32_t probes = 0;
        for (int32_t l = 0; l < count; ++l)
        {
            int32_t const pool = hostPoolMapping[(first + l) * 2];
            int32_t const layerInPool = hostPoolMapping[(first + l) * 2 + 1];
            if (pool < 0 || pool >= numPools || layerInPool < 0 || hostPoolPointers[pool * 2] == nullptr)
            {
                return cudaErrorInvalidValue;
            }
            // gptAttentionPlugin.cpp: pool pointer + layerIdxInCachePool * 2 * bytesPerBlock.
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
        dim3 const grid(static_cast<unsigned int>(batch), static_cast<unsigned int>(numKVHeads),
            static_cast<unsigned int>(count * 2));
        cudaError_t const status = dispatchCopyUnit(copyUnitBytes(headBytes, alignmentProbe, probes),
            [&](auto unit)
            {
                kvCompactPagedKernel<decltype(unit)><<<grid, kThreadsPerBlock, 0, stream>>>(chunk, maxBlocksPerSeq,
                    tokensPerBlock, tokensPerBlockLog2, headBytes, bytesPerBlock, pastLengths, acceptedNodes,
                    maxAccepted, numAccepted);
            });
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

} // namespace dflash
