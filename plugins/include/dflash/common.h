// Shared definitions for the DFlash plugin library: error codes, limits and the
// host/device qualifier macro.
//
// Everything in include/dflash/ is compiled three ways: by nvcc inside the CUDA
// kernels, by g++ inside the CPU library (no CUDA toolkit needed), and by the
// TensorRT plugin classes. So this header must not include any CUDA header.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash
{

//! Largest tree (root included) the mask code accepts. Must equal
//! tensorrt_llm_dflash.tree.MAX_TREE_NODES; the Python tests check it.
constexpr int32_t kMaxTreeNodes = 1024;
//! Words of one packed-mask row at the maximum tree size.
constexpr int32_t kMaxMaskWords = (kMaxTreeNodes + 31) / 32;

} // namespace dflash

#ifdef __cplusplus
extern "C" {
#endif

//! Error codes of every C-ABI function and of the host-side checks of the
//! TensorRT plugins. Values are part of the ABI: never renumber, only append.
typedef enum DFlashStatus
{
    DFLASH_OK = 0,
    DFLASH_ERR_NULL_POINTER = 1,          //!< a required pointer argument is null
    DFLASH_ERR_BATCH_OUT_OF_RANGE = 2,    //!< batch < 0
    DFLASH_ERR_TREE_TOO_LARGE = 3,        //!< N (nodes per row) < 1 or > kMaxTreeNodes
    DFLASH_ERR_LENGTH_OUT_OF_RANGE = 4,   //!< generation length < 1 or > N
    DFLASH_ERR_ROOT_PARENT = 5,           //!< parents[0] != -1
    DFLASH_ERR_NEGATIVE_PARENT = 6,       //!< parents[i] < 0 for a node i > 0
    DFLASH_ERR_PARENT_OUT_OF_RANGE = 7,   //!< parents[i] >= length
    DFLASH_ERR_PARENT_NOT_BEFORE_CHILD = 8, //!< i <= parents[i] < length
    DFLASH_ERR_BAD_GEOMETRY = 9,          //!< a cache dimension (heads, head bytes, layers, ...) is < 1
    DFLASH_ERR_PAST_LENGTH_OUT_OF_RANGE = 10, //!< past_len < 0
    DFLASH_ERR_NUM_ACCEPTED_OUT_OF_RANGE = 11, //!< num_accepted < 0 or > max_accepted
    DFLASH_ERR_ACCEPTED_ROOT = 12,        //!< accepted_nodes[0] != 0
    DFLASH_ERR_ACCEPTED_NOT_INCREASING = 13, //!< accepted_nodes not strictly increasing
    DFLASH_ERR_SLOT_OUT_OF_RANGE = 14,    //!< past_len + accepted node beyond the cache capacity
    DFLASH_ERR_TOKENS_PER_BLOCK = 15,     //!< tokens_per_block is not a positive power of two
    DFLASH_ERR_POOL_MAPPING = 16,         //!< pool index or layer-in-pool out of range
    DFLASH_ERR_BLOCK_OFFSET = 17,         //!< block offset outside its pool, or the pool pointer is null
    DFLASH_ERR_CUDA = 18,                 //!< a CUDA call failed; DFlashErrorDetail.value is the cudaError_t
    DFLASH_ERR_DDTREE_SHAPE = 19,         //!< fused tree kernels: budget (index 0), depth (1), k (2), nodes (3),
                                          //!< max_path (4), capacity (5), width (6), branches (7), n-gram (8),
                                          //!< size (9), max_hops (10), table rows (11), bins (12)
    DFLASH_ERR_COUNT = 20                 //!< number of codes, not an error
} DFlashStatus;

//! Where an error was found. Every field is -1 when it does not apply.
//! `sequence` is the batch row, `index` the element inside it (node, accepted
//! position, layer, block), `value` the offending value.
typedef struct DFlashErrorDetail
{
    int32_t code;
    int32_t sequence;
    int32_t index;
    int64_t value;
} DFlashErrorDetail;

#ifdef __cplusplus
}
#endif

namespace dflash
{

//! Fill an optional detail record and return the code (keeps call sites one line).
inline int32_t reportError(DFlashErrorDetail* detail, int32_t code, int32_t sequence, int32_t index, int64_t value)
{
    if (detail != nullptr)
    {
        detail->code = code;
        detail->sequence = sequence;
        detail->index = index;
        detail->value = value;
    }
    return code;
}

} // namespace dflash
