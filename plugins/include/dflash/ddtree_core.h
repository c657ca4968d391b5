// DDTree's best-first tree for one batch row: the body of the fused tree-build kernel
// (src/cuda/ddtree_kernels.cu, one thread per row) and of the CPU library's
// dflash_ddtree_build_cpu, which runs it row after row. The PyTorch runtime's
// device_tree.build_ddtree_device builds the same tree out of ~400 small tensor ops (one
// kernel launch each on a GPU); this is the same algorithm as one launch.
//
// The algorithm and its tie rule are tensorrt_llm_dflash.tree.best_first_tree's (the
// numpy reference every implementation is held equal to, node for node):
// * a node is a rank tuple (r1..rd); its score is its parent's score plus
//   logprobs[d-1][rd], one float64 addition per node (so every device rounds alike);
// * pop the best heap entry (score descending, then rank tuple ascending, a prefix
//   before its extensions), append it as the next node, then push its next sibling
//   (same parent, rank + 1) and its own first child (rank 0 at the next depth);
// * at most `budget` draft nodes; entries whose log-probability is not finite
//   (a reduced draft vocabulary writes -inf) are never pushed; a row's depth is capped
//   by `depthLimit` (the drafted depths, the budget and the row's max_depth).
//
// Output layout (per row, `budget + 1` columns, as device_tree.DeviceTree after
// pad_tree): column 0 is the root (token `root`, parent -1, depth 0, score +0.0), then
// the nodes in pop order, then padding (token -1, parent 0, depth 0, score -inf, valid 0).
//
// Below it, two more per-row bodies of the graph-ready runtime's step, kernels of the same
// file: the cost-aware tree's path sums (pathSumsRow, for device_policy.path_values) and
// the verifier's walk (walkRow, for device_tree.walk_device).
#pragma once

#include "dflash/common.h"

#include <cstdint>

namespace dflash
{

//! Largest budget (draft nodes) the fused build takes (node indices are int16 in its heap).
//! The cost-aware tree's pool is 63 nodes; larger budgets use the tensor-op build.
constexpr int32_t kMaxDDTreeBudget = 255;

struct DDTreeEntry
{
    double score;
    int16_t parent; //!< node index of the parent (0 = the root)
    int16_t rank;   //!< rank under the parent (column of the depth's log-probability row)
};

//! Bytes of one row's scratch: its heap (every pop pushes at most two entries, sibling and child, so
//! budget + 2 suffice) and each node's rank, rounded up to keep the next row's heap aligned. The scratch
//! is caller memory (a torch tensor), not a per-thread array: a kernel with a 4.6 KiB stack frame would
//! need the driver to grow every thread's local memory past its 1 KiB default, which a CUDA graph
//! capture must not trigger.
DFLASH_HD int64_t ddtreeScratchRowBytes(int32_t budget)
{
    int64_t const bytes = static_cast<int64_t>(budget + 2) * sizeof(DDTreeEntry)
        + static_cast<int64_t>(budget + 1) * sizeof(int16_t);
    int64_t const align = sizeof(DDTreeEntry);
    return (bytes + align - 1) / align * align;
}

//! True when the rank tuple of (parent a, rank ra) sorts before that of (b, rb), lexicographically.
//! `parents`, `depths` and `ranks` describe the nodes built so far (the parents of both entries among
//! them). Neither tuple is a prefix of the other: both are in the heap, not yet built, while every
//! proper prefix of a heap entry is a built node. So after lifting the deeper one to the other's
//! depth the two differ, and they first differ under their deepest common ancestor.
DFLASH_HD bool tupleBefore(int16_t a, int16_t ra, int16_t b, int16_t rb, int64_t const* parents,
    int64_t const* depths, int16_t const* ranks)
{
    int64_t da = depths[a] + 1;
    int64_t db = depths[b] + 1;
    while (da > db)
    {
        ra = ranks[a];
        a = static_cast<int16_t>(parents[a]);
        --da;
    }
    while (db > da)
    {
        rb = ranks[b];
        b = static_cast<int16_t>(parents[b]);
        --db;
    }
    while (a != b) // same depth: climb until both hang under one node
    {
        ra = ranks[a];
        a = static_cast<int16_t>(parents[a]);
        rb = ranks[b];
        b = static_cast<int16_t>(parents[b]);
    }
    return ra < rb;
}

//! The heap's order: x pops before y.
DFLASH_HD bool popsBefore(DDTreeEntry const& x, DDTreeEntry const& y, int64_t const* parents, int64_t const* depths,
    int16_t const* ranks)
{
    if (x.score != y.score)
    {
        return x.score > y.score;
    }
    return tupleBefore(x.parent, x.rank, y.parent, y.rank, parents, depths, ranks);
}

DFLASH_HD void heapPush(DDTreeEntry* heap, int32_t& size, DDTreeEntry entry, int64_t const* parents,
    int64_t const* depths, int16_t const* ranks)
{
    int32_t i = size++;
    while (i > 0)
    {
        int32_t const up = (i - 1) / 2;
        if (!popsBefore(entry, heap[up], parents, depths, ranks))
        {
            break;
        }
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = entry;
}

DFLASH_HD DDTreeEntry heapPop(DDTreeEntry* heap, int32_t& size, int64_t const* parents, int64_t const* depths,
    int16_t const* ranks)
{
    DDTreeEntry const top = heap[0];
    DDTreeEntry const last = heap[--size];
    int32_t i = 0;
    while (true)
    {
        int32_t child = 2 * i + 1;
        if (child >= size)
        {
            break;
        }
        if (child + 1 < size && popsBefore(heap[child + 1], heap[child], parents, depths, ranks))
        {
            ++child;
        }
        if (!popsBefore(heap[child], last, parents, depths, ranks))
        {
            break;
        }
        heap[i] = heap[child];
        i = child;
    }
    if (size > 0)
    {
        heap[i] = last;
    }
    return top;
}

DFLASH_HD bool usableLogprob(double value)
{
    // Finite (torch.isfinite): -inf (outside a reduced vocabulary) is never a node, nor is a NaN.
    // x - x is 0 for a finite x and NaN for +-inf and NaN.
    return value - value == 0.0;
}

//! One row. logprobs / tokens: [depth, k] (row-major, each depth's row sorted
//! non-increasing); `depthLimit` = min(depth, budget, the row's max_depth), >= 0;
//! 0 <= budget <= kMaxDDTreeBudget. Outputs: budget + 1 entries each; numNodes: one;
//! scratch: ddtreeScratchRowBytes(budget) bytes, aligned for DDTreeEntry.
DFLASH_HD void buildDDTreeRow(double const* logprobs, int64_t const* tokens, int32_t k, int64_t root,
    int32_t depthLimit, int32_t budget, int64_t* outTokens, int64_t* outParents, int64_t* outDepths,
    unsigned char* outValid, int64_t* outNumNodes, double* outScores, unsigned char* scratch)
{
    DDTreeEntry* heap = reinterpret_cast<DDTreeEntry*>(scratch);
    int16_t* ranks = reinterpret_cast<int16_t*>(scratch + static_cast<int64_t>(budget + 2) * sizeof(DDTreeEntry));
    int32_t heapSize = 0;
    int32_t count = 1;
    outTokens[0] = root;
    outParents[0] = -1;
    outDepths[0] = 0;
    outValid[0] = 1;
    outScores[0] = 0.0;
    ranks[0] = 0;
    int32_t const ranksUsed = k < budget ? k : budget;
    if (budget > 0 && depthLimit > 0 && ranksUsed > 0 && usableLogprob(logprobs[0]))
    {
        heapPush(heap, heapSize, DDTreeEntry{0.0 + logprobs[0], 0, 0}, outParents, outDepths, ranks);
    }
    while (heapSize > 0 && count <= budget)
    {
        DDTreeEntry const top = heapPop(heap, heapSize, outParents, outDepths, ranks);
        int32_t const node = count++;
        int64_t const depth = outDepths[top.parent] + 1;
        double const* row = logprobs + (depth - 1) * k;
        outTokens[node] = tokens[(depth - 1) * k + top.rank];
        outParents[node] = top.parent;
        outDepths[node] = depth;
        outValid[node] = 1;
        outScores[node] = top.score;
        ranks[node] = top.rank;
        int32_t const sibling = top.rank + 1;
        if (sibling < ranksUsed && usableLogprob(row[sibling]))
        {
            heapPush(heap, heapSize, DDTreeEntry{outScores[top.parent] + row[sibling], top.parent,
                static_cast<int16_t>(sibling)}, outParents, outDepths, ranks);
        }
        double const* childRow = row + k; // depth + 1's row (exists: depth < depthLimit <= depth rows)
        if (depth < depthLimit && usableLogprob(childRow[0]))
        {
            heapPush(heap, heapSize, DDTreeEntry{top.score + childRow[0], static_cast<int16_t>(node), 0}, outParents,
                outDepths, ranks);
        }
    }
    *outNumNodes = count;
    for (int32_t node = count; node <= budget; ++node)
    {
        outTokens[node] = -1;
        outParents[node] = 0;
        outDepths[node] = 0;
        outValid[node] = 0;
        outScores[node] = -__builtin_huge_val();
    }
}

//! The row's depth limit: the drafted depths, the budget (a node at depth t needs t - 1
//! ancestors) and its max_depth (null: none; negative counts as 0).
DFLASH_HD int32_t ddtreeDepthLimit(int32_t depth, int32_t budget, int64_t const* maxDepth, int32_t row)
{
    int64_t limit = depth < budget ? depth : budget;
    if (maxDepth != nullptr)
    {
        int64_t const rowLimit = maxDepth[row] < 0 ? 0 : maxDepth[row];
        limit = rowLimit < limit ? rowLimit : limit;
    }
    return static_cast<int32_t>(limit);
}

//! One field of a fused tree kernel's shape: its index in DFLASH_ERR_DDTREE_SHAPE's detail (common.h), its value and
//! its bounds (no upper bound where highest < lowest).
struct ShapeField
{
    int32_t index;
    int64_t value;
    int64_t lowest;
    int64_t highest;
};

//! The shape check of every fused tree kernel (host side: the CPU library and the CUDA launchers alike): DFLASH_OK,
//! or batch < 0 as DFLASH_ERR_BATCH_OUT_OF_RANGE, or the first field out of its bounds as DFLASH_ERR_DDTREE_SHAPE
//! with the field's index and value in `detail` (which may be null).
template <int32_t Count>
int32_t checkShape(int32_t batch, ShapeField const (&fields)[Count], DFlashErrorDetail* detail)
{
    if (batch < 0)
    {
        return reportError(detail, DFLASH_ERR_BATCH_OUT_OF_RANGE, -1, -1, batch);
    }
    for (ShapeField const& field : fields)
    {
        if (field.value < field.lowest || (field.highest >= field.lowest && field.value > field.highest))
        {
            return reportError(detail, DFLASH_ERR_DDTREE_SHAPE, -1, field.index, field.value);
        }
    }
    return DFLASH_OK;
}

//! The DDTree build: budget (0) in 0..kMaxDDTreeBudget, depth (1) and k (2) >= 0.
inline int32_t ddtreeShapeError(int32_t batch, int32_t depth, int32_t k, int32_t budget, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{0, budget, 0, kMaxDDTreeBudget}, {1, depth, 0, -1}, {2, k, 0, -1}};
    return checkShape(batch, fields, detail);
}

//! Path sums of one row of a tree in parent-first order (every parent's column before its child's):
//! out[i] = values[i] for a root (parent < 0), values[i] + out[parent] otherwise: one float64 addition per
//! node, so the same value as the depth-by-depth rounds of device_policy.path_values (which add the same
//! two numbers once the parent's sum is final). A parent at or after its child breaks the contract: NaN.
DFLASH_HD void pathSumsRow(double const* values, int64_t const* parents, int32_t n, double* out)
{
    for (int32_t i = 0; i < n; ++i)
    {
        int64_t const parent = parents[i];
        if (parent < 0)
        {
            out[i] = values[i];
        }
        else if (parent < i)
        {
            out[i] = values[i] + out[parent];
        }
        else
        {
            out[i] = __builtin_nan("");
        }
    }
}

//! The verifier's walk over one row (device_tree.walk_device's result): from the root, follow the target's choice
//! at each accepted node into the first valid child (lowest column) holding that token, while the path stays under
//! `maxPath` nodes. outPath [maxPath]: the accepted nodes in depth order, padded by repeating the last one;
//! outLength: how many (root included); outBonus: the target's choice at the last. Each row is scanned whole per
//! step (no order assumed), at most maxPath times.
DFLASH_HD void walkRow(int64_t const* tokens, int64_t const* parents, unsigned char const* valid,
    int64_t const* choices, int32_t n, int32_t maxPath, int64_t* outPath, int64_t* outLength, int64_t* outBonus)
{
    int64_t node = 0;
    int32_t length = 1;
    outPath[0] = 0;
    while (length < maxPath)
    {
        int64_t const want = choices[node];
        int64_t next = -1;
        for (int32_t c = 0; c < n && next < 0; ++c)
        {
            if (valid[c] && parents[c] == node && c != node && tokens[c] == want)
            {
                next = c;
            }
        }
        if (next < 0)
        {
            break;
        }
        outPath[length++] = next;
        node = next;
    }
    for (int32_t i = length; i < maxPath; ++i)
    {
        outPath[i] = node;
    }
    *outLength = length;
    *outBonus = choices[node];
}

//! The walk: nodes (3) and max_path (4) >= 1.
inline int32_t walkShapeError(int32_t batch, int32_t n, int32_t maxPath, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, n, 1, 0}, {4, maxPath, 1, 0}};
    return checkShape(batch, fields, detail);
}

//! The path sums: nodes (3) >= 0.
inline int32_t pathSumsShapeError(int32_t batch, int32_t n, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, n, 0, -1}};
    return checkShape(batch, fields, detail);
}

//! Thread `row` of the kernel: one batch row, inputs [batch, depth, k], outputs [batch, budget + 1].
DFLASH_HD void ddtreeRowThread(int32_t row, double const* logprobs, int64_t const* tokens, int64_t const* roots,
    int64_t const* maxDepth, int32_t depth, int32_t k, int32_t budget, int64_t* outTokens, int64_t* outParents,
    int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores, unsigned char* scratch)
{
    int64_t const in = static_cast<int64_t>(row) * depth * k;
    int64_t const out = static_cast<int64_t>(row) * (budget + 1);
    buildDDTreeRow(logprobs + in, tokens + in, k, roots[row], ddtreeDepthLimit(depth, budget, maxDepth, row), budget,
        outTokens + out, outParents + out, outDepths + out, outValid + out, outNumNodes + row, outScores + out,
        scratch + static_cast<int64_t>(row) * ddtreeScratchRowBytes(budget));
}

} // namespace dflash
