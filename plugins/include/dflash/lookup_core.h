// Prompt-lookup branches for one batch row, and their grafting into the drafter's pool: the
// bodies of the fused lookup and graft kernels (src/cuda/ddtree_kernels.cu, one thread per
// row) and of the CPU library's dflash_lookup_cpu / dflash_graft_cpu (row after row). The
// graph-ready runtime's device_lookup.lookup_device and graft_device compute the same results
// from ~90 and ~80 tensor ops; these are the same rules as one pass each (docstrings of
// tensorrt_llm_dflash/device_lookup.py: the numpy reference is lookup.lookup_branches and
// tree.CandidateTree.add_branch).
#pragma once

#include "dflash/common.h"
#include "dflash/ddtree_core.h"

#include <cstdint>

namespace dflash
{

//! A row's tokens at [e - n + 1, e] equal its newest n tokens (all inside the row: e - n + 1 >= 0).
DFLASH_HD bool ngramEndsAt(int64_t const* history, int64_t e, int64_t last, int32_t n)
{
    if (e - n + 1 < 0)
    {
        return false;
    }
    for (int32_t i = 0; i < n; ++i)
    {
        if (history[e - i] != history[last - i])
        {
            return false;
        }
    }
    return true;
}

//! The continuation of the match ending at `e`: history[e + 1 + t] while e + 1 + t <= last and t < cap, else -1.
DFLASH_HD int64_t followToken(int64_t const* history, int64_t e, int32_t t, int64_t last, int32_t cap)
{
    return (e + 1 + t <= last && t < cap) ? history[e + 1 + t] : -1;
}

//! Branches of one row (lookup_device's rule): the longest n-gram (minNgram..maxNgram) ending at the newest token
//! that also ends at an earlier position followed by a token; its matches most recent first, each taken when its
//! continuation (at most `cap` tokens) differs from every branch taken before, at most `branches` of them.
//! history: the row's tokens [length] (length >= 0); outTokens [branches, width] (-1 past a branch's end);
//! outLengths [branches]; outNgram: the match's n (0 when no branch).
DFLASH_HD void lookupRow(int64_t const* history, int64_t length, int32_t width, int32_t cap, int32_t maxNgram,
    int32_t minNgram, int32_t branches, int64_t* outTokens, int64_t* outLengths, int64_t* outNgram)
{
    int64_t const last = length - 1;
    int32_t chosen = 0;
    for (int32_t n = maxNgram; n >= minNgram && n >= 1 && chosen == 0; --n)
    {
        if (last - n + 1 < 0)
        {
            continue; // fewer tokens than the n-gram
        }
        for (int64_t e = last - 1; e >= 0; --e)
        {
            if (ngramEndsAt(history, e, last, n))
            {
                chosen = n;
                break;
            }
        }
    }
    int32_t taken = 0;
    if (chosen > 0 && cap > 0)
    {
        for (int64_t e = last - 1; e >= 0 && taken < branches; --e)
        {
            if (!ngramEndsAt(history, e, last, chosen))
            {
                continue;
            }
            bool repeated = false; // its continuation equals a branch taken before (all width columns)
            for (int32_t r = 0; r < taken && !repeated; ++r)
            {
                bool same = true;
                for (int32_t t = 0; t < width && same; ++t)
                {
                    same = followToken(history, e, t, last, cap) == outTokens[r * width + t];
                }
                repeated = same;
            }
            if (repeated)
            {
                continue;
            }
            int64_t count = 0;
            for (int32_t t = 0; t < width; ++t)
            {
                int64_t const token = followToken(history, e, t, last, cap);
                outTokens[taken * width + t] = token;
                count += token >= 0;
            }
            outLengths[taken] = count;
            ++taken;
        }
    }
    for (int32_t r = taken; r < branches; ++r)
    {
        for (int32_t t = 0; t < width; ++t)
        {
            outTokens[r * width + t] = -1;
        }
        outLengths[r] = 0;
    }
    *outNgram = (branches > 0 && outLengths[0] > 0) ? chosen : 0;
}

//! The pool node at depth t + 1 on branch `want`'s path ([0, t] all in the pool), for every t, into poolNode
//! [width] (-1 from the first offset the pool does not hold). The pool's siblings never repeat a token (a DDTree
//! depth's tokens are distinct); were they to, the last such child is taken.
DFLASH_HD void poolPath(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int32_t poolSize, int64_t const* want, int32_t width, int64_t* poolNode)
{
    int64_t current = 0;
    bool onPool = true;
    for (int32_t t = 0; t < width; ++t)
    {
        int64_t found = -1;
        if (onPool && want[t] >= 0)
        {
            for (int32_t c = 0; c < poolSize; ++c)
            {
                if (valid[c] && parents[c] >= 0 && parents[c] == current && depths[c] == t + 1
                    && tokens[c] == want[t])
                {
                    found = c;
                }
            }
        }
        onPool = found >= 0;
        poolNode[t] = found;
        current = found;
    }
}

//! Graft one row's branches under its root (graft_device's result): pool columns [poolSize] then branch columns
//! poolSize + r * width + t. A branch shares the pool's nodes along its prefix, else the node of the earliest
//! branch with the same prefix, else owns its column; a shared node keeps the larger acceptance estimate.
//! Outputs [poolSize + branches * width] (num nodes: one); poolNode is scratch [width].
DFLASH_HD void graftRow(int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t numNodes, double const* scores, double const* poolCond, int32_t poolSize,
    int64_t const* want, double const* branchCond, int32_t branches, int32_t width, int64_t* outTokens,
    int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes, double* outScores,
    double* outCond, unsigned char* outOnBranch, int64_t* poolNode)
{
    int32_t const size = poolSize + branches * width;
    for (int32_t c = 0; c < size; ++c)
    {
        bool const pool = c < poolSize;
        outTokens[c] = pool ? tokens[c] : -1;
        outParents[c] = pool ? parents[c] : 0;
        outDepths[c] = pool ? depths[c] : 0;
        outValid[c] = pool ? valid[c] : 0;
        outScores[c] = pool ? scores[c] : -__builtin_huge_val();
        outCond[c] = pool ? poolCond[c] : 0.0;
        outOnBranch[c] = 0;
    }
    int64_t owned = 0;
    for (int32_t r = 0; r < branches; ++r)
    {
        int64_t const* branch = want + static_cast<int64_t>(r) * width;
        poolPath(tokens, parents, depths, valid, poolSize, branch, width, poolNode);
        int64_t previous = 0; // the node at offset t - 1 (the root before offset 0)
        for (int32_t t = 0; t < width; ++t)
        {
            int64_t node = 0; // an offset past the branch's end counts at the root, as the tensor ops clamp it
            double estimate = 0.0;
            bool const inBranch = branch[t] >= 0;
            if (inBranch)
            {
                int32_t owner = r; // the earliest branch q <= r that spells the same prefix through t
                for (int32_t q = 0; q < r && owner == r; ++q)
                {
                    bool same = true;
                    for (int32_t i = 0; i <= t && same; ++i)
                    {
                        same = want[static_cast<int64_t>(q) * width + i] == branch[i];
                    }
                    if (same)
                    {
                        owner = q;
                    }
                }
                node = poolNode[t] >= 0 ? poolNode[t] : poolSize + static_cast<int64_t>(owner) * width + t;
                if (poolNode[t] < 0 && owner == r)
                {
                    outTokens[node] = branch[t];
                    outParents[node] = previous;
                    outDepths[node] = t + 1;
                    outValid[node] = 1;
                    ++owned;
                }
                estimate = branchCond[static_cast<int64_t>(r) * width + t];
                previous = node;
            }
            if (estimate > outCond[node])
            {
                outCond[node] = estimate;
            }
            if (inBranch)
            {
                outOnBranch[node] = 1;
            }
        }
    }
    *outNumNodes = numNodes + owned; // (the root is never on a branch: an in-branch offset's node is not column 0)
}

//! The lookup: capacity (5) >= 0, width (6) and branches (7) >= 1, 1 <= min_ngram <= max_ngram (8).
inline int32_t lookupShapeError(int32_t batch, int32_t capacity, int32_t width, int32_t branches, int32_t maxNgram,
    int32_t minNgram, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{5, capacity, 0, -1}, {6, width, 1, 0}, {7, branches, 1, 0}, {8, minNgram, 1, 0},
        {8, maxNgram, minNgram < 1 ? 1 : minNgram, 0}};
    return checkShape(batch, fields, detail);
}

//! The graft: pool nodes (3), width (6) and branches (7) >= 1.
inline int32_t graftShapeError(int32_t batch, int32_t poolSize, int32_t branches, int32_t width,
    DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, poolSize, 1, 0}, {6, width, 1, 0}, {7, branches, 1, 0}};
    return checkShape(batch, fields, detail);
}

//! Thread `row` of the lookup kernel: history rows `rowStride` apart (a view of a wider buffer), `capacity` readable
//! tokens each; a row's length is clamped to them (a longer one breaks the contract: it is never read past).
DFLASH_HD void lookupRowThread(int32_t row, int64_t const* history, int64_t rowStride, int32_t capacity,
    int64_t const* lengths, int64_t const* limits, int32_t width, int32_t maxNgram, int32_t minNgram,
    int32_t branches, int64_t* outTokens, int64_t* outLengths, int64_t* outNgram)
{
    int64_t length = lengths[row] < capacity ? lengths[row] : capacity;
    int64_t cap = width;
    if (limits != nullptr && limits[row] < cap)
    {
        cap = limits[row];
    }
    lookupRow(history + static_cast<int64_t>(row) * rowStride, length, width, static_cast<int32_t>(cap < 0 ? 0 : cap),
        maxNgram, minNgram, branches, outTokens + static_cast<int64_t>(row) * branches * width,
        outLengths + static_cast<int64_t>(row) * branches, outNgram + row);
}

//! Thread `row` of the graft kernel: pool tensors [batch, poolSize], branches [batch, branches, width], outputs
//! [batch, poolSize + branches * width]; poolNode: scratch [batch, width].
DFLASH_HD void graftRowThread(int32_t row, int64_t const* tokens, int64_t const* parents, int64_t const* depths,
    unsigned char const* valid, int64_t const* numNodes, double const* scores, double const* poolCond,
    int32_t poolSize, int64_t const* want, double const* branchCond, int32_t branches, int32_t width,
    int64_t* outTokens, int64_t* outParents, int64_t* outDepths, unsigned char* outValid, int64_t* outNumNodes,
    double* outScores, double* outCond, unsigned char* outOnBranch, int64_t* poolNode)
{
    int64_t const in = static_cast<int64_t>(row) * poolSize;
    int64_t const extra = static_cast<int64_t>(branches) * width;
    int64_t const out = static_cast<int64_t>(row) * (poolSize + extra);
    graftRow(tokens + in, parents + in, depths + in, valid + in, numNodes[row], scores + in, poolCond + in, poolSize,
        want + static_cast<int64_t>(row) * extra, branchCond + static_cast<int64_t>(row) * extra, branches, width,
        outTokens + out, outParents + out, outDepths + out, outValid + out, outNumNodes + row, outScores + out,
        outCond + out, outOnBranch + out, poolNode + static_cast<int64_t>(row) * width);
}

} // namespace dflash
