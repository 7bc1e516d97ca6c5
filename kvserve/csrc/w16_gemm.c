/*
 * 16-bit weights read as 16-bit: y[M, N] = x[M, K] . W[N, K]^T with x and y fp32 and W bf16
 * (kind 0) or fp16 (kind 1), row-major as the checkpoint stores it (so a tied LM head shares its
 * table with the embedding). On every CPU kind dtype=auto computes in fp32; without this
 * kernel the engine would hold an fp32 copy of every weight and read twice the bytes per
 * decode step. Twin: kvserve.kernels.reference.w16_linear (x @ W.float().T);
 * tests/quant/test_w16.py sweeps shapes, both kinds and every ISA variant build
 * (cbuild.ISA_FLAGS) against it.
 *
 * Every y[m, n] is one dot product over k in a fixed order: lane-wise FMA chains over VL-wide
 * column chunks, a fixed horizontal sum, then the K % VL tail in scalar order. Rows of x are
 * never mixed and every row runs the same arithmetic whatever M is, so a row's result does not
 * depend on its batch (batch invariance; the test checks it bit for bit).
 *
 * Tiling: NR weight rows x MR rows of x per register tile (AVX-512: 4 x 4 zmm accumulators;
 * AVX2: 6 x 2 ymm, so each x vector read from L2 serves 6 FMAs). OpenMP splits the N / NR
 * weight tiles over threads. x is walked in chunks of ~256 KB of rows (prefill-sized M), each
 * tile streamed once per chunk. M <= MR: the tile is
 * converted to fp32 in registers as it is read. M > MR: it is converted once per chunk into a
 * per-thread fp32 scratch (NR * K floats, L1/L2-resident) and every MR-row block of x runs
 * against that; the converted values are exact, so both paths compute the same sums.
 *
 * Packed weights (packed = 1; kvs_w16_packing gives the build's NR and PK, kvserve/quant/w16.py
 * packs): W as [ceil(N / NR), K / PK, NR, PK], i.e. each tile's NR rows interleaved PK
 * columns at a time (rows past N zero; K % PK == 0). A tile is then one sequential stream
 * instead of NR streams a row apart: a batch-1 step reads its weights at ~34 GB/s instead of
 * ~26 on 2 AVX2 cores (the read probe: ~35). The arithmetic is the same in both layouts (the
 * same vectors meet in the same order), so packing changes no result.
 *
 * AMX layout (packed = 2, builds with AMX only; kvserve.kernels.cpu.w16_gemm.AMX_PACKING): bf16
 * tables with K % 16 == 0 as [ceil(N / 16), K / 2, 16, 2], so each 16-column step of 16 weight
 * rows is one 512-byte VNNI B tile the AMX loops read in place (no per-call repack or
 * transpose: a batch-1 step streams ~1.3x faster than from the 4 x 16 tiles). The tile products
 * are the same, so the bits are those of the 4 x 16 tiles. The loader packs it only where
 * every bf16-table GEMM takes the tiles; any other path reads it through a plain C loop.
 *
 * BF16 dot products (builds with AVX512-BF16, i.e. -march=native on Zen 4+ / Cooper Lake /
 * Sapphire Rapids+, or cbuild's "bf16" variant): bf16 weights (kind 0, row-major or packed:
 * the same sums bit for bit, see btile) times a GEMM of M >= bf16_rows rows (the caller's threshold; 0 = never) take vdpbf16ps instead -- x is
 * rounded to bf16 (round to nearest even, subnormals to zero) once per call, and every 32
 * columns add pairs of exact bf16 x bf16 products into fp32 lanes. Chosen at run time: the
 * caller passes bf16_rows from the CPU's flags and the kernel also checks the CPU itself
 * (__builtin_cpu_supports), so a library built elsewhere never runs it where it cannot. Twin:
 * kvserve.kernels.reference.w16_linear_bf16_dot (x rounded to bf16, then the fp32 product).
 * Batch invariance then holds within each regime: a row's result does not depend on the other
 * rows, but it does depend on whether its GEMM has >= bf16_rows rows (bf16-rounded x) or
 * fewer (fp32 x).
 */
/* the build's -fassociative-math would let the compiler reorder a row's sum differently in
 * each specialization of tile(), and contract a*b+c into an FMA in some; keep the order and
 * the roundings as written (the vector FMAs are explicit) */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "kvs_op.h"
#include "half.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* weight rows per tile: AVX2 6 (x 2 rows of x: 12 of its 16 ymm accumulate; each x vector,
 * streamed from L2 for prefill- and batch-sized M, feeds 6 FMAs), else 4 */
#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#define NR 6
#else
#define NR 4
#endif
#ifndef PF_TILES
#define PF_TILES 4
#endif
/* packed tiles: software prefetch this many bytes ahead of the one stream */
#ifndef PF_PACKED
#define PF_PACKED 512
#endif

static inline float w16_scalar(const uint16_t *w, int kind) {
    if (kind == 1) return kvs_f16f(*w);
    uint32_t u = (uint32_t)*w << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VL 16
#define MR 4
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m256 vfold(vec v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
static inline vec vload16(const uint16_t *p, int kind) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kind == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
#define MR 2
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256 vfold(vec v) { return v; }
static inline vec vload16(const uint16_t *p, int kind) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#ifdef VL
/* [sum a0, sum a1, sum a2, sum a3] with one fixed addition tree per sum (4 sums for the
 * shuffles of ~1.5) */
static inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
    const __m256 h0 = vfold(a0), h1 = vfold(a1), h2 = vfold(a2), h3 = vfold(a3);
    const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(h0, h1), _mm256_unpackhi_ps(h0, h1));
    const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(h2, h3), _mm256_unpackhi_ps(h2, h3));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* One register tile: rows x[0..mr) against weight rows w[0..NR) (16-bit, or fp32 when wf is
 * set), K columns; out[i][j] = x_i . w_j. mr, kind and wf are constants at every call site, so
 * each combination compiles to its own fully unrolled loop. */
static inline __attribute__((always_inline)) void tile(
    const float *const *x, int mr, const uint16_t *const *w, const float *const *wf, int kind,
    int64_t K, int64_t pf, const int64_t ws, float out[MR][NR]) {
    vec acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();
    const int64_t kv = K - K % VL;
    for (int64_t k = 0; k < kv; k += VL) {
        /* the rows' x vectors first, then one weight vector at a time (MR x NR accumulators,
         * MR x vectors and one weight vector live: no spills at 2 x 6 on AVX2) */
        vec xv[MR];
        for (int i = 0; i < mr; i++) {
            if (wf) _mm_prefetch((const char *)(x[i] + k + 64), _MM_HINT_T0);
            xv[i] = vload(x[i] + k);
        }
        if (!wf && ws != 1) { /* packed: the tile's one stream, NR * VL * 2 bytes per step */
            const char *p = (const char *)(w[0] + k * ws) + PF_PACKED;
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        for (int j = 0; j < NR; j++) {
            if (!wf && ws == 1) _mm_prefetch((const char *)(w[j] + k + pf), _MM_HINT_T0);
            vec wv = wf ? vload(wf[j] + k) : vload16(w[j] + k * ws, kind);
            /* in a register: else the compiler folds the load into every row's FMA, and the
             * loads (one per FMA) instead of the FMAs bound the loop */
#ifndef KVS_SIMDE /* (an emulated 512-bit vector is no register) */
            __asm__("" : "+v"(wv));
#endif
            for (int i = 0; i < mr; i++) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) {
        /* 4 sums per vsum4 (each output's addition tree is the same in every lane, so a
         * padded last group changes nothing) */
        for (int j0 = 0; j0 < NR; j0 += 4) {
#define KVS_J(d) (j0 + (d) < NR ? j0 + (d) : j0)
            float s4[4];
            _mm_storeu_ps(s4, vsum4(acc[i][j0], acc[i][KVS_J(1)], acc[i][KVS_J(2)],
                                    acc[i][KVS_J(3)]));
#undef KVS_J
            for (int j = j0; j < j0 + 4 && j < NR; j++) out[i][j] = s4[j - j0];
        }
        for (int j = 0; j < NR; j++)
            for (int64_t k = kv; k < K; k++)
                out[i][j] += x[i][k] * (wf ? wf[j][k] : w16_scalar(w[j] + k, kind));
    }
}

static void tile_dispatch(const float *const *x, int mr, const uint16_t *const *w,
                          const float *const *wf, int kind, int64_t K, int64_t pf, int packed,
                          float out[MR][NR]) {
    /* literal arguments: one specialized copy of tile() per (mr, source, layout) */
#define KVS_TILE(MRV)                                                          \
    if (wf)                                                                    \
        tile(x, MRV, w, wf, 0, K, pf, 1, out);                                 \
    else if (kind == 1)                                                        \
        if (packed)                                                            \
            tile(x, MRV, w, NULL, 1, K, pf, NR, out);                          \
        else                                                                   \
            tile(x, MRV, w, NULL, 1, K, pf, 1, out);                           \
    else if (packed)                                                           \
        tile(x, MRV, w, NULL, 0, K, pf, NR, out);                              \
    else                                                                       \
        tile(x, MRV, w, NULL, 0, K, pf, 1, out);
    switch (mr) {
#if MR == 4
    case 4: KVS_TILE(4) break;
    case 3: KVS_TILE(3) break;
#endif
    case 2: KVS_TILE(2) break;
    default: KVS_TILE(1) break;
    }
#undef KVS_TILE
}
#else
#define MR 4
/* plain C: the same per-element order as above with VL = 8 */
static void tile_dispatch(const float *const *x, int mr, const uint16_t *const *w,
                          const float *const *wf, int kind, int64_t K, int64_t pf, int packed,
                          float out[MR][NR]) {
    const int64_t kv = K - K % 8, ws = packed ? NR : 1;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float lane[8] = {0};
            for (int64_t k = 0; k < kv; k += 8)
                for (int l = 0; l < 8; l++)
                    lane[l] += x[i][k + l] *
                               (wf ? wf[j][k + l] : w16_scalar(w[j] + k * ws + l, kind));
            float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                      ((lane[1] + lane[5]) + (lane[3] + lane[7]));
            for (int64_t k = kv; k < K; k++)
                s += x[i][k] * (wf ? wf[j][k] : w16_scalar(w[j] + k, kind));
            out[i][j] = s;
        }
}
#endif

#if defined(__AVX512BF16__) && defined(VL) && VL == 16
#define KVS_BF16_DOT 1
/* fp32 -> bf16, round to nearest even, subnormals to zero, NaN kept NaN: what vcvtne2ps2bf16
 * does, for the K % 32 tail */
static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* one row of x -> bf16, zero-padded to Kp (a multiple of 32) */
static void bf16_row(const float *x, int64_t K, int64_t Kp, uint16_t *out) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16),
                                               _mm512_loadu_ps(x + k));
        _mm512_storeu_si512(out + k, (__m512i)b);
    }
    for (; k < K; k++) out[k] = bf16_rne(x[k]);
    for (; k < Kp; k++) out[k] = 0;
}

/* One register tile of bf16 dot products: x rows (bf16, zero-padded to a multiple of 32)
 * against NR bf16 weight rows, row-major (ws = 1: row j at w[j]) or packed (ws = NR: row j's
 * PK = 16 columns from k at w[j] + k * NR, the tile one stream). A packed row's 32 columns of a
 * step are its two 16-column pieces, NR * PK apart, joined into one vector: the same values
 * in the same lanes as the row-major load, so both layouts compute the same sums bit for bit
 * (a K % 32 == 16 tail: the first piece, the upper half zero, as the row-major masked load). */
static inline __attribute__((always_inline)) void btile(
    const uint16_t *const *x, int mr, const uint16_t *const *w, int64_t K, int64_t pf,
    const int64_t ws, float out[MR][NR]) {
    vec acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();
    const int64_t kv = K - K % 32;
    for (int64_t k = 0; k < K; k += 32) {
        __m512i wv[NR];
        if (ws != 1) { /* packed: NR * 32 * 2 bytes of the one stream per step */
            const char *p = (const char *)(w[0] + k * ws) + 2 * PF_PACKED;
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
            _mm_prefetch(p + 128, _MM_HINT_T0);
            _mm_prefetch(p + 192, _MM_HINT_T0);
            for (int j = 0; j < NR; j++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(w[j] + k * ws));
                wv[j] = k < kv ? _mm512_inserti64x4(
                                     _mm512_castsi256_si512(lo),
                                     _mm256_loadu_si256((const __m256i *)(w[j] + (k + 16) * ws)),
                                     1)
                               : _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                                                    _mm256_setzero_si256(), 1);
            }
        } else {
            /* the last K % 32 columns: weights loaded masked (x is zero-padded already) */
            const __mmask32 mk = k < kv ? ~(__mmask32)0 : (__mmask32)((1u << (K - k)) - 1);
            for (int j = 0; j < NR; j++) {
                _mm_prefetch((const char *)(w[j] + k + pf), _MM_HINT_T0);
                wv[j] = k < kv ? _mm512_loadu_si512(w[j] + k)
                               : _mm512_maskz_loadu_epi16(mk, w[j] + k);
            }
        }
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + k);
            for (int j = 0; j < NR; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        _mm_storeu_ps(out[i], vsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}

static void btile_dispatch(const uint16_t *const *x, int mr, const uint16_t *const *w,
                           int64_t K, int64_t pf, int packed, float out[MR][NR]) {
#define KVS_BTILE(MRV)                                                         \
    if (packed)                                                                \
        btile(x, MRV, w, K, pf, NR, out);                                      \
    else                                                                       \
        btile(x, MRV, w, K, pf, 1, out);
    switch (mr) {
    case 4: KVS_BTILE(4) break;
    case 3: KVS_BTILE(3) break;
    case 2: KVS_BTILE(2) break;
    default: KVS_BTILE(1) break;
    }
#undef KVS_BTILE
}

/* the bf16-dot GEMM (same tiling and chunking as kvs_w16_gemm); 1 when x's bf16 copy could
 * not be allocated */
static int w16_gemm_bf16_dot(const float *x, int64_t M, int64_t K, int64_t ldx,
                             const uint16_t *w, int64_t N, int64_t ldw, int num_threads,
                             float *y, int64_t ldy, int packed) {
    const int64_t Kp = (K + 31) / 32 * 32;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * Kp));
    if (xb == NULL) return 1;
    const int64_t ntiles = (N + NR - 1) / NR;
    const int64_t pf = PF_TILES * NR * ldw;
    int64_t mb = (int64_t)(262144 / (2 * (Kp > 0 ? Kp : 1))) / MR * MR;
    if (mb < MR) mb = MR;
#pragma omp parallel num_threads(num_threads) if (N * K * 4 > 65536)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) bf16_row(x + m * ldx, K, Kp, xb + m * Kp);
        for (int64_t c0 = 0; c0 < M; c0 += mb) {
            const int64_t c1 = c0 + mb < M ? c0 + mb : M;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < ntiles; t++) {
                const uint16_t *wr[NR];
                for (int j = 0; j < NR; j++) {
                    int64_t n = t * NR + j;
                    if (n >= N) n = N - 1; /* alias the last row; its result is dropped */
                    /* packed: row j's first 16 columns (PK == VL == 16 in every build with
                     * this path); its next ones follow NR * 16 apart */
                    wr[j] = packed ? w + t * NR * K + j * 16 : w + n * ldw;
                }
                const int nr = N - t * NR < NR ? (int)(N - t * NR) : NR;
                for (int64_t m0 = c0; m0 < c1; m0 += MR) {
                    const int mr = c1 - m0 < MR ? (int)(c1 - m0) : MR;
                    const uint16_t *xr[MR];
                    for (int i = 0; i < MR; i++) xr[i] = xb + (m0 + (i < mr ? i : 0)) * Kp;
                    float out[MR][NR];
                    btile_dispatch(xr, mr, wr, K, pf, packed, out);
                    for (int i = 0; i < mr; i++)
                        memcpy(y + (m0 + i) * ldy + t * NR, out[i], sizeof(float) * nr);
                }
            }
        }
    }
    free(xb);
    return 0;
}
#endif

#if defined(KVS_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(KVS_SIMDE)
#define KVS_AMX 1
#include "amx.h"
/* AMX (Sapphire Rapids and later): the bf16 dot products as tile products (TDPBF16PS).
 *
 * Roles: A = one packed tile's NR = 4 weight rows x 16 columns (32 contiguous bytes a row: the
 * packed layout is read in place, no copy), B = 16 rows of x as the tile's VNNI pairs
 * (B[r][2m + p] = x[m][16s + 2r + p], 8 pair rows), C[n][m] = y[m][n] (4 x 16 fp32). Per
 * 16-column step two weight tiles meet two 16-row blocks of x: 2 A + 2 B loads, 4 products.
 * Row-major tables are first copied, two tiles at a time, into that layout.
 *
 * Every element of C accumulates its 16-column steps in k order, one TDPBF16PS each, and no
 * element mixes with another: a row of x gets the same sums whatever the other rows are (zero
 * rows pad a block), so the path is batch-invariant on its own. The tile shape is part of the
 * arithmetic (measured: 16 x 32-column tiles round differently from 4 x 16 ones), so this one
 * shape serves every M, and on an AMX CPU the path serves every GEMM the bf16-dot threshold
 * sends to the bf16 dots (M = 1 included), never beside vdpbf16ps. Its sums run in another
 * order than vdpbf16ps's: the twin's tolerance, not bit equality, relates the two.
 *
 * x is rounded to bf16 and laid out as B tiles once per call (xt: [Mp / 16][Kp / 32][16][16]
 * dwords: the pair rows of two 16-column steps). x rows are walked in chunks of ~AMX_XT_BYTES
 * of xt (L2-resident while every weight tile pair meets them). */
#ifndef AMX_XT_BYTES
#define AMX_XT_BYTES 524288
#endif

static int amx_state = -1; /* -1: not asked yet, 0: off / unavailable, 1: on */

/* the tile permission, CPUID check and configuration: amx.h (shared with the GGUF GEMMs'
 * AMX-INT8 paths) */
typedef kvs_amx_cfg amx_cfg;

static void amx_config(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* tmm0-3 C: NR weight rows x 16 rows of x, fp32 */
        cfg.rows[t] = NR;
        cfg.colsb[t] = 64;
    }
    for (int t = 4; t < 6; t++) { /* tmm4-5 A: NR weight rows x 16 columns, bf16 */
        cfg.rows[t] = NR;
        cfg.colsb[t] = 32;
    }
    for (int t = 6; t < 8; t++) { /* tmm6-7 B: 8 column pairs x 16 rows of x */
        cfg.rows[t] = 8;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static int w16_gemm_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                        int64_t N, int64_t ldw, int num_threads, float *y, int64_t ldy,
                        int packed) {
    const int64_t Kp = (K + 31) / 32 * 32, S = Kp / 32, Mp = (M + 15) / 16 * 16;
    const int64_t K16 = (K + 15) / 16; /* 16-column steps */
    uint32_t *xt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(Mp * Kp / 2));
    if (xt == NULL) return 1;
    /* rows of x per chunk: ~AMX_XT_BYTES of xt, a multiple of 32 */
    int64_t mc = (int64_t)(AMX_XT_BYTES / (2 * Kp)) / 32 * 32;
    if (mc < 32) mc = 32;
    const int64_t npairs = (N + 2 * NR - 1) / (2 * NR); /* pairs of packed tiles */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K * (M < 4 ? M : 4) > 65536)
    {
        uint16_t row[Kp];
#pragma omp for schedule(static)
        for (int64_t m = 0; m < Mp; m++) {
            if (m < M)
                bf16_row(x + m * ldx, K, Kp, row);
            else
                memset(row, 0, sizeof(row));
            uint32_t *dst = xt + (m / 16) * S * 256 + m % 16;
            for (int64_t s = 0; s < S; s++)
                for (int r = 0; r < 16; r++) /* the pair (32s + 2r, +1) */
                    memcpy(dst + s * 256 + r * 16, row + s * 32 + 2 * r, 4);
        }
        /* row-major weights: each pair of tiles copied into the packed layout (zero rows past
         * N, zero columns past K) */
        uint16_t *ws = packed ? NULL : aligned_alloc(64, sizeof(uint16_t) * 2 * NR * 16 *
                                                         (size_t)K16);
        if (!packed && ws == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (packed || ws != NULL) amx_config();
        float cbuf[4][NR * 16];
        for (int64_t c0 = 0; c0 < Mp && (packed || ws != NULL); c0 += mc) {
            const int64_t c1 = c0 + mc < Mp ? c0 + mc : Mp;
#pragma omp for schedule(static) nowait
            for (int64_t tp = 0; tp < npairs; tp++) {
                const int two_n = (tp * 2 + 1) * NR < N; /* a second tile of weight rows */
                const uint16_t *a0, *a1;
                int64_t as; /* bytes between a tile's 16-column steps */
                if (packed) {
                    a0 = w + tp * 2 * NR * K;
                    a1 = a0 + NR * K;
                    as = NR * 16;
                } else {
                    memset(ws, 0, sizeof(uint16_t) * 2 * NR * 16 * (size_t)K16);
                    for (int j = 0; j < 2 * NR; j++) {
                        const int64_t n = tp * 2 * NR + j;
                        if (n >= N) break;
                        for (int64_t k = 0; k < K; k++)
                            ws[(j / NR) * NR * 16 * K16 + (k / 16) * NR * 16 + (j % NR) * 16 +
                               k % 16] = w[n * ldw + k];
                    }
                    a0 = ws;
                    a1 = ws + NR * 16 * K16;
                    as = NR * 16;
                }
                const int nv = N - tp * 2 * NR < 2 * NR ? (int)(N - tp * 2 * NR) : 2 * NR;
                for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                    const int two = m0 + 16 < Mp; /* a second 16-row block of x */
                    const uint32_t *b0 = xt + (m0 / 16) * S * 256;
                    const uint32_t *b1 = b0 + S * 256;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < K16; s++) {
                        /* B: the 8 pairs of columns 16s.., rows r = 8 (s % 2).. of block s/2 */
                        const int64_t bo = (s / 2) * 256 + (s % 2) * 128;
                        _tile_loadd(4, a0 + s * as, 32);
                        _tile_loadd(6, b0 + bo, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two_n) {
                            _tile_loadd(5, a1 + s * as, 32);
                            _tile_dpbf16ps(2, 5, 6);
                        }
                        if (two) {
                            _tile_loadd(7, b1 + bo, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            if (two_n) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, cbuf[0], 64);
                    if (two_n) _tile_stored(2, cbuf[2], 64);
                    if (two) _tile_stored(1, cbuf[1], 64);
                    if (two && two_n) _tile_stored(3, cbuf[3], 64);
                    /* cbuf[2 * nh + mh][n][m] -> y[m0 + 16 mh + m][tp * 2NR + NR nh + n] */
                    for (int mh = 0; mh < 1 + two; mh++)
                        for (int m = 0; m < 16 && m0 + 16 * mh + m < M; m++) {
                            float *yr = y + (m0 + 16 * mh + m) * ldy + tp * 2 * NR;
                            for (int n = 0; n < nv; n++)
                                yr[n] = cbuf[2 * (n / NR) + mh][(n % NR) * 16 + m];
                        }
                }
            }
        }
        if (packed || ws != NULL) _tile_release();
        free(ws);
    }
    free(xt);
    return failed;
}
#endif

#ifdef KVS_AMX
/* The same tile products for prefill-sized M, cache- and register-blocked (oneDNN's shape).
 *
 * Roles swapped: A = 16 rows of x (bf16, row-major: 16 columns = 32 bytes a row, read in place
 * from x's bf16 copy), B = 16 weight rows as VNNI pairs (B[r][2n + p] = w[n][16s + 2r + p],
 * 8 pair rows), C[m][n] = y[m][n] (16 x 16 fp32, stored straight into y). Every product is
 * still one TDPBF16PS over 16 columns per step, the steps in k order from zero: the tile shape
 * that rounds (measured: 16 vs 32 columns per product) is unchanged, and a C element's sum
 * does not depend on how many rows the A and B tiles have or which lane it sits in (measured:
 * 4 x 16 weight tiles and 16 x 16 ones give the same bits, either role). So this path gives
 * w16_gemm_amx's results bit for bit, and rows stay batch-invariant across the two (tested).
 *
 * Register blocking 2 x 2: per 16-column step 2 A (32 rows of x) + 2 B (32 weight rows) loads
 * feed 4 products into tmm0-3 (a 16 x 16 tile product at 16 columns runs at half the
 * TDPBF16PS peak: ~1.1 TFLOP/s a core here with the operands in L1). Weights are repacked into
 * the VNNI layout once per call ([N / 32][K16][2][8][16] dwords; each thread repacks the
 * 32-row blocks it then computes, the next one during the current one's products); x is
 * walked in chunks of ~AMX_XT_BYTES (L2-resident while the thread's weight blocks meet them),
 * each rounded to bf16 during the previous chunk's products.
 *
 * The repack costs N K per call, yet this path serves every M by default (AMX_BLOCK_ROWS 1):
 * an engine's weights are never L2-hot between two uses (SmolLM2's layers: 212 MB a step),
 * and from L3 the repack's vector loads stream faster than w16_gemm_amx's tile loads of the
 * packed table (measured, 30 SmolLM2 layers, 1 thread: M = 1 / 4 / 16: 9 / 35 / 133 GFLOP/s
 * against 7 / 26 / 96; decode tok/s 34.4 / 130 / 460 against 29.0 / 99 / 342 at batch 1 / 4
 * / 16). With L2-hot weights (a few small tables) the in-place tiles win below ~20 rows.
 * w16_gemm_amx stays as the other loop over the same products (tests compare the two bit
 * for bit); kvs_w16_amx_block_rows sets from how many rows this path runs. */
#ifndef AMX_BLOCK_ROWS
#define AMX_BLOCK_ROWS 1
#endif
static int64_t amx_block_rows = AMX_BLOCK_ROWS;

static void amx_config_blocked(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* tmm0-3 C: 16 rows of x x 16 weight rows, fp32 */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    for (int t = 4; t < 6; t++) { /* tmm4-5 A: 16 rows of x x 16 columns, bf16 */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 32;
    }
    for (int t = 6; t < 8; t++) { /* tmm6-7 B: 8 column pairs x 16 weight rows */
        cfg.rows[t] = 8;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 weight rows (src[i]: row n0 + i's 16 columns of a step, NULL past N; `valid` of them
 * inside K) -> one VNNI B tile dst[r][i] = (w[i][2r], w[i][2r + 1]): a 16 x 8 dword transpose */
static inline void vnni_tile(const uint16_t *const *src, int valid, uint32_t *dst) {
    const __mmask16 mk = (__mmask16)((1u << valid) - 1);
    __m256i r[16];
    for (int i = 0; i < 16; i++)
        r[i] = src[i] == NULL ? _mm256_setzero_si256()
               : valid == 16  ? _mm256_loadu_si256((const __m256i *)src[i])
                              : _mm256_maskz_loadu_epi16(mk, src[i]);
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++) /* [row i | row i + 8], 8 dwords each */
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(r[i]), r[i + 8], 1);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* u[i + d]: dword d (and d + 4) of rows i .. i + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int d = 0; d < 4; d++) {
        _mm512_store_si512(dst + d * 16, _mm512_permutex2var_epi64(u[d], lo, u[d + 4]));
        _mm512_store_si512(dst + (d + 4) * 16, _mm512_permutex2var_epi64(u[d], hi, u[d + 4]));
    }
}

/* weight rows n0 .. n0 + 31, B tile t of their [K16][2][8][16] dwords (zero past N, K): the
 * 16-column step t / 2 of rows n0 + 16 (t % 2) .., written to tile (256 dwords) */
static inline void vnni_tile_at(const uint16_t *w, int64_t N, int64_t K, int64_t ldw,
                                int packed, int64_t n0, int64_t t, uint32_t *tile) {
    const int64_t s = t / 2;
    const int valid = K - 16 * s < 16 ? (int)(K - 16 * s) : 16;
    const uint16_t *src[16];
    for (int i = 0; i < 16; i++) {
        const int64_t n = n0 + 16 * (t % 2) + i;
        src[i] = n >= N   ? NULL
                 : packed ? w + (n / NR) * NR * K + s * NR * 16 + (n % NR) * 16
                          : w + n * ldw + 16 * s;
    }
    vnni_tile(src, valid, tile);
}

/* the same tile at its place in a block's [K16][2][8][16] buffer dst */
static inline void vnni_step(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, int packed,
                             int64_t n0, int64_t t, uint32_t *dst) {
    vnni_tile_at(w, N, K, ldw, packed, n0, t, dst + t * 128);
}

/* A packed table's 16 weight rows (four 4-row tiles, gs elements apart; t: the step's first
 * tile's 16-column piece) -> one B tile with its weight rows in AMX_FEW_LANES order (lane n:
 * row 2n for n < 8, row 2 (n - 8) + 1 above): each 64-byte load is rows (2i, 2i + 1) of a step,
 * so no lane crossing is needed before vnni_tile's network; the caller puts C's lanes back in
 * row order. */
static inline void vnni_tile_packed(const uint16_t *t, int64_t gs, uint32_t *dst) {
    __m512i z[8], u[8], v[8];
    for (int i = 0; i < 8; i++) z[i] = _mm512_load_si512(t + (i / 2) * gs + (i % 2) * 32);
    for (int i = 0; i < 8; i += 2) {
        u[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        u[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        v[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int d = 0; d < 4; d++) {
        _mm512_store_si512(dst + d * 16, _mm512_permutex2var_epi64(v[d], lo, v[d + 4]));
        _mm512_store_si512(dst + (d + 4) * 16, _mm512_permutex2var_epi64(v[d], hi, v[d + 4]));
    }
}

/* x rows r0 + u / P, columns [32 (u % P), + 32) -> bf16 at buf's row u / P (rows lx apart;
 * P = Kp / 32 pieces a row; rows at or past M zero): bf16_row's values, a piece at a time */
static inline void x_piece(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t lx,
                           int64_t P, int64_t r0, int64_t u, uint16_t *buf) {
    const int64_t r = u / P, k = 32 * (u % P), m = r0 + r;
    uint16_t *out = buf + r * lx + k;
    if (m >= M) {
        memset(out, 0, 64);
        return;
    }
    const float *xr = x + m * ldx;
    if (k + 32 <= K) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16),
                                               _mm512_loadu_ps(xr + k));
        _mm512_storeu_si512(out, (__m512i)b);
    } else {
        for (int64_t i = 0; i < 32; i++) out[i] = k + i < K ? bf16_rne(xr[k + i]) : 0;
    }
}

static int w16_gemm_amx_blocked(const float *x, int64_t M, int64_t K, int64_t ldx,
                                const uint16_t *w, int64_t N, int64_t ldw, int num_threads,
                                float *y, int64_t ldy, int packed) {
    const int64_t Kp = (K + 31) / 32 * 32, K16 = (K + 15) / 16, Mp = (M + 31) / 32 * 32;
    /* x's bf16 rows: 32-byte aligned (a tile row never splits a line), never a multiple of
     * 4 KB apart (16 rows of a tile in one L1 set) */
    const int64_t lx = Kp + 16;
    const int64_t nblk = (N + 31) / 32;
    /* rows of x per chunk: ~AMX_XT_BYTES of bf16 x, a multiple of 32 */
    int64_t mc = (int64_t)(AMX_XT_BYTES / (2 * lx)) / 32 * 32;
    if (mc < 32) mc = 32;
    if (mc > Mp) mc = Mp;
    /* two chunk buffers: chunk i + 1 is rounded while a slower thread still multiplies
     * chunk i */
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * 2 * (size_t)(mc * lx));
    /* the repacked weights: one chunk of x (M <= mc, e.g. the LM head's last rows): each
     * block repacked into one of two per-thread buffers while the previous block's products
     * run (L1/L2-hot, no table-sized copy); more: every block kept for the later chunks,
     * repacked the same way during the first by the thread that owns it in every chunk */
    const int one_chunk = Mp <= mc, vnni = packed == 2; /* vnni: B tiles read in place */
    uint32_t *wb = one_chunk || vnni ? NULL
                             : aligned_alloc(64, sizeof(uint32_t) * 256 * (size_t)(nblk * K16));
    if (xb == NULL || (!one_chunk && !vnni && wb == NULL)) {
        free(xb);
        free(wb);
        return 1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* this thread's 32-row weight blocks, the same in every chunk */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = nblk * me / nt, hi = nblk * (me + 1) / nt, tiles = 2 * K16;
        uint32_t *own = one_chunk && !vnni
                            ? aligned_alloc(64, sizeof(uint32_t) * 512 * (size_t)K16)
                            : NULL;
        if (one_chunk && !vnni && own == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        amx_config_blocked();
        float cbuf[32][32];
        /* x rounded to bf16 into two chunk buffers in turn, each thread its share of a
         * chunk's rows: the first chunk before any product, chunk i + 1 a few pieces a step
         * during chunk i's products (the vector ports are idle beside the tile unit) */
        const int64_t P = Kp / 32;
        {
            const int64_t e1 = mc < Mp ? mc : Mp;
            for (int64_t u = e1 * me / nt * P; u < e1 * (me + 1) / nt * P; u++)
                x_piece(x, ldx, M, K, lx, P, 0, u, xb);
        }
        for (int64_t c0 = 0; c0 < Mp; c0 += mc) {
            const int64_t c1 = c0 + mc < Mp ? c0 + mc : Mp;
            const uint16_t *xc = xb + ((c0 / mc) % 2) * mc * lx;
            /* the chunk is complete, and every thread is done with the previous chunk's
             * products, which read the other buffer, before this chunk's products round the
             * next chunk into it */
#pragma omp barrier
            const int64_t e1 = c1 + mc < Mp ? c1 + mc : Mp; /* the next chunk: rows c1 .. e1 */
            uint16_t *xn = xb + ((c0 / mc + 1) % 2) * mc * lx;
            int64_t cu = e1 > c1 ? (e1 - c1) * me / nt * P : 0;
            const int64_t cend = e1 > c1 ? (e1 - c1) * (me + 1) / nt * P : 0;
            const int64_t csteps = (hi - lo) * ((c1 - c0) / 32) * K16;
            const int64_t cper = csteps > 0 ? (cend - cu + csteps - 1) / csteps : 0;
            if (one_chunk && !vnni && own == NULL) continue;
            /* block b's B tiles: one chunk, the two halves of own in turn; else wb's */
#define KVS_BBUF(b) (one_chunk ? own + (((b) - lo) % 2) * K16 * 256 : wb + (b) * K16 * 256)
            if (c0 == 0 && lo < hi && !vnni)
                for (int64_t t = 0; t < tiles; t++) vnni_step(w, N, K, ldw, packed, lo * 32, t,
                                                              KVS_BBUF(lo));
            /* during the first chunk, block b + 1 is repacked a few tiles a step while block
             * b's tile products run (vector ports otherwise idle beside the tile unit) */
            const int64_t per = (tiles * 32 + (c1 - c0) * K16 - 1) / ((c1 - c0) * K16);
            for (int64_t b = lo; b < hi; b++) {
                const int64_t n0 = b * 32;
                const int two_n = n0 + 16 < N; /* a second 16 weight rows */
                /* B tile (s, half h) at bb + s * bs + h * bh (dwords): the repacked block's
                 * [K16][2][8][16], or the VNNI table's [N / 16][K / 2][16][2] in place */
                const uint32_t *bb = vnni ? (const uint32_t *)(w + n0 * K) : KVS_BBUF(b);
                const int64_t bs = vnni ? 128 : 256, bh = vnni ? 8 * K : 128;
                uint32_t *nb = c0 == 0 && b + 1 < hi && !vnni ? KVS_BBUF(b + 1) : NULL;
#undef KVS_BBUF
                int64_t ti = nb != NULL ? 0 : tiles; /* next block's tiles repacked */
                for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                    const int two_m = m0 + 16 < M; /* a second 16 rows of x */
                    const uint16_t *a0 = xc + (m0 - c0) * lx, *a1 = a0 + 16 * lx;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    /* the next block's 32 rows of y (2 lines each), one row a step: without
                     * it the stores wait on their lines (~20% of the time at M = 1,024) */
                    const float *yn = m0 + 32 < c1 && m0 + 64 <= M && n0 + 32 <= N
                                          ? y + (m0 + 32) * ldy + n0
                                          : NULL;
                    for (int64_t s = 0; s < K16; s++) {
                        if (yn != NULL && s < 32) {
                            __builtin_prefetch(yn + s * ldy, 1, 3);
                            __builtin_prefetch(yn + s * ldy + 16, 1, 3);
                        }
                        for (int64_t i = 0; i < per && ti < tiles; i++, ti++)
                            vnni_step(w, N, K, ldw, packed, n0 + 32, ti, nb);
                        for (int64_t i = 0; i < cper && cu < cend; i++, cu++)
                            x_piece(x, ldx, M, K, lx, P, c1, cu, xn);
                        _tile_loadd(4, a0 + 16 * s, 2 * lx);
                        _tile_loadd(6, bb + s * bs, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two_n) {
                            _tile_loadd(7, bb + s * bs + bh, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (two_m) {
                            _tile_loadd(5, a1 + 16 * s, 2 * lx);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two_n) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    /* C[mh][nh] -> y[m0 + 16 mh ..][n0 + 16 nh ..]: straight into y where the
                     * whole 32 x 32 block is inside it */
                    float *yb = y + m0 * ldy + n0;
                    if (m0 + 32 <= M && n0 + 32 <= N) {
                        _tile_stored(0, yb, 4 * ldy);
                        _tile_stored(1, yb + 16, 4 * ldy);
                        _tile_stored(2, yb + 16 * ldy, 4 * ldy);
                        _tile_stored(3, yb + 16 * ldy + 16, 4 * ldy);
                        continue;
                    }
                    _tile_stored(0, &cbuf[0][0], 128);
                    if (two_n) _tile_stored(1, &cbuf[0][16], 128);
                    if (two_m) _tile_stored(2, &cbuf[16][0], 128);
                    if (two_m && two_n) _tile_stored(3, &cbuf[16][16], 128);
                    const int mv = M - m0 < 32 ? (int)(M - m0) : 32;
                    const int nv = N - n0 < 32 ? (int)(N - n0) : 32;
                    for (int m = 0; m < mv; m++)
                        memcpy(yb + m * ldy, cbuf[m], sizeof(float) * (size_t)nv);
                }
                for (; ti < tiles; ti++) vnni_step(w, N, K, ldw, packed, n0 + 32, ti, nb);
            }
            for (; cu < cend; cu++) x_piece(x, ldx, M, K, lx, P, c1, cu, xn);
        }
        _tile_release();
        free(own);
    }
    free(xb);
    free(wb);
    return failed;
}
#endif

#ifdef KVS_AMX
/* The same tile products for a decode-sized GEMM (M <= 16 rows of x: one A tile), which
 * streams its weights once from DRAM: the blocked loop's roles (A = x rows, B = weight rows as
 * VNNI pairs, C[m][n] = y[m][n]), but the A and C tiles configured with exactly M rows (a
 * product's cost follows its rows: no 15 zero rows at M = 1), x rounded to bf16 once per call
 * by each thread (M K values, L1-resident), and each 32-weight-row block's B tiles repacked one
 * 16-column step at a time into a small L1 ring right before their two products, the block two
 * ahead prefetched as one linear stream (a thread's blocks are consecutive in the packed table,
 * so its weights are one stream; without it the repack's loads wait on DRAM). Every C element
 * is still one TDPBF16PS per 16 columns in k order from zero, and its sum does not depend on
 * the A / B tiles' row counts (measured; see w16_gemm_amx_blocked): the bits of the blocked and
 * in-place loops, so rows stay batch-invariant across the three (tested). */
#ifndef AMX_FEW_ROWS
#define AMX_FEW_ROWS 16
#endif
static int64_t amx_few_rows = AMX_FEW_ROWS;
#ifndef AMX_FEW_AHEAD
#define AMX_FEW_AHEAD 8
#endif


static int w16_gemm_amx_few(const float *x, int64_t M, int64_t K, int64_t ldx,
                            const uint16_t *w, int64_t N, int64_t ldw, int num_threads,
                            float *y, int64_t ldy, int packed) {
    const int64_t Kp = (K + 31) / 32 * 32, K16 = (K + 15) / 16, lx = Kp + 16;
    const int64_t nblk = (N + 31) / 32;
    const int64_t P = Kp / 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K > 65536)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = nblk * me / nt, hi = nblk * (me + 1) / nt;
        uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(M * lx));
        if (xb == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (xb != NULL && lo < hi) {
            for (int64_t u = 0; u < M * P; u++) x_piece(x, ldx, M, K, lx, P, 0, u, xb);
            amx_cfg cfg;
            memset(&cfg, 0, sizeof(cfg));
            cfg.palette = 1;
            cfg.rows[0] = cfg.rows[1] = (uint8_t)M; /* tmm0-1 C: M rows x 16 weight rows */
            cfg.colsb[0] = cfg.colsb[1] = 64;
            cfg.rows[4] = (uint8_t)M; /* tmm4 A: M rows of x x 16 columns */
            cfg.colsb[4] = 32;
            cfg.rows[6] = cfg.rows[7] = 8; /* tmm6-7 B: 8 column pairs x 16 weight rows */
            cfg.colsb[6] = cfg.colsb[7] = 64;
            _tile_loadconfig(&cfg);
            float cbuf[16][32] __attribute__((aligned(64)));
            /* the B tiles of AMX_FEW_AHEAD steps: a tile load right behind the stores that
             * wrote its bytes waits for them (measured: 3x the step's time), so each step's
             * tiles are transposed that many steps before their products */
            uint32_t ring[AMX_FEW_AHEAD][2][256] __attribute__((aligned(64)));
            /* this thread's weights are one stream of the packed table: prefetched a block
             * (32 K values) ahead, a step's share of lines per step */
            const char *wend = (const char *)(w + hi * 32 * K);
            const int64_t pfstep = (64 * K / K16 + 63) / 64 * 64;
            /* y lane j <- C lane (j odd ? 8 + j / 2 : j / 2): AMX_FEW_LANES order back */
            const __m512i back = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6,
                                                   14, 7, 15);
            const int64_t steps = (hi - lo) * K16;
            int64_t g = 0; /* steps transposed so far, in order */
#define KVS_FEW_TRANSPOSE()                                                                \
    do {                                                                                   \
        const int64_t gn0 = (lo + g / K16) * 32, gs = g % K16;                             \
        uint32_t(*gt)[256] = ring[g % AMX_FEW_AHEAD];                                      \
        if (packed && gn0 + 32 <= N) {                                                     \
            vnni_tile_packed(w + gn0 * K + gs * 64, 4 * K, gt[0]);                         \
            vnni_tile_packed(w + (gn0 + 16) * K + gs * 64, 4 * K, gt[1]);                  \
        } else {                                                                           \
            vnni_tile_at(w, N, K, ldw, packed, gn0, 2 * gs, gt[0]);                        \
            if (gn0 + 16 < N) vnni_tile_at(w, N, K, ldw, packed, gn0, 2 * gs + 1, gt[1]);  \
        }                                                                                  \
        g++;                                                                               \
    } while (0)
            while (g < steps && g < AMX_FEW_AHEAD - 1) KVS_FEW_TRANSPOSE();
            for (int64_t b = lo; b < hi; b++) {
                const int64_t n0 = b * 32;
                const int two_n = n0 + 16 < N;
                const int fast = packed && n0 + 32 <= N; /* lanes in AMX_FEW_LANES order */
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t s = 0; s < K16; s++) {
                    if (packed) {
                        const char *pf = (const char *)(w + (n0 + 32) * K) + s * pfstep;
                        for (int64_t o = 0; o < pfstep && pf + o < wend; o += 64)
                            _mm_prefetch(pf + o, _MM_HINT_T0);
                    }
                    if (g < steps) KVS_FEW_TRANSPOSE();
                    uint32_t(*bt)[256] = ring[((b - lo) * K16 + s) % AMX_FEW_AHEAD];
                    _tile_loadd(4, xb + 16 * s, 2 * lx);
                    _tile_loadd(6, bt[0], 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_n) {
                        _tile_loadd(7, bt[1], 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                float *yb = y + n0;
                _tile_stored(0, &cbuf[0][0], 128);
                if (two_n) _tile_stored(1, &cbuf[0][16], 128);
                if (fast) {
                    for (int m = 0; m < M; m++) {
                        const __m512 c0 = _mm512_load_ps(cbuf[m]), c1 = _mm512_load_ps(cbuf[m] + 16);
                        _mm512_storeu_ps(yb + m * ldy, _mm512_permutexvar_ps(back, c0));
                        _mm512_storeu_ps(yb + m * ldy + 16, _mm512_permutexvar_ps(back, c1));
                    }
                    continue;
                }
                const int nv = N - n0 < 32 ? (int)(N - n0) : 32;
                for (int m = 0; m < M; m++) memcpy(yb + m * ldy, cbuf[m], sizeof(float) * nv);
            }
#undef KVS_FEW_TRANSPOSE
            _tile_release();
        }
        free(xb);
    }
    return failed;
}
#endif

/* From how many rows the AMX bf16 dots take the blocked path (rows >= 1 sets it, 0 restores
 * the build's default AMX_BLOCK_ROWS, -1 only asks); returns the value in force. For tests
 * and benchmarks that compare the two paths (the same bits); 0 in builds without AMX. */
int64_t kvs_w16_amx_block_rows(int64_t rows) {
#ifdef KVS_AMX
    if (rows >= 0)
        __atomic_store_n(&amx_block_rows, rows ? rows : AMX_BLOCK_ROWS, __ATOMIC_RELEASE);
    return __atomic_load_n(&amx_block_rows, __ATOMIC_ACQUIRE);
#else
    (void)rows;
    return 0;
#endif
}

#ifdef KVS_AMX
/* VNNI-packed tables (packed == 2: [N / 16][K / 2][16][2], each 16-column step of 16 weight
 * rows one 512-byte B tile, read in place) at M <= 16 rows: A = x's M rows, B = the table's
 * tiles, C = M x 16. No repack, no transpose: a step is two tile loads and two products per
 * 32 weight rows. */
static int w16_gemm_amx_vnni_few(const float *x, int64_t M, int64_t K, int64_t ldx,
                                 const uint16_t *w, int64_t N, int num_threads, float *y,
                                 int64_t ldy) {
    const int64_t K16 = K / 16, lx = K + 16, P = (K + 31) / 32;
    const int64_t ngrp = (N + 15) / 16, nblk = (ngrp + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K > 65536)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = nblk * me / nt, hi = nblk * (me + 1) / nt;
        uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(M * (lx + 32)));
        if (xb == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (xb != NULL && lo < hi) {
            for (int64_t u = 0; u < M * P; u++) x_piece(x, ldx, M, K, lx, P, 0, u, xb);
            amx_cfg cfg;
            memset(&cfg, 0, sizeof(cfg));
            cfg.palette = 1;
            cfg.rows[0] = cfg.rows[1] = (uint8_t)M; /* tmm0-1 C: M rows x 16 weight rows */
            cfg.colsb[0] = cfg.colsb[1] = 64;
            cfg.rows[4] = (uint8_t)M; /* tmm4 A: M rows of x x 16 columns */
            cfg.colsb[4] = 32;
            cfg.rows[6] = cfg.rows[7] = 8; /* tmm6-7 B: 8 column pairs x 16 weight rows */
            cfg.colsb[6] = cfg.colsb[7] = 64;
            _tile_loadconfig(&cfg);
            float cbuf[16][32] __attribute__((aligned(64)));
            const char *wend = (const char *)(w + ngrp * 16 * K);
            for (int64_t b = lo; b < hi; b++) {
                const int64_t n0 = b * 32;
                const int two_n = n0 + 16 < N;
                const uint16_t *b0 = w + 2 * b * 16 * K, *b1 = b0 + 16 * K;
                const char *pf = (const char *)(b0 + 2 * 32 * K);
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t s = 0; s < K16; s++) {
                    for (int o = 0; o < 1024; o += 64)
                        if (pf + s * 512 + o < wend) _mm_prefetch(pf + s * 512 + o, _MM_HINT_T0);
                    _tile_loadd(4, xb + 16 * s, 2 * lx);
                    _tile_loadd(6, b0 + 256 * s, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two_n) {
                        _tile_loadd(7, b1 + 256 * s, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                float *yb = y + n0;
                if (n0 + 32 <= N) {
                    _tile_stored(0, yb, 4 * ldy);
                    _tile_stored(1, yb + 16, 4 * ldy);
                    continue;
                }
                _tile_stored(0, &cbuf[0][0], 128);
                if (two_n) _tile_stored(1, &cbuf[0][16], 128);
                const int nv = (int)(N - n0);
                for (int m = 0; m < M; m++) memcpy(yb + m * ldy, cbuf[m], sizeof(float) * nv);
            }
            _tile_release();
        }
        free(xb);
    }
    return failed;
}
#endif

#ifdef KVS_AMX
/* VNNI-packed tables without the tiles (AMX turned off, or fp32 dots: a GEMM below the
 * bf16-dot threshold): plain C, every output one sum in k order of fp32 products, with x as
 * given or rounded to bf16 (bf16 = 1: the bf16-dot twin's arithmetic; the products are then
 * exact). Correct on any table the loader packed so, not fast: the engine packs this layout
 * only where every bf16-table GEMM takes the tiles (kvserve.kernels.cpu.w16_gemm). */
static int w16_gemm_vnni_plain(const float *x, int64_t M, int64_t K, int64_t ldx,
                               const uint16_t *w, int64_t N, int num_threads, float *y,
                               int64_t ldy, int bf16) {
    const int64_t ngrp = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K * M > 65536)
    {
        float *wf = malloc(sizeof(float) * 16 * (size_t)K); /* [K][16]: a group widened */
        if (wf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < ngrp; g++) {
            if (wf == NULL) continue;
            const uint16_t *t = w + g * 16 * K;
            for (int64_t k = 0; k < K; k++)
                for (int n = 0; n < 16; n++)
                    wf[k * 16 + n] = w16_scalar(t + (k / 2) * 32 + n * 2 + k % 2, 0);
            const int nv = N - g * 16 < 16 ? (int)(N - g * 16) : 16;
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * ldx;
                float acc[16] = {0};
                for (int64_t k = 0; k < K; k++) {
                    float xv = xm[k];
                    if (bf16) {
                        const uint16_t h = bf16_rne(xv);
                        xv = w16_scalar(&h, 0);
                    }
                    for (int n = 0; n < 16; n++) acc[n] += wf[k * 16 + n] * xv;
                }
                memcpy(y + m * ldy + g * 16, acc, sizeof(float) * (size_t)nv);
            }
        }
        free(wf);
    }
    return failed;
}
#endif

/* Up to how many rows the AMX bf16 dots take the few-row path (w16_gemm_amx_few; rows >= 0
 * sets it, 0: never, at most 16; -1 only asks); returns the value in force. For tests and
 * benchmarks that compare the loops (the same bits); 0 in builds without AMX. */
int64_t kvs_w16_amx_few_rows(int64_t rows) {
#ifdef KVS_AMX
    if (rows >= 0) __atomic_store_n(&amx_few_rows, rows < 16 ? rows : 16, __ATOMIC_RELEASE);
    return __atomic_load_n(&amx_few_rows, __ATOMIC_ACQUIRE);
#else
    (void)rows;
    return 0;
#endif
}

/* AMX for the bf16 dot products: request 1 turns it on where the build and the CPU have it
 * (asking Linux for the tile state once), 0 turns it off (vdpbf16ps then), -1 only asks.
 * Returns whether it is on. */
int kvs_w16_amx(int request) {
#ifdef KVS_AMX
    return kvs_amx_request(&amx_state, request, KVS_AMX_BF16_BIT);
#else
    (void)request;
    return 0;
#endif
}

/* 1 when this build has the bf16-dot path and the CPU running it has AVX512-BF16 */
int kvs_w16_bf16_dot(void) {
#if defined(KVS_BF16_DOT) && defined(KVS_SIMDE)
    return 1; /* emulated (cbuild's bf16_emu test build): any CPU runs it */
#elif defined(KVS_BF16_DOT)
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

/* columns per packed step (the vector width; the plain C path sums in 8-lane order) */
#ifdef VL
#define PK VL
#else
#define PK 8
#endif

/* the packed layout this build reads: out[0] = rows per tile (NR), out[1] = columns per
 * step (PK) */
void kvs_w16_packing(int64_t *out) {
    out[0] = NR;
    out[1] = PK;
}

/* one packed tile (NR rows, K % PK == 0) -> NR fp32 rows of K (exact), read as one stream;
 * prefetching pf elements ahead (a few tiles: the GEMM between two widenings reads no memory,
 * so a short distance would leave every tile's first lines to DRAM latency) */
static void widen_packed(const uint16_t *w, int64_t K, int kind, int64_t pf, float *out) {
    for (int64_t s = 0; s < K / PK; s++) {
        const uint16_t *src = w + s * NR * PK;
#ifdef VL
        _mm_prefetch((const char *)(src + pf), _MM_HINT_T0);
        _mm_prefetch((const char *)(src + pf) + 64, _MM_HINT_T0);
#endif
        for (int j = 0; j < NR; j++) {
            float *dst = out + (size_t)j * K + s * PK;
#ifdef VL
            const vec v = vload16(src + j * PK, kind);
            memcpy(dst, &v, sizeof(v));
#else
            for (int l = 0; l < PK; l++) dst[l] = w16_scalar(src + j * PK + l, kind);
#endif
        }
    }
}

/* 16-bit row -> fp32 (exact) */
static void widen_row(const uint16_t *w, int64_t K, int kind, int64_t pf, float *out) {
    int64_t k = 0;
#ifdef VL
    for (; k + VL <= K; k += VL) {
        _mm_prefetch((const char *)(w + k + pf), _MM_HINT_T0);
        const vec v = vload16(w + k, kind);
        memcpy(out + k, &v, sizeof(v));
    }
#endif
    for (; k < K; k++) out[k] = w16_scalar(w + k, kind);
}

/* x fp32 [M, K] (row stride ldx), w 16-bit [N, K] (row stride ldw) or, packed, this build's
 * tiles (kvs_w16_packing; ldw unused), y fp32 [M, N] (row stride ldy); bf16 weights (either
 * layout) and M >= bf16_rows > 0 take the bf16 dot products where the build and the CPU have them.
 * Returns 0, 1 when scratch memory could not be allocated (y is then incomplete), or 2 (nothing
 * done) for packed weights with K % PK != 0. */
int kvs_w16_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                 int64_t N, int64_t ldw, int kind, int num_threads, float *y, int64_t ldy,
                 int64_t bf16_rows, int packed) {
    if (packed == 1 && K % PK) return 2;
    if (packed == 2) { /* the AMX tiles' VNNI layout (builds with AMX only, bf16, K % 16 == 0) */
#ifdef KVS_AMX
        if (kind != 0 || K % 16) return 2;
        const int dots = bf16_rows > 0 && M >= bf16_rows && kvs_w16_bf16_dot();
        if (dots && __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1)
            return M <= __atomic_load_n(&amx_few_rows, __ATOMIC_ACQUIRE)
                       ? w16_gemm_amx_vnni_few(x, M, K, ldx, w, N, num_threads, y, ldy)
                       : w16_gemm_amx_blocked(x, M, K, ldx, w, N, 0, num_threads, y, ldy, 2);
        return w16_gemm_vnni_plain(x, M, K, ldx, w, N, num_threads, y, ldy, dots);
#else
        return 2;
#endif
    }
#ifdef KVS_BF16_DOT
    if (kind == 0 && bf16_rows > 0 && M >= bf16_rows && kvs_w16_bf16_dot()) {
#ifdef KVS_AMX
        if (__atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1 &&
            M <= __atomic_load_n(&amx_few_rows, __ATOMIC_ACQUIRE))
            return w16_gemm_amx_few(x, M, K, ldx, w, N, ldw, num_threads, y, ldy, packed);
        if (__atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1)
            return M >= __atomic_load_n(&amx_block_rows, __ATOMIC_ACQUIRE)
                       ? w16_gemm_amx_blocked(x, M, K, ldx, w, N, ldw, num_threads, y, ldy,
                                              packed)
                       : w16_gemm_amx(x, M, K, ldx, w, N, ldw, num_threads, y, ldy, packed);
#endif
        return w16_gemm_bf16_dot(x, M, K, ldx, w, N, ldw, num_threads, y, ldy, packed);
    }
#else
    (void)bf16_rows;
#endif
    const int64_t ntiles = (N + NR - 1) / NR;
    const int convert = M > MR;
    /* software prefetch PF_TILES weight tiles ahead: rows of a few KB are too short for the
     * hardware prefetcher to reach full bandwidth on its own */
    const int64_t pf = PF_TILES * NR * ldw;
    /* rows of x per chunk: ~256 KB of x (a multiple of MR, at least MR) */
    int64_t mb = (int64_t)(262144 / (4 * (K > 0 ? K : 1))) / MR * MR;
    if (mb < MR) mb = MR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K * (M < 4 ? M : 4) > 65536)
    {
        float *scratch = convert ? malloc(sizeof(float) * NR * (size_t)K) : NULL;
        if (convert && scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* prefill-sized M: x is walked in chunks of mb rows that stay in L2 (each weight
         * tile is widened once per chunk); without them every tile re-streamed all of x from
         * L3 (M = 2,048: ~60 GFLOP/s instead of ~115 on 2 threads). Rows never mix, so the
         * chunking changes no result. */
        for (int64_t c0 = 0; c0 < M; c0 += mb) {
            const int64_t c1 = c0 + mb < M ? c0 + mb : M;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < ntiles; t++) {
                if (convert && scratch == NULL) continue;
                const uint16_t *wr[NR];
                const float *wf[NR];
                for (int j = 0; j < NR; j++) {
                    int64_t n = t * NR + j;
                    if (n >= N) n = N - 1; /* alias the last row; its result is dropped */
                    /* packed: row j's first vector; its next ones follow NR * PK apart */
                    wr[j] = packed ? w + t * NR * K + j * PK : w + n * ldw;
                    wf[j] = scratch + (size_t)j * K;
                    if (convert && !packed)
                        widen_row(wr[j], K, kind, pf, scratch + (size_t)j * K);
                }
                if (convert && packed)
                    widen_packed(w + t * NR * K, K, kind, PF_TILES * NR * K, scratch);
                const int nr = N - t * NR < NR ? (int)(N - t * NR) : NR;
                for (int64_t m0 = c0; m0 < c1; m0 += MR) {
                    const int mr = c1 - m0 < MR ? (int)(c1 - m0) : MR;
                    const float *xr[MR];
                    for (int i = 0; i < MR; i++) xr[i] = x + (m0 + (i < mr ? i : 0)) * ldx;
                    float out[MR][NR];
                    tile_dispatch(xr, mr, wr, convert ? wf : NULL, kind, K, pf, packed, out);
                    for (int i = 0; i < mr; i++)
                        memcpy(y + (m0 + i) * ldy + t * NR, out[i], sizeof(float) * nr);
                }
            }
        }
        free(scratch);
    }
    return failed;
}

int kvs_w16_gemm_op(const int64_t *a) {
    return kvs_w16_gemm(OP_P(0), a[1], a[2], a[3], OP_P(4), a[5], a[6], (int)a[7], (int)a[8],
                        OP_P(9), a[10], a[11], (int)a[12]);
}
