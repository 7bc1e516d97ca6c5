/*
 * Q8_0 GEMV / skinny GEMM for a GGUF model's LM head: y[m, n] = sum_g d[n, g] *
 * sum_{k in g} q[n, k] x[m, k], fp32 activations and accumulation.
 *
 *   q  int8  [N, K]      (K a multiple of 32)
 *   d  fp16  [N, K/32]   one scale per 32 weights of a row
 *   x  fp32  [M, K],  y fp32 [M, N]
 *
 * Twin: kvserve.quant.gguf_q8.dequantize_q8 -> x @ W^T (tests/quant/test_q8.py). Rows of W are
 * independent: OpenMP over N; each row's 32-byte groups are widened once per row of x (the
 * row stays in L1 across the M rows of x).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "half.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif


void kvs_q8_gemv(const int8_t *restrict q, const uint16_t *restrict d,
                 const float *restrict x, int64_t M, int64_t N, int64_t K, int num_threads,
                 float *restrict y) {
    const int64_t ng = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qr = q + n * K;
        const uint16_t *dr = d + n * ng;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
#ifdef __AVX2__
            __m256 acc = _mm256_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                const int8_t *qg = qr + 32 * g;
                const float *xg = xr + 32 * g;
                __m256 t = _mm256_setzero_ps();
                for (int i = 0; i < 4; i++) {
                    const __m128i b = _mm_loadl_epi64((const __m128i *)(qg + 8 * i));
                    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                    t = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + 8 * i), t);
                }
                acc = _mm256_fmadd_ps(t, _mm256_set1_ps(kvs_f16f(dr[g])), acc);
            }
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            y[m * N + n] = _mm_cvtss_f32(s);
#else
            float acc = 0.0f;
            for (int64_t g = 0; g < ng; g++) {
                float t = 0.0f;
                for (int i = 0; i < 32; i++)
                    t += (float)qr[32 * g + i] * xr[32 * g + i];
                acc += t * kvs_f16f(dr[g]);
            }
            y[m * N + n] = acc;
#endif
        }
    }
}
