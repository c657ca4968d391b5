// Serial CPU emulation of the CUDA kernels (see dflash_cpu.h). Each function mirrors
// its launcher in src/cuda/*.cu line for line, with the <<<grid, block>>> launch
// replaced by loops over blockIdx and threadIdx. Sequential threads are a faithful
// model here because the kernels have no shared memory, no barriers and no two
// threads writing or reading-after-writing the same bytes.

#include "dflash/dflash_cpu.h"
#include "dflash/kernel_bodies.h"

namespace
{

using dflash::kLayersPerLaunch;
using dflash::kThreadsPerBlock;

//! One emulated launch over grid (x, y, z) with kThreadsPerBlock threads per block.
template <typename Body>
void runGrid(int32_t gridX, int32_t gridY, int32_t gridZ, Body body)
{
    for (int32_t z = 0; z < gridZ; ++z)
    {
        for (int32_t y = 0; y < gridY; ++y)
        {
            for (int32_t x = 0; x < gridX; ++x)
            {
                for (int32_t thread = 0; thread < kThreadsPerBlock; ++thread)
                {
                    body(x, y, z, thread);
                }
            }
        }
    }
}

} // namespace

extern "C" {

int32_t dflash_emulate_tree_mask_kernel(int32_t const* parents, int32_t const* generation_lengths, int32_t batch,
    int32_t num_nodes, int32_t max_nodes, int32_t* packed_mask, int32_t* position_offsets, int32_t* lengths_out)
{
    if (batch < 0 || num_nodes < 1 || max_nodes < num_nodes || max_nodes > dflash::kMaxTreeNodes)
    {
        return DFLASH_ERR_BAD_GEOMETRY;
    }
    int64_t const threads = static_cast<int64_t>(batch) * max_nodes;
    auto const blocks = static_cast<int32_t>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
    int32_t const numWords = dflash::maskWordsFor(max_nodes);
    runGrid(blocks, 1, 1,
        [&](int32_t x, int32_t, int32_t, int32_t thread)
        {
            int64_t const t = static_cast<int64_t>(x) * kThreadsPerBlock + thread;
            if (t < threads)
            {
                dflash::treeMaskThread(t, parents, generation_lengths, batch, num_nodes, max_nodes, numWords,
                    packed_mask, position_offsets, lengths_out);
            }
        });
    return DFLASH_OK;
}

int32_t dflash_emulate_kv_compact_linear_kernel(void* const* layer_caches, int32_t num_layers, int32_t batch,
    int32_t num_kv_heads, int32_t max_seq_len, int32_t head_bytes, int32_t const* past_lengths,
    int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted)
{
    if (layer_caches == nullptr || num_layers < 1 || batch < 0 || num_kv_heads < 1 || max_seq_len < 1
        || head_bytes < 1 || max_accepted < 1)
    {
        return DFLASH_ERR_BAD_GEOMETRY;
    }
    for (int32_t first = 0; batch > 0 && first < num_layers; first += kLayersPerLaunch)
    {
        int32_t const count = num_layers - first < kLayersPerLaunch ? num_layers - first : kLayersPerLaunch;
        dflash::LinearLayerChunk chunk;
        int32_t const unit = dflash::planLinearChunk(layer_caches, first, count, head_bytes, chunk);
        if (unit == 0)
        {
            return DFLASH_ERR_BAD_GEOMETRY;
        }
        dflash::dispatchCopyUnit(unit,
            [&](auto vec)
            {
                runGrid(batch, num_kv_heads, count * 2,
                    [&](int32_t x, int32_t y, int32_t z, int32_t thread)
                    {
                        dflash::kvCompactLinearThread<decltype(vec)>(x, y, z, thread, kThreadsPerBlock, chunk,
                            num_kv_heads, max_seq_len, head_bytes, past_lengths, accepted_nodes, max_accepted,
                            num_accepted);
                    });
            });
    }
    return DFLASH_OK;
}

int32_t dflash_emulate_kv_compact_paged_kernel(void* const* pool_pointers, int32_t num_pools,
    int32_t const* pool_mapping, int32_t num_layers, int32_t const* block_offsets, int32_t batch,
    int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_kv_heads, int32_t head_bytes,
    int32_t const* past_lengths, int32_t const* accepted_nodes, int32_t max_accepted, int32_t const* num_accepted)
{
    if (pool_pointers == nullptr || pool_mapping == nullptr || block_offsets == nullptr || num_pools < 1
        || num_layers < 1 || batch < 0 || max_blocks_per_seq < 1 || !dflash::isPowerOfTwo(tokens_per_block)
        || num_kv_heads < 1 || head_bytes < 1 || max_accepted < 1)
    {
        return DFLASH_ERR_BAD_GEOMETRY;
    }
    int64_t const bytesPerBlock = dflash::pagedBytesPerBlock(tokens_per_block, num_kv_heads, head_bytes);
    int64_t const poolStride = static_cast<int64_t>(batch) * 2 * max_blocks_per_seq;
    int32_t const tokensPerBlockLog2 = dflash::log2OfPowerOfTwo(tokens_per_block);
    for (int32_t first = 0; batch > 0 && first < num_layers; first += kLayersPerLaunch)
    {
        int32_t const count = num_layers - first < kLayersPerLaunch ? num_layers - first : kLayersPerLaunch;
        dflash::PagedLayerChunk chunk;
        int32_t const unit = dflash::planPagedChunk(pool_pointers, pool_mapping, num_pools, block_offsets,
            poolStride, bytesPerBlock, first, count, head_bytes, chunk);
        if (unit == 0)
        {
            return DFLASH_ERR_BAD_GEOMETRY;
        }
        dflash::dispatchCopyUnit(unit,
            [&](auto vec)
            {
                runGrid(batch, num_kv_heads, count * 2,
                    [&](int32_t x, int32_t y, int32_t z, int32_t thread)
                    {
                        dflash::kvCompactPagedThread<decltype(vec)>(x, y, z, thread, kThreadsPerBlock, chunk,
                            max_blocks_per_seq, tokens_per_block, tokensPerBlockLog2, head_bytes, bytesPerBlock,
                            past_lengths, accepted_nodes, max_accepted, num_accepted);
                    });
            });
    }
    return DFLASH_OK;
}

} // extern "C"
