// C ABI over the CUDA launchers (include/dflash/dflash_cuda.h). Host code only;
// compiled by the host compiler against the CUDA runtime headers.

#include "dflash/dflash_cuda.h"
#include "dflash/cuda_kernels.h"
#include "dflash/ddtree_core.h"
#include "dflash/learn_core.h"
#include "dflash/lookup_core.h"

namespace
{

int32_t statusOf(cudaError_t error, DFlashErrorDetail* detail)
{
    if (error == cudaSuccess)
    {
        return dflash::reportError(detail, DFLASH_OK, -1, -1, -1);
    }
    int32_t const code = error == cudaErrorInvalidValue ? DFLASH_ERR_BAD_GEOMETRY : DFLASH_ERR_CUDA;
    return dflash::reportError(detail, code, -1, -1, static_cast<int64_t>(error));
}

} // namespace

extern "C" {

int32_t dflash_tree_mask_cuda(int32_t const* parents, int32_t const* generation_lengths, int32_t batch,
    int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets, int32_t* lengths_out,
    void* stream, DFlashErrorDetail* detail)
{
    return statusOf(dflash::launchTreeMask(parents, generation_lengths, batch, num_nodes, max_nodes, packed_mask,
                        position_offsets, lengths_out, static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_kv_compact_linear_cuda(void* const* layer_caches, int32_t num_layers, int32_t batch,
    int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted, void* stream,
    DFlashErrorDetail* detail)
{
    return statusOf(dflash::launchKVCompactLinear(layer_caches, num_layers, batch, num_kv_heads, max_seq_len,
                        head_bytes, past_lengths, accepted_nodes, max_accepted, num_accepted,
                        static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_kv_compact_paged_cuda(void* const* pool_pointers, int32_t num_pools, int32_t const* pool_mapping,
    int32_t num_layers, int32_t const* block_offsets, int32_t batch, int32_t max_blocks_per_seq,
    int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted, void* stream,
    DFlashErrorDetail* detail)
{
    return statusOf(dflash::launchKVCompactPaged(pool_pointers, pool_mapping, num_pools, num_layers, block_offsets,
                        batch, max_blocks_per_seq, tokens_per_block, num_kv_heads, head_bytes, past_lengths,
                        accepted_nodes, max_accepted, num_accepted, static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_ddtree_build_cuda(double const* topk_logprobs, int64_t const* topk_tokens, int64_t const* roots,
    int64_t const* max_depth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* tokens,
    int64_t* parents, int64_t* depths, unsigned char* valid, int64_t* num_nodes, double* scores, void* scratch,
    void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::ddtreeShapeError(batch, depth, k, budget, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchDDTreeBuild(topk_logprobs, topk_tokens, roots, max_depth, batch, depth, k, budget,
                        tokens, parents, depths, valid, num_nodes, scores, static_cast<unsigned char*>(scratch),
                        static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_path_sums_cuda(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out,
    void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::pathSumsShapeError(batch, n, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchPathSums(values, parents, batch, n, out, static_cast<cudaStream_t>(stream)), detail);
}

int32_t dflash_walk_cuda(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t max_path, int64_t* path, int64_t* lengths,
    int64_t* bonus, void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::walkShapeError(batch, n, max_path, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchWalk(tokens, parents, valid, choices, batch, n, max_path, path, lengths, bonus,
                        static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_lookup_cuda(int64_t const* history, int64_t row_stride, int32_t capacity, int64_t const* lengths,
    int64_t const* limits, int32_t batch, int32_t width, int32_t max_ngram, int32_t min_ngram, int32_t branches,
    int64_t* tokens, int64_t* branch_lengths, int64_t* ngram, void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::lookupShapeError(batch, capacity, width, branches, max_ngram, min_ngram, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchLookup(history, row_stride, capacity, lengths, limits, batch, width, max_ngram,
                        min_ngram, branches, tokens, branch_lengths, ngram, static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_graft_cuda(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* num_nodes, double const* scores, double const* pool_cond,
    int32_t batch, int32_t pool_size, int64_t const* branch_tokens, double const* branch_cond, int32_t branches,
    int32_t width, int64_t* out_tokens, int64_t* out_parents, int64_t* out_depths, unsigned char* out_valid,
    int64_t* out_num_nodes, double* out_scores, double* out_cond, unsigned char* out_on_branch, int64_t* scratch,
    void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::graftShapeError(batch, pool_size, branches, width, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchGraft(tokens, parents, depths, valid, num_nodes, scores, pool_cond, batch,
                        pool_size, branch_tokens, branch_cond, branches, width, out_tokens, out_parents, out_depths,
                        out_valid, out_num_nodes, out_scores, out_cond, out_on_branch, scratch,
                        static_cast<cudaStream_t>(stream)),
        detail);
}

int32_t dflash_select_cuda(double const* values, int64_t const* tokens, int64_t const* parents,
    int64_t const* depths, unsigned char const* valid, double const* scores, double const* cond,
    unsigned char const* on_branch, int32_t batch, int32_t n, int32_t size, int64_t* out_tokens, int64_t* out_parents,
    int64_t* out_depths, unsigned char* out_valid, int64_t* out_num_nodes, double* out_scores, double* out_cond,
    unsigned char* out_on_branch, int64_t* scratch, void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::selectShapeError(batch, n, size, detail); code != DFLASH_OK)
    {
        return code;
    }
    dflash::SelectRow const row{values, tokens, parents, depths, valid, scores, cond, on_branch, out_tokens,
        out_parents, out_depths, out_valid, out_scores, out_cond, out_on_branch};
    return statusOf(
        dflash::launchSelect(row, batch, n, size, out_num_nodes, scratch, static_cast<cudaStream_t>(stream)), detail);
}

int32_t dflash_visibility_cuda(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t max_hops, unsigned char* out, void* stream, DFlashErrorDetail* detail)
{
    if (int32_t const code = dflash::visibilityShapeError(batch, n, max_hops, detail); code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(
        dflash::launchVisibility(parents, valid, batch, n, max_hops, out, static_cast<cudaStream_t>(stream)), detail);
}

int32_t dflash_learn_cuda(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, unsigned char const* on_branch, int64_t const* choices, int64_t const* draft_rows,
    int64_t const* draft_bins, unsigned char const* drafted, unsigned char const* live, int64_t const* ngram,
    int32_t batch, int32_t n, double* hits, double* trials, double const* prior, double* table, int32_t rows,
    int32_t bins, double* lookup_hits, double* lookup_trials, double const* lookup_prior, double* lookup_table,
    int32_t lookup_rows, int32_t lookup_bins, double const* lookup_edges, double decay, double strength, void* stream, DFlashErrorDetail* detail)
{
    dflash::LearnInputs const in{tokens, parents, depths, valid, on_branch, choices, draft_rows, draft_bins, drafted,
        live, ngram, lookup_edges};
    dflash::LearnTable const draft{hits, trials, prior, table, rows, bins};
    dflash::LearnTable const lookup{lookup_hits, lookup_trials, lookup_prior, lookup_table, lookup_rows, lookup_bins};
    if (int32_t const code = dflash::learnShapeError(batch, n, draft, lookup, ngram != nullptr, detail);
        code != DFLASH_OK)
    {
        return code;
    }
    return statusOf(dflash::launchLearn(in, batch, n, draft, lookup, decay, strength, static_cast<cudaStream_t>(stream)),
        detail);
}

} // extern "C"
