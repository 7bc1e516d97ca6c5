/*
 * Grouped multi-LoRA GEMM (punica / S-LoRA): y[t] += scale[s] * B[s] (A[s] x[t]), s = idx[t],
 * rows with idx[t] < 0 untouched.
 *
 *   x  fp32 [T, K]          a fp32 [S, R, K]     b fp32 [S, N, R]     scale fp32 [S]
 *   idx int64 [T]           y fp32 [T, N] (added to in place)
 *   tmp fp32 [T, R]         order int64 [T]: scratch the caller allocates
 *
 * Twin: kvserve.kernels.reference.lora_delta (tests/kernels/test_lora_gemm.py). The rows are
 * first grouped by slot (a counting sort into `order`), so each adapter's A and B rows are read
 * once per group while they are hot: shrink in parallel over the R ranks (one A row against
 * every row of the group), expand in parallel over blocks of N outputs (one B block against
 * every row of the group). Rank padding (zero rows of A, zero columns of B) costs R, not the
 * adapter's own rank: slots share one R per layer.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float dot(const float *restrict p, const float *restrict q, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(q + i), acc);
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + i), _mm512_maskz_loadu_ps(m, q + i),
                              acc);
        i = n;
    }
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(q + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    s = _mm_cvtss_f32(h);
#endif
    for (; i < n; i++)
        s += p[i] * q[i];
    return s;
}

/* Which SIMD path this build has: 2 AVX-512, 1 AVX2, 0 plain C (tests). */
int kvs_lora_simd(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#define NBLOCK 64

/* Returns the number of rows with an adapter (0: nothing was done), -1 for a slot >= S. */
int64_t kvs_lora_gemm(const float *restrict x, const float *restrict a,
                      const float *restrict b, const int64_t *restrict idx,
                      const float *restrict scale, int64_t T, int64_t K, int64_t N, int64_t R,
                      int64_t S, int num_threads, float *restrict tmp, int64_t *restrict order,
                      float *restrict y) {
    /* counting sort of the rows with an adapter by slot (stable: row order kept per slot) */
    int64_t count[S + 1];
    memset(count, 0, sizeof count);
    for (int64_t t = 0; t < T; t++) {
        if (idx[t] >= S)
            return -1;
        if (idx[t] >= 0)
            count[idx[t] + 1]++;
    }
    for (int64_t s = 0; s < S; s++)
        count[s + 1] += count[s];
    const int64_t m = count[S];
    if (m == 0)
        return 0;
    for (int64_t t = 0; t < T; t++)
        if (idx[t] >= 0)
            order[count[idx[t]]++] = t;
    /* shrink: tmp[t, r] = A[s, r] . x[t] */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t j = 0; j < m; j++) {
            const int64_t t = order[j];
            tmp[t * R + r] = dot(a + (idx[t] * R + r) * K, x + t * K, K);
        }
    }
    /* expand: y[t, n] += scale[s] * B[s, n] . tmp[t] */
    const int64_t nb = (N + NBLOCK - 1) / NBLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t n0 = blk * NBLOCK, n1 = n0 + NBLOCK < N ? n0 + NBLOCK : N;
        for (int64_t j = 0; j < m; j++) {
            const int64_t t = order[j], s = idx[t];
            const float sc = scale[s], *tr = tmp + t * R;
            const float *bs = b + s * N * R;
            float *yr = y + t * N;
            for (int64_t n = n0; n < n1; n++)
                yr[n] += sc * dot(bs + n * R, tr, R);
        }
    }
    return m;
}
