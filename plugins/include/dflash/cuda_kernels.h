// Host-side launchers of the DFlash CUDA kernels (src/cuda/*.cu). Used by the
// TensorRT plugins' enqueue(). All pointers named device* / plain tensor pointers
// are device memory; host* pointers are host memory read before the launch.
//
// The per-thread bodies live in kernel_bodies.h (shared with the CPU emulation).
// The kernels cannot report bad input (there is no host round trip inside
// enqueue), so they are written to stay memory safe instead: a tree walk only
// follows parents that precede their child, and a sequence whose accepted path
// breaks the contract (see kv_compact_core.h) is skipped, not half-moved.
#pragma once

#include "dflash/learn_core.h"
#include "dflash/select_core.h"

#include <cstdint>
#include <cuda_runtime_api.h>

namespace dflash
{

//! DFlashTreeMask: see tree_mask_core.h for the contract (numNodes <= maxNodes <= 1024).
cudaError_t launchTreeMask(int32_t const* parents, int32_t const* generationLengths, int32_t batch, int32_t numNodes,
    int32_t maxNodes, int32_t* packedMask, int32_t* positionOffsets, int32_t* lengthsOut, cudaStream_t stream);

//! DFlashKVCompact on linear caches: hostLayerCaches[l] (a host array of device
//! addresses, passed to the kernel by value) is layer l's buffer [batch, 2, heads, maxSeqLen, headBytes].
cudaError_t launchKVCompactLinear(void* const* hostLayerCaches, int32_t numLayers, int32_t batch, int32_t numKVHeads,
    int32_t maxSeqLen, int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes,
    int32_t maxAccepted, int32_t const* numAccepted, cudaStream_t stream);

//! DFlashKVCompact on TensorRT-LLM's paged cache. hostPoolPointers [numPools, 2]
//! and hostPoolMapping [numLayers, 2] are the gpt attention plugin's
//! host_kv_cache_pool_pointers / host_kv_cache_pool_mapping; blockOffsets is its
//! kv_cache_block_offsets [numPools, batch, 2, maxBlocksPerSeq] on the device.
cudaError_t launchKVCompactPaged(void* const* hostPoolPointers, int32_t const* hostPoolMapping, int32_t numPools,
    int32_t numLayers, int32_t const* blockOffsets, int32_t batch, int32_t maxBlocksPerSeq, int32_t tokensPerBlock,
    int32_t numKVHeads, int32_t headBytes, int32_t const* pastLengths, int32_t const* acceptedNodes,
    int32_t maxAccepted, int32_t const* numAccepted, cudaStream_t stream);

//! newLengths[b] = pastLengths[b] + max(numAccepted[b], 0): the committed KV length
//! after compaction (the DFlashKVCompact plugin's output).
cudaError_t launchCommittedLengths(int32_t const* pastLengths, int32_t const* numAccepted, int32_t batch,
    int32_t* newLengths, cudaStream_t stream);

//! The fused DDTree build (ddtree_core.h): one thread per row; arguments as dflash_ddtree_build_cpu's, all
//! device memory (maxDepth may be null). cudaErrorInvalidValue where ddtreeShapeError refuses them.
cudaError_t launchDDTreeBuild(double const* logprobs, int64_t const* tokens, int64_t const* roots,
    int64_t const* maxDepth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* outTokens,
    int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores,
    unsigned char* scratch, cudaStream_t stream);

//! Path sums (ddtree_core.h, pathSumsRow): one thread per row; cudaErrorInvalidValue where pathSumsShapeError
//! refuses the shape.
cudaError_t launchPathSums(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out,
    cudaStream_t stream);

//! The walk (ddtree_core.h, walkRow): one thread per row; cudaErrorInvalidValue where walkShapeError refuses.
cudaError_t launchWalk(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t maxPath, int64_t* path, int64_t* lengths,
    int64_t* bonus, cudaStream_t stream);

//! Lookup branches and grafting (lookup_core.h): one thread per row; cudaErrorInvalidValue where
//! lookupShapeError / graftShapeError refuse the shape.
cudaError_t launchLookup(int64_t const* history, int64_t rowStride, int32_t capacity, int64_t const* lengths,
    int64_t const* limits, int32_t batch, int32_t width, int32_t maxNgram, int32_t minNgram, int32_t branches,
    int64_t* tokens, int64_t* branchLengths, int64_t* ngram, cudaStream_t stream);

cudaError_t launchGraft(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* numNodes, double const* scores, double const* poolCond, int32_t batch,
    int32_t poolSize, int64_t const* branchTokens, double const* branchCond, int32_t branches, int32_t width,
    int64_t* outTokens, int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes,
    double* outScores, double* outCond, unsigned char* outOnBranch, int64_t* scratch, cudaStream_t stream);

//! The cost-aware tree's select (select_core.h): one warp per row, its phases one node per lane; scratch
//! [batch, 2n] int64. cudaErrorInvalidValue where selectShapeError refuses the shape.
cudaError_t launchSelect(SelectRow const& row, int32_t batch, int32_t n, int32_t size, int64_t* outNumNodes,
    int64_t* scratch, cudaStream_t stream);

//! The ancestor-or-self mask (select_core.h, visibilityNode): one thread per node, out [batch, n, n] bytes.
//! cudaErrorInvalidValue where visibilityShapeError refuses the shape.
cudaError_t launchVisibility(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t maxHops, unsigned char* out, cudaStream_t stream);

//! The cost-aware tree's learning step (learn_core.h, learnBatch): one thread. cudaErrorInvalidValue where
//! learnShapeError refuses the shape.
cudaError_t launchLearn(LearnInputs const& in, int32_t batch, int32_t n, LearnTable const& draft,
    LearnTable const& lookup, double decay, double strength, cudaStream_t stream);

} // namespace dflash
