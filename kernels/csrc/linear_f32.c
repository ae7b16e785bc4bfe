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
 * stream. With M <= 4 the weights are streamed once; larger M re-reads a block of PANELS
 * panels (PANELS * 3 * K * 4 bytes: 110-295 KB for K = 576-1536, within a 512 KB L2) per group
 * of 4 rows. Threads (the caller's OpenMP pool: torch's libgomp) split the column blocks.
 */
#include "simd.h"
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define NR 3       /* weight rows (output columns) per panel */
#define MR_MAX 4   /* x rows per micro-kernel call */
#define PANELS 16  /* panels per block of columns a thread takes */

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

/* x: [M, K] (row stride ldx, unit column stride; ldx may be 0), packed: see above,
 * bias: [N] or NULL, y: [M, N] (row stride ldy). */
void sb_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t blocks = (panels + PANELS - 1) / PANELS;
    const int64_t panel_size = (K + 7) / 8 * NR * 8;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t p1 = (b + 1) * PANELS < panels ? (b + 1) * PANELS : panels;
        for (int64_t m = 0; m < M; m += MR_MAX) {
            const int64_t mr = M - m < MR_MAX ? M - m : MR_MAX;
            for (int64_t p = b * PANELS; p < p1; p++) {
                const int64_t n = p * NR, ncols = N - n < NR ? N - n : NR;
                MICROS[mr](x + m * ldx, ldx, packed + p * panel_size, bias ? bias + n : NULL,
                           y + m * ldy + n, ldy, K, ncols);
            }
        }
    }
}
