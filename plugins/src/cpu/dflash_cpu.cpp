// CPU implementation of the DFlash plugins (C ABI, see include/dflash/dflash_cpu.h).
// The per-element logic lives in the shared __host__ __device__ headers so the CUDA
// kernels and this file cannot drift apart.

#include "dflash/dflash_cpu.h"
#include "dflash/ddtree_core.h"
#include "dflash/learn_core.h"
#include "dflash/lookup_core.h"
#include "dflash/select_core.h"
#include "dflash/kv_compact_core.h"
#include "dflash/enqueue_guard.h"
#include "dflash/tree_mask_core.h"

#include <cstring>

namespace
{

using dflash::reportError;

constexpr int32_t kAbiVersion = 4;

char const* const kErrorStrings[DFLASH_ERR_COUNT] = {
    "ok",
    "a required pointer argument is null",
    "batch size is negative",
    "tree size N is out of range 1..1024",
    "generation length is out of range 1..N",
    "the root's parent must be -1",
    "only the root may have a negative parent",
    "parent index is out of range (>= the tree's length)",
    "a parent must come before its child",
    "a cache dimension (layers, heads, head bytes, max length, pools, blocks) is not positive",
    "past (committed) length is negative",
    "number of accepted nodes is out of range 0..max_accepted",
    "accepted_nodes[0] must be 0 (the root)",
    "accepted nodes must be strictly increasing",
    "an accepted node's slot is beyond the cache capacity",
    "tokens_per_block must be a positive power of two",
    "pool mapping refers to a pool or layer that does not exist",
    "a block offset points outside its pool, or the pool pointer is null",
    "a CUDA call failed (the detail's value is the cudaError_t)",
    "a fused tree kernel's shape (budget, depth, ranks, nodes, path, capacity, width, branches, n-gram) is out of range",
};

//! Validate all sequences' accepted paths; capacity is the per-sequence slot count.
int32_t validateAllAccepted(int32_t const* pastLengths, int32_t const* accepted, int32_t maxAccepted,
    int32_t const* numAccepted, int32_t batch, int64_t capacity, DFlashErrorDetail* detail)
{
    for (int32_t seq = 0; seq < batch; ++seq)
    {
        int32_t badIndex = -1;
        int64_t badValue = 0;
        int32_t const code = dflash::validateAcceptedRow(accepted + static_cast<int64_t>(seq) * maxAccepted,
            numAccepted[seq], maxAccepted, pastLengths[seq], capacity, &badIndex, &badValue);
        if (code != DFLASH_OK)
        {
            return reportError(detail, code, seq, badIndex, badValue);
        }
    }
    return DFLASH_OK;
}

//! In-order forward copy of one (seq, kv, head) row. `slotAddress(token)` maps a
//! token index to its bytes. Safe in place: destination past+i never exceeds the
//! source past+accepted[i], and every later source lies beyond every earlier
//! destination because accepted[] is strictly increasing.
template <typename SlotAddress>
void moveAcceptedSlots(SlotAddress slotAddress, int32_t pastLength, int32_t const* accepted, int32_t numAccepted,
    int32_t headBytes)
{
    for (int32_t i = 0; i < numAccepted; ++i)
    {
        if (accepted[i] == i)
        {
            continue; // already in place (always true for the root)
        }
        char const* src = slotAddress(pastLength + accepted[i]);
        char* dst = slotAddress(pastLength + i);
        std::memcpy(dst, src, static_cast<size_t>(headBytes));
    }
}

} // namespace

extern "C" {

int32_t dflash_abi_version(void)
{
    return kAbiVersion;
}

int32_t dflash_max_tree_nodes(void)
{
    return dflash::kMaxTreeNodes;
}

char const* dflash_error_string(int32_t code)
{
    if (code < 0 || code >= DFLASH_ERR_COUNT)
    {
        return "unknown error";
    }
    return kErrorStrings[code];
}

int32_t dflash_tree_mask_cpu(int32_t const* parents, int32_t const* generation_lengths, int32_t batch,
    int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets, int32_t* lengths_out,
    DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (batch < 0)
    {
        return reportError(detail, DFLASH_ERR_BATCH_OUT_OF_RANGE, -1, -1, batch);
    }
    if (num_nodes < 1 || num_nodes > dflash::kMaxTreeNodes)
    {
        return reportError(detail, DFLASH_ERR_TREE_TOO_LARGE, -1, -1, num_nodes);
    }
    if (max_nodes < num_nodes || max_nodes > dflash::kMaxTreeNodes)
    {
        return reportError(detail, DFLASH_ERR_TREE_TOO_LARGE, -1, -1, max_nodes);
    }
    if (batch > 0
        && (parents == nullptr || generation_lengths == nullptr || packed_mask == nullptr
            || position_offsets == nullptr || lengths_out == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t seq = 0; seq < batch; ++seq)
    {
        int32_t badIndex = -1;
        int64_t badValue = 0;
        int32_t const code = dflash::validateTreeRow(parents + static_cast<int64_t>(seq) * num_nodes, num_nodes,
            generation_lengths[seq], &badIndex, &badValue);
        if (code != DFLASH_OK)
        {
            return reportError(detail, code, seq, badIndex, badValue);
        }
    }

    int32_t const numWords = dflash::maskWordsFor(max_nodes);
    std::memset(packed_mask, 0, sizeof(int32_t) * static_cast<size_t>(batch) * num_nodes * numWords);
    std::memset(position_offsets, 0, sizeof(int32_t) * static_cast<size_t>(batch) * max_nodes);
    uint32_t rowWords[dflash::kMaxMaskWords];
    int64_t row = 0; // rows packed tightly: sequence after sequence, each its own length
    for (int32_t seq = 0; seq < batch; ++seq)
    {
        int32_t const* rowParents = parents + static_cast<int64_t>(seq) * num_nodes;
        int32_t const length = generation_lengths[seq];
        for (int32_t node = 0; node < length; ++node, ++row)
        {
            int32_t const depth = dflash::buildMaskRow(rowParents, node, rowWords, numWords);
            std::memcpy(packed_mask + row * numWords, rowWords, sizeof(uint32_t) * static_cast<size_t>(numWords));
            position_offsets[static_cast<int64_t>(seq) * max_nodes + node] = depth;
        }
        lengths_out[seq] = length;
    }
    return DFLASH_OK;
}

int32_t dflash_enqueue_skipped_while_building(void)
{
    return dflash::skipEnqueueWhileBuilding() ? 1 : 0;
}

int32_t dflash_kv_compact_linear_cpu(void* const* layer_caches, int32_t num_layers, int32_t batch,
    int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (batch < 0)
    {
        return reportError(detail, DFLASH_ERR_BATCH_OUT_OF_RANGE, -1, -1, batch);
    }
    if (num_layers < 1 || num_kv_heads < 1 || max_seq_len < 1 || head_bytes < 1 || max_accepted < 1)
    {
        return reportError(detail, DFLASH_ERR_BAD_GEOMETRY, -1, -1, -1);
    }
    if (batch == 0)
    {
        return DFLASH_OK;
    }
    if (layer_caches == nullptr || past_lengths == nullptr || accepted_nodes == nullptr || num_accepted == nullptr)
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t layer = 0; layer < num_layers; ++layer)
    {
        if (layer_caches[layer] == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, layer, 0);
        }
    }
    int32_t const code
        = validateAllAccepted(past_lengths, accepted_nodes, max_accepted, num_accepted, batch, max_seq_len, detail);
    if (code != DFLASH_OK)
    {
        return code;
    }

    for (int32_t layer = 0; layer < num_layers; ++layer)
    {
        char* base = static_cast<char*>(layer_caches[layer]);
        for (int32_t seq = 0; seq < batch; ++seq)
        {
            int32_t const* accepted = accepted_nodes + static_cast<int64_t>(seq) * max_accepted;
            for (int32_t kv = 0; kv < 2; ++kv)
            {
                for (int32_t head = 0; head < num_kv_heads; ++head)
                {
                    auto slotAddress = [&](int32_t token)
                    {
                        return base
                            + dflash::linearSlotByteOffset(seq, kv, head, token, num_kv_heads, max_seq_len, head_bytes);
                    };
                    moveAcceptedSlots(slotAddress, past_lengths[seq], accepted, num_accepted[seq], head_bytes);
                }
            }
        }
    }
    return DFLASH_OK;
}

int32_t dflash_kv_compact_paged_cpu(void* const* pool_pointers, int64_t const* pool_capacity_blocks,
    int32_t num_pools, int32_t const* pool_mapping, int32_t num_layers, int32_t const* block_offsets, int32_t batch,
    int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes,
    int32_t const* past_lengths, int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted,
    DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (batch < 0)
    {
        return reportError(detail, DFLASH_ERR_BATCH_OUT_OF_RANGE, -1, -1, batch);
    }
    if (num_pools < 1 || num_layers < 1 || max_blocks_per_seq < 1 || num_kv_heads < 1 || head_bytes < 1
        || max_accepted < 1)
    {
        return reportError(detail, DFLASH_ERR_BAD_GEOMETRY, -1, -1, -1);
    }
    if (!dflash::isPowerOfTwo(tokens_per_block))
    {
        return reportError(detail, DFLASH_ERR_TOKENS_PER_BLOCK, -1, -1, tokens_per_block);
    }
    if (batch == 0)
    {
        return DFLASH_OK;
    }
    if (pool_pointers == nullptr || pool_capacity_blocks == nullptr || pool_mapping == nullptr
        || block_offsets == nullptr || past_lengths == nullptr || accepted_nodes == nullptr
        || num_accepted == nullptr)
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    int64_t const capacity = static_cast<int64_t>(max_blocks_per_seq) * tokens_per_block;
    int32_t code
        = validateAllAccepted(past_lengths, accepted_nodes, max_accepted, num_accepted, batch, capacity, detail);
    if (code != DFLASH_OK)
    {
        return code;
    }

    int64_t const bytesPerBlock = dflash::pagedBytesPerBlock(tokens_per_block, num_kv_heads, head_bytes);
    int32_t const tokensPerBlockLog2 = dflash::log2OfPowerOfTwo(tokens_per_block);
    int64_t const poolStride = static_cast<int64_t>(batch) * 2 * max_blocks_per_seq;

    // Check every block the copy will touch before moving a byte, so a bad table
    // leaves the cache untouched.
    for (int32_t layer = 0; layer < num_layers; ++layer)
    {
        int32_t const pool = pool_mapping[layer * 2];
        int32_t const layerInPool = pool_mapping[layer * 2 + 1];
        if (pool < 0 || pool >= num_pools || layerInPool < 0)
        {
            int64_t const badValue = (pool < 0 || pool >= num_pools) ? pool : layerInPool;
            return reportError(detail, DFLASH_ERR_POOL_MAPPING, -1, layer, badValue);
        }
        for (int32_t seq = 0; seq < batch; ++seq)
        {
            int32_t const count = num_accepted[seq];
            if (count == 0)
            {
                continue;
            }
            int32_t const* accepted = accepted_nodes + static_cast<int64_t>(seq) * max_accepted;
            int32_t const firstBlock = past_lengths[seq] >> tokensPerBlockLog2;
            int32_t const lastBlock = (past_lengths[seq] + accepted[count - 1]) >> tokensPerBlockLog2;
            for (int32_t kv = 0; kv < 2; ++kv)
            {
                int32_t const* row = block_offsets + pool * poolStride
                    + dflash::pagedOffsetRowStart(seq, kv, max_blocks_per_seq);
                for (int32_t block = firstBlock; block <= lastBlock; ++block)
                {
                    int32_t const raw = row[block];
                    int32_t const side = dflash::isPrimaryBlock(raw) ? 0 : 1;
                    // The block (index, layer-in-pool, kv) must lie inside its pool:
                    // layerInPool * 2 + index + 1 blocks from the pool start.
                    int64_t const lastUsed = static_cast<int64_t>(layerInPool) * 2 + dflash::blockIndexOf(raw);
                    if (pool_pointers[pool * 2 + side] == nullptr
                        || lastUsed >= pool_capacity_blocks[pool * 2 + side])
                    {
                        return reportError(detail, DFLASH_ERR_BLOCK_OFFSET, seq, block, raw);
                    }
                }
            }
        }
    }

    for (int32_t layer = 0; layer < num_layers; ++layer)
    {
        int32_t const pool = pool_mapping[layer * 2];
        int64_t const layerOffset = static_cast<int64_t>(pool_mapping[layer * 2 + 1]) * 2 * bytesPerBlock;
        char* primaryBase = static_cast<char*>(pool_pointers[pool * 2]) + layerOffset;
        char* secondaryBase = pool_pointers[pool * 2 + 1] == nullptr
            ? nullptr
            : static_cast<char*>(pool_pointers[pool * 2 + 1]) + layerOffset;
        for (int32_t seq = 0; seq < batch; ++seq)
        {
            int32_t const* accepted = accepted_nodes + static_cast<int64_t>(seq) * max_accepted;
            for (int32_t kv = 0; kv < 2; ++kv)
            {
                int32_t const* row
                    = block_offsets + pool * poolStride + dflash::pagedOffsetRowStart(seq, kv, max_blocks_per_seq);
                for (int32_t head = 0; head < num_kv_heads; ++head)
                {
                    auto slotAddress = [&](int32_t token)
                    {
                        return dflash::pagedSlotAddress(primaryBase, secondaryBase, row, head, token, tokens_per_block,
                            tokensPerBlockLog2, bytesPerBlock, head_bytes);
                    };
                    moveAcceptedSlots(slotAddress, past_lengths[seq], accepted, num_accepted[seq], head_bytes);
                }
            }
        }
    }
    return DFLASH_OK;
}

int32_t dflash_compact_tail_cpu(void* tensor, int64_t outer, int64_t seq_len, int64_t inner_bytes, int32_t past_len,
    int32_t const* accepted_nodes, int32_t num_accepted, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (outer < 1 || seq_len < 1 || inner_bytes < 1)
    {
        return reportError(detail, DFLASH_ERR_BAD_GEOMETRY, -1, -1, -1);
    }
    if (tensor == nullptr || (num_accepted > 0 && accepted_nodes == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    int32_t badIndex = -1;
    int64_t badValue = 0;
    int32_t const maxAccepted = num_accepted > 0 ? num_accepted : 1;
    int32_t const code = dflash::validateAcceptedRow(
        accepted_nodes, num_accepted, maxAccepted, past_len, seq_len, &badIndex, &badValue);
    if (code != DFLASH_OK)
    {
        return reportError(detail, code, 0, badIndex, badValue);
    }
    char* base = static_cast<char*>(tensor);
    for (int64_t row = 0; row < outer; ++row)
    {
        char* rowBase = base + row * seq_len * inner_bytes;
        for (int32_t i = 0; i < num_accepted; ++i)
        {
            if (accepted_nodes[i] == i)
            {
                continue;
            }
            std::memcpy(rowBase + (past_len + static_cast<int64_t>(i)) * inner_bytes,
                rowBase + (past_len + static_cast<int64_t>(accepted_nodes[i])) * inner_bytes,
                static_cast<size_t>(inner_bytes));
        }
    }
    return DFLASH_OK;
}

int32_t dflash_max_ddtree_budget(void)
{
    return dflash::kMaxDDTreeBudget;
}

int32_t dflash_ddtree_scratch_bytes(int32_t budget)
{
    return static_cast<int32_t>(dflash::ddtreeScratchRowBytes(budget));
}

int32_t dflash_ddtree_build_cpu(double const* topk_logprobs, int64_t const* topk_tokens, int64_t const* roots,
    int64_t const* max_depth, int32_t batch, int32_t depth, int32_t k, int32_t budget, int64_t* tokens,
    int64_t* parents, int64_t* depths, unsigned char* valid, int64_t* num_nodes, double* scores, void* scratch,
    DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::ddtreeShapeError(batch, depth, k, budget, detail); code != DFLASH_OK)
    {
        return code;
    }
    bool const needsInputs = depth > 0 && k > 0;
    if (batch > 0
        && ((needsInputs && (topk_logprobs == nullptr || topk_tokens == nullptr)) || roots == nullptr
            || tokens == nullptr || parents == nullptr || depths == nullptr || valid == nullptr
            || num_nodes == nullptr || scores == nullptr || scratch == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's threads, one after another
    {
        dflash::ddtreeRowThread(row, topk_logprobs, topk_tokens, roots, max_depth, depth, k, budget, tokens, parents,
            depths, valid, num_nodes, scores, static_cast<unsigned char*>(scratch));
    }
    return DFLASH_OK;
}

int32_t dflash_path_sums_cpu(double const* values, int64_t const* parents, int32_t batch, int32_t n, double* out,
    DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::pathSumsShapeError(batch, n, detail); code != DFLASH_OK)
    {
        return code;
    }
    if (batch > 0 && n > 0 && (values == nullptr || parents == nullptr || out == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's threads, one after another
    {
        int64_t const offset = static_cast<int64_t>(row) * n;
        dflash::pathSumsRow(values + offset, parents + offset, n, out + offset);
    }
    return DFLASH_OK;
}

int32_t dflash_walk_cpu(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t batch, int32_t n, int32_t max_path, int64_t* path, int64_t* lengths,
    int64_t* bonus, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::walkShapeError(batch, n, max_path, detail); code != DFLASH_OK)
    {
        return code;
    }
    if (batch > 0
        && (tokens == nullptr || parents == nullptr || valid == nullptr || choices == nullptr || path == nullptr
            || lengths == nullptr || bonus == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's threads, one after another
    {
        int64_t const offset = static_cast<int64_t>(row) * n;
        dflash::walkRow(tokens + offset, parents + offset, valid + offset, choices + offset, n, max_path,
            path + static_cast<int64_t>(row) * max_path, lengths + row, bonus + row);
    }
    return DFLASH_OK;
}

int32_t dflash_select_cpu(double const* values, int64_t const* tokens, int64_t const* parents,
    int64_t const* depths, unsigned char const* valid, double const* scores, double const* cond,
    unsigned char const* on_branch, int32_t batch, int32_t n, int32_t size, int64_t* out_tokens, int64_t* out_parents,
    int64_t* out_depths, unsigned char* out_valid, int64_t* out_num_nodes, double* out_scores, double* out_cond,
    unsigned char* out_on_branch, int64_t* scratch, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::selectShapeError(batch, n, size, detail); code != DFLASH_OK)
    {
        return code;
    }
    void const* pointers[] = {values, tokens, parents, depths, valid, scores, cond, on_branch, out_tokens,
        out_parents, out_depths, out_valid, out_num_nodes, out_scores, out_cond, out_on_branch, scratch};
    for (void const* pointer : pointers)
    {
        if (batch > 0 && pointer == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
        }
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's warps, one after another; a phase's lanes in a loop
    {
        int64_t const in = static_cast<int64_t>(row) * n;
        int64_t const out = static_cast<int64_t>(row) * size;
        int64_t* ranks = scratch + 2 * in;
        int64_t* slots = ranks + n;
        dflash::SelectRow const mine{values + in, tokens + in, parents + in, depths + in, valid + in, scores + in,
            cond + in, on_branch + in, out_tokens + out, out_parents + out, out_depths + out, out_valid + out,
            out_scores + out, out_cond + out, out_on_branch + out};
        for (int32_t i = 0; i < n; ++i)
        {
            ranks[i] = dflash::selectRank(mine.values, n, i);
        }
        for (int32_t i = 0; i < n; ++i)
        {
            slots[i] = dflash::selectSlot(ranks, size, i);
        }
        for (int32_t i = 0; i < n; ++i)
        {
            if (slots[i] >= 0)
            {
                dflash::selectEmit(mine, slots, n, i);
            }
        }
        out_num_nodes[row] = dflash::selectCount(mine.outValid, size);
    }
    return DFLASH_OK;
}

int32_t dflash_visibility_cpu(int64_t const* parents, unsigned char const* valid, int32_t batch, int32_t n,
    int64_t max_hops, unsigned char* out, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::visibilityShapeError(batch, n, max_hops, detail); code != DFLASH_OK)
    {
        return code;
    }
    if (batch > 0 && (parents == nullptr || valid == nullptr || out == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int64_t node = 0; node < static_cast<int64_t>(batch) * n; ++node) // the kernel's threads
    {
        int64_t const row = node / n;
        dflash::visibilityNode(parents + row * n, valid + row * n, n, max_hops, static_cast<int32_t>(node % n),
            out + node * n);
    }
    return DFLASH_OK;
}

int32_t dflash_learn_cpu(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, unsigned char const* on_branch, int64_t const* choices, int64_t const* draft_rows,
    int64_t const* draft_bins, unsigned char const* drafted, unsigned char const* live, int64_t const* ngram,
    int32_t batch, int32_t n, double* hits, double* trials, double const* prior, double* table, int32_t rows,
    int32_t bins, double* lookup_hits, double* lookup_trials, double const* lookup_prior, double* lookup_table,
    int32_t lookup_rows, int32_t lookup_bins, double const* lookup_edges, double decay, double strength, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    dflash::LearnInputs const in{tokens, parents, depths, valid, on_branch, choices, draft_rows, draft_bins, drafted,
        live, ngram, lookup_edges};
    dflash::LearnTable const draft{hits, trials, prior, table, rows, bins};
    dflash::LearnTable const lookup{lookup_hits, lookup_trials, lookup_prior, lookup_table, lookup_rows, lookup_bins};
    if (int32_t const code = dflash::learnShapeError(batch, n, draft, lookup, ngram != nullptr, detail);
        code != DFLASH_OK)
    {
        return code;
    }
    void const* required[] = {hits, trials, prior, table};
    void const* perNode[] = {tokens, parents, depths, valid, on_branch, choices, draft_rows, draft_bins, drafted};
    void const* perLookup[] = {lookup_hits, lookup_trials, lookup_prior, lookup_table, lookup_edges};
    for (void const* pointer : required)
    {
        if (pointer == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
        }
    }
    for (void const* pointer : perNode)
    {
        if (batch > 0 && pointer == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
        }
    }
    for (void const* pointer : perLookup)
    {
        if (ngram != nullptr && pointer == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
        }
    }
    dflash::learnBatch(in, batch, n, draft, lookup, decay, strength); // the kernel's one thread
    return DFLASH_OK;
}

int32_t dflash_lookup_cpu(int64_t const* history, int64_t row_stride, int32_t capacity, int64_t const* lengths,
    int64_t const* limits, int32_t batch, int32_t width, int32_t max_ngram, int32_t min_ngram, int32_t branches,
    int64_t* tokens, int64_t* branch_lengths, int64_t* ngram, DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::lookupShapeError(batch, capacity, width, branches, max_ngram, min_ngram, detail); code != DFLASH_OK)
    {
        return code;
    }
    if (batch > 0
        && ((capacity > 0 && history == nullptr) || lengths == nullptr || tokens == nullptr
            || branch_lengths == nullptr || ngram == nullptr))
    {
        return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's threads, one after another
    {
        dflash::lookupRowThread(row, history, row_stride, capacity, lengths, limits, width, max_ngram, min_ngram,
            branches, tokens, branch_lengths, ngram);
    }
    return DFLASH_OK;
}

int32_t dflash_graft_cpu(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* num_nodes, double const* scores, double const* pool_cond,
    int32_t batch, int32_t pool_size, int64_t const* branch_tokens, double const* branch_cond, int32_t branches,
    int32_t width, int64_t* out_tokens, int64_t* out_parents, int64_t* out_depths, unsigned char* out_valid,
    int64_t* out_num_nodes, double* out_scores, double* out_cond, unsigned char* out_on_branch, int64_t* scratch,
    DFlashErrorDetail* detail)
{
    reportError(detail, DFLASH_OK, -1, -1, -1);
    if (int32_t const code = dflash::graftShapeError(batch, pool_size, branches, width, detail); code != DFLASH_OK)
    {
        return code;
    }
    void const* required[] = {tokens, parents, depths, valid, num_nodes, scores, pool_cond, branch_tokens,
        branch_cond, out_tokens, out_parents, out_depths, out_valid, out_num_nodes, out_scores, out_cond,
        out_on_branch, scratch};
    for (void const* pointer : required)
    {
        if (batch > 0 && pointer == nullptr)
        {
            return reportError(detail, DFLASH_ERR_NULL_POINTER, -1, -1, -1);
        }
    }
    for (int32_t row = 0; row < batch; ++row) // the kernel's threads, one after another
    {
        dflash::graftRowThread(row, tokens, parents, depths, valid, num_nodes, scores, pool_cond, pool_size,
            branch_tokens, branch_cond, branches, width, out_tokens, out_parents, out_depths, out_valid,
            out_num_nodes, out_scores, out_cond, out_on_branch, scratch);
    }
    return DFLASH_OK;
}

} // extern "C"
