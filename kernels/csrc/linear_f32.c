/* Row-invariant float32 matmul for x86-64 CPUs with AVX2 + FMA: y = x w^T (+ bias).
 *
 * Built by kernels/cpu_build.py, called by kernels/linear_cpu.py (see there for the contract). Every output element
 * y[m, n] is computed the same way whatever M, the row's place in x and the thread count:
 * eight float32 FMA lanes over k = 0, 8, 16, ... (lane l sums k = l mod 8 in order; a last
 * partial chunk reads zeros past K), then a fixed horizontal sum ((l0+l4)+(l2+l6)) +
 * ((l1+l5)+(l3+l7)), then + bias[n]. Blocking over rows (MR <= 4) and columns only decides which
 * elements share registers, never the order of one element's sums, so a token's logits do not
 * depend on how many rows share a step (docs/design.md, "Batch invariance").
 *
 * The weight is packed once (kernels/linear_cpu.py, pack_weight): panel p holds rows 3p..3p+2
 * as [ceil(K / 8)][3][8] floats, zero past N and K, so a micro-kernel reads one sequential
 * stream. With M <= 4 the weights are streamed once; larger M re-reads a block of panels
 * (block_panels: at most 128 KB, so it stays in a 512 KB L2 beside the rows of x) per group
 * of 4 rows. Threads (the caller's OpenMP pool: torch's libgomp) split the column blocks.
 */
#include "simd.h"
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define NR 3       /* weight rows (output columns) per panel */
#define MR_MAX 4   /* x rows per micro-kernel call */
#define PANELS 16  /* most panels per block of columns a thread takes */
#define BLOCK_FLOATS 32768 /* ... and at most this many floats of packed weight (128 KB) */

/* panels per block: up to 16, the block's weights within 128 KB of L2 (K = 576: 16; K = 1536:
 * 7; a block that L2 cannot hold with the rows of x halved the speed of the down projection
 * at prompt-sized M). Blocking never changes an element's order of sums. */
static int64_t block_panels(int64_t panel_size) {
    const int64_t p = BLOCK_FLOATS / panel_size;
    return p < 1 ? 1 : p > PANELS ? PANELS : p;
}

/* MR rows of x times one panel: y[i, j] for i < MR, j < ncols (<= NR) */
#define MICRO(MR)                                                                           \
    static void micro_##MR(const float *x, int64_t ldx, const float *p, const float *bias,  \
                           float *y, int64_t ldy, int64_t K, int64_t ncols) {               \
        __m256 acc[MR][NR];                                                                 \
        for (int i = 0; i < MR; i++)                                                        \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                   \
        int64_t k = 0;                                                                      \
        for (; k + 8 <= K; k += 8, p += NR * 8) {                                           \
            __m256 wv[NR];                                                                  \
            for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(p + j * 8);                \
            for (int i = 0; i < MR; i++) {                                                  \
                __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                               \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
            }                                                                               \
        }                                                                                   \
        if (k < K) {                                                                        \
            __m256i m = _mm256_loadu_si256((const __m256i *)(TAIL_MASK + 8 - (K - k)));     \
            __m256 wv[NR];                                                                  \
            for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(p + j * 8);                \
            for (int i = 0; i < MR; i++) {                                                  \
                __m256 xv = _mm256_maskload_ps(x + i * ldx + k, m);                         \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MR; i++)                                                        \
            for (int j = 0; j < ncols; j++) {                                               \
                float s = hsum8(acc[i][j]);                                                 \
                y[i * ldy + j] = bias ? s + bias[j] : s;                                    \
            }                                                                               \
    }

MICRO(4)
MICRO(3)
MICRO(2)
MICRO(1)

typedef void (*micro_fn)(const float *, int64_t, const float *, const float *, float *, int64_t,
                         int64_t, int64_t);
static const micro_fn MICROS[MR_MAX + 1] = {NULL, micro_1, micro_2, micro_3, micro_4};

/* ---- AVX-512: two panels at once, the same arithmetic per element ----
 *
 * On a CPU with AVX-512 (F, VL, DQ) a 512-bit register holds the eight lanes of one element of
 * panel p (low half) and of the matching element of panel p + 1 (high half). Each lane runs
 * the same FMA on the same operands in the same k order as micro_MR's 256-bit lane, the tail
 * chunk included (x masked to zeros past K, the packed weight zero there), and each half is
 * reduced by hsum8: every output element has the AVX2 kernel's bits, so the two kernels can
 * share a run, a step or a matmul (tests/unit/test_linear_cpu.py compares them). Up to 8 rows
 * of x and 6 columns per call: 24 accumulators, each weight vector feeding 8 FMAs (the AVX2
 * micro-kernel's 4), which is what lets prompt-sized matmuls run at the wider units' speed. */
#define MR512 8

#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq")))

/* y[i, j] (panel p, low halves) and y[i, NR + j] (panel p + 1, high halves, j < nb) from the
 * accumulators of rows i < mr: hsum8 of each half, then + bias */
AVX512 static inline __attribute__((always_inline)) void store512(
        __m512 acc[][NR], int mr, const float *bias, float *y, int64_t ldy, int64_t nb) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            const float lo = hsum8(_mm512_castps512_ps256(acc[i][j]));
            y[i * ldy + j] = bias ? lo + bias[j] : lo;
            if (j < nb) {
                const float hi = hsum8(_mm512_extractf32x8_ps(acc[i][j], 1));
                y[i * ldy + NR + j] = bias ? hi + bias[NR + j] : hi;
            }
        }
}

AVX512 static inline __attribute__((always_inline)) void micro512(
        int mr, const float *x, int64_t ldx, const float *pa, const float *pb,
        const float *bias, float *y, int64_t ldy, int64_t K, int64_t ncols_b) {
    __m512 acc[MR512][NR];
    for (int i = 0; i < MR512; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8, pa += NR * 8, pb += NR * 8) {
        __m512 wv[NR];
        for (int j = 0; j < NR; j++)
            wv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(pa + j * 8)),
                                       _mm256_loadu_ps(pb + j * 8), 1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * ldx + k));
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) { /* the last partial chunk: x read as zeros past K (the packed weight is zero
                  * there); a masked load in the loop above halved its speed */
        const __mmask8 m = (__mmask8)((1u << (K - k)) - 1);
        __m512 wv[NR];
        for (int j = 0; j < NR; j++)
            wv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(pa + j * 8)),
                                       _mm256_loadu_ps(pb + j * 8), 1);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_maskz_loadu_ps(m, x + i * ldx + k));
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    store512(acc, mr, bias, y, ldy, ncols_b);
}

/* all 8 rows (mr a constant: the accumulators stay in registers), or a last 5-7 */
AVX512 static void micro512_8(const float *x, int64_t ldx, const float *pa, const float *pb,
                              const float *bias, float *y, int64_t ldy, int64_t K, int64_t nb) {
    micro512(MR512, x, ldx, pa, pb, bias, y, ldy, K, nb);
}

AVX512 static void micro512_n(int mr, const float *x, int64_t ldx, const float *pa,
                              const float *pb, const float *bias, float *y, int64_t ldy,
                              int64_t K, int64_t nb) {
    micro512(mr, x, ldx, pa, pb, bias, y, ldy, K, nb);
}

static int cpu_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

static int avx512_state = -1; /* -1: not decided yet */

static int use_avx512(void) {
    if (avx512_state < 0) avx512_state = cpu_has_avx512();
    return avx512_state;
}

/* enable: 0 turns the AVX-512 path off, 1 on (where the CPU has it), -1 leaves it as it is
 * (sb_linear_avx512_start(0) starts it off); returns whether it is in use. The bits are the
 * same either way: this is for tests and A/B timings. */
int sb_linear_avx512(int enable) {
    if (enable >= 0) avx512_state = enable && cpu_has_avx512();
    return use_avx512();
}

/* The state before anything set it: on = 0 starts on the AVX2 kernels (cpu_build passes
 * SPECBATCH_CPU_AVX512 from specbatch/settings.py at load). A state already set stays. */
void sb_linear_avx512_start(int on) {
    if (avx512_state < 0) avx512_state = on && cpu_has_avx512();
}

/* rows 0 .. M-1 of x times panels p0 .. p1-1, whose packed floats start at w (panel_size each):
 * y[:, 3 p0 ...]. AVX-512 for pairs of whole panels in groups of 8 rows (and a last group of
 * 5-7) when M >= 8 (fewer rows stream the weights once per 4 rows anyway); the AVX2
 * micro-kernels for an odd last panel and 1-4 leftover rows. Same bits either way. */
static void panel_rows(const float *x, int64_t ldx, const float *w, int64_t p0, int64_t p1,
                       int64_t panel_size, const float *bias, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K) {
    int64_t m = 0;
    if (M >= MR512 && use_avx512()) {
        for (; m + MR512 <= M || (m < M && M - m >= 5); m += MR512) {
            const int mr = M - m < MR512 ? (int)(M - m) : MR512;
            int64_t p = p0;
            for (; p + 2 <= p1; p += 2) { /* panel p + 1 has 1 .. NR real columns */
                const int64_t n = p * NR, nb = N - n - NR < NR ? N - n - NR : NR;
                const float *pa = w + (p - p0) * panel_size, *pb = pa + panel_size;
                const float *bn = bias ? bias + n : NULL;
                if (mr == MR512)
                    micro512_8(x + m * ldx, ldx, pa, pb, bn, y + m * ldy + n, ldy, K, nb);
                else
                    micro512_n(mr, x + m * ldx, ldx, pa, pb, bn, y + m * ldy + n, ldy, K, nb);
            }
            for (; p < p1; p++) {
                const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
                for (int64_t r = 0; r < mr; r += MR_MAX) {
                    const int64_t rr = mr - r < MR_MAX ? mr - r : MR_MAX;
                    MICROS[rr](x + (m + r) * ldx, ldx, w + (p - p0) * panel_size,
                               bias ? bias + n : NULL, y + (m + r) * ldy + n, ldy, K, ncols);
                }
            }
        }
    }
    for (; m < M; m += MR_MAX) {
        const int64_t mr = M - m < MR_MAX ? M - m : MR_MAX;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
            MICROS[mr](x + m * ldx, ldx, w + (p - p0) * panel_size, bias ? bias + n : NULL,
                       y + m * ldy + n, ldy, K, ncols);
        }
    }
}

/* x: [M, K] (row stride ldx, unit column stride; ldx may be 0), packed: see above,
 * bias: [N] or NULL, y: [M, N] (row stride ldy). */
void sb_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t panel_size = (K + 7) / 8 * NR * 8, per = block_panels(panel_size);
    const int64_t blocks = (panels + per - 1) / per;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t p0 = b * per, p1 = (b + 1) * per < panels ? (b + 1) * per : panels;
        panel_rows(x, ldx, packed + p0 * panel_size, p0, p1, panel_size, bias, y, ldy, M, N, K);
    }
}

/* ---- The same matmul on weights stored as exact 4-bit or 8-bit codes ----
 *
 * kernels/linear_cpu.py (pack_quantized) stores a weight whose float32 values are exactly
 * d * q + m (Q4_1: q in 0..15, per 32 k a float32 d with at most 11 significant bits and a float32
 * m) or d * q (Q8_0: q in -127..127), as a GGUF's Q4_1 / Q8_0 tensors dequantise to, and checks
 * the codes give back every weight bit for bit. Here each block of panels is rebuilt in
 * float32 (the float32 layout above; d * q is exact, so the one rounding of the FMA is the
 * rounding of the dequantiser's add) into a per-thread buffer, and the same micro-kernels run on
 * it: the outputs are the float32 kernel's, bit for bit, at a sixth (Q4_1) or a quarter (Q8_0)
 * of the bytes streamed from memory.
 *
 * Layout per panel p (rows 3p..3p+2) and block b of 32 k (K % 32 == 0):
 *   Q4_1: scales [p][b][3][2] (d, m) float32; codes [p][b][3][16] bytes, byte i < 8 holds
 *         k = 32b + i (low nibble) and 32b + 8 + i (high), byte 8 + i k = 32b + 16 + i and 24 + i;
 *   Q8_0: scales [p][b][3][1] (d) float32; codes [p][b][3][32] int8, k = 32b + i. */

#define Q4_1 1
#define Q8_0 2

/* Software prefetch of a stream of codes or scales PREFETCH_BYTES ahead of where a pass over
 * them reads (one line per call): as in linear_q8.c, a few-row matmul streams the weights
 * from memory once and otherwise waits on each block's loads. Changes no arithmetic; an
 * address past the end is dropped by the CPU, never a fault. */
#define PREFETCH_BYTES 4096

static inline __attribute__((always_inline)) void prefetch_ahead(const void *p) {
    _mm_prefetch((const char *)((uintptr_t)p + PREFETCH_BYTES), _MM_HINT_T0);
}

static __thread float *tl_buf = NULL;
static __thread int64_t tl_cap = 0;

static float *thread_buffer(int64_t floats) {
    if (floats > tl_cap) {
        free(tl_buf);
        tl_buf = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        tl_cap = tl_buf ? floats : 0;
    }
    return tl_buf;
}

/* panel p of the weight in the float32 layout [K / 8][3][8] */
static void dequant_panel(int kind, const float *scales, const uint8_t *codes, int64_t p,
                          int64_t nblk, float *out) {
    if (kind == Q4_1) {
        const float *s = scales + p * nblk * NR * 2;
        const uint8_t *c = codes + p * nblk * NR * 16;
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int64_t b = 0; b < nblk; b++)
            for (int j = 0; j < NR; j++, s += 2, c += 16) {
                const __m256 d = _mm256_broadcast_ss(s), m = _mm256_broadcast_ss(s + 1);
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
                    float *o = out + ((4 * b + 2 * h) * NR + j) * 8;
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(
                        d, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), m));
                    _mm256_storeu_ps(o + NR * 8, _mm256_fmadd_ps(
                        d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m));
                }
            }
    } else {
        const float *s = scales + p * nblk * NR;
        const int8_t *c = (const int8_t *)codes + p * nblk * NR * 32;
        for (int64_t b = 0; b < nblk; b++)
            for (int j = 0; j < NR; j++, s++, c += 32) {
                const __m256 d = _mm256_broadcast_ss(s);
                for (int h = 0; h < 4; h++) {
                    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
                    _mm256_storeu_ps(out + ((4 * b + h) * NR + j) * 8,
                                     _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
                }
            }
    }
}

/* M <= MR_MAX rows times one panel straight from the codes: each weight vector is rebuilt in a
 * register (the same value dequant_panel stores) and goes into the same FMA of the same
 * accumulator in the same k order as micro_MR on the rebuilt panel, so the bits are equal. */
static inline void fma_rows(int mr, const float *x, int64_t ldx, int64_t k, __m256 w,
                            __m256 *acc) {
    for (int i = 0; i < mr; i++)
        acc[i * NR] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), w, acc[i * NR]);
}

#define QMICRO(MR)                                                                          \
    static void qmicro_##MR(int kind, const float *x, int64_t ldx, const float *s,          \
                            const uint8_t *c, int64_t nblk, const float *bias, float *y,    \
                            int64_t ldy, int64_t ncols) {                                   \
        __m256 acc[MR][NR];                                                                 \
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++)                                \
            _Pragma("GCC unroll 3") for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps(); \
        const __m256i low = _mm256_set1_epi32(0x0F);                                        \
        for (int64_t b = 0; b < nblk; b++) {                                                \
            const int64_t k = 32 * b;                                                       \
            prefetch_ahead(c + b * NR * (kind == Q4_1 ? 16 : 32)); /* 48 or 96 B a block */  \
            if (kind == Q8_0) prefetch_ahead(c + b * NR * 32 + 64);                         \
            prefetch_ahead(s + b * NR * (kind == Q4_1 ? 2 : 1)); /* 24 or 12 B a block */    \
            _Pragma("GCC unroll 3") for (int j = 0; j < NR; j++) {                          \
                if (kind == Q4_1) {                                                         \
                    const float *sj = s + (b * NR + j) * 2;                                 \
                    const uint8_t *cj = c + (b * NR + j) * 16;                              \
                    const __m256 d = _mm256_broadcast_ss(sj), m = _mm256_broadcast_ss(sj + 1); \
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)cj)); \
                    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cj + 8))); \
                    fma_rows(MR, x, ldx, k, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(            \
                        _mm256_and_si256(v, low)), m), &acc[0][j]);                         \
                    fma_rows(MR, x, ldx, k + 8, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(        \
                        _mm256_srli_epi32(v, 4)), m), &acc[0][j]);                          \
                    fma_rows(MR, x, ldx, k + 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(       \
                        _mm256_and_si256(u, low)), m), &acc[0][j]);                         \
                    fma_rows(MR, x, ldx, k + 24, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(       \
                        _mm256_srli_epi32(u, 4)), m), &acc[0][j]);                          \
                } else {                                                                    \
                    const __m256 d = _mm256_broadcast_ss(s + b * NR + j);                   \
                    const int8_t *cj = (const int8_t *)c + (b * NR + j) * 32;               \
                    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++)                     \
                        fma_rows(MR, x, ldx, k + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps( \
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(cj + 8 * h))))), \
                            &acc[0][j]);                                                    \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MR; i++)                                                        \
            for (int j = 0; j < ncols; j++) {                                               \
                float v = hsum8(acc[i][j]);                                                 \
                y[i * ldy + j] = bias ? v + bias[j] : v;                                    \
            }                                                                               \
    }

QMICRO(1)
QMICRO(2)
QMICRO(3)
QMICRO(4)

#define QMICRO_MAX_M 8 /* AVX2, measured: from 9-12 rows the block path is faster */
#define QMICRO512_MAX_M 48 /* AVX-512 (passes of up to 8 rows), measured: 9-48 rows are
                            * 1.03-1.3x faster than the block path, 64 rows 0.98x (dense_rows.py) */

/* The fewest rows a pass over the codes takes on AVX-512 (fewer: the AVX2 qmicro). Which is
 * faster at 1-3 rows depends on the CPU's AVX-512 units (the bits are the same either way):
 * on an AVX-512 EPYC (Zen 4, 256-bit units) 1-3 rows ran 0.73-0.95x as fast on AVX-512 (its
 * per-16-weight decode cost more than it saved), so there it starts at 4 rows; on an Intel Xeon
 * (Emerald Rapids) 1-3 rows ran 1.2-1.3x faster on AVX-512 (a batch-1 float32 step of
 * SmolLM2-135M's Q4_1 / Q8_0 codes feeding 1, 2, 3 tokens 6.8, 8.4, 10.7 -> 5.8, 6.8, 8.2 ms;
 * on AVX2 3 tokens cost more than 4), so Intel CPUs start at 1. */
static int qmicro512_min_m = 0; /* 0: not decided yet */

static int qmicro512_from(void) {
    if (qmicro512_min_m == 0) qmicro512_min_m = __builtin_cpu_is("intel") ? 1 : 4;
    return qmicro512_min_m;
}

/* rows: 1-4 sets the fewest rows of an AVX-512 pass over the codes, anything else leaves it;
 * returns it. The bits are the same either way: this is for tests and A/B timings. */
int sb_linear_qmicro512_from(int rows) {
    if (rows >= 1 && rows <= 4) qmicro512_min_m = rows;
    return qmicro512_from();
}

typedef void (*qmicro_fn)(int, const float *, int64_t, const float *, const uint8_t *, int64_t,
                          const float *, float *, int64_t, int64_t);
static const qmicro_fn QMICROS[MR_MAX + 1] = {NULL, qmicro_1, qmicro_2, qmicro_3, qmicro_4};

/* Up to 8 rows times two panels (p: sa, ca; p + 1: sb, cb) straight from the codes, on AVX-512:
 * each 256-bit half of a weight register is rebuilt as qmicro rebuilds panel p's / p + 1's
 * vector (the same integer decode and the same d * q + m FMA, or d * q), and each accumulator
 * half takes the same FMAs in the same k order as qmicro's, so the bits are qmicro's (and so
 * the float32 kernel's). One pass over the codes serves all rows (qmicro: one per 4 rows).
 *
 * Register plan (32 zmm): the 24 accumulators stay in registers for the whole call. Each
 * 32-k block is taken in two halves of 16 k: the six weight vectors of a half (3 columns x 2
 * chunks of 8 k; Q4_1: the low and high nibbles of one 8-byte load) are rebuilt first, then
 * every row broadcasts its two x chunks and feeds the 3 columns. Rebuilding all 12 vectors of
 * a block at once would not fit beside the accumulators, and looping over columns outermost
 * made GCC keep the x broadcasts in registers and the accumulators on the stack (a load and a
 * store of each per column: 8 rows ran at ~60 GFLOP/s). */
AVX512 static inline __attribute__((always_inline)) __m512 pair_scale(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

AVX512 static inline __attribute__((always_inline)) __m512i pair_codes(const void *a,
                                                                        const void *b) {
    return _mm512_castsi128_si512(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                                     _mm_loadl_epi64((const __m128i *)b)));
}

AVX512 static inline __attribute__((always_inline)) void qmicro512(
        int mr, int kind, const float *x, int64_t ldx, const float *sa, const uint8_t *ca,
        const float *sb, const uint8_t *cb, int64_t nblk, const float *bias, float *y,
        int64_t ldy, int64_t nb) {
    __m512 acc[MR512][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR512; i++)
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t cs = kind == Q4_1 ? 16 : 32, ss = kind == Q4_1 ? 2 : 1;
        for (int64_t o = 0; o < NR * cs; o += 64) { /* 48 or 96 bytes of codes a block */
            prefetch_ahead(ca + b * NR * cs + o);
            prefetch_ahead(cb + b * NR * cs + o);
        }
        prefetch_ahead(sa + b * NR * ss);
        prefetch_ahead(sb + b * NR * ss);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) { /* k + 16 * half + [0, 16) */
            const int64_t k = 32 * b + 16 * half;
            __m512 w[NR][2];
#pragma GCC unroll 3
            for (int j = 0; j < NR; j++) {
                const int64_t e = b * NR + j;
                if (kind == Q4_1) {
                    const __m512 d = pair_scale(sa[2 * e], sb[2 * e]);
                    const __m512 m = pair_scale(sa[2 * e + 1], sb[2 * e + 1]);
                    const __m512i v = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(
                        pair_codes(ca + 16 * e + 8 * half, cb + 16 * e + 8 * half)));
                    w[j][0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), m);
                    w[j][1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
                } else {
                    const __m512 d = pair_scale(sa[e], sb[e]);
                    const int8_t *qa = (const int8_t *)ca + 32 * e + 16 * half;
                    const int8_t *qb = (const int8_t *)cb + 32 * e + 16 * half;
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++)
                        w[j][h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                            _mm512_castsi512_si128(pair_codes(qa + 8 * h, qb + 8 * h)))));
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * ldx + k + 8 * h));
#pragma GCC unroll 3
                    for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, w[j][h], acc[i][j]);
                }
        }
    }
    store512(acc, mr, bias, y, ldy, nb);
}

/* qmicro512 with the weight kind and mr constants (its accumulators then stay in registers) */
#define QMICRO512(MR)                                                                         \
    AVX512 static void qmicro512_##MR(int kind, const float *x, int64_t ldx, const float *sa, \
                                      const uint8_t *ca, const float *sb, const uint8_t *cb, \
                                      int64_t nblk, const float *bias, float *y, int64_t ldy,  \
                                      int64_t nb) {                                           \
        if (kind == Q4_1)                                                                     \
            qmicro512(MR, Q4_1, x, ldx, sa, ca, sb, cb, nblk, bias, y, ldy, nb);              \
        else                                                                                  \
            qmicro512(MR, Q8_0, x, ldx, sa, ca, sb, cb, nblk, bias, y, ldy, nb);              \
    }
QMICRO512(1)
QMICRO512(2)
QMICRO512(3)
QMICRO512(4)
QMICRO512(5)
QMICRO512(6)
QMICRO512(7)
QMICRO512(8)

typedef void (*qmicro512_fn)(int, const float *, int64_t, const float *, const uint8_t *,
                             const float *, const uint8_t *, int64_t, const float *, float *,
                             int64_t, int64_t);
static const qmicro512_fn QMICROS512[MR512 + 1] = {
    NULL, qmicro512_1, qmicro512_2, qmicro512_3, qmicro512_4, /* from qmicro512_from() rows */
    qmicro512_5, qmicro512_6, qmicro512_7, qmicro512_8};

#define Q4_1_X8 3 /* the kinds of linear_q8.c: the same codes, 8-bit activations */
#define Q8_0_X8 4
#define Q6_K_X8 5
#define SEGMENTS 6 /* rows in runs of different kinds: sb_segment below */
#define Q5_K_X8 7
#define Q4_K_X8 8
int sb_linear_q8(const float *x, int64_t ldx, int kind, const float *scales,
                 const uint8_t *codes, const float *bias, float *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K);

/* One run of a SEGMENTS weight: its rows n0 .. n0 + n - 1 as a weight of their own (kind,
 * scales, codes), e.g. the Q4_K q/k rows and the Q6_K v rows of a fused q/k/v. Each output
 * element is its run's own computation, so the bits are those of the runs apart. */
typedef struct {
    int64_t kind;
    const float *scales;
    const uint8_t *codes;
    int64_t n0, n;
} sb_segment;

/* As sb_linear_f32, with the weight given as (kind, scales, codes) above; K % 32 == 0.
 * Kinds Q4_1_X8 / Q8_0_X8 / Q6_K_X8 / Q5_K_X8 / Q4_K_X8 go to linear_q8.c (its own layout, 8-bit
 * activations);
 * SEGMENTS: scales points to the runs (sb_segment, in row order, covering 0 .. N - 1).
 * Returns 0, or -1 when a thread's buffer could not be allocated (y is then incomplete). */
int sb_linear_quant(const float *x, int64_t ldx, int kind, const float *scales,
                    const uint8_t *codes, const float *bias, float *y, int64_t ldy, int64_t M,
                    int64_t N, int64_t K) {
    if (kind == SEGMENTS) {
        const sb_segment *seg = (const sb_segment *)(const void *)scales;
        for (int64_t n = 0; n < N; seg++) {
            if (sb_linear_quant(x, ldx, (int)seg->kind, seg->scales, seg->codes,
                                bias ? bias + seg->n0 : NULL, y + seg->n0, ldy, M, seg->n, K))
                return -1;
            n = seg->n0 + seg->n;
        }
        return 0;
    }
    if (kind == Q4_1_X8 || kind == Q8_0_X8 || kind == Q6_K_X8 || kind == Q5_K_X8
        || kind == Q4_K_X8) /* int8 */
        return sb_linear_q8(x, ldx, kind, scales, codes, bias, y, ldy, M, N, K);
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t panel_size = K / 8 * NR * 8, nblk = K / 32;
    const int64_t ss = kind == Q4_1 ? 2 : 1, cs = kind == Q4_1 ? 16 : 32; /* per (block, col) */
    const int avx512 = use_avx512(), min512 = qmicro512_from();
    /* up to QMICRO_MAX_M (AVX-512: QMICRO512_MAX_M) rows: straight from the codes, every pass
     * over them rebuilding the weights in registers, PANELS panels per block (an even count,
     * so none is left to the AVX2 kernel; their codes are 55 KB at K = 1536); more: a block of
     * rebuilt float32 panels, as many as fit the L2 budget */
    const int from_codes = M <= (avx512 ? QMICRO512_MAX_M : QMICRO_MAX_M);
    const int64_t per = from_codes ? PANELS : block_panels(panel_size);
    const int64_t blocks = (panels + per - 1) / per;
    const int64_t group = avx512 ? MR512 : M; /* rows per pass over a block's codes */
    int failed = 0;
#pragma omp parallel
    {
        float *buf = from_codes ? NULL : thread_buffer(per * panel_size);
        if (!from_codes && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!from_codes && !buf) continue;
            const int64_t p0 = b * per, p1 = p0 + per < panels ? p0 + per : panels;
            if (!from_codes) {
                for (int64_t p = p0; p < p1; p++)
                    dequant_panel(kind, scales, codes, p, nblk, buf + (p - p0) * panel_size);
                panel_rows(x, ldx, buf, p0, p1, panel_size, bias, y, ldy, M, N, K);
                continue;
            }
            for (int64_t m = 0; m < M; m += group) {
                /* rows m..m+mr: pairs of panels on AVX-512 (one pass), the rest on AVX2 */
                const int64_t mr = M - m < group ? M - m : group;
                int64_t p = p0;
                if (avx512 && mr >= min512)
                    for (; p + 2 <= p1; p += 2) {
                        const int64_t n = p * NR, nb = N - n - NR < NR ? N - n - NR : NR;
                        const float *sa = scales + p * nblk * NR * ss;
                        const uint8_t *ca = codes + p * nblk * NR * cs;
                        QMICROS512[mr](kind, x + m * ldx, ldx, sa, ca, sa + nblk * NR * ss,
                                       ca + nblk * NR * cs, nblk, bias ? bias + n : NULL,
                                       y + m * ldy + n, ldy, nb);
                    }
                for (; p < p1; p++) {
                    const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
                    for (int64_t i = m; i < m + mr; i += MR_MAX) {
                        const int64_t r = m + mr - i < MR_MAX ? m + mr - i : MR_MAX;
                        QMICROS[r](kind, x + i * ldx, ldx, scales + p * nblk * NR * ss,
                                   codes + p * nblk * NR * cs, nblk, bias ? bias + n : NULL,
                                   y + i * ldy + n, ldy, ncols);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

