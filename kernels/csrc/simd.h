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

/* hsum8 of four vectors at once, bit for bit: [hsum8(a), hsum8(b), hsum8(c), hsum8(d)]. The
 * same adds in the same order per lane, with the lanes of four sums sharing each instruction
 * (9 shuffles and adds for four sums instead of 6 per sum). */
static inline __m128 hsum8_x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* x_i = l_i + l_{i+4}: [xa | xb] and [xc | xd] */
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                    _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20),
                                    _mm256_permute2f128_ps(c, d, 0x31));
    /* [xa0 + xa2, xa1 + xa3, xc0 + xc2, xc1 + xc3 | the same for b, d] */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* (x0 + x2) + (x1 + x3): [a, c, a, c | b, d, b, d] */
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* TAIL_MASK + 8 - r: a maskload/maskstore mask of the first r (1..7) lanes */
static const int32_t TAIL_MASK[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-5 polynomial),
 * relative error ~2e-7; inputs below -87.3 give ~1e-38, not 0 */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#endif
