/*
 * INT4 weight-only GEMV / skinny GEMM (W4A32) for decode, reading the bytes that torch's
 * `_convert_weight_to_int4pack_for_cpu` produced (so the layer holds one packed copy, shared
 * with `_weight_int4pack_mm_for_cpu`, which keeps the larger-M work).
 *
 * Twin: Int4Linear.dequantize() -> x @ W^T (kvserve/layers/int4/methods.py); the test
 * tests/quant/test_int4_gemv.py sweeps shapes against it.
 *
 * Packed layout ("halves" mode, block_n = BN in {32, 64}; found by int4pack_layout()):
 *
 *   packed  uint8 [N/BN, K, BN/2]      byte j of (block b, column k):
 *                                        low  nibble = row b*BN + j
 *                                        high nibble = row b*BN + BN/2 + j
 *   sz      bf16  [K/G, N, 2]          (s, z) per (group, row): w = (u - 8) * s + z
 *      or  fp16  [K/G, N, 2]          min_form: (s, m), w = u * s + m  (GGUF Q4_0 / Q4_1,
 *                                     whose fp16 d and m it holds exactly)
 *
 * Work unit = 16 bytes of one block's k-row = 32 rows:
 *
 *        byte offset c*16 ... c*16+15 of each k-row (c = 0 .. BN/32 - 1)
 *        low nibbles  -> rows lo0 = b*BN + 16c      .. lo0 + 15
 *        high nibbles -> rows hi0 = b*BN + BN/2 + 16c .. hi0 + 15
 *
 * Per group g and row n:  y[m,n] += s * sum_k u[n,k] x[m,k] + (z - 8 s) * sum_k x[m,k],
 * so the inner loop is a plain dot of unsigned nibbles with x (fp32 FMAs); xs[m, g] =
 * sum_{k in g} x[m, k] comes precomputed. Units are independent: OpenMP over units, rows of
 * x in tiles of 2 (14 ymm registers live in the AVX2 loop).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "half.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Rows of the 32 outputs of a unit, in vector order: lo0..lo0+15, hi0..hi0+15. */
static inline int64_t unit_row(int64_t lo0, int64_t hi0, int r) {
    return r < 16 ? lo0 + r : hi0 + (r - 16);
}

#ifdef __AVX2__
/*
 * Nibble extraction without shuffles. The 16 bytes of a k-row are broadcast to both 128-bit
 * halves (4 dwords each); vector t (t = 0..3) masks, in each dword d, the low nibble of byte t
 * (lanes 0-3) and its high nibble (lanes 4-7) *in place*: the int32 is u * 2^p (p = 8t or
 * 8t + 4), converted to fp32 exactly. The 2^-p factor is applied once per group to the sums.
 * For t = 3 the dword is shifted right by 4 first so that nibble 7 (bits 28-31) stays positive
 * (p = 20 / 24). Lane l of vector t holds row  4l + t  (l < 4)  or  16 + 4(l - 4) + t.
 */
static inline int vrow(int t, int l) { return l < 4 ? 4 * l + t : 16 + 4 * (l - 4) + t; }

#define KVS_UNPACK(ptr, w0, w1, w2, w3)                                                 \
    do {                                                                                 \
        const __m256i v_ = _mm256_broadcastsi128_si256(                                  \
            _mm_loadu_si128((const __m128i *)(ptr)));                                    \
        w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v_, mk0));                              \
        w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v_, mk1));                              \
        w2 = _mm256_cvtepi32_ps(_mm256_and_si256(v_, mk2));                              \
        w3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v_, 4), mk3));        \
    } while (0)

#define KVS_MASKS                                                                        \
    const __m256i mk0 = _mm256_setr_epi32(0xF, 0xF, 0xF, 0xF, 0xF0, 0xF0, 0xF0, 0xF0);   \
    const __m256i mk1 = _mm256_slli_epi32(mk0, 8);                                       \
    const __m256i mk2 = _mm256_slli_epi32(mk0, 16);                                      \
    const __m256i mk3 = _mm256_slli_epi32(mk0, 20)

/* Undo the 2^p factors and the lane order: a[t] -> acc[row]. */
static inline void unscramble(const __m256 a[4], float *restrict acc) {
    static const float inv[4][2] = {
        {1.0f, 1.0f / 16}, {1.0f / 256, 1.0f / 4096},
        {1.0f / 65536, 1.0f / 1048576}, {1.0f / 1048576, 1.0f / 16777216}};
    float tmp[8];
    for (int t = 0; t < 4; t++) {
        const __m256 f = _mm256_setr_ps(inv[t][0], inv[t][0], inv[t][0], inv[t][0],
                                        inv[t][1], inv[t][1], inv[t][1], inv[t][1]);
        _mm256_storeu_ps(tmp, _mm256_mul_ps(a[t], f));
        for (int l = 0; l < 8; l++) acc[vrow(t, l)] = tmp[l];
    }
}
#endif

/* acc[mm][r] = sum_{k in [k0, k1)} u[row r, k] * x[m0 + mm, k] for one unit ((k1-k0) even). */
static void unit_dot(const uint8_t *restrict wk, int64_t stride, const float *restrict x,
                     int64_t K, int mt, int64_t k0, int64_t k1, float acc[2][32]) {
#ifdef __AVX2__
    KVS_MASKS;
    /* named accumulators (not arrays): keeps all eight in registers (gcc spilled arrays) */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    if (mt == 1) {
        /* two k per iteration, two accumulator sets: 8 independent FMA chains */
        for (int64_t k = k0; k < k1; k += 2) {
            __m256 w0, w1, w2, w3;
            KVS_UNPACK(wk + k * stride, w0, w1, w2, w3);
            const __m256 x0 = _mm256_broadcast_ss(x + k);
            a0 = _mm256_fmadd_ps(w0, x0, a0);
            a1 = _mm256_fmadd_ps(w1, x0, a1);
            a2 = _mm256_fmadd_ps(w2, x0, a2);
            a3 = _mm256_fmadd_ps(w3, x0, a3);
            KVS_UNPACK(wk + (k + 1) * stride, w0, w1, w2, w3);
            const __m256 x1 = _mm256_broadcast_ss(x + k + 1);
            b0 = _mm256_fmadd_ps(w0, x1, b0);
            b1 = _mm256_fmadd_ps(w1, x1, b1);
            b2 = _mm256_fmadd_ps(w2, x1, b2);
            b3 = _mm256_fmadd_ps(w3, x1, b3);
        }
        const __m256 a[4] = {_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1),
                             _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)};
        unscramble(a, acc[0]);
        return;
    }
    for (int64_t k = k0; k < k1; k++) {
        __m256 w0, w1, w2, w3;
        KVS_UNPACK(wk + k * stride, w0, w1, w2, w3);
        const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + K + k);
        a0 = _mm256_fmadd_ps(w0, x0, a0);
        a1 = _mm256_fmadd_ps(w1, x0, a1);
        a2 = _mm256_fmadd_ps(w2, x0, a2);
        a3 = _mm256_fmadd_ps(w3, x0, a3);
        b0 = _mm256_fmadd_ps(w0, x1, b0);
        b1 = _mm256_fmadd_ps(w1, x1, b1);
        b2 = _mm256_fmadd_ps(w2, x1, b2);
        b3 = _mm256_fmadd_ps(w3, x1, b3);
    }
    const __m256 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
    unscramble(a, acc[0]);
    unscramble(b, acc[1]);
#else
    for (int mm = 0; mm < mt; mm++)
        for (int r = 0; r < 32; r++) acc[mm][r] = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        const uint8_t *b = wk + k * stride;
        for (int mm = 0; mm < mt; mm++) {
            const float xv = x[mm * K + k];
            for (int j = 0; j < 16; j++) {
                acc[mm][j] += (float)(b[j] & 15) * xv;
                acc[mm][16 + j] += (float)(b[j] >> 4) * xv;
            }
        }
    }
#endif
}


/* min form: out[mm][r] += s[r] * acc[mm][r] + m[r] * xs[mm], fp16 (s, m) pairs at p. */
static inline void combine8_min(const uint16_t *restrict p, int mt, float acc[2][32], int r0,
                                const float xsv[2], float out[2][32]) {
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));       /* s0 m0 .. */
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))); /* s4 m4 .. */
    /* per 128-bit lane: [a0 a2 b0 b2 | a4 a6 b4 b6] = s0 s1 s4 s5 | s2 s3 s6 s7 -> reorder */
    const __m256 s = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
    const __m256 m = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
    for (int mm = 0; mm < mt; mm++) {
        __m256 o = _mm256_loadu_ps(out[mm] + r0);
        o = _mm256_fmadd_ps(s, _mm256_loadu_ps(acc[mm] + r0), o);
        o = _mm256_fmadd_ps(m, _mm256_set1_ps(xsv[mm]), o);
        _mm256_storeu_ps(out[mm] + r0, o);
    }
#else
    for (int i = 0; i < 8; i++) {
        const float s = kvs_f16f(p[2 * i]), m = kvs_f16f(p[2 * i + 1]);
        for (int mm = 0; mm < mt; mm++)
            out[mm][r0 + i] += s * acc[mm][r0 + i] + m * xsv[mm];
    }
#endif
}

/* out[mm][r] += s[r] * acc[mm][r] + (z[r] - 8 s[r]) * xs[mm] over 8 rows whose (s, z) bf16
 * pairs start at p (row-contiguous). */
static inline void combine8(const uint16_t *restrict p, int mt, float acc[2][32], int r0,
                            const float xsv[2], float out[2][32]) {
#ifdef __AVX2__
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);  /* 8 x (s | z << 16) */
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
    const __m256 cz = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);
    for (int mm = 0; mm < mt; mm++) {
        __m256 o = _mm256_loadu_ps(out[mm] + r0);
        o = _mm256_fmadd_ps(s, _mm256_loadu_ps(acc[mm] + r0), o);
        o = _mm256_fmadd_ps(cz, _mm256_set1_ps(xsv[mm]), o);
        _mm256_storeu_ps(out[mm] + r0, o);
    }
#else
    for (int i = 0; i < 8; i++) {
        const float s = bf16f(p[2 * i]), z = bf16f(p[2 * i + 1]);
        for (int mm = 0; mm < mt; mm++)
            out[mm][r0 + i] += s * acc[mm][r0 + i] + (z - 8.0f * s) * xsv[mm];
    }
#endif
}

/*
 * x   fp32 [M, K] (K = padded K, zero beyond the true width), xs fp32 [M, K/G]
 * y   fp32 [M, N] (N = padded N), written
 */
void kvs_int4_gemv(const uint8_t *packed, const uint16_t *sz, const float *x, const float *xs,
                   int64_t M, int64_t N, int64_t K, int64_t G, int64_t BN, int num_threads,
                   int min_form, float *y) {
    const int64_t ng = K / G;
    const int64_t per_block = BN / 32;          /* units per row block */
    const int64_t n_units = (N / BN) * per_block;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t u = 0; u < n_units; u++) {
        const int64_t b = u / per_block, c = u % per_block;
        const int64_t lo0 = b * BN + 16 * c, hi0 = b * BN + BN / 2 + 16 * c;
        const uint8_t *wk = packed + b * K * (BN / 2) + 16 * c;   /* + k * BN/2 per column */
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mt = (M - m0) >= 2 ? 2 : 1;
            float out[2][32] = {{0}};
            float acc[2][32];
            for (int64_t g = 0; g < ng; g++) {
                unit_dot(wk, BN / 2, x + m0 * K, K, mt, g * G, (g + 1) * G, acc);
                const uint16_t *szg = sz + (g * N) * 2;
                const float xsv[2] = {xs[m0 * ng + g], mt == 2 ? xs[(m0 + 1) * ng + g] : 0.0f};
                for (int r0 = 0; r0 < 32; r0 += 8) {
                    const uint16_t *p = szg + 2 * unit_row(lo0, hi0, r0);
                    if (min_form)
                        combine8_min(p, mt, acc, r0, xsv, out);
                    else
                        combine8(p, mt, acc, r0, xsv, out);
                }
            }
            for (int mm = 0; mm < mt; mm++)
                for (int r = 0; r < 32; r++)
                    y[(m0 + mm) * N + unit_row(lo0, hi0, r)] = out[mm][r];
        }
    }
}

/*
 * Dequantize stored rows [r0, r1) (multiples of BN) to W^T, fp32 out [K, r1 - r0] (k-major),
 * for the GEMM path of larger batches. Twin: the torch code of CpuPackMethod.rows_t
 * (kvserve/layers/int4/methods.py), which it reproduces bit for bit: per (group, row)
 * t = z - 8 s (bf16 pairs) or t = m (fp16 min form), then w = fl(fl(u * s) + t) -- two
 * roundings, so no contraction into an FMA here.
 */
__attribute__((optimize("fp-contract=off")))
void kvs_int4_dequant_t(const uint8_t *restrict packed, const uint16_t *restrict sz,
                        int64_t N, int64_t K, int64_t G, int64_t BN, int min_form, int64_t r0,
                        int64_t r1, int num_threads, float *restrict out) {
    const int64_t rows = r1 - r0, half = BN / 2, ng = K / G, b0 = r0 / BN, b1 = r1 / BN;
    /* groups outer (parallel): each group's (s, t) per row once, then its G k-rows of the
     * output written front to back (contiguous rows of W^T) */
#pragma omp parallel num_threads(num_threads)
    {
        float *s = (float *)__builtin_alloca(2 * rows * sizeof(float)), *t = s + rows;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < ng; g++) {
            const uint16_t *p = sz + (g * N + r0) * 2;
            for (int64_t r = 0; r < rows; r++) {
                if (min_form) {
                    s[r] = kvs_f16f(p[2 * r]);
                    t[r] = kvs_f16f(p[2 * r + 1]);
                } else {
                    s[r] = bf16f(p[2 * r]);
                    const float e = 8.0f * s[r];
                    t[r] = bf16f(p[2 * r + 1]) - e;
                }
            }
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                float *restrict o = out + k * rows;
                for (int64_t b = b0; b < b1; b++) {
                    const uint8_t *restrict q = packed + (b * K + k) * half;
                    const int64_t c = (b - b0) * BN;
                    const float *restrict sb = s + c, *restrict tb = t + c;
                    for (int64_t j = 0; j < half; j++) {
                        const float lo = (float)(q[j] & 15) * sb[j];
                        const float hi = (float)(q[j] >> 4) * sb[half + j];
                        o[c + j] = lo + tb[j];
                        o[c + half + j] = hi + tb[half + j];
                    }
                }
            }
        }
    }
}
