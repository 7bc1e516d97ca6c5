/*
 * Integrity checksum sums of KV blocks (kvserve/cache/integrity.py, module docstring):
 * for each (block, layer) region of N int16 words w_i,
 *
 *     S1 = sum_i w_i            S2 = sum_i (i + 1) * w_i            (exact, int64)
 *
 * Twin: integrity._sums_numpy (the numpy reductions); tests/cache/test_block_sums.py checks
 * bit-equality over shapes, dtypes and extreme words.
 *
 * One pass, no int64 multiplies: the words are read as rows of 16 lanes (i = 16 r + c);
 * per lane, a1 = running sum of w and a2 = running sum of a1 (int32, flushed to int64 every
 * FLUSH rows, small enough that neither can overflow), so that at the end
 *     G_c = sum_r P_c(r) = sum_r (R - r) w_rc      (P_c(r): prefix sum of lane c up to row r)
 *     sum_r r w_rc = R S1_c - G_c
 *     S2 = 16 sum_c (R S1_c - G_c) + sum_c (c + 1) S1_c
 * gcc vectorizes the 16-lane loop; a tail of N % 16 words is added directly.
 *
 * Regions: region (b, l) starts at base + l * layer_stride + block_ids[b] * block_stride
 * (in words). Parallel over blocks with OpenMP.
 */
#include <stdint.h>
#include <omp.h>

#define LANES 16
#define FLUSH 128 /* rows per int32 window: |a1| <= 128 * 32768 = 2^22, |a2| <= 2^29 */

static void region_sums(const int16_t *restrict w, int64_t n, int64_t *restrict s1_out,
                        int64_t *restrict s2_out) {
    const int64_t rows = n / LANES;
    int64_t S1[LANES] = {0}, G[LANES] = {0};
    for (int64_t r0 = 0; r0 < rows; r0 += FLUSH) {
        const int64_t r1 = r0 + FLUSH < rows ? r0 + FLUSH : rows;
        int32_t a1[LANES] = {0}, a2[LANES] = {0};
        for (int64_t r = r0; r < r1; r++) {
            const int16_t *row = w + r * LANES;
            for (int c = 0; c < LANES; c++) {
                a1[c] += row[c];
                a2[c] += a1[c];
            }
        }
        /* rows of this window also carry the prefix of all earlier windows (S1 so far) */
        for (int c = 0; c < LANES; c++) {
            G[c] += (int64_t)a2[c] + (r1 - r0) * S1[c];
            S1[c] += a1[c];
        }
    }
    int64_t s1 = 0, s2 = 0;
    for (int c = 0; c < LANES; c++) {
        s1 += S1[c];
        s2 += LANES * (rows * S1[c] - G[c]) + (int64_t)(c + 1) * S1[c];
    }
    for (int64_t i = rows * LANES; i < n; i++) { /* tail */
        s1 += w[i];
        s2 += (i + 1) * (int64_t)w[i];
    }
    *s1_out = s1;
    *s2_out = s2;
}

/* out [n_blocks, L, 2] int64 (S1, S2) */
void kvs_block_sums(const int16_t *base, int64_t layer_stride, int64_t block_stride,
                    int64_t words, const int64_t *block_ids, int64_t n_blocks, int64_t L,
                    int num_threads, int64_t *out) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < n_blocks; b++)
        for (int64_t l = 0; l < L; l++) {
            const int16_t *w = base + l * layer_stride + block_ids[b] * block_stride;
            region_sums(w, words, out + (b * L + l) * 2, out + (b * L + l) * 2 + 1);
        }
}
