/*
 * Integer-dot GEMM for GGUF's 5-bit and K-quant formats kept packed: Q5_0, Q5_1, Q4_K, Q5_K,
 * Q6_K (ggml type ids 6, 7, 12, 13, 14). Activations are quantized per row in int8 blocks of
 * 32 columns (act_q8.h, as wq_gemm.c does for Q4_0 / Q4_1 / Q8_0), the products run on
 * integer units (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw + vpmaddwd, or plain C), and the
 * formats' integer sub-block scales are applied to the exact integer sums:
 *
 *   Q5_0  w = d (u - 16)            per 32: T = I - 16 qs                    y += d sum_b dx T
 *   Q5_1  w = d u + m               per 32: T = I                y += d sum dx T + m sum dx qs
 *   Q4_K  w = d sc u - dmin mn      per 32: T = sc I; per 256:  y += d sum dx T - dmin sum dx mn qs
 *   Q5_K  (the same, 5-bit u)
 *   Q6_K  w = d sc_h (u - 32)       per 16 (h): T = sum_h sc_h (I_h - 32 qs_h); y += d sum dx T
 *
 * with u the unsigned code, I = sum_k u[k] q[k] over the block (or half-block h) and qs / qs_h
 * the sums of the activation's int8 q. The integer part of every T (I - c qs) is exact and
 * below 2^24 (so its fp32 conversion is exact); the sub-scales sc join dx as one float factor
 * (sc dx). Results equal dequant(W) . dequant(quant(x)) up to fp32 rounding of the products
 * and sums. Twin: kvserve.kernels.reference.kq_matmul; tests/quant/test_kq.py sweeps types,
 * shapes and ISA builds against it (and its dequantization against gguf.quants).
 *
 * Layout (kvserve.quant.kq packs it): per tile of 16 output rows, per super-block (sb = 8
 * blocks of 32 for K-quants, 1 for Q5_0 / Q5_1), one byte stream
 *   hdr     fp16 D[16] (d), then for Q5_1 / K-quants fp16 Dm[16] (m / dmin)
 *   per block of 32 columns:
 *     scales  Q4_K / Q5_K: uint8 sc[16], uint8 mn[16];  Q6_K: int8 sc[2 halves][16]
 *     lo      uint8 [4 t][16 rows][4 j]: low nibble bits 0-3 of u[r, 8t + j], high nibble
 *             those of u[r, 8t + 4 + j] (wq_gemm.c's 4-bit tile order)
 *     hi      5-bit: 8 uint64 masks, mask 2t + n bit 4r + j = bit 4 of u[r, 8t + 4n + j];
 *             6-bit: those 8, then 8 more for bit 5
 * so a 64-byte load is 16 rows x 4 columns and its high bits one 64-bit AVX-512 mask. Bytes
 * per 16 x 256 weights: Q4_K 2368 (file 2304), Q5_K 2880 (2816), Q6_K 3360 (3360); per
 * 16 x 32: Q5_0 352 (352), Q5_1 384 (384): within 3% of the file.
 *
 * AVX-512 VNNI GEMMs of 1-4 rows run pass_vnni (4 weight tiles x 1-4 rows: one pass, the
 * weights read once), 5-24 the wide pass (one tile x up to 8 rows, the weights read once), more
 * pass_vnni's passes of 4 rows or, from 25 rows where the CPU has them, AMX-INT8 tiles.
 * Batch invariance: a row's result depends on that row alone and every row runs the same float
 * operations in the same order whatever the batch and the pass (rows past the end alias valid
 * ones, results dropped).
 */
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

/* the format of one ggml type, as the kernel reads it */
typedef struct {
    int bits;   /* code bits: 4, 5, 6 */
    int sb;     /* blocks of 32 per super-block (per header) */
    int subsc;  /* 0: none; 1: uint8 sc + mn per block; 2: int8 sc per half-block */
    int dm;     /* 0: no Dm; 1: + Dm sum dx qs (Q5_1); 2: - Dm sum dx mn qs (K-quants) */
    int zero;   /* code offset c: w ~ (u - c) */
} kq_fmt;

static int kq_format(int type, kq_fmt *f) {
    switch (type) {
    case 6: *f = (kq_fmt){5, 1, 0, 0, 16}; return 0;   /* Q5_0 */
    case 7: *f = (kq_fmt){5, 1, 0, 1, 0}; return 0;    /* Q5_1 */
    case 12: *f = (kq_fmt){4, 8, 1, 2, 0}; return 0;   /* Q4_K */
    case 13: *f = (kq_fmt){5, 8, 1, 2, 0}; return 0;   /* Q5_K */
    case 14: *f = (kq_fmt){6, 8, 2, 0, 32}; return 0;  /* Q6_K */
    default: return -1;
    }
}

static inline int64_t hdr_bytes(const kq_fmt f) { return 32 * (f.dm ? 2 : 1); }
static inline int64_t blk_bytes(const kq_fmt f) {
    return (f.subsc ? 32 : 0) + 256 + 64 * (f.bits - 4);
}
static inline int64_t sb_bytes(const kq_fmt f) { return hdr_bytes(f) + f.sb * blk_bytes(f); }

/* bytes of one weight of n rows (n padded to 16) and k columns in this layout; -1 for an
 * unknown type or a k the type cannot hold */
int64_t kvs_kq_bytes(int type, int64_t n, int64_t k) {
    kq_fmt f = {0, 1, 0, 0, 0};
    if (kq_format(type, &f) || k % (32 * f.sb)) return -1;
    return (n + 15) / 16 * (k / (32 * f.sb)) * sb_bytes(f);
}

/* ---------------------------------------------------------------- activations */

/* x fp32 [M, K] -> q int8 [terms M, K], dx fp32 [terms M, K/32], qs int32 [terms M, K/16]
 * (sums of q per 16 columns; the terms == 2 remainder rows follow the first M) */
static void quant_act(const float *restrict x, int64_t M, int64_t K, int terms,
                      int num_threads, int8_t *restrict q, float *restrict dx,
                      int32_t *restrict qs) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        int32_t s1, s2;
        const int64_t i2 = M * nb + i;
        kvs_quant_block(x + i * 32, terms, q + i * 32, terms == 2 ? q + i2 * 32 : NULL, dx + i,
                        &s1, terms == 2 ? dx + i2 : NULL, &s2);
        for (int t = 0; t < terms; t++) {
            const int8_t *qb = q + (t ? i2 : i) * 32;
            int32_t lo = 0, hi = 0;
            for (int j = 0; j < 16; j++) {
                lo += qb[j];
                hi += qb[16 + j];
            }
            qs[2 * (t ? i2 : i)] = lo;
            qs[2 * (t ? i2 : i) + 1] = hi;
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VT 4 /* tiles (64 output rows) per pass */
#define VM 4 /* rows of x per pass */
/* GEMMs of at most KQ_VNNI_PF_ROWS rows (one pass per tile group: batch-1 decode's 2 GEMM
 * rows, 2 rows of x) prefetch this many bytes ahead in each of the pass's 4 tile streams (0:
 * none). 2026-12-07, 2 threads, int8x2, weights in L3: 2 rows Q4_K / Q5_K / Q5_0 4-7% faster
 * than the wide pass, Q6_K 18% (the same work; four tiles' streams interleaved, more to
 * overlap); 4 rows Q4_K 5% faster, Q5_0 level, Q5_K / Q6_K 6-14% slower; streamed from DRAM
 * (570 MB) 1.4x faster at 4 rows: the wide pass's one stream per thread reads at ~15 GB/s of
 * 23 (docs/quantization.md). */
#ifndef KQ_VNNI_PF
#define KQ_VNNI_PF 4096
#endif
#ifndef KQ_VNNI_PF_ROWS
#define KQ_VNNI_PF_ROWS 4
#endif

/* Codes t of a 32-column block (lo: its low nibbles) -> w0 / w1: the 16 columns' 4 + 4 k-quads
 * as unsigned bytes (the 5th / 6th bit planes at lo + 256 and lo + 320 added), vpdpbusd's B. */
static inline __attribute__((always_inline)) void kq_codes(const uint8_t *lo, int t,
                                                          const int bits, __m512i *w0p,
                                                          __m512i *w1p) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512((const void *)(lo + 64 * t));
    __m512i w0 = _mm512_and_si512(v, lo4);
    __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    if (bits >= 5) {
        uint64_t m0, m1;
        memcpy(&m0, lo + 256 + 8 * (2 * t), 8);
        memcpy(&m1, lo + 256 + 8 * (2 * t + 1), 8);
        w0 = _mm512_mask_add_epi8(w0, (__mmask64)m0, w0, _mm512_set1_epi8(16));
        w1 = _mm512_mask_add_epi8(w1, (__mmask64)m1, w1, _mm512_set1_epi8(16));
    }
    if (bits == 6) {
        uint64_t m0, m1;
        memcpy(&m0, lo + 256 + 64 + 8 * (2 * t), 8);
        memcpy(&m1, lo + 256 + 64 + 8 * (2 * t + 1), 8);
        w0 = _mm512_mask_add_epi8(w0, (__mmask64)m0, w0, _mm512_set1_epi8(32));
        w1 = _mm512_mask_add_epi8(w1, (__mmask64)m1, w1, _mm512_set1_epi8(32));
    }
    *w0p = w0;
    *w1p = w1;
}

/* A block's 16 columns' sub-scales as floats: 1 (none), unsigned bytes at blk (subsc 1), or the
 * signed bytes of segment seg at blk + 16 seg (subsc 2). */
static inline __attribute__((always_inline)) __m512 kq_subscales(const uint8_t *blk,
                                                                 const int subsc, int seg) {
    if (subsc == 1)
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk)));
    if (subsc == 2)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * seg))));
    return _mm512_set1_ps(1.0f);
}

/* vt tiles x vm rows of x over all of K; out fp32 [VT][VM][16]. The type's constants are
 * literal at each call site (always inlined): one specialized copy per type and vm. */
static inline __attribute__((always_inline)) void pass_vnni(
    const uint8_t *const wt[VT], const int8_t *const qr[VM], const float *const dxr[VM],
    const int32_t *const qsr[VM], int64_t K, const int bits, const int sb, const int subsc,
    const int dm, const int zero, const int vm, const int pf, float out[VT][VM][16]) {
    const kq_fmt f = {bits, sb, subsc, dm, zero};
    const int64_t nsb = K / (32 * sb), hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int nseg = subsc == 2 ? 2 : 1, tseg = 4 / nseg;
    __m512 o[VT][VM];
    for (int j = 0; j < VT; j++)
        for (int i = 0; i < vm; i++) o[j][i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m512 fa[VT][VM], fm[VT][VM];
        float ms[VM] = {0};
        for (int j = 0; j < VT; j++)
            for (int i = 0; i < vm; i++) fa[j][i] = fm[j][i] = _mm512_setzero_ps();
        for (int bi = 0; bi < sb; bi++) {
            const int64_t b = s * sb + bi; /* block of 32 columns */
            for (int j = 0; KQ_VNNI_PF > 0 && pf && j < VT; j++) {
                const uint8_t *blk = wt[j] + s * sbb + hb + bi * bb;
                for (int64_t p = (bi ? 0 : -hb); p < bb; p += 64)
                    _mm_prefetch((const char *)(blk + KQ_VNNI_PF + p), _MM_HINT_T0);
            }
            for (int seg = 0; seg < nseg; seg++) {
                __m512i a[VT][VM];
                for (int j = 0; j < VT; j++)
                    for (int i = 0; i < vm; i++) a[j][i] = _mm512_setzero_si512();
                for (int t = seg * tseg; t < (seg + 1) * tseg; t++) {
                    __m512i x0[VM], x1[VM];
                    for (int i = 0; i < vm; i++) {
                        int32_t v0, v1;
                        memcpy(&v0, qr[i] + 32 * b + 8 * t, 4);
                        memcpy(&v1, qr[i] + 32 * b + 8 * t + 4, 4);
                        x0[i] = _mm512_set1_epi32(v0);
                        x1[i] = _mm512_set1_epi32(v1);
                    }
                    for (int j = 0; j < VT; j++) {
                        const uint8_t *blk = wt[j] + s * sbb + hb + bi * bb;
                        const uint8_t *lo = blk + (subsc ? 32 : 0);
                        __m512i w0, w1;
                        kq_codes(lo, t, bits, &w0, &w1);
                        for (int i = 0; i < vm; i++) {
                            a[j][i] = _mm512_dpbusd_epi32(a[j][i], w0, x0[i]);
                            a[j][i] = _mm512_dpbusd_epi32(a[j][i], w1, x1[i]);
                        }
                    }
                }
                /* T (exact int32) -> fa += (sc dx) T: the sub-scale joins dx as a float (a
                 * vpmulld would cost 2 uops and 10 cycles of latency on port 0, beside the
                 * dpbusd) */
                for (int j = 0; j < VT; j++) {
                    const uint8_t *blk = wt[j] + s * sbb + hb + bi * bb;
                    const __m512 sc = kq_subscales(blk, subsc, seg);
                    for (int i = 0; i < vm; i++) {
                        __m512i T = a[j][i];
                        if (zero) {
                            const int32_t qsum = nseg == 2
                                ? qsr[i][2 * b + seg] : qsr[i][2 * b] + qsr[i][2 * b + 1];
                            T = _mm512_sub_epi32(T, _mm512_set1_epi32(zero * qsum));
                        }
                        const __m512 d = subsc ? _mm512_mul_ps(sc, _mm512_set1_ps(dxr[i][b]))
                                               : _mm512_set1_ps(dxr[i][b]);
                        fa[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T), d, fa[j][i]);
                    }
                }
            }
            if (dm == 2)
                for (int j = 0; j < VT; j++) {
                    const uint8_t *blk = wt[j] + s * sbb + hb + bi * bb;
                    const __m512 mn = _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
                    for (int i = 0; i < vm; i++) {
                        const float dq =
                            dxr[i][b] * (float)(qsr[i][2 * b] + qsr[i][2 * b + 1]);
                        fm[j][i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dq), fm[j][i]);
                    }
                }
            if (dm == 1)
                for (int i = 0; i < vm; i++)
                    ms[i] += dxr[i][b] * (float)(qsr[i][2 * b] + qsr[i][2 * b + 1]);
        }
        for (int j = 0; j < VT; j++) {
            const uint16_t *h = (const uint16_t *)(wt[j] + s * sbb);
            const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
            __m512 Dm = _mm512_setzero_ps();
            if (dm) Dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16)));
            for (int i = 0; i < vm; i++) {
                o[j][i] = _mm512_fmadd_ps(D, fa[j][i], o[j][i]);
                if (dm == 2) o[j][i] = _mm512_fnmadd_ps(Dm, fm[j][i], o[j][i]);
                if (dm == 1) o[j][i] = _mm512_fmadd_ps(Dm, _mm512_set1_ps(ms[i]), o[j][i]);
            }
        }
    }
    for (int j = 0; j < VT; j++)
        for (int i = 0; i < vm; i++) _mm512_storeu_ps(out[j][i], o[j][i]);
}

#define KQ_VNNI(BITS, SB, SUBSC, DM, ZERO)                                                  \
    do {                                                                                    \
        if (vm == 4) pass_vnni(wt, qr, dxr, qsr, K, BITS, SB, SUBSC, DM, ZERO, 4, pf, out); \
        else if (vm == 2)                                                                    \
            pass_vnni(wt, qr, dxr, qsr, K, BITS, SB, SUBSC, DM, ZERO, 2, pf, out);          \
        else pass_vnni(wt, qr, dxr, qsr, K, BITS, SB, SUBSC, DM, ZERO, 1, pf, out);         \
    } while (0)

/* y[:, 0:n] (row stride ldy) for one weight; M rows of quantized x */
static void gemm_vnni(int type, const uint8_t *w, int64_t n, int64_t K, const int8_t *q,
                      const float *dx, const int32_t *qs, int64_t M, int num_threads, float *y,
                      int64_t ldy) {
    kq_fmt f = {0, 1, 0, 0, 0};
    kq_format(type, &f);
    const int64_t ntiles = (n + 15) / 16, ngroups = (ntiles + VT - 1) / VT;
    const int64_t tile_bytes = K / (32 * f.sb) * sb_bytes(f);
    const int pf = M <= KQ_VNNI_PF_ROWS; /* one pass per tile: it streams the weights */
    kvs_share sh;
    kvs_share_init(&sh, ngroups, num_threads);
#pragma omp parallel num_threads(num_threads)
    KVS_SHARE_FOR(sh, tg) {
        const uint8_t *wt[VT];
        for (int j = 0; j < VT; j++) {
            int64_t tile = tg * VT + j;
            if (tile >= ntiles) tile = ntiles - 1; /* alias; result dropped */
            wt[j] = w + tile * tile_bytes;
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
                dxr[i] = dx + m * (K / 32);
                qsr[i] = qs + m * (K / 16);
            }
            float out[VT][VM][16];
            switch (type) {
            case 6: KQ_VNNI(5, 1, 0, 0, 16); break;
            case 7: KQ_VNNI(5, 1, 0, 1, 0); break;
            case 12: KQ_VNNI(4, 8, 1, 2, 0); break;
            case 13: KQ_VNNI(5, 8, 1, 2, 0); break;
            default: KQ_VNNI(6, 8, 2, 0, 32); break;
            }
            for (int j = 0; j < VT && tg * VT + j < ntiles; j++) {
                const int64_t c0 = (tg * VT + j) * 16, nc = n - c0 < 16 ? n - c0 : 16;
                for (int i = 0; i < vm; i++)
                    memcpy(y + (m0 + i) * ldy + c0, out[j][i], nc * sizeof(float));
            }
            m0 += vm;
        }
    }
}

/*
 * AVX-512 VNNI wide pass: one weight tile x up to KM rows of x over all of K (a speculative
 * verify step's 5-24 GEMM rows: 3-12 rows of x, two int8 terms each), as wq_gemm.c's
 * pass_vnni_wide. Each code vector is loaded and unpacked (nibbles and high-bit
 * masks) once for all rows, each row's 4 bytes of x are broadcast from memory into the dpbusd,
 * and the tile's chunks of rows run back to back while its codes are in L1: the weights are
 * read from memory once per step instead of once per VM rows (pass_vnni), prefetched PF_KQ
 * bytes ahead (a thread's tiles are consecutive, kvs_sched.h: one stream).
 * Per row: the very operations of pass_vnni in its order (per segment T = a - zero qsum,
 * fa = fma(cvt(T), sc dx, fa); per block fm = fma(mn, dx qsum, fm) or ms += dx qsum; per
 * super-block o = fma(D, fa, o), then o = o - Dm fm or o = fma(Dm, ms, o)), so every row is bit
 * for bit what any other pass computes for it (batch invariance). The row-only terms are
 * computed once per call (kq_row_terms): dq = dx qsum per block (the same fp32 product) and
 * zq = zero qsum per segment (exact int32). Super-blocks of 8 blocks (K-quants) keep o in out
 * (read and written once per super-block) and fa, fm and the block's sums in registers.
 */
#define KM 8 /* rows of x per wide pass */
/* 2026-12-07, AMX Xeon, 2 threads, int8x2 (docs/quantization.md): 6-24 GEMM rows 1.07-1.5x
 * pass_vnni's passes of 4 with the weights in L3 (level at 6 rows, 1.08x at 8 streamed from
 * DRAM), 16-24 rows 1.05-1.22x the AMX tiles (whose time is ~flat from 18 to 32 rows: they
 * win from ~26-30 rows by type); 1-4 rows: pass_vnni's one pass (see KQ_VNNI_PF). */
#ifndef KQ_WIDE_MIN_ROWS
#define KQ_WIDE_MIN_ROWS 5 /* fewer rows: pass_vnni, one pass */
#endif
#ifndef KQ_WIDE_MAX_ROWS
#define KQ_WIDE_MAX_ROWS 24 /* more rows: pass_vnni's passes of 4 (or AMX-INT8 tiles) */
#endif
#ifndef PF_KQ
#define PF_KQ 4096 /* 2 / 4 / 8 / 16 KiB alike; none: 1.4-1.6x slower at 2-6 GEMM rows */
#endif
#ifndef PF_KQ_HINT
#define PF_KQ_HINT _MM_HINT_T0
#endif
#ifndef KQ_WIDE_SPLIT
/* passes of at most this many rows (one-segment blocks: not Q6_K, where it measured 3% slower)
 * sum w0's and w1's products apart, added at the segment's end (exact): half-length dpbusd
 * chains, Q5_0 3-11% faster at 2-6 GEMM rows (measured from 2), Q4_K level */
#define KQ_WIDE_SPLIT 4
#endif
static inline __attribute__((always_inline)) void pass_kq_wide(
    const uint8_t *restrict wt, const int8_t *restrict q, const float *restrict dx,
    const float *restrict dq, const int32_t *restrict zq, int64_t K, const int bits,
    const int sb, const int subsc, const int dm, const int zero, const int vm,
    float out[KM][16]) {
    const kq_fmt f = {bits, sb, subsc, dm, zero};
    const int64_t nsb = K / (32 * sb), hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int64_t nb = K / 32;
    const int nseg = subsc == 2 ? 2 : 1, tseg = 4 / nseg;
    __m512 o[KM]; /* sb == 1: out in registers; else in out[] */
    for (int i = 0; i < vm; i++) {
        o[i] = _mm512_setzero_ps();
        if (sb > 1) _mm512_store_ps(out[i], o[i]);
    }
    for (int64_t s = 0; s < nsb; s++) {
        __m512 fa[KM], fm[KM];
        float ms[KM];
        for (int i = 0; i < vm; i++) {
            fa[i] = fm[i] = _mm512_setzero_ps();
            ms[i] = 0;
        }
        for (int bi = 0; bi < sb; bi++) {
            const int64_t b = s * sb + bi; /* block of 32 columns */
            const uint8_t *blk = wt + s * sbb + hb + bi * bb;
            const uint8_t *lo = blk + (subsc ? 32 : 0);
            for (int64_t p = (bi ? 0 : -hb); PF_KQ > 0 && p < bb; p += 64)
                _mm_prefetch((const char *)(blk + PF_KQ + p), PF_KQ_HINT);
            for (int seg = 0; seg < nseg; seg++) {
                __m512i a[KM], a1[KM];
                for (int i = 0; i < vm; i++) a[i] = a1[i] = _mm512_setzero_si512();
                for (int t = seg * tseg; t < (seg + 1) * tseg; t++) {
                    __m512i w0, w1;
                    kq_codes(lo, t, bits, &w0, &w1);
                    for (int i = 0; i < vm; i++) {
                        int32_t v0, v1;
                        memcpy(&v0, q + i * K + 32 * b + 8 * t, 4);
                        memcpy(&v1, q + i * K + 32 * b + 8 * t + 4, 4);
                        a[i] = _mm512_dpbusd_epi32(a[i], w0, _mm512_set1_epi32(v0));
                        if (vm <= KQ_WIDE_SPLIT && nseg == 1)
                            a1[i] = _mm512_dpbusd_epi32(a1[i], w1, _mm512_set1_epi32(v1));
                        else
                            a[i] = _mm512_dpbusd_epi32(a[i], w1, _mm512_set1_epi32(v1));
                    }
                }
                if (vm <= KQ_WIDE_SPLIT && nseg == 1)
                    for (int i = 0; i < vm; i++) a[i] = _mm512_add_epi32(a[i], a1[i]);
                const __m512 sc = kq_subscales(blk, subsc, seg);
                for (int i = 0; i < vm; i++) {
                    __m512i T = a[i];
                    if (zero)
                        T = _mm512_sub_epi32(T, _mm512_set1_epi32(zq[(i * nb + b) * nseg + seg]));
                    const __m512 d = subsc ? _mm512_mul_ps(sc, _mm512_set1_ps(dx[i * nb + b]))
                                           : _mm512_set1_ps(dx[i * nb + b]);
                    fa[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T), d, fa[i]);
                }
            }
            if (dm == 2) {
                const __m512 mn = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
                for (int i = 0; i < vm; i++)
                    fm[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dq[i * nb + b]), fm[i]);
            }
            if (dm == 1)
                for (int i = 0; i < vm; i++) ms[i] += dq[i * nb + b];
        }
        const uint16_t *h = (const uint16_t *)(wt + s * sbb);
        const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        __m512 Dm = _mm512_setzero_ps();
        if (dm) Dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16)));
        for (int i = 0; i < vm; i++) {
            __m512 oi = sb > 1 ? _mm512_load_ps(out[i]) : o[i];
            oi = _mm512_fmadd_ps(D, fa[i], oi);
            if (dm == 2) oi = _mm512_fnmadd_ps(Dm, fm[i], oi);
            if (dm == 1) oi = _mm512_fmadd_ps(Dm, _mm512_set1_ps(ms[i]), oi);
            if (sb > 1) _mm512_store_ps(out[i], oi);
            else o[i] = oi;
        }
    }
    if (sb == 1)
        for (int i = 0; i < vm; i++) _mm512_store_ps(out[i], o[i]);
}

/* the row-only terms of M rows, per block b: dq [M][nb] = dx qsum (pass_vnni's fp32 product)
 * and zq [M][nb nseg] = zero x the segment's (or block's) qsum */
static void kq_row_terms(const kq_fmt f, const float *restrict dx, const int32_t *restrict qs,
                         int64_t M, int64_t nb, float *restrict dq, int32_t *restrict zq) {
    const int nseg = f.subsc == 2 ? 2 : 1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int32_t q0 = qs[m * 2 * nb + 2 * b], q1 = qs[m * 2 * nb + 2 * b + 1];
            dq[m * nb + b] = dx[m * nb + b] * (float)(q0 + q1);
            if (nseg == 2) {
                zq[(m * nb + b) * 2] = f.zero * q0;
                zq[(m * nb + b) * 2 + 1] = f.zero * q1;
            } else {
                zq[m * nb + b] = f.zero * (q0 + q1);
            }
        }
}

#define KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, VMV)                                           \
    pass_kq_wide(wt, q + m0 * K, dx + m0 * nb, dq + m0 * nb, zq + m0 * nb * nseg, K, BITS,  \
                 SB, SUBSC, DM, ZERO, VMV, out)
#define KQ_WIDE(BITS, SB, SUBSC, DM, ZERO)                                                   \
    do {                                                                                     \
        switch (vm) { /* one specialized copy per row count */                              \
        case 1: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 1); break;                             \
        case 2: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 2); break;                             \
        case 3: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 3); break;                             \
        case 4: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 4); break;                             \
        case 5: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 5); break;                             \
        case 6: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 6); break;                             \
        case 7: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 7); break;                             \
        default: KQ_WIDE_VM(BITS, SB, SUBSC, DM, ZERO, 8); break;                            \
        }                                                                                    \
    } while (0)

/* gemm_vnni's y for M <= 2 KM rows on the wide pass: chunks of <= KM rows, as even as they
 * come (9 rows: 5 + 4), each tile's chunks one after the other. Returns -1 without scratch
 * memory (y untouched: the caller runs pass_vnni) */
static int gemm_kq_wide(int type, const uint8_t *w, int64_t n, int64_t K, const int8_t *q,
                        const float *dx, const int32_t *qs, int64_t M, int num_threads,
                        float *y, int64_t ldy) {
    kq_fmt f = {0, 1, 0, 0, 0};
    kq_format(type, &f);
    const int64_t ntiles = (n + 15) / 16, nb = K / 32, nch = (M + KM - 1) / KM;
    const int64_t nseg = f.subsc == 2 ? 2 : 1;
    const int64_t tile_bytes = K / (32 * f.sb) * sb_bytes(f);
    float *dq = malloc(sizeof(float) * (size_t)(M * nb) + sizeof(int32_t) * (size_t)(M * nb * nseg));
    if (dq == NULL) return -1;
    int32_t *zq = (int32_t *)(dq + M * nb);
    kq_row_terms(f, dx, qs, M, nb, dq, zq);
    kvs_share sh;
    kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
    KVS_SHARE_FOR(sh, tile) {
        const uint8_t *wt = w + tile * tile_bytes;
        const int64_t c0 = tile * 16, nc = n - c0 < 16 ? n - c0 : 16;
        for (int64_t c = 0, m0 = 0; c < nch; c++) {
            const int vm = (int)(M / nch + (c < M % nch));
            float out[KM][16] __attribute__((aligned(64)));
            switch (type) {
            case 6: KQ_WIDE(5, 1, 0, 0, 16); break;
            case 7: KQ_WIDE(5, 1, 0, 1, 0); break;
            case 12: KQ_WIDE(4, 8, 1, 2, 0); break;
            case 13: KQ_WIDE(5, 8, 1, 2, 0); break;
            default: KQ_WIDE(6, 8, 2, 0, 32); break;
            }
            for (int i = 0; i < vm; i++)
                memcpy(y + (m0 + i) * ldy + c0, out[i], nc * sizeof(float));
            m0 += vm;
        }
    }
    free(dq);
    return 0;
}
#undef KQ_WIDE
#undef KQ_WIDE_VM

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(KVS_SIMDE)
#define KVS_KQ_AMX 1
#include "amx.h"
/*
 * AMX-INT8 (Sapphire Rapids and later), as wq_gemm.c's: the VNNI pass's exact integer sums I
 * (per block, or per half-block for Q6_K) as TDPBSUD tile products, then the VNNI pass's float
 * operations in its order, so every output is bit for bit the VNNI one:
 *   T = I - zero qsum;  fa = fma(cvt(T), sc dx, fa)  (sc dx: one vmulps, as there);
 *   K-quants per block: fm = fma(mn, dx qsum, fm);  Q5_1: ms = 0 + dx qsum;
 *   per super-block: o = fma(D, fa, o);  o = o - Dm fm  (fnmadd) / o = fma(Dm, ms, o).
 * A tile's codes (low nibbles + the high-bit masks) are unpacked once per call into B layout
 * (k-quads x 16 outputs x 4 bytes: the VNNI pass's w0 / w1 vectors, stored). One C tile (up to
 * 16 rows x 16 outputs) runs over all of K at a time: o in registers for one-block super-blocks
 * (Q5_0 / Q5_1), fa in registers and o / fm in memory for the K-quants; two tile-register sets
 * alternate between segments. Rows past a multiple of 16: a last row tile overlapping the one
 * before it; M < 16: tiles of M rows, float work rounded up to a multiple of 4 rows.
 * From 16 rows (1 thread, Gemma 3's shapes): Q5_0 / Q5_1 / Q6_K 1.5x the VNNI passes of 4,
 * Q4_K 1.05x, 1.3-1.9x at 64; at 8 rows Q4_K is 0.8x (its float part, sc dx and the dmin term,
 * is most of the work), the rest ~1.1x; below that the per-call unpacking of the codes loses.
 * Against the wide pass (5-24 rows since 2026-12-07) the tiles are 0.82-0.95x at 16-24 rows
 * (2 threads, int8x2, Llama layers h = 2048): from 25 rows (was 16).
 */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 25
#endif
static int amx_state = -1;          /* -1: not asked yet, 0: off / unavailable, 1: on */
static int amx_rows = AMX_MIN_ROWS; /* GEMMs of at least this many rows take the tiles */

/* tmm0-1 C (ra rows x 16 int32), tmm4-5 A (ra rows x segb int8), tmm6-7 B (segb / 4 k-quads x
 * 16 outputs x 4): two sets, even and odd segments */
static void kq_amx_config(int ra, int segb) {
    kvs_amx_cfg cfg;
    kvs_amx_cfg_init(&cfg);
    for (int t = 0; t < 2; t++) {
        cfg.rows[t] = (uint8_t)ra;
        cfg.colsb[t] = 64;
        cfg.rows[4 + t] = (uint8_t)ra;
        cfg.colsb[4 + t] = (uint16_t)segb;
        cfg.rows[6 + t] = (uint8_t)(segb / 4);
        cfg.colsb[6 + t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* a tile's codes over all of K -> ub [K / 4][64]: k-quad 8b + 2t the VNNI pass's w0, 2t + 1 w1 */
static void kq_unpack(const uint8_t *restrict wt, int64_t nsb, const kq_fmt f,
                      uint8_t *restrict ub) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16),
                  b32 = _mm512_set1_epi8(32);
    const int64_t hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    for (int64_t s = 0; s < nsb; s++)
        for (int bi = 0; bi < f.sb; bi++) {
            const uint8_t *lo = wt + s * sbb + hb + bi * bb + (f.subsc ? 32 : 0);
            uint8_t *u = ub + (s * f.sb + bi) * 512;
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(lo + 64 * t));
                __m512i w0 = _mm512_and_si512(v, lo4);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                for (int p = 0; p + 4 < f.bits; p++) {
                    uint64_t m0, m1;
                    memcpy(&m0, lo + 256 + 64 * p + 8 * (2 * t), 8);
                    memcpy(&m1, lo + 256 + 64 * p + 8 * (2 * t + 1), 8);
                    const __m512i add = p ? b32 : b16;
                    w0 = _mm512_mask_add_epi8(w0, (__mmask64)m0, w0, add);
                    w1 = _mm512_mask_add_epi8(w1, (__mmask64)m1, w1, add);
                }
                _mm512_store_si512((void *)(u + 128 * t), w0);
                _mm512_store_si512((void *)(u + 128 * t + 64), w1);
            }
        }
}

/* segment e's products on tile set P (literal tile numbers) into cb[P] */
#define KQ_SEG(P, TA, TB, e)                            \
    do {                                                \
        _tile_zero(P);                                  \
        _tile_loadd(TA, a + segb * (e), K);             \
        _tile_loadd(TB, ub + 16 * segb * (e), 64);      \
        _tile_dpbsud(P, TA, TB);                        \
        _tile_stored(P, cb[P], 64);                     \
    } while (0)

/* One C tile over all of K: per row i < nr (rows past ra: copies of its last, never written)
 * dxt [nb][16] = dx, dqt [nb][16] = dx qsum (qsum over the block), zqt [nb nseg][16] = zero x
 * the segment's qsum; outputs c0 .. c0 + nc of the weight (tile wt, unpacked ub); rows own ..
 * ra - 1 written to yr[i]. */
static inline __attribute__((always_inline)) void kq_amx_ctile(
    const int8_t *restrict a, int64_t K, const uint8_t *restrict ub,
    const uint8_t *restrict wt, const float *restrict dxt, const float *restrict dqt,
    const int32_t *restrict zqt, const int bits, const int sb, const int subsc, const int dm,
    const int zero, const int nr, int own, int ra, float *const yr[16], int nc,
    int32_t (*restrict cb)[16][16], float (*restrict om)[16], float (*restrict fm)[16]) {
    const kq_fmt f = {bits, sb, subsc, dm, zero};
    const int64_t hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int nseg = subsc == 2 ? 2 : 1, segb = 32 / nseg;
    const int64_t ne = K / 32 * nseg;
    /* sb == 1 (Q5_0, Q5_1; dm != 2): out in registers; else fa, with out and fm in memory */
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
    if (sb > 1) memset(om, 0, sizeof(float) * 16 * 16);
#define KQ_T(P, i, e)                                                                       \
    (zero ? _mm512_sub_epi32(_mm512_load_si512((const void *)cb[P][i]),                     \
                             _mm512_set1_epi32(zqt[(e) * 16 + i]))                          \
          : _mm512_load_si512((const void *)cb[P][i]))
#define KQ_FLOATS(P, e)                                                                     \
    do {                                                                                    \
        const int64_t b = (e) / nseg, sbi = b / sb;                                         \
        const int seg = (int)((e) % nseg), bi = (int)(b % sb);                              \
        const uint8_t *blk = wt + sbi * sbb + hb + bi * bb;                                 \
        const uint16_t *h = (const uint16_t *)(wt + sbi * sbb);                             \
        __m512 sc = _mm512_set1_ps(1.0f);                                                   \
        if (subsc == 1)                                                                     \
            sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk))); \
        else if (subsc == 2)                                                                \
            sc = _mm512_cvtepi32_ps(                                                        \
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * seg))));  \
        if (sb == 1) {                                                                      \
            const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));       \
            __m512 Dm = _mm512_setzero_ps();                                                \
            if (dm) Dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16)));    \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                         \
                const __m512 dd = _mm512_set1_ps(dxt[b * 16 + i]);                          \
                const __m512 d = subsc ? _mm512_mul_ps(sc, dd) : dd;                        \
                const __m512 fa =                                                           \
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(KQ_T(P, i, e)), d, _mm512_setzero_ps()); \
                acc[i] = _mm512_fmadd_ps(D, fa, acc[i]);                                    \
                if (dm == 1) {                                                              \
                    float ms = 0;                                                           \
                    ms += dqt[b * 16 + i];                                                  \
                    acc[i] = _mm512_fmadd_ps(Dm, _mm512_set1_ps(ms), acc[i]);               \
                }                                                                           \
            }                                                                               \
        } else {                                                                            \
            if (bi == 0 && seg == 0) {                                                      \
                _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) acc[i] =              \
                    _mm512_setzero_ps();                                                    \
                if (dm == 2) memset(fm, 0, sizeof(float) * 16 * 16);                        \
            }                                                                               \
            _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                         \
                const __m512 dd = _mm512_set1_ps(dxt[b * 16 + i]);                          \
                const __m512 d = subsc ? _mm512_mul_ps(sc, dd) : dd;                        \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(KQ_T(P, i, e)), d, acc[i]);     \
            }                                                                               \
            if (seg == nseg - 1) {                                                          \
                if (dm == 2) {                                                              \
                    const __m512 mn = _mm512_cvtepi32_ps(                                   \
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)))); \
                    _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++)                   \
                        _mm512_store_ps(fm[i], _mm512_fmadd_ps(                             \
                            mn, _mm512_set1_ps(dqt[b * 16 + i]), _mm512_load_ps(fm[i])));   \
                }                                                                           \
                if (bi == sb - 1) {                                                         \
                    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)); \
                    __m512 Dm = _mm512_setzero_ps();                                        \
                    if (dm) Dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16))); \
                    _Pragma("GCC unroll 16") for (int i = 0; i < nr; i++) {                 \
                        __m512 o = _mm512_fmadd_ps(D, acc[i], _mm512_load_ps(om[i]));       \
                        if (dm == 2) o = _mm512_fnmadd_ps(Dm, _mm512_load_ps(fm[i]), o);    \
                        _mm512_store_ps(om[i], o);                                          \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } while (0)
    KQ_SEG(0, 4, 6, 0);
    for (int64_t e = 0; e < ne; e += 2) {
        if (e + 1 < ne) KQ_SEG(1, 5, 7, e + 1);
        KQ_FLOATS(0, e);
        if (e + 1 < ne) {
            if (e + 2 < ne) KQ_SEG(0, 4, 6, e + 2);
            KQ_FLOATS(1, e + 1);
        }
    }
#undef KQ_FLOATS
#undef KQ_T
    if (sb == 1)
#pragma GCC unroll 16
        for (int i = 0; i < nr; i++) _mm512_store_ps(om[i], acc[i]);
    for (int i = own; i < ra; i++) memcpy(yr[i], om[i], sizeof(float) * nc);
}

/* scratch per thread: an unpacked tile, two C tiles, out and fm of one C tile */
#define KQ_AMX_THREAD_BYTES(K) ((size_t)(K) * 16 + 2048 + 1024 + 1024)

/* y[:, 0:n] (row stride ldy) on AMX tiles; returns 0, or 1 without scratch memory (nothing
 * written: the caller runs VNNI) */
static int gemm_amx(int type, const uint8_t *w, int64_t n, int64_t K, const int8_t *q,
                    const float *dx, const int32_t *qs, int64_t M, int num_threads, float *y,
                    int64_t ldy) {
    kq_fmt f = {0, 1, 0, 0, 0};
    kq_format(type, &f);
    const int64_t ntiles = (n + 15) / 16, nb = K / 32, nsb = K / (32 * f.sb);
    const int64_t tile_bytes = nsb * sb_bytes(f);
    const int nseg = f.subsc == 2 ? 2 : 1;
    const int ra = M < 16 ? (int)M : 16, nr = (ra + 3) / 4 * 4;
    const int64_t nrt = M < 16 ? 1 : (M + 15) / 16;
    /* per row tile: dxt, dqt [nb][16] floats, zqt [nb nseg][16] int32 */
    const size_t t_bytes =
        ((size_t)(nrt * nb * (2 + nseg) * 16) * 4 + 63) & ~(size_t)63;
    const size_t per_thread = (KQ_AMX_THREAD_BYTES(K) + 63) & ~(size_t)63;
    char *buf = aligned_alloc(64, t_bytes + per_thread * (size_t)num_threads);
    if (buf == NULL) return 1;
    float *dxt_all = (float *)buf, *dqt_all = dxt_all + nrt * nb * 16;
    int32_t *zqt_all = (int32_t *)(dqt_all + nrt * nb * 16);
    for (int64_t rt = 0; rt < nrt; rt++)
        for (int i = 0; i < 16; i++) {
            const int64_t want = 16 * rt;
            const int64_t r0 = M < 16 ? 0 : (want + 16 <= M ? want : M - 16);
            const int64_t m = r0 + (i < ra ? i : ra - 1);
            const float *dxr = dx + m * nb;
            const int32_t *qsr = qs + m * (K / 16);
            for (int64_t b = 0; b < nb; b++) {
                dxt_all[(rt * nb + b) * 16 + i] = dxr[b];
                dqt_all[(rt * nb + b) * 16 + i] = dxr[b] * (float)(qsr[2 * b] + qsr[2 * b + 1]);
                for (int seg = 0; seg < nseg; seg++) /* the VNNI pass's zero * qsum */
                    zqt_all[((rt * nb + b) * nseg + seg) * 16 + i] =
                        f.zero * (nseg == 2 ? qsr[2 * b + seg] : qsr[2 * b] + qsr[2 * b + 1]);
            }
        }
    kvs_share sh;
    kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = buf + t_bytes + per_thread * (size_t)omp_get_thread_num();
        uint8_t *ub = (uint8_t *)mine;
        int32_t(*cb)[16][16] = (int32_t(*)[16][16])(mine + (size_t)K * 16);
        float(*om)[16] = (float(*)[16])(mine + (size_t)K * 16 + 2048);
        float(*fm)[16] = om + 16;
        memset(cb, 0, 2048); /* rows past ra are read (and dropped) when ra % 4 != 0 */
        const int segb = 32 / nseg;
        kq_amx_config(ra, segb);
        KVS_SHARE_FOR(sh, tile) {
            const uint8_t *wt = w + tile * tile_bytes;
            kq_unpack(wt, nsb, f, ub);
            const int64_t c0 = tile * 16;
            const int nc = n - c0 < 16 ? (int)(n - c0) : 16;
            for (int64_t rt = 0; rt < nrt; rt++) {
                const int64_t want = 16 * rt, r0 = M < 16 ? 0 : (want + 16 <= M ? want : M - 16);
                float *yr[16];
                for (int i = 0; i < 16; i++) yr[i] = y + (r0 + (i < ra ? i : ra - 1)) * ldy + c0;
                const int8_t *a = q + r0 * K;
                const float *dxt = dxt_all + rt * nb * 16, *dqt = dqt_all + rt * nb * 16;
                const int32_t *zqt = zqt_all + rt * nb * nseg * 16;
                const int own = (int)(want - r0);
#define KQ_CT(BITS, SB, SUBSC, DM, ZERO)                                                     \
    do {                                                                                     \
        switch (nr) {                                                                        \
        case 4: kq_amx_ctile(a, K, ub, wt, dxt, dqt, zqt, BITS, SB, SUBSC, DM, ZERO, 4, own, \
                             ra, yr, nc, cb, om, fm); break;                                 \
        case 8: kq_amx_ctile(a, K, ub, wt, dxt, dqt, zqt, BITS, SB, SUBSC, DM, ZERO, 8, own, \
                             ra, yr, nc, cb, om, fm); break;                                 \
        case 12: kq_amx_ctile(a, K, ub, wt, dxt, dqt, zqt, BITS, SB, SUBSC, DM, ZERO, 12,    \
                              own, ra, yr, nc, cb, om, fm); break;                           \
        default: kq_amx_ctile(a, K, ub, wt, dxt, dqt, zqt, BITS, SB, SUBSC, DM, ZERO, 16,    \
                              own, ra, yr, nc, cb, om, fm); break;                           \
        }                                                                                    \
    } while (0)
                switch (type) {
                case 6: KQ_CT(5, 1, 0, 0, 16); break;
                case 7: KQ_CT(5, 1, 0, 1, 0); break;
                case 12: KQ_CT(4, 8, 1, 2, 0); break;
                case 13: KQ_CT(5, 8, 1, 2, 0); break;
                default: KQ_CT(6, 8, 2, 0, 32); break;
                }
#undef KQ_CT
            }
        }
        _tile_release();
    }
    free(buf);
    return 0;
}
#undef KQ_SEG
#endif
#elif defined(__AVX2__)
/* ---------------------------------------------------------------- AVX2 */

#define MT 4 /* rows of x per pass */

/* 32 bits -> 32 bytes: byte i = add where bit i is set, else 0 */
static inline __m256i expand_bits(uint32_t m, __m256i add) {
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), idx);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel), add);
}

/* one half hh (8 output rows) of a tile x mt rows of x over all of K: y[mm, 8 hh ..] */
static inline __attribute__((always_inline)) void pass_avx2(
    const uint8_t *restrict wt, const int8_t *restrict q, const float *restrict dx,
    const int32_t *restrict qs, int64_t K, const int bits, const int sb, const int subsc,
    const int dm, const int zero, const int mt, const int hh, float out[MT][16]) {
    const kq_fmt f = {bits, sb, subsc, dm, zero};
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i b16 = _mm256_set1_epi8(16), b32 = _mm256_set1_epi8(32);
    const int64_t nsb = K / (32 * sb), hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int64_t nb = K / 32;
    const int nseg = subsc == 2 ? 2 : 1, tseg = 4 / nseg;
    __m256 o[MT];
    for (int mm = 0; mm < mt; mm++) o[mm] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m256 fa[MT], fm[MT];
        float ms[MT] = {0};
        for (int mm = 0; mm < mt; mm++) fa[mm] = fm[mm] = _mm256_setzero_ps();
        for (int bi = 0; bi < sb; bi++) {
            const int64_t b = s * sb + bi;
            const uint8_t *blk = wt + s * sbb + hb + bi * bb;
            const uint8_t *lo = blk + (subsc ? 32 : 0);
            for (int seg = 0; seg < nseg; seg++) {
                __m256i a[MT];
                for (int mm = 0; mm < mt; mm++) a[mm] = _mm256_setzero_si256();
                for (int t = seg * tseg; t < (seg + 1) * tseg; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(lo + 64 * t + 32 * hh));
                    __m256i w0 = _mm256_and_si256(v, lo4);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                    for (int p = 0; p + 4 < bits; p++) { /* bit 4 (and 5) planes */
                        uint32_t m0, m1;
                        memcpy(&m0, lo + 256 + 64 * p + 8 * (2 * t) + 4 * hh, 4);
                        memcpy(&m1, lo + 256 + 64 * p + 8 * (2 * t + 1) + 4 * hh, 4);
                        w0 = _mm256_or_si256(w0, expand_bits(m0, p ? b32 : b16));
                        w1 = _mm256_or_si256(w1, expand_bits(m1, p ? b32 : b16));
                    }
                    for (int mm = 0; mm < mt; mm++) {
                        int32_t v0, v1;
                        memcpy(&v0, q + mm * K + 32 * b + 8 * t, 4);
                        memcpy(&v1, q + mm * K + 32 * b + 8 * t + 4, 4);
                        /* u <= 63, |q| <= 127: a pair <= 16002, widened at once */
                        a[mm] = _mm256_add_epi32(a[mm], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(w0, _mm256_set1_epi32(v0)), ones));
                        a[mm] = _mm256_add_epi32(a[mm], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(w1, _mm256_set1_epi32(v1)), ones));
                    }
                }
                __m256 sc = _mm256_set1_ps(1.0f); /* the sub-scale joins dx (no vpmulld) */
                if (subsc == 1)
                    sc = _mm256_cvtepi32_ps(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * hh))));
                else if (subsc == 2)
                    sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(blk + 16 * seg + 8 * hh))));
                for (int mm = 0; mm < mt; mm++) {
                    __m256i T = a[mm];
                    if (zero) {
                        const int32_t qsum = nseg == 2 ? qs[mm * 2 * nb + 2 * b + seg]
                            : qs[mm * 2 * nb + 2 * b] + qs[mm * 2 * nb + 2 * b + 1];
                        T = _mm256_sub_epi32(T, _mm256_set1_epi32(zero * qsum));
                    }
                    const __m256 d = subsc ? _mm256_mul_ps(sc, _mm256_set1_ps(dx[mm * nb + b]))
                                           : _mm256_set1_ps(dx[mm * nb + b]);
                    fa[mm] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T), d, fa[mm]);
                }
            }
            for (int mm = 0; mm < mt; mm++) {
                const float dq = dx[mm * nb + b] *
                    (float)(qs[mm * 2 * nb + 2 * b] + qs[mm * 2 * nb + 2 * b + 1]);
                if (dm == 2) {
                    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * hh))));
                    fm[mm] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dq), fm[mm]);
                }
                if (dm == 1) ms[mm] += dq;
            }
        }
        const uint16_t *h = (const uint16_t *)(wt + s * sbb);
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8 * hh)));
        __m256 Dm = _mm256_setzero_ps();
        if (dm) Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 16 + 8 * hh)));
        for (int mm = 0; mm < mt; mm++) {
            o[mm] = _mm256_fmadd_ps(D, fa[mm], o[mm]);
            if (dm == 2) o[mm] = _mm256_fnmadd_ps(Dm, fm[mm], o[mm]);
            if (dm == 1) o[mm] = _mm256_fmadd_ps(Dm, _mm256_set1_ps(ms[mm]), o[mm]);
        }
    }
    for (int mm = 0; mm < mt; mm++) _mm256_storeu_ps(out[mm] + 8 * hh, o[mm]);
}

#define KQ_AVX2_MT(BITS, SB, SUBSC, DM, ZERO, MTV)                                     \
    do {                                                                               \
        pass_avx2(wt, q + m0 * K, dx + m0 * nb, qs + m0 * 2 * nb, K, BITS, SB, SUBSC, DM, \
                  ZERO, MTV, 0, out);                                                  \
        pass_avx2(wt, q + m0 * K, dx + m0 * nb, qs + m0 * 2 * nb, K, BITS, SB, SUBSC, DM, \
                  ZERO, MTV, 1, out);                                                  \
    } while (0)
#define KQ_AVX2(BITS, SB, SUBSC, DM, ZERO)                                          \
    do {                                                                            \
        switch (mt) {                                                               \
        case 4: KQ_AVX2_MT(BITS, SB, SUBSC, DM, ZERO, 4); break;                    \
        case 3: KQ_AVX2_MT(BITS, SB, SUBSC, DM, ZERO, 3); break;                    \
        case 2: KQ_AVX2_MT(BITS, SB, SUBSC, DM, ZERO, 2); break;                    \
        default: KQ_AVX2_MT(BITS, SB, SUBSC, DM, ZERO, 1); break;                   \
        }                                                                           \
    } while (0)
#else
/* ---------------------------------------------------------------- plain C */
#define MT 4

static inline int code_at(const uint8_t *lo, int bits, int r, int kk) {
    const int t = kk / 8, n = (kk % 8) / 4, j = kk % 4, lane = 4 * r + j;
    const uint8_t byte = lo[64 * t + 4 * r + j];
    int u = n ? byte >> 4 : byte & 15;
    for (int p = 0; p + 4 < bits; p++) {
        uint64_t m;
        memcpy(&m, lo + 256 + 64 * p + 8 * (2 * t + n), 8);
        u |= (int)((m >> lane) & 1) << (4 + p);
    }
    return u;
}

/* one tile x mt rows: out[mm][r] (the vector paths' sums in another order) */
static void tile_c(const uint8_t *wt, const kq_fmt f, const int8_t *q, const float *dx,
                   const int32_t *qs, int64_t K, int mt, float out[MT][16]) {
    const int64_t nsb = K / (32 * f.sb), hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int64_t nb = K / 32;
    for (int mm = 0; mm < mt; mm++)
        for (int r = 0; r < 16; r++) out[mm][r] = 0.0f;
    for (int64_t s = 0; s < nsb; s++) {
        const uint16_t *h = (const uint16_t *)(wt + s * sbb);
        for (int mm = 0; mm < mt; mm++)
            for (int r = 0; r < 16; r++) {
                float fa = 0.0f, fm = 0.0f;
                for (int bi = 0; bi < f.sb; bi++) {
                    const int64_t b = s * f.sb + bi;
                    const uint8_t *blk = wt + s * sbb + hb + bi * bb;
                    const uint8_t *lo = blk + (f.subsc ? 32 : 0);
                    const int8_t *qb = q + mm * K + 32 * b;
                    const int32_t q0 = qs[mm * 2 * nb + 2 * b], q1 = qs[mm * 2 * nb + 2 * b + 1];
                    int32_t I[2] = {0, 0};
                    for (int kk = 0; kk < 32; kk++) I[kk / 16] += code_at(lo, f.bits, r, kk) * qb[kk];
                    int32_t T;
                    if (f.subsc == 2)
                        T = (int8_t)blk[r] * (I[0] - f.zero * q0) +
                            (int8_t)blk[16 + r] * (I[1] - f.zero * q1);
                    else {
                        T = I[0] + I[1] - f.zero * (q0 + q1);
                        if (f.subsc == 1) T *= blk[r];
                    }
                    fa += dx[mm * nb + b] * (float)T;
                    const float dq = dx[mm * nb + b] * (float)(q0 + q1);
                    if (f.dm == 2) fm += (float)blk[16 + r] * dq;
                    if (f.dm == 1) fm += dq;
                }
                out[mm][r] += kvs_f16f(h[r]) * fa;
                if (f.dm == 2) out[mm][r] -= kvs_f16f(h[16 + r]) * fm;
                if (f.dm == 1) out[mm][r] += kvs_f16f(h[16 + r]) * fm;
            }
    }
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
static void gemm_tiles(int type, const uint8_t *w, int64_t n, int64_t K, const int8_t *q,
                       const float *dx, const int32_t *qs, int64_t M, int num_threads, float *y,
                       int64_t ldy) {
    kq_fmt f = {0, 1, 0, 0, 0};
    kq_format(type, &f);
    const int64_t ntiles = (n + 15) / 16, nb = K / 32;
    const int64_t tile_bytes = K / (32 * f.sb) * sb_bytes(f);
    kvs_share sh;
    kvs_share_init(&sh, ntiles, num_threads);
#pragma omp parallel num_threads(num_threads)
    KVS_SHARE_FOR(sh, tile) {
        const uint8_t *wt = w + tile * tile_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (M - m0) < MT ? (int)(M - m0) : MT;
            float out[MT][16];
#if defined(__AVX2__)
            switch (type) {
            case 6: KQ_AVX2(5, 1, 0, 0, 16); break;
            case 7: KQ_AVX2(5, 1, 0, 1, 0); break;
            case 12: KQ_AVX2(4, 8, 1, 2, 0); break;
            case 13: KQ_AVX2(5, 8, 1, 2, 0); break;
            default: KQ_AVX2(6, 8, 2, 0, 32); break;
            }
#else
            (void)nb;
            tile_c(wt, f, q + m0 * K, dx + m0 * (K / 32), qs + m0 * (K / 16), K, mt, out);
#endif
            const int64_t c0 = tile * 16, nc = n - c0 < 16 ? n - c0 : 16;
            for (int mm = 0; mm < mt; mm++)
                memcpy(y + (m0 + mm) * ldy + c0, out[mm], nc * sizeof(float));
        }
    }
}
#endif

/* ---------------------------------------------------------------- one call per layer */

static _Thread_local void *scratch_buf = NULL;
static _Thread_local size_t scratch_cap = 0;

/*
 * y fp32 [M, sum n_s] = x^ . [W_0; W_1; ...]^T for x fp32 [M, K]: the activations quantized
 * once (terms int8 passes), then each shard's GEMM into its columns of y (shards of a fused
 * module may have different types). shards int64 [nshard, 3]: (ggml type, n rows, pointer to
 * the packed bytes). Returns 0; -1 without scratch memory; -2 for an unknown type or a K the
 * type cannot hold (y untouched).
 */
int kvs_kq_linear(const float *x, int64_t M, int64_t K, const int64_t *shards, int64_t nshard,
                  int terms, int num_threads, float *y) {
    int64_t ntot = 0;
    for (int64_t s = 0; s < nshard; s++) {
        if (kvs_kq_bytes((int)shards[3 * s], shards[3 * s + 1], K) < 0 || K % 32) return -2;
        ntot += shards[3 * s + 1];
    }
    const int64_t rows = terms * M, nb = K / 32;
    const size_t q_bytes = ((size_t)(rows * K) + 63) & ~(size_t)63;
    const size_t need = q_bytes + (size_t)(rows * nb) * 12 +
                        (terms > 1 ? (size_t)(rows * ntot) * 4 : 0);
    if (need > scratch_cap) {
        void *p = realloc(scratch_buf, need);
        if (p == NULL) return -1;
        scratch_buf = p;
        scratch_cap = need;
    }
    int8_t *q = (int8_t *)scratch_buf;
    float *dx = (float *)((char *)scratch_buf + q_bytes);
    int32_t *qs = (int32_t *)(dx + rows * nb);
    float *out = terms > 1 ? (float *)(qs + rows * 2 * nb) : y;
    quant_act(x, M, K, terms, num_threads, q, dx, qs);
    int64_t c0 = 0;
    for (int64_t s = 0; s < nshard; s++) {
        const int type = (int)shards[3 * s];
        const int64_t n = shards[3 * s + 1];
        const uint8_t *w = (const uint8_t *)(intptr_t)shards[3 * s + 2];
#ifdef KVS_KQ_AMX
        if (rows >= __atomic_load_n(&amx_rows, __ATOMIC_ACQUIRE) &&
            __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1 &&
            gemm_amx(type, w, n, K, q, dx, qs, rows, num_threads, out + c0, ntot) == 0) {
            c0 += n;
            continue;
        }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (rows < KQ_WIDE_MIN_ROWS || rows > KQ_WIDE_MAX_ROWS ||
            gemm_kq_wide(type, w, n, K, q, dx, qs, rows, num_threads, out + c0, ntot))
            gemm_vnni(type, w, n, K, q, dx, qs, rows, num_threads, out + c0, ntot);
#else
        gemm_tiles(type, w, n, K, q, dx, qs, rows, num_threads, out + c0, ntot);
#endif
        c0 += n;
    }
    if (terms > 1)
        for (int64_t i = 0; i < M * ntot; i++) y[i] = out[i] + out[M * ntot + i];
    return 0;
}

/* AMX-INT8 for GEMMs of at least `rows` rows (rows < 1 leaves the threshold): request 1 turns
 * it on where the build and the CPU have it (asking Linux for the tile state once), 0 turns it
 * off (the VNNI pass for every row count), -1 only asks. Returns the threshold in force while
 * it is on, 0 while it is off. */
int kvs_kq_amx(int request, int rows) {
#ifdef KVS_KQ_AMX
    if (rows >= 1) __atomic_store_n(&amx_rows, rows, __ATOMIC_RELEASE);
    return kvs_amx_request(&amx_state, request, KVS_AMX_INT8_BIT)
               ? __atomic_load_n(&amx_rows, __ATOMIC_ACQUIRE)
               : 0;
#else
    (void)request;
    (void)rows;
    return 0;
#endif
}

int kvs_kq_linear_op(const int64_t *a) {
    return kvs_kq_linear(OP_P(0), a[1], a[2], OP_P(3), a[4], (int)a[5], (int)a[6], OP_P(7));
}

/* ---------------------------------------------------------------- dequantize */

/*
 * Rows [r0, r1) of the weight (r0 a multiple of 16) as fp32 w [r1 - r0, K], exactly
 * gguf.quants.dequantize's values (its fp32 operations in its order: Q5_0 d (u - 16); Q5_1
 * d u + m; Q4_K / Q5_K (d sc) u - (dmin mn); Q6_K (d sc) (u - 32)). For fp32 activations
 * (--gguf-activations fp32) and dequantize(). Returns 0, -2 for an unknown type or K.
 */
int kvs_kq_dequant(int type, const uint8_t *w, int64_t n, int64_t K, int64_t r0, int64_t r1,
                   int num_threads, float *out) {
    kq_fmt f = {0, 1, 0, 0, 0};
    if (kq_format(type, &f) || K % (32 * f.sb) || r0 % 16 || r1 > n || r0 > r1) return -2;
    const int64_t nsb = K / (32 * f.sb), hb = hdr_bytes(f), bb = blk_bytes(f), sbb = sb_bytes(f);
    const int64_t tile_bytes = nsb * sbb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t row = r0; row < r1; row++) {
        const int r = (int)(row % 16);
        const uint8_t *wt = w + (row / 16) * tile_bytes;
        float *o = out + (row - r0) * K;
        for (int64_t s = 0; s < nsb; s++) {
            const uint16_t *h = (const uint16_t *)(wt + s * sbb);
            const float d = kvs_f16f(h[r]), dm = f.dm ? kvs_f16f(h[16 + r]) : 0.0f;
            for (int bi = 0; bi < f.sb; bi++) {
                const uint8_t *blk = wt + s * sbb + hb + bi * bb;
                const uint8_t *lo = blk + (f.subsc ? 32 : 0);
                float *ob = o + (s * f.sb + bi) * 32;
                for (int kk = 0; kk < 32; kk++) {
                    const int t = kk / 8, nib = (kk % 8) / 4, j = kk % 4, lane = 4 * r + j;
                    const uint8_t byte = lo[64 * t + 4 * r + j];
                    int u = nib ? byte >> 4 : byte & 15;
                    for (int p = 0; p + 4 < f.bits; p++) {
                        uint64_t m;
                        memcpy(&m, lo + 256 + 64 * p + 8 * (2 * t + nib), 8);
                        u |= (int)((m >> lane) & 1) << (4 + p);
                    }
                    float v;
                    if (type == 6) {
                        v = d * (float)(u - 16);
                    } else if (type == 7) {
                        const float du = d * (float)u;
                        v = du + dm;
                    } else if (type == 14) {
                        const float ds = d * (float)(int8_t)blk[16 * (kk / 16) + r];
                        v = ds * (float)(u - 32);
                    } else {
                        const float ds = d * (float)blk[r], dmn = dm * (float)blk[16 + r];
                        const float du = ds * (float)u;
                        v = du - dmn;
                    }
                    ob[kk] = v;
                }
            }
        }
    }
    return 0;
}
