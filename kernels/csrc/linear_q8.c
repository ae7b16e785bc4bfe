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
 *   GGUF Q6_K super-block's sub-blocks of 16, d = its float16 d times the int8 sub-scale):
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
 *   Q6_K: codes as Q8_0's; scales [2][16] floats (d_lo, then d_hi, per column);
 *   Q5_K: codes as Q8_0's (q_w + 128); scales as Q4_1's.
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

/* bytes of codes and floats of scales per (group, block) */
static inline int64_t codes_per(int kind) { return kind == Q4_1_X8 ? 256 : 512; }
static inline int64_t scales_per(int kind) { return kind == Q8_0_X8 ? 16 : 32; }
/* Q4_1 and Q5_K: w = d_w q + m_w, the m_w d_x S term */
static inline int has_offset(int kind) { return kind == Q4_1_X8 || kind == Q5_K_X8; }

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
                if (kind == Q4_1_X8) {
                    for (int r = 0; r < 4; r++)
                        for (int j = 0; j < 4; j++) {
                            const uint8_t byte = cb[r * 64 + c * 4 + j];
                            dot += (byte & 15) * q[4 * r + j] + (byte >> 4) * q[16 + 4 * r + j];
                        }
                } else {
                    for (int r = 0; r < 8; r++)
                        for (int j = 0; j < 4; j++) {
                            const int32_t p =
                                ((int32_t)cb[r * 64 + c * 4 + j] - 128) * q[4 * r + j];
                            if (kind == Q6_K_X8 && r >= 4)
                                dot2 += p;
                            else
                                dot += p;
                        }
                }
                const float dx = xd[i * nblk + b];
                acc = fmaf((float)dot, sb[c] * dx, acc);
                if (has_offset(kind)) acc = fmaf(sb[GC + c], xds[i * nblk + b], acc);
                if (kind == Q6_K_X8) acc = fmaf((float)dot2, sb[GC + c] * dx, acc);
            }
            y[i * ldy + c] = bias ? acc + bias[c] : acc;
        }
}

/* ---- AVX2 (no VNNI): VPMADDUBSW + VPMADDWD, each 256-bit half of a group in turn ----
 * The integer sums are those of the portable kernel (exact: a Q4_1 pair of products is at most
 * 2 * 15 * 127, and Q8_0 / Q6_K run |q_w| times sign-adjusted q_x, at most 2 * 127 * 127, all
 * within int16), the float operations the same per element: the same bits. */

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
            if (kind == Q4_1_X8) {
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
            } else {
                for (int r = 0; r < 8; r++) {
                    const __m256i sw = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(cb + 64 * r + 32 * h)), flip);
                    const __m256i aw = _mm256_abs_epi8(sw);
                    for (int i = 0; i < mr; i++) {
                        int32_t qx;
                        memcpy(&qx, xq + i * K + b * QB + 4 * r, 4);
                        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(qx), sw);
                        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
                        if (kind == Q6_K_X8 && r >= 4)
                            dot2[i] = _mm256_add_epi32(dot2[i], p);
                        else
                            dot[i] = _mm256_add_epi32(dot[i], p);
                    }
                }
            }
            const __m256 dw = _mm256_loadu_ps(scales + b * sp + 8 * h);
            for (int i = 0; i < mr; i++) {
                const float dx = xd[i * (K / QB) + b];
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                            _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[i][h]);
                if (has_offset(kind))
                    acc[i][h] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(scales + b * sp + GC + 8 * h),
                        _mm256_set1_ps(xds[i * (K / QB) + b]), acc[i][h]);
                if (kind == Q6_K_X8)
                    acc[i][h] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot2[i]),
                        _mm256_mul_ps(_mm256_loadu_ps(scales + b * sp + GC + 8 * h),
                                      _mm256_set1_ps(dx)), acc[i][h]);
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
        if (kind == Q4_1_X8) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m512i v = _mm512_loadu_si512((const void *)(cb + 64 * r));
                w[r] = _mm512_and_si512(v, low);
                w[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) w[r] = _mm512_loadu_si512((const void *)(cb + 64 * r));
        }
        const __m512 dw = _mm512_loadu_ps(scales + b * sp);
        /* two accumulation chains per row (even and odd r): VPDPBUSD's latency (~5 cycles)
         * bound one chain of 8 at few rows; the integer sums are exact, so the order does not
         * change a bit. Q8_0's - 128 S starts the even chain. Q6_K: the first chain sums
         * k 0..15 (r < 4), the second k 16..31, each started by its own - 128 S. */
        __m512i dot[MRQ], dot2[MRQ];
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            dot[i] = kind != Q4_1_X8 ? _mm512_set1_epi32(xk[2 * (i * nblk + b)])
                                     : _mm512_setzero_si512();
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
                acc[i] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(dot2[i]),
                    _mm512_mul_ps(_mm512_loadu_ps(scales + b * sp + GC), _mm512_set1_ps(dx)),
                    acc[i]);
            if (has_offset(kind))
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(scales + b * sp + GC),
                                         _mm512_set1_ps(xds[i * nblk + b]), acc[i]);
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
            if (kind == Q6_K_X8) {
                xk[2 * b] = -128 * xs[2 * b];
                xk[2 * b + 1] = -128 * xs[2 * b + 1];
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
