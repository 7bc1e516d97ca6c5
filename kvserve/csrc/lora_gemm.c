/*
 * Grouped multi-LoRA GEMM (punica / S-LoRA): y[t] += scale[s] * B[s] (A[s] x[t]), s = idx[t],
 * rows with idx[t] < 0 untouched.
 *
 *   x  fp32 [T, K]          a fp32 [S, R, K]     bt fp32 [S, R, N] (B transposed)
 *                           (a and bt both bf16 instead with wbf16: --lora-dtype bfloat16)
 *   scale fp32 [S]          idx int64 [T]        y fp32 [T, N] (added to in place)
 *   noff int64 [H + 1]      the H shards of a fused linear: output columns
 *                           [noff[h], noff[h+1]) take ranks [h*R/H, (h+1)*R/H) (H divides R,
 *                           noff[0] = 0, noff[H] = N); entries of bt outside them are not read
 *   tmp fp32 [T, R]         order int64 [T]: scratch the caller allocates
 *
 * Twin: kvserve.kernels.reference.lora_delta (tests/kernels/test_lora_gemm.py). The rows are
 * first grouped by slot (a counting sort into `order`), so each adapter's A and B rows are read
 * once per group while they are hot:
 *   shrink  tmp[t, r] = scale[s] * A[s, r] . x[t], in parallel over the R ranks: one A row
 *           against four rows of the group at a time (four independent accumulators);
 *   expand  each thread owns a run of NB-column blocks, walked once per slot (one adapter's
 *           B^T rows streamed at a time); each row of the group accumulates
 *           sum_r tmp[t, r] * bt[s, r, block] over its shard's R/H ranks only (a fused q/k/v
 *           pays the rank of one shard per column, not of all three), vectorized along N with
 *           no horizontal sums.
 * Rank padding of a smaller adapter (zero rows of A / bt) still costs R/H: slots share one R.
 * The decode graphs record this kernel (kvs_lora_gemm_op: T is the row count, idx a graph
 * input), so a LoRA server replays decode steps like a plain one.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "kvs_op.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* out[k] = p . q[k] for k < 4 (n floats each): one pass over p, four accumulators */
static inline void dot4(const float *restrict p, const float *const q[4], int64_t n,
                        float out[4]) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (; i + 16 <= n; i += 16) {
        const __m512 pv = _mm512_loadu_ps(p + i);
        c0 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[0] + i), c0);
        c1 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[1] + i), c1);
        c2 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[2] + i), c2);
        c3 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[3] + i), c3);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 pv = _mm512_maskz_loadu_ps(m, p + i);
        c0 = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, q[0] + i), c0);
        c1 = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, q[1] + i), c1);
        c2 = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, q[2] + i), c2);
        c3 = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, q[3] + i), c3);
        i = n;
    }
    out[0] = _mm512_reduce_add_ps(c0);
    out[1] = _mm512_reduce_add_ps(c1);
    out[2] = _mm512_reduce_add_ps(c2);
    out[3] = _mm512_reduce_add_ps(c3);
#else
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX2__) && defined(__FMA__)
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (; i + 8 <= n; i += 8) {
        const __m256 pv = _mm256_loadu_ps(p + i);
        for (int k = 0; k < 4; k++)
            c[k] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(q[k] + i), c[k]);
    }
    for (int k = 0; k < 4; k++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(c[k]), _mm256_extractf128_ps(c[k], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        s[k] = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; i++)
        for (int k = 0; k < 4; k++)
            s[k] += p[i] * q[k][i];
    memcpy(out, s, sizeof s);
#endif
}

#define NB 64 /* output columns per expand block (4 AVX-512 vectors) */

/* yr[c] += sum_{r < rh} v[r] * br[r * ldb + c] for c < len (<= NB) */
static inline void expand_row(float *restrict yr, const float *restrict v,
                              const float *restrict br, int64_t ldb, int64_t rh, int64_t len) {
#if defined(__AVX512F__)
    __mmask16 m[4];
    __m512 acc[4];
    for (int k = 0; k < 4; k++) {
        const int64_t left = len - 16 * k;
        m[k] = left >= 16 ? (__mmask16)0xFFFF
                          : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        acc[k] = _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < rh; r++) {
        const __m512 vr = _mm512_set1_ps(v[r]);
        const float *b = br + r * ldb;
        for (int k = 0; k < 4; k++)
            acc[k] = _mm512_fmadd_ps(vr, _mm512_maskz_loadu_ps(m[k], b + 16 * k), acc[k]);
    }
    for (int k = 0; k < 4; k++)
        if (m[k])
            _mm512_mask_storeu_ps(yr + 16 * k, m[k],
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(m[k], yr + 16 * k),
                                                acc[k]));
#else
    float acc[NB];
    for (int64_t c = 0; c < len; c++)
        acc[c] = 0.0f;
    for (int64_t r = 0; r < rh; r++) {
        const float vr = v[r], *b = br + r * ldb;
        for (int64_t c = 0; c < len; c++)
            acc[c] += vr * b[c];
    }
    for (int64_t c = 0; c < len; c++)
        yr[c] += acc[c];
#endif
}

/* ---- bf16 adapter weights (--lora-dtype bfloat16): the same loops, A / B^T rows widened to
 * fp32 as they are read (exact), half the bytes streamed per step ---- */
static inline float bf16f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void dot4_bf16(const uint16_t *restrict p, const float *const q[4], int64_t n,
                             float out[4]) {
    int64_t i = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX512F__)
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (; i + 16 <= n; i += 16) {
        const __m512 pv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + i))), 16));
        c0 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[0] + i), c0);
        c1 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[1] + i), c1);
        c2 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[2] + i), c2);
        c3 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(q[3] + i), c3);
    }
    s[0] = _mm512_reduce_add_ps(c0);
    s[1] = _mm512_reduce_add_ps(c1);
    s[2] = _mm512_reduce_add_ps(c2);
    s[3] = _mm512_reduce_add_ps(c3);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (; i + 8 <= n; i += 8) {
        const __m256 pv = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + i))), 16));
        for (int k = 0; k < 4; k++)
            c[k] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(q[k] + i), c[k]);
    }
    for (int k = 0; k < 4; k++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(c[k]), _mm256_extractf128_ps(c[k], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        s[k] = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; i++) {
        const float pv = bf16f(p[i]);
        for (int k = 0; k < 4; k++)
            s[k] += pv * q[k][i];
    }
    memcpy(out, s, sizeof s);
}

static inline void expand_row_bf16(float *restrict yr, const float *restrict v,
                                   const uint16_t *restrict br, int64_t ldb, int64_t rh,
                                   int64_t len) {
    float acc[NB];
    int64_t c = 0;
#if defined(__AVX512F__)
    __m512 av[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                    _mm512_setzero_ps()};
    const int64_t full = len / 16; /* whole 16-column vectors; the tail below in scalar */
    for (int64_t r = 0; r < rh; r++) {
        const __m512 vr = _mm512_set1_ps(v[r]);
        const uint16_t *b = br + r * ldb;
        for (int64_t k = 0; k < full; k++)
            av[k] = _mm512_fmadd_ps(vr, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 16 * k))), 16)),
                av[k]);
    }
    for (int64_t k = 0; k < full; k++)
        _mm512_storeu_ps(acc + 16 * k, av[k]);
    c = 16 * full;
#endif
    for (int64_t j = c; j < len; j++)
        acc[j] = 0.0f;
    for (int64_t r = 0; r < rh; r++) {
        const float vr = v[r];
        const uint16_t *b = br + r * ldb;
        for (int64_t j = c; j < len; j++)
            acc[j] += vr * bf16f(b[j]);
    }
    for (int64_t j = 0; j < len; j++)
        yr[j] += acc[j];
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

/* Returns the number of rows with an adapter (0: nothing was done), -1 for a slot >= S or
 * shards that do not split R / N. ``wbf16``: a and bt hold bf16 (uint16) rather than fp32. */
int64_t kvs_lora_gemm(const void *restrict a_, const void *restrict bt_, int64_t wbf16,
                      const float *restrict x, const int64_t *restrict idx,
                      const float *restrict scale, const int64_t *restrict noff, int64_t T,
                      int64_t K, int64_t N, int64_t R, int64_t S, int64_t H, int num_threads,
                      float *restrict tmp, int64_t *restrict order, float *restrict y) {
    const float *a = (const float *)a_, *bt = (const float *)bt_;
    const uint16_t *a16 = (const uint16_t *)a_, *bt16 = (const uint16_t *)bt_;
    if (H < 1 || R % H != 0 || noff[0] != 0 || noff[H] != N)
        return -1;
    const int64_t rh = R / H;
    /* counting sort of the rows with an adapter by slot (stable: row order kept per slot) */
    int64_t start[S + 1], fill[S];
    memset(start, 0, sizeof start);
    for (int64_t t = 0; t < T; t++) {
        if (idx[t] >= S)
            return -1;
        if (idx[t] >= 0)
            start[idx[t] + 1]++;
    }
    for (int64_t s = 0; s < S; s++)
        start[s + 1] += start[s];
    const int64_t m = start[S];
    if (m == 0)
        return 0;
    memcpy(fill, start, sizeof fill);
    for (int64_t t = 0; t < T; t++)
        if (idx[t] >= 0)
            order[fill[idx[t]]++] = t;
    /* shrink: tmp[t, r] = scale[s] * A[s, r] . x[t], four rows of a slot's group at a time */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t s = 0; s < S; s++) {
            const int64_t arow = (s * R + r) * K;
            const float sc = scale[s];
            for (int64_t j = start[s]; j < start[s + 1]; j += 4) {
                const int64_t rows = start[s + 1] - j < 4 ? start[s + 1] - j : 4;
                const float *q[4];
                for (int64_t k = 0; k < 4; k++)
                    q[k] = x + order[j + (k < rows ? k : rows - 1)] * K;
                float o[4];
                if (wbf16)
                    dot4_bf16(a16 + arow, q, K, o);
                else
                    dot4(a + arow, q, K, o);
                for (int64_t k = 0; k < rows; k++)
                    tmp[order[j + k] * R + r] = sc * o[k];
            }
        }
    }
    /* expand: y[t, c] += sum over c's shard h of tmp[t, r] * bt[s, r, c]. Each thread owns a
     * run of NB-column blocks and walks it once per slot: one slot's R/H rows of B^T are read
     * as ascending streams at a time (all slots at once would be S times the streams) */
    const int64_t nblk = (N + NB - 1) / NB;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t b0 = nblk * id / nt, b1 = nblk * (id + 1) / nt;
        for (int64_t s = 0; s < S; s++) {
            if (start[s] == start[s + 1])
                continue;
            int64_t h = 0;
            for (int64_t blk = b0; blk < b1; blk++) {
                const int64_t cend = blk * NB + NB < N ? blk * NB + NB : N;
                for (int64_t c0 = blk * NB; c0 < cend;) {
                    while (noff[h + 1] <= c0)
                        h++;
                    const int64_t c1 = noff[h + 1] < cend ? noff[h + 1] : cend;
                    const int64_t brow = (s * R + h * rh) * N + c0;
                    for (int64_t j = start[s]; j < start[s + 1]; j++) {
                        const int64_t t = order[j];
                        if (wbf16)
                            expand_row_bf16(y + t * N + c0, tmp + t * R + h * rh, bt16 + brow,
                                            N, rh, c1 - c0);
                        else
                            expand_row(y + t * N + c0, tmp + t * R + h * rh, bt + brow, N, rh,
                                       c1 - c0);
                    }
                    c0 = c1;
                }
            }
        }
    }
    return m;
}

int kvs_lora_gemm_op(const int64_t *a) {
    return kvs_lora_gemm(OP_P(0), OP_P(1), a[2], OP_P(3), OP_P(4), OP_P(5), OP_P(6), a[7], a[8],
                         a[9], a[10], a[11], a[12], (int)a[13], OP_P(14), OP_P(15),
                         OP_P(16)) < 0;
}
