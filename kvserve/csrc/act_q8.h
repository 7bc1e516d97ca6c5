/* Activation quantization to int8 blocks of 32 columns, shared by the integer-dot GEMMs
 * (kvserve/csrc/wq_gemm.c, kvserve/csrc/kq_gemm.c): llama.cpp's Q8 activation blocks, plus an
 * optional second int8 term for the remainder. Include after <immintrin.h> where __AVX2__.
 *
 * Per 32-column block: v = x * (127 / amax), q = rint(v) clamped to +-127, dx = amax / 127
 * (a zero block: dx = 0, q = 0), qs = sum q. terms == 2 also gives the remainder
 * q' = rint((v - q) * 254), dx' = dx / 254, qs' = sum q'. Twin:
 * kvserve.kernels.reference.wq_quantize_act (same fp32 operations: bit-identical). */
#ifndef KVS_ACT_Q8_H
#define KVS_ACT_Q8_H
#include <math.h>
#include <stdint.h>

/* no contraction of x * inv - q into an FMA: include after the users' #pragma GCC optimize
 * ("fp-contract=off") */
#if defined(__AVX2__)
/* one 32-column block of one row, the scalar loop below in vector form (same fp32 operations:
 * a product, a round to nearest even, a clamp; amax ignores NaN as fmaxf does) */
static inline void quant_block_avx2(const float *restrict xb, int terms, int8_t *restrict q,
                                    int8_t *restrict q2, float *restrict dx, int32_t *restrict qs,
                                    float *restrict dx2, int32_t *restrict qs2) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 x[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(xb + 8 * j);
        m = _mm256_max_ps(_mm256_and_ps(x[j], absmask), m); /* NaN lanes keep m */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i r32[4], s32[4];
    __m256i sum = _mm256_setzero_si256(), sum2 = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_mul_ps(x[j], inv);
        /* max(r, lo) with r first: a NaN r gives lo, as fmaxf(NaN, lo) does */
        const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(v, rnd), lo), hi);
        r32[j] = _mm256_cvtps_epi32(r);
        sum = _mm256_add_epi32(sum, r32[j]);
        if (terms == 2) {
            const __m256 e = _mm256_mul_ps(_mm256_sub_ps(v, r), _mm256_set1_ps(254.0f));
            const __m256 r2 = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(e, rnd), lo), hi);
            s32[j] = _mm256_cvtps_epi32(r2);
            sum2 = _mm256_add_epi32(sum2, s32[j]);
        }
    }
    /* 4 x 8 int32 -> 32 int8 in column order (packs interleave 128-bit lanes: permute back) */
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r32[0], r32[1]),
                                   _mm256_packs_epi32(r32[2], r32[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, perm));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_hadd_epi32(h, h);
    *qs = _mm_cvtsi128_si32(_mm_hadd_epi32(h, h));
    *dx = amax / 127.0f;
    if (terms == 2) {
        p = _mm256_packs_epi16(_mm256_packs_epi32(s32[0], s32[1]),
                               _mm256_packs_epi32(s32[2], s32[3]));
        _mm256_storeu_si256((__m256i *)q2, _mm256_permutevar8x32_epi32(p, perm));
        h = _mm_add_epi32(_mm256_castsi256_si128(sum2), _mm256_extracti128_si256(sum2, 1));
        h = _mm_hadd_epi32(h, h);
        *qs2 = _mm_cvtsi128_si32(_mm_hadd_epi32(h, h));
        *dx2 = *dx / 254.0f;
    }
}
#endif


/* one 32-column block of one row: q (and with terms == 2, q2) int8 [32], dx / qs (dx2 / qs2) */
static inline void kvs_quant_block(const float *restrict xb, int terms, int8_t *restrict q,
                                   int8_t *restrict q2, float *restrict dx,
                                   int32_t *restrict qs, float *restrict dx2,
                                   int32_t *restrict qs2) {
#if defined(__AVX2__)
    if (terms == 2)
        quant_block_avx2(xb, 2, q, q2, dx, qs, dx2, qs2);
    else
        quant_block_avx2(xb, 1, q, NULL, dx, qs, NULL, NULL);
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0, s2 = 0;
    for (int j = 0; j < 32; j++) {
        const float v = xb[j] * inv;
        const float r = fminf(fmaxf(nearbyintf(v), -127.0f), 127.0f);
        q[j] = (int8_t)r;
        s += (int32_t)r;
        if (terms == 2) {
            const float r2 = fminf(fmaxf(nearbyintf((v - r) * 254.0f), -127.0f), 127.0f);
            q2[j] = (int8_t)r2;
            s2 += (int32_t)r2;
        }
    }
    *dx = amax / 127.0f;
    *qs = s;
    if (terms == 2) {
        *dx2 = *dx / 254.0f;
        *qs2 = s2;
    }
#endif
}
#endif
