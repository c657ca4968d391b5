// CUDA kernel of the DFlashTreeMask plugin: one thread per mask row. The body is
// dflash::treeMaskThread (kernel_bodies.h), shared with the CPU emulation.

#include "dflash/cuda_kernels.h"
#include "dflash/kernel_bodies.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

__global__ void treeMaskKernel(int32_t const* parents, int32_t const* generationLengths, int32_t batch,
    int32_t numNodes, int32_t maxNodes, int32_t numWords, int32_t* packedMask, int32_t* positionOffsets,
    int32_t* lengthsOut)
{
    int64_t const t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t < static_cast<int64_t>(batch) * maxNodes)
    {
        treeMaskThread(t, parents, generationLengths, batch, numNodes, maxNodes, numWords, packedMask,
            positionOffsets, lengthsOut);
    }
}

} // namespace

cudaError_t launchTreeMask(int32_t const* parents, int32_t const* generationLengths, int32_t batch, int32_t numNodes,
    int32_t maxNodes, int32_t* packedMask, int32_t* positionOffsets, int32_t* lengthsOut, cudaStream_t stream)
{
    if (batch < 0 || numNodes < 1 || maxNodes < numNodes || maxNodes > kMaxTreeNodes)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const threads = static_cast<int64_t>(batch) * maxNodes;
    if (threads == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
    treeMaskKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(parents, generationLengths, batch, numNodes, maxNodes,
        maskWordsFor(maxNodes), packedMask, positionOffsets, lengthsOut);
    return cudaGetLastError();
}

} // namespace dflash
