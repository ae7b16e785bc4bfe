/* Code weights times 8-bit activations: y = x w^T (+ bias), integer dot products per block.
 *
 * Built by kernels/cpu_build.py, called through sb_linear_quant (linear_f32.c) for the weight
 * kinds Q4_1_X8 and Q8_0_X8 (kernels/linear_cpu.py, pack_q8, documents the layout). The
 * scheme is llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products (ggml-quants.c):
 *
 *   each row of x, per block of 32 k:  d_x = max |x| / 127,  q_x = rint(x * (1 / d_x)) (int8,
 *                                      round to nearest even),  S = sum q_x (int32);
 *   Q4_1 weight block (d_w, m_w, q_w in 0..15, w = d_w q_w + m_w), per output element:
 *       acc = fma(float(sum q_w q_x), d_w * d_x, acc);  acc = fma(m_w, d_x * float(S), acc)
 *   Q8_0 weight block (d_w, q_w in -127..127, w = d_w q_w):
 *       acc = fma(float(sum q_w q_x), d_w * d_x, acc)
 *   Q5_K weight block: as Q4_1's, q_w in 0..31 (a GGUF Q5_K sub-block, as Q4_K's below)
 *   Q6_K weight block (d_lo for k 0..15, d_hi for k 16..31, q_w in -32..31, w = d q_w; a
 *   GGUF Q6_K super-block's sub-blocks of 16, d = its float16 d times the int8 sub-scale,
 *   an exact product):
 *       acc = fma(float(sum_lo q_w q_x), d_lo * d_x, acc);
 *       acc = fma(float(sum_hi q_w q_x), d_hi * d_x, acc)
 *   (a GGUF Q4_K sub-block of 32 is a Q4_1 block with d_w = d * sc and m_w = -dmin * m:
 *   kernels/kquant.py)
 *
 * over the blocks in order, then y = acc + bias. The integer sums are exact (|sum| < 2^20, so
 * float(sum) is exact too) and every float operation is one element's own, in a fixed order:
 * an output element has the same bits whatever M, the row's place in x, the tiling, the thread
 * count and the instruction set (the AVX-512 VNNI, AVX2 and portable C kernels below agree bit
 * for bit; tests/unit/test_linear_q8.py). So the batch invariance of docs/design.md holds by
 * construction, as with the float32 kernels; the numbers differ from float32's (activations
 * are rounded to 8 bits per block, as llama.cpp does).
 *
 * Layout (16 output columns per group, one 32-bit lane of a 512-bit register each; N padded to
 * a multiple of 16 with zero weights): for group g and block b,
 *   Q4_1: codes [4][16][4] bytes, byte (r, c, j) = q(c, 4r + j) | q(c, 16 + 4r + j) << 4;
 *         scales [2][16] floats (d_w, then m_w, per column);
 *   Q8_0: codes [8][16][4] bytes, byte (r, c, j) = q(c, 4r + j) + 128 (unsigned for VPDPBUSD:
 *         sum (q_w + 128) q_x - 128 S = sum q_w q_x, exact); scales [16] floats (d_w);
 *   Q5_K: codes as Q8_0's (q_w + 128); scales as Q4_1's.
 *   Q4_K: codes [288] bytes: Q4_1's 256, then sc [16] and m [16] (uint8, 6 bits: the GGUF
 *         sub-block's scale and min); scales per super-block of 8 blocks: [2][16] float16 (d,
 *         then dmin, per column). d_w = d * sc and m_w = -(dmin * m) are exact float32
 *         products (11 significant bits times 6), computed in the kernel: the Q4_1 arithmetic
 *         above on the same d_w and m_w values, in 4.6 bits a weight instead of 6.
 *   Q6_K: codes [416] bytes: q_w + 32 (0..63) in two parts, the low 4 bits in Q4_1's layout
 *         (256), the high 2 bits (128: byte (s, c, j), s = 0, 1, holds those of k 8t + 4s + j
 *         at bits 2t, t = 0..3), then sc_lo [16] and sc_hi [16] (int8: the GGUF sub-blocks'
 *         scales of k 0..15 and 16..31); scales per super-block: [16] float16 d per column.
 *         d_lo = d * sc_lo and d_hi = d * sc_hi (exact) in the kernel; the integer sums run
 *         on the unsigned codes, sum (q_w + 32) q_x - 32 S = sum q_w q_x (exact). 6.6 bits a
 *         weight instead of 10.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32      /* k per block */
#define GC 16      /* output columns per group */
#define MRQ 8      /* rows of x per tile */
#define CHAINS2_MAX_ROWS 4 /* two accumulation chains per row up to this many rows */
#define Q4_1_X8 3
#define Q8_0_X8 4
#define Q6_K_X8 5
#define Q5_K_X8 7 /* (6: SEGMENTS, linear_f32.c) */
#define Q4_K_X8 8

/* bytes of codes and floats of scales per (group, block); Q4_K and Q6_K keep float16 scales
 * per super-block of 8 blocks (64 and 32 bytes per group), i.e. 2 and 1 floats' worth per
 * block, K a multiple of 256 */
static inline int64_t codes_per(int kind) {
    return kind == Q4_1_X8 ? 256 : kind == Q4_K_X8 ? 288 : kind == Q6_K_X8 ? 416 : 512;
}
static inline int64_t scales_per(int kind) {
    return kind == Q8_0_X8 ? 16 : kind == Q4_K_X8 ? 2 : kind == Q6_K_X8 ? 1 : 32;
}
/* Q4_1, Q5_K and Q4_K: w = d_w q + m_w, the m_w d_x S term */
static inline int has_offset(int kind) {
    return kind == Q4_1_X8 || kind == Q5_K_X8 || kind == Q4_K_X8;
}
/* codes in nibbles (Q4_1's 256 bytes first) */
static inline int nibble_codes(int kind) {
    return kind == Q4_1_X8 || kind == Q4_K_X8 || kind == Q6_K_X8;
}

/* float16 bits -> float32, exact (the portable kernel's; the SIMD ones use VCVTPH2PS) */
static float half_to_float(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? ldexpf((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), e - 25);
    return h & 0x8000 ? -f : f;
}

/* Software prefetch of the weights PREFETCH_BLOCKS blocks ahead (4 KB of Q4_1 codes, 8 KB of
 * Q8_0; past the group's last block that is the next group's, which follows it): a few-row
 * matmul streams the weights from memory once, and without it each block's loads waited for
 * memory while the integer work sat idle. Measured on the AMX Xeon VM (2 threads, every dense
 * matmul of a SmolLM2-135M step, benchmarks/dense_rows.py): 1 row 5.6 -> 4.0 ms, 6 rows 8.3 ->
 * 4.7, 11 rows 10.6 -> 6.2-6.9, 16 rows 12.2 -> 7.5-8.5, 64 rows 30.4 -> 25-26 (distances 12,
 * 24, 32 no better; session 13). A prefetch changes no arithmetic, and one past the end of
 * the weights is dropped by the CPU, never a fault. */
#define PREFETCH_BLOCKS 16

static inline __attribute__((always_inline)) void prefetch_block(
        int kind, const uint8_t *codes, const float *scales, int64_t b) {
    const int64_t cp = codes_per(kind), sp = scales_per(kind);
    const uintptr_t c = (uintptr_t)codes + (uintptr_t)(b * cp);  /* (may lie past the end) */
    const uintptr_t s = (uintptr_t)scales + sizeof(float) * (uintptr_t)(b * sp);
    for (int64_t o = 0; o < cp; o += 64) _mm_prefetch((const char *)(c + o), _MM_HINT_T0);
    for (int64_t o = 0; o < (int64_t)sizeof(float) * sp; o += 64)
        _mm_prefetch((const char *)(s + o), _MM_HINT_T0);
}

/* ---- the rows of x in 8 bits: q [M][K] int8, d [M][K / 32] float, s [M][K / 32][2] int32
 * (the sums of q over k 0..15 and 16..31) ---- */

/* A block holding a NaN or an infinity gets codes 0 and d = NaN, so every output of its row
 * is NaN, as a float32 matmul would give (the engine then ends that record with an error
 * instead of sampling from finite garbage). */
static void quantize_scalar(const float *x, int64_t K, int8_t *q, float *d, int32_t *s) {
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < QB; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            finite &= isfinite(xb[j]) != 0;
        }
        if (!finite) {
            memset(q + b * QB, 0, QB);
            d[b] = NAN;
            s[2 * b] = s[2 * b + 1] = 0;
            continue;
        }
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < QB; j++) {
            const int v = (int)nearbyintf(xb[j] * id);
            q[b * QB + j] = (int8_t)v;
            sum[j >= 16] += v;
        }
        d[b] = db;
        s[2 * b] = sum[0];
        s[2 * b + 1] = sum[1];
    }
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* quantize_scalar's arithmetic, 16 lanes at a time (max is exact, the product and the rounding
 * to nearest even are one element's own): the same bytes */
VNNI static void quantize_512(const float *x, int64_t K, int8_t *q, float *d, int32_t *s) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const __m512 zero = _mm512_setzero_ps(); /* x * 0 is +-0 for finite x, else NaN */
        if (_mm512_cmp_ps_mask(_mm512_add_ps(_mm512_mul_ps(v0, zero), _mm512_mul_ps(v1, zero)),
                               zero, _CMP_NEQ_UQ)) {
            memset(q + b * QB, 0, QB);
            d[b] = NAN;
            s[2 * b] = s[2 * b + 1] = 0;
            continue;
        }
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        _mm_storeu_si128((__m128i *)(q + b * QB), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QB + 16), _mm512_cvtsepi32_epi8(q1));
        d[b] = db;
        s[2 * b] = _mm512_reduce_add_epi32(q0);
        s[2 * b + 1] = _mm512_reduce_add_epi32(q1);
    }
}

/* ---- the portable kernel: one element at a time, the documented arithmetic ---- */

static void group_scalar(int kind, int64_t mr, const int8_t *xq, const float *xd,
                         const float *xds, const int32_t *xk, int64_t K, const uint8_t *codes,
                         const float *scales, const float *bias, float *y, int64_t ldy,
                         int64_t ncols) {
    const int64_t nblk = K / QB, cp = codes_per(kind), sp = scales_per(kind);
    for (int64_t i = 0; i < mr; i++)
        for (int64_t c = 0; c < ncols; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *cb = codes + b * cp;
                const float *sb = scales + b * sp;
                const int8_t *q = xq + i * K + b * QB;
                int32_t dot = 0, dot2 = 0;
                if (kind == Q4_1_X8 || kind == Q4_K_X8) {
                    for (int r = 0; r < 4; r++)
                        for (int j = 0; j < 4; j++) {
                            const uint8_t byte = cb[r * 64 + c * 4 + j];
                            dot += (byte & 15) * q[4 * r + j] + (byte >> 4) * q[16 + 4 * r + j];
                        }
                } else if (kind == Q6_K_X8) {
                    for (int r = 0; r < 8; r++)
                        for (int j = 0; j < 4; j++) {
                            const uint8_t lo = cb[(r & 3) * 64 + c * 4 + j];
                            const uint8_t hi = cb[256 + (r & 1) * 64 + c * 4 + j];
                            const int32_t u = ((r < 4 ? lo : lo >> 4) & 15)
                                              | ((hi >> (2 * (r >> 1))) & 3) << 4;
                            if (r >= 4)
                                dot2 += (u - 32) * q[4 * r + j];
                            else
                                dot += (u - 32) * q[4 * r + j];
                        }
                } else { /* Q8_0, Q5_K: 8-bit codes q_w + 128 */
                    for (int r = 0; r < 8; r++)
                        for (int j = 0; j < 4; j++)
                            dot += ((int32_t)cb[r * 64 + c * 4 + j] - 128) * q[4 * r + j];
                }
                const float dx = xd[i * nblk + b];
                float dw = 0.0f, mw = 0.0f, dw2 = 0.0f;
                if (kind == Q4_1_X8 || kind == Q5_K_X8) {
                    dw = sb[c];
                    mw = sb[GC + c];
                } else if (kind == Q8_0_X8) {
                    dw = sb[c];
                } else if (kind == Q4_K_X8) { /* exact products of the GGUF's parts */
                    const uint16_t *h = (const uint16_t *)scales + (b / 8) * 2 * GC;
                    dw = half_to_float(h[c]) * (float)cb[256 + c];
                    mw = -(half_to_float(h[GC + c]) * (float)cb[256 + GC + c]);
                } else if (kind == Q6_K_X8) {
                    const float d = half_to_float(((const uint16_t *)scales)[(b / 8) * GC + c]);
                    dw = d * (float)(int8_t)cb[384 + c];
                    dw2 = d * (float)(int8_t)cb[384 + GC + c];
                }
                acc = fmaf((float)dot, dw * dx, acc);
                if (has_offset(kind)) acc = fmaf(mw, xds[i * nblk + b], acc);
                if (kind == Q6_K_X8) acc = fmaf((float)dot2, dw2 * dx, acc);
            }
            y[i * ldy + c] = bias ? acc + bias[c] : acc;
        }
}

/* ---- AVX2 (no VNNI): VPMADDUBSW + VPMADDWD, each 256-bit half of a group in turn ----
 * The integer sums are those of the portable kernel (exact: a Q4_1 / Q4_K pair of products is
 * at most 2 * 15 * 127, a Q6_K pair (unsigned codes) 2 * 63 * 127, and Q8_0 / Q5_K run |q_w|
 * times sign-adjusted q_x, at most 2 * 127 * 127, all within int16), the float operations the
 * same per element: the same bits. */

#define MRA 4 /* rows per call: 16 ymm registers */

static inline __attribute__((always_inline)) void group_256(
        int kind, int mr, const int8_t *xq, const float *xd, const float *xds, const int32_t *xk,
        int64_t K, const uint8_t *codes, const float *scales, const float *bias, float *y,
        int64_t ldy, int64_t ncols) {
    const int64_t nblk = K / QB, cp = codes_per(kind), sp = scales_per(kind);
    __m256 acc[MRA][2];
    for (int i = 0; i < MRA; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *cb = codes + b * cp;
        prefetch_block(kind, codes, scales, b + PREFETCH_BLOCKS);
        for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7 */
            __m256i dot[MRA], dot2[MRA]; /* Q6_K: k 0..15, k 16..31 */
            for (int i = 0; i < mr; i++) dot[i] = dot2[i] = _mm256_setzero_si256();
            if (kind == Q6_K_X8) { /* unsigned codes: - 32 S of each half starts its chain */
                __m256i w[8];
                const __m256i m30 = _mm256_set1_epi8(0x30);
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(cb + 256 + 32 * h));
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(cb + 320 + 32 * h));
                for (int r = 0; r < 4; r++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + 64 * r + 32 * h));
                    w[r] = _mm256_and_si256(v, low);
                    w[r + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for (int r = 0; r < 8; r++) { /* the high 2 bits of k 4r..4r + 3 to bits 4, 5 */
                    const __m256i hs = r & 1 ? h1 : h0;
                    const int t = r >> 1;
                    const __m256i sh = t == 0 ? _mm256_slli_epi16(hs, 4)
                                       : t == 1 ? _mm256_slli_epi16(hs, 2)
                                       : t == 2 ? hs : _mm256_srli_epi16(hs, 2);
                    w[r] = _mm256_or_si256(w[r], _mm256_and_si256(sh, m30));
                }
                for (int i = 0; i < mr; i++) {
                    dot[i] = _mm256_set1_epi32(xk[2 * (i * nblk + b)]);
                    dot2[i] = _mm256_set1_epi32(xk[2 * (i * nblk + b) + 1]);
                    for (int r = 0; r < 8; r++) {
                        int32_t qx;
                        memcpy(&qx, xq + i * K + b * QB + 4 * r, 4);
                        const __m256i p = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(w[r], _mm256_set1_epi32(qx)), ones);
                        if (r >= 4)
                            dot2[i] = _mm256_add_epi32(dot2[i], p);
                        else
                            dot[i] = _mm256_add_epi32(dot[i], p);
                    }
                }
            } else if (kind == Q4_1_X8 || kind == Q4_K_X8) {
                for (int r = 0; r < 4; r++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + 64 * r + 32 * h));
                    const __m256i wl = _mm256_and_si256(v, low);
                    const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int i = 0; i < mr; i++) {
                        const int8_t *q = xq + i * K + b * QB;
                        int32_t ql, qh;
                        memcpy(&ql, q + 4 * r, 4);
                        memcpy(&qh, q + 16 + 4 * r, 4);
                        const __m256i pl = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(ql));
                        const __m256i ph = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(qh));
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(
                            _mm256_add_epi16(pl, ph), ones));
                    }
                }
            } else { /* Q8_0, Q5_K: 8-bit codes q_w + 128 */
                for (int r = 0; r < 8; r++) {
                    const __m256i sw = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(cb + 64 * r + 32 * h)), flip);
                    const __m256i aw = _mm256_abs_epi8(sw);
                    for (int i = 0; i < mr; i++) {
                        int32_t qx;
                        memcpy(&qx, xq + i * K + b * QB + 4 * r, 4);
                        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(qx), sw);
                        dot[i] = _mm256_add_epi32(
                            dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                    }
                }
            }
            /* dw (and m_w, or d_hi): read, or (Q4_K, Q6_K) the exact products of the GGUF's
             * float16 super-block scales and the block's small integers; Q4_K's m_w is the
             * negated product: fnmadd(p, ., acc) = fma(-p, ., acc) */
            __m256 dw, dw2;
            if (kind == Q4_K_X8) {
                const uint16_t *hs = (const uint16_t *)scales + (b / 8) * 2 * GC + 8 * h;
                dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hs)),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                       _mm_loadl_epi64((const __m128i *)(cb + 256 + 8 * h)))));
                dw2 = _mm256_mul_ps(
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hs + GC))),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(cb + 256 + GC + 8 * h)))));
            } else if (kind == Q6_K_X8) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
                    (const __m128i *)((const uint16_t *)scales + (b / 8) * GC + 8 * h)));
                dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(cb + 384 + 8 * h)))));
                dw2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                           (const __m128i *)(cb + 384 + GC + 8 * h)))));
            } else {
                dw = _mm256_loadu_ps(scales + b * sp + 8 * h);
                dw2 = has_offset(kind) ? _mm256_loadu_ps(scales + b * sp + GC + 8 * h) : dw;
            }
            for (int i = 0; i < mr; i++) {
                const float dx = xd[i * (K / QB) + b];
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                            _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[i][h]);
                if (kind == Q4_K_X8)
                    acc[i][h] = _mm256_fnmadd_ps(dw2, _mm256_set1_ps(xds[i * (K / QB) + b]),
                                                 acc[i][h]);
                else if (has_offset(kind))
                    acc[i][h] = _mm256_fmadd_ps(dw2, _mm256_set1_ps(xds[i * (K / QB) + b]),
                                                acc[i][h]);
                if (kind == Q6_K_X8)
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2[i]),
                                                _mm256_mul_ps(dw2, _mm256_set1_ps(dx)),
                                                acc[i][h]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        float out[GC];
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        for (int64_t c = 0; c < ncols; c++) y[i * ldy + c] = bias ? out[c] + bias[c] : out[c];
    }
}

/* NAME_MR: IMPL (group_256 or group_512) with the kind and the row count MR constants, so
 * the accumulators stay in registers; ATTR its target attribute */
#define GROUP_FN(NAME, ATTR, IMPL, MR)                                                        \
    ATTR static void NAME##_##MR(int kind, const int8_t *xq, const float *xd,                 \
                                 const float *xds, const int32_t *xk, int64_t K,              \
                                 const uint8_t *codes, const float *scales,                   \
                                 const float *bias, float *y, int64_t ldy, int64_t ncols) {   \
        if (kind == Q4_1_X8)                                                                  \
            IMPL(Q4_1_X8, MR, xq, xd, xds, xk, K, codes, scales, bias, y, ldy, ncols);        \
        else if (kind == Q8_0_X8)                                                             \
            IMPL(Q8_0_X8, MR, xq, xd, xds, xk, K, codes, scales, bias, y, ldy, ncols);        \
        else if (kind == Q5_K_X8)                                                             \
            IMPL(Q5_K_X8, MR, xq, xd, xds, xk, K, codes, scales, bias, y, ldy, ncols);        \
        else if (kind == Q4_K_X8)                                                             \
            IMPL(Q4_K_X8, MR, xq, xd, xds, xk, K, codes, scales, bias, y, ldy, ncols);        \
        else                                                                                  \
            IMPL(Q6_K_X8, MR, xq, xd, xds, xk, K, codes, scales, bias, y, ldy, ncols);        \
    }
#define GROUP256(MR) GROUP_FN(group256, , group_256, MR)
GROUP256(1)
GROUP256(2)
GROUP256(3)
GROUP256(4)

typedef void (*group_fn)(int, const int8_t *, const float *, const float *, const int32_t *,
                         int64_t, const uint8_t *, const float *,
                         const float *, float *, int64_t, int64_t);
static const group_fn GROUPS256[MRA + 1] = {NULL, group256_1, group256_2, group256_3,
                                            group256_4};

/* ---- AVX-512 VNNI: 16 columns x up to 8 rows per call, VPDPBUSD on 4 k per lane ---- */

VNNI static inline __attribute__((always_inline)) void group_512(
        int kind, int mr, const int8_t *xq, const float *xd, const float *xds, const int32_t *xk,
        int64_t K, const uint8_t *codes, const float *scales, const float *bias, float *y,
        int64_t ldy, int64_t ncols) {
    const int64_t nblk = K / QB, cp = codes_per(kind), sp = scales_per(kind);
    __m512 acc[MRQ];
#pragma GCC unroll 8
    for (int i = 0; i < MRQ; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *cb = codes + b * cp;
        prefetch_block(kind, codes, scales, b + PREFETCH_BLOCKS);
        __m512i w[8];
        if (nibble_codes(kind)) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m512i v = _mm512_loadu_si512((const void *)(cb + 64 * r));
                w[r] = _mm512_and_si512(v, low);
                w[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (kind == Q6_K_X8) { /* the high 2 bits of k 4r..4r + 3 to bits 4, 5 */
                const __m512i m30 = _mm512_set1_epi8(0x30);
                const __m512i h0 = _mm512_loadu_si512((const void *)(cb + 256));
                const __m512i h1 = _mm512_loadu_si512((const void *)(cb + 320));
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const __m512i hs = r & 1 ? h1 : h0;
                    const int t = r >> 1;
                    const __m512i sh = t == 0 ? _mm512_slli_epi16(hs, 4)
                                       : t == 1 ? _mm512_slli_epi16(hs, 2)
                                       : t == 2 ? hs : _mm512_srli_epi16(hs, 2);
                    /* w | (sh & 0x30): one VPTERNLOGD */
                    w[r] = _mm512_ternarylogic_epi32(w[r], sh, m30, 0xF8);
                }
            }
        } else {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) w[r] = _mm512_loadu_si512((const void *)(cb + 64 * r));
        }
        /* d_w and m_w (Q4_K: d_w and dmin m, m_w its negation; Q6_K: d_lo and d_hi), read or
         * (Q4_K, Q6_K) the exact products of the GGUF's float16 super-block scales and the
         * block's small integers */
        __m512 dw, dw2;
        if (kind == Q4_K_X8) {
            const uint16_t *hs = (const uint16_t *)scales + (b / 8) * 2 * GC;
            dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hs)),
                               _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                   _mm_loadu_si128((const __m128i *)(cb + 256)))));
            dw2 = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hs + GC))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(cb + 256 + GC)))));
        } else if (kind == Q6_K_X8) {
            const __m512 d = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)((const uint16_t *)scales + (b / 8) * GC)));
            dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(cb + 384)))));
            dw2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128((const __m128i *)(cb + 384 + GC)))));
        } else {
            dw = _mm512_loadu_ps(scales + b * sp);
            dw2 = has_offset(kind) ? _mm512_loadu_ps(scales + b * sp + GC) : dw;
        }
        /* two accumulation chains per row (even and odd r): VPDPBUSD's latency (~5 cycles)
         * bound one chain of 8 at few rows; the integer sums are exact, so the order does not
         * change a bit. Q8_0's - 128 S starts the even chain. Q6_K: the first chain sums
         * k 0..15 (r < 4), the second k 16..31, each started by its own - 32 S. */
        __m512i dot[MRQ], dot2[MRQ];
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            dot[i] = kind != Q4_1_X8 && kind != Q4_K_X8
                         ? _mm512_set1_epi32(xk[2 * (i * nblk + b)]) : _mm512_setzero_si512();
            dot2[i] = kind == Q6_K_X8 ? _mm512_set1_epi32(xk[2 * (i * nblk + b) + 1])
                                      : _mm512_setzero_si512();
        }
        if (kind == Q6_K_X8)
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
#pragma GCC unroll 8
                for (int i = 0; i < mr; i++) {
                    int32_t q0, q1;
                    memcpy(&q0, xq + i * K + b * QB + 4 * r, 4);
                    memcpy(&q1, xq + i * K + b * QB + 16 + 4 * r, 4);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], w[r], _mm512_set1_epi32(q0));
                    dot2[i] = _mm512_dpbusd_epi32(dot2[i], w[r + 4], _mm512_set1_epi32(q1));
                }
        else
#pragma GCC unroll 4
        for (int r = 0; r < 8; r += 2)
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                int32_t q0, q1;
                memcpy(&q0, xq + i * K + b * QB + 4 * r, 4);
                memcpy(&q1, xq + i * K + b * QB + 4 * r + 4, 4);
                dot[i] = _mm512_dpbusd_epi32(dot[i], w[r], _mm512_set1_epi32(q0));
                if (mr <= CHAINS2_MAX_ROWS)
                    dot2[i] = _mm512_dpbusd_epi32(dot2[i], w[r + 1], _mm512_set1_epi32(q1));
                else
                    dot[i] = _mm512_dpbusd_epi32(dot[i], w[r + 1], _mm512_set1_epi32(q1));
            }
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const float dx = xd[i * nblk + b];
            if (kind != Q6_K_X8) dot[i] = _mm512_add_epi32(dot[i], dot2[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[i]);
            if (kind == Q6_K_X8)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2[i]),
                                         _mm512_mul_ps(dw2, _mm512_set1_ps(dx)), acc[i]);
            if (kind == Q4_K_X8)
                acc[i] = _mm512_fnmadd_ps(dw2, _mm512_set1_ps(xds[i * nblk + b]), acc[i]);
            else if (has_offset(kind))
                acc[i] = _mm512_fmadd_ps(dw2, _mm512_set1_ps(xds[i * nblk + b]), acc[i]);
        }
    }
    const __mmask16 m = (__mmask16)((1u << ncols) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) {
        __m512 out = acc[i];
        if (bias) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(m, bias));
        _mm512_mask_storeu_ps(y + i * ldy, m, out);
    }
}

#define GROUP512(MR) GROUP_FN(group512, VNNI, group_512, MR)
GROUP512(1)
GROUP512(2)
GROUP512(3)
GROUP512(4)
GROUP512(5)
GROUP512(6)
GROUP512(7)
GROUP512(8)

static const group_fn GROUPS512[MRQ + 1] = {NULL,        group512_1, group512_2,
                                               group512_3,  group512_4, group512_5,
                                               group512_6,  group512_7, group512_8};

static int isa_state = -1; /* -1: not decided yet; else 2 VNNI, 1 AVX2, 0 portable C */

static int cpu_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Which kernel runs: 2 AVX-512 VNNI (where the CPU has it), 1 AVX2, 0 the portable C loop
 * (tests). isa >= 0 asks for one (VNNI only where the CPU has it), -1 only asks;
 * sb_linear_q8_isa_start(0) starts on AVX2. The same bits whichever runs. */
int sb_linear_q8_isa(int isa) {
    if (isa_state < 0) isa_state = cpu_vnni() ? 2 : 1;
    if (isa >= 0) isa_state = isa >= 2 ? (cpu_vnni() ? 2 : 1) : isa;
    return isa_state;
}

/* The state before anything set it: vnni = 0 starts on AVX2 (cpu_build passes
 * SPECBATCH_CPU_VNNI from specbatch/settings.py at load). A state already set stays. */
void sb_linear_q8_isa_start(int vnni) {
    if (isa_state < 0) isa_state = vnni && cpu_vnni() ? 2 : 1;
}

/* Groups of 16 columns per thread block: at most 4 (weights of 4 groups at K = 1536 are 24 KB
 * of codes and scales, read once per tile of 8 rows from L1/L2), fewer where that splits the
 * blocks evenly over the threads (576 columns: 36 groups, 9 blocks of 4 left one of 2 threads
 * idle for a ninth of o_proj and down_proj; 18 blocks of 2 do not). Changes no bits. */
#define GROUPS_PER_BLOCK 4

static int64_t groups_per_block(int64_t groups) {
    const int64_t threads = omp_get_max_threads();
    for (int64_t gpb = GROUPS_PER_BLOCK; gpb > 1; gpb /= 2)
        if (((groups + gpb - 1) / gpb) % threads == 0) return gpb;
    return 1;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) w^T (+ bias [N]) for the kinds above;
 * K % 32 == 0; codes and scales in the layout above. Returns 0, or -1 when the buffer for x's
 * codes could not be allocated. */
int sb_linear_q8(const float *x, int64_t ldx, int kind, const float *scales,
                 const uint8_t *codes, const float *bias, float *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K) {
    const int64_t nblk = K / QB, groups = (N + GC - 1) / GC;
    const int isa = sb_linear_q8_isa(-1), vnni = isa == 2;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * nblk));
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)(M * nblk * 2));
    /* per (row, block), for the kernels' loops: d_x * S (Q4_1's offset term) and -128 S (Q8_0's
     * unsigned-code correction; Q6_K: -128 S of k 0..15 and of k 16..31), read as broadcasts
     * from memory */
    float *xds = malloc(sizeof(float) * (size_t)(M * nblk));
    int32_t *xk = malloc(sizeof(int32_t) * (size_t)(M * nblk * 2));
    if (!xq || !xd || !xs || !xds || !xk) {
        free(xq);
        free(xd);
        free(xs);
        free(xds);
        free(xk);
        return -1;
    }
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        if (vnni)
            quantize_512(x + m * ldx, K, xq + m * K, xd + m * nblk, xs + 2 * m * nblk);
        else
            quantize_scalar(x + m * ldx, K, xq + m * K, xd + m * nblk, xs + 2 * m * nblk);
        for (int64_t b = m * nblk; b < (m + 1) * nblk; b++) {
            const int32_t sum = xs[2 * b] + xs[2 * b + 1];
            xds[b] = xd[b] * (float)sum;
            if (kind == Q6_K_X8) { /* codes q_w + 32 */
                xk[2 * b] = -32 * xs[2 * b];
                xk[2 * b + 1] = -32 * xs[2 * b + 1];
            } else {
                xk[2 * b] = -128 * sum;
            }
        }
    }
    const int64_t cg = nblk * codes_per(kind), sg = nblk * scales_per(kind);
    const int64_t gpb = groups_per_block(groups), nblocks = (groups + gpb - 1) / gpb;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t g0 = blk * gpb;
        const int64_t g1 = g0 + gpb < groups ? g0 + gpb : groups;
        for (int64_t m = 0; m < M; m += MRQ) {
            const int64_t mr = M - m < MRQ ? M - m : MRQ;
            for (int64_t g = g0; g < g1; g++) {
                const int64_t n = g * GC, ncols = N - n < GC ? N - n : GC;
                const float *bg = bias ? bias + n : NULL;
                if (vnni)
                    GROUPS512[mr](kind, xq + m * K, xd + m * nblk, xds + m * nblk,
                                  xk + 2 * m * nblk, K,
                                  codes + g * cg, scales + g * sg, bg, y + m * ldy + n, ldy,
                                  ncols);
                else if (isa == 1)
                    for (int64_t i = 0; i < mr; i += MRA)
                        GROUPS256[mr - i < MRA ? mr - i : MRA](
                            kind, xq + (m + i) * K, xd + (m + i) * nblk,
                            xds + (m + i) * nblk, xk + 2 * (m + i) * nblk,
                            K, codes + g * cg, scales + g * sg, bg, y + (m + i) * ldy + n,
                            ldy, ncols);
                else
                    group_scalar(kind, mr, xq + m * K, xd + m * nblk, xds + m * nblk,
                                 xk + 2 * m * nblk, K,
                                 codes + g * cg, scales + g * sg, bg, y + m * ldy + n, ldy,
                                 ncols);
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
    free(xds);
    free(xk);
    return 0;
}
