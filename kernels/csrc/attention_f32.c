/* Decode/verify attention over the KV cache in place, float32, x86-64 AVX2 + FMA: the CPU
 * counterpart of kernels/attention.py (same contract), batch-invariant by construction.
 *
 * Built and loaded by kernels/cpu_build.py, called by kernels/attention_cpu.py. Query token t
 * (query heads h of kv head h / group) attends to keys 0 .. pos[t] of its own cache row rows[t],
 * read where they sit. One task per (token, kv head); per query head, in this fixed order:
 *   1. scores s_j = dot(q, k_j) * scale for j = 0 .. pos[t]: eight FMA lanes over d in order,
 *      then the horizontal sum ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
 *   2. m = max_j s_j; e_j = exp(s_j - m) (Cephes' expf polynomial, vectorised, the same
 *      arithmetic for every lane); l = the e_j summed in eight lanes over j in order (lanes past
 *      pos[t] add zero), then the horizontal sum above;
 *   3. o = (sum_j e_j v_j, one FMA per key in key order) * (1 / l).
 * The query heads of one kv head (up to GMAX at a time) share each pass over the keys and the
 * values: a key or value row is loaded once and feeds every head's own accumulators, which
 * changes which sums share registers, never the order of one head's sums (grouped-query
 * attention reads a third of the bytes it did one head at a time, session 9).
 * Nothing depends on other tokens, the number of tokens a row feeds this step, the cache
 * capacity or keys past pos[t]: a token's output has the same bits whatever shares the step
 * (two-pass softmax instead of the Triton kernel's online one: on a CPU the scores of a row fit
 * in cache, and each exp is taken once).
 */
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GMAX 3 /* query heads per pass over a kv head's keys and values */

/* scores of G <= GMAX query heads q[g] (D floats each) with keys k_0 .. k_{nk-1} (row stride
 * ldk) into s[g * lds + j]; D a multiple of 8. KB keys at a time (G * KB independent chains,
 * within AVX2's 16 registers); each key's sum the same ops whatever G, KB and nk. With KB 4,
 * the four sums of a head share the horizontal adds (hsum8_x4: hsum8's bits); that and the
 * vector max in softmax_numerators cut a batch-1 verify token's attention from ~0.40 to ~0.29
 * ms (30 layers of SmolLM2-135M at 600 cached tokens, float16 cache, session 12). */
/* eight cache elements from element index i of a float32 (F16 0) or float16 (F16 1) cache:
 * float16 values widen to float32 exactly, so the arithmetic after the load is the same */
static inline __attribute__((always_inline)) __m256 kv_load(int F16, const void *c, int64_t i) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)));
    return _mm256_loadu_ps((const float *)c + i);
}

static inline __attribute__((always_inline)) void scores(
        int G, int KB, int F16, const float *const *q, const void *k, int64_t ldk, int64_t nk,
        int64_t D, float scale, float *s, int64_t lds) {
    int64_t j = 0;
    for (; j + KB <= nk; j += KB) {
        const int64_t k0 = j * ldk;
        __m256 a[GMAX][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < KB; u++) a[g][u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kv[4];
            for (int u = 0; u < KB; u++) kv[u] = kv_load(F16, k, k0 + u * ldk + d);
            for (int g = 0; g < G; g++) {
                const __m256 qv = _mm256_loadu_ps(q[g] + d);
                for (int u = 0; u < KB; u++) a[g][u] = _mm256_fmadd_ps(qv, kv[u], a[g][u]);
            }
        }
        if (KB == 4) { /* the same sums, four keys' lanes per instruction */
            const __m128 sc = _mm_set1_ps(scale);
            for (int g = 0; g < G; g++)
                _mm_storeu_ps(s + g * lds + j,
                              _mm_mul_ps(hsum8_x4(a[g][0], a[g][1], a[g][2], a[g][3]), sc));
        } else {
            for (int g = 0; g < G; g++)
                for (int u = 0; u < KB; u++) s[g * lds + j + u] = hsum8(a[g][u]) * scale;
        }
    }
    for (; j < nk; j++)
        for (int g = 0; g < G; g++) {
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv_load(F16, k, j * ldk + d), a0);
            s[g * lds + j] = hsum8(a0) * scale;
        }
}

/* s_j <- exp(s_j - max), returns their sum */
static float softmax_numerators(float *s, int64_t n) {
    /* the max is exact in any order (a NaN score makes the row's outputs NaN either way) */
    float m = s[0];
    int64_t j = 0;
    if (n >= 8) {
        __m256 mx = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < n) {
        __m256i mask = _mm256_loadu_si256((const __m256i *)(TAIL_MASK + 8 - (n - j)));
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), mv));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(s + j, mask, e);
        acc = _mm256_add_ps(acc, e);
    }
    return hsum8(acc);
}

#define MAX_D 256
#define SLICE 32 /* output dims per pass over the values: G * 4 accumulators */

/* G <= GMAX query heads of one kv head: o[g] = softmax(q[g] k^T * scale) v over keys 0 .. n-1;
 * s: G * n floats of scratch. Inlined with G and D constants for the common shapes, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_group(
        int G, int F16, const float *const *q, const void *k, const void *v, int64_t ldc,
        int64_t n, int64_t D, float scale, float *s, float *const *out) {
    scores(G, 4, F16, q, k, ldc, n, D, scale, s, n);
    float inv[GMAX];
    for (int g = 0; g < G; g++) inv[g] = 1.0f / softmax_numerators(s + g * n, n);
    for (int64_t d0 = 0; d0 < D; d0 += SLICE) { /* each value row's slice is read once */
        const int w = (int)((D - d0 < SLICE ? D - d0 : SLICE) / 8);
        __m256 acc[GMAX][SLICE / 8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < w; c++) acc[g][c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const int64_t vj = j * ldc + d0;
            for (int c = 0; c < w; c++) {
                const __m256 vv = kv_load(F16, v, vj + 8 * c);
                for (int g = 0; g < G; g++)
                    acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[g * n + j]), vv, acc[g][c]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 iv = _mm256_set1_ps(inv[g]);
            for (int c = 0; c < w; c++)
                _mm256_storeu_ps(out[g] + d0 + 8 * c, _mm256_mul_ps(acc[g][c], iv));
        }
    }
}

/* attend_group with G and D constants where they are common */
#define ATTEND_HEADS(F16)                                                                   \
    static void attend_heads_##F16(int G, const float *const *q, const void *k,             \
                                   const void *v, int64_t ldc, int64_t n, int64_t D,         \
                                   float scale, float *s, float *const *out) {               \
        if (G == 3 && D == 64) attend_group(3, F16, q, k, v, ldc, n, 64, scale, s, out);     \
        else if (G == 2 && D == 64) attend_group(2, F16, q, k, v, ldc, n, 64, scale, s, out); \
        else if (G == 1 && D == 64) attend_group(1, F16, q, k, v, ldc, n, 64, scale, s, out); \
        else if (G == 3 && D == 128) attend_group(3, F16, q, k, v, ldc, n, 128, scale, s, out); \
        else if (G == 2 && D == 128) attend_group(2, F16, q, k, v, ldc, n, 128, scale, s, out); \
        else if (G == 1 && D == 128) attend_group(1, F16, q, k, v, ldc, n, 128, scale, s, out); \
        else if (G == 3) attend_group(3, F16, q, k, v, ldc, n, D, scale, s, out);            \
        else if (G == 2) attend_group(2, F16, q, k, v, ldc, n, D, scale, s, out);            \
        else attend_group(1, F16, q, k, v, ldc, n, D, scale, s, out);                        \
    }
ATTEND_HEADS(0)
ATTEND_HEADS(1)

/* q: [T, H, D] (strides s_qt, s_qh; d contiguous); caches: [R, Hkv, C, D] (strides s_cr, s_ch,
 * s_cc, in elements; d contiguous), float32, or float16 with kv_f16 (widened exactly on load:
 * the same arithmetic on the stored values); rows, pos: [T]; o: [T, H, D] (strides s_ot,
 * s_oh). D a multiple of 8, <= MAX_D. Returns 0, or -1 if a scratch allocation failed (o then
 * undefined). */
int sb_attention_f32(const float *q, int64_t s_qt, int64_t s_qh, const void *kc,
                     const void *vc, int64_t s_cr, int64_t s_ch, int64_t s_cc,
                     const int64_t *rows, const int64_t *pos, float *o, int64_t s_ot,
                     int64_t s_oh, int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale,
                     int kv_f16) {
    const int64_t esize = kv_f16 ? 2 : 4;
    const int64_t group = H / Hkv;
    int failed = 0;
    /* tasks round-robin over the threads: a prefill's tokens read 1 .. n keys each, so
     * contiguous halves would leave one thread the long half (the schedule changes no bits) */
#pragma omp parallel for collapse(2) schedule(static, 1) reduction(| : failed)
    for (int64_t t = 0; t < T; t++)
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t n = pos[t] + 1;
            const int64_t G = group < GMAX ? group : GMAX;
            float *s = malloc(sizeof(float) * (size_t)(n * G));
            if (s == NULL) {
                failed = 1;
                continue;
            }
            const int64_t at = (rows[t] * s_cr + hk * s_ch) * esize;
            const void *k = (const char *)kc + at, *v = (const char *)vc + at;
            for (int64_t h0 = hk * group; h0 < (hk + 1) * group; h0 += GMAX) {
                const int g = (int)((hk + 1) * group - h0 < GMAX ? (hk + 1) * group - h0 : GMAX);
                const float *qh[GMAX];
                float *oh[GMAX];
                for (int i = 0; i < g; i++) {
                    qh[i] = q + t * s_qt + (h0 + i) * s_qh;
                    oh[i] = o + t * s_ot + (h0 + i) * s_oh;
                }
                if (kv_f16)
                    attend_heads_1(g, qh, k, v, s_cc, n, D, scale, s, oh);
                else
                    attend_heads_0(g, qh, k, v, s_cc, n, D, scale, s, oh);
            }
            free(s);
        }
    return failed ? -1 : 0;
}
