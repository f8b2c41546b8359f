/*
 * Self-inclusive OTB on the CPU in one sweep per group: the native kernel of otb_torch (see _native.py).
 *
 * The math is the reference's (otb_spec.otb, arXiv 2602.07078, §3); this file only fuses it. For each group g of
 * members i (rows order[offsets[g]] … order[offsets[g+1] − 1] of a row-major [B, T] batch, any row order):
 *
 *   Gᵢₜ = Σ_{k≥t} mᵢₖ rᵢₖ                                   (returns; written to `ret`)
 *   wᵢₜ = mᵢₜ (1 − 2πᵢₜ + Σπ²ᵢₜ) ρᵢₜ²,  πᵢₜ = exp(min(log πᵢₜ, 0))
 *   Wᵢₜ = Σ_{j≤t} wᵢⱼ
 *   B_c = Σᵢ Gᵢₜ Wᵢₜ mᵢₜ / (Σᵢ Wᵢₜ mᵢₜ + ε)  over the tokens t of column c, 0 where the denominator is 0
 *   Aᵢₜ = mᵢₜ (Gᵢₜ − B_c(t))                                  (written to `adv`; mᵢₜ B_c(t) to `base`)
 *
 * with column c(t) = t (align by position, verl's single-turn) or the number of valid tokens before t (align by
 * valid token, verl's multi-turn; masked positions get B = 0). Groups of one member get B = 0, and so does one member
 * of a group from some token on by the reference's rules (zero tail, < 2 non-empty members; see below). `lengths`
 * receives each row's number of valid tokens, at its place in the plan's order.
 *
 * Scans accumulate in double and round each output once (what torch's CPU cumsum does); everything else is in the
 * compute type T (float or double), in the order of the eager kernel (otb_torch._core.grouped_otb). With `check`,
 * the return value is nonzero if any input may break a value rule of the reference: non-finite values anywhere, a
 * mask outside {0, 1}, or at valid positions log π > slack, Σπ² outside [−slack, 1 + slack], π² − Σπ² above its
 * slack, ρ < 0 — with the caller's own rules for integer token statistics (no slack; π² may underflow) a superset
 * of what the reference rejects, so the caller runs the exact check only when it is set. Without `check` (the hot
 * path), inputs the reference rejects give undefined results: NaN at a masked position outside a row's valid span
 * is skipped, inside it spreads, and a non-binary mask is read as "valid where nonzero" for the counts.
 *
 * No OpenMP (it would meet torch's own runtime in the process): the caller splits the groups over threads, and
 * ctypes releases the GIL for the call. Built for the baseline of the architecture (SSE2 on x86-64), or with -mavx2
 * where torch reports AVX2 on the machine (the loader chooses before it compiles), and with
 * -ffp-contract=off, so no multiply–add is fused behind the code's back.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define OTB_EXPORT __attribute__((visibility("default")))

/* exp(x) for x ≤ 0 in float, a vector at a time with the compiler's vector extensions (auto-vectorisation of the
 * selects below is not dependable; 8 lanes with AVX2, else 4, which every x86-64 and ARM64 has): 2ⁿ·exp(r) with n = round(x/ln 2), r = x − n ln 2 (Cody–Waite, ln 2 split so
 * that n·ln2_hi is exact), |r| ≤ ln 2/2, and Taylor's polynomial of degree 7 by Estrin's scheme (truncation below 5.3e-9 relative,
 * under half an ulp; measured relative error ≤ 1.46 ε on a grid of 2·10⁷ points); x ≤ −87 (results below 1.7e-38) gives 0, NaN gives NaN, x > 0 is
 * read as 0. */
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

/* out[t] = exp(min(x[t], 0)), t < count */
static void otb_exp_row_float(const float *x, float *out, int64_t count) {
    int64_t t = 0;
    for (; t + 2 * OTB_LANES <= count; t += 2 * OTB_LANES) {   /* two vectors per step: independent work overlaps */
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

static void otb_exp_row_double(const double *x, double *out, int64_t count) {
    for (int64_t t = 0; t < count; ++t) out[t] = x[t] > 0 ? 1.0 : exp(x[t]);
}

/* One entry point per compute type T (float, double) and mask type M; scratch holds 5·width values of T. */
#define OTB_DEFINE(NAME, T, M, EXP_ROW, FINITE_MAX)                                                                 \
static int NAME##_check_row(const T *r, const M *m, const T *mv, const T *lp, const T *spp, const T *pi,            \
                            const T *rho,                                                                            \
                            int64_t width, int64_t lo, int64_t hi, T slack_lp, T slack_spp) {                       \
    int bad = 0;                                                                                                     \
    const T own_slack = (slack_spp + 2 * slack_lp) * (T)0.999;  /* margin: π² is computed, the rest compared */    \
    for (int64_t t = 0; t < width; ++t) {                                                                            \
        const int valid = mv[t] != 0;                                                                                \
        bad |= !((r[t] <= FINITE_MAX) & (r[t] >= -FINITE_MAX));                                                      \
        bad |= !((lp[t] <= FINITE_MAX) & (lp[t] >= -FINITE_MAX));                                                   \
        bad |= !((spp[t] <= FINITE_MAX) & (spp[t] >= -FINITE_MAX));                                                  \
        bad |= (m[t] != 0) & (m[t] != 1);                      /* in the mask's own type, before any rounding */   \
        bad |= valid & (lp[t] > slack_lp);                                                                           \
        bad |= valid & ((spp[t] < -slack_spp) | (spp[t] > 1 + slack_spp));                                          \
    }                                                                                                                \
    for (int64_t t = lo; t < hi; ++t)                          /* π is computed on the valid span only */           \
        bad |= (mv[t] != 0) & (pi[t] * pi[t] - spp[t] > own_slack);                                                  \
    if (rho) {                                                                                                       \
        for (int64_t t = 0; t < width; ++t)                                                                          \
            bad |= !((rho[t] <= FINITE_MAX) & (rho[t] >= 0));                                                        \
    }                                                                                                                \
    return bad;                                                                                                      \
}                                                                                                                    \
                                                                                                                     \
OTB_EXPORT int NAME(const T *r, const M *m, const T *lp, const T *spp, const T *rho, int64_t width,                 \
                    const int64_t *order, const int64_t *offsets, int64_t first_group, int64_t last_group,           \
                    int valid_token, int zero_tail, double epsilon, T *adv, T *ret, T *base, T *lengths, T *scratch,\
                    int check,                                                                                       \
                    double slack_lp, double slack_spp) {                                                            \
    T *energy = scratch, *num = scratch + width, *den = scratch + 2 * width, *mv = scratch + 3 * width,              \
      *pi = scratch + 4 * width;                                                                                     \
    const T eps = (T)epsilon;                                                                                        \
    int bad = 0;                                                                                                     \
    for (int64_t g = first_group; g < last_group; ++g) {                                                             \
        const int64_t begin = offsets[g], end = offsets[g + 1], size = end - begin;                                  \
        if (size > 1) {                                                                                              \
            memset(num, 0, (size_t)width * sizeof(T));                                                               \
            memset(den, 0, (size_t)width * sizeof(T));                                                               \
        }                                                                                                            \
        for (int64_t p = begin; p < end; ++p) {                                                                      \
            const int64_t at = (order ? order[p] : p) * width;                                                       \
            const T *rr = r + at, *lr = lp + at, *sr = spp + at, *wr = rho ? rho + at : 0;                           \
            const M *mr = m + at;                                                                                    \
            T *gr = ret + at;                                                                                        \
            for (int64_t t = 0; t < width; ++t) mv[t] = (T)mr[t];                                                    \
            int64_t valid = 0;                                                                                       \
            for (int64_t t = 0; t < width; ++t) valid += mv[t] != 0;                                                 \
            lengths[p] = (T)valid;                                                                                   \
            /* the valid span [lo, hi): outside it m = 0, so Gₜ is the row total before it and 0 after it, and   */ \
            /* mₜWₜ = 0 — the scans and the exponential run on the span only (right padding is most of a batch) */ \
            int64_t lo = 0, hi = width;                                                                              \
            while (lo < width && mv[lo] == 0) ++lo;                                                                  \
            while (hi > lo && mv[hi - 1] == 0) --hi;                                                                 \
            if (check || size > 1) EXP_ROW(lr + lo, pi + lo, hi - lo);                                               \
            if (check) bad |= NAME##_check_row(rr, mr, mv, lr, sr, pi, wr, width, lo, hi, (T)slack_lp, (T)slack_spp);   \
            double total = 0, running = 0;                                                                           \
            if (size == 1) {                                                                                         \
                for (int64_t t = hi - 1; t >= lo; --t) {                                                             \
                    total += (double)(rr[t] * mv[t]);                                                                \
                    gr[t] = (T)total;                                                                                \
                }                                                                                                    \
            } else {                                                                                                 \
                for (int64_t t = lo; t < hi; ++t)              /* mₜ(1 − 2πₜ + Σπ²ₜ) */                              \
                    energy[t] = mv[t] + mv[t] * (sr[t] - 2 * pi[t]);                                                 \
                if (wr) for (int64_t t = lo; t < hi; ++t) energy[t] = energy[t] * wr[t] * wr[t];                     \
                /* the two scans in one loop, Gₜ from the end, mₜWₜ from the start: independent chains overlap */  \
                for (int64_t t = lo, s = hi - 1; t < hi; ++t, --s) {                                                 \
                    total += (double)(rr[s] * mv[s]);                                                                \
                    gr[s] = (T)total;                                                                                \
                    running += (double)energy[t];                                                                    \
                    energy[t] = (T)running * mv[t];                                                                  \
                }                                                                                                    \
            }                                                                                                        \
            for (int64_t t = 0; t < lo; ++t) gr[t] = (T)total;                                                       \
            for (int64_t t = hi; t < width; ++t) gr[t] = 0;                                                          \
            if (check) bad |= !((total <= FINITE_MAX) & (total >= -FINITE_MAX));                                     \
            if (size == 1) {                                                                                         \
                T *ar = adv + at;                                                                                    \
                for (int64_t t = 0; t < width; ++t) ar[t] = gr[t] * mv[t];                                           \
                if (base) memset(base + at, 0, (size_t)width * sizeof(T));                                           \
                continue;                                                                                            \
            }                                                                                                        \
            if (!valid_token) {                                                                                      \
                for (int64_t t = lo; t < hi; ++t) {                                                                  \
                    num[t] += gr[t] * energy[t];                                                                     \
                    den[t] += energy[t];                                                                             \
                }                                                                                                    \
            } else {                                                                                                 \
                int64_t column = 0;                                                                                  \
                for (int64_t t = lo; t < hi; ++t) {                                                                  \
                    if (mv[t] != 0) {                                                                                \
                        num[column] += gr[t] * energy[t];                                                            \
                        den[column] += energy[t];                                                                    \
                        ++column;                                                                                    \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        if (size == 1) continue;                                                                                     \
        for (int64_t t = 0; t < width; ++t) {                  /* B, 0 where the denominator is 0 */                 \
            const T d = den[t] + eps;                                                                                \
            num[t] = d != 0 ? num[t] / d : (T)0;                                                                     \
        }                                                                                                            \
        /* the rules that zero one member's baseline from aligned token `start` on (otb_spec.otb; as           */   \
        /* otb_torch._core.zero_rule_fix): the unique longest member from the second-longest length (zero      */   \
        /* tail), and, aligned by valid token, the first longest member of a group with < 2 non-empty members */   \
        int64_t zero_row = -1, zero_start = width;                                                                   \
        {                                                                                                            \
            T longest = lengths[begin], second = -1;                                                                 \
            int64_t first = begin, at_longest = 0, nonempty = 0;                                                     \
            for (int64_t p = begin; p < end; ++p)                                                                    \
                if (lengths[p] > longest) { longest = lengths[p]; first = p; }                                       \
            for (int64_t p = begin; p < end; ++p) {                                                                  \
                at_longest += lengths[p] == longest;                                                                 \
                nonempty += lengths[p] > 0;                                                                          \
                if (lengths[p] != longest && lengths[p] > second) second = lengths[p];                              \
            }                                                                                                        \
            if (zero_tail && at_longest == 1) { zero_row = first; zero_start = (int64_t)second; }                    \
            if (valid_token && nonempty < 2) { zero_row = first; zero_start = 0; }                                   \
        }                                                                                                            \
        for (int64_t p = begin; p < end; ++p) {                                                                      \
            const int64_t at = (order ? order[p] : p) * width;                                                       \
            const M *mr = m + at;                                                                                    \
            const T *gr = ret + at;                                                                                  \
            T *ar = adv + at, *br = base ? base + at : 0;                                                            \
            const int64_t start = p == zero_row ? zero_start : width;                                               \
            if (!valid_token && start == width) {                                                                    \
                for (int64_t t = 0; t < width; ++t) ar[t] = (gr[t] - num[t]) * (T)mr[t];                             \
                if (br) for (int64_t t = 0; t < width; ++t) br[t] = num[t] * (T)mr[t];                               \
            } else if (!valid_token) {                                                                               \
                for (int64_t t = 0; t < width; ++t) {                                                                \
                    const T b = t < start ? num[t] : (T)0;                                                           \
                    ar[t] = (gr[t] - b) * (T)mr[t];                                                                  \
                    if (br) br[t] = b * (T)mr[t];                                                                    \
                }                                                                                                    \
            } else {                                                                                                 \
                int64_t column = 0;                                                                                  \
                for (int64_t t = 0; t < width; ++t) {                                                                \
                    const T b = mr[t] != 0 ? (column < start ? num[column] : (T)0) : (T)0;                           \
                    column += mr[t] != 0;                                                                            \
                    ar[t] = (gr[t] - b) * (T)mr[t];                                                                  \
                    if (br) br[t] = b * (T)mr[t];                                                                    \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    return bad;                                                                                                      \
}

#define OTB_DEFINE_MASKS(PREFIX, T, EXP_ROW, FINITE_MAX)                                                             \
    OTB_DEFINE(PREFIX##_bool, T, uint8_t, EXP_ROW, FINITE_MAX)                                                       \
    OTB_DEFINE(PREFIX##_int32, T, int32_t, EXP_ROW, FINITE_MAX)                                                      \
    OTB_DEFINE(PREFIX##_int64, T, int64_t, EXP_ROW, FINITE_MAX)                                                      \
    OTB_DEFINE(PREFIX##_float32, T, float, EXP_ROW, FINITE_MAX)                                                      \
    OTB_DEFINE(PREFIX##_float64, T, double, EXP_ROW, FINITE_MAX)

OTB_DEFINE_MASKS(otb_float32, float, otb_exp_row_float, 3.40282346638528859812e+38f)
OTB_DEFINE_MASKS(otb_float64, double, otb_exp_row_double, 1.79769313486231570815e+308)

/* The exponential the float32 kernel uses, exported for the accuracy test. */
OTB_EXPORT void otb_expf_array(const float *x, float *out, int64_t count) { otb_exp_row_float(x, out, count); }
