// C ABI of libdflash_plugins_cpu.so: the CPU implementation of both plugins,
// loaded by tensorrt_llm_dflash/kernels.py with ctypes and used as the bit-exact
// reference for the CUDA kernels.
//
// Rules shared by every function:
// * returns DFLASH_OK (0) or a DFlashStatus code; never aborts, never throws;
// * inputs are fully validated before anything is written, so on error the
//   outputs / caches are untouched;
// * `detail` may be null; when given it receives where the error was found.
#pragma once

#include "dflash/common.h"

#if defined(_WIN32)
#define DFLASH_API __declspec(dllexport)
#else
#define DFLASH_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

//! ABI version; bump when a signature changes.
DFLASH_API int32_t dflash_abi_version(void);

//! Largest tree the mask functions accept (dflash::kMaxTreeNodes).
DFLASH_API int32_t dflash_max_tree_nodes(void);

//! Static, NUL-terminated description of a status code ("unknown error" if out of range).
DFLASH_API char const* dflash_error_string(int32_t code);

//! DFlashTreeMask on the CPU (contract in tree_mask_core.h).
//! parents [batch, num_nodes], generation_lengths [batch], num_nodes <= max_nodes <= 1024;
//! outputs packed_mask [batch * num_nodes, ceil(max_nodes/32)] (rows packed by length),
//! position_offsets [batch, max_nodes], lengths_out [batch] (a copy of generation_lengths).
DFLASH_API int32_t dflash_tree_mask_cpu(int32_t const* parents, int32_t const* generation_lengths, int32_t batch,
    int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets, int32_t* lengths_out,
    DFlashErrorDetail* detail);

//! 1 when the TensorRT plugins' enqueue() returns without work (IS_BUILDING=1: TensorRT
//! is building; see enqueue_guard.h), else 0.
DFLASH_API int32_t dflash_enqueue_skipped_while_building(void);

//! DFlashKVCompact on a linear cache. layer_caches[l] points to layer l's buffer
//! [batch, 2, num_kv_heads, max_seq_len, head_bytes] (bytes). For each sequence b
//! and i < num_accepted[b], slot past_lengths[b] + i receives slot
//! past_lengths[b] + accepted_nodes[b * max_accepted + i], for K and V, every head
//! and every layer, in place.
DFLASH_API int32_t dflash_kv_compact_linear_cpu(void* const* layer_caches, int32_t num_layers, int32_t batch,
    int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted, DFlashErrorDetail* detail);

//! DFlashKVCompact on TensorRT-LLM's paged cache.
//! pool_pointers [num_pools, 2] (primary, secondary; secondary may be null when unused),
//! pool_capacity_blocks [num_pools, 2]: size of each primary / secondary pool in units
//! of one layer's K (or V) block (pool bytes / bytes_per_block), used only to refuse
//! offsets outside the pool;
//! pool_mapping [num_layers, 2] (pool index, layer index inside the pool);
//! block_offsets [num_pools, batch, 2, max_blocks_per_seq] KVCacheIndex values.
DFLASH_API int32_t dflash_kv_compact_paged_cpu(void* const* pool_pointers, int64_t const* pool_capacity_blocks,
    int32_t num_pools, int32_t const* pool_mapping, int32_t num_layers, int32_t const* block_offsets, int32_t batch,
    int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes,
    int32_t const* past_lengths, int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted,
    DFlashErrorDetail* detail);

//! Move one tensor's tail in place: `tensor` is [outer, seq_len, inner_bytes] bytes
//! (e.g. an HF cache [1, heads, seq, head_dim] with outer = heads); for every outer
//! row, slot past_len + i receives slot past_len + accepted_nodes[i].
//! This is what tensorrt_llm_dflash.kernels.compact_tail_ calls.
DFLASH_API int32_t dflash_compact_tail_cpu(void* tensor, int64_t outer, int64_t seq_len, int64_t inner_bytes,
    int32_t past_len, int32_t const* accepted_nodes, int32_t num_accepted, DFlashErrorDetail* detail);

//! DDTree's best-first tree for a batch of rows (ddtree_core.h; the same body as the CUDA
//! kernel, run row after row). topk_logprobs [batch, depth, k] float64 (each depth's row
//! sorted non-increasing; non-finite entries are never nodes), topk_tokens [batch, depth, k],
//! roots [batch], max_depth [batch] or null (a row's nodes are at most that deep).
//! Outputs [batch, budget + 1] (num_nodes [batch]): device_tree.DeviceTree's layout.
//! scratch: batch * dflash_ddtree_scratch_bytes(budget) bytes, 16-byte aligned (the rows' heaps).
//! 0 <= budget <= dflash_max_ddtree_budget(), depth >= 0, k >= 0, else DFLASH_ERR_DDTREE_SHAPE
//! (detail index 0: budget, 1: depth, 2: k).
DFLASH_API int32_t dflash_ddtree_build_cpu(double const* topk_logprobs, int64_t const* topk_tokens,
    int64_t const* roots, int64_t const* max_depth, int32_t batch, int32_t depth, int32_t k, int32_t budget,
    int64_t* tokens, int64_t* parents, int64_t* depths, unsigned char* valid, int64_t* num_nodes, double* scores,
    void* scratch, DFlashErrorDetail* detail);

//! Scratch bytes per row of the fused DDTree build at `budget` (dflash::ddtreeScratchRowBytes).
DFLASH_API int32_t dflash_ddtree_scratch_bytes(int32_t budget);

//! Path sums per row of trees in parent-first order (ddtree_core.h, pathSumsRow): values, parents and out
//! [batch, n]; out[i] = values[i] (+ out[parents[i]] when parents[i] >= 0). device_policy.path_values's sum.
DFLASH_API int32_t dflash_path_sums_cpu(double const* values, int64_t const* parents, int32_t batch, int32_t n,
    double* out, DFlashErrorDetail* detail);

//! The verifier's walk per row (ddtree_core.h, walkRow; device_tree.walk_device's result): tokens, parents,
//! valid (bytes) and choices [batch, n]; outputs path [batch, max_path], lengths and bonus [batch].
DFLASH_API int32_t dflash_walk_cpu(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t max_path, int64_t* path, int64_t* lengths,
    int64_t* bonus, DFlashErrorDetail* detail);

//! Prompt-lookup branches per row (lookup_core.h, lookupRow; device_lookup.lookup_device's result): history rows
//! `row_stride` apart with `capacity` readable tokens each, lengths [batch], limits [batch] or null (a per-row cap
//! on the width); outputs tokens [batch, branches, width], branch_lengths [batch, branches], ngram [batch].
DFLASH_API int32_t dflash_lookup_cpu(int64_t const* history, int64_t row_stride, int32_t capacity,
    int64_t const* lengths, int64_t const* limits, int32_t batch, int32_t width, int32_t max_ngram,
    int32_t min_ngram, int32_t branches, int64_t* tokens, int64_t* branch_lengths, int64_t* ngram,
    DFlashErrorDetail* detail);

//! The branches grafted into the pool per row (lookup_core.h, graftRow; device_lookup.graft_device's result): pool
//! [batch, pool_size] (+ num_nodes [batch]), branch tokens and conditionals [batch, branches, width]; outputs
//! [batch, pool_size + branches * width] (+ out_num_nodes [batch]); scratch [batch, width].
DFLASH_API int32_t dflash_graft_cpu(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* num_nodes, double const* scores, double const* pool_cond,
    int32_t batch, int32_t pool_size, int64_t const* branch_tokens, double const* branch_cond, int32_t branches,
    int32_t width, int64_t* out_tokens, int64_t* out_parents, int64_t* out_depths, unsigned char* out_valid,
    int64_t* out_num_nodes, double* out_scores, double* out_cond, unsigned char* out_on_branch, int64_t* scratch,
    DFlashErrorDetail* detail);

//! The cost-aware tree's `size` best candidates per row (select_core.h; device_policy.DevicePolicy.select's result):
//! values (float64), tokens, parents, depths, valid (bytes), scores, cond, on_branch (bytes) [batch, n] in
//! parent-first order; outputs [batch, size] (+ out_num_nodes [batch]); scratch [batch, 2 * n] int64.
//! n >= 1 (detail index 3) and 1 <= size <= n (index 9), else DFLASH_ERR_DDTREE_SHAPE.
DFLASH_API int32_t dflash_select_cpu(double const* values, int64_t const* tokens, int64_t const* parents,
    int64_t const* depths, unsigned char const* valid, double const* scores, double const* cond,
    unsigned char const* on_branch, int32_t batch, int32_t n, int32_t size, int64_t* out_tokens, int64_t* out_parents,
    int64_t* out_depths, unsigned char* out_valid, int64_t* out_num_nodes, double* out_scores, double* out_cond,
    unsigned char* out_on_branch, int64_t* scratch, DFlashErrorDetail* detail);

//! The ancestor-or-self mask (select_core.h, visibilityNode; device_tree.visibility_device's result): parents and
//! valid (bytes) [batch, n]; out [batch, n, n] bytes. n >= 1 (index 3), max_hops >= 0 (index 10).
DFLASH_API int32_t dflash_visibility_cpu(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t max_hops, unsigned char* out, DFlashErrorDetail* detail);

//! The cost-aware tree's learning step (learn_core.h; device_policy.DevicePolicy.learn's update of its tables), in
//! place on the tables: the verified trees' tokens, parents, depths, valid and on_branch (bytes) and the target's
//! choices [batch, n]; the drafter table's cells per node (draft_rows, draft_bins [batch, n], drafted bytes);
//! live [batch] bytes or null; ngram [batch] or null (then the lookup table is neither read nor written). Tables
//! [rows, bins] float64 (hits, trials, table updated; prior read), lookup_edges: lookup_bins - 1 inner edges.
//! n (detail index 3), rows (11) and bins (12) >= 1, else DFLASH_ERR_DDTREE_SHAPE.
DFLASH_API int32_t dflash_learn_cpu(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, unsigned char const* on_branch, int64_t const* choices, int64_t const* draft_rows,
    int64_t const* draft_bins, unsigned char const* drafted, unsigned char const* live, int64_t const* ngram,
    int32_t batch, int32_t n, double* hits, double* trials, double const* prior, double* table, int32_t rows,
    int32_t bins, double* lookup_hits, double* lookup_trials, double const* lookup_prior, double* lookup_table,
    int32_t lookup_rows, int32_t lookup_bins, double const* lookup_edges, double decay, double strength, DFlashErrorDetail* detail);

//! Largest budget dflash_ddtree_build_cpu / _cuda take (dflash::kMaxDDTreeBudget).
DFLASH_API int32_t dflash_max_ddtree_budget(void);

// ---------------------------------------------------------------------------
// GPU kernel emulation (test aid). These run the CUDA kernels' per-thread bodies
// (include/dflash/kernel_bodies.h) serially over the same grid and with the same
// launch plans as src/cuda/*.cu, so the kernels' indexing can be tested without a
// GPU. Like the kernels, they do not validate the tree or the accepted paths: a
// sequence whose path breaks the contract is skipped. They return DFLASH_OK, or
// DFLASH_ERR_BAD_GEOMETRY where the CUDA launcher returns cudaErrorInvalidValue.

DFLASH_API int32_t dflash_emulate_tree_mask_kernel(int32_t const* parents, int32_t const* generation_lengths,
    int32_t batch, int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets,
    int32_t* lengths_out);

DFLASH_API int32_t dflash_emulate_kv_compact_linear_kernel(void* const* layer_caches, int32_t num_layers,
    int32_t batch, int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted);

DFLASH_API int32_t dflash_emulate_kv_compact_paged_kernel(void* const* pool_pointers, int32_t num_pools,
    int32_t const* pool_mapping, int32_t num_layers, int32_t const* block_offsets, int32_t batch,
    int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes,
    int32_t const* past_lengths, int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted);

#ifdef __cplusplus
}
#endif
