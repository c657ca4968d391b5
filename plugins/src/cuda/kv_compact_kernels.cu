// CUDA kernels of the DFlashKVCompact plugin.
//
// Grid: x = sequence, y = KV head, z = (layer in this launch) * 2 + {0 K, 1 V}.
// The bodies (kvCompact*Thread) and the per-launch layer plans live in
// kernel_bodies.h, shared with the CPU emulation that the tests run.

#include "dflash/cuda_kernels.h"
#include "dflash/kernel_bodies.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

template <typename Vec>
__global__ void kvCompactLinearKernel(LinearLayerChunk layers, int32_t numKVHeads, int32_t maxSeqLen,
    int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes, int32_t maxAccepted,
    int32_t const* numAccepted)
{
    kvCompactLinearThread<Vec>(static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y),
        static_cast<int32_t>(blockIdx.z), static_cast<int32_t>(threadIdx.x), static_cast<int32_t>(blockDim.x), layers,
        numKVHeads, maxSeqLen, headBytes, pastLengths, acceptedNodes, maxAccepted, numAccepted);
}

template <typename Vec>
__global__ void kvCompactPagedKernel(PagedLayerChunk layers, int32_t maxBlocksPerSeq, int32_t tokensPerBlock,
    int32_t tokensPerBlockLog2, int32_t headBytes, int64_t bytesPerBlock, int32_t const* pastLengths,
    int32_t const* acceptedNodes, int32_t maxAccepted, int32_t const* numAccepted)
{
    kvCompactPagedThread<Vec>(static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y),
        static_cast<int32_t>(blockIdx.z), static_cast<int32_t>(threadIdx.x), static_cast<int32_t>(blockDim.x), layers,
        maxBlocksPerSeq, tokensPerBlock, tokensPerBlockLog2, headBytes, bytesPerBlock, pastLengths, acceptedNodes,
        maxAccepted, numAccepted);
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
    auto const blocks = static_cast<unsigned int>((batch + kThreadsPerBlock - 1) / kThreadsPerBlock);
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
    for (int32_t first = 0; batch > 0 && first < numLayers; first += kLayersPerLaunch)
    {
        int32_t const count = numLayers - first < kLayersPerLaunch ? numLayers - first : kLayersPerLaunch;
        LinearLayerChunk chunk;
        int32_t const unit = planLinearChunk(hostLayerCaches, first, count, headBytes, chunk);
        if (unit == 0)
        {
            return cudaErrorInvalidValue;
        }
        dim3 const grid(static_cast<unsigned int>(batch), static_cast<unsigned int>(numKVHeads),
            static_cast<unsigned int>(count * 2));
        dispatchCopyUnit(unit,
            [&](auto vec)
            {
                kvCompactLinearKernel<decltype(vec)><<<grid, kThreadsPerBlock, 0, stream>>>(chunk, numKVHeads,
                    maxSeqLen, headBytes, pastLengths, acceptedNodes, maxAccepted, numAccepted);
            });
        cudaError_t const status = cudaGetLastError();
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
    int64_t const bytesPerBlock = pagedBytesPerBlock(tokensPerBlock, numKVHeads, headBytes);
    int64_t const poolStride = static_cast<int64_t>(batch) * 2 * maxBlocksPerSeq;
    int32_t const tokensPerBlockLog2 = log2OfPowerOfTwo(tokensPerBlock);
    for (int32_t first = 0; batch > 0 && first < numLayers; first += kLayersPerLaunch)
    {
        int32_t const count = numLayers - first < kLayersPerLaunch ? numLayers - first : kLayersPerLaunch;
        PagedLayerChunk chunk;
        int32_t const unit = planPagedChunk(hostPoolPointers, hostPoolMapping, numPools, blockOffsets, poolStride,
            bytesPerBlock, first, count, headBytes, chunk);
        if (unit == 0)
        {
            return cudaErrorInvalidValue;
        }
        dim3 const grid(static_cast<unsigned int>(batch), static_cast<unsigned int>(numKVHeads),
            static_cast<unsigned int>(count * 2));
        dispatchCopyUnit(unit,
            [&](auto vec)
            {
                kvCompactPagedKernel<decltype(vec)><<<grid, kThreadsPerBlock, 0, stream>>>(chunk, maxBlocksPerSeq,
                    tokensPerBlock, tokensPerBlockLog2, headBytes, bytesPerBlock, pastLengths, acceptedNodes,
                    maxAccepted, numAccepted);
            });
        cudaError_t const status = cudaGetLastError();
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

} // namespace dflash
