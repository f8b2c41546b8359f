/*
 * OTB on the CPU in one sweep per group member: the native kernel of otb_torch (see _native.py).
 *
 * The math is the reference's (otb_spec.otb, arXiv 2602.07078, §3); this file only fuses it. Per member row i of a
 * row-major [B, T] batch (rows in any order, listed group by group by a plan: order[offsets[g]] …):
 *
 *   Gᵢₜ = Σ_{k≥t} mᵢₖ rᵢₖ                                   (returns; written to `ret`)
 *   wᵢₜ = mᵢₜ (1 − 2πᵢₜ + Σπ²ᵢₜ) ρᵢₜ²,  πᵢₜ = exp(min(log πᵢₜ, 0))
 *   Wᵢₜ = Σ_{j≤t} wᵢⱼ
 *
 * and per group, over the tokens t of aligned column c (c = t: align by position, verl's single-turn; c = the number
 * of valid tokens before t: align by valid token, verl's multi-turn):
 *
 *   N_c = Σᵢ GᵢₜWᵢₜmᵢₜ,   D_c = Σᵢ Wᵢₜmᵢₜ,   V_c = Σᵢ [mᵢₜ ≠ 0]   (the last for leave-one-out only)
 *
 * self-inclusive:  Bᵢₜ = N_c / (D_c + ε)                           0 where the denominator is 0, or a rule says so
 * leave-one-out:   Bᵢₜ = (N_c − GᵢₜWᵢₜmᵢₜ) / (D_c − Wᵢₜmᵢₜ + ε)   0 where D_c − Wᵢₜmᵢₜ ≤ 0, or V_c − [mᵢₜ ≠ 0] = 0
 *                  (with every W, in N_c and D_c too, the weight max(W, 0): otb_nonnegative)
 *
 *   Aᵢₜ = mᵢₜ (Gᵢₜ − Bᵢₜ)   (written to `adv`; mᵢₜBᵢₜ to `base`)
 *
 * The self-inclusive rules (otb_spec.otb; as otb_torch._core.zero_rule_fix): a group with fewer than two members
 * (aligned by valid token, rows without a valid token are not members) has B = 0, and with the zero tail the unique
 * longest member has B = 0 from the second-longest length on. Leave-one-out needs no rule: V_c − [mᵢₜ ≠ 0] = 0
 * covers singletons and the tail.
 *
 * Entry points (one per compute type T ∈ {float, double} and mask type M, named <entry>_<T>_<M>):
 *
 *   otb_groups       — one process: each group in one thread, its column sums in scratch rows of T;
 *   otb_dist_first   — one rank of a data-/context-parallel batch (otb_torch.distributed): the returns, and the
 *                      rank's terms of N, D (, V) added into a [G, planes, T] grid of global groups (T the rank's
 *                      width); per local group the member count and top-two lengths (context parallel: the row
 *                      pieces' totals instead);
 *   otb_dist_offsets — context parallel: the other pieces' offsets added, then the terms into a grid of `columns`
 *                      columns from global column `origin` (all K from 0, or by position a piece's own);
 *   otb_dist_final   — after the grid's SUM all-reduce (none where the grid is complete): B and A for the rank's
 *                      rows (the self-inclusive rules from every rank's group statistics, merged per row).
 *
 * Scans accumulate in double and round each output once (what torch's CPU cumsum does); everything else is in the
 * compute type T, in the order of the eager kernel (otb_torch._core) — except that one-process leave-one-out keeps
 * each column's largest weight out of its sums (FN(otb_top)), where the eager kernel sums a member above ¾ of the
 * column's energy apart; a distributed rank keeps its own top of each cell apart the same way (otb_dist_tops_in,
 * otb_dist_tops_out put it back around the grid's sum). With `check`, the return value is nonzero if
 * any input may break a value rule of the reference: non-finite values anywhere, a mask outside {0, 1}, or at valid
 * positions log π > slack, Σπ² outside [−slack, 1 + slack], π² − Σπ² above its slack, ρ < 0 — with the caller's own
 * rules for integer token statistics (no slack; π² may underflow) a superset of what the reference rejects, so the
 * caller runs the exact check only when it is set. Without `check` (the hot path), inputs the reference rejects give
 * undefined results: NaN at a masked position outside a row's valid span is skipped, inside it spreads, and a
 * non-binary mask is read as "valid where nonzero" for the counts and alignment.
 *
 * Multi-turn masks are runs of valid tokens between tool outputs: the valid-token loops classify blocks of 8
 * positions (all valid: contiguous columns, vectorised; none valid: skipped) and fall back to one position at a time
 * only in mixed blocks.
 *
 * No OpenMP (it would meet torch's own runtime in the process): the caller splits the groups over threads, and
 * ctypes releases the GIL for the call. Built for the baseline of the architecture (SSE2 on x86-64), or with -mavx2
 * where torch reports AVX2 on the machine (the loader chooses before it compiles), and with -ffp-contract=off, so no
 * multiply–add is fused behind the code's back.
 *
 * Layout of this file: the common part (exponential, names), then the template (#else branch), included once per
 * (T, M) by the file itself (#include "_kernel.c": the name of this file).
 */
#ifndef OTB_TEMPLATE
#define OTB_TEMPLATE 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"     /* vectors passed between inlined helpers: no ABI is involved */
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "the value checks test for NaN and infinity: build without -ffinite-math-only (or -ffast-math)"
#endif

#define OTB_EXPORT __attribute__((visibility("default")))

/* exp(x) for x ≤ 0 in float, a vector at a time with the compiler's vector extensions (auto-vectorisation of the
 * selects below is not dependable; 8 lanes with AVX2, else 4, which every x86-64 and ARM64 has): 2ⁿ·exp(r) with
 * n = round(x/ln 2), r = x − n ln 2 (Cody–Waite, ln 2 split so that n·ln2_hi is exact), |r| ≤ ln 2/2, and Taylor's
 * polynomial of degree 7 by Estrin's scheme (truncation below 5.3e-9 relative, under half an ulp; measured relative
 * error ≤ 1.46 ε on a grid of 2·10⁷ points); x ≤ −87 (results below 1.7e-38) gives 0, NaN gives NaN, x > 0 is read
 * as 0. */
#if defined(__AVX2__)
#define OTB_LANES 8
#define OTB_SPLAT(v) {v, v, v, v, v, v, v, v}
#else
#define OTB_LANES 4
#define OTB_SPLAT(v) {v, v, v, v}
#endif
typedef float otb_vf __attribute__((vector_size(4 * OTB_LANES)));
typedef int32_t otb_vi __attribute__((vector_size(4 * OTB_LANES)));

static inline otb_vf otb_select(otb_vi mask, otb_vf yes, otb_vf no) {
    return (otb_vf)((mask & (otb_vi)yes) | (~mask & (otb_vi)no));
}

static inline otb_vf otb_expv(otb_vf x) {
    const otb_vf low = OTB_SPLAT(-87.0f), zero = OTB_SPLAT(0.0f), log2e = OTB_SPLAT(1.44269504088896341f),
                  half = OTB_SPLAT(0.5f), ln2_hi = OTB_SPLAT(0.693145751953125f),
                  ln2_lo = OTB_SPLAT(1.42860682030941723e-6f);
    const otb_vi above = x > low;
    otb_vf clamped = otb_select(above, x, low);
    clamped = otb_select(clamped > zero, zero, clamped);
    const otb_vi n = __builtin_convertvector(clamped * log2e - half, otb_vi);   /* rounds to nearest for t ≤ 0 */
    const otb_vf fn = __builtin_convertvector(n, otb_vf);
    otb_vf r = clamped - fn * ln2_hi;
    r = r - fn * ln2_lo;
    const otb_vf c7 = OTB_SPLAT(1.0f / 5040.0f), c6 = OTB_SPLAT(1.0f / 720.0f), c5 = OTB_SPLAT(1.0f / 120.0f),
                  c4 = OTB_SPLAT(1.0f / 24.0f), c3 = OTB_SPLAT(1.0f / 6.0f), one = OTB_SPLAT(1.0f);
    const otb_vf r2 = r * r, r4 = r2 * r2;                 /* Estrin's scheme: a short dependency chain */
    const otb_vf p = ((one + r) + r2 * (half + r * c3)) + r4 * ((c4 + r * c5) + r2 * (c6 + r * c7));
    const otb_vi bias = OTB_SPLAT(127);
    const otb_vf value = p * (otb_vf)((n + bias) << 23);             /* 2ⁿ, n ∈ [−126, 0] */
    return otb_select(above, value, otb_select(x != x, x, zero));
}

/* Software prefetching of the next member row while this row is computed. A row's first reads of its inputs come
 * from memory (the batch is far larger than the caches); left to the hardware prefetcher they stall the passes that
 * make them (the mask pass, the exponential, the value checks; likewise the first writes of the returns), while the
 * arithmetic passes after them run from cache with the memory idle. So the loops of the arithmetic-heavy passes (the
 * exponential and the two scans, over the row's valid span) issue the next row's cache-line prefetches, round-robin
 * over its arrays, spread evenly over their 16-position steps (`step` per step), and what is left when the row is
 * done (a rounding remainder, or a row without valid tokens) is issued at once. Rows the first sweep writes are
 * hinted for writing (PREFETCHW where the target has it; an ordinary prefetch on baseline x86-64). A prefetch is a
 * hint: it changes no value and does not fault; the addresses lie inside the next row's arrays. Measured:
 * docs/performance.md. */
#define OTB_PREFETCH_ARRAYS 7
#define OTB_LINE 64

/* cache lines covering `bytes` bytes from a line's start */
static inline int64_t otb_lines(int64_t bytes) { return (bytes + OTB_LINE - 1) / OTB_LINE; }

typedef struct {
    const char *at[OTB_PREFETCH_ARRAYS];      /* the next row's arrays, `arrays` of them; at[0], at[1] written */
    int64_t lines[OTB_PREFETCH_ARRAYS];       /* … and their lengths in cache lines */
    int arrays, array;                        /* the next prefetch: line `line` of array `array` */
    int64_t line, longest;                    /* done when line = longest (the most lines of any array) */
    int64_t step;                             /* prefetches per 16 positions of the current row's loops */
    int64_t issued;                           /* prefetches issued (counted in OTB_PREFETCH_CHECK builds only) */
} otb_prefetch;

#ifdef OTB_PREFETCH_CHECK
/* Test builds only (tests/test_torch_native.py): each row's cursor, once the row is done, is kept per thread, and the
 * next row the sweep computes must be the one it described — every array's base and length in lines, the output
 * rows the sweep writes included (the caller says whether mₜWₜ goes to an output row) — with each line of each array
 * prefetched once; a mismatch counts one error. */
static int64_t otb_prefetch_errors;
static __thread otb_prefetch otb_prefetch_done;           /* arrays = 0: no row described */
static __thread int otb_prefetch_wm_output;               /* set by the caller before each row */
OTB_EXPORT int64_t otb_prefetch_check_errors(void) { return __atomic_load_n(&otb_prefetch_errors, __ATOMIC_SEQ_CST); }
#define OTB_PREFETCH_COUNT(pf) (++(pf)->issued)
#define OTB_PREFETCH_WM_OUTPUT(flag) (otb_prefetch_wm_output = (flag))
#else
#define OTB_PREFETCH_COUNT(pf) ((void)0)
#define OTB_PREFETCH_WM_OUTPUT(flag) ((void)0)
#endif

/* The next `count` prefetches (fewer at the end; pf NULL or done: none). */
static inline void otb_prefetch_lines(otb_prefetch *pf, int64_t count) {
    if (!pf) return;
    for (; count > 0 && pf->line < pf->longest; --count) {
        if (pf->line < pf->lines[pf->array]) {
            const char *address = pf->at[pf->array] + OTB_LINE * pf->line;
            if (pf->array <= 1) __builtin_prefetch(address, 1, 3);                /* to be written */
            else __builtin_prefetch(address, 0, 3);
            OTB_PREFETCH_COUNT(pf);
        }
        if (++pf->array == pf->arrays) {
            pf->array = 0;
            ++pf->line;
        }
    }
}

/* out[t] = exp(min(x[t], 0)), t < count */
static void otb_exp_row_float(const float *x, float *out, int64_t count, otb_prefetch *pf) {
    int64_t t = 0;
    for (; t + 2 * OTB_LANES <= count; t += 2 * OTB_LANES) {   /* two vectors per step: independent work overlaps */
        if (pf && t % 16 == 0) otb_prefetch_lines(pf, pf->step);          /* once per 16 positions */
        otb_vf u, v;
        memcpy(&u, x + t, sizeof u);
        memcpy(&v, x + t + OTB_LANES, sizeof v);
        u = otb_expv(u);
        v = otb_expv(v);
        memcpy(out + t, &u, sizeof u);
        memcpy(out + t + OTB_LANES, &v, sizeof v);
    }
    for (; t + OTB_LANES <= count; t += OTB_LANES) {
        otb_vf v;
        memcpy(&v, x + t, sizeof v);
        v = otb_expv(v);
        memcpy(out + t, &v, sizeof v);
    }
    if (t < count) {
        otb_vf v = OTB_SPLAT(0.0f);
        memcpy(&v, x + t, (size_t)(count - t) * sizeof(float));
        v = otb_expv(v);
        memcpy(out + t, &v, (size_t)(count - t) * sizeof(float));
    }
}

static void otb_exp_row_double(const double *x, double *out, int64_t count, otb_prefetch *pf) {
    for (int64_t t = 0; t < count; ++t) {
        if (pf && t % 16 == 0) otb_prefetch_lines(pf, pf->step);
        out[t] = x[t] > 0 ? 1.0 : exp(x[t]);
    }
}

/* The exponential the float32 kernel uses, exported for the accuracy test. */
OTB_EXPORT void otb_expf_array(const float *x, float *out, int64_t count) { otb_exp_row_float(x, out, count, 0); }

/* The fused linear token statistics (otb_torch._fused), float32: the elementwise work on one block of logits
 * z [rows, width] (row stride `stride`), rows [begin, end) of it, each row in two reads — the second from cache
 * (a row of 2048 floats is 8 KiB) — instead of torch's four to six passes over the whole block. */

/* Σ of a vector's lanes, in double. */
static inline double otb_lanes_sum(otb_vf v) {
    double total = 0.0;
    for (int k = 0; k < OTB_LANES; ++k) total += (double)v[k];
    return total;
}

/* Forward: fold each row into its running maximum m and sums S₁ = Σ e^{z−m}, S₂ = Σ e^{2(z−m)}, T = Σ e^{z−m}(z − m)
 * (peak, s1, s2, tilt: one value per row of the block, rows counted from `begin`'s block start); with first = 0 the
 * sums already there are rescaled to the new maximum m' (shift δ = m − m' ≤ 0: S₁ ← e^δ S₁, S₂ ← e^{2δ} S₂,
 * T ← e^δ (T + δ S₁)) before the row's terms are added. A NaN in the row gives NaN sums (as the eager path); z is not
 * written. Lane sums in float, each row's total and the rescaling in double, stored as float. */
OTB_EXPORT void otb_fused_fold_float32(const float *z, int64_t begin, int64_t end, int64_t width, int64_t stride,
                                       float *peak, float *s1, float *s2, float *tilt, int first) {
    for (int64_t r = begin; r < end; ++r) {
        const float *row = z + r * stride;
        otb_vf top = OTB_SPLAT(-INFINITY);
        otb_vi nan = OTB_SPLAT(0);
        int64_t v = 0;
        for (; v + OTB_LANES <= width; v += OTB_LANES) {
            otb_vf x;
            memcpy(&x, row + v, sizeof x);
            nan |= x != x;
            top = otb_select(x > top, x, top);
        }
        float high = -INFINITY;
        int any_nan = 0;
        for (int k = 0; k < OTB_LANES; ++k) {
            high = top[k] > high ? top[k] : high;
            any_nan |= nan[k] != 0;
        }
        for (; v < width; ++v) {
            high = row[v] > high ? row[v] : high;
            any_nan |= row[v] != row[v];
        }
        const float old = peak[r];
        const float new_peak = any_nan ? NAN : (first || high > old ? high : old);
        const otb_vf m = OTB_SPLAT(new_peak);
        otb_vf a1 = OTB_SPLAT(0.0f), a2 = a1, at = a1, b1 = a1, b2 = a1, bt = a1;
        v = 0;
        for (; v + 2 * OTB_LANES <= width; v += 2 * OTB_LANES) {     /* two vectors per step: independent chains */
            otb_vf x, y;
            memcpy(&x, row + v, sizeof x);
            memcpy(&y, row + v + OTB_LANES, sizeof y);
            x -= m;
            y -= m;
            const otb_vf e = otb_expv(x), f = otb_expv(y);
            a1 += e;
            a2 += e * e;
            at += e * x;
            b1 += f;
            b2 += f * f;
            bt += f * y;
        }
        for (; v < width; v += OTB_LANES) {
            otb_vf x = m;
            const int64_t count = width - v < OTB_LANES ? width - v : OTB_LANES;
            memcpy(&x, row + v, (size_t)count * sizeof(float));
            x -= m;
            for (int64_t k = count; k < OTB_LANES; ++k) x[k] = -1000.0f;   /* e^{−1000} = 0, −1000·0 = 0, any m */
            const otb_vf e = otb_expv(x);
            a1 += e;
            a2 += e * e;
            at += e * x;
        }
        const double row1 = otb_lanes_sum(a1 + b1), row2 = otb_lanes_sum(a2 + b2), rowt = otb_lanes_sum(at + bt);
        if (first) {
            s1[r] = (float)row1;
            s2[r] = (float)row2;
            tilt[r] = (float)rowt;
        } else {
            const double shift = (double)old - (double)new_peak, factor = exp(shift);
            tilt[r] = (float)(factor * ((double)tilt[r] + shift * (double)s1[r]) + rowt);
            s1[r] = (float)(factor * (double)s1[r] + row1);
            s2[r] = (float)(factor * factor * (double)s2[r] + row2);
        }
        peak[r] = new_peak;
    }
}

/* Backward: with x = z + shift[r] (z = h·Wᵀ/τ and shift = −lse: x = log π_v), z ← c·e^{min(x, 0)} in place, with
 * c = offset[r] + slope[r]·x (slope NULL: c = offset[r]) — the logit cotangent's −c·π part,
 * c = g_lp + g_H·(log π_v + H). One read and one write of each row. */
OTB_EXPORT void otb_fused_cotangent_float32(float *z, int64_t begin, int64_t end, int64_t width, int64_t stride,
                                            const float *shift, const float *offset, const float *slope) {
    for (int64_t r = begin; r < end; ++r) {
        float *row = z + r * stride;
        const otb_vf s = OTB_SPLAT(shift[r]), c0 = OTB_SPLAT(offset[r]), c1 = OTB_SPLAT(slope ? slope[r] : 0.0f);
        int64_t v = 0;
        for (; v + OTB_LANES <= width; v += OTB_LANES) {
            otb_vf x;
            memcpy(&x, row + v, sizeof x);
            x += s;
            x = (c0 + c1 * x) * otb_expv(x);
            memcpy(row + v, &x, sizeof x);
        }
        if (v < width) {
            otb_vf x = OTB_SPLAT(0.0f);
            memcpy(&x, row + v, (size_t)(width - v) * sizeof(float));
            x += s;
            x = (c0 + c1 * x) * otb_expv(x);
            memcpy(row + v, &x, (size_t)(width - v) * sizeof(float));
        }
    }
}

/* The scans: four double lanes (AVX; two SSE2 registers elsewhere), shuffled with GCC's or clang's builtin. */
typedef double otb_v4d __attribute__((vector_size(32)));
#if defined(__clang__) || __GNUC__ >= 12
#define OTB_SHUFFLE(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
typedef int64_t otb_v4l __attribute__((vector_size(32)));
#define OTB_SHUFFLE(a, b, i, j, k, l) __builtin_shuffle(a, b, (otb_v4l){i, j, k, l})
#endif
#define OTB_LANE(x, i) OTB_SHUFFLE(x, x, i, i, i, i)

/* inclusive prefix sums of the lanes: (x₀, x₀ + x₁, (x₁ + x₂) + x₀, (x₂ + x₃) + (x₀ + x₁)) */
static inline otb_v4d otb_prefix4(otb_v4d x) {
    const otb_v4d zero = {0, 0, 0, 0};
    x += OTB_SHUFFLE(zero, x, 0, 4, 5, 6);
    return x + OTB_SHUFFLE(zero, x, 0, 1, 4, 5);
}

/* inclusive suffix sums of the lanes: ((x₀ + x₁) + (x₂ + x₃), (x₁ + x₂) + x₃, x₂ + x₃, x₃) */
static inline otb_v4d otb_suffix4(otb_v4d x) {
    const otb_v4d zero = {0, 0, 0, 0};
    x += OTB_SHUFFLE(x, zero, 1, 2, 3, 4);
    return x + OTB_SHUFFLE(x, zero, 2, 3, 4, 5);
}

/* Bit k set where v[k] ≠ 0 (NaN included), k < 8: one compare and move-mask per vector on x86 (the compiler does not
 * find these for a loop over 8 flags); a loop elsewhere. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline unsigned otb_nonzero8_float(const float *v) {
#if defined(__AVX__)
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
#else
    const __m128 zero = _mm_setzero_ps();
    return (unsigned)_mm_movemask_ps(_mm_cmpneq_ps(_mm_loadu_ps(v), zero))
           | (unsigned)_mm_movemask_ps(_mm_cmpneq_ps(_mm_loadu_ps(v + 4), zero)) << 4;
#endif
}
static inline unsigned otb_nonzero8_double(const double *v) {
    unsigned bits = 0;
#if defined(__AVX__)
    for (int k = 0; k < 2; ++k)
        bits |= (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(v + 4 * k), _mm256_setzero_pd(),
                                                           _CMP_NEQ_UQ)) << 4 * k;
#else
    for (int k = 0; k < 4; ++k)
        bits |= (unsigned)_mm_movemask_pd(_mm_cmpneq_pd(_mm_loadu_pd(v + 2 * k), _mm_setzero_pd())) << 2 * k;
#endif
    return bits;
}
#else
static inline unsigned otb_nonzero8_float(const float *v) {
    unsigned bits = 0;
    for (int k = 0; k < 8; ++k) bits |= (unsigned)(v[k] != 0) << k;
    return bits;
}
static inline unsigned otb_nonzero8_double(const double *v) {
    unsigned bits = 0;
    for (int k = 0; k < 8; ++k) bits |= (unsigned)(v[k] != 0) << k;
    return bits;
}
#endif

/* Where a self-inclusive row's baseline is 0 from (otb_dist_final): the ranks' statistics merged for group `id` by
 * the rule of otb_spec.distributed.combine_group_lengths. stats: [ranks, 4, G] int64, each rank's (members, longest,
 * count at the longest, second longest; −1: none) of its rows. Fewer than two members in all: column 0. With the zero
 * tail, a row of the group's unique longest length L₁ (the count at L₁ summed over the ranks that reach it is 1):
 * the second longest, the largest of the ranks' values below L₁ (their longest, or their second where they reach
 * L₁) and at least −1. Else `columns`: no column. O(ranks). */
static int64_t otb_zero_from(const int64_t *stats, int64_t ranks, int64_t num_groups, int64_t id, int zero_tail,
                             int64_t row_length, int64_t columns) {
    int64_t members = 0, longest = -1;
    for (int64_t p = 0; p < ranks; ++p) {
        const int64_t *rank = stats + p * 4 * num_groups + id;
        members += rank[0];
        if (rank[num_groups] > longest) longest = rank[num_groups];
    }
    if (members < 2) return 0;
    if (!zero_tail || row_length != longest) return columns;
    int64_t count = 0, second = -1;
    for (int64_t p = 0; p < ranks; ++p) {
        const int64_t *rank = stats + p * 4 * num_groups + id;
        const int reaches = rank[num_groups] == longest;
        if (reaches) count += rank[2 * num_groups];
        const int64_t below = reaches ? rank[3 * num_groups] : rank[num_groups];
        if (below > second) second = below;
    }
    return count == 1 ? second : columns;
}

#define OTB_BLOCK 8                 /* positions per block in the valid-token loops (otb_nonzero8) */
#define OTB_ALL 0xFFu
#define OTB_CAT2(a, b) a##_##b
#define OTB_CAT(a, b) OTB_CAT2(a, b)
#define FN(name) OTB_CAT(name, OTB_SUFFIX)

/* Instantiate the template for every (compute type, mask type): T, its integer flag type of the same width (so
 * that the checks' OR-reductions vectorise), its exponential and largest finite value; M and the name suffix. */
#define T float
#define FLAG int32_t
#define EXP_ROW otb_exp_row_float
#define NONZERO8 otb_nonzero8_float
#define FINITE_MAX 3.40282346638528859812e+38f
#define M uint8_t
#define OTB_SUFFIX float32_bool
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M int32_t
#define OTB_SUFFIX float32_int32
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M int64_t
#define OTB_SUFFIX float32_int64
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M float
#define OTB_SUFFIX float32_float32
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M double
#define OTB_SUFFIX float32_float64
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#undef T
#undef FLAG
#undef EXP_ROW
#undef NONZERO8
#undef FINITE_MAX

#define T double
#define FLAG int64_t
#define EXP_ROW otb_exp_row_double
#define NONZERO8 otb_nonzero8_double
#define FINITE_MAX 1.79769313486231570815e+308
#define M uint8_t
#define OTB_SUFFIX float64_bool
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M int32_t
#define OTB_SUFFIX float64_int32
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M int64_t
#define OTB_SUFFIX float64_int64
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M float
#define OTB_SUFFIX float64_float32
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#define M double
#define OTB_SUFFIX float64_float64
#include "_kernel.c"
#undef M
#undef OTB_SUFFIX
#undef T
#undef FLAG
#undef EXP_ROW
#undef NONZERO8
#undef FINITE_MAX

#else
/* ===================================================================================================================
 * The template: T (compute type), FLAG, EXP_ROW, NONZERO8, FINITE_MAX, M (mask type), OTB_SUFFIX.
 * =================================================================================================================*/

typedef T FN(otb_tv4) __attribute__((vector_size(4 * sizeof(T))));    /* four values of T */
typedef T FN(otb_tv8) __attribute__((vector_size(8 * sizeof(T))));    /* a block of OTB_BLOCK values of T */
typedef FLAG FN(otb_fv8) __attribute__((vector_size(8 * sizeof(T))));   /* … and its comparison results */

/* Leave-one-out in one process: per column of a group, its largest weight mₜWₜ so far (w) and that member's GₜWₜmₜ
 * (gw). With them the column sums num and den leave the top member out, so its baseline needs no D − Wᵢ, which
 * cancels to rounding noise where Wᵢ dwarfs the others' energy (a forced opening where one member sampled another
 * token); every other member has D − Wᵢ ≥ Wtop ≥ Wᵢ, so D − Wᵢ ≥ D/2. A member is the top where its own (w, g·w)
 * equal the column's — the same products, bit for bit: a member tied with the top in both reads the sums without the
 * top, which hold its twin's terms in place of its own, the same numbers. In a distributed rank's grid, per group
 * and cell the top among the rank's own members (OTB_GROUP_TOP). w NULL: plain sums. */
typedef struct {
    T *w, *gw;
} FN(otb_top);

/* The valid-token loops' blocks as explicit vectors (the compiler does not reliably vectorise 8-position loops). */
static inline FN(otb_tv8) FN(otb_load8)(const T *at) {
    FN(otb_tv8) v;
    memcpy(&v, at, sizeof v);
    return v;
}

static inline void FN(otb_store8)(T *at, FN(otb_tv8) v) { memcpy(at, &v, sizeof v); }

static inline FN(otb_tv8) FN(otb_select8)(FN(otb_fv8) mask, FN(otb_tv8) yes, FN(otb_tv8) no) {
    return (FN(otb_tv8))((mask & (FN(otb_fv8))yes) | (~mask & (FN(otb_fv8))no));
}

/* mv ← (T)m over the row; the row's number of valid tokens, and its valid span [*lo, *hi) (outside it m = 0; an
 * empty row gives lo = hi = width). One pass, its reductions vectorised (counts and positions in FLAG: T's width). */
static inline int64_t FN(otb_row_mask)(const M *restrict mr, T *restrict mv, int64_t width, int64_t *lo,
                                       int64_t *hi) {
    FLAG valid = 0, first = (FLAG)width, last = 0;
    for (FLAG t = 0; t < (FLAG)width; ++t) {
        const T v = (T)mr[t];
        mv[t] = v;
        valid += v != 0 ? 1 : 0;
        const FLAG at = v != 0 ? t : (FLAG)width, after = v != 0 ? t + 1 : 0;
        first = at < first ? at : first;
        last = after > last ? after : last;
    }
    *lo = first;
    *hi = last > first ? last : first;
    return valid;
}

/* The slack of the rule π² ≤ Σπ² as the kernel tests it, π² − Σπ² > slack: a 0.1 % margin below the reference's, as
 * π² is computed here and the rest only compared. */
static inline T FN(otb_pi_slack)(T slack_lp, T slack_spp) { return (slack_spp + 2 * slack_lp) * (T)0.999; }

/* Nonzero if the row may break a value rule (see the file's comment); π is known on [lo, hi) only. With pi_checked,
 * the rule π² ≤ Σπ² is left to the caller (the energy loop tests it, reading the same values). */
static int FN(otb_check_row)(const T *restrict r, const M *restrict m, const T *restrict mv, const T *restrict lp,
                             const T *restrict spp, const T *restrict pi, const T *restrict rho, int64_t width,
                             int64_t lo, int64_t hi, T slack_lp, T slack_spp, int pi_checked) {
    FLAG bad = 0;
    const T own_slack = FN(otb_pi_slack)(slack_lp, slack_spp);
    for (int64_t t = 0; t < width; ++t) {
        const FLAG valid = mv[t] != 0;
        /* x − x is 0 for every finite x and NaN for ±∞ and NaN (no -ffinite-math-only: the compiler keeps it) */
        const T finite = (r[t] - r[t]) + (lp[t] - lp[t]) + (spp[t] - spp[t]);
        bad |= !(finite == 0);
        bad |= valid & ((lp[t] > slack_lp) | (spp[t] < -slack_spp) | (spp[t] > 1 + slack_spp));
    }
    int binary = 0;
    for (int64_t t = 0; t < width; ++t) binary |= (m[t] != 0) & (m[t] != 1);   /* in the mask's own type */
    if (!pi_checked)
        for (int64_t t = lo; t < hi; ++t) bad |= (mv[t] != 0) & (pi[t] * pi[t] - spp[t] > own_slack);
    if (rho) {
        for (int64_t t = 0; t < width; ++t) bad |= !((rho[t] <= FINITE_MAX) & (rho[t] >= 0));
    }
    return bad != 0 || binary;
}

/* The scans, over the valid span [lo, hi), sixteen positions at a time: each vector of four gets its in-register
 * prefix (suffix), then the offsets of the vectors before (after) it in the block, then the carry — so the carry's
 * chain is one addition per 16 positions. Every output is a double sum rounded once to T; the end of the span runs
 * one position at a time. */

/* mₜWₜ = mₜ(*running + Σ_{lo≤j≤t} eⱼ) in place of the energies e in wm; *running becomes the total */
static inline void FN(otb_scan_energy)(const T *restrict mv, T *restrict wm, int64_t lo, int64_t hi,
                                       double *running, otb_prefetch *pf) {
    typedef FN(otb_tv4) tv4;
    otb_v4d carry = {*running, *running, *running, *running};
    int64_t t = lo;
    for (; t + 16 <= hi; t += 16) {
        if (pf) otb_prefetch_lines(pf, pf->step);
        otb_v4d p[4];
        for (int k = 0; k < 4; ++k) {
            tv4 e;
            memcpy(&e, wm + t + 4 * k, sizeof e);
            p[k] = otb_prefix4(__builtin_convertvector(e, otb_v4d));
        }
        const otb_v4d o1 = OTB_LANE(p[0], 3), o2 = o1 + OTB_LANE(p[1], 3), o3 = o2 + OTB_LANE(p[2], 3);
        const otb_v4d block = o3 + OTB_LANE(p[3], 3);
        p[0] = p[0] + carry;
        p[1] = (p[1] + o1) + carry;
        p[2] = (p[2] + o2) + carry;
        p[3] = (p[3] + o3) + carry;
        carry = carry + block;
        for (int k = 0; k < 4; ++k) {
            tv4 m4, w = __builtin_convertvector(p[k], tv4);
            memcpy(&m4, mv + t + 4 * k, sizeof m4);
            w = w * m4;
            memcpy(wm + t + 4 * k, &w, sizeof w);
        }
    }
    double run = carry[0];
    for (; t < hi; ++t) {
        run += (double)wm[t];
        wm[t] = (T)run * mv[t];
    }
    *running = run;
}

/* Gₜ = *total + Σ_{t≤k<hi} rₖmₖ into gr; *total becomes the row's (piece's) total */
static inline void FN(otb_scan_returns)(const T *restrict rr, const T *restrict mv, T *restrict gr, int64_t lo,
                                        int64_t hi, double *total, otb_prefetch *pf) {
    typedef FN(otb_tv4) tv4;
    otb_v4d carry = {*total, *total, *total, *total};
    int64_t s = hi;                                             /* positions [lo, s) are left */
    for (; s - 16 >= lo; s -= 16) {
        if (pf) otb_prefetch_lines(pf, pf->step);
        otb_v4d q[4];
        for (int k = 0; k < 4; ++k) {
            tv4 x, m4;
            memcpy(&x, rr + s - 16 + 4 * k, sizeof x);
            memcpy(&m4, mv + s - 16 + 4 * k, sizeof m4);
            q[k] = otb_suffix4(__builtin_convertvector(x * m4, otb_v4d));
        }
        const otb_v4d o2 = OTB_LANE(q[3], 0), o1 = o2 + OTB_LANE(q[2], 0), o0 = o1 + OTB_LANE(q[1], 0);
        const otb_v4d block = o0 + OTB_LANE(q[0], 0);
        q[3] = q[3] + carry;
        q[2] = (q[2] + o2) + carry;
        q[1] = (q[1] + o1) + carry;
        q[0] = (q[0] + o0) + carry;
        carry = carry + block;
        for (int k = 0; k < 4; ++k) {
            const tv4 g = __builtin_convertvector(q[k], tv4);
            memcpy(gr + s - 16 + 4 * k, &g, sizeof g);
        }
    }
    double sum = carry[0];
    for (--s; s >= lo; --s) {
        sum += (double)(rr[s] * mv[s]);
        gr[s] = (T)sum;
    }
    *total = sum;
}

/* The leave-one-out weights: w = max(w, 0) in place on [lo, hi) (a NaN stays NaN), as
 * otb_spec._baseline.leave_one_out_energy: energies a hair negative from statistics within the input slack weigh 0. */
static inline void FN(otb_nonnegative)(T *restrict w, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) w[t] = w[t] < 0 ? (T)0 : w[t];
}

/* One member's terms into a leave-one-out column that keeps its largest weight apart (otb_top): the top's weight
 * and term move into the sums when a larger weight arrives, so num and den hold the sums of the other members. */
static inline void FN(otb_top_add)(T g, T w, T *restrict n, T *restrict d, FN(otb_top) top, int64_t c) {
    const T gw = g * w;
    const int up = w > top.w[c];
    *n += up ? top.gw[c] : gw;
    *d += up ? top.w[c] : w;
    top.gw[c] = up ? gw : top.gw[c];
    top.w[c] = up ? w : top.w[c];
}

/* Adds one member row's terms into its group's columns: num[c] += GₜWₜmₜ, den[c] += Wₜmₜ, cnt[c] += [mₜ ≠ 0] (cnt
 * may be NULL) at c = col0 + t (position) or col0 + #valid before t (valid token), for c < columns; gr, wm: Gₜ and
 * mₜWₜ on the valid span [lo, hi). With top.w, the terms go through otb_top_add. */
static void FN(otb_row_accumulate)(const T *restrict gr, const T *restrict wm, const T *restrict mv, int64_t lo,
                                   int64_t hi, T *restrict num, T *restrict den, T *restrict cnt, int valid_token,
                                   int64_t col0, int64_t columns, FN(otb_top) top) {
    if (!valid_token) {                                     /* c = col0 + t */
        const int64_t stop = hi < columns - col0 ? hi : columns - col0;
        T *n = num + col0, *d = den + col0;
        if (top.w) {                                        /* FN(otb_top_add), in a loop that vectorises */
            T *restrict tw = top.w + col0, *restrict tg = top.gw + col0;
            for (int64_t t = lo; t < stop; ++t) {
                const T w = wm[t], gw = gr[t] * w, old_w = tw[t], old_gw = tg[t];
                const int up = w > old_w;
                n[t] += up ? old_gw : gw;
                d[t] += up ? old_w : w;
                tg[t] = up ? gw : old_gw;
                tw[t] = up ? w : old_w;
            }
        } else {
            for (int64_t t = lo; t < stop; ++t) {
                n[t] += gr[t] * wm[t];
                d[t] += wm[t];
            }
        }
        if (cnt) {
            T *v = cnt + col0;
            for (int64_t t = lo; t < stop; ++t) v[t] += mv[t] != 0 ? (T)1 : (T)0;
        }
        return;
    }
    int64_t t = lo, c = col0;                              /* c = col0 + #valid before t */
    while (t < hi && c < columns) {
        if (t + OTB_BLOCK <= hi) {
            const unsigned bits = NONZERO8(mv + t);
            const int all = bits == OTB_ALL, none = bits == 0;
            if (none) {
                t += OTB_BLOCK;
                continue;
            }
            if (all && c + OTB_BLOCK <= columns) {
                const FN(otb_tv8) w = FN(otb_load8)(wm + t);
                if (top.w) {                                    /* FN(otb_top_add), 8 at a time */
                    typedef FN(otb_tv8) tv8;
                    const tv8 gw = FN(otb_load8)(gr + t) * w, old_w = FN(otb_load8)(top.w + c),
                              old_gw = FN(otb_load8)(top.gw + c);
                    const FN(otb_fv8) up = w > old_w;
                    FN(otb_store8)(num + c, FN(otb_load8)(num + c) + FN(otb_select8)(up, old_gw, gw));
                    FN(otb_store8)(den + c, FN(otb_load8)(den + c) + FN(otb_select8)(up, old_w, w));
                    FN(otb_store8)(top.gw + c, FN(otb_select8)(up, gw, old_gw));
                    FN(otb_store8)(top.w + c, FN(otb_select8)(up, w, old_w));
                } else {
                    FN(otb_store8)(num + c, FN(otb_load8)(num + c) + FN(otb_load8)(gr + t) * w);
                    FN(otb_store8)(den + c, FN(otb_load8)(den + c) + w);
                }
                if (cnt) for (int k = 0; k < OTB_BLOCK; ++k) cnt[c + k] += (T)1;
                t += OTB_BLOCK;
                c += OTB_BLOCK;
                continue;
            }
        }
        if (mv[t] != 0) {
            if (top.w) {
                FN(otb_top_add)(gr[t], wm[t], num + c, den + c, top, c);
            } else {
                num[c] += gr[t] * wm[t];
                den[c] += wm[t];
            }
            if (cnt) cnt[c] += (T)1;
            ++c;
        }
        ++t;
    }
}

/* Prefetching of the row at offset `at` (an element offset into the [B, width] arrays; at < 0: none) while the
 * current row is computed: for writing, its rows of the returns and of wm when the first sweep writes mₜWₜ into an
 * output (wm NULL: the energies go to scratch); for reading, its mask, log π, rewards, Σπ² and ρ (when given), in
 * the order the first sweep reads them. Returns pf, or NULL when there is no next row. */
static otb_prefetch *FN(otb_prefetch_row)(otb_prefetch *pf, int64_t at, int64_t width, const M *m, const T *lp,
                                          const T *r, const T *spp, const T *rho, T *ret, T *wm) {
    if (at < 0) return 0;
    const int64_t values = otb_lines(width * (int64_t)sizeof(T));
    pf->at[0] = (const char *)(ret + at);
    pf->at[1] = (const char *)(wm ? wm + at : ret + at);
    pf->at[2] = (const char *)(m + at);
    pf->lines[2] = otb_lines(width * (int64_t)sizeof(M));
    pf->at[3] = (const char *)(lp + at);
    pf->at[4] = (const char *)(r + at);
    pf->at[5] = (const char *)(spp + at);
    pf->at[6] = rho ? (const char *)(rho + at) : 0;
    pf->arrays = rho ? 7 : 6;
    for (int k = 3; k < pf->arrays; ++k) pf->lines[k] = values;
    pf->lines[0] = values;
    pf->lines[1] = wm ? values : 0;
    pf->longest = pf->lines[2] > pf->lines[3] ? pf->lines[2] : pf->lines[3];
    pf->array = 0;
    pf->line = 0;
    pf->issued = 0;
    return pf;
}

#ifdef OTB_PREFETCH_CHECK
/* Test builds: does the previous row's cursor describe this row (rr, mr, lr, sr, wr its inputs, gr its returns, wm
 * its energies, an output row when the caller said so)? */
static void FN(otb_prefetch_verify)(const T *rr, const M *mr, const T *lr, const T *sr, const T *wr, const T *gr,
                                    const T *wm, int64_t width) {
    const otb_prefetch *e = &otb_prefetch_done;
    if (e->arrays == 0) return;
    const int64_t values = otb_lines(width * (int64_t)sizeof(T)), mask = otb_lines(width * (int64_t)sizeof(M));
    int ok = e->at[0] == (const char *)gr && e->lines[0] == values;
    ok &= otb_prefetch_wm_output ? e->at[1] == (const char *)wm && e->lines[1] == values : e->lines[1] == 0;
    ok &= e->at[2] == (const char *)mr && e->lines[2] == mask;
    ok &= e->at[3] == (const char *)lr && e->at[4] == (const char *)rr && e->at[5] == (const char *)sr;
    ok &= e->lines[3] == values && e->lines[4] == values && e->lines[5] == values;
    ok &= wr ? e->arrays == 7 && e->at[6] == (const char *)wr && e->lines[6] == values : e->arrays == 6;
    int64_t lines = 0;
    for (int k = 0; k < e->arrays; ++k) lines += e->lines[k];
    ok &= e->issued == lines;
    if (!ok) __atomic_fetch_add(&otb_prefetch_errors, 1, __ATOMIC_SEQ_CST);
}
#endif

/* The first sweep over one member row (scratch mv, pi: width values each).
 *
 * Writes Gₜ (plus `ret_offset`, the rewards of later context pieces) to gr. With `need_energy`, writes mₜWₜ (Wₜ plus
 * `energy_offset`, the energy of earlier pieces) to wm on the valid span (elsewhere wm is left as it is; with
 * `nonnegative`, the leave-one-out weights mₜ·max(Wₜ, 0)) and, when num is given, adds the row's terms into the
 * group's columns (otb_row_accumulate; with top.w, keeping each column's largest weight apart). The running total
 * in `sums` stays the bare Σw. Returns the valid count; ORs the value checks into *bad; with `sums`, stores the
 * scans' last values there (Σmr and Σw, offsets included). With pf, prefetches the next row while it runs
 * (otb_prefetch). */
static int64_t FN(otb_row_first)(const T *restrict rr, const M *restrict mr, const T *restrict lr,
                                 const T *restrict sr, const T *restrict wr, int64_t width, T *restrict gr,
                                 T *restrict wm, T *restrict mv, T *restrict pi, T *restrict num, T *restrict den,
                                 T *restrict cnt, int valid_token, int64_t col0, int64_t columns, double ret_offset,
                                 double energy_offset, int need_energy, int nonnegative, int check, T slack_lp,
                                 T slack_spp, int *bad, double *sums, otb_prefetch *pf, FN(otb_top) top) {
#ifdef OTB_PREFETCH_CHECK
    FN(otb_prefetch_verify)(rr, mr, lr, sr, wr, gr, wm, width);
#endif
    int64_t lo, hi;
    const int64_t valid = FN(otb_row_mask)(mr, mv, width, &lo, &hi);
    if (pf) {                               /* spread over the 16-position steps of the exponential and the scans */
        const int64_t steps = (1 + (check || need_energy) + need_energy) * ((hi - lo) / 16) + 1;
        const int64_t prefetches = pf->longest * pf->arrays;
        pf->step = (prefetches + steps - 1) / steps;
    }
    if (check || need_energy) EXP_ROW(lr + lo, pi + lo, hi - lo, pf);
    if (check) *bad |= FN(otb_check_row)(rr, mr, mv, lr, sr, pi, wr, width, lo, hi, slack_lp, slack_spp, need_energy);
    double total = ret_offset, running = energy_offset;
    FN(otb_scan_returns)(rr, mv, gr, lo, hi, &total, pf);
    if (need_energy) {
        if (check) {                                       /* with the rule π² ≤ Σπ² on the values just read */
            const T own_slack = FN(otb_pi_slack)(slack_lp, slack_spp);
            FLAG flagged = 0;
            for (int64_t t = lo; t < hi; ++t) {
                wm[t] = mv[t] + mv[t] * (sr[t] - 2 * pi[t]);                             /* mₜ(1 − 2πₜ + Σπ²ₜ) */
                flagged |= (mv[t] != 0) & (pi[t] * pi[t] - sr[t] > own_slack);
            }
            *bad |= flagged != 0;
        } else {
            for (int64_t t = lo; t < hi; ++t) wm[t] = mv[t] + mv[t] * (sr[t] - 2 * pi[t]);
        }
        if (wr) for (int64_t t = lo; t < hi; ++t) wm[t] = wm[t] * wr[t] * wr[t];
        FN(otb_scan_energy)(mv, wm, lo, hi, &running, pf);
        if (nonnegative) FN(otb_nonnegative)(wm, lo, hi);
    }
    otb_prefetch_lines(pf, INT64_MAX);                     /* the rest of the next row, at once */
#ifdef OTB_PREFETCH_CHECK
    if (pf) otb_prefetch_done = *pf;
    else otb_prefetch_done.arrays = 0;
#endif
    for (int64_t t = 0; t < lo; ++t) gr[t] = (T)total;
    for (int64_t t = hi; t < width; ++t) gr[t] = (T)ret_offset;
    if (check) *bad |= !((total <= FINITE_MAX) & (total >= -FINITE_MAX));
    if (sums) {
        sums[0] = total;
        sums[1] = running;
    }
    if (num && need_energy)
        FN(otb_row_accumulate)(gr, wm, mv, lo, hi, num, den, cnt, valid_token, col0, columns, top);
    return valid;
}

/* A local group's members, longest length, count at the longest and second-longest length (−1: none) into
 * stats[k·G + id]; lengths from total_lengths (NULL: `lengths`), members: rows with a valid token when aligned by
 * valid token, all rows by position. With cnt (leave-one-out by valid token), each member also adds 1 at column
 * L − 1 of the histogram that becomes V (otb_lengths_to_counts). */
static void FN(otb_group_statistics)(const int64_t *order, int64_t begin, int64_t end, const int64_t *lengths,
                                     const int64_t *total_lengths, int valid_token, int64_t id, int64_t num_groups,
                                     int64_t *stats, T *cnt, int64_t columns) {
    int64_t members = 0, longest = -1, at_longest = 0, second = -1;
    for (int64_t p = begin; p < end; ++p) {
        const int64_t row = order[p], length = total_lengths ? total_lengths[row] : lengths[row];
        if (valid_token && length == 0) continue;
        ++members;
        if (length > longest) longest = length;
        if (cnt && length >= 1 && length <= columns) cnt[length - 1] += 1;
    }
    for (int64_t p = begin; p < end; ++p) {
        const int64_t row = order[p], length = total_lengths ? total_lengths[row] : lengths[row];
        if (valid_token && length == 0) continue;
        if (length == longest) ++at_longest;
        else if (length > second) second = length;
    }
    stats[id] = members;
    stats[num_groups + id] = longest;
    stats[2 * num_groups + id] = at_longest;
    stats[3 * num_groups + id] = second;
}

/* Outside the valid span: Aₜ = Gₜmₜ (= 0 for finite G), Bₜmₜ = 0. */
static inline void FN(otb_outside)(const T *restrict gr, const T *restrict mv, int64_t from, int64_t to,
                                   T *restrict ar, T *restrict br) {
    for (int64_t t = from; t < to; ++t) ar[t] = gr[t] * mv[t];
    if (br && to > from) memset(br + from, 0, (size_t)(to - from) * sizeof(T));
}

/* Self-inclusive advantages of one member row (scratch mv: width values): Bₜ = ratio[c] for aligned columns
 * c < start (0 from there on and for c ≥ columns), Aₜ = (Gₜ − Bₜ)mₜ into ar, Bₜmₜ into br (when given). */
static void FN(otb_row_final_self)(const M *restrict mr, const T *restrict gr, int64_t width,
                                   const T *restrict ratio, int valid_token, int64_t col0, int64_t columns,
                                   int64_t start, T *restrict ar, T *restrict br, T *restrict mv) {
    const int64_t limit = start < columns ? start : columns;
    int64_t lo, hi;
    FN(otb_row_mask)(mr, mv, width, &lo, &hi);
    FN(otb_outside)(gr, mv, 0, lo, ar, br);
    if (!valid_token) {
        int64_t stop = limit - col0;
        stop = stop < lo ? lo : (stop > hi ? hi : stop);
        const T *b = ratio + col0;
        if (br) {
            for (int64_t t = lo; t < stop; ++t) {
                ar[t] = (gr[t] - b[t]) * mv[t];
                br[t] = b[t] * mv[t];
            }
        } else {
            for (int64_t t = lo; t < stop; ++t) ar[t] = (gr[t] - b[t]) * mv[t];
        }
        FN(otb_outside)(gr, mv, stop, width, ar, br);
        return;
    }
    int64_t t = lo, c = col0;
    while (t < hi) {
        if (t + OTB_BLOCK <= hi) {
            const unsigned bits = NONZERO8(mv + t);
            const int all = bits == OTB_ALL, none = bits == 0;
            if (all && c + OTB_BLOCK <= limit) {
                const FN(otb_tv8) b = FN(otb_load8)(ratio + c), m8 = FN(otb_load8)(mv + t);
                FN(otb_store8)(ar + t, (FN(otb_load8)(gr + t) - b) * m8);
                if (br) FN(otb_store8)(br + t, b * m8);
                t += OTB_BLOCK;
                c += OTB_BLOCK;
                continue;
            }
            if (none || (all && c >= limit)) {             /* masked, or past the zero rule's start: B = 0 */
                FN(otb_outside)(gr, mv, t, t + OTB_BLOCK, ar, br);
                t += OTB_BLOCK;
                c += all ? OTB_BLOCK : 0;
                continue;
            }
        }
        T b = 0;
        if (mv[t] != 0) {
            b = c < limit ? ratio[c] : (T)0;
            ++c;
        }
        ar[t] = (gr[t] - b) * mv[t];
        if (br) br[t] = b * mv[t];
        ++t;
    }
    FN(otb_outside)(gr, mv, hi, width, ar, br);
}

/* Leave-one-out Bₜ from the other members' sums n, d and the count vc of members valid at the column, for a member
 * with v = [mₜ ≠ 0]; branch-free, so that the loops around it vectorise. */
static inline T FN(otb_loo_ratio)(T n, T d, T vc, T v, T eps) {
    const T ratio = n / (d <= 0 ? (T)1 : d + eps);  /* no baseline unless the others' energy is positive; NaN stays */
    return ((vc - v > 0) & !(d <= 0)) ? ratio : (T)0;
}

/* Leave-one-out Bₜ at column c (sums nc, dc, vc) for a member whose own terms there are (g = Gₜ, w = Wₜmₜ,
 * v = [mₜ ≠ 0]). */
static inline T FN(otb_leave_one_out)(T nc, T dc, T vc, T g, T w, T v, T eps) {
    return FN(otb_loo_ratio)(nc - g * w, dc - w, vc, v, eps);
}

/* The same from sums that leave column c's top member out (FN(otb_top)): that member takes them as they are, any
 * other adds the top's terms back and takes its own out. */
static inline T FN(otb_leave_one_out_top)(T nc, T dc, T vc, T g, T w, T v, T eps, FN(otb_top) top, int64_t c) {
    const T gw = g * w;
    const int own = (top.w[c] == w) & (top.gw[c] == gw);
    const T n = own ? nc : (nc + top.gw[c]) - gw, d = own ? dc : (dc + top.w[c]) - w;
    return FN(otb_loo_ratio)(n, d, vc, v, eps);
}

/* Leave-one-out advantages of one member row (scratch mv: width values): ar holds mₜWₜ on the valid span on entry
 * (anything elsewhere) and Aₜ on exit; Bₜmₜ into br (when given); columns c ≥ columns get B = 0. V (cnt): the
 * members valid at each column. */
static void FN(otb_row_final_loo)(const M *restrict mr, const T *restrict gr, T *restrict ar, int64_t width,
                                  const T *restrict num, const T *restrict den, const T *restrict cnt,
                                  int valid_token, int64_t col0, int64_t columns, T eps, T *restrict br,
                                  T *restrict mv, FN(otb_top) top) {
    int64_t lo, hi;
    FN(otb_row_mask)(mr, mv, width, &lo, &hi);
    FN(otb_outside)(gr, mv, 0, lo, ar, br);
    if (!valid_token) {
        int64_t stop = columns - col0;
        stop = stop < lo ? lo : (stop > hi ? hi : stop);
        const T *n = num + col0, *d = den + col0, *v = cnt + col0;
        if (top.w) {                                        /* FN(otb_leave_one_out_top), vectorised */
            const T *restrict tw = top.w + col0, *restrict tg = top.gw + col0;
            for (int64_t t = lo; t < stop; ++t) {
                const T w = ar[t], g = gr[t], gw = g * w;
                const int own = (tw[t] == w) & (tg[t] == gw);
                const T nt = own ? n[t] : (n[t] + tg[t]) - gw, dt = own ? d[t] : (d[t] + tw[t]) - w;
                const T b = FN(otb_loo_ratio)(nt, dt, v[t], mv[t] != 0 ? (T)1 : (T)0, eps);
                ar[t] = (g - b) * mv[t];
                if (br) br[t] = b * mv[t];
            }
        } else if (br) {
            for (int64_t t = lo; t < stop; ++t) {
                const T b = FN(otb_leave_one_out)(n[t], d[t], v[t], gr[t], ar[t], mv[t] != 0 ? (T)1 : (T)0, eps);
                ar[t] = (gr[t] - b) * mv[t];
                br[t] = b * mv[t];
            }
        } else {
            for (int64_t t = lo; t < stop; ++t) {
                const T b = FN(otb_leave_one_out)(n[t], d[t], v[t], gr[t], ar[t], mv[t] != 0 ? (T)1 : (T)0, eps);
                ar[t] = (gr[t] - b) * mv[t];
            }
        }
        FN(otb_outside)(gr, mv, stop, width, ar, br);
        return;
    }
    int64_t t = lo, c = col0;
    while (t < hi) {
        if (t + OTB_BLOCK <= hi) {
            const unsigned bits = NONZERO8(mv + t);
            const int all = bits == OTB_ALL, none = bits == 0;
            if (all && c + OTB_BLOCK <= columns) {       /* otb_leave_one_out(_top), 8 at a time */
                typedef FN(otb_tv8) tv8;
                const tv8 zero = {0}, one = zero + 1, g = FN(otb_load8)(gr + t), w = FN(otb_load8)(ar + t),
                          m8 = FN(otb_load8)(mv + t), gw = g * w;
                tv8 n = FN(otb_load8)(num + c), d = FN(otb_load8)(den + c);
                if (top.w) {
                    const tv8 top_w = FN(otb_load8)(top.w + c), top_gw = FN(otb_load8)(top.gw + c);
                    const FN(otb_fv8) own = (top_w == w) & (top_gw == gw);
                    n = FN(otb_select8)(own, n, (n + top_gw) - gw);
                    d = FN(otb_select8)(own, d, (d + top_w) - w);
                } else {
                    n = n - gw;
                    d = d - w;
                }
                const FN(otb_fv8) positive = ~(d <= 0);     /* the others' energy (a NaN stays NaN) */
                const tv8 ratio = n / FN(otb_select8)(positive, d + eps, one);
                const tv8 b = FN(otb_select8)((FN(otb_load8)(cnt + c) - one > 0) & positive, ratio, zero);
                FN(otb_store8)(ar + t, (g - b) * m8);
                if (br) FN(otb_store8)(br + t, b * m8);
                t += OTB_BLOCK;
                c += OTB_BLOCK;
                continue;
            }
            if (none) {
                FN(otb_outside)(gr, mv, t, t + OTB_BLOCK, ar, br);
                t += OTB_BLOCK;
                continue;
            }
        }
        T b = 0;
        if (mv[t] != 0) {
            if (c < columns)
                b = top.w ? FN(otb_leave_one_out_top)(num[c], den[c], cnt[c], gr[t], ar[t], (T)1, eps, top, c)
                          : FN(otb_leave_one_out)(num[c], den[c], cnt[c], gr[t], ar[t], (T)1, eps);
            ++c;
        }
        ar[t] = (gr[t] - b) * mv[t];
        if (br) br[t] = b * mv[t];
        ++t;
    }
    FN(otb_outside)(gr, mv, hi, width, ar, br);
}

/* Aligned by valid token, the members valid at column c are those longer than c: V_c = #{members: L > c}, from
 * hist[c] = #{members: L = c + 1} (added per member, summable across ranks) by a suffix sum, in place. */
static void FN(otb_lengths_to_counts)(T *restrict hist, int64_t columns) {
    for (int64_t c = columns - 2; c >= 0; --c) hist[c] += hist[c + 1];
}

/* Nonzero if a value of x[0 … count) is ±inf or NaN: a group's sums N and D (finite inputs whose products Gₜ·Wₜ or
 * their sums overflow; NaN from ∞ − ∞), or a leave-one-out row's advantages, whose N − GᵢWᵢ can leave the range where
 * N and D do not (returns of mixed signs), read while the row is in cache. The caller then checks the inputs, and
 * the outputs for ±inf/NaN. */
static int FN(otb_row_not_finite)(const T *restrict x, int64_t count) {
    FLAG outside = 0;
    for (int64_t t = 0; t < count; ++t) outside |= !((x[t] <= FINITE_MAX) & (x[t] >= -FINITE_MAX));
    return outside != 0;
}

/* B = N / (D + ε) over `count` columns, in place of N; 0 where the denominator is 0 */
static void FN(otb_ratio)(T *restrict num, const T *restrict den, int64_t count, T eps) {
    for (int64_t c = 0; c < count; ++c) {
        const T d = den[c] + eps;
        num[c] = d != 0 ? num[c] / d : (T)0;
    }
}

/* One process: groups first_group … last_group − 1 of the plan (order NULL: rows in plan order), each by this thread
 * from start to end. scratch holds 8·width values of T (the last 2: leave-one-out's FN(otb_top)). lengths[p]
 * receives the valid count of the row at plan position p. Returns nonzero if the value checks flag something (only
 * with `check`). */
OTB_EXPORT int FN(otb_groups)(const T *r, const M *m, const T *lp, const T *spp, const T *rho, int64_t width,
                              const int64_t *order, const int64_t *offsets, int64_t first_group, int64_t last_group,
                              int valid_token, int leave_one_out, int zero_tail, double epsilon, T *adv, T *ret,
                              T *base, T *lengths, T *scratch, int check, double slack_lp, double slack_spp) {
    T *mv = scratch, *pi = scratch + width, *energy = scratch + 2 * width, *num = scratch + 3 * width,
      *den = scratch + 4 * width, *cnt = scratch + 5 * width;
    const FN(otb_top) top = {leave_one_out ? scratch + 6 * width : 0, scratch + 7 * width};
    const T eps = (T)epsilon;
    int bad = 0;
    for (int64_t g = first_group; g < last_group; ++g) {
        const int64_t begin = offsets[g], end = offsets[g + 1], size = end - begin;
        if (size > 1) {
            memset(num, 0, (size_t)width * sizeof(T));
            memset(den, 0, (size_t)width * sizeof(T));
            if (leave_one_out) {
                memset(cnt, 0, (size_t)width * sizeof(T));
                memset(top.w, 0, 2 * (size_t)width * sizeof(T));       /* top.w, top.gw */
            }
        }
        for (int64_t p = begin; p < end; ++p) {
            const int64_t at = (order ? order[p] : p) * width;
            const int64_t next = p + 1 < offsets[last_group] ? (order ? order[p + 1] : p + 1) * width : -1;
            T *wm = leave_one_out ? adv + at : energy;         /* leave-one-out reads mₜWₜ again: kept in adv */
            otb_prefetch prefetch;
            OTB_PREFETCH_WM_OUTPUT(leave_one_out);
            lengths[p] = (T)FN(otb_row_first)(
                r + at, m + at, lp + at, spp + at, rho ? rho + at : 0, width, ret + at, wm, mv, pi,
                size > 1 ? num : 0, den, leave_one_out && !valid_token ? cnt : 0, valid_token, 0, width, 0.0, 0.0,
                size > 1, leave_one_out, check, (T)slack_lp, (T)slack_spp, &bad, 0,
                FN(otb_prefetch_row)(&prefetch, next, width, m, lp, r, spp, rho, ret, leave_one_out ? adv : 0),
                top);
            if (size == 1) {                                   /* a group of one: B = 0 */
                const T *gr = ret + at;
                const M *mr = m + at;
                T *ar = adv + at;
                for (int64_t t = 0; t < width; ++t) ar[t] = gr[t] * (T)mr[t];
                if (base) memset(base + at, 0, (size_t)width * sizeof(T));
            }
        }
        if (size == 1) continue;
        if (check) {
            bad |= FN(otb_row_not_finite)(num, width) | FN(otb_row_not_finite)(den, width);
            if (leave_one_out) bad |= FN(otb_row_not_finite)(top.gw, width) | FN(otb_row_not_finite)(top.w, width);
        }
        if (leave_one_out) {
            if (valid_token) {                                 /* V from the members' lengths */
                for (int64_t p = begin; p < end; ++p)
                    if (lengths[p] >= 1) cnt[(int64_t)lengths[p] - 1] += 1;
                FN(otb_lengths_to_counts)(cnt, width);
            }
            for (int64_t p = begin; p < end; ++p) {
                const int64_t at = (order ? order[p] : p) * width;
                FN(otb_row_final_loo)(m + at, ret + at, adv + at, width, num, den, cnt, valid_token, 0, width, eps,
                                      base ? base + at : 0, mv, top);
                if (check) bad |= FN(otb_row_not_finite)(adv + at, width);
            }
            continue;
        }
        FN(otb_ratio)(num, den, width, eps);
        /* the rules that zero one member's baseline from aligned token `start` on: the unique longest member from
         * the second-longest length (zero tail), and, aligned by valid token, the first longest member of a group
         * with < 2 non-empty members */
        int64_t zero_row = -1, zero_start = width;
        {
            T longest = lengths[begin], second = -1;
            int64_t first = begin, at_longest = 0, nonempty = 0;
            for (int64_t p = begin; p < end; ++p)
                if (lengths[p] > longest) { longest = lengths[p]; first = p; }
            for (int64_t p = begin; p < end; ++p) {
                at_longest += lengths[p] == longest;
                nonempty += lengths[p] > 0;
                if (lengths[p] != longest && lengths[p] > second) second = lengths[p];
            }
            if (zero_tail && at_longest == 1) { zero_row = first; zero_start = (int64_t)second; }
            if (valid_token && nonempty < 2) { zero_row = first; zero_start = 0; }
        }
        for (int64_t p = begin; p < end; ++p) {
            const int64_t at = (order ? order[p] : p) * width;
            FN(otb_row_final_self)(m + at, ret + at, width, num, valid_token, 0, width,
                                   p == zero_row ? zero_start : width, adv + at, base ? base + at : 0, mv);
        }
    }
    return bad;
}

/* The distributed entry points take a rank's plan as (order, offsets): local group g's rows are order[offsets[g]] …
 * order[offsets[g + 1] − 1], in batch order, and group_ids[g] is its global id; a call computes local groups
 * first_group … last_group − 1, and visits their rows in batch order — rows[offsets[first_group]] …
 * rows[offsets[last_group] − 1] lists them so, row_group[b] is row b's local group — because the rows of a rank lie
 * anywhere and its passes run one after the other over all of them: in batch order, the memory streams of
 * consecutive rows run on, where group by group they restart at every row. (The order of a group's terms in its sums
 * is the same either way: its members in batch order.) */

#define OTB_GRID_ROW(id) (grid + (id) * planes * columns)
/* Leave-one-out across ranks: tops [G, 2, columns] holds, per global group, the rank's own FN(otb_top) (w, then gw);
 * NULL: plain sums. */
#define OTB_GROUP_TOP(id) \
    (tops ? (FN(otb_top)){tops + (id) * 2 * columns, tops + (id) * 2 * columns + columns} : (FN(otb_top)){0, 0})

/* One rank of a distributed batch, first sweep: each row's Gₜ into ret and mₜWₜ into wm (when given, else scratch:
 * 3·width values of T); lengths[b] receives row b's valid count. With the grid (data parallel), the row's terms are
 * added into grid[global id] = [N; D; V] (planes 2 or 3, each of `columns` K) at column t (position) or #valid before
 * t (valid token), and stats[k·G + id] = (members, longest, count at longest, second longest) of the local rows of
 * each group. Without it (context parallel), totals[b], totals[B + b], totals[2B + b] receive the row piece's Σmr,
 * Σw and Σm (double) for the other pieces' offsets (otb_dist_offsets adds the terms afterwards). With `nonnegative`
 * (leave-one-out, data parallel only: a context piece's W is whole after the offsets), the weights are
 * mₜ·max(Wₜ, 0). */
OTB_EXPORT int FN(otb_dist_first)(const T *r, const M *m, const T *lp, const T *spp, const T *rho, int64_t width,
                                  const int64_t *order, const int64_t *offsets, const int64_t *rows_in_order,
                                  const int64_t *row_group, int64_t first_group, int64_t last_group,
                                  const int64_t *group_ids, T *grid, int64_t columns, int planes, int valid_token,
                                  int64_t num_groups, T *ret, T *wm, int64_t *lengths, int64_t *stats,
                                  double *totals, int64_t rows, T *scratch, int check, double slack_lp,
                                  double slack_spp, int nonnegative, T *tops) {
    T *mv = scratch, *pi = scratch + width, *energy = scratch + 2 * width;
    int bad = 0;
    for (int64_t p = offsets[first_group]; p < offsets[last_group]; ++p) {
        const int64_t row = rows_in_order[p], at = row * width;
        const int64_t next = p + 1 < offsets[last_group] ? rows_in_order[p + 1] * width : -1;
        T *num = grid ? OTB_GRID_ROW(group_ids[row_group[row]]) : 0, *den = num ? num + columns : 0;
        T *cnt = num && planes > 2 && !valid_token ? num + 2 * columns : 0;
        double sums[2];
        otb_prefetch prefetch;
        OTB_PREFETCH_WM_OUTPUT(wm != 0);
        lengths[row] = FN(otb_row_first)(
            r + at, m + at, lp + at, spp + at, rho ? rho + at : 0, width, ret + at, wm ? wm + at : energy, mv, pi,
            num, den, cnt, valid_token, 0, columns, 0.0, 0.0, 1, nonnegative, check, (T)slack_lp, (T)slack_spp, &bad,
            sums,
            FN(otb_prefetch_row)(&prefetch, next, width, m, lp, r, spp, rho, ret, wm),
            num ? OTB_GROUP_TOP(group_ids[row_group[row]]) : (FN(otb_top)){0, 0});
        if (totals) {
            totals[row] = sums[0];
            totals[rows + row] = sums[1];
            totals[2 * rows + row] = (double)lengths[row];
        }
    }
    if (grid) {
        for (int64_t g = first_group; g < last_group; ++g) {
            T *num = OTB_GRID_ROW(group_ids[g]);
            FN(otb_group_statistics)(order, offsets[g], offsets[g + 1], lengths, 0, valid_token, group_ids[g],
                                     num_groups, stats, planes > 2 && valid_token ? num + 2 * columns : 0, columns);
        }
    }
    return bad;
}

/* Context parallel, after the other pieces' totals: each row's returns (ret) and energies (wm, from the first sweep)
 * get the offsets of the other pieces — Gₜ += ret_offsets[b] (the later pieces' rewards), mₜWₜ += mₜ·energy_offsets[b]
 * (the earlier pieces' energy) — and its terms are added into grid[global id] at columns col0 + t (position) or
 * col_offsets[b] + #valid before t (valid token), less `origin`: the grid's first column (0 for a grid of all K
 * columns; by position a piece whose grid is its own columns alone passes origin = col0); with count_rows (the first
 * piece of its rows, or every piece where each holds every row), the group statistics from total_lengths. With
 * `nonnegative` (leave-one-out), the whole energies become the weights mₜ·max(Wₜ, 0) first. scratch: width values of
 * T. */
OTB_EXPORT void FN(otb_dist_offsets)(const M *m, int64_t width, const int64_t *order, const int64_t *offsets,
                                     const int64_t *rows_in_order, const int64_t *row_group, int64_t first_group,
                                     int64_t last_group, const int64_t *group_ids, T *grid, int64_t columns,
                                     int planes, int valid_token, const double *ret_offsets,
                                     const double *energy_offsets, const int64_t *col_offsets, int64_t col0,
                                     int64_t origin, const int64_t *total_lengths, int count_rows,
                                     int64_t num_groups, T *ret, T *wm, int64_t *stats, int nonnegative,
                                     T *tops, T *scratch) {
    T *mv = scratch;
    for (int64_t p = offsets[first_group]; p < offsets[last_group]; ++p) {
        const int64_t row = rows_in_order[p], at = row * width;
        T *num = OTB_GRID_ROW(group_ids[row_group[row]]), *den = num + columns;
        T *cnt = planes > 2 && !valid_token ? num + 2 * columns : 0;
        T *gr = ret + at, *wr = wm + at;
        int64_t lo, hi;
        FN(otb_row_mask)(m + at, mv, width, &lo, &hi);
        const T later = (T)ret_offsets[row], earlier = (T)energy_offsets[row];
        for (int64_t t = 0; t < width; ++t) gr[t] = gr[t] + later;
        for (int64_t t = lo; t < hi; ++t) wr[t] = wr[t] + earlier * mv[t];
        if (nonnegative) FN(otb_nonnegative)(wr, lo, hi);
        FN(otb_row_accumulate)(gr, wr, mv, lo, hi, num, den, cnt, valid_token,
                               (valid_token ? col_offsets[row] : col0) - origin, columns,
                               OTB_GROUP_TOP(group_ids[row_group[row]]));
    }
    if (!count_rows) return;
    for (int64_t g = first_group; g < last_group; ++g) {
        T *num = OTB_GRID_ROW(group_ids[g]);
        FN(otb_group_statistics)(order, offsets[g], offsets[g + 1], total_lengths, total_lengths, valid_token,
                                 group_ids[g], num_groups, stats, planes > 2 && valid_token ? num + 2 * columns : 0,
                                 columns);
    }
}

/* Leave-one-out across ranks, around the grid's SUM all-reduce. The first sweep left each cell's top member on the
 * rank out of N and D (tops [G, 2, columns]: w, then gw; FN(otb_top)). Before the sum (otb_dist_tops_in): rest
 * [G, 2, columns] ← (N, D), and N += gw, D += w — the rank's whole sums go out. After it (otb_dist_tops_out): N and D
 * of every cell become the sums without the rank's top there, N − gw and D − w (≥ D/4 while w ≤ ¾D; `share` is ¾,
 * otb_spec.tolerances.DOMINANT_SHARE), except where that member dominates, w > share·D (at most one member per cell
 * over all ranks): with `peer` (over two ranks, the other rank's [G, planes, columns] sums as the exchange brought
 * them) the others' sums added directly, rest + peer; without it, left as they are and flagged in owned[g·columns + c]
 * for the caller's exchange. Returns the count of such cells of the rank. One pass over the cells; grid [G, planes,
 * columns]. */
OTB_EXPORT void FN(otb_dist_tops_in)(T *grid, const T *tops, T *rest, int64_t groups, int planes, int64_t columns) {
    for (int64_t g = 0; g < groups; ++g) {
        T *restrict n = grid + g * planes * columns, *restrict d = n + columns;
        T *restrict rn = rest + g * 2 * columns, *restrict rd = rn + columns;
        const T *restrict w = tops + g * 2 * columns, *restrict gw = w + columns;
        for (int64_t c = 0; c < columns; ++c) {
            rn[c] = n[c];
            rd[c] = d[c];
            n[c] = n[c] + gw[c];
            d[c] = d[c] + w[c];
        }
    }
}

OTB_EXPORT int64_t FN(otb_dist_tops_out)(T *grid, const T *tops, const T *rest, const T *peer, int64_t groups,
                                         int planes, int64_t columns, double share, unsigned char *owned) {
    int64_t count = 0;
    for (int64_t g = 0; g < groups; ++g) {
        T *restrict n = grid + g * planes * columns, *restrict d = n + columns;
        const T *restrict rn = rest + g * 2 * columns, *restrict rd = rn + columns;
        const T *restrict w = tops + g * 2 * columns, *restrict gw = w + columns;
        const T *restrict pn = peer ? peer + g * planes * columns : 0, *restrict pd = pn ? pn + columns : 0;
        unsigned char *restrict flag = owned ? owned + g * columns : 0;
        for (int64_t c = 0; c < columns; ++c) {
            const int dominant = w[c] > (T)share * d[c];
            count += dominant;
            if (flag) flag[c] = (unsigned char)dominant;
            if (!dominant) {
                n[c] = n[c] - gw[c];
                d[c] = d[c] - w[c];
            } else if (pn) {
                n[c] = rn[c] + pn[c];
                d[c] = rd[c] + pd[c];
            }
        }
    }
    return count;
}

/* One rank, after the grid's SUM all-reduce: B and A of the rows of local groups first_group … last_group − 1.
 * First each of these groups' grid row: self-inclusive, N becomes N/(D + ε) in place; leave-one-out by valid token,
 * the length histogram becomes V. Then each row: self-inclusive, B = 0 from the column otb_zero_from finds in the
 * ranks' [ranks, 4, G] group statistics `stats` (all ranks' rows; the row's total length from total_lengths);
 * leave-one-out, mₜWₜ of the first sweep is read from adv and overwritten. The grid holds `columns` columns from
 * global column `origin` (as otb_dist_offsets; the zero rule's column is global). scratch: width values of T. */
OTB_EXPORT void FN(otb_dist_final)(const M *m, int64_t width, const int64_t *offsets, const int64_t *rows_in_order,
                                   const int64_t *row_group, int64_t first_group, int64_t last_group,
                                   const int64_t *group_ids, T *grid, int64_t columns, int planes, int valid_token,
                                   int leave_one_out, int zero_tail, double epsilon, const int64_t *stats,
                                   int64_t ranks, int64_t num_groups, const int64_t *total_lengths,
                                   const int64_t *col_offsets, int64_t col0, int64_t origin, const T *ret,
                                   T *adv, T *base, T *tops, T *scratch) {
    const T eps = (T)epsilon;
    for (int64_t g = first_group; g < last_group; ++g) {
        T *num = OTB_GRID_ROW(group_ids[g]);
        if (!leave_one_out) FN(otb_ratio)(num, num + columns, columns, eps);
        else if (valid_token) FN(otb_lengths_to_counts)(num + 2 * columns, columns);
    }
    for (int64_t p = offsets[first_group]; p < offsets[last_group]; ++p) {
        const int64_t row = rows_in_order[p], at = row * width, id = group_ids[row_group[row]];
        T *num = OTB_GRID_ROW(id);
        const int64_t start_column = (valid_token && col_offsets ? col_offsets[row] : col0) - origin;
        if (leave_one_out) {
            FN(otb_row_final_loo)(m + at, ret + at, adv + at, width, num, num + columns, num + 2 * columns,
                                  valid_token, start_column, columns, eps, base ? base + at : 0, scratch,
                                  OTB_GROUP_TOP(id));
            continue;
        }
        const int64_t start = otb_zero_from(stats, ranks, num_groups, id, zero_tail, total_lengths[row],
                                            origin + columns) - origin;
        FN(otb_row_final_self)(m + at, ret + at, width, num, valid_token, start_column, columns, start, adv + at,
                               base ? base + at : 0, scratch);
    }
}

#undef OTB_GRID_ROW
#undef OTB_GROUP_TOP

#endif
