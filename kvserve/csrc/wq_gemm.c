/*
 * Integer-dot GEMM for GGUF-style weights (W4A8 / W8A8), llama.cpp's approach on CPU:
 * activations are quantized per row to int8 in blocks of 32 (one fp32 scale each), weights are
 * unsigned codes u with a (scale s, min m) pair per group of G columns (w = u * s + m), and the
 * inner products run on integer units: AVX-512 VNNI `vpdpbusd` (u8 x s8 -> s32, 64 products
 * per instruction), AVX2 `vpmaddubsw` + `vpmaddwd`, or plain C (any CPU).
 *
 *   y[m, n] = sum_g ( s[n,g] * sum_{b in g} dx[m,b] * sum_{k in b} u[n,k] q[m,k]
 *                   + m[n,g] * sum_{b in g} dx[m,b] * qs[m,b] )
 *
 * which is exactly dequant(W) . dequant(quant(x)) up to fp32 rounding: x is taken as
 * x^[m,k] = dx[m,b] * q[m,k]. Twin: kvserve.kernels.reference.wq_matmul (fake-quantized x @ W^T);
 * tests/quant/test_wq.py sweeps shapes against it. Integer sums are exact, so results differ
 * from the twin only in the order of fp32 additions. A row's result depends on that row alone
 * (batch invariant): rows of x are never mixed and every row runs the same instruction stream.
 *
 * Weight tiles (16 output rows each; `bits` = 4 or 8):
 *   bits 4: codes uint8 [N/16, K/8, 16, 4]  byte j of row r in k-oct t: low nibble u[r, 8t+j],
 *                                             high nibble u[r, 8t+4+j]
 *   bits 8: codes uint8 [N/16, K/4, 16, 4]  byte j of row r in k-quad t: u[r, 4t+j]
 *   sm      fp16  [N/16, K/G, 2, 16]         s for the tile's 16 rows, then m
 * A 64-byte load is 16 rows x 4 columns: one dpbusd against 4 int8 of x broadcast to all lanes.
 * Activations: q int8 [M, K], dx fp32 [M, K/32], qs int32 [M, K/32] (sum of q per block).
 */
/* the build's -fassociative-math / -ffp-contract=fast would let the compiler vectorize a
 * row's float updates one way for a pass of 4 rows and another for 1 (the portable path's
 * loops over rows), breaking batch invariance; keep the order and the roundings as written
 * (the vector FMAs are explicit) */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "kvs_op.h"
#include "half.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "act_q8.h"

#define MT 4 /* rows of x per pass over a weight tile */
/* AVX2 passes of 1-2 rows (batch 1): software prefetch this many bytes ahead of the codes'
 * stream (a thread's tiles are consecutive, so it runs on into its next tile). Without it such
 * a pass reads its tiles at ~75% of the read bandwidth: too little integer work per byte to
 * hide DRAM latency behind, and the hardware prefetcher alone does not run far enough ahead.
 * 2 / 4 / 8 KiB measured alike (benchmarks/wq_gemm.py); 3-4 rows are compute-bound (none).
 * Past the table's end the hints touch nothing: a prefetch never faults. */
#ifndef PF_WQ
#define PF_WQ 4096
#endif

/* 16 fp16 -> fp32 */
static inline void f16x16(const uint16_t *restrict p, float *restrict out) {
#if defined(__AVX2__) && defined(__F16C__)
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
#else
    for (int r = 0; r < 16; r++) out[r] = kvs_f16f(p[r]);
#endif
}

/* ---------------------------------------------------------------- activation quantization */

/* x fp32 [M, K] (K % 32 == 0) -> q, dx, qs, each [terms * M, ...] (act_q8.h: rows M + m
 * hold the terms == 2 remainders; x ~ dx q + dx' q' to ~1.5e-5 of the block's amax). */
void kvs_wq_quant_act(const float *restrict x, int64_t M, int64_t K, int terms,
                      int num_threads, int8_t *restrict q, float *restrict dx,
                      int32_t *restrict qs) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        if (terms == 2)
            kvs_quant_block(x + i * 32, 2, q + i * 32, q + (M * nb + i) * 32, dx + i, qs + i,
                            dx + M * nb + i, qs + M * nb + i);
        else
            kvs_quant_block(x + i * 32, 1, q + i * 32, NULL, dx + i, qs + i, NULL, NULL);
    }
}

/* ---------------------------------------------------------------- per-block integer dots */

#if defined(__AVX2__)
/*
 * AVX2 pass (AVX-512 builds without VNNI take it too): mt (<= MT) rows of x against nh halves
 * of a weight tile (8 output rows each, halves h0 .. h0 + nh - 1) over all of K, the 8 outputs
 * of each row and half held in one fp32 register from the first block to the last. Up to 2 rows
 * (a batch-1 row and its int8x2 remainder) take both halves in one pass, so each x broadcast and
 * each row's scalar work serve 16 outputs; 3-4 rows take a pass per half (more accumulators
 * would spill). Every output runs the same operations either way. AVX2 has no u8 x s8 -> s32 dot:
 * vpmaddubsw (pairs -> s16), then vpmaddwd (-> s32). A code vector is unpacked once per block
 * and serves every row of the pass; mt, bits are constants at each call site, so the loops
 * unroll and everything stays in registers.
 *
 * 4-bit: nibbles (<= 15) times |q| <= 127: a pair <= 3810, and 8 pairs per s16 lane per block
 * (<= 30480) stay below 32767.
 * 8-bit: u = q8 + 128 with q8 = u ^ 0x80 signed; sum u q = sum q8 q + 128 qs. q8 q runs as
 * |q8| (unsigned, <= 128) times sign(q, q8): a pair <= 2 * 128 * 127 = 32512, widened to s32
 * after every vpmaddubsw.
 *
 * Per row and block b of group g (one fixed sequence whatever mt is: batch invariance):
 *   out = fma(s[g], dx[b] * acc_b, out);  ms += dx[b] * qs[b];  at the group's end
 *   out = fma(m[g], ms, out)
 */
/* Integer adds are associative, so gcc is free to regroup an accumulator's chain: it computed
 * a whole block's vpmaddubsw products first and spilled them to the stack to add them up later.
 * An empty asm on the accumulator after each step keeps the chain in program order, and in
 * registers (the sums are exact integers either way). */
#define KVS_KEEP(v) __asm__("" : "+x"(v))

static inline __attribute__((always_inline)) void pass_avx2(
    const uint8_t *restrict wt, const uint16_t *restrict st, const int8_t *restrict q,
    const float *restrict dx, const int32_t *restrict qs, int64_t K, int64_t G, const int bits,
    const int mt, const int h0, const int nh, float *restrict y, int64_t ldy) {
    /* halves h0 .. h0 + nh - 1 (nh = 2: the whole tile in one pass, each x broadcast and each
     * row's scalar work shared by both halves; every output's operations are the same) */
    const int64_t nb = K / 32, ng = K / G, bpg = G / 32, block_bytes = 64 * bits;
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F);
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    __m256 out[MT][2];
    for (int mm = 0; mm < mt; mm++)
        for (int hh = 0; hh < nh; hh++) out[mm][hh] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 s[2];
        for (int hh = 0; hh < nh; hh++)
            s[hh] = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(st + g * 32 + 8 * (h0 + hh))));
        float ms[MT] = {0};
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            const uint8_t *wb = wt + b * block_bytes + 32 * h0;
            const int8_t *qb = q + 32 * b;
            if (nh == 2) /* mt <= 2: the memory-bound passes */
                for (int o = 0; o < block_bytes; o += 64)
                    _mm_prefetch((const char *)(wt + b * block_bytes + PF_WQ + o), _MM_HINT_T0);
            __m256i a[MT][2];
            if (bits == 4) {
                for (int mm = 0; mm < mt; mm++)
                    for (int hh = 0; hh < nh; hh++) a[mm][hh] = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) { /* k 8t..8t+3 (low nibbles), 8t+4..8t+7 (high) */
                    __m256i w0[2], w1[2];
                    for (int hh = 0; hh < nh; hh++) {
                        const __m256i v =
                            _mm256_loadu_si256((const __m256i *)(wb + 64 * t + 32 * hh));
                        w0[hh] = _mm256_and_si256(v, lo4);
                        w1[hh] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                    }
                    for (int mm = 0; mm < mt; mm++) {
                        int32_t x0, x1;
                        memcpy(&x0, qb + mm * K + 8 * t, 4);
                        memcpy(&x1, qb + mm * K + 8 * t + 4, 4);
                        const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
                        for (int hh = 0; hh < nh; hh++) {
                            a[mm][hh] = _mm256_add_epi16(a[mm][hh],
                                                         _mm256_maddubs_epi16(w0[hh], b0));
                            a[mm][hh] = _mm256_add_epi16(a[mm][hh],
                                                         _mm256_maddubs_epi16(w1[hh], b1));
                            KVS_KEEP(a[mm][hh]);
                        }
                    }
                }
                for (int mm = 0; mm < mt; mm++)
                    for (int hh = 0; hh < nh; hh++)
                        a[mm][hh] = _mm256_madd_epi16(a[mm][hh], ones);
            } else {
                for (int mm = 0; mm < mt; mm++)
                    for (int hh = 0; hh < nh; hh++)
                        a[mm][hh] = _mm256_set1_epi32(128 * qs[mm * nb + b]);
                for (int t = 0; t < 8; t++) { /* k-quad t: k 4t..4t+3 */
                    __m256i q8[2], mag[2];
                    for (int hh = 0; hh < nh; hh++) {
                        q8[hh] = _mm256_xor_si256(
                            _mm256_loadu_si256((const __m256i *)(wb + 64 * t + 32 * hh)), bias);
                        mag[hh] = _mm256_abs_epi8(q8[hh]);
                    }
                    for (int mm = 0; mm < mt; mm++) {
                        int32_t xv;
                        memcpy(&xv, qb + mm * K + 4 * t, 4);
                        const __m256i bx = _mm256_set1_epi32(xv);
                        for (int hh = 0; hh < nh; hh++) {
                            const __m256i sx = _mm256_sign_epi8(bx, q8[hh]);
                            a[mm][hh] = _mm256_add_epi32(a[mm][hh], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(mag[hh], sx), ones));
                            KVS_KEEP(a[mm][hh]);
                        }
                    }
                }
            }
            for (int mm = 0; mm < mt; mm++) {
                const float d = dx[mm * nb + b];
                for (int hh = 0; hh < nh; hh++) {
                    const __m256 f =
                        _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(a[mm][hh]));
                    out[mm][hh] = _mm256_fmadd_ps(s[hh], f, out[mm][hh]);
                }
                ms[mm] += d * (float)qs[mm * nb + b];
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            const __m256 mn = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(st + g * 32 + 16 + 8 * (h0 + hh))));
            for (int mm = 0; mm < mt; mm++)
                out[mm][hh] = _mm256_fmadd_ps(mn, _mm256_set1_ps(ms[mm]), out[mm][hh]);
        }
    }
    for (int mm = 0; mm < mt; mm++)
        for (int hh = 0; hh < nh; hh++)
            _mm256_storeu_ps(y + mm * ldy + 8 * (h0 + hh), out[mm][hh]);
}

static void pass_avx2_dispatch(const uint8_t *wt, const uint16_t *st, const int8_t *q,
                               const float *dx, const int32_t *qs, int64_t K, int64_t G,
                               int bits, int mt, float *y, int64_t ldy) {
    /* literal arguments: one specialized copy per (bits, mt). Up to 2 rows, one pass takes
     * both halves of the tile (16 outputs per row: 4 accumulators per row fit the 16 ymm);
     * 3 or 4 rows run one pass per half. */
#define KVS_PASS(BITS, MTV, H0, NH) pass_avx2(wt, st, q, dx, qs, K, G, BITS, MTV, H0, NH, y, ldy)
#define KVS_PASS_MT(BITS)                                                       \
    switch (mt) {                                                              \
    case 4: KVS_PASS(BITS, 4, 0, 1); KVS_PASS(BITS, 4, 1, 1); break;           \
    case 3: KVS_PASS(BITS, 3, 0, 1); KVS_PASS(BITS, 3, 1, 1); break;           \
    case 2: KVS_PASS(BITS, 2, 0, 2); break;                                    \
    default: KVS_PASS(BITS, 1, 0, 2); break;                                   \
    }
    if (bits == 4) {
        KVS_PASS_MT(4)
    } else {
        KVS_PASS_MT(8)
    }
#undef KVS_PASS_MT
#undef KVS_PASS
}
#else
/* plain C: acc[mm][r] = sum_{k in block} u[r, k] * q[m0 + mm, k] for the 16 rows of a tile,
 * one 32-column block (wb: the block's first code byte in the tile) */
static void block_dots(const uint8_t *restrict wb, int bits, const int8_t *restrict qb,
                       int64_t K, int mt, int32_t acc[MT][16]) {
    for (int mm = 0; mm < mt; mm++) {
        for (int r = 0; r < 16; r++) {
            int32_t s = 0;
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++) {
                    int u0, u1;
                    if (bits == 4) {
                        const uint8_t b = wb[64 * t + 4 * r + j];
                        u0 = b & 15;
                        u1 = b >> 4;
                    } else {
                        u0 = wb[128 * t + 4 * r + j];
                        u1 = wb[128 * t + 64 + 4 * r + j];
                    }
                    s += u0 * qb[mm * K + 8 * t + j] + u1 * qb[mm * K + 8 * t + 4 + j];
                }
            acc[mm][r] = s;
        }
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/*
 * AVX-512 VNNI pass: VT tiles (64 rows) x VM rows of x over all of K. 16 independent
 * dpbusd chains hide its latency; each x broadcast feeds VT tiles, each code load VM rows.
 * Rows and tiles past the ends are aliased to valid ones and their results dropped, so every
 * row runs the same instructions wherever it sits (batch invariance).
 */
#define VT 4
#define VM 4
/* vm (1, 2 or 4) rows; always inlined with a constant vm so each variant is specialized.
 * out fp32 [VT][VM][16] in memory (updated once per group). */
static inline __attribute__((always_inline)) void pass_vnni(
    const uint8_t *const wt[VT], const uint16_t *const st[VT], const int8_t *const qr[VM],
    const float *const dxr[VM], const int32_t *const qsr[VM], int64_t K, int64_t G, int bits,
    const int vm, float out[VT][VM][16]) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int64_t ng = K / G, bpg = G / 32, block_bytes = 32 * 16 * bits / 8;
    memset(out, 0, sizeof(float) * VT * VM * 16);
    for (int64_t g = 0; g < ng; g++) {
        __m512 f[VT][VM];
        float ms[VM] = {0};
        for (int j = 0; j < VT; j++)
            for (int i = 0; i < vm; i++) f[j][i] = _mm512_setzero_ps();
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            __m512i a[VT][VM];
            for (int j = 0; j < VT; j++)
                for (int i = 0; i < vm; i++) a[j][i] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                __m512i x0[VM], x1[VM];
                for (int i = 0; i < vm; i++) {
                    int32_t v0, v1;
                    memcpy(&v0, qr[i] + 32 * b + 8 * t, 4);
                    memcpy(&v1, qr[i] + 32 * b + 8 * t + 4, 4);
                    x0[i] = _mm512_set1_epi32(v0);
                    x1[i] = _mm512_set1_epi32(v1);
                }
                for (int j = 0; j < VT; j++) {
                    const uint8_t *wb = wt[j] + b * block_bytes;
                    __m512i w0, w1;
                    if (bits == 4) {
                        const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * t));
                        w0 = _mm512_and_si512(v, lo4);
                        w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    } else {
                        w0 = _mm512_loadu_si512((const void *)(wb + 128 * t));
                        w1 = _mm512_loadu_si512((const void *)(wb + 128 * t + 64));
                    }
                    for (int i = 0; i < vm; i++) {
                        a[j][i] = _mm512_dpbusd_epi32(a[j][i], w0, x0[i]);
                        a[j][i] = _mm512_dpbusd_epi32(a[j][i], w1, x1[i]);
                    }
                }
            }
            for (int i = 0; i < vm; i++) {
                const __m512 d = _mm512_set1_ps(dxr[i][b]);
                ms[i] += dxr[i][b] * (float)qsr[i][b];
                for (int j = 0; j < VT; j++)
                    f[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j][i]), d, f[j][i]);
            }
        }
        for (int j = 0; j < VT; j++) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st[j] + g * 32)));
            const __m512 mn = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(st[j] + g * 32 + 16)));
            for (int i = 0; i < vm; i++) {
                __m512 o = _mm512_loadu_ps(out[j][i]);
                o = _mm512_fmadd_ps(s, f[j][i], o);
                o = _mm512_fmadd_ps(mn, _mm512_set1_ps(ms[i]), o);
                _mm512_storeu_ps(out[j][i], o);
            }
        }
    }
}
#endif

/* y fp32 [M, N] (N % 16 == 0, K % G == 0, G % 32 == 0). OpenMP over weight tiles: each
 * tile's codes are read once per MT rows of x. */
void kvs_wq_gemm(const uint8_t *restrict codes, const uint16_t *restrict sm,
                 const int8_t *restrict q, const float *restrict dx, const int32_t *restrict qs,
                 int64_t M, int64_t N, int64_t K, int64_t G, int bits, int num_threads,
                 float *restrict y) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    {
        const int64_t ntiles = N / 16, ng = K / G, nb = K / 32;
        const int64_t tile_bytes = K * 16 * bits / 8, ngroups = (ntiles + VT - 1) / VT;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t tg = 0; tg < ngroups; tg++) {
            const uint8_t *wt[VT];
            const uint16_t *st[VT];
            for (int j = 0; j < VT; j++) {
                int64_t tile = tg * VT + j;
                if (tile >= ntiles) tile = ntiles - 1; /* alias; result dropped */
                wt[j] = codes + tile * tile_bytes;
                st[j] = sm + tile * ng * 32;
            }
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t rem = M - m0;
                const int vm = rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
                const int8_t *qr[VM];
                const float *dxr[VM];
                const int32_t *qsr[VM];
                for (int i = 0; i < VM; i++) {
                    const int64_t m = i < vm ? m0 + i : m0;
                    qr[i] = q + m * K;
                    dxr[i] = dx + m * nb;
                    qsr[i] = qs + m * nb;
                }
                float out[VT][VM][16];
                if (vm == 4)
                    pass_vnni(wt, st, qr, dxr, qsr, K, G, bits, 4, out);
                else if (vm == 2)
                    pass_vnni(wt, st, qr, dxr, qsr, K, G, bits, 2, out);
                else
                    pass_vnni(wt, st, qr, dxr, qsr, K, G, bits, 1, out);
                for (int j = 0; j < VT && tg * VT + j < ntiles; j++)
                    for (int i = 0; i < vm; i++)
                        memcpy(y + (m0 + i) * N + (tg * VT + j) * 16, out[j][i], 64);
                m0 += vm;
            }
        }
        return;
    }
#endif
    const int64_t ntiles = N / 16, ng = K / G, nb = K / 32;
    const int64_t tile_bytes = K * 16 * bits / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const uint8_t *wt = codes + tile * tile_bytes;
        const uint16_t *st = sm + tile * ng * 32;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (M - m0) < MT ? (int)(M - m0) : MT;
#if defined(__AVX2__)
            pass_avx2_dispatch(wt, st, q + m0 * K, dx + m0 * nb, qs + m0 * nb, K, G, bits, mt,
                               y + m0 * N + tile * 16, N);
#else
            /* per row and group: f = sum_b dx[b] acc_b, ms = sum_b dx[b] qs[b];
             * out += s f + m ms (the AVX2 pass's sums in another order) */
            const int64_t bpg = G / 32, block_bytes = 32 * 16 * bits / 8;
            float out[MT][16];
            memset(out, 0, sizeof(out));
            for (int64_t g = 0; g < ng; g++) {
                float f[MT][16], msum[MT];
                memset(f, 0, sizeof(f));
                memset(msum, 0, sizeof(msum));
                for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                    int32_t acc[MT][16];
                    block_dots(wt + b * block_bytes, bits, q + m0 * K + 32 * b, K, mt, acc);
                    for (int mm = 0; mm < mt; mm++) {
                        const float d = dx[(m0 + mm) * nb + b];
                        for (int r = 0; r < 16; r++) f[mm][r] += d * (float)acc[mm][r];
                        msum[mm] += d * (float)qs[(m0 + mm) * nb + b];
                    }
                }
                float s[16], mn[16];
                f16x16(st + g * 32, s);
                f16x16(st + g * 32 + 16, mn);
                for (int mm = 0; mm < mt; mm++)
                    for (int r = 0; r < 16; r++) out[mm][r] += s[r] * f[mm][r] + mn[r] * msum[mm];
            }
            for (int mm = 0; mm < mt; mm++)
                memcpy(y + (m0 + mm) * N + tile * 16, out[mm], 16 * sizeof(float));
#endif
        }
    }
}

/* ---------------------------------------------------------------- one call per layer */

/*
 * y fp32 [M, N] = W . x^ for x fp32 [M, K]: quantize (terms int8 passes), GEMM, and add the
 * passes' rows -- what kvserve.kernels.cpu.wq_gemm.wq_linear does in one ctypes call. Scratch
 * space (per calling thread, grown on demand) holds q / dx / qs and the terms > 1 rows.
 * Returns 0, or -1 if scratch could not be allocated (y untouched).
 */
static _Thread_local void *scratch_buf = NULL;
static _Thread_local size_t scratch_cap = 0;

int kvs_wq_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                  const uint16_t *sm, int64_t N, int64_t G, int bits, int terms,
                  int num_threads, float *y) {
    const int64_t rows = terms * M, nb = K / 32;
    const size_t q_bytes = ((size_t)(rows * K) + 63) & ~(size_t)63;
    const size_t need =
        q_bytes + (size_t)(rows * nb) * 8 + (terms > 1 ? (size_t)(rows * N) * 4 : 0);
    if (need > scratch_cap) {
        void *p = realloc(scratch_buf, need);
        if (p == NULL) return -1;
        scratch_buf = p;
        scratch_cap = need;
    }
    int8_t *q = (int8_t *)scratch_buf;
    float *dx = (float *)((char *)scratch_buf + q_bytes);
    int32_t *qs = (int32_t *)(dx + rows * nb);
    float *out = terms > 1 ? (float *)(qs + rows * nb) : y;
    kvs_wq_quant_act(x, M, K, terms, num_threads, q, dx, qs);
    kvs_wq_gemm(codes, sm, q, dx, qs, rows, N, K, G, bits, num_threads, out);
    if (terms > 1)
        for (int64_t i = 0; i < M * N; i++) y[i] = out[i] + out[M * N + i];
    return 0;
}

int kvs_wq_linear_op(const int64_t *a) {
    return kvs_wq_linear(OP_P(0), a[1], a[2], OP_P(3), OP_P(4), a[5], a[6], (int)a[7],
                         (int)a[8], (int)a[9], OP_P(10));
}
