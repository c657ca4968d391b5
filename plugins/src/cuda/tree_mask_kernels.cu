// CUDA kernel of the DFlashTreeMask plugin. One thread builds one mask row; the
// row logic is dflash::buildMaskRow, shared with the CPU library.

#include "dflash/cuda_kernels.h"
#include "dflash/tree_mask_core.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

constexpr int32_t kThreadsPerBlock = 128;

__global__ void treeMaskKernel(int32_t const* parents, int32_t const* generationLengths, int32_t batch,
    int32_t numNodes, int32_t numWords, int32_t* packedMask, int32_t* positionOffsets, int32_t* lengthsOut)
{
    int64_t const row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row >= static_cast<int64_t>(batch) * numNodes)
    {
        return;
    }
    int32_t const seq = static_cast<int32_t>(row / numNodes);
    int32_t const node = static_cast<int32_t>(row % numNodes);
    // Clamp rather than trust: an out-of-range length must not make us read past the row.
    int32_t const length = min(max(generationLengths[seq], 0), numNodes);

    uint32_t words[kMaxMaskWords];
    int32_t depth = 0;
    if (node < length)
    {
        depth = buildMaskRow(parents + static_cast<int64_t>(seq) * numNodes, node, words, numWords);
    }
    else
    {
        for (int32_t w = 0; w < numWords; ++w)
        {
            words[w] = 0u;
        }
    }
    int32_t* outRow = packedMask + row * numWords;
    for (int32_t w = 0; w < numWords; ++w)
    {
        outRow[w] = static_cast<int32_t>(words[w]);
    }
    positionOffsets[row] = depth;
    if (node == 0)
    {
        lengthsOut[seq] = generationLengths[seq];
    }
}

} // namespace

cudaError_t launchTreeMask(int32_t const* parents, int32_t const* generationLengths, int32_t batch, int32_t numNodes,
    int32_t* packedMask, int32_t* positionOffsets, int32_t* lengthsOut, cudaStream_t stream)
{
    if (batch < 0 || numNodes < 1 || numNodes > kMaxTreeNodes)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const rows = static_cast<int64_t>(batch) * numNodes;
    if (rows == 0)
    {
        return cudaSuccess;
    }
    unsigned int const blocks = static_cast<unsigned int>((rows + kThreadsPerBlock - 1) / kThreadsPerBlock);
    treeMaskKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(parents, generationLengths, batch, numNodes,
        maskWordsFor(numNodes), packedMask, positionOffsets, lengthsOut);
    return cudaGetLastError();
}

} // namespace dflash
