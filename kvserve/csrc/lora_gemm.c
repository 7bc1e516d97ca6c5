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
 * first grouped by slot (a counting sort into `order`), then each used slot's adapter is
 * streamed once, whatever the number of its rows (register blocks of MR = 4 rows):
 *   shrink  tmp[t, r] = scale[s] * A[s, r] . x[t], in units of RQ = 4 ranks: a 4 ranks x
 *           4 rows block of dot products in 16 accumulators (8 loads per 16 FMAs), reduced
 *           by one transposing sum (hsum16x16 / hsum8x8, csrc/vmath.h);
 *   expand  y[t, c] += sum_r tmp[t, r] * bt[s, r, c] over c's shard's R/H ranks only (a
 *           fused q/k/v pays one shard's rank per column, not all three), each B^T line
 *           loaded once for the group's rows. Groups of many rows: units of NB = 64 columns
 *           of one shard, 4 rows x 64 columns in 16 accumulators. Groups of at most SW_ROWS
 *           rows (decode; AVX-512): units of CW = 512 columns walked along B^T's rows, 4
 *           ranks at a time, each 16 columns added into every row's y (in L1) -- 4 runs of
 *           contiguous columns the hardware prefetcher follows, where 64 columns x 16 ranks
 *           are 32 short strided pieces (SmolLM2 decode step, 4 bf16 adapters, one thread:
 *           the kernel's 120 calls 4.4-5.1 -> 3.0-3.6 ms with both loops below reworked).
 * A decode step streams every used adapter's A and B^T from memory (SmolLM2, 4 rank-16
 * adapters: 78 MB fp32, 39 MB bf16 over 30 layers), so the AVX-512 loops prefetch ahead: the
 * shrink the 4 contiguous A rows PF_UNITS units on, the expand the B^T lines PF_UNITS units (NB)
 * or 4 ranks (CW) on. Their inner loops take full vectors without masks (one masked tail), so
 * the accumulators stay in registers.
 * Threads: one parallel region per call. Each thread takes an even run of the shrink units
 * (slot-major), then of the expand units; when the used slots split evenly over the threads
 * both runs cover the same slots and no barrier is needed (4 adapters on 2 threads), else one
 * barrier parts the phases. A call of little work runs on one thread: under PAR_MACS
 * multiply-adds (m rows x (R*K + R/H*N)), which every decode-sized call is (SmolLM2, 16 rows:
 * at most 1.1M, the gate/up call). A parallel region is a point where both threads must be on
 * a core at once; on a server the event loop, the detokenizer and the clients share those cores,
 * so a descheduled thread stalls its partner at each region's join. 120 short regions a step
 * (4 a layer) cost a served mixed step more than the second thread saves (2-core Xeon, 4 rank-16
 * adapters, 16 rows: the decode forward 40.9 ms with 2 threads, 34.7 ms on one; docs/server.md).
 * Prefill-sized calls (hundreds of rows) still split over the threads. bf16 weights are
 * widened to fp32 exactly as they are read (shift), so fp32 and bf16 share every loop.
 * Rank padding of a smaller adapter (zero rows of A / bt) still costs R/H: slots share one R.
 * The decode graphs record this kernel (kvs_lora_gemm_op: T is the row count, idx a graph
 * input), so a LoRA server replays decode steps like a plain one.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "kvs_op.h"
#include "vmath.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define RQ 4  /* ranks per shrink unit */
#define MR 4  /* rows of a slot's group per register block */
#define NB 64 /* output columns per expand unit (4 AVX-512 vectors) */
#define CW 512  /* output columns per expand unit of the streaming expand (AVX-512) */
#define SW_ROWS 8 /* the most rows of a slot's group the streaming expand takes */
#define PF_UNITS 2 /* prefetch distance (AVX-512 path): A's rows / B^T's columns 2 units on */
#define PAR_MACS (INT64_C(1) << 22) /* the least multiply-adds a call splits over threads */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static inline float bf16f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* element i of an fp32 (bf = 0) or bf16 (bf = 1) weight row, widened */
static ALWAYS_INLINE float wval(const void *p, int64_t i, int bf) {
    return bf ? bf16f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
/* 16 weights from p + i, widened; the first n (<= 16) only, the rest zero */
static ALWAYS_INLINE __m512 wload16(const void *p, int64_t i, int bf, int64_t n) {
    if (!bf)
        return n >= 16 ? _mm512_loadu_ps((const float *)p + i)
                       : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), (const float *)p + i);
    if (n >= 16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
            16));
    uint16_t buf[16] = {0};
    memcpy(buf, (const uint16_t *)p + i, (size_t)n * sizeof *buf);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)buf)), 16));
}

/* 16 full weights from p + i, widened (no mask, no tail) */
static ALWAYS_INLINE __m512 wload16_full(const void *p, int64_t i, int bf) {
    if (!bf)
        return _mm512_loadu_ps((const float *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
        16));
}

/* o[r * 4 + t] = ar[r] . xr[t] (K elements) for 4 weight rows and 4 activation rows. ``pf``:
 * where to prefetch, es lines per 16 elements (the block of 4 rows PF_UNITS units on: a slot's
 * A rows are contiguous, so the next units' rows follow). Full vectors in the loop, one masked
 * tail. */
static ALWAYS_INLINE void shrink4x4(const void *const ar[RQ], int bf, const float *const xr[MR],
                                    int64_t K, const char *pf, float o[RQ * MR]) {
    __m512 acc[RQ * MR];
    for (int i = 0; i < RQ * MR; i++)
        acc[i] = _mm512_setzero_ps();
    const int64_t kf = K & ~(int64_t)15;
    int64_t k = 0;
    for (; k < kf; k += 16) {
        for (int l = 0; l < (bf ? 2 : 4); l++) /* 16 elements x 4 rows x es bytes */
            _mm_prefetch(pf + k * (bf ? 8 : 16) + 64 * l, _MM_HINT_T0);
        __m512 xv[MR];
        for (int t = 0; t < MR; t++)
            xv[t] = _mm512_loadu_ps(xr[t] + k);
        for (int r = 0; r < RQ; r++) {
            const __m512 av = wload16_full(ar[r], k, bf);
            for (int t = 0; t < MR; t++)
                acc[r * MR + t] = _mm512_fmadd_ps(av, xv[t], acc[r * MR + t]);
        }
    }
    if (k < K) {
        const int64_t n = K - k;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        __m512 xv[MR];
        for (int t = 0; t < MR; t++)
            xv[t] = _mm512_maskz_loadu_ps(m, xr[t] + k);
        for (int r = 0; r < RQ; r++) {
            const __m512 av = wload16(ar[r], k, bf, n);
            for (int t = 0; t < MR; t++)
                acc[r * MR + t] = _mm512_fmadd_ps(av, xv[t], acc[r * MR + t]);
        }
    }
    _mm512_storeu_ps(o, hsum16x16(acc));
}

/* yr[t][c] += sum_{r < rh} v[t][r] * b[r * ldb + c] for c < len (<= NB), t < rows (<= MR; the
 * pointers of rows past it repeat the last row and are not written). ``pf``: the unit to
 * prefetch (same rows, further columns). */
static ALWAYS_INLINE void expand4(float *const yr[MR], int64_t rows, const float *const v[MR],
                                  const void *b, int bf, int64_t ldb, int64_t rh, int64_t len,
                                  const char *pf) {
    __m512 acc[MR][NB / 16];
    for (int u = 0; u < NB / 16; u++)
        for (int t = 0; t < MR; t++)
            acc[t][u] = _mm512_setzero_ps();
    if (len == NB) { /* a full unit: no masks, the accumulators stay in registers */
        for (int64_t r = 0; r < rh; r++) {
            for (int l = 0; l < (bf ? 2 : 4); l++) /* this row's lines of the unit ahead */
                _mm_prefetch(pf + r * ldb * (bf ? 2 : 4) + 64 * l, _MM_HINT_T0);
            __m512 bv[NB / 16];
            for (int u = 0; u < NB / 16; u++)
                bv[u] = wload16_full(b, r * ldb + 16 * u, bf);
            for (int t = 0; t < MR; t++) {
                const __m512 vt = _mm512_set1_ps(v[t][r]);
                for (int u = 0; u < NB / 16; u++)
                    acc[t][u] = _mm512_fmadd_ps(vt, bv[u], acc[t][u]);
            }
        }
        for (int64_t t = 0; t < rows; t++)
            for (int u = 0; u < NB / 16; u++)
                _mm512_storeu_ps(yr[t] + 16 * u,
                                 _mm512_add_ps(_mm512_loadu_ps(yr[t] + 16 * u), acc[t][u]));
        return;
    }
    int64_t n[NB / 16];
    for (int u = 0; u < NB / 16; u++) {
        const int64_t left = len - 16 * u;
        n[u] = left >= 16 ? 16 : left < 0 ? 0 : left;
    }
    for (int64_t r = 0; r < rh; r++) {
        __m512 bv[NB / 16];
        for (int u = 0; u < NB / 16; u++)
            bv[u] = n[u] ? wload16(b, r * ldb + 16 * u, bf, n[u]) : _mm512_setzero_ps();
        for (int t = 0; t < MR; t++) {
            const __m512 vt = _mm512_set1_ps(v[t][r]);
            for (int u = 0; u < NB / 16; u++)
                acc[t][u] = _mm512_fmadd_ps(vt, bv[u], acc[t][u]);
        }
    }
    for (int64_t t = 0; t < rows; t++)
        for (int u = 0; u < NB / 16; u++)
            if (n[u]) {
                const __mmask16 m = (__mmask16)(n[u] >= 16 ? 0xFFFFu : (1u << n[u]) - 1u);
                _mm512_mask_storeu_ps(yr[t] + 16 * u, m,
                                      _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr[t] + 16 * u),
                                                    acc[t][u]));
            }
}

/* The expand of a slot group of few rows (decode: SW_ROWS or fewer), B^T walked along its
 * rows: y[rows, 0 .. len) += v[rows] . b over the shard's rh ranks, 4 ranks at a time -- their
 * 4 B^T rows read as contiguous runs of len (<= CW) columns, each 16 columns added into every
 * row's y (kept in L1) by 4 FMAs. A run of CW columns of 4 rows is one stream the hardware
 * prefetcher follows, where the register-blocked expand4 reads 64 columns of 16 rows at a
 * time; each B^T line is still read once (for up to SW_ROWS rows). Ranks past rh: zero
 * weight, their row pointer repeats the last rank. */
static ALWAYS_INLINE void expand_stream(float *const yr[], int64_t m, const float *const v[],
                                        const void *b, int bf, int64_t ldb, int64_t rh,
                                        int64_t len) {
    const int64_t es = bf ? 2 : 4;
    for (int64_t r0 = 0; r0 < rh; r0 += RQ) {
        const void *br[RQ];
        for (int i = 0; i < RQ; i++)
            br[i] = (const char *)b + (r0 + i < rh ? r0 + i : rh - 1) * ldb * es;
        const char *pf = (const char *)b + (r0 + RQ) * ldb * es; /* the next 4 ranks' rows */
        const int pre = r0 + RQ < rh;
        for (int64_t j = 0; j < m; j += MR) {
            const int64_t mr = m - j < MR ? m - j : MR;
            __m512 vt[MR][RQ];
            for (int t = 0; t < MR; t++)
                for (int i = 0; i < RQ; i++)
                    vt[t][i] = _mm512_set1_ps(t < mr && r0 + i < rh ? v[j + t][r0 + i] : 0.0f);
            int64_t c = 0;
            for (; c + 16 <= len; c += 16) {
                if (pre && j == 0 && (c * es) % 64 == 0)
                    for (int i = 0; i < RQ; i++)
                        _mm_prefetch(pf + (i * ldb + c) * es, _MM_HINT_T0);
                __m512 bv[RQ];
                for (int i = 0; i < RQ; i++)
                    bv[i] = wload16_full(br[i], c, bf);
                for (int t = 0; t < MR; t++)
                    if (t < mr) {
                        __m512 acc = _mm512_loadu_ps(yr[j + t] + c);
                        for (int i = 0; i < RQ; i++)
                            acc = _mm512_fmadd_ps(vt[t][i], bv[i], acc);
                        _mm512_storeu_ps(yr[j + t] + c, acc);
                    }
            }
            if (c < len) {
                const int64_t n = len - c;
                const __mmask16 k = (__mmask16)((1u << n) - 1u);
                __m512 bv[RQ];
                for (int i = 0; i < RQ; i++)
                    bv[i] = wload16(br[i], c, bf, n);
                for (int t = 0; t < MR; t++)
                    if (t < mr) {
                        __m512 acc = _mm512_maskz_loadu_ps(k, yr[j + t] + c);
                        for (int i = 0; i < RQ; i++)
                            acc = _mm512_fmadd_ps(vt[t][i], bv[i], acc);
                        _mm512_mask_storeu_ps(yr[j + t] + c, k, acc);
                    }
            }
        }
    }
}
#else
static ALWAYS_INLINE void shrink4x4(const void *const ar[RQ], int bf, const float *const xr[MR],
                                    int64_t K, const char *pf, float o[RQ * MR]) {
    (void)pf;
    int64_t k = 0;
    for (int i = 0; i < RQ * MR; i++)
        o[i] = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    /* two ranks x 4 rows at a time: 8 accumulators (AVX2 has 16 registers) */
    const int64_t kv = K & ~(int64_t)7;
    for (int half = 0; half < 2; half++) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_setzero_ps();
        for (k = 0; k < kv; k += 8) {
            __m256 xv[MR];
            for (int t = 0; t < MR; t++)
                xv[t] = _mm256_loadu_ps(xr[t] + k);
            for (int r = 0; r < 2; r++) {
                const void *p = ar[2 * half + r];
                const __m256 av = bf ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                           _mm_loadu_si128((const __m128i *)((const uint16_t *)p +
                                                                             k))), 16))
                                     : _mm256_loadu_ps((const float *)p + k);
                for (int t = 0; t < MR; t++)
                    acc[r * MR + t] = _mm256_fmadd_ps(av, xv[t], acc[r * MR + t]);
            }
        }
        float s[8];
        _mm256_storeu_ps(s, hsum8x8(acc));
        memcpy(o + 8 * half, s, sizeof s);
    }
#endif
    for (; k < K; k++)
        for (int r = 0; r < RQ; r++) {
            const float av = wval(ar[r], k, bf);
            for (int t = 0; t < MR; t++)
                o[r * MR + t] += av * xr[t][k];
        }
}

static ALWAYS_INLINE void expand4(float *const yr[MR], int64_t rows, const float *const v[MR],
                                  const void *b, int bf, int64_t ldb, int64_t rh, int64_t len,
                                  const char *pf) {
    (void)pf;
    for (int64_t t = 0; t < rows; t++) {
        float acc[NB];
        for (int64_t c = 0; c < len; c++)
            acc[c] = 0.0f;
        for (int64_t r = 0; r < rh; r++) {
            const float vr = v[t][r];
            if (bf) {
                const uint16_t *br = (const uint16_t *)b + r * ldb;
                for (int64_t c = 0; c < len; c++)
                    acc[c] += vr * bf16f(br[c]);
            } else {
                const float *br = (const float *)b + r * ldb;
                for (int64_t c = 0; c < len; c++)
                    acc[c] += vr * br[c];
            }
        }
        for (int64_t c = 0; c < len; c++)
            yr[t][c] += acc[c];
    }
}
#endif

/* tmp[t, r0 + i] = sc * A[s, r0 + i] . x[t] for i < RQ (ranks < R) and the group's rows */
static ALWAYS_INLINE void shrink_unit(const char *as, int bf, int64_t es, const float *x,
                                      int64_t K, int64_t R, int64_t r0, const int64_t *rows,
                                      int64_t m, float sc, float *tmp) {
    const int64_t nr = R - r0 < RQ ? R - r0 : RQ;
    const void *ar[RQ];
    for (int64_t i = 0; i < RQ; i++)
        ar[i] = as + (r0 + (i < nr ? i : nr - 1)) * K * es;
    for (int64_t j = 0; j < m; j += MR) {
        const int64_t mr = m - j < MR ? m - j : MR;
        const float *xr[MR];
        for (int64_t t = 0; t < MR; t++)
            xr[t] = x + rows[j + (t < mr ? t : mr - 1)] * K;
        float o[RQ * MR];
        shrink4x4(ar, bf, xr, K, (const char *)ar[0] + PF_UNITS * RQ * K * es, o);
        for (int64_t i = 0; i < nr; i++)
            for (int64_t t = 0; t < mr; t++)
                tmp[rows[j + t] * R + r0 + i] = sc * o[i * MR + t];
    }
}

/* y[t, c0 .. c0 + len) += tmp[t, shard h's ranks] . bt[s, those ranks, c0 ..] for the rows */
static ALWAYS_INLINE void expand_unit(const char *bs, int bf, int64_t es, int64_t N, int64_t R,
                                      int64_t rh, int64_t h, int64_t c0, int64_t len,
                                      const int64_t *rows, int64_t m, const float *tmp,
                                      float *y) {
    const char *b = bs + (h * rh * N + c0) * es;
#if defined(__AVX512F__)
    if (m <= SW_ROWS) {
        float *yr[SW_ROWS];
        const float *v[SW_ROWS];
        for (int64_t t = 0; t < m; t++) {
            yr[t] = y + rows[t] * N + c0;
            v[t] = tmp + rows[t] * R + h * rh;
        }
        expand_stream(yr, m, v, b, bf, N, rh, len);
        return;
    }
#endif
    for (int64_t j = 0; j < m; j += MR) {
        const int64_t mr = m - j < MR ? m - j : MR;
        float *yr[MR];
        const float *v[MR];
        for (int64_t t = 0; t < MR; t++) {
            const int64_t row = rows[j + (t < mr ? t : mr - 1)];
            yr[t] = y + row * N + c0;
            v[t] = tmp + row * R + h * rh;
        }
        expand4(yr, mr, v, b, bf, N, rh, len, (const char *)b + PF_UNITS * NB * es);
    }
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
int64_t kvs_lora_gemm(const void *restrict a, const void *restrict bt, int64_t wbf16,
                      const float *restrict x, const int64_t *restrict idx,
                      const float *restrict scale, const int64_t *restrict noff, int64_t T,
                      int64_t K, int64_t N, int64_t R, int64_t S, int64_t H, int num_threads,
                      float *restrict tmp, int64_t *restrict order, float *restrict y) {
    if (H < 1 || R % H != 0 || noff[0] != 0 || noff[H] != N)
        return -1;
    for (int64_t h = 0; h < H; h++)
        if (noff[h + 1] < noff[h])
            return -1;
    const int64_t rh = R / H, es = wbf16 ? 2 : 4;
    const int bf = wbf16 != 0;
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
    /* the used slots; the expand units of one slot: (shard, first column) of W-column runs,
     * W = CW when every group takes the streaming expand (AVX-512, SW_ROWS rows or fewer) */
    int64_t act[S], na = 0, most = 0;
    for (int64_t s = 0; s < S; s++)
        if (start[s + 1] > start[s]) {
            act[na++] = s;
            most = start[s + 1] - start[s] > most ? start[s + 1] - start[s] : most;
        }
#if defined(__AVX512F__)
    const int64_t W = most <= SW_ROWS ? CW : NB;
#else
    const int64_t W = NB;
    (void)most;
#endif
    int64_t nc = 0;
    for (int64_t h = 0; h < H; h++)
        nc += (noff[h + 1] - noff[h] + W - 1) / W;
    int64_t ch_h[nc + 1], ch_c[nc + 1];
    nc = 0;
    for (int64_t h = 0; h < H; h++)
        for (int64_t c = noff[h]; c < noff[h + 1]; c += W) {
            ch_h[nc] = h;
            ch_c[nc++] = c;
        }
    const int64_t nq = (R + RQ - 1) / RQ, u1 = na * nq, u2 = na * nc;
    const int nt = num_threads > 1 && m * (R * K + rh * N) >= PAR_MACS ? num_threads : 1;
    const char *a8 = (const char *)a, *b8 = (const char *)bt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
        for (int64_t u = u1 * id / n; u < u1 * (id + 1) / n; u++) {
            const int64_t s = act[u / nq];
            const char *as = a8 + s * R * K * es;
            if (bf)
                shrink_unit(as, 1, es, x, K, R, (u % nq) * RQ, order + start[s],
                            start[s + 1] - start[s], scale[s], tmp);
            else
                shrink_unit(as, 0, es, x, K, R, (u % nq) * RQ, order + start[s],
                            start[s + 1] - start[s], scale[s], tmp);
        }
        if (na % n != 0) { /* the runs of the two phases cover different slots */
#pragma omp barrier
        }
        for (int64_t u = u2 * id / n; u < u2 * (id + 1) / n; u++) {
            const int64_t s = act[u / nc], c = u % nc, h = ch_h[c], c0 = ch_c[c];
            const int64_t len = noff[h + 1] - c0 < W ? noff[h + 1] - c0 : W;
            const char *bs = b8 + s * R * N * es;
            if (bf)
                expand_unit(bs, 1, es, N, R, rh, h, c0, len, order + start[s],
                            start[s + 1] - start[s], tmp, y);
            else
                expand_unit(bs, 0, es, N, R, rh, h, c0, len, order + start[s],
                            start[s + 1] - start[s], tmp, y);
        }
    }
    return m;
}

int kvs_lora_gemm_op(const int64_t *a) {
    return kvs_lora_gemm(OP_P(0), OP_P(1), a[2], OP_P(3), OP_P(4), OP_P(5), OP_P(6), a[7], a[8],
                         a[9], a[10], a[11], a[12], (int)a[13], OP_P(14), OP_P(15),
                         OP_P(16)) < 0;
}
