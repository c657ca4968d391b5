// The fused DDTree build: one thread per batch row runs dflash::ddtreeRowThread
// (ddtree_core.h, the body the CPU library runs too). A row's tree is a best-first search
// over at most kMaxDDTreeBudget pops, sequential by nature; what this kernel saves is the
// ~400 tensor-op launches device_tree.build_ddtree_device needs for the same tree.
// The path sums of the cost-aware tree's values (pathSumsRow) likewise: one pass per row
// in place of device_policy.path_values's depth-by-depth rounds (~60 launches), and the
// verifier's walk (walkRow) in place of device_tree.walk_device's pointer doubling (~45), and
// the prompt-lookup branches and their grafting (lookup_core.h) in place of
// device_lookup.lookup_device's and graft_device's (~90 and ~80). The cost-aware tree's selection
// of its best nodes (select_core.h) runs one warp per row, its phases one node per lane with the warp
// synchronized between them (~30 launches); the verifier's ancestor-or-self mask one thread per
// node (~17); its learning step (learn_core.h) one thread, as every row updates the same tables (~40).

#include "dflash/cuda_kernels.h"
#include "dflash/ddtree_core.h"
#include "dflash/learn_core.h"
#include "dflash/lookup_core.h"
#include "dflash/select_core.h"

#include <cuda_runtime.h>

namespace dflash
{
namespace
{

//! Rows per block: a batch is a handful of rows (each thread's heap lives in the caller's scratch).
constexpr int32_t kDDTreeRowsPerBlock = 32;

__global__ void ddtreeKernel(double const* logprobs, int64_t const* tokens, int64_t const* roots,
    int64_t const* maxDepth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* outTokens,
    int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores,
    unsigned char* scratch)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        ddtreeRowThread(row, logprobs, tokens, roots, maxDepth, depth, k, budget, outTokens, outParents, outDepths,
            outValid, outNumNodes, outScores, scratch);
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

__global__ void walkKernel(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t maxPath, int64_t* path, int64_t* lengths, int64_t* bonus)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        int64_t const offset = static_cast<int64_t>(row) * n;
        walkRow(tokens + offset, parents + offset, valid + offset, choices + offset, n, maxPath,
            path + static_cast<int64_t>(row) * maxPath, lengths + row, bonus + row);
    }
}

__global__ void lookupKernel(int64_t const* history, int64_t rowStride, int32_t capacity, int64_t const* lengths,
    int64_t const* limits, int32_t batch, int32_t width, int32_t maxNgram, int32_t minNgram, int32_t branches,
    int64_t* tokens, int64_t* branchLengths, int64_t* ngram)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        lookupRowThread(row, history, rowStride, capacity, lengths, limits, width, maxNgram, minNgram, branches,
            tokens, branchLengths, ngram);
    }
}

__global__ void graftKernel(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* numNodes, double const* scores, double const* poolCond, int32_t batch,
    int32_t poolSize, int64_t const* branchTokens, double const* branchCond, int32_t branches, int32_t width,
    int64_t* outTokens, int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes,
    double* outScores, double* outCond, unsigned char* outOnBranch, int64_t* scratch)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row < batch)
    {
        graftRowThread(row, tokens, parents, depths, valid, numNodes, scores, poolCond, poolSize, branchTokens,
            branchCond, branches, width, outTokens, outParents, outDepths, outValid, outNumNodes, outScores, outCond,
            outOnBranch, scratch);
    }
}

//! Rows per block of the select: one warp each.
constexpr int32_t kSelectRowsPerBlock = 4;
constexpr int32_t kWarp = 32;

__global__ void selectKernel(SelectRow row, int32_t batch, int32_t n, int32_t size, int64_t* outNumNodes,
    int64_t* scratch)
{
    int32_t const r = static_cast<int32_t>(blockIdx.x) * kSelectRowsPerBlock + static_cast<int32_t>(threadIdx.x) / kWarp;
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % kWarp;
    if (r >= batch)  // the whole warp leaves together: no lane of a live row waits on it below
    {
        return;
    }
    int64_t const in = static_cast<int64_t>(r) * n;
    int64_t const out = static_cast<int64_t>(r) * size;
    int64_t* ranks = scratch + 2 * in;
    int64_t* slots = ranks + n;
    double const* values = row.values + in;
    for (int32_t i = lane; i < n; i += kWarp)
    {
        ranks[i] = selectRank(values, n, i);
    }
    __syncwarp();
    for (int32_t i = lane; i < n; i += kWarp)
    {
        slots[i] = selectSlot(ranks, size, i);
    }
    __syncwarp();
    SelectRow const mine{values, row.tokens + in, row.parents + in, row.depths + in, row.valid + in, row.scores + in,
        row.cond + in, row.onBranch + in, row.outTokens + out, row.outParents + out, row.outDepths + out,
        row.outValid + out, row.outScores + out, row.outCond + out, row.outOnBranch + out};
    for (int32_t i = lane; i < n; i += kWarp)
    {
        if (slots[i] >= 0)
        {
            selectEmit(mine, slots, n, i);
        }
    }
    __syncwarp();
    if (lane == 0)
    {
        outNumNodes[r] = selectCount(mine.outValid, size);
    }
}

__global__ void visibilityKernel(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t maxHops, unsigned char* out)
{
    int64_t const node = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (node < static_cast<int64_t>(batch) * n)
    {
        int64_t const r = node / n;
        visibilityNode(parents + r * n, valid + r * n, n, maxHops, static_cast<int32_t>(node % n), out + node * n);
    }
}

__global__ void learnKernel(LearnInputs in, int32_t batch, int32_t n, LearnTable draft, LearnTable lookup,
    double decay, double strength)
{
    if (blockIdx.x == 0 && threadIdx.x == 0)
    {
        learnBatch(in, batch, n, draft, lookup, decay, strength);
    }
}

} // namespace

cudaError_t launchLearn(LearnInputs const& in, int32_t batch, int32_t n, LearnTable const& draft,
    LearnTable const& lookup, double decay, double strength, cudaStream_t stream)
{
    if (learnShapeError(batch, n, draft, lookup, in.ngram != nullptr, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    learnKernel<<<1, 1, 0, stream>>>(in, batch, n, draft, lookup, decay, strength);
    return cudaGetLastError();
}

cudaError_t launchSelect(SelectRow const& row, int32_t batch, int32_t n, int32_t size, int64_t* outNumNodes,
    int64_t* scratch, cudaStream_t stream)
{
    if (selectShapeError(batch, n, size, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kSelectRowsPerBlock - 1) / kSelectRowsPerBlock);
    selectKernel<<<blocks, kSelectRowsPerBlock * kWarp, 0, stream>>>(row, batch, n, size, outNumNodes, scratch);
    return cudaGetLastError();
}

cudaError_t launchVisibility(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t maxHops, unsigned char* out, cudaStream_t stream)
{
    if (visibilityShapeError(batch, n, maxHops, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const nodes = static_cast<int64_t>(batch) * n;
    if (nodes == 0)
    {
        return cudaSuccess;
    }
    constexpr int32_t threads = 128;
    auto const blocks = static_cast<unsigned int>((nodes + threads - 1) / threads);
    visibilityKernel<<<blocks, threads, 0, stream>>>(parents, valid, batch, n, maxHops, out);
    return cudaGetLastError();
}

cudaError_t launchLookup(int64_t const* history, int64_t rowStride, int32_t capacity, int64_t const* lengths,
    int64_t const* limits, int32_t batch, int32_t width, int32_t maxNgram, int32_t minNgram, int32_t branches,
    int64_t* tokens, int64_t* branchLengths, int64_t* ngram, cudaStream_t stream)
{
    if (lookupShapeError(batch, capacity, width, branches, maxNgram, minNgram, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    lookupKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(history, rowStride, capacity, lengths, limits, batch,
        width, maxNgram, minNgram, branches, tokens, branchLengths, ngram);
    return cudaGetLastError();
}

cudaError_t launchGraft(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* numNodes, double const* scores, double const* poolCond, int32_t batch,
    int32_t poolSize, int64_t const* branchTokens, double const* branchCond, int32_t branches, int32_t width,
    int64_t* outTokens, int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes,
    double* outScores, double* outCond, unsigned char* outOnBranch, int64_t* scratch, cudaStream_t stream)
{
    if (graftShapeError(batch, poolSize, branches, width, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    graftKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(tokens, parents, depths, valid, numNodes, scores,
        poolCond, batch, poolSize, branchTokens, branchCond, branches, width, outTokens, outParents, outDepths,
        outValid, outNumNodes, outScores, outCond, outOnBranch, scratch);
    return cudaGetLastError();
}

cudaError_t launchWalk(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t maxPath, int64_t* path, int64_t* lengths,
    int64_t* bonus, cudaStream_t stream)
{
    if (walkShapeError(batch, n, maxPath, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    walkKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(tokens, parents, valid, choices, batch, n, maxPath, path,
        lengths, bonus);
    return cudaGetLastError();
}

cudaError_t launchPathSums(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out,
    cudaStream_t stream)
{
    if (pathSumsShapeError(batch, n, nullptr) != DFLASH_OK)
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
    unsigned char* scratch, cudaStream_t stream)
{
    if (ddtreeShapeError(batch, depth, k, budget, nullptr) != DFLASH_OK)
    {
        return cudaErrorInvalidValue;
    }
    if (batch == 0)
    {
        return cudaSuccess;
    }
    auto const blocks = static_cast<unsigned int>((batch + kDDTreeRowsPerBlock - 1) / kDDTreeRowsPerBlock);
    ddtreeKernel<<<blocks, kDDTreeRowsPerBlock, 0, stream>>>(logprobs, tokens, roots, maxDepth, batch, depth, k,
        budget, outTokens, outParents, outDepths, outValid, outNumNodes, outScores, scratch);
    return cudaGetLastError();
}

} // namespace dflash
