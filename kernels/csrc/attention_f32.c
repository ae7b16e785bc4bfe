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
 * On AVX-512 CPUs the same operations run two keys' sums or sixteen output dims per register
 * and two consecutive tokens of a row share a pass (attend_run, below; session 13: a batch-1
 * verify step of 11 tokens at 600 cached, int8, 12.4 -> 11.5 ms).
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
#define RMAX 2 /* tokens of one row per pass (attend_run) */
#define PMAX (RMAX * GMAX) /* (token, head) pairs sharing a pass */

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
        __m256 a[PMAX][4];
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

/* ---- AVX-512: the same arithmetic per key and per output element, in 512-bit registers ----
 * Where the CPU has AVX-512 F/VL every task runs attend_run below instead of attend_group:
 *   scores: two keys per register, each 256-bit half the eight lanes of one key's sum as above
 *     (q's eight floats broadcast to both halves), so each half runs the FMAs of the AVX2 pass
 *     in the same order, and the halves' sums go through hsum8_x4: the same bits at half the
 *     FMA instructions;
 *   values: sixteen output dims per register; an output dim's sum is its own lane, one FMA per
 *     key in key order either way: the same bits;
 *   softmax: softmax_numerators, unchanged.
 * And R <= RMAX consecutive tokens of one row (positions n0 - 1 .. n0 + R - 2: token r sees keys
 * 0 .. n0 - 1 + r: a verify step's draft tokens, a prompt's tokens) share each load (and float16
 * widening) of a key or value row over keys 0 .. n0 - 1, which all of them see. A key's score is
 * the same sum whichever keys or tokens share its pass, each token's softmax runs on its own
 * scores, and each output accumulates its values in key order (keys 0 .. n0 - 1 for all, then
 * token r's last r keys), so the bits equal one token's pass alone, and AVX2's
 * (tests/unit/test_attention_cpu.py). q, out: R * G pointers, token-major; s: R * G * (n0 + R -
 * 1) floats of scratch. */
#define AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq")))

/* keys i and i + ldk (element indices) at dims d .. d + 7 as the two halves of a register */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 kv_load_pair(
        int F16, const void *c, int64_t i, int64_t ldk) {
    if (F16) {
        const uint16_t *h = (const uint16_t *)c;
        const __m256i both = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(h + i))),
            _mm_loadu_si128((const __m128i *)(h + i + ldk)), 1);
        return _mm512_cvtph_ps(both);
    }
    const float *f = (const float *)c;
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f + i)),
                              _mm256_loadu_ps(f + i + ldk), 1);
}

/* sixteen cache elements from element index i, as kv_load */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 kv_load16(int F16, const void *c,
                                                                            int64_t i) {
    if (F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i)));
    return _mm512_loadu_ps((const float *)c + i);
}

/* scores() for P (token, head) pairs, four keys a pass as two pairs of keys */
AVX512_TARGET static inline __attribute__((always_inline)) void scores512(
        int P, int F16, const float *const *q, const void *k, int64_t ldk, int64_t nk,
        int64_t D, float scale, float *s, int64_t lds) {
    int64_t j = 0;
    const __m128 sc = _mm_set1_ps(scale);
    for (; j + 4 <= nk; j += 4) {
        const int64_t k0 = j * ldk;
        __m512 a[PMAX][2];
        for (int p = 0; p < P; p++) a[p][0] = a[p][1] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m512 k01 = kv_load_pair(F16, k, k0 + d, ldk);
            const __m512 k23 = kv_load_pair(F16, k, k0 + 2 * ldk + d, ldk);
            for (int p = 0; p < P; p++) {
                const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[p] + d));
                a[p][0] = _mm512_fmadd_ps(qv, k01, a[p][0]);
                a[p][1] = _mm512_fmadd_ps(qv, k23, a[p][1]);
            }
        }
        for (int p = 0; p < P; p++)
            _mm_storeu_ps(s + p * lds + j, _mm_mul_ps(hsum8_x4(
                _mm512_castps512_ps256(a[p][0]), _mm512_extractf32x8_ps(a[p][0], 1),
                _mm512_castps512_ps256(a[p][1]), _mm512_extractf32x8_ps(a[p][1], 1)), sc));
    }
    if (j < nk) /* the last 1-3 keys: scores()'s one-key loop, the same sums */
        scores(P, 4, F16, q, (const char *)k + j * ldk * (F16 ? 2 : 4), ldk, nk - j, D, scale,
               s + j, lds);
}

#define SLICE512 64 /* output dims per pass over the values: P * 4 accumulators */

AVX512_TARGET static inline __attribute__((always_inline)) void attend_run(
        int R, int G, int F16, const float *const *q, const void *k, const void *v, int64_t ldc,
        int64_t n0, int64_t D, float scale, float *s, float *const *out) {
    const int P = R * G;
    const int64_t lds = n0 + R - 1, esize = F16 ? 2 : 4;
    scores512(P, F16, q, k, ldc, n0, D, scale, s, lds); /* keys every token sees */
    for (int r = 1; r < R; r++) /* token r's own last r keys */
        scores512(G, F16, q + r * G, (const char *)k + n0 * ldc * esize, ldc, r, D, scale,
                  s + r * G * lds + n0, lds);
    float inv[PMAX];
    for (int p = 0; p < P; p++) inv[p] = 1.0f / softmax_numerators(s + p * lds, n0 + p / G);
    for (int64_t d0 = 0; d0 < D; d0 += SLICE512) {
        /* sixteen dims a register; a last 8 (D % 16 == 8) in the low half (the high half
         * unused: its lanes are not stored) */
        const int64_t left = D - d0 < SLICE512 ? D - d0 : SLICE512;
        const int w = (int)((left + 15) / 16);
        const __mmask16 last = left % 16 ? 0x00FF : 0xFFFF;
        __m512 acc[PMAX][SLICE512 / 16];
        for (int p = 0; p < P; p++)
            for (int c = 0; c < w; c++) acc[p][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n0 + R - 1; j++) {
            const int64_t vj = j * ldc + d0;
            const int p0 = j < n0 ? 0 : (int)(j - n0 + 1) * G; /* the tokens that see key j */
            for (int c = 0; c < w; c++) {
                const __m512 vv = c == w - 1 && last != 0xFFFF
                    ? _mm512_castps256_ps512(kv_load(F16, v, vj + 16 * c))
                    : kv_load16(F16, v, vj + 16 * c);
                for (int p = p0; p < P; p++)
                    acc[p][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[p * lds + j]), vv, acc[p][c]);
            }
        }
        for (int p = 0; p < P; p++) {
            const __m512 iv = _mm512_set1_ps(inv[p]);
            for (int c = 0; c < w; c++)
                _mm512_mask_storeu_ps(out[p] + d0 + 16 * c, c == w - 1 ? last : 0xFFFF,
                                      _mm512_mul_ps(acc[p][c], iv));
        }
    }
}

/* attend_run with R, G and D constants where they are common */
#define ATTEND_RUN(F16)                                                                     \
    AVX512_TARGET static void attend_run_##F16(int R, int G, const float *const *q,         \
                                               const void *k, const void *v, int64_t ldc,   \
                                               int64_t n0, int64_t D, float scale, float *s, \
                                               float *const *out) {                         \
        if (R == 2 && G == 3 && D == 64)                                                    \
            attend_run(2, 3, F16, q, k, v, ldc, n0, 64, scale, s, out);                     \
        else if (R == 1 && G == 3 && D == 64)                                               \
            attend_run(1, 3, F16, q, k, v, ldc, n0, 64, scale, s, out);                     \
        else if (R == 2)                                                                    \
            attend_run(2, G, F16, q, k, v, ldc, n0, D, scale, s, out);                      \
        else                                                                                \
            attend_run(1, G, F16, q, k, v, ldc, n0, D, scale, s, out);                      \
    }
ATTEND_RUN(0)
ATTEND_RUN(1)

static int avx512_state = -1; /* attend_run in use: -1 not decided yet */

static int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

/* Whether attend_run (AVX-512) runs the tasks: where the CPU has AVX-512 F/VL/DQ, unless
 * started off (sb_attention_avx512_start); enable >= 0 sets it (tests, A/B timings). The
 * same bits either way. */
int sb_attention_avx512(int enable) {
    if (avx512_state < 0) avx512_state = cpu_avx512();
    if (enable >= 0) avx512_state = enable && cpu_avx512();
    return avx512_state;
}

/* The state before anything set it: on = 0 starts on the AVX2 form (cpu_build passes
 * SPECBATCH_CPU_AVX512 from specbatch/settings.py at load). A state already set stays. */
void sb_attention_avx512_start(int on) {
    if (avx512_state < 0) avx512_state = on && cpu_avx512();
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
    /* AVX-512: tasks of up to RMAX tokens (same row, consecutive positions) that share
     * passes (attend_run); task u starts at token first[u]. AVX2 (or more than GMAX query
     * heads per kv head): one token a task (attend_group). */
    const int runs = group <= GMAX && sb_attention_avx512(-1);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(T + 1));
    if (first == NULL) return -1;
    int64_t U = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || !runs || t == first[U - 1] + RMAX || rows[t] != rows[t - 1] ||
            pos[t] != pos[t - 1] + 1)
            first[U++] = t;
    first[U] = T;
    /* tasks round-robin over the threads: a prefill's tokens read 1 .. n keys each, so
     * contiguous halves would leave one thread the long half (the schedule changes no bits) */
#pragma omp parallel for collapse(2) schedule(static, 1) reduction(| : failed)
    for (int64_t u = 0; u < U; u++)
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t t = first[u], R = first[u + 1] - t;
            const int64_t n = pos[t] + 1;
            const int64_t G = group < GMAX ? group : GMAX;
            float *s = malloc(sizeof(float) * (size_t)((n + R - 1) * G * R));
            if (s == NULL) {
                failed = 1;
                continue;
            }
            const int64_t at = (rows[t] * s_cr + hk * s_ch) * esize;
            const void *k = (const char *)kc + at, *v = (const char *)vc + at;
            if (runs) { /* R <= RMAX tokens, group <= GMAX heads */
                const float *qh[PMAX];
                float *oh[PMAX];
                for (int64_t r = 0; r < R; r++)
                    for (int64_t g = 0; g < group; g++) {
                        qh[r * group + g] = q + (t + r) * s_qt + (hk * group + g) * s_qh;
                        oh[r * group + g] = o + (t + r) * s_ot + (hk * group + g) * s_oh;
                    }
                if (kv_f16)
                    attend_run_1((int)R, (int)group, qh, k, v, s_cc, n, D, scale, s, oh);
                else
                    attend_run_0((int)R, (int)group, qh, k, v, s_cc, n, D, scale, s, oh);
                free(s);
                continue;
            }
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
    free(first);
    return failed ? -1 : 0;
}
