/* Greedy choice at the fed positions of a step, in one pass per position over the logits: the
 * argmax among the tokens a packed grammar bitmask allows (all tokens without one), ties to the
 * lowest id, and whether the position's logits hold a NaN.
 *
 * Built by kernels/cpu_build.py, called by kernels/select_cpu.py. It replaces, for all-greedy
 * steps on the CPU, the torch sequence gather (index_select), copy, grammar mask (xgrammar's
 * apply), argmax and NaN check, five to six passes over ~200 KB per position (SmolLM2's 49,152
 * tokens) that cost ~0.15 ms per fed position on the 2-core VM. The result equals that
 * sequence's: the argmax of the masked logits is the first index among the maxima of the
 * allowed tokens; where no allowed token is above -inf (or none is allowed) every masked
 * logit is -inf and torch's argmax gives index 0, and so does this. A NaN anywhere in a
 * position's logits (allowed or not) sets its flag; the id is then unused.
 *
 * Bitmask layout (xgrammar's): int32 words [T][W], W = ceil(V / 32); bit v % 32 of word v / 32
 * set: token v allowed. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* lanes' bits 0..7 of a mask byte as a vector mask */
static inline __m256 lane_mask(uint32_t bits, __m256i lanes) {
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)bits), lanes);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lanes));
}

static void select_one(const float *x, int64_t V, const int32_t *mask, int64_t *id, uint8_t *nan) {
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 neg = _mm256_set1_ps(-INFINITY);
    __m256 best = neg, bad = _mm256_setzero_ps();
    const int64_t V8 = V & ~(int64_t)7;
    for (int64_t v = 0; v < V8; v += 8) {
        const __m256 val = _mm256_loadu_ps(x + v);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(val, val, _CMP_UNORD_Q));
        if (mask) {
            const uint32_t bits = ((uint32_t)mask[v >> 5] >> (v & 31)) & 0xFFu;
            if (!bits) continue;
            best = _mm256_max_ps(best, _mm256_blendv_ps(neg, val, lane_mask(bits, lanes)));
        } else {
            best = _mm256_max_ps(best, val);
        }
    }
    float lanes_best[8], m;
    _mm256_storeu_ps(lanes_best, best);
    m = lanes_best[0];
    for (int j = 1; j < 8; j++) m = lanes_best[j] > m ? lanes_best[j] : m;
    int has_nan = _mm256_movemask_ps(bad) != 0;
    for (int64_t v = V8; v < V; v++) {
        has_nan |= isnan(x[v]);
        if ((!mask || ((uint32_t)mask[v >> 5] >> (v & 31)) & 1u) && x[v] > m) m = x[v];
    }
    *nan = (uint8_t)has_nan;
    *id = 0;
    if (has_nan || m == -INFINITY) return;
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t v = 0; v < V8; v += 8) { /* the first allowed index holding the maximum */
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), mv, _CMP_EQ_OQ));
        if (mask) hit &= (int)(((uint32_t)mask[v >> 5] >> (v & 31)) & 0xFFu);
        if (hit) {
            *id = v + __builtin_ctz((unsigned)hit);
            return;
        }
    }
    for (int64_t v = V8; v < V; v++)
        if ((!mask || ((uint32_t)mask[v >> 5] >> (v & 31)) & 1u) && x[v] == m) {
            *id = v;
            return;
        }
}

/* logits: rows of V floats, row stride ld; index [T]: the row of each fed position; bitmask
 * [T][W] or NULL; out: ids [T] int64, nan [T] uint8. Positions run in parallel. */
void sb_greedy_select(const float *logits, int64_t ld, const int64_t *index, int64_t T, int64_t V,
                      const int32_t *bitmask, int64_t W, int64_t *ids, uint8_t *nan) {
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++)
        select_one(logits + index[t] * ld, V, bitmask ? bitmask + t * W : 0, ids + t, nan + t);
}
