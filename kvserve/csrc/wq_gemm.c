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
#include "kvs_sched.h"

#define MT 4 /* rows of x per pass over a weight tile */
/* AVX2 passes of 1-2 rows (batch 1): software prefetch this many bytes ahead of the codes'
 * stream (a thread's tiles are consecutive, kvs_sched.h, so it runs on into its next tile).
 * Without it such a pass reads its tiles at ~75% of the read bandwidth: too little integer
 * work per byte to hide DRAM latency behind, and the hardware prefetcher alone does not run
 * far enough ahead.
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/*
 * AVX-512 VNNI wide pass: one weight tile x up to WM rows of x over all of K, every row in one
 * pass (a decode step's 1-2 GEMM rows, a speculative verify step's 3-16: 1-8 rows of x, two
 * int8 terms each). Each
 * code vector is loaded and unpacked once for all rows, each row's 4 bytes of x are broadcast
 * from memory into the dpbusd, and a row's 16 outputs stay in a register from the first group
 * to the last: the pass reads the weights once, as a 1-row step does, instead of once per 4
 * rows (pass_vnni) or through AMX tile stores and a per-call unpack (from AMX_MIN_ROWS rows).
 * A thread's tiles are consecutive (kvs_sched.h): one stream, prefetched PF_WQ bytes ahead.
 * Per row: the very operations of pass_vnni in its order (f = fma(cvt(a), dx, f) per block,
 * ms += dx qs; at the group's end out = fma(s, f, out), out = fma(m, ms, out)), so every row is
 * bit for bit what any other pass computes for it (batch invariance).
 */
#define WM 8
#ifndef WIDE_MIN_ROWS
/* from 1 row: a decode step's 1-2 GEMM rows ran pass_vnni's 4-tile passes until 2026-12-07
 * 22:51 UTC; the wide pass is 18% faster at 2 rows on the AMX Xeon with the weights in L3 and
 * 11% with 664 MB streamed from DRAM (docs/cpu.md) */
#define WIDE_MIN_ROWS 1
#endif
#ifndef WIDE_MAX_ROWS
#define WIDE_MAX_ROWS 16 /* more rows: pass_vnni's passes of 4 (or AMX-INT8 tiles) */
#endif
static inline __attribute__((always_inline)) void pass_vnni_wide(
    const uint8_t *restrict wt, const uint16_t *restrict st, const int8_t *restrict q,
    const float *restrict dx, const float *restrict msr, int64_t K, int64_t G, const int bits,
    const int vm, float *restrict y, int64_t ldy) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int64_t ng = K / G, bpg = G / 32, nb = K / 32, block_bytes = 32 * 16 * bits / 8;
    __m512 out[WM];
    for (int i = 0; i < vm; i++) out[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 f[WM];
        for (int i = 0; i < vm; i++) f[i] = _mm512_setzero_ps();
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            const uint8_t *wb = wt + b * block_bytes;
            for (int o = 0; o < block_bytes; o += 64)
                _mm_prefetch((const char *)(wb + PF_WQ + o), _MM_HINT_T0);
            __m512i a[WM];
            for (int i = 0; i < vm; i++) a[i] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
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
                    int32_t v0, v1;
                    memcpy(&v0, q + i * K + 32 * b + 8 * t, 4);
                    memcpy(&v1, q + i * K + 32 * b + 8 * t + 4, 4);
                    a[i] = _mm512_dpbusd_epi32(a[i], w0, _mm512_set1_epi32(v0));
                    a[i] = _mm512_dpbusd_epi32(a[i], w1, _mm512_set1_epi32(v1));
                }
            }
            for (int i = 0; i < vm; i++)
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), _mm512_set1_ps(dx[i * nb + b]),
                                       f[i]);
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * 32)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * 32 + 16)));
        for (int i = 0; i < vm; i++) {
            out[i] = _mm512_fmadd_ps(s, f[i], out[i]);
            out[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(msr[i * ng + g]), out[i]);
        }
    }
    for (int i = 0; i < vm; i++) _mm512_storeu_ps(y + i * ldy, out[i]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__) && !defined(KVS_SIMDE)
#define KVS_WQ_AMX 1
#include "amx.h"
/*
 * AMX-INT8 (Sapphire Rapids and later): the VNNI pass's integer block sums as tile products
 * (TDPBSUD: A signed int8 x B unsigned uint8 -> int32), then the VNNI pass's float updates,
 * operation for operation, so every output is bit for bit the VNNI one (and so batch-invariant
 * whatever the row count that picks the path). Per 32-column block b:
 *   A = up to 16 rows of q (32 bytes each, read in place with stride K);
 *   B = 8 k-quads x 16 outputs x 4 bytes: an 8-bit tile's block is exactly that (8 consecutive
 *       64-byte rows, read in place); a 4-bit tile is first unpacked, once per tile and call,
 *       into that layout (k-oct t's low nibbles -> k-quad 2t, high nibbles -> 2t + 1);
 *   C[row][output] = sum_{k in b} q[row, k] u[output, k]: the VNNI pass's exact int32 `a`.
 * C is stored and each (row, output) runs f = fma(cvt(a), dx[row][b], f) per block and, at its
 * group's end, out = fma(s, f, out); out = fma(m, ms, out), with ms = sum_b dx qs in the same
 * scalar order (once per row and group: it does not depend on the tile).
 *
 * M <= AMX_FEW_MAX (decode and verify steps) takes wq_gemm_amx_few below: AMX_JT weight tiles
 * in flight, a software pipeline, float work on exactly M rows. More rows: one C tile (a row
 * tile of 16 rows x one weight tile) runs over all of K at a time, its 16 rows' out (groups of
 * one block: G = 32, every GGUF Q4_0 / Q4_1 / Q8_0) or f (larger groups; out then lives in
 * memory) in registers. Two sets of tile registers alternate between
 * blocks, so block b + 1's product is loaded, multiplied and stored while block b's floats are
 * computed (a tile store's data reaches the vector loads only once it has left the store
 * buffer). Rows past a multiple of 16 are covered by a last row tile that overlaps the one
 * before it (its overlapped rows are not written), so no row is read past M.
 */
/* Default thresholds, measured against the wide VNNI pass (benchmarks/wq_gemm.py --amx
 * --baseline-amx, 2-core Xeon, SmolLM2's 30 Q4_1 layers + Q8_0 head, int8x2, 2026-12-07
 * 21:14 UTC, two runs): at 8 GEMM rows the tiles are 0.83-0.85x (layers) / 0.90-0.93x (head)
 * of the wide pass, at 10 rows 1.01-1.02x / 1.03-1.07x, at 12 1.04x / 1.16x, at 16 1.13-1.16x
 * / 1.00-1.14x: both from 10 rows (the 4-bit one was 16 before the few-row path). Below, the
 * VNNI passes are faster: at 2 GEMM rows (batch-1 decode) the tiles are 0.91x / 0.93x. */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 10
#endif
#ifndef AMX_MIN_ROWS4
#define AMX_MIN_ROWS4 10
#endif
static int amx_state = -1; /* -1: not asked yet, 0: off / unavailable, 1: on */
static int amx_rows = AMX_MIN_ROWS; /* GEMMs of at least this many rows take the tiles */
static int amx_rows4 = AMX_MIN_ROWS4; /* the same for 4-bit tables */

/* Row m's per-block dx and per-group ms = sum_{b in g} dx qs (pass_vnni's scalar order) into
 * column i of dxt [nb][16] and mst [ng][16]: what both tile paths' floats read. */
static void amx_row_prep(const float *restrict dx, const int32_t *restrict qs, int64_t m,
                         int64_t nb, int64_t ng, int64_t bpg, float *restrict dxt,
                         float *restrict mst, int i) {
    for (int64_t g = 0; g < ng; g++) {
        float ms = 0;
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            ms += dx[m * nb + b] * (float)qs[m * nb + b];
            dxt[b * 16 + i] = dx[m * nb + b];
        }
        mst[g * 16 + i] = ms;
    }
}

/* tmm0-1 C, tmm4-5 A, tmm6-7 B (two sets: even and odd blocks); ra rows per row tile */
static void amx_config(int ra) {
    kvs_amx_cfg cfg;
    kvs_amx_cfg_init(&cfg);
    for (int t = 0; t < 2; t++) {
        cfg.rows[t] = (uint8_t)ra; /* C: ra rows x 16 int32 */
        cfg.colsb[t] = 64;
        cfg.rows[4 + t] = (uint8_t)ra; /* A: ra rows x 32 int8 */
        cfg.colsb[4 + t] = 32;
        cfg.rows[6 + t] = 8; /* B: 8 k-quads x 16 outputs x 4 */
        cfg.colsb[6 + t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* block b's products on tile set P (C tile P, A tile TA, B tile TB: literals, the tile
 * intrinsics paste them into the instruction) into cb[P] */
#define AMX_BLOCK(P, TA, TB, b)                               \
    do {                                                      \
        _tile_zero(P);                                        \
        _tile_loadd(TA, a + 32 * (b), K);                     \
        _tile_loadd(TB, w + 512 * (b), 64);                   \
        _tile_dpbsud(P, TA, TB);                              \
        _tile_stored(P, cb[P], 64);                           \
    } while (0)

/* One C tile over all of K: its rows' dx and ms as dxt [nb][16], mst [ng][16] (i < nr, a
 * multiple of 4; rows past the tile's ra are copies of its last, never written), 16 outputs
 * of weight tile w (B layout) with scales st; rows own .. ra - 1 written to yr[i]. g1: groups
 * of one block. */
static inline __attribute__((always_inline)) void amx_ctile(
    const int8_t *restrict a, int64_t K, const uint8_t *restrict w,
    const uint16_t *restrict st, const float *restrict dxt, const float *restrict mst,
    int64_t bpg, const int nr, const int g1, int own, int ra, float *const yr[16],
    int32_t (*restrict cb)[16][16], float (*restrict om)[16]) {
    const int64_t nb = K / 32;
    __m512 acc[16]; /* g1: out; else f of the current group */
#pragma GCC unroll 16
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
    if (!g1) memset(om, 0, sizeof(float) * 16 * 16);
#define AMX_LOAD_SM(V, off) V = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (off))))
#define AMX_C(P, i) _mm512_cvtepi32_ps(_mm512_load_si512((const void *)cb[P][i]))
#define AMX_FLOATS(P, b)                                                                    \
    do {                                                                                    \
        __m512 s, mn;                                                                       \
        if (g1) {                                                                           \
            AMX_LOAD_SM(s, (b) * 32);                                                       \
            AMX_LOAD_SM(mn, (b) * 32 + 16);                                                 \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                         \
                const __m512 d = _mm512_set1_ps(dxt[(b) * 16 + i]);                         \
                const __m512 f = _mm512_fmadd_ps(AMX_C(P, i), d, _mm512_setzero_ps());     \
                acc[i] = _mm512_fmadd_ps(s, f, acc[i]);                                     \
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(mst[(b) * 16 + i]), acc[i]);    \
            }                                                                               \
        } else {                                                                            \
            const int64_t g = (b) / bpg;                                                    \
            if ((b) == g * bpg)                                                             \
                _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) acc[i] =              \
                    _mm512_setzero_ps();                                                    \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) acc[i] =                  \
                _mm512_fmadd_ps(AMX_C(P, i), _mm512_set1_ps(dxt[(b) * 16 + i]), acc[i]);    \
            if ((b) == (g + 1) * bpg - 1) {                                                 \
                AMX_LOAD_SM(s, g * 32);                                                     \
                AMX_LOAD_SM(mn, g * 32 + 16);                                               \
                _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                     \
                    __m512 o = _mm512_load_ps(om[i]);                                       \
                    o = _mm512_fmadd_ps(s, acc[i], o);                                      \
                    o = _mm512_fmadd_ps(mn, _mm512_set1_ps(mst[g * 16 + i]), o);            \
                    _mm512_store_ps(om[i], o);                                              \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } while (0)
    AMX_BLOCK(0, 4, 6, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) AMX_BLOCK(1, 5, 7, b + 1);
        AMX_FLOATS(0, b);
        if (b + 1 < nb) {
            if (b + 2 < nb) AMX_BLOCK(0, 4, 6, b + 2);
            AMX_FLOATS(1, b + 1);
        }
    }
#undef AMX_FLOATS
#undef AMX_C
#undef AMX_LOAD_SM
#pragma GCC unroll 16
    for (int i = 0; i < nr; i++)
        if (i >= own && i < ra) {
            if (g1)
                _mm512_storeu_ps(yr[i], acc[i]);
            else
                memcpy(yr[i], om[i], 64);
        }
}

/*
 * Few rows (M <= 16 a chunk: a decode step's 2 GEMM rows, a verify step's 2r): M rows
 * against AMX_JT weight tiles at a time, software-pipelined. Per unit of work (one block, or
 * with pb = 2 two blocks: M <= 8) the A tile is loaded once for the AMX_JT weight tiles, each of
 * which has its own B and C tile registers (tmm0-1: A, even and odd units; tmm2-4: B; tmm5-7:
 * C), so AMX_JT products are in flight at once; the C tiles are stored into a ring of AMX_RING
 * unit slots and their floats run AMX_LAG units later, when the tile stores have long reached
 * the cache (a tile store does not forward to vector loads: read at once, the loads wait for
 * it). pb = 2 runs two blocks in one product, halving the tile instructions: the A tile has 2M
 * rows of 64 bytes (rows i < M: block 2u's 32 bytes of row i, then 32 zero bytes; rows M + i:
 * 32 zero bytes, then block 2u + 1's), B the two blocks' 16 k-quads, so C's rows i hold block
 * 2u's sums and rows M + i block 2u + 1's, each exactly its block's (the zeros add nothing).
 * The float work runs on the M rows there are (no rounding up), and 4-bit blocks are unpacked
 * into a ring of B slots AMX_UNPACK units ahead of their tile loads, in L1, instead of a whole
 * tile up front; the calling thread's scratch is kept between calls. Per output, the VNNI
 * pass's float operations in its order: bit for bit.
 *
 * Measured (benchmarks/wq_gemm.py --amx --baseline-amx, SmolLM2 layers at 2 / 4 / 8 GEMM rows):
 * 3.6-3.9 / 4.2-4.3 / 5.8-5.9 ms against the one-C-tile loop's 4.6-4.9 / 5.1-5.2 / 5.9-6.0.
 * What is left at few rows, per (block, weight tile): the 4-bit unpack (3 vector operations and
 * 2 stores per 64 code bytes, as many as the VNNI pass's unpack, plus the stores), ~20-30
 * cycles of tile instructions whatever M (loads, zero, product, store), and 4 float operations
 * per row on the one 512-bit port; the VNNI pass's 8 vpdpbusd per row only outweigh the tile
 * instructions from ~10 rows. Tried, no gain: prefetching the codes (2-8 KiB ahead; slower),
 * a deeper ring (8 slots, LAG 3-5, UNPACK 2-6: slower, the ring no longer fits L1 beside the
 * stream). Allocating the scratch per call cost ~7 us a call (page faults).
 */
#define AMX_JT 3
#ifndef AMX_FEW_MAX
/* GEMMs of up to this many rows take the few-row path (chunks of <= 16 rows); more, the
 * one-C-tile loop. Measured (benchmarks/wq_gemm.py, layers + head ms, few-row / one-C-tile):
 * 18 rows 11.9 / 14.5, 24 rows 13.6 / 15.7, 26 rows 14.8 / 16.1, 28 rows 15.6 / 15.9,
 * 32 rows 16.7 / 16.6 */
#define AMX_FEW_MAX 28
#endif
#ifndef AMX_PB_MAX
#define AMX_PB_MAX 8 /* M <= this: two blocks per product */
#endif
#ifndef AMX_LAG
#define AMX_LAG 2
#endif
#ifndef AMX_UNPACK
#define AMX_UNPACK 1
#endif
#ifndef AMX_RING
#define AMX_RING 4 /* slots of both rings: a power of two */
#endif
_Static_assert(AMX_RING > AMX_LAG && AMX_RING > AMX_UNPACK && !(AMX_RING & (AMX_RING - 1)),
               "a ring slot is rewritten only after its last reader");

static void amx_config_few(int ra, int pb) {
    kvs_amx_cfg cfg;
    kvs_amx_cfg_init(&cfg);
    for (int t = 0; t < 2; t++) { /* A: pb ra rows x 32 pb int8 */
        cfg.rows[t] = (uint8_t)(pb * ra);
        cfg.colsb[t] = (uint16_t)(32 * pb);
    }
    for (int j = 0; j < AMX_JT; j++) {
        cfg.rows[2 + j] = (uint8_t)(8 * pb); /* B: 8 pb k-quads x 16 outputs x 4 */
        cfg.colsb[2 + j] = 64;
        cfg.rows[5 + j] = (uint8_t)(pb * ra); /* C: pb ra rows x 16 int32 */
        cfg.colsb[5 + j] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The M = ra (<= 16) rows against weight tiles wt[j] (scales st[j]) over all of K; row i of
 * tile j's 16 outputs to yo[j] + i * ldy (yo[j] NULL: an alias, dropped). A tiles: pb = 1,
 * q itself (row stride K); pb = 2, a2 [nu][2 ra][64] as above. dxt [nb][16], mst [ng][16] as
 * for amx_ctile. nr: rows of float work (ra where g1, else ra rounded up to 4 with pb = 1;
 * rows past ra read rows of cb no tile store writes, and are dropped). tb: [AMX_JT][1024], the
 * last unit of an 8-bit table with an odd number of blocks (its second half never counts). */
static inline __attribute__((always_inline)) void amx_few(
    const int8_t *restrict a, int64_t K, const uint8_t *const wt[AMX_JT],
    const uint16_t *const st[AMX_JT], const float *restrict dxt, const float *restrict mst,
    int64_t bpg, const int nr, const int g1, const int bits, const int pb, int ra,
    float *const yo[AMX_JT], int64_t ldy, uint8_t (*restrict ub)[AMX_JT][1024],
    int32_t (*restrict cb)[AMX_JT][16][16], float (*restrict om)[16][16],
    uint8_t (*restrict tb)[1024]) {
    const int64_t nb = K / 32, nu = (nb + pb - 1) / pb;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 acc[AMX_JT][16]; /* g1: out; else f of the current group */
#pragma GCC unroll 4
    for (int j = 0; j < AMX_JT; j++)
#pragma GCC unroll 16
        for (int i = 0; i < nr; i++) acc[j][i] = _mm512_setzero_ps();
    if (!g1) memset(om, 0, sizeof(float) * AMX_JT * 16 * 16);
    if (bits == 8 && pb == 2 && (nb & 1))
        for (int j = 0; j < AMX_JT; j++) memcpy(tb[j], wt[j] + 512 * (nb - 1), 512);
/* 4-bit unit uu of every tile -> B slot uu (k-oct t -> k-quads 2t, 2t + 1) */
#define AMX_UNPACK_UNIT(uu)                                                                  \
    do {                                                                                     \
        uint8_t(*dst)[1024] = ub[(uu) & (AMX_RING - 1)];                                     \
        const int nt = pb == 2 && 2 * (uu) + 1 >= nb ? 4 : 4 * pb;                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < AMX_JT; j++)                             \
            for (int t = 0; t < nt; t++) {                                                   \
                const __m512i v =                                                            \
                    _mm512_loadu_si512((const void *)(wt[j] + 256 * pb * (uu) + 64 * t));    \
                _mm512_store_si512((void *)(dst[j] + 128 * t), _mm512_and_si512(v, lo4));    \
                _mm512_store_si512((void *)(dst[j] + 128 * t + 64),                          \
                                   _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));          \
            }                                                                                \
    } while (0)
#define AMX_BSRC(j, uu)                                                                      \
    (bits == 4 ? (const void *)ub[(uu) & (AMX_RING - 1)][j]                                  \
     : pb == 2 && 2 * (uu) + 1 >= nb ? (const void *)tb[j]                                   \
                                     : (const void *)(wt[j] + 512 * pb * (uu)))
#define AMX_TILES(TA, uu)                                                                    \
    do {                                                                                     \
        int32_t(*c)[16][16] = cb[(uu) & (AMX_RING - 1)];                                     \
        if (pb == 2)                                                                         \
            _tile_loadd(TA, a + 128 * ra * (uu), 64);                                        \
        else                                                                                 \
            _tile_loadd(TA, a + 32 * (uu), K);                                               \
        _tile_loadd(2, AMX_BSRC(0, uu), 64);                                                 \
        _tile_loadd(3, AMX_BSRC(1, uu), 64);                                                 \
        _tile_loadd(4, AMX_BSRC(2, uu), 64);                                                 \
        _tile_zero(5);                                                                       \
        _tile_zero(6);                                                                       \
        _tile_zero(7);                                                                       \
        _tile_dpbsud(5, TA, 2);                                                              \
        _tile_dpbsud(6, TA, 3);                                                              \
        _tile_dpbsud(7, TA, 4);                                                              \
        _tile_stored(5, c[0], 64);                                                           \
        _tile_stored(6, c[1], 64);                                                           \
        _tile_stored(7, c[2], 64);                                                           \
    } while (0)
#define AMX_LOAD_SM(V, p) V = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* block bb's floats from C rows r0 .. r0 + nr - 1 of slot sl */
#define AMX_FLOATS(bb, sl, r0)                                                               \
    do {                                                                                     \
        int32_t(*c)[16][16] = cb[sl];                                                        \
        __m512 s[AMX_JT], mn[AMX_JT];                                                        \
        if (g1) {                                                                            \
            _Pragma("GCC unroll 4") for (int j = 0; j < AMX_JT; j++) {                       \
                AMX_LOAD_SM(s[j], st[j] + (bb) * 32);                                        \
                AMX_LOAD_SM(mn[j], st[j] + (bb) * 32 + 16);                                  \
            }                                                                                \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                          \
                const __m512 d = _mm512_set1_ps(dxt[(bb) * 16 + i]);                         \
                const __m512 msv = _mm512_set1_ps(mst[(bb) * 16 + i]);                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < AMX_JT; j++) {                   \
                    const __m512 f = _mm512_fmadd_ps(                                        \
                        _mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[j][(r0) + i])), \
                        d, _mm512_setzero_ps());                                             \
                    acc[j][i] = _mm512_fmadd_ps(s[j], f, acc[j][i]);                         \
                    acc[j][i] = _mm512_fmadd_ps(mn[j], msv, acc[j][i]);                      \
                }                                                                            \
            }                                                                                \
        } else {                                                                             \
            const int64_t g = (bb) / bpg;                                                    \
            if ((bb) == g * bpg)                                                             \
                for (int j = 0; j < AMX_JT; j++)                                             \
                    _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) acc[j][i] =        \
                        _mm512_setzero_ps();                                                 \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                          \
                const __m512 d = _mm512_set1_ps(dxt[(bb) * 16 + i]);                         \
                for (int j = 0; j < AMX_JT; j++)                                             \
                    acc[j][i] = _mm512_fmadd_ps(                                             \
                        _mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[j][(r0) + i])), \
                        d, acc[j][i]);                                                       \
            }                                                                                \
            if ((bb) == (g + 1) * bpg - 1)                                                   \
                for (int j = 0; j < AMX_JT; j++) {                                           \
                    AMX_LOAD_SM(s[j], st[j] + g * 32);                                       \
                    AMX_LOAD_SM(mn[j], st[j] + g * 32 + 16);                                 \
                    _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                  \
                        __m512 o = _mm512_load_ps(om[j][i]);                                 \
                        o = _mm512_fmadd_ps(s[j], acc[j][i], o);                             \
                        o = _mm512_fmadd_ps(mn[j], _mm512_set1_ps(mst[g * 16 + i]), o);      \
                        _mm512_store_ps(om[j][i], o);                                        \
                    }                                                                        \
                }                                                                            \
        }                                                                                    \
    } while (0)
/* unit uu's unpack-ahead and tile products (A tile TA), then unit uu - AMX_LAG's floats */
#define AMX_STEP(TA, uu)                                                                     \
    do {                                                                                     \
        if ((uu) < nu) {                                                                     \
            if (bits == 4 && (uu) + AMX_UNPACK < nu)                                         \
                AMX_UNPACK_UNIT((uu) + AMX_UNPACK);                                          \
            AMX_TILES(TA, uu);                                                               \
        }                                                                                    \
        if ((uu) >= AMX_LAG && (uu) - AMX_LAG < nu) {                                        \
            const int64_t fu = (uu) - AMX_LAG, sl = fu & (AMX_RING - 1);                     \
            AMX_FLOATS(pb * fu, sl, 0);                                                      \
            if (pb == 2 && 2 * fu + 1 < nb) AMX_FLOATS(2 * fu + 1, sl, ra);                  \
        }                                                                                    \
    } while (0)
    if (bits == 4)
        for (int64_t uu = 0; uu < AMX_UNPACK && uu < nu; uu++) AMX_UNPACK_UNIT(uu);
    for (int64_t un = 0; un < nu + AMX_LAG; un += 2) {
        AMX_STEP(0, un);
        AMX_STEP(1, un + 1);
    }
#undef AMX_STEP
#undef AMX_FLOATS
#undef AMX_LOAD_SM
#undef AMX_TILES
#undef AMX_BSRC
#undef AMX_UNPACK_UNIT
    for (int j = 0; j < AMX_JT; j++)
        if (yo[j] != NULL)
            for (int i = 0; i < ra; i++) {
                if (g1)
                    _mm512_storeu_ps(yo[j] + i * ldy, acc[j][i]);
                else
                    memcpy(yo[j] + i * ldy, om[j][i], 64);
            }
}

/* scratch per thread of the few-row path: B ring, C ring, out of AMX_JT C tiles, odd tail */
#define AMX_FEW_BYTES ((size_t)AMX_RING * AMX_JT * (1024 + 1024) + AMX_JT * (1024 + 1024))

/* one chunk of <= 16 rows: its rows' dxt, mst (see amx_few), A (q itself, or a2 for pb = 2) */
typedef struct {
    int ra, pb, nr;
    const int8_t *a;
    const float *dxt, *mst;
    float *y;
} amx_chunk;

/* the AMX_JT weight tiles wt / st against chunk ch (weight tile j's outputs at column yc[j], -1:
 * an alias, dropped) */
static void amx_few_chunk(const amx_chunk *ch, int64_t K, int64_t N, int64_t bpg, int bits,
                          const uint8_t *const wt[AMX_JT], const uint16_t *const st[AMX_JT],
                          const int64_t yc[AMX_JT], uint8_t (*ub)[AMX_JT][1024],
                          int32_t (*cb)[AMX_JT][16][16], float (*om)[16][16],
                          uint8_t (*tb)[1024]) {
    float *yo[AMX_JT];
    for (int j = 0; j < AMX_JT; j++) yo[j] = yc[j] < 0 ? NULL : ch->y + yc[j];
    const int g1 = bpg == 1, ra = ch->ra;
    const int8_t *a = ch->a;
    const float *dxt = ch->dxt, *mst = ch->mst;
#define AMX_FEW(NR, G1, PB)                                                                  \
    amx_few(a, K, wt, st, dxt, mst, bpg, NR, G1, bits, PB, ra, yo, N, ub, cb, om, tb)
    if (ch->pb == 2) {
        switch (ch->nr) {
        case 1: AMX_FEW(1, g1, 2); break;
        case 2: AMX_FEW(2, g1, 2); break;
        case 3: AMX_FEW(3, g1, 2); break;
        case 4: AMX_FEW(4, g1, 2); break;
        case 5: AMX_FEW(5, g1, 2); break;
        case 6: AMX_FEW(6, g1, 2); break;
        case 7: AMX_FEW(7, g1, 2); break;
        default: AMX_FEW(8, g1, 2); break;
        }
    } else if (g1) {
        switch (ch->nr) {
        case 9: AMX_FEW(9, 1, 1); break;
        case 10: AMX_FEW(10, 1, 1); break;
        case 11: AMX_FEW(11, 1, 1); break;
        case 12: AMX_FEW(12, 1, 1); break;
        case 13: AMX_FEW(13, 1, 1); break;
        case 14: AMX_FEW(14, 1, 1); break;
        case 15: AMX_FEW(15, 1, 1); break;
        default: AMX_FEW(16, 1, 1); break;
        }
    } else {
        switch (ch->nr) {
        case 12: AMX_FEW(12, 0, 1); break;
        default: AMX_FEW(16, 0, 1); break;
        }
    }
#undef AMX_FEW
}

/* wq_gemm_amx for M <= AMX_FEW_MAX: weight tiles in groups of AMX_JT (the last group's missing
 * tiles aliased to the last tile, their results dropped); M > 16 in chunks of <= 16 rows, as
 * even as they come (18: 9 + 9), each tile group's chunks back to back while its codes are in
 * L1 / L2 (the weights are read from memory once; measured: a pass per chunk lost ~15% on the
 * head, which comes from DRAM) */
static int wq_gemm_amx_few(const uint8_t *restrict codes, const uint16_t *restrict sm,
                           const int8_t *restrict q, const float *restrict dx,
                           const int32_t *restrict qs, int64_t M, int64_t N, int64_t K,
                           int64_t G, int bits, int num_threads, float *restrict y) {
    const int64_t ntiles = N / 16, ng = K / G, nb = K / 32, bpg = G / 32;
    const int64_t tile_bytes = K * 16 * bits / 8, ngroups = (ntiles + AMX_JT - 1) / AMX_JT;
    const int nch = (int)((M + 15) / 16);
    const size_t t_bytes = ((size_t)((nb + ng) * 16) * sizeof(float) + 63) & ~(size_t)63;
    const size_t a_bytes = (size_t)(((nb + 1) / 2) * 2 * AMX_PB_MAX * 64); /* per chunk, max */
    const size_t per_thread = (AMX_FEW_BYTES + 63) & ~(size_t)63;
    /* the calling thread's scratch, kept between calls (allocating it per call cost a page
     * fault per page each time: ~7 us a call, a fifth of a decode step's AMX time) */
    static _Thread_local char *few_buf = NULL;
    static _Thread_local size_t few_cap = 0;
    const size_t need = (t_bytes + a_bytes) * (size_t)nch + per_thread * (size_t)num_threads;
    if (need > few_cap) {
        char *p = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (p == NULL) return 1;
        free(few_buf);
        few_buf = p;
        few_cap = need;
    }
    char *buf = few_buf;
    amx_chunk chs[(AMX_FEW_MAX + 15) / 16];
    int zero_cb = 0;
    for (int c = 0, m0 = 0; c < nch; c++) {
        amx_chunk *ch = &chs[c];
        const int ra = (int)(M / nch + (c < M % nch)), pb = ra <= AMX_PB_MAX ? 2 : 1;
        const int nr = bpg == 1 || pb == 2 ? ra : (ra + 3) / 4 * 4;
        float *dxt = (float *)(buf + (t_bytes + a_bytes) * (size_t)c), *mst = dxt + nb * 16;
        for (int i = 0; i < nr; i++) /* the rows amx_few reads; past ra, the last one's */
            amx_row_prep(dx, qs, m0 + (i < ra ? i : ra - 1), nb, ng, bpg, dxt, mst, i);
        int8_t *a2 = (int8_t *)((char *)dxt + t_bytes); /* pb = 2: [nu][2 ra][64], amx_few */
        if (pb == 2) {
            memset(a2, 0, (size_t)(((nb + 1) / 2) * 2 * ra * 64));
            for (int64_t b = 0; b < nb; b++)
                for (int i = 0; i < ra; i++)
                    memcpy(a2 + ((b >> 1) * 2 * ra + (b & 1) * ra + i) * 64 + 32 * (b & 1),
                           q + (m0 + i) * K + 32 * b, 32);
        }
        ch->ra = ra;
        ch->pb = pb;
        ch->nr = nr;
        ch->a = pb == 2 ? a2 : q + m0 * K;
        ch->dxt = dxt;
        ch->mst = mst;
        ch->y = y + m0 * N;
        zero_cb |= ch->nr > ra;
        m0 += ra;
    }
    kvs_share sh;
    kvs_share_init(&sh, ngroups, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = buf + (t_bytes + a_bytes) * (size_t)nch +
                     per_thread * (size_t)omp_get_thread_num();
        uint8_t(*ub)[AMX_JT][1024] = (uint8_t(*)[AMX_JT][1024])mine;
        int32_t(*cb)[AMX_JT][16][16] =
            (int32_t(*)[AMX_JT][16][16])(mine + (size_t)AMX_RING * AMX_JT * 1024);
        float(*om)[16][16] = (float(*)[16][16])(mine + (size_t)AMX_RING * AMX_JT * 2048);
        uint8_t(*tb)[1024] = (uint8_t(*)[1024])(mine + (size_t)AMX_RING * AMX_JT * 2048 +
                                                AMX_JT * 1024);
        if (zero_cb) memset(cb, 0, (size_t)AMX_RING * AMX_JT * 1024); /* rows past ra: read */
        int cfg = -1; /* the chunk whose tile shape is loaded */
        KVS_SHARE_FOR(sh, tg) {
            const uint8_t *wt[AMX_JT];
            const uint16_t *st[AMX_JT];
            int64_t yc[AMX_JT];
            for (int j = 0; j < AMX_JT; j++) {
                const int64_t want = tg * AMX_JT + j, tile = want < ntiles ? want : ntiles - 1;
                wt[j] = codes + tile * tile_bytes;
                st[j] = sm + tile * ng * 32;
                yc[j] = want < ntiles ? tile * 16 : -1;
            }
            for (int c = 0; c < nch; c++) {
                if (cfg < 0 || chs[c].ra != chs[cfg].ra || chs[c].pb != chs[cfg].pb) {
                    amx_config_few(chs[c].ra, chs[c].pb);
                    cfg = c;
                }
                amx_few_chunk(&chs[c], K, N, bpg, bits, wt, st, yc, ub, cb, om, tb);
            }
        }
        _tile_release();
    }
    return 0;
}

/* scratch per thread: an unpacked 4-bit tile, two C tiles, out of one C tile */
#define AMX_THREAD_BYTES(K) ((size_t)(K) * 16 + 2 * 1024 + 1024)

/* Returns 0, or 1 if scratch could not be allocated (nothing written: the caller runs VNNI) */
static int wq_gemm_amx(const uint8_t *restrict codes, const uint16_t *restrict sm,
                       const int8_t *restrict q, const float *restrict dx,
                       const int32_t *restrict qs, int64_t M, int64_t N, int64_t K, int64_t G,
                       int bits, int num_threads, float *restrict y) {
    if (M <= AMX_FEW_MAX)
        return wq_gemm_amx_few(codes, sm, q, dx, qs, M, N, K, G, bits, num_threads, y);
    const int64_t ntiles = N / 16, ng = K / G, nb = K / 32, bpg = G / 32;
    const int64_t tile_bytes = K * 16 * bits / 8;
    const int ra = M < 16 ? (int)M : 16;              /* rows per row tile */
    const int64_t nrt = M < 16 ? 1 : (M + 15) / 16;   /* row tiles */
    /* per row tile rt: dxt [nb][16] = dx of its rows, mst [ng][16] = sum_{b in g} dx qs in
     * the VNNI pass's order (rows past ra: its last row's) */
    const size_t t_bytes = ((size_t)(nrt * (nb + ng) * 16) * sizeof(float) + 63) & ~(size_t)63;
    const size_t per_thread = (AMX_THREAD_BYTES(K) + 63) & ~(size_t)63;
    char *buf = aligned_alloc(64, t_bytes + per_thread * (size_t)num_threads);
    if (buf == NULL) return 1;
    float *dxt_all = (float *)buf, *mst_all = dxt_all + nrt * nb * 16;
    for (int64_t rt = 0; rt < nrt; rt++)
        for (int i = 0; i < 16; i++) {
            const int64_t want = 16 * rt;
            const int64_t r0 = M < 16 ? 0 : (want + 16 <= M ? want : M - 16);
            amx_row_prep(dx, qs, r0 + (i < ra ? i : ra - 1), nb, ng, bpg,
                         dxt_all + rt * nb * 16, mst_all + rt * ng * 16, i);
        }
    const int nr = (ra + 3) / 4 * 4, g1 = bpg == 1;
    kvs_share sh;
    kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = buf + t_bytes + per_thread * (size_t)omp_get_thread_num();
        uint8_t *ub = (uint8_t *)mine; /* [K / 4][64] */
        int32_t(*cb)[16][16] = (int32_t(*)[16][16])(mine + (size_t)K * 16);
        float(*om)[16] = (float(*)[16])(mine + (size_t)K * 16 + 2048);
        memset(cb, 0, 2048); /* rows past ra are read (and dropped) when ra % 4 != 0 */
        amx_config(ra);
        KVS_SHARE_FOR(sh, tile) {
            const uint8_t *wt = codes + tile * tile_bytes, *w = wt;
            const uint16_t *st = sm + tile * ng * 32;
            if (bits == 4) { /* k-oct t -> k-quads 2t (low nibbles), 2t + 1 (high) */
                const __m512i lo4 = _mm512_set1_epi8(0x0F);
                for (int64_t t = 0; t < K / 8; t++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(wt + 64 * t));
                    _mm512_store_si512((void *)(ub + 128 * t), _mm512_and_si512(v, lo4));
                    _mm512_store_si512((void *)(ub + 128 * t + 64),
                                       _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
                }
                w = ub;
            }
            for (int64_t rt = 0; rt < nrt; rt++) {
                const int64_t want = 16 * rt, r0 = M < 16 ? 0 : (want + 16 <= M ? want : M - 16);
                float *yr[16];
                for (int i = 0; i < 16; i++)
                    yr[i] = y + (r0 + (i < ra ? i : ra - 1)) * N + tile * 16;
                const float *dxt = dxt_all + rt * nb * 16, *mst = mst_all + rt * ng * 16;
                const int8_t *a = q + r0 * K;
                const int own = (int)(want - r0);
#define AMX_CT(NR, G1) amx_ctile(a, K, w, st, dxt, mst, bpg, NR, G1, own, ra, yr, cb, om)
                if (g1) {
                    switch (nr) {
                    case 4: AMX_CT(4, 1); break;
                    case 8: AMX_CT(8, 1); break;
                    case 12: AMX_CT(12, 1); break;
                    default: AMX_CT(16, 1); break;
                    }
                } else {
                    switch (nr) {
                    case 4: AMX_CT(4, 0); break;
                    case 8: AMX_CT(8, 0); break;
                    case 12: AMX_CT(12, 0); break;
                    default: AMX_CT(16, 0); break;
                    }
                }
#undef AMX_CT
            }
        }
        _tile_release();
    }
    free(buf);
    return 0;
}
#undef AMX_BLOCK
#endif

/* AMX-INT8 for GEMMs of at least `rows` rows (rows < 1 leaves the thresholds; rows >= 1 sets
 * both the 8-bit and the 4-bit one): request 1 turns it on where the build and the CPU have it
 * (asking Linux for the tile state once), 0 turns it off (the VNNI passes for every row count),
 * -1 only asks. Returns the (8-bit, lower) threshold in force while it is on, 0 while off. */
int kvs_wq_amx(int request, int rows) {
#ifdef KVS_WQ_AMX
    if (rows >= 1) {
        __atomic_store_n(&amx_rows, rows, __ATOMIC_RELEASE);
        __atomic_store_n(&amx_rows4, rows, __ATOMIC_RELEASE);
    }
    return kvs_amx_request(&amx_state, request, KVS_AMX_INT8_BIT)
               ? __atomic_load_n(&amx_rows, __ATOMIC_ACQUIRE)
               : 0;
#else
    (void)request;
    (void)rows;
    return 0;
#endif
}

/* y fp32 [M, N] (N % 16 == 0, K % G == 0, G % 32 == 0). OpenMP over weight tiles: each
 * tile's codes are read from memory once (AMX, the wide pass) or once per 4 rows of x. */
void kvs_wq_gemm(const uint8_t *restrict codes, const uint16_t *restrict sm,
                 const int8_t *restrict q, const float *restrict dx, const int32_t *restrict qs,
                 int64_t M, int64_t N, int64_t K, int64_t G, int bits, int num_threads,
                 float *restrict y) {
#ifdef KVS_WQ_AMX
    if (M >= __atomic_load_n(bits == 4 ? &amx_rows4 : &amx_rows, __ATOMIC_ACQUIRE) &&
        __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1 &&
        wq_gemm_amx(codes, sm, q, dx, qs, M, N, K, G, bits, num_threads, y) == 0)
        return;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (M >= WIDE_MIN_ROWS && M <= WIDE_MAX_ROWS) {
        /* chunks of <= WM rows, as even as they come (9 rows: 5 + 4), each tile's chunks one
         * after the other while its codes are in L1: the weights are read from memory once */
        const int64_t ntiles = N / 16, ng = K / G, nch = (M + WM - 1) / WM;
        const int64_t tile_bytes = K * 16 * bits / 8, nb = K / 32, bpg = G / 32;
        /* ms[m][g] = sum_{b in g} dx qs, in pass_vnni's scalar order: the same for every tile,
         * so computed once (as the AMX path does) instead of in every tile's pass */
        float *ms = malloc(sizeof(float) * (size_t)(M * ng));
        if (ms == NULL) goto passes; /* pass_vnni needs no scratch */
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < ng; g++) {
                float acc = 0;
                for (int64_t b = g * bpg; b < (g + 1) * bpg; b++)
                    acc += dx[m * nb + b] * (float)qs[m * nb + b];
                ms[m * ng + g] = acc;
            }
#define KVS_WIDE(VM) \
    pass_vnni_wide(wt, st, q + m0 * K, dx + m0 * nb, ms + m0 * ng, K, G, bits, VM, \
                   y + m0 * N + tile * 16, N)
        kvs_share sh;
        kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
        KVS_SHARE_FOR(sh, tile) {
            const uint8_t *wt = codes + tile * tile_bytes;
            const uint16_t *st = sm + tile * ng * 32;
            for (int64_t c = 0, m0 = 0; c < nch; c++) {
                const int64_t vm = M / nch + (c < M % nch);
                switch (vm) { /* one specialized copy per row count */
                case 1: KVS_WIDE(1); break;
                case 2: KVS_WIDE(2); break;
                case 3: KVS_WIDE(3); break;
                case 4: KVS_WIDE(4); break;
                case 5: KVS_WIDE(5); break;
                case 6: KVS_WIDE(6); break;
                case 7: KVS_WIDE(7); break;
                default: KVS_WIDE(8); break;
                }
                m0 += vm;
            }
        }
#undef KVS_WIDE
        free(ms);
        return;
    }
passes:
    {
        const int64_t ntiles = N / 16, ng = K / G, nb = K / 32;
        const int64_t tile_bytes = K * 16 * bits / 8, ngroups = (ntiles + VT - 1) / VT;
        kvs_share sh;
        kvs_share_init(&sh, ngroups, num_threads);
#pragma omp parallel num_threads(num_threads)
        KVS_SHARE_FOR(sh, tg) {
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
    kvs_share sh;
    kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
    KVS_SHARE_FOR(sh, tile) {
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
