// The fused DDTree build: one thread per batch row runs dflash::ddtreeRowThread
// (ddtree_core.h, the body the CPU library runs too). A row's tree is a best-first search
// over at most kMaxDDTreeBudget pops, sequential by nature; what this kernel saves is the
// ~400 tensor-op launches device_tree.build_ddtree_device needs for the same tree.
// The path sums of the cost-aware tree's values (pathSumsRow) likewise: one pass per row
// in place of device_policy.path_values's depth-by-depth rounds (~60 launches).

#include "dflash/cuda_kernels.h"
#include "dflash/ddtree_core.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

//! Rows per block: a batch is a handful of rows, and each thread's scratch (its heap and
//! ranks, ~4.6 KiB) lives in local memory.
constexpr int32_t kDDTreeRowsPerBlock = 32;

__global__ void ddtreeKernel(double const* logprobs, int64_t const* tokens, int64_t const* roots,
    int64_t const* maxDepth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* outTokens,
    int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        ddtreeRowThread(row, logprobs, tokens, roots, maxDepth, depth, k, budget, outTokens, outParents, outDepths,
            outValid, outNumNodes, outScores);
    }
}

__global__ void pathSumsKernel(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        int64_t const offset = static_cast<int64_t>(row) * n;
        pathSumsRow(values + offset, parents + offset, n, out + offset);
    }
}

} // namespace

cudaError_t launchPathSums(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out,
    cudaStream_t stream)
{
    int32_t index = -1;
    int64_t value = 0;
    if (pathSumsShapeError(batch, n, &index, &value) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0 || n == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    pathSumsKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(values, parents, batch, n, out);
    return cudaGetLastError();
}

cudaError_t launchDDTreeBuild(double const* logprobs, int64_t const* tokens, int64_t const* roots,
    int64_t const* maxDepth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* outTokens,
    int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores,
    cudaStream_t stream)
{
    int32_t index = -1;
    int64_t value = 0;
    if (ddtreeShapeError(batch, depth, k, budget, &index, &value) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    ddtreeKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(logprobs, tokens, roots, maxDepth, batch, depth, k,
        budget, outTokens, outParents, outDepths, outValid, outNumNodes, outScores);
    return cudaGetLastError();
}

} // namespace dflash
