// The cost-aware tree's last two tree-stage steps as per-node bodies, shared by the CUDA kernels
// (src/cuda/ddtree_kernels.cu) and the CPU library (src/cpu/dflash_cpu.cpp):
// * the selection of the `size` best candidates (device_policy.DevicePolicy.select: ~30 tensor
//   ops, a stable sort, a sort of the kept indices and a dozen gathers), and
// * the verifier's ancestor-or-self mask (device_tree.visibility_device: ~17 ops of pointer
//   doubling).
// Both are index logic only (no arithmetic on the values), so they equal the tensor ops bit for bit.
//
// Select, per row of `n` candidates in parent-first order (every parent's column before its child's):
//   1. selectRank: a node's place in torch.sort(-values, stable=True): how many nodes sort before it
//      (a larger value first, equal values by column, NaN after every number);
//   2. selectSlot: its column in the chosen tree, the number of kept nodes (rank < size) before it,
//      or -1 when it is not kept;
//   3. selectEmit: the kept node's columns of the chosen tree (parents renumbered through the slots;
//      a node with value <= 0 or invalid becomes padding: token -1, parent 0, depth 0).
// Each phase reads only the previous phases' results, so a kernel runs the nodes of a phase in
// parallel (one warp per row) and the CPU library runs them in a loop.
#pragma once

#include "dflash/common.h"
#include "dflash/ddtree_core.h"

#include <cstdint>

namespace dflash
{

//! True when node `a` comes before node `b` in a stable ascending sort of -values (torch.sort's order:
//! NaN last, ties by column).
DFLASH_HD bool selectBefore(double const* values, int32_t a, int32_t b)
{
    double const keyA = -values[a];
    double const keyB = -values[b];
    bool const nanA = keyA != keyA;
    bool const nanB = keyB != keyB;
    if (nanA || nanB)
    {
        return nanA && nanB ? a < b : nanB;
    }
    if (keyA != keyB)
    {
        return keyA < keyB;
    }
    return a < b;
}

//! Phase 1: how many of the row's `n` nodes sort before node `i`.
DFLASH_HD int64_t selectRank(double const* values, int32_t n, int32_t i)
{
    int64_t rank = 0;
    for (int32_t j = 0; j < n; ++j)
    {
        rank += (j != i && selectBefore(values, j, i)) ? 1 : 0;
    }
    return rank;
}

//! Phase 2: node `i`'s column in the chosen tree (kept nodes keep their order), -1 when not kept.
DFLASH_HD int64_t selectSlot(int64_t const* ranks, int32_t size, int32_t i)
{
    if (ranks[i] >= size)
    {
        return -1;
    }
    int64_t slot = 0;
    for (int32_t j = 0; j < i; ++j)
    {
        slot += ranks[j] < size ? 1 : 0;
    }
    return slot;
}

//! The inputs of one row (every array [n]) and the outputs (every array [size]).
struct SelectRow
{
    double const* values;
    int64_t const* tokens;
    int64_t const* parents;
    int64_t const* depths;
    unsigned char const* valid;
    double const* scores;
    double const* cond;
    unsigned char const* onBranch;
    int64_t* outTokens;
    int64_t* outParents;
    int64_t* outDepths;
    unsigned char* outValid;
    double* outScores;
    double* outCond;
    unsigned char* outOnBranch;
};

//! Phase 3: the chosen tree's column slots[i] from node `i` (a kept node). A parent outside the row (a broken
//! contract: the tensor ops would raise) is read as "not kept" instead of out of bounds.
DFLASH_HD void selectEmit(SelectRow const& row, int64_t const* slots, int32_t n, int32_t i)
{
    int64_t const slot = slots[i];
    int64_t const oldParent = row.parents[i];
    int64_t parent = oldParent;
    if (oldParent >= 0)
    {
        parent = oldParent < n ? slots[oldParent] : -1;
    }
    bool const keep = row.valid[i] != 0 && row.values[i] > 0.0;
    row.outTokens[slot] = keep ? row.tokens[i] : -1;
    row.outParents[slot] = (keep || parent < 0) ? parent : 0;
    row.outDepths[slot] = keep ? row.depths[i] : 0;
    row.outValid[slot] = keep ? 1 : 0;
    row.outScores[slot] = row.scores[i];
    row.outCond[slot] = row.cond[i];
    row.outOnBranch[slot] = (keep && row.onBranch[i] != 0) ? 1 : 0;
}

//! The chosen tree's node count: its valid columns.
DFLASH_HD int64_t selectCount(unsigned char const* outValid, int32_t size)
{
    int64_t count = 0;
    for (int32_t s = 0; s < size; ++s)
    {
        count += outValid[s] != 0 ? 1 : 0;
    }
    return count;
}

//! The ancestor-or-self row of node `i` (visibility_device's vis[b, i, :], `n` bytes): itself, and when it is
//! valid, the first `maxHops` nodes up its root path (each node's parent clamped at 0, as the pointer doubling's
//! jump table is; a parent outside the row ends the path where the tensor ops would raise).
DFLASH_HD void visibilityNode(int64_t const* parents, unsigned char const* valid, int32_t n, int64_t maxHops,
    int32_t i, unsigned char* outRow)
{
    for (int32_t j = 0; j < n; ++j)
    {
        outRow[j] = 0;
    }
    outRow[i] = 1;
    if (!valid[i])
    {
        return;
    }
    int64_t node = i;
    for (int64_t hop = 0; hop < maxHops; ++hop)
    {
        int64_t const parent = parents[node] < 0 ? 0 : parents[node];
        if (parent >= n || parent == node)  // out of the row, or the root's fixed point: nothing new above
        {
            return;
        }
        outRow[parent] = 1;
        node = parent;
    }
}

//! The select: nodes (3) >= 1, size (9) in 1..nodes.
inline int32_t selectShapeError(int32_t batch, int32_t n, int32_t size, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, n, 1, 0}, {9, size, 1, n < 1 ? 1 : n}};
    return checkShape(batch, fields, detail);
}

//! The visibility: nodes (3) >= 1, max_hops (10) >= 0.
inline int32_t visibilityShapeError(int32_t batch, int32_t n, int64_t maxHops, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, n, 1, 0}, {10, maxHops, 0, -1}};
    return checkShape(batch, fields, detail);
}

} // namespace dflash
