// The cost-aware tree's learning step (device_policy.DevicePolicy.learn) as one body, shared by the CUDA
// kernel (src/cuda/ddtree_kernels.cu, one thread: every row updates the same tables) and the CPU library
// (src/cpu/dflash_cpu.cpp). The tensor ops take ~40 launches for it a drafted step.
//
// Every verified node is labelled accepted when its token is the target's choice at its parent. The
// drafter's table (rows: depth, bins: the marginal's bin, both computed by the tensor ops, which need an
// exp) and the lookup table (rows: the offset along the branch, bins: the step's n-gram length) then get,
// in this order and with these roundings, what _update and _refresh do:
//   hits *= decay; trials *= decay                       (every cell; one float64 multiplication each)
//   hits[cell] += 1 per accepted offered node; trials[cell] += 1 per offered node
//   table = running max over bins of (hits + strength * prior) / (trials + strength)
// Adding 1.0 repeatedly to a cell gives the same double in any order, so this equals torch's scatter_add
// (atomics on a GPU) bit for bit; the arithmetic is written with round-to-nearest intrinsics on the device
// so that nvcc cannot contract a multiply and an add into one FMA (the CPU library builds with
// -ffp-contract=off for the same reason).
#pragma once

#include "dflash/common.h"
#include "dflash/ddtree_core.h"

#include <cstdint>

namespace dflash
{

DFLASH_HD double mulRn(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

DFLASH_HD double addRn(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

DFLASH_HD double divRn(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}

//! One learned table ([rows, bins] float64, row-major) and its prior.
struct LearnTable
{
    double* hits;
    double* trials;
    double const* prior;
    double* table;
    int32_t rows;
    int32_t bins;
};

//! The verified trees ([batch, n] each) and the per-node cells the tensor ops computed for the drafter's table.
struct LearnInputs
{
    int64_t const* tokens;
    int64_t const* parents;
    int64_t const* depths;
    unsigned char const* valid;
    unsigned char const* onBranch;
    int64_t const* choices;
    int64_t const* draftRows;   //!< (depth - 1) clamped to the table's rows
    int64_t const* draftBins;   //!< the marginal's bin
    unsigned char const* drafted; //!< a drafter node (valid, not the root, a finite score)
    unsigned char const* live;  //!< [batch] or null (every row counts)
    int64_t const* ngram;       //!< [batch] or null (no lookup update)
    double const* lookupEdges;  //!< the lookup table's inner bin edges (bins - 1 of them)
};

//! Decay every cell of `t` by `decay`.
DFLASH_HD void learnDecay(LearnTable const& t, double decay)
{
    int64_t const cells = static_cast<int64_t>(t.rows) * t.bins;
    for (int64_t c = 0; c < cells; ++c)
    {
        t.hits[c] = mulRn(t.hits[c], decay);
        t.trials[c] = mulRn(t.trials[c], decay);
    }
}

//! One offered node in cell (row, bin); a cell outside the table (a broken contract) is skipped, not written.
DFLASH_HD void learnCount(LearnTable const& t, int64_t row, int64_t bin, bool accepted)
{
    if (row < 0 || row >= t.rows || bin < 0 || bin >= t.bins)
    {
        return;
    }
    int64_t const cell = row * t.bins + bin;
    t.trials[cell] = addRn(t.trials[cell], 1.0);
    if (accepted)
    {
        t.hits[cell] = addRn(t.hits[cell], 1.0);
    }
}

//! table = the running maximum over each row's bins of (hits + strength * prior) / (trials + strength).
DFLASH_HD void learnRefresh(LearnTable const& t, double strength)
{
    for (int32_t r = 0; r < t.rows; ++r)
    {
        double best = 0.0;
        for (int32_t b = 0; b < t.bins; ++b)
        {
            int64_t const cell = static_cast<int64_t>(r) * t.bins + b;
            double const raw = divRn(addRn(t.hits[cell], mulRn(strength, t.prior[cell])), addRn(t.trials[cell], strength));
            // torch.cummax's rule: a new value at or above the running one replaces it, and a NaN stays once seen.
            best = (b == 0 || raw != raw || (best == best && raw >= best)) ? raw : best;
            t.table[cell] = best;
        }
    }
}

//! The whole learning step over `batch` rows of `n` verified nodes.
DFLASH_HD void learnBatch(LearnInputs const& in, int32_t batch, int32_t n, LearnTable const& draft,
    LearnTable const& lookup, double decay, double strength)
{
    learnDecay(draft, decay);
    if (in.ngram != nullptr)
    {
        learnDecay(lookup, decay);
    }
    for (int32_t b = 0; b < batch; ++b)
    {
        if (in.live != nullptr && !in.live[b])
        {
            continue;
        }
        int64_t lookupBin = 0; // torch.bucketize(ngram, inner edges, right=True): the edges at or below it
        if (in.ngram != nullptr)
        {
            double const length = static_cast<double>(in.ngram[b]);
            for (int32_t e = 0; e + 1 < lookup.bins; ++e)
            {
                lookupBin += in.lookupEdges[e] <= length ? 1 : 0;
            }
        }
        for (int32_t i = 0; i < n; ++i)
        {
            int64_t const node = static_cast<int64_t>(b) * n + i;
            int64_t const parent = in.parents[node] < 0 ? 0 : in.parents[node];
            bool const accepted = parent < n && in.tokens[node] == in.choices[static_cast<int64_t>(b) * n + parent];
            if (in.drafted[node])
            {
                learnCount(draft, in.draftRows[node], in.draftBins[node], accepted);
            }
            if (in.ngram != nullptr && in.onBranch[node] && in.valid[node] && in.parents[node] >= 0)
            {
                int64_t row = in.depths[node] - 1;
                row = row < 0 ? 0 : (row > lookup.rows - 1 ? lookup.rows - 1 : row);
                learnCount(lookup, row, lookupBin, accepted);
            }
        }
    }
    learnRefresh(draft, strength);
    if (in.ngram != nullptr)
    {
        learnRefresh(lookup, strength);
    }
}

//! The learning step: nodes (3) >= 1, table rows (11) and bins (12) >= 1 (the lookup table's only with an n-gram).
inline int32_t learnShapeError(int32_t batch, int32_t n, LearnTable const& draft, LearnTable const& lookup,
    bool withLookup, DFlashErrorDetail* detail)
{
    ShapeField const fields[] = {{3, n, 1, 0}, {11, draft.rows, 1, 0}, {12, draft.bins, 1, 0},
        {11, withLookup ? lookup.rows : 1, 1, 0}, {12, withLookup ? lookup.bins : 1, 1, 0}};
    return checkShape(batch, fields, detail);
}

} // namespace dflash
