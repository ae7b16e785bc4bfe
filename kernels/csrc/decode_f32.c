/* Every decoder layer of a float32 decode/verify step in one call, x86-64 AVX2 + FMA.
 *
 * Built by kernels/cpu_build.py, called by kernels/decode_cpu.py (see there for the contract).
 * Per layer, for the T tokens of the step (each token's own row of every buffer):
 *   x = rms_norm(h) * w_in;  qkv = x Wqkv^T (+ b);  rope on q and k;  k, v -> the cache at
 *   (row, position);  a = attention(q, cache) (attention_f32.c);  h = h + a Wo^T (+ b);
 *   x = rms_norm(h) * w_post;  [g, u] = x Wgu^T;  h = h + (silu(g) * u) Wdown^T.
 * The matmuls are linear_f32.c's (float32 panels or exact 4/8-bit codes, the same bits); the
 * glue is elementwise or per token in a fixed order:
 *   rms_norm: s = x_i^2 summed in eight FMA lanes over i in order, the fixed horizontal sum
 *             (simd.h), r = 1 / sqrtf(s / n + eps), y_i = (x_i * r) * w_i;
 *   rope:     y_i = x_i * cos_i + x_{(i + D/2) mod D} * sin_i (sin's first half negated by the
 *             caller), two products and one sum, never fused (-ffp-contract=off);
 *   silu:     g / (1 + exp(-g)) with simd.h's exp.
 * So a token's bits depend only on its own inputs and cache row, never on T, the other tokens
 * or the thread count: the same batch invariance as the torch path this replaces (whose glue
 * rounds differently: the two paths agree to ~1e-6, not bit for bit).
 */
#include "simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void sb_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
int sb_linear_quant(const float *x, int64_t ldx, int kind, const float *scales,
                    const uint8_t *codes, const float *bias, float *y, int64_t ldy, int64_t M,
                    int64_t N, int64_t K);
int sb_attention_f32(const float *q, int64_t s_qt, int64_t s_qh, const void *kc,
                     const void *vc, int64_t s_cr, int64_t s_ch, int64_t s_cc,
                     const int64_t *rows, const int64_t *pos, float *o, int64_t s_ot,
                     int64_t s_oh, int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale,
                     int kv_f16);

/* a weight as linear_f32.c takes it: kind 0 float32 panels (data), else Q4_1 / Q8_0 (data =
 * scales, codes); bias [N] or NULL */
typedef struct {
    int64_t kind;
    const float *data;
    const uint8_t *codes;
    const float *bias;
    int64_t N, K;
} sb_weight;

typedef struct {
    sb_weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    void *k_cache, *v_cache; /* [R, Hkv, C, D] float32 or float16, strides to sb_decode_f32 */
} sb_layer;

static int linear(const sb_weight *w, const float *x, float *y, int64_t M) {
    if (w->kind == 0) {
        sb_linear_f32(x, w->K, w->data, w->bias, y, w->N, M, w->N, w->K);
        return 0;
    }
    return sb_linear_quant(x, w->K, (int)w->kind, w->data, w->codes, w->bias, y, w->N, M,
                           w->N, w->K);
}

/* y = rms_norm(x) * w for T rows of n floats (n a multiple of 8) */
static void rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t n,
                     float eps) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float *yt = y + t * n;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(xt + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + i), r),
                                                   _mm256_loadu_ps(w + i)));
    }
}

/* rope in place on `heads` heads of D floats (D / 2 a multiple of 8) with cos, sin [D] */
static void rope(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    float tmp[256];
    for (int64_t h = 0; h < heads; h++, x += D) {
        memcpy(tmp, x, sizeof(float) * (size_t)D);
        for (int64_t i = 0; i < D; i += 8) {
            const int64_t j = i < half ? i + half : i - half;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(tmp + i), _mm256_loadu_ps(cos + i));
            __m256 b = _mm256_mul_ps(_mm256_loadu_ps(tmp + j), _mm256_loadu_ps(sin + i));
            _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
        }
    }
}

/* h += d for T rows of n floats (n a multiple of 8) */
static void add_rows(float *h, const float *d, int64_t T, int64_t n) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(h + t * n + i, _mm256_add_ps(_mm256_loadu_ps(h + t * n + i),
                                                          _mm256_loadu_ps(d + t * n + i)));
}

/* silu(g) = g / (1 + exp(-g)), exp's argument capped where it would overflow */
static inline __m256 silu_ps(__m256 g) {
    const __m256 e = exp_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                          _mm256_set1_ps(88.3762626647949f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* D floats of x into the cache at dst: as they are, or (f16) rounded to float16, nearest even */
static void cache_store(void *dst, const float *x, int64_t D, int f16) {
    if (!f16) {
        memcpy(dst, x, sizeof(float) * (size_t)D);
        return;
    }
    for (int64_t i = 0; i < D; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

/* h [T, hidden] in place through every layer; cos, sin [T, D]; rows, pos [T] (checked by the
 * caller); caches' strides s_cr, s_ch, s_cc in elements (d contiguous), float32 or, with
 * kv_f16, float16 (keys and values rounded to float16 as they are written). hidden a multiple
 * of 8, D a multiple of 16 up to 256. Returns 0, or -1 when memory ran out (h is then
 * undefined). */
int sb_decode_f32(const sb_layer *layers, int64_t L, float *h, int64_t T, int64_t hidden,
                  const float *cos, const float *sin, const int64_t *rows, const int64_t *pos,
                  int64_t H, int64_t Hkv, int64_t D, int64_t s_cr, int64_t s_ch, int64_t s_cc,
                  float eps, float scale, int kv_f16) {
    const int64_t esize = kv_f16 ? 2 : 4;
    const int64_t nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
    const int64_t inter = layers[0].gate_up.N / 2;
    float *x = malloc(sizeof(float) * (size_t)(T * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(T * nqkv));
    float *att = malloc(sizeof(float) * (size_t)(T * nq));
    float *tmp = malloc(sizeof(float) * (size_t)(T * hidden));
    float *gu = malloc(sizeof(float) * (size_t)(T * 2 * inter));
    float *act = malloc(sizeof(float) * (size_t)(T * inter));
    int failed = !x || !qkv || !att || !tmp || !gu || !act;
    for (int64_t l = 0; l < L && !failed; l++) {
        const sb_layer *ly = layers + l;
        rms_norm(h, ly->input_norm, x, T, hidden, eps);
        failed |= linear(&ly->qkv, x, qkv, T);
#pragma omp parallel for schedule(static) if (T >= 16)
        for (int64_t t = 0; t < T; t++) {
            float *qt = qkv + t * nqkv;
            rope(qt, H + Hkv, D, cos + t * D, sin + t * D); /* q heads, then k heads */
            const int64_t at = rows[t] * s_cr + pos[t] * s_cc;
            for (int64_t g = 0; g < Hkv; g++) {
                cache_store((char *)ly->k_cache + (at + g * s_ch) * esize, qt + nq + g * D, D,
                            kv_f16);
                cache_store((char *)ly->v_cache + (at + g * s_ch) * esize,
                            qt + nq + nkv + g * D, D, kv_f16);
            }
        }
        failed |= sb_attention_f32(qkv, nqkv, D, ly->k_cache, ly->v_cache, s_cr, s_ch, s_cc,
                                   rows, pos, att, nq, D, T, H, Hkv, D, scale, kv_f16);
        failed |= linear(&ly->o, att, tmp, T);
        add_rows(h, tmp, T, hidden);
        rms_norm(h, ly->post_norm, x, T, hidden, eps);
        failed |= linear(&ly->gate_up, x, gu, T);
#pragma omp parallel for schedule(static) if (T >= 16)
        for (int64_t t = 0; t < T; t++) {
            const float *g = gu + t * 2 * inter, *u = g + inter;
            float *a = act + t * inter;
            int64_t i = 0;
            for (; i + 8 <= inter; i += 8)
                _mm256_storeu_ps(a + i, _mm256_mul_ps(silu_ps(_mm256_loadu_ps(g + i)),
                                                      _mm256_loadu_ps(u + i)));
            for (; i < inter; i++) { /* the same arithmetic, one lane (inter % 8 != 0) */
                float out[8];
                _mm256_storeu_ps(out, silu_ps(_mm256_set_ps(0, 0, 0, 0, 0, 0, 0, g[i])));
                a[i] = out[0] * u[i];
            }
        }
        failed |= linear(&ly->down, act, tmp, T);
        add_rows(h, tmp, T, hidden);
    }
    free(x);
    free(qkv);
    free(att);
    free(tmp);
    free(gu);
    free(act);
    return failed ? -1 : 0;
}
