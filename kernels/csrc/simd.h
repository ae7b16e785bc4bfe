/* AVX2 helpers shared by the C kernels (one definition, so their fixed reduction orders agree
 * with the documentation in each kernel). */
#ifndef SPECBATCH_SIMD_H
#define SPECBATCH_SIMD_H
#include <immintrin.h>
#include <stdint.h>

/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)): the fixed horizontal sum of eight lanes */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* TAIL_MASK + 8 - r: a maskload/maskstore mask of the first r (1..7) lanes */
static const int32_t TAIL_MASK[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

#endif
