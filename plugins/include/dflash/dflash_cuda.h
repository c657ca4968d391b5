// C ABI of libdflash_plugins_cuda.so (built whenever nvcc is found, no TensorRT
// needed): the CUDA kernels of both plugins, callable from a Python runtime with
// ctypes on device pointers (e.g. torch tensors' data_ptr() and
// torch.cuda.current_stream().cuda_stream), for runtimes that compact the KV cache
// between engine steps instead of inside the engine.
//
// Same arguments as the CPU functions in dflash_cpu.h, except: tree / path tensors
// and caches are device memory; `layer_caches`, `pool_pointers` and `pool_mapping`
// are host arrays (as the plugins receive them); `stream` is a cudaStream_t (0 = the
// legacy default stream). The launches are asynchronous and, like the kernels, do
// not validate trees or paths (validate on the host first when the input is not
// trusted). Returns DFLASH_OK, DFLASH_ERR_BAD_GEOMETRY for arguments the launcher
// refuses, or DFLASH_ERR_CUDA with the cudaError_t in detail->value.
#pragma once

#include "dflash/dflash_cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

DFLASH_API int32_t dflash_tree_mask_cuda(int32_t const* parents, int32_t const* generation_lengths, int32_t batch,
    int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets, int32_t* lengths_out,
    void* stream, DFlashErrorDetail* detail);

DFLASH_API int32_t dflash_kv_compact_linear_cuda(void* const* layer_caches, int32_t num_layers, int32_t batch,
    int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted, void* stream,
    DFlashErrorDetail* detail);

DFLASH_API int32_t dflash_kv_compact_paged_cuda(void* const* pool_pointers, int32_t num_pools,
    int32_t const* pool_mapping, int32_t num_layers, int32_t const* block_offsets, int32_t batch,
    int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes,
    int32_t const* past_lengths, int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted,
    void* stream, DFlashErrorDetail* detail);

//! The fused DDTree build on the device (dflash_ddtree_build_cpu's arguments, device memory, asynchronous; the
//! shape is checked, the values are not). CUDA-graph safe: one kernel launch on `stream`, no allocation.
DFLASH_API int32_t dflash_ddtree_build_cuda(double const* topk_logprobs, int64_t const* topk_tokens,
    int64_t const* roots, int64_t const* max_depth, int32_t batch, int32_t depth, int32_t k, int32_t budget,
    int64_t* tokens, int64_t* parents, int64_t* depths, unsigned char* valid, int64_t* num_nodes, double* scores,
    void* scratch, void* stream, DFlashErrorDetail* detail);

//! Path sums on the device (dflash_path_sums_cpu's arguments, device memory, one thread per row, asynchronous).
DFLASH_API int32_t dflash_path_sums_cuda(double const* values, int64_t const* parents, int32_t batch, int32_t n,
    double* out, void* stream, DFlashErrorDetail* detail);

//! The walk on the device (dflash_walk_cpu's arguments, device memory, one thread per row, asynchronous).
DFLASH_API int32_t dflash_walk_cuda(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t max_path, int64_t* path, int64_t* lengths,
    int64_t* bonus, void* stream, DFlashErrorDetail* detail);

//! Lookup branches and their grafting on the device (dflash_lookup_cpu's / dflash_graft_cpu's arguments, device
//! memory, one thread per row, asynchronous).
DFLASH_API int32_t dflash_lookup_cuda(int64_t const* history, int64_t row_stride, int32_t capacity,
    int64_t const* lengths, int64_t const* limits, int32_t batch, int32_t width, int32_t max_ngram,
    int32_t min_ngram, int32_t branches, int64_t* tokens, int64_t* branch_lengths, int64_t* ngram, void* stream,
    DFlashErrorDetail* detail);

DFLASH_API int32_t dflash_graft_cuda(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* num_nodes, double const* scores, double const* pool_cond,
    int32_t batch, int32_t pool_size, int64_t const* branch_tokens, double const* branch_cond, int32_t branches,
    int32_t width, int64_t* out_tokens, int64_t* out_parents, int64_t* out_depths, unsigned char* out_valid,
    int64_t* out_num_nodes, double* out_scores, double* out_cond, unsigned char* out_on_branch, int64_t* scratch,
    void* stream, DFlashErrorDetail* detail);

//! The select and the visibility on the device (dflash_select_cpu's / dflash_visibility_cpu's arguments, device
//! memory, asynchronous; the select one warp per row, the visibility one thread per node).
DFLASH_API int32_t dflash_select_cuda(double const* values, int64_t const* tokens, int64_t const* parents,
    int64_t const* depths, unsigned char const* valid, double const* scores, double const* cond,
    unsigned char const* on_branch, int32_t batch, int32_t n, int32_t size, int64_t* out_tokens, int64_t* out_parents,
    int64_t* out_depths, unsigned char* out_valid, int64_t* out_num_nodes, double* out_scores, double* out_cond,
    unsigned char* out_on_branch, int64_t* scratch, void* stream, DFlashErrorDetail* detail);

DFLASH_API int32_t dflash_visibility_cuda(int64_t const* parents, unsigned char const* valid, int32_t batch,
    int32_t n, int64_t max_hops, unsigned char* out, void* stream, DFlashErrorDetail* detail);

//! The learning step on the device (dflash_learn_cpu's arguments, device memory, one thread: every row updates the
//! same tables; asynchronous).
DFLASH_API int32_t dflash_learn_cuda(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, unsigned char const* on_branch, int64_t const* choices, int64_t const* draft_rows,
    int64_t const* draft_bins, unsigned char const* drafted, unsigned char const* live, int64_t const* ngram,
    int32_t batch, int32_t n, double* hits, double* trials, double const* prior, double* table, int32_t rows,
    int32_t bins, double* lookup_hits, double* lookup_trials, double const* lookup_prior, double* lookup_table,
    int32_t lookup_rows, int32_t lookup_bins, double const* lookup_edges, double decay, double strength, void* stream,
    DFlashErrorDetail* detail);

#ifdef __cplusplus
}
#endif
