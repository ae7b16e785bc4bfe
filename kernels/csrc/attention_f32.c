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
 * Nothing depends on other tokens, the number of tokens a row feeds this step, the cache
 * capacity or keys past pos[t]: a token's output has the same bits whatever shares the step
 * (two-pass softmax instead of the Triton kernel's online one: on a CPU the scores of a row fit
 * in cache, and each exp is taken once).
 */
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* dot products of q (D floats) with keys k_0 .. k_{nk-1} (row stride ldk), D a multiple of 8;
 * four keys at a time (independent chains), each key's sum the same ops whatever nk */
static void scores(const float *q, const float *k, int64_t ldk, int64_t nk, int64_t D,
                   float scale, float *s) {
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k + j * ldk;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ldk + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ldk + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ldk + d), a3);
        }
        s[j] = hsum8(a0) * scale;
        s[j + 1] = hsum8(a1) * scale;
        s[j + 2] = hsum8(a2) * scale;
        s[j + 3] = hsum8(a3) * scale;
    }
    for (; j < nk; j++) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + j * ldk + d), a0);
        s[j] = hsum8(a0) * scale;
    }
}

/* s_j <- exp(s_j - max), returns their sum */
static float softmax_numerators(float *s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    int64_t j = 0;
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

/* one query head: o = softmax(q k^T * scale) v over keys 0 .. n-1; s: n floats of scratch.
 * Inlined with D a constant for the common head sizes, so acc stays in registers. */
static inline __attribute__((always_inline)) void attend_head(
        const float *q, const float *k, const float *v, int64_t ldc, int64_t n, int64_t D,
        float scale, float *s, float *out) {
    scores(q, k, ldc, n, D, scale, s);
    const float inv = 1.0f / softmax_numerators(s, n);
    __m256 acc[MAX_D / 8];
    for (int64_t d = 0; d < D / 8; d++) acc[d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m256 p = _mm256_set1_ps(s[j]);
        const float *vj = v + j * ldc;
        for (int64_t d = 0; d < D / 8; d++)
            acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), acc[d]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], iv));
}

/* q: [T, H, D] (strides s_qt, s_qh; d contiguous); caches: [R, Hkv, C, D] (strides s_cr, s_ch,
 * s_cc; d contiguous); rows, pos: [T]; o: [T, H, D] (strides s_ot, s_oh). D a multiple of 8,
 * <= MAX_D. Returns 0, or -1 if a scratch allocation failed (o then undefined). */
int sb_attention_f32(const float *q, int64_t s_qt, int64_t s_qh, const float *kc,
                     const float *vc, int64_t s_cr, int64_t s_ch, int64_t s_cc,
                     const int64_t *rows, const int64_t *pos, float *o, int64_t s_ot,
                     int64_t s_oh, int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale) {
    const int64_t group = H / Hkv;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) reduction(| : failed)
    for (int64_t t = 0; t < T; t++)
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t n = pos[t] + 1;
            float *s = malloc(sizeof(float) * (size_t)n);
            if (s == NULL) {
                failed = 1;
                continue;
            }
            const float *k = kc + rows[t] * s_cr + hk * s_ch;
            const float *v = vc + rows[t] * s_cr + hk * s_ch;
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                const float *qh = q + t * s_qt + h * s_qh;
                float *oh = o + t * s_ot + h * s_oh;
                if (D == 64)
                    attend_head(qh, k, v, s_cc, n, 64, scale, s, oh);
                else if (D == 128)
                    attend_head(qh, k, v, s_cc, n, 128, scale, s, oh);
                else
                    attend_head(qh, k, v, s_cc, n, D, scale, s, oh);
            }
            free(s);
        }
    return failed ? -1 : 0;
}
