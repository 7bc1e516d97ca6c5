/*
 * CPU paged attention reading BF16/FP16/FP32, FP8 (E4M3/E5M2) or INT8 KV directly.
 *
 * One query row attends tokens [0, len) of its sequence's paged K/V. Decode rows are a
 * sequence's single new token; a prefill/extend row at position p is the same thing with
 * len = p + 1 (causal), so one kernel serves both and a row's result does not depend on how
 * its sequence was chunked or batched.
 *
 * Pure-torch twin: kvserve/kernels/reference/cpu_attention.py (decode / prefill, what the
 * CPU backend runs where this kernel does not build); tests/attention/test_cpu_kernel.py
 * sweeps shapes and dtypes against it.
 *
 * Layout (see kvserve/cache/kv_cache.py):
 *   kv      [num_blocks+1, 2, bs, H, D]   (one layer; component 0 = K, 1 = V)
 *   scales  [num_blocks+1, 2, bs, H]      bf16 (FP8) / int8 log-scale codes e (INT8:
 *                                          scale = 2^(e/8), see kvserve/quant/int8.py)
 *   q       [n, H*G, D] fp32 (rows ldq floats apart),  out [n, H*G, D] fp32 (contiguous)
 *   block_tables [S, max_blocks] int64;  row_seq [n] int64 (row -> table row; NULL: row i
 *   uses table i);  lens [n] int64 tokens each row attends
 *
 * FP8 and 16-bit values are widened to fp32 with integer ops only: the payload bits are
 * placed in an fp32 word so that the fp32 value equals the true value times 2^-bias_delta
 * (subnormals included), and 2^bias_delta is folded into the per-token scale:
 *
 *   e4m3  s eeee mmm        -> fp32 bits s<<31 | (eeee mmm)<<20    value * 2^-120
 *   e5m2  s eeeee mm        -> fp32 bits s<<31 | (eeeee mm)<<21    value * 2^-112
 *   fp16  s eeeee m(10)     -> fp32 bits s<<31 | (e m)<<13         value * 2^-112
 *   bf16                    -> fp32 bits h<<16                     exact
 *   int8                    -> (float)q                            exact (scale = 2^(e/8))
 *
 * For K the scale multiplies the score (q . k), for V the probability, never the D-wide row.
 * Parallel over jobs with OpenMP: a job is a tile of rows (one decode row, or up to 16
 * consecutive prefill rows of one sequence) with all kv heads when there are >= 2 tiles per
 * thread (each block's K and V components are then read as contiguous runs), else a tile and
 * one kv head. Two implementations of a job:
 *
 *   job_avx2    (AVX2+FMA+F16C, D % 8 == 0): one pass over the blocks, online softmax.
 *               Per block of bs tokens (the next block's rows are prefetched meanwhile):
 *                 K, V tiles [bs, nh, D] widened to fp32 in L1 (the only pass over payload)
 *                 for each query (row r, kv head hh, query head j), causal length lens[r]:
 *                   scores [bs]: 8 tokens at a time, 8 accumulators over D, one
 *                   transposing reduction (no per-dot horizontal sum), times the K factors
 *                   m' = max(m, scores); acc *= exp(m - m'); p = exp(scores - m') (vector exp)
 *                   acc[D] += (p * V factors) . V   (64 floats of acc in registers at a time)
 *               A row's arithmetic does not depend on its tile, job shape or batch.
 *   job_avx512  (AVX-512F/BW builds, D % 16 == 0; used instead of job_avx2 there): the same
 *               pass on 16 lanes, head-major factors, masked tail lanes, spread prefetches.
 *   job_amx     (builds with AMX-BF16, turned on by kvs_attention_amx; D % 32 == 0, BF16 / FP8
 *               / INT8 KV): scores and P.V as AMX tile products, see its comment below.
 *   job_scalar  portable C, two passes (scores, then P.V); any D.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "vmath.h"
#include "kvs_op.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVS_AVX2 1
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E5M2 = 4, DT_I8 = 5 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Widen one D-row to fp32 "raw" values (true value = raw * factor). */
static inline void widen(const void *src, int dtype, int D, float *restrict dst) {
    uint32_t *restrict u = (uint32_t *)dst;
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int d = 0; d < D; d++) u[d] = (uint32_t)s[d] << 16;
    } else if (dtype == DT_F16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int d = 0; d < D; d++)
            u[d] = ((uint32_t)(s[d] & 0x8000u) << 16) | ((uint32_t)(s[d] & 0x7FFFu) << 13);
    } else if (dtype == DT_I8) {
        const int8_t *s = (const int8_t *)src;
        for (int d = 0; d < D; d++) dst[d] = (float)s[d];
    } else if (dtype == DT_E4M3) {
        const uint8_t *s = (const uint8_t *)src;
        for (int d = 0; d < D; d++)
            u[d] = ((uint32_t)(s[d] & 0x80u) << 24) | ((uint32_t)(s[d] & 0x7Fu) << 20);
    } else {
        const uint8_t *s = (const uint8_t *)src;
        for (int d = 0; d < D; d++)
            u[d] = ((uint32_t)(s[d] & 0x80u) << 24) | ((uint32_t)(s[d] & 0x7Fu) << 21);
    }
}

/* INT8 scale codes: scale(e) = 2^floor(e/8) * fp32(2^((e mod 8)/8)), exact; the mantissas
 * are kvserve/quant/int8.py SCALE_MANTISSAS (its SCALE_TABLE == kvs_int8_scale_table). */
static const float LOG8_MANT[8] = {0x1p+0f,         0x1.172b84p+0f, 0x1.306fe0p+0f,
                                   0x1.4bfdaep+0f,  0x1.6a09e6p+0f, 0x1.8ace54p+0f,
                                   0x1.ae89fap+0f,  0x1.d5818ep+0f};

static inline float log8_scale(int e) {
    return ldexpf(LOG8_MANT[e & 7], e >> 3); /* e >> 3 = floor(e / 8) (arithmetic shift) */
}

static float LOG8_TABLE[256]; /* index e + 128 */
static int log8_ready = 0;

static void log8_init(void) {
    if (__atomic_load_n(&log8_ready, __ATOMIC_ACQUIRE)) return;
    for (int e = -128; e < 128; e++) LOG8_TABLE[e + 128] = log8_scale(e);
    __atomic_store_n(&log8_ready, 1, __ATOMIC_RELEASE);
}

/* the 256 scales (tests compare them with the Python table) */
void kvs_int8_scale_table(float *out) {
    log8_init();
    memcpy(out, LOG8_TABLE, sizeof(LOG8_TABLE));
}

static float dtype_factor(int dtype) {
    switch (dtype) {
    case DT_E4M3: return ldexpf(1.0f, 120);
    case DT_E5M2: return ldexpf(1.0f, 112);
    case DT_F16: return ldexpf(1.0f, 112);
    default: return 1.0f;
    }
}

static int elem_size(int dtype) {
    return dtype == DT_F32 ? 4 : (dtype == DT_BF16 || dtype == DT_F16) ? 2 : 1; /* FP8, INT8 */
}

/* Everything a job needs that is the same for every job of the call. */
typedef struct {
    const uint8_t *kv;
    const uint16_t *scales; /* bf16; NULL unless FP8 */
    const int8_t *codes;    /* INT8 log-scale codes; NULL unless INT8 */
    int dtype, bs, H, G, D;
    float sm_scale, factor;
    int window; /* > 0: a row of length len attends only [len - window, len) */
    size_t row_bytes, comp_bytes, block_bytes, comp_scales;
    size_t ldq; /* floats between consecutive query rows */
} Geo;

/* First token row ``len`` attends: 0, or len - window on a sliding-window layer. */
static inline int row_lo(const Geo *g, int64_t len) {
    return g->window > 0 && len > g->window ? (int)(len - g->window) : 0;
}

/* Per-thread scratch, sized for the call (bs8 = bs rounded up to 8). */
typedef struct {
    float *kw, *vw;   /* [bs8, D] widened K / V tile */
    float *s;         /* [G, bs8] scores -> probabilities (scalar path: [G, max_len]) */
    float *acc;       /* [R*G, D] */
    float *ks, *vs;   /* [bs8] per-token K / V factors */
    float *mx, *sum;  /* [R*G] running max / denominator */
    /* AMX job only (64-byte aligned): Q^T B tiles [nh][chunks][D / 32][hi, mid, lo][16][16];
     * K / V rows of a span as bf16 [64][D]; V in VNNI pairs [2][D / 16][16][16] dwords; C / O
     * tile stores [4][16][16] fp32; P [hi, lo][2 halves][16][32] bf16; a span's K / V factors
     * [64] and K / V row pointers [2][64] */
    uint32_t *qb, *vb;
    uint16_t *kb, *vr, *pa;
    float *cs, *ob, *sk, *sv;
    const uint8_t **kp;
} Scratch;

/* ---- portable job: two passes ------------------------------------------------------------ */
static void job_scalar(const Geo *g, const float *qs, const int64_t *table, int len, int h,
                       float *os, Scratch *w) {
    const int G = g->G, D = g->D, bs = g->bs, H = g->H;
    const int lo = row_lo(g, len);
    float *scores = w->s, *row = w->kw, *acc = w->acc, *mx = w->mx, *sum = w->sum;
    for (int j = 0; j < G; j++) mx[j] = -INFINITY;
    for (int t = lo; t < len; t++) {
        int64_t blk = table[t / bs];
        int off = t % bs;
        const uint8_t *base = g->kv + blk * g->block_bytes;
        widen(base + ((size_t)off * H + h) * g->row_bytes, g->dtype, D, row);
        float ks = g->sm_scale * g->factor;
        const size_t ki = blk * 2 * g->comp_scales + (size_t)off * H + h;
        if (g->scales) ks *= bf16_to_f32(g->scales[ki]);
        else if (g->codes) ks *= LOG8_TABLE[g->codes[ki] + 128];
        for (int j = 0; j < G; j++) {
            const float *qg = qs + (int64_t)j * D;
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += qg[d] * row[d];
            dot *= ks;
            scores[(size_t)t * G + j] = dot;
            if (dot > mx[j]) mx[j] = dot;
        }
    }
    for (int j = 0; j < G; j++) sum[j] = 0.f;
    for (int t = lo; t < len; t++)
        for (int j = 0; j < G; j++) {
            float e = expf(scores[(size_t)t * G + j] - mx[j]);
            scores[(size_t)t * G + j] = e;
            sum[j] += e;
        }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int t = lo; t < len; t++) {
        int64_t blk = table[t / bs];
        int off = t % bs;
        const uint8_t *base = g->kv + blk * g->block_bytes + g->comp_bytes;
        widen(base + ((size_t)off * H + h) * g->row_bytes, g->dtype, D, row);
        float vs = g->factor;
        const size_t vi = blk * 2 * g->comp_scales + g->comp_scales + (size_t)off * H + h;
        if (g->scales) vs *= bf16_to_f32(g->scales[vi]);
        else if (g->codes) vs *= LOG8_TABLE[g->codes[vi] + 128];
        for (int j = 0; j < G; j++) {
            float p = scores[(size_t)t * G + j] * vs;
            float *ag = acc + (size_t)j * D;
            for (int d = 0; d < D; d++) ag[d] += p * row[d];
        }
    }
    for (int j = 0; j < G; j++) {
        float inv = 1.0f / sum[j];
        for (int d = 0; d < D; d++) os[(size_t)j * D + d] = acc[(size_t)j * D + d] * inv;
    }
}

#ifdef KVS_AVX2
/* ---- AVX2 job: one pass, online softmax ---------------------------------------------------- */

/* 8 payload elements -> 8 fp32 raw values; true value = raw * simd_factor(dtype).
 * 16-bit payloads use the same bit placement as widen(); FP8 goes through fp16 bits and the
 * F16C convert (see kvserve/quant/fp8.py):
 *   e4m3  sign-extend to int16, << 7, clear bit 14  -> fp16 bits of value * 2^-8
 *   e5m2  << 8                                      -> fp16 bits of value (its top byte) */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *src, const int dtype) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)src);
    if (dtype == DT_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
    if (dtype == DT_BF16 || dtype == DT_F16) {
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
        if (dtype == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16);
        __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFF)), 13);
        return _mm256_castsi256_ps(_mm256_or_si256(sign, mag));
    }
    __m128i b = _mm_loadl_epi64((const __m128i *)src);
    __m128i h = dtype == DT_E4M3
        ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xBF80))
        : _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
    return _mm256_cvtph_ps(h);
}

/* What widen8's raw values are multiplied by. */
static inline float simd_factor(int dtype) {
    return dtype == DT_E4M3 ? 256.0f : dtype == DT_F16 ? ldexpf(1.0f, 112) : 1.0f;
}

/* Widen the rows of tokens [0, nt) x heads [h0, h0 + nh) of one component into
 * dst [bs8 * nh, D] (token-major: row i * nh + hh); rows of tokens nt..bs8-1 are zeroed (their
 * scores are computed and then ignored). With nh == H the source is one contiguous run. */
static inline __attribute__((always_inline)) void widen_tile(
    const uint8_t *comp, size_t row_bytes, int H, int h0, int nh, int nt, int bs8, int D,
    const int dtype, int es, float *restrict dst) {
    for (int i = 0; i < nt; i++)
        for (int hh = 0; hh < nh; hh++) {
            const uint8_t *r = comp + ((size_t)i * H + h0 + hh) * row_bytes;
            float *o = dst + ((size_t)i * nh + hh) * D;
            for (int c = 0; c < D; c += 8)
                _mm256_storeu_ps(o + c, widen8(r + (size_t)c * es, dtype));
        }
    if (nt < bs8)
        memset(dst + (size_t)nt * nh * D, 0, sizeof(float) * (size_t)(bs8 - nt) * nh * D);
}

/* bf16 scales of tokens [0, nt) x heads [h0, h0 + nh) (rows of H in memory) -> fp32
 * ks / vs [nt * nh] token-major, times kf / vf. With nh == H one contiguous run. */
static inline void widen_scales(const uint16_t *sk, const uint16_t *sv, int H, int h0, int nh,
                                int nt, float kf, float vf, float *ks, float *vs) {
    if (nh == H) {
        const int n = nt * H;
        const __m256 kv = _mm256_set1_ps(kf), vv = _mm256_set1_ps(vf);
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sk + i)));
            __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sv + i)));
            __m256 af = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
            __m256 bf = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
            _mm256_storeu_ps(ks + i, _mm256_mul_ps(af, kv));
            _mm256_storeu_ps(vs + i, _mm256_mul_ps(bf, vv));
        }
        for (; i < n; i++) {
            ks[i] = kf * bf16_to_f32(sk[i]);
            vs[i] = vf * bf16_to_f32(sv[i]);
        }
        return;
    }
    for (int i = 0; i < nt; i++)
        for (int hh = 0; hh < nh; hh++) {
            ks[i * nh + hh] = kf * bf16_to_f32(sk[(size_t)i * H + h0 + hh]);
            vs[i * nh + hh] = vf * bf16_to_f32(sv[(size_t)i * H + h0 + hh]);
        }
}

/* INT8 log-scale codes of tokens [0, nt) x heads [h0, h0 + nh) -> fp32 ks / vs (as above). */
static inline void widen_codes(const int8_t *sk, const int8_t *sv, int H, int h0, int nh,
                               int nt, float kf, float vf, float *ks, float *vs) {
    for (int i = 0; i < nt; i++)
        for (int hh = 0; hh < nh; hh++) {
            ks[i * nh + hh] = kf * LOG8_TABLE[sk[(size_t)i * H + h0 + hh] + 128];
            vs[i * nh + hh] = vf * LOG8_TABLE[sv[(size_t)i * H + h0 + hh] + 128];
        }
}

/* R consecutive query rows of one sequence (row r attends lens[r] tokens; lens ascending by
 * one for a prefill tile, R = 1 for decode) x kv heads [h0, h0 + nh) x their G query heads:
 * the K/V tiles are widened once per block for all nh*R*G queries.
 * Query x = (hh * R + r) * G + j;  q0 / o0 point at row 0, head h0 of the tile. */
static inline __attribute__((always_inline)) void job_avx2(
    const Geo *g, const int dtype, const float *q0, size_t qstride, int R, const int64_t *lens,
    const int64_t *table, int h0, int nh, float *o0, Scratch *w) {
    const int G = g->G, D = g->D, bs = g->bs, H = g->H, es = elem_size(dtype);
    const int bs8 = (bs + 7) & ~7, RG = R * G, X = nh * RG;
    const size_t ld = (size_t)nh * D; /* floats between a head's rows of consecutive tokens */
    const float factor = simd_factor(dtype);
    float *mx = w->mx, *sum = w->sum;
    for (int x = 0; x < X; x++) { mx[x] = -INFINITY; sum[x] = 0.f; }
    memset(w->acc, 0, sizeof(float) * (size_t)X * D);
    int len = 0, lo0 = row_lo(g, lens[0]);
    for (int r = 0; r < R; r++) {
        len = lens[r] > len ? (int)lens[r] : len;
        lo0 = row_lo(g, lens[r]) < lo0 ? row_lo(g, lens[r]) : lo0;
    }
    const int nblk = (len + bs - 1) / bs;
    /* sliding window: blocks wholly before every row's window are never read */
    for (int b = lo0 / bs; b < nblk; b++) {
        const int64_t blk = table[b];
        const int nt = len - b * bs < bs ? len - b * bs : bs;
        const uint8_t *kbase = g->kv + blk * g->block_bytes;
        if (b + 1 < nblk) { /* next block's K/V rows: blocks are scattered, no HW prefetch */
            const uint8_t *nx = g->kv + table[b + 1] * g->block_bytes + (size_t)h0 * g->row_bytes;
            const size_t span = (size_t)nh * g->row_bytes, step = (size_t)H * g->row_bytes;
            for (int i = 0; i < bs; i++)
                for (size_t o = 0; o < span; o += 64) {
                    _mm_prefetch((const char *)(nx + i * step + o), _MM_HINT_T0);
                    _mm_prefetch((const char *)(nx + g->comp_bytes + i * step + o), _MM_HINT_T0);
                }
        }
        widen_tile(kbase, g->row_bytes, H, h0, nh, nt, bs8, D, dtype, es, w->kw);
        widen_tile(kbase + g->comp_bytes, g->row_bytes, H, h0, nh, nt, bs8, D, dtype, es,
                   w->vw);
        /* per-token factors, token-major [i * nh + hh]: K folds in sm_scale */
        const float kf = g->sm_scale * factor;
        if (dtype == DT_I8 && g->codes) {
            const int8_t *sc = g->codes + blk * 2 * g->comp_scales;
            widen_codes(sc, sc + g->comp_scales, H, h0, nh, nt, kf, factor, w->ks, w->vs);
        } else if (dtype != DT_I8 && g->scales) {
            const uint16_t *sc = g->scales + blk * 2 * g->comp_scales;
            widen_scales(sc, sc + g->comp_scales, H, h0, nh, nt, kf, factor, w->ks, w->vs);
        } else {
            for (int i = 0; i < nt * nh; i++) {
                w->ks[i] = kf;
                w->vs[i] = factor;
            }
        }
        for (int x = 0; x < X; x++) {
            const int hh = x / RG, r = (x / G) % R, j = x % G;
            /* tokens of this block the row may see (causal): [0, ntr) */
            const int ntr = (int)lens[r] - b * bs < nt ? (int)lens[r] - b * bs : nt;
            /* ... and not before its window: tokens [lo, ntr) of the block */
            const int lo = row_lo(g, lens[r]) - b * bs;
            if (ntr <= 0 || lo >= ntr) continue;
            const float *qg = q0 + (size_t)r * g->ldq + ((size_t)hh * G + j) * D;
            const float *kh = w->kw + (size_t)hh * D, *vh = w->vw + (size_t)hh * D;
            const float *ksh = w->ks + hh, *vsh = w->vs + hh; /* stride nh */
            float *sj = w->s + (size_t)x * bs8;
            /* scores: 8 tokens at a time */
            for (int i0 = 0; i0 < ntr; i0 += 8) {
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                const float *kt = kh + (size_t)i0 * ld;
                for (int c = 0; c < D; c += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + c);
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + (size_t)u * ld + c),
                                               a[u]);
                }
                _mm256_storeu_ps(sj + i0, hsum8x8(a));
            }
            float m = mx[x];
            for (int i = 0; i < ntr; i++) {
                sj[i] = i < lo ? -INFINITY : sj[i] * ksh[(size_t)i * nh];
                if (sj[i] > m) m = sj[i];
            }
            /* online softmax: rescale what was accumulated under the old max */
            float *ax = w->acc + (size_t)x * D;
            if (m > mx[x]) {
                if (mx[x] != -INFINITY) {
                    float corr = expf(mx[x] - m);
                    sum[x] *= corr;
                    __m256 cv = _mm256_set1_ps(corr);
                    for (int c = 0; c < D; c += 8)
                        _mm256_storeu_ps(ax + c, _mm256_mul_ps(_mm256_loadu_ps(ax + c), cv));
                }
                mx[x] = m;
            }
            const __m256 mv = _mm256_set1_ps(m);
            int i = 0;
            __m256 sacc = _mm256_setzero_ps();
            for (; i + 8 <= ntr; i += 8) {
                __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + i), mv));
                sacc = _mm256_add_ps(sacc, p);
                _mm256_storeu_ps(sj + i, p);
            }
            float tail[8];
            _mm256_storeu_ps(tail, sacc);
            float ssum = tail[0] + tail[1] + tail[2] + tail[3] + tail[4] + tail[5] + tail[6] +
                         tail[7];
            for (; i < ntr; i++) {
                float p = expf(sj[i] - m);
                ssum += p;
                sj[i] = p;
            }
            sum[x] += ssum;
            for (i = 0; i < ntr; i++) sj[i] *= vsh[(size_t)i * nh];
            /* acc[x] += sum_i p_i * V_i, 64 floats of acc in registers at a time */
            int c0 = 0;
            for (; c0 + 64 <= D; c0 += 64) {
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_loadu_ps(ax + c0 + 8 * u);
                for (int t = 0; t < ntr; t++) {
                    __m256 pb = _mm256_broadcast_ss(sj + t);
                    const float *vr = vh + (size_t)t * ld + c0;
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vr + 8 * u), a[u]);
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(ax + c0 + 8 * u, a[u]);
            }
            for (; c0 < D; c0 += 8) {
                __m256 a = _mm256_loadu_ps(ax + c0);
                for (int t = 0; t < ntr; t++)
                    a = _mm256_fmadd_ps(_mm256_broadcast_ss(sj + t),
                                        _mm256_loadu_ps(vh + (size_t)t * ld + c0), a);
                _mm256_storeu_ps(ax + c0, a);
            }
        }
    }
    for (int x = 0; x < X; x++) {
        const int hh = x / RG, r = (x / G) % R, j = x % G;
        const __m256 inv = _mm256_set1_ps(1.0f / sum[x]);
        float *os = o0 + (size_t)r * qstride + ((size_t)hh * G + j) * D;
        for (int c = 0; c < D; c += 8)
            _mm256_storeu_ps(os + c,
                             _mm256_mul_ps(_mm256_loadu_ps(w->acc + (size_t)x * D + c), inv));
    }
}

/* One specialized copy per dtype (the dtype branches fold away). */
#define KVS_JOB(NAME, DT)                                                                      \
    static void NAME(const Geo *g, const float *q0, size_t qs, int R, const int64_t *lens,     \
                     const int64_t *t, int h0, int nh, float *o0, Scratch *w) {                 \
        job_avx2(g, DT, q0, qs, R, lens, t, h0, nh, o0, w);                                    \
    }
KVS_JOB(job_f32, DT_F32)
KVS_JOB(job_bf16, DT_BF16)
KVS_JOB(job_f16, DT_F16)
KVS_JOB(job_e4m3, DT_E4M3)
KVS_JOB(job_e5m2, DT_E5M2)
KVS_JOB(job_i8, DT_I8)

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVS_AVX512 1
/* ---- AVX-512 job: job_avx2's pass on 16 lanes ---------------------------------------------
 * The same one pass and online softmax; what changes besides the width:
 *   - scores 16 tokens at a time, one transposing reduction (hsum16x16) per 16 tokens;
 *   - per-token factors head-major (one vector load per 16 tokens, no strided scalar loop);
 *     masked lanes (tokens a row may not see) become -inf before the max, 0 after the exp;
 *   - the next block's prefetches are spread over the widening of this one (a burst of
 *     ~200 prefetches per block stalled the AVX2 job at long context). */

/* 16 payload elements -> 16 fp32 raw values (widen8's bit placement; true = raw * factor) */
static inline __attribute__((always_inline)) __m512 widen16(const uint8_t *src, const int dtype) {
    if (dtype == DT_F32) return _mm512_loadu_ps((const float *)src);
    if (dtype == DT_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    if (dtype == DT_BF16 || dtype == DT_F16) {
        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
        if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x8000)), 16);
        __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7FFF)), 13);
        return _mm512_castsi512_ps(_mm512_or_si512(sign, mag));
    }
    __m128i b = _mm_loadu_si128((const __m128i *)src);
    __m256i h = dtype == DT_E4M3
        ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                           _mm256_set1_epi16((short)0xBF80))
        : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    return _mm512_cvtph_ps(h);
}

/* acc[0, NV*16) += sum_{t < n} p[t] * v[t * ld + 0 .. NV*16) with acc in registers */
#define KVS_PV(NV)                                                                             \
    do {                                                                                       \
        __m512 a_[NV];                                                                         \
        for (int u = 0; u < NV; u++) a_[u] = _mm512_loadu_ps(ax + c0 + 16 * u);                \
        for (int t = 0; t < ntr; t++) {                                                        \
            const __m512 pb = _mm512_set1_ps(sj[t]);                                           \
            const float *vr = vh + (size_t)t * ld + c0;                                        \
            for (int u = 0; u < NV; u++)                                                       \
                a_[u] = _mm512_fmadd_ps(pb, _mm512_loadu_ps(vr + 16 * u), a_[u]);              \
        }                                                                                      \
        for (int u = 0; u < NV; u++) _mm512_storeu_ps(ax + c0 + 16 * u, a_[u]);                \
    } while (0)

/* Query x's scores sj[0, ntr) (scaled; lanes past ntr hold -inf; mv: their running max with
 * the old max) -> online softmax: acc and sum rescaled to the new max, sum += sum(p), and sj
 * becomes p * V factor. */
static inline __attribute__((always_inline)) void softmax_step(
    float *sj, int ntr, __m512 mv, const float *vsh, float *mxp, float *sump, float *ax,
    int D) {
    const float m = _mm512_reduce_max_ps(mv);
    if (m > *mxp) { /* rescale what was accumulated under the old max */
        if (*mxp != -INFINITY) {
            const float corr = expf(*mxp - m);
            *sump *= corr;
            const __m512 cv = _mm512_set1_ps(corr);
            for (int c = 0; c < D; c += 16)
                _mm512_storeu_ps(ax + c, _mm512_mul_ps(_mm512_loadu_ps(ax + c), cv));
        }
        *mxp = m;
    }
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sacc = _mm512_setzero_ps();
    for (int i0 = 0; i0 < ntr; i0 += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + i0), mb));
        sacc = _mm512_add_ps(sacc, p);
        _mm512_storeu_ps(sj + i0, _mm512_mul_ps(p, _mm512_loadu_ps(vsh + i0)));
    }
    *sump += _mm512_reduce_add_ps(sacc);
}

/* One block for decode rows (R == 1) with D == 64 and GG <= 4 query heads per KV head: each K
 * and V row is widened in registers and used by all GG queries of its head at once, with no
 * fp32 staging tile. Per query the arithmetic is the staging path's operation for operation
 * (the same FMA chain over D per token, the same hsum16x16 tree, the same P.V chains over the
 * tokens), so a row's result does not depend on which path ran (tested exactly). */
static inline __attribute__((always_inline)) void direct_block(
    const Geo *g, const int dtype, const int GG, const float *q0, const uint8_t *kbase,
    const uint8_t *nx, int h0, int nh, int ntr, int lo, int bs16, Scratch *w) {
    const int H = g->H, es = elem_size(dtype);
    const size_t rb = g->row_bytes;
    for (int hh = 0; hh < nh; hh++) {
        const float *ksh = w->ks + (size_t)hh * bs16, *vsh = w->vs + (size_t)hh * bs16;
        __m512 qr[4][4], mv[4];
        for (int j = 0; j < GG; j++) {
            for (int c = 0; c < 4; c++)
                qr[j][c] = _mm512_loadu_ps(q0 + ((size_t)hh * GG + j) * 64 + 16 * c);
            mv[j] = _mm512_set1_ps(w->mx[hh * GG + j]);
        }
        /* scores, 16 tokens at a time */
        for (int i0 = 0; i0 < ntr; i0 += 16) {
            __m512 part[4][16];
            const int n16 = ntr - i0 < 16 ? ntr - i0 : 16;
            for (int u = 0; u < 16; u++) {
                if (u >= n16) {
                    for (int j = 0; j < GG; j++) part[j][u] = _mm512_setzero_ps();
                    continue;
                }
                const size_t off = ((size_t)(i0 + u) * H + h0 + hh) * rb;
                if (nx)
                    for (size_t o = 0; o < rb; o += 64) {
                        _mm_prefetch((const char *)(nx + off + o), _MM_HINT_T0);
                        _mm_prefetch((const char *)(nx + g->comp_bytes + off + o), _MM_HINT_T0);
                    }
                __m512 kc[4];
                for (int c = 0; c < 4; c++)
                    kc[c] = widen16(kbase + off + (size_t)16 * c * es, dtype);
                for (int j = 0; j < GG; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int c = 0; c < 4; c++) acc = _mm512_fmadd_ps(qr[j][c], kc[c], acc);
                    part[j][u] = acc;
                }
            }
            __mmask16 live = n16 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n16) - 1u);
            if (lo > i0) live &= lo - i0 >= 16 ? 0 : (__mmask16)(0xFFFFu << (lo - i0));
            for (int j = 0; j < GG; j++) {
                const __m512 sc = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live,
                                                     hsum16x16(part[j]),
                                                     _mm512_loadu_ps(ksh + i0));
                _mm512_storeu_ps(w->s + (size_t)(hh * GG + j) * bs16 + i0, sc);
                mv[j] = _mm512_max_ps(mv[j], sc);
            }
        }
        for (int j = 0; j < GG; j++) {
            const int x = hh * GG + j;
            softmax_step(w->s + (size_t)x * bs16, ntr, mv[j], vsh, w->mx + x, w->sum + x,
                         w->acc + (size_t)x * 64, 64);
        }
        /* acc[j] += sum_t p_jt * V_t, V rows widened once for the GG queries */
        __m512 acc[4][4];
        for (int j = 0; j < GG; j++)
            for (int c = 0; c < 4; c++)
                acc[j][c] = _mm512_loadu_ps(w->acc + (size_t)(hh * GG + j) * 64 + 16 * c);
        const uint8_t *vbase = kbase + g->comp_bytes;
        for (int t = 0; t < ntr; t++) {
            const uint8_t *rv = vbase + ((size_t)t * H + h0 + hh) * rb;
            __m512 vc[4];
            for (int c = 0; c < 4; c++) vc[c] = widen16(rv + (size_t)16 * c * es, dtype);
            for (int j = 0; j < GG; j++) {
                const __m512 pb = _mm512_set1_ps(w->s[(size_t)(hh * GG + j) * bs16 + t]);
                for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(pb, vc[c], acc[j][c]);
            }
        }
        for (int j = 0; j < GG; j++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(w->acc + (size_t)(hh * GG + j) * 64 + 16 * c, acc[j][c]);
    }
}

static inline __attribute__((always_inline)) void job_avx512(
    const Geo *g, const int dtype, const float *q0, size_t qstride, int R, const int64_t *lens,
    const int64_t *table, int h0, int nh, float *o0, Scratch *w) {
    const int G = g->G, D = g->D, bs = g->bs, H = g->H, es = elem_size(dtype);
    const int bs16 = (bs + 15) & ~15, RG = R * G, X = nh * RG;
    const size_t ld = (size_t)nh * D; /* floats between a head's rows of consecutive tokens */
    const size_t rb = g->row_bytes;
    const float factor = simd_factor(dtype), kf = g->sm_scale * factor;
    float *mx = w->mx, *sum = w->sum;
    for (int x = 0; x < X; x++) { mx[x] = -INFINITY; sum[x] = 0.f; }
    memset(w->acc, 0, sizeof(float) * (size_t)X * D);
    int len = 0, lo0 = row_lo(g, lens[0]);
    for (int r = 0; r < R; r++) {
        len = lens[r] > len ? (int)lens[r] : len;
        lo0 = row_lo(g, lens[r]) < lo0 ? row_lo(g, lens[r]) : lo0;
    }
    const int nblk = (len + bs - 1) / bs;
    /* sliding window: blocks wholly before every row's window are never read */
    /* decode rows of 64-wide heads: K / V widened in registers, no staging tile */
    const int direct = R == 1 && D == 64 && G <= 4;
    for (int b = lo0 / bs; b < nblk; b++) {
        const int64_t blk = table[b];
        const int nt = len - b * bs < bs ? len - b * bs : bs;
        const uint8_t *kbase = g->kv + blk * g->block_bytes;
        const uint8_t *nx = b + 1 < nblk ? g->kv + table[b + 1] * g->block_bytes : NULL;
        /* per-token factors, head-major [hh * bs16 + i]: K folds in sm_scale */
        for (int hh = 0; hh < nh; hh++) {
            float *ks = w->ks + (size_t)hh * bs16, *vs = w->vs + (size_t)hh * bs16;
            if (dtype == DT_I8 && g->codes) {
                const int8_t *sc = g->codes + blk * 2 * g->comp_scales + h0 + hh;
                for (int i = 0; i < nt; i++) {
                    ks[i] = kf * LOG8_TABLE[sc[(size_t)i * H] + 128];
                    vs[i] = factor * LOG8_TABLE[sc[g->comp_scales + (size_t)i * H] + 128];
                }
            } else if (dtype != DT_I8 && g->scales) {
                const uint16_t *sc = g->scales + blk * 2 * g->comp_scales + h0 + hh;
                for (int i = 0; i < nt; i++) {
                    ks[i] = kf * bf16_to_f32(sc[(size_t)i * H]);
                    vs[i] = factor * bf16_to_f32(sc[g->comp_scales + (size_t)i * H]);
                }
            } else {
                for (int i = 0; i < nt; i++) { ks[i] = kf; vs[i] = factor; }
            }
            for (int i = nt; i < bs16; i++) { ks[i] = 0.f; vs[i] = 0.f; }
        }
        if (direct) {
            const int dlo = row_lo(g, lens[0]) - b * bs; /* window start in this block */
            switch (G) { /* literal GG: one specialized copy each */
            case 1: direct_block(g, dtype, 1, q0, kbase, nx, h0, nh, nt, dlo, bs16, w); break;
            case 2: direct_block(g, dtype, 2, q0, kbase, nx, h0, nh, nt, dlo, bs16, w); break;
            case 3: direct_block(g, dtype, 3, q0, kbase, nx, h0, nh, nt, dlo, bs16, w); break;
            default: direct_block(g, dtype, 4, q0, kbase, nx, h0, nh, nt, dlo, bs16, w); break;
            }
            continue;
        }
        /* K / V rows -> fp32 tiles [bs16 * nh, D]; the next block's rows are prefetched as
         * this block's are read (blocks are scattered: no hardware prefetch across them) */
        for (int i = 0; i < nt; i++)
            for (int hh = 0; hh < nh; hh++) {
                const size_t off = ((size_t)i * H + h0 + hh) * rb;
                const uint8_t *rk = kbase + off, *rv = rk + g->comp_bytes;
                if (nx)
                    for (size_t o = 0; o < rb; o += 64) {
                        _mm_prefetch((const char *)(nx + off + o), _MM_HINT_T0);
                        _mm_prefetch((const char *)(nx + g->comp_bytes + off + o), _MM_HINT_T0);
                    }
                float *ok = w->kw + ((size_t)i * nh + hh) * D;
                float *ov = w->vw + ((size_t)i * nh + hh) * D;
                for (int c = 0; c < D; c += 16) {
                    _mm512_storeu_ps(ok + c, widen16(rk + (size_t)c * es, dtype));
                    _mm512_storeu_ps(ov + c, widen16(rv + (size_t)c * es, dtype));
                }
            }
        if (nt < bs16) { /* rows past the block: finite, and masked below */
            memset(w->kw + (size_t)nt * ld, 0, sizeof(float) * (size_t)(bs16 - nt) * ld);
            memset(w->vw + (size_t)nt * ld, 0, sizeof(float) * (size_t)(bs16 - nt) * ld);
        }
        for (int x = 0; x < X; x++) {
            const int hh = x / RG, r = (x / G) % R, j = x % G;
            /* tokens of this block the row may see (causal): [0, ntr) */
            const int ntr = (int)lens[r] - b * bs < nt ? (int)lens[r] - b * bs : nt;
            /* ... and not before its window: tokens [lo, ntr) of the block */
            const int lo = row_lo(g, lens[r]) - b * bs;
            if (ntr <= 0 || lo >= ntr) continue;
            const float *qg = q0 + (size_t)r * g->ldq + ((size_t)hh * G + j) * D;
            const float *kh = w->kw + (size_t)hh * D, *vh = w->vw + (size_t)hh * D;
            const float *ksh = w->ks + (size_t)hh * bs16, *vsh = w->vs + (size_t)hh * bs16;
            float *sj = w->s + (size_t)x * bs16;
            /* scores, 16 tokens at a time; lanes past ntr -> -inf */
            __m512 mv = _mm512_set1_ps(mx[x]);
            for (int i0 = 0; i0 < ntr; i0 += 16) {
                __m512 a[16];
                for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();
                const float *kt = kh + (size_t)i0 * ld;
                for (int c = 0; c < D; c += 16) {
                    const __m512 qv = _mm512_loadu_ps(qg + c);
                    for (int u = 0; u < 16; u++)
                        a[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kt + (size_t)u * ld + c), a[u]);
                }
                const int left = ntr - i0;
                __mmask16 live = left >= 16 ? (__mmask16)0xFFFF
                                            : (__mmask16)((1u << left) - 1u);
                if (lo > i0) live &= lo - i0 >= 16 ? 0 : (__mmask16)(0xFFFFu << (lo - i0));
                const __m512 sc = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live,
                                                     hsum16x16(a), _mm512_loadu_ps(ksh + i0));
                _mm512_storeu_ps(sj + i0, sc);
                mv = _mm512_max_ps(mv, sc);
            }
            float *ax = w->acc + (size_t)x * D;
            softmax_step(sj, ntr, mv, vsh, mx + x, sum + x, ax, D);
            /* acc[x] += sum_t p_t * V_t, up to 128 floats of acc in registers at a time */
            int c0 = 0;
            for (; c0 + 128 <= D; c0 += 128) KVS_PV(8);
            for (; c0 + 64 <= D; c0 += 64) KVS_PV(4);
            for (; c0 < D; c0 += 16) KVS_PV(1);
        }
    }
    for (int x = 0; x < X; x++) {
        const int hh = x / RG, r = (x / G) % R, j = x % G;
        const __m512 inv = _mm512_set1_ps(1.0f / sum[x]);
        float *os = o0 + (size_t)r * qstride + ((size_t)hh * G + j) * D;
        for (int c = 0; c < D; c += 16)
            _mm512_storeu_ps(os + c,
                             _mm512_mul_ps(_mm512_loadu_ps(w->acc + (size_t)x * D + c), inv));
    }
}
#undef KVS_PV

#define KVS_JOB512(NAME, DT)                                                                   \
    static void NAME(const Geo *g, const float *q0, size_t qs, int R, const int64_t *lens,     \
                     const int64_t *t, int h0, int nh, float *o0, Scratch *w) {                 \
        job_avx512(g, DT, q0, qs, R, lens, t, h0, nh, o0, w);                                  \
    }
KVS_JOB512(job512_f32, DT_F32)
KVS_JOB512(job512_bf16, DT_BF16)
KVS_JOB512(job512_f16, DT_F16)
KVS_JOB512(job512_e4m3, DT_E4M3)
KVS_JOB512(job512_e5m2, DT_E5M2)
KVS_JOB512(job512_i8, DT_I8)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    !defined(KVS_SIMDE)
#define KVS_AMX 1
#include "amx.h"
/* ---- AMX-BF16 job (Sapphire Rapids and later; D % 32 == 0; BF16 KV, and INT8 / FP8 KV, whose
 * payload values are exact in bf16) ---------------------------------------------------------
 * One tile of R rows x nh kv heads as in job_avx512, but the dot products are tile products
 * (TDPBF16PS): the R*G queries of a kv head, 16 per chunk, cost about what one costs. Per span
 * of 64 tokens (at multiples of 64: the online softmax's steps) and kv head:
 *   scores  C[16 tokens][16 queries] = K . Q^T for the span's 4 chunks of 16 tokens: A = 16 K
 *           rows x 32 bf16 (read in place from the paged cache for BF16 KV with bs % 16 == 0,
 *           else the rows converted to bf16 exactly), B = Q^T in VNNI pairs, prepared once per
 *           job. Q = Qhi + Qmid + Qlo (bf16 each, every part the rest of Q rounded): three
 *           exact products per K row into the fp32 C tile, so the scores keep fp32 accuracy
 *           (with two parts, Q to 2^-17, the test caches' scores of ~1e3 were off by up to 1e-2
 *           relative after the exp).
 *   softmax per query over the span's 64 tokens (its C columns, times the K factors, masked to
 *           the tokens its row sees): m, corr = exp(m_old - m), sum = sum * corr + sum(p);
 *           P = p * V factors, split into bf16 hi + lo rows (P to 2^-17).
 *   P.V     O[16 queries][16 columns] = Phi . V + Plo . V per 32-token half, V in VNNI pairs
 *           (token rows 2i, 2i + 1 interleaved; rows past len zero); acc = acc * corr + O.
 * A query's arithmetic does not depend on its lane, its chunk, R, nh or the batch (a tile
 * product computes each C element from its own A row and B column only; masked tokens add
 * exact zeros), and every row of a (dtype, D) takes this job when it is on, decode rows
 * included: batch invariance holds as with the other jobs (its bits differ from theirs). The
 * tile configuration is loaded at the start of every job and released at its end (the GEMMs
 * in the same threads load their own). Off by default: see docs/cpu.md for what it gains
 * (verify tiles of several rows) and costs (decode rows). */
static int amx_state = -1; /* -1: not asked yet, 0: off / unavailable, 1: on */
#define AMX_SPAN 64        /* tokens per online-softmax step (4 score tiles of 16) */

static void amx_attn_config(void) {
    kvs_amx_cfg cfg;
    kvs_amx_cfg_init(&cfg);
    /* every tile 16 rows x 64 bytes. Scores: tmm0-3 C (16 tokens x 16 queries, one per
     * 16-token chunk of the span), tmm4 K A (16 tokens x 32 bf16), tmm5-7 Q^T hi / mid / lo B
     * (16 pairs x 16 queries). P.V: tmm0-3 O C (16 queries x 16 columns, 4 column groups),
     * tmm4 / tmm5 P hi / lo A (16 queries x 32 tokens), tmm6 / tmm7 V B (16 token pairs x 16
     * columns) */
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* fp32 -> bf16 hi (round to nearest even) and lo = bf16(x - hi) */
static inline __attribute__((always_inline)) void split_bf16(__m512 x, __m256i *hi,
                                                              __m256i *lo) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    *hi = h;
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf));
}

/* Token rows [t0, t0 + 64) of kv head h: K / V row pointers (NULL past len) and factors (K
 * folds in sm_scale; 0 past len). */
static inline __attribute__((always_inline)) void span_rows(
    const Geo *g, const int dtype, const int64_t *table, int t0, int len, int h, float kf,
    float factor, const uint8_t **kp, float *ks, float *vs) {
    const int bs = g->bs, H = g->H;
    int bi = t0 / bs, off = t0 % bs; /* the token's block and offset, stepped (no division) */
    for (int t = 0; t < AMX_SPAN; t++, off = off + 1 == bs ? (bi++, 0) : off + 1) {
        if (t0 + t >= len) {
            kp[t] = NULL;
            ks[t] = vs[t] = 0.f;
            continue;
        }
        const int64_t blk = table[bi];
        const size_t row = (size_t)off * H + h;
        kp[t] = g->kv + blk * g->block_bytes + row * g->row_bytes;
        if (dtype == DT_I8 && g->codes) {
            const int8_t *sc = g->codes + blk * 2 * g->comp_scales + row;
            ks[t] = kf * LOG8_TABLE[sc[0] + 128];
            vs[t] = factor * LOG8_TABLE[sc[g->comp_scales] + 128];
        } else if (dtype != DT_I8 && g->scales) {
            const uint16_t *sc = g->scales + blk * 2 * g->comp_scales + row;
            ks[t] = kf * bf16_to_f32(sc[0]);
            vs[t] = factor * bf16_to_f32(sc[g->comp_scales]);
        } else {
            ks[t] = kf;
            vs[t] = factor;
        }
    }
}

/* One payload row -> bf16 (exact for the dtypes this job takes); NULL -> zeros */
static inline __attribute__((always_inline)) void row_bf16(const uint8_t *src, int D,
                                                            const int dtype, uint16_t *dst) {
    if (src == NULL) {
        memset(dst, 0, sizeof(uint16_t) * (size_t)D);
    } else if (dtype == DT_BF16) {
        memcpy(dst, src, sizeof(uint16_t) * (size_t)D);
    } else {
        const int es = elem_size(dtype);
        for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c),
                                (__m256i)_mm512_cvtneps_pbh(widen16(src + (size_t)c * es,
                                                                    dtype)));
    }
}

static inline __attribute__((always_inline)) void job_amx(
    const Geo *g, const int dtype, const float *q0, size_t qstride, int R, const int64_t *lens,
    const int64_t *table, int h0, int nh, float *o0, Scratch *w) {
    const int G = g->G, D = g->D, bs = g->bs, RG = R * G, X = nh * RG;
    const int S = D / 32, NC = (RG + 15) / 16, NG = D / 16; /* D steps; query chunks; cols */
    const size_t rstride = (size_t)g->H * g->row_bytes;
    const float factor = simd_factor(dtype), kf = g->sm_scale * factor;
    /* K rows read in place: BF16 and whole 16-token chunks inside one block */
    const int direct = dtype == DT_BF16 && bs % 16 == 0;
    float *mx = w->mx, *sum = w->sum;
    amx_attn_config();
    for (int x = 0; x < X; x++) { mx[x] = -INFINITY; sum[x] = 0.f; }
    memset(w->acc, 0, sizeof(float) * (size_t)X * D);
    /* Q^T B tiles, per (head, query chunk, D step): hi, mid, lo [16 pairs][16 queries] */
    for (int hh = 0; hh < nh; hh++)
        for (int c = 0; c < NC; c++) {
            uint32_t *bt = w->qb + (size_t)(hh * NC + c) * S * 768;
            memset(bt, 0, sizeof(uint32_t) * (size_t)S * 768);
            for (int n = 0; n < 16 && c * 16 + n < RG; n++) {
                const int xi = c * 16 + n, r = xi / G, j = xi % G;
                const float *qg = q0 + (size_t)r * g->ldq + ((size_t)hh * G + j) * D;
                uint32_t *qp = (uint32_t *)w->kb; /* [3][D / 2] (kb is free here) */
                for (int d = 0; d < D; d += 16) {
                    __m512 x = _mm512_loadu_ps(qg + d);
                    for (int part = 0; part < 3; part++) {
                        const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
                        _mm256_storeu_si256((__m256i *)(qp + part * (D / 2) + d / 2), h);
                        x = _mm512_sub_ps(x, _mm512_castsi512_ps(
                                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
                    }
                }
                for (int s = 0; s < S; s++)
                    for (int part = 0; part < 3; part++)
                        for (int k = 0; k < 16; k++)
                            bt[s * 768 + part * 256 + k * 16 + n] =
                                qp[part * (D / 2) + s * 16 + k];
            }
        }
    int len = 0, lo0 = row_lo(g, lens[0]);
    for (int r = 0; r < R; r++) {
        len = lens[r] > len ? (int)lens[r] : len;
        lo0 = row_lo(g, lens[r]) < lo0 ? row_lo(g, lens[r]) : lo0;
    }
    /* C column n of a stored score tile: dwords n, n + 16, ... */
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i col = _mm512_slli_epi32(iota, 4);
    const uint8_t **kp = w->kp, **vp = w->kp + AMX_SPAN;
    /* spans of AMX_SPAN tokens at multiples of AMX_SPAN (the online softmax's steps) */
    for (int t0 = lo0 / AMX_SPAN * AMX_SPAN; t0 < len; t0 += AMX_SPAN) {
        const int nu = (len - t0 + 15) / 16 < 4 ? (len - t0 + 15) / 16 : 4; /* chunks in use */
        for (int hh = 0; hh < nh; hh++) {
            span_rows(g, dtype, table, t0, len, h0 + hh, kf, factor, kp, w->sk, w->sv);
            for (int t = 0; t < AMX_SPAN; t++)
                vp[t] = kp[t] ? kp[t] + g->comp_bytes : NULL;
            /* K A tiles: in place, else rows converted into kb [4][16][D] */
            const uint8_t *ka[4];
            size_t kst[4];
            for (int u = 0; u < nu; u++) {
                if (direct) {
                    ka[u] = kp[16 * u];
                    kst[u] = rstride;
                } else {
                    for (int t = 0; t < 16; t++)
                        row_bf16(kp[16 * u + t], D, dtype, w->kb + (size_t)(16 * u + t) * D);
                    ka[u] = (const uint8_t *)(w->kb + (size_t)16 * u * D);
                    kst[u] = (size_t)D * 2;
                }
            }
            /* V in VNNI pairs: vb[half][D / 16][16 pairs][16 columns]; rows past len zero.
             * (No software prefetch: every variant tried -- the next span's rows, this span's
             * K rows ahead of the tile loads -- measured slower on the Xeon of docs/cpu.md.) */
            for (int k = 0; k < AMX_SPAN / 2; k++) {
                const uint8_t *ra = vp[2 * k], *rb = vp[2 * k + 1];
                if (dtype != DT_BF16) {
                    uint16_t *cv = w->vr + (size_t)(2 * k) * D;
                    row_bf16(ra, D, dtype, cv);
                    row_bf16(rb, D, dtype, cv + D);
                    ra = ra ? (const uint8_t *)cv : NULL;
                    rb = rb ? (const uint8_t *)(cv + D) : NULL;
                }
                uint32_t *dst = w->vb + (size_t)(k / 16) * NG * 256 + (k % 16) * 16;
                for (int c = 0; c < S; c++) {
                    const __m512i a = ra ? _mm512_loadu_si512(ra + (size_t)c * 64)
                                         : _mm512_setzero_si512();
                    const __m512i bb = rb ? _mm512_loadu_si512(rb + (size_t)c * 64)
                                          : _mm512_setzero_si512();
                    /* in-lane unpacks: columns 0-3, 8-11, 16-19, 24-27 of the 32, then the rest
                     * (acc keeps that order; the output is permuted back at the end) */
                    _mm512_store_si512(dst + (size_t)(2 * c) * 256, _mm512_unpacklo_epi16(a, bb));
                    _mm512_store_si512(dst + (size_t)(2 * c + 1) * 256,
                                       _mm512_unpackhi_epi16(a, bb));
                }
            }
            for (int c = 0; c < NC; c++) {
                const uint32_t *bt = w->qb + (size_t)(hh * NC + c) * S * 768;
                const int nq = RG - c * 16 < 16 ? RG - c * 16 : 16;
                /* scores: C tile u = chunk u's 16 tokens x 16 queries */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int s = 0; s < S; s++) {
                    _tile_loadd(5, bt + s * 768, 64);
                    _tile_loadd(6, bt + s * 768 + 256, 64);
                    _tile_loadd(7, bt + s * 768 + 512, 64);
#define KVS_AMX_SCORE(U)                                                                       \
    if (U < nu) {                                                                              \
        _tile_loadd(4, ka[U] + (size_t)s * 64, kst[U]);                                        \
        _tile_dpbf16ps(U, 4, 5);                                                               \
        _tile_dpbf16ps(U, 4, 6);                                                               \
        _tile_dpbf16ps(U, 4, 7);                                                               \
    }
                    KVS_AMX_SCORE(0)
                    KVS_AMX_SCORE(1)
                    KVS_AMX_SCORE(2)
                    KVS_AMX_SCORE(3)
#undef KVS_AMX_SCORE
                }
                _tile_stored(0, w->cs, 64);
                _tile_stored(1, w->cs + 256, 64);
                _tile_stored(2, w->cs + 512, 64);
                _tile_stored(3, w->cs + 768, 64);
                float corr[16];
                unsigned live = 0;
                const float *ksh = w->sk, *vsh = w->sv;
                for (int n = 0; n < nq; n++) {
                    const int xi = c * 16 + n, r = xi / G, x = hh * RG + xi;
                    /* tokens of this span the row sees: [lo, hi) relative to t0 */
                    const int hi = (int)lens[r] - t0, lo = row_lo(g, lens[r]) - t0;
                    uint16_t *ph = w->pa + n * 32, *pl = ph + 512;
                    if (hi <= 0 || lo >= AMX_SPAN) {
                        for (int h2 = 0; h2 < 2; h2++) {
                            _mm512_storeu_si512(ph + h2 * 1024, _mm512_setzero_si512());
                            _mm512_storeu_si512(pl + h2 * 1024, _mm512_setzero_si512());
                        }
                        continue;
                    }
                    __m512 sc[4];
                    __m512 mv = _mm512_set1_ps(-INFINITY);
                    for (int u = 0; u < 4; u++) {
                        const __m512i tok = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * u));
                        const __mmask16 m16 =
                            _mm512_cmplt_epi32_mask(tok, _mm512_set1_epi32(hi)) &
                            _mm512_cmpge_epi32_mask(tok, _mm512_set1_epi32(lo));
                        sc[u] = u < nu ? _mm512_mask_mul_ps(
                                             _mm512_set1_ps(-INFINITY), m16,
                                             _mm512_i32gather_ps(
                                                 _mm512_add_epi32(col, _mm512_set1_epi32(n)),
                                                 w->cs + 256 * u, 4),
                                             _mm512_loadu_ps(ksh + 16 * u))
                                       : _mm512_set1_ps(-INFINITY);
                        mv = _mm512_max_ps(mv, sc[u]);
                    }
                    const float mo = mx[x], cm = _mm512_reduce_max_ps(mv);
                    const float m = cm > mo ? cm : mo;
                    const float cr = mo == -INFINITY ? 0.f : m > mo ? expf(mo - m) : 1.f;
                    const __m512 mb = _mm512_set1_ps(m);
                    __m512 p[4];
                    for (int u = 0; u < 4; u++) p[u] = exp16(_mm512_sub_ps(sc[u], mb));
                    sum[x] = sum[x] * cr + _mm512_reduce_add_ps(_mm512_add_ps(
                                               _mm512_add_ps(p[0], p[1]),
                                               _mm512_add_ps(p[2], p[3])));
                    mx[x] = m;
                    corr[n] = cr;
                    live |= 1u << n;
                    for (int u = 0; u < 4; u++) {
                        __m256i h16, l16;
                        split_bf16(_mm512_mul_ps(p[u], _mm512_loadu_ps(vsh + 16 * u)), &h16,
                                   &l16);
                        const size_t at = (size_t)(u / 2) * 1024 + (u % 2) * 16;
                        _mm256_storeu_si256((__m256i *)(ph + at), h16);
                        _mm256_storeu_si256((__m256i *)(pl + at), l16);
                    }
                }
                if (!live) continue;
                /* P.V: O tiles 0-3 = 4 column groups; per half of the span Phi . V + Plo . V */
                for (int g0 = 0; g0 < NG; g0 += 4) {
                    const int ng = NG - g0 < 4 ? NG - g0 : 4;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int h2 = 0; h2 < 2 && 32 * h2 < 16 * nu; h2++) {
                        _tile_loadd(4, w->pa + h2 * 1024, 64);
                        _tile_loadd(5, w->pa + 512 + h2 * 1024, 64);
                        const uint32_t *vh = w->vb + (size_t)h2 * NG * 256 + (size_t)g0 * 256;
#define KVS_AMX_PV(U, T)                                                                       \
    if (U < ng) {                                                                              \
        _tile_loadd(T, vh + U * 256, 64);                                                      \
        _tile_dpbf16ps(U, 4, T);                                                               \
        _tile_dpbf16ps(U, 5, T);                                                               \
    }
                        KVS_AMX_PV(0, 6)
                        KVS_AMX_PV(1, 7)
                        KVS_AMX_PV(2, 6)
                        KVS_AMX_PV(3, 7)
#undef KVS_AMX_PV
                    }
                    _tile_stored(0, w->ob, 64);
                    if (ng > 1) _tile_stored(1, w->ob + 256, 64);
                    if (ng > 2) _tile_stored(2, w->ob + 512, 64);
                    if (ng > 3) _tile_stored(3, w->ob + 768, 64);
                    for (int n = 0; n < nq; n++) {
                        if (!((live >> n) & 1u)) continue;
                        float *ax = w->acc + (size_t)(hh * RG + c * 16 + n) * D + g0 * 16;
                        const __m512 cv = _mm512_set1_ps(corr[n]);
                        for (int u = 0; u < ng; u++)
                            _mm512_storeu_ps(ax + 16 * u,
                                             _mm512_fmadd_ps(_mm512_loadu_ps(ax + 16 * u), cv,
                                                             _mm512_load_ps(w->ob + 256 * u +
                                                                            n * 16)));
                    }
                }
            }
        }
    }
    _tile_release();
    /* acc's 32-column groups hold columns (0-3, 8-11, 16-19, 24-27), (4-7, 12-15, ...) */
    const __m512i un0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i un1 = _mm512_add_epi32(un0, _mm512_set1_epi32(8));
    for (int x = 0; x < X; x++) {
        const int hh = x / RG, r = (x / G) % R, j = x % G;
        const __m512 inv = _mm512_set1_ps(1.0f / sum[x]);
        float *os = o0 + (size_t)r * qstride + ((size_t)hh * G + j) * D;
        const float *ax = w->acc + (size_t)x * D;
        for (int c = 0; c < D; c += 32) {
            const __m512 a = _mm512_loadu_ps(ax + c), b = _mm512_loadu_ps(ax + c + 16);
            _mm512_storeu_ps(os + c, _mm512_mul_ps(_mm512_permutex2var_ps(a, un0, b), inv));
            _mm512_storeu_ps(os + c + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(a, un1, b), inv));
        }
    }
}

#define KVS_JOBAMX(NAME, DT)                                                                   \
    static void NAME(const Geo *g, const float *q0, size_t qs, int R, const int64_t *lens,     \
                     const int64_t *t, int h0, int nh, float *o0, Scratch *w) {                 \
        job_amx(g, DT, q0, qs, R, lens, t, h0, nh, o0, w);                                     \
    }
KVS_JOBAMX(jobamx_bf16, DT_BF16)
KVS_JOBAMX(jobamx_e4m3, DT_E4M3)
KVS_JOBAMX(jobamx_e5m2, DT_E5M2)
KVS_JOBAMX(jobamx_i8, DT_I8)
#endif
#endif
#endif

typedef void (*JobFn)(const Geo *, const float *, size_t, int, const int64_t *,
                      const int64_t *, int, int, float *, Scratch *);

/* The portable job, one row and head at a time. */
static void job_rows_scalar(const Geo *g, const float *q0, size_t qs, int R, const int64_t *lens,
                            const int64_t *t, int h0, int nh, float *o0, Scratch *w) {
    for (int r = 0; r < R; r++)
        for (int hh = 0; hh < nh; hh++) {
            size_t off = (size_t)hh * g->G * g->D;
            job_scalar(g, q0 + (size_t)r * g->ldq + off, t, (int)lens[r], h0 + hh,
                       o0 + (size_t)r * qs + off, w);
        }
}

/* 2: AVX-512 job, 1: AVX2 job, 0: portable only (for tests and benchmarks). */
int kvs_attention_simd(void) {
#if defined(KVS_AVX512)
    return 2;
#elif defined(KVS_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The AMX-BF16 job (D % 32 == 0; BF16, FP8 and INT8 KV): request 1 turns it on where the build
 * and the CPU have AMX-BF16 (asking Linux for the tile state), 0 off (the AVX-512 job), -1 only
 * asks. Returns whether it is on; 0 in builds without AMX. */
int kvs_attention_amx(int request) {
#ifdef KVS_AMX
    return kvs_amx_request(&amx_state, request, KVS_AMX_BF16_BIT);
#else
    (void)request;
    return 0;
#endif
}

/* Query rows per job for prefill/extend tiles (consecutive rows of one sequence). */
#define ROW_TILE 16

void kvs_paged_attention(const void *kv, const void *scales, int dtype, const float *q,
                         int64_t ldq, const int64_t *block_tables, const int64_t *row_seq,
                         const int64_t *lens, int n, int max_blocks, int bs, int H, int G,
                         int D, float sm_scale, int num_threads, int force_scalar, float *out,
                         int window) {
    Geo g;
    g.kv = (const uint8_t *)kv;
    log8_init();
    g.scales = dtype == DT_I8 ? NULL : (const uint16_t *)scales;
    g.codes = dtype == DT_I8 ? (const int8_t *)scales : NULL;
    g.dtype = dtype;
    g.bs = bs;
    g.H = H;
    g.G = G;
    g.D = D;
    g.sm_scale = sm_scale;
    g.window = window;
    g.ldq = (size_t)ldq;
    g.factor = dtype_factor(dtype);
    g.row_bytes = (size_t)D * elem_size(dtype);
    g.comp_bytes = (size_t)bs * H * g.row_bytes;
    g.block_bytes = 2 * g.comp_bytes;
    g.comp_scales = (size_t)bs * H;
    JobFn fn = job_rows_scalar;
#ifdef KVS_AVX2
    if (!force_scalar && D % 8 == 0) {
        static const JobFn fns[] = {job_f32, job_bf16, job_f16, job_e4m3, job_e5m2, job_i8};
        fn = fns[dtype];
    }
#endif
#ifdef KVS_AVX512
    if (!force_scalar && D % 16 == 0) {
        static const JobFn fns512[] = {job512_f32, job512_bf16, job512_f16,
                                       job512_e4m3, job512_e5m2, job512_i8};
        fn = fns512[dtype];
    }
#endif
    int amx = 0;
#ifdef KVS_AMX
    if (!force_scalar && D % 32 == 0 && dtype != DT_F32 && dtype != DT_F16 &&
        __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == 1) {
        static const JobFn fnsamx[] = {NULL, jobamx_bf16, NULL, jobamx_e4m3, jobamx_e5m2,
                                       jobamx_i8};
        fn = fnsamx[dtype];
        amx = 1;
    }
#endif
    /* tiles: runs of consecutive rows of one sequence whose lens step by one, <= ROW_TILE.
     * Without row_seq (a table per row: decode rows, and the engine's speculative verify rows,
     * a sequence's table repeated per row) the AMX job also tiles rows whose lens step by one
     * where the earlier row's blocks are a prefix of the later row's table (the job reads the
     * tile's last table): its R*G queries per KV head then share the tile products. */
    int *tile_start = (int *)malloc(sizeof(int) * (size_t)(n + 1));
    int ntiles = 0, max_len = 0, max_rows = 1;
    for (int i = 0; i < n; i++) {
        max_len = lens[i] > max_len ? (int)lens[i] : max_len;
        int same = i > 0 && fn != job_rows_scalar && lens[i] == lens[i - 1] + 1 &&
                   i - tile_start[ntiles - 1] < ROW_TILE;
        if (same && row_seq)
            same = row_seq[i] == row_seq[i - 1];
        else if (same) /* blocks of row i - 1 (lens[i - 1] tokens) == row i's first ones */
            same = amx && memcmp(block_tables + (int64_t)(i - 1) * max_blocks,
                                 block_tables + (int64_t)i * max_blocks,
                                 sizeof(int64_t) * (size_t)((lens[i - 1] + bs - 1) / bs)) == 0;
        if (!same) tile_start[ntiles++] = i;
        else if (i - tile_start[ntiles - 1] + 1 > max_rows)
            max_rows = i - tile_start[ntiles - 1] + 1;
    }
    tile_start[ntiles] = n;
    /* Jobs: a tile with all kv heads (each block's K/V component read as one contiguous run)
     * when there are enough tiles to keep every thread busy, else a tile and one head. */
    const int nh = ntiles >= 2 * num_threads ? H : 1, njobs = ntiles * (H / nh);
    const int bs8 = (bs + 15) & ~15, X = nh * max_rows * G; /* rounded for both jobs */
    const size_t s_len = fn == job_rows_scalar ? (size_t)max_len * G : (size_t)X * bs8;
    const size_t qstride = (size_t)H * G * D;
    if (num_threads > njobs) num_threads = njobs > 0 ? njobs : 1;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w;
        w.kw = (float *)malloc(sizeof(float) * (size_t)bs8 * nh * D);
        w.vw = (float *)malloc(sizeof(float) * (size_t)bs8 * nh * D);
        w.s = (float *)malloc(sizeof(float) * (s_len > 0 ? s_len : 1));
        w.acc = (float *)malloc(sizeof(float) * (size_t)X * D);
        w.ks = (float *)malloc(sizeof(float) * (size_t)bs8 * nh);
        w.vs = (float *)malloc(sizeof(float) * (size_t)bs8 * nh);
        w.mx = (float *)malloc(sizeof(float) * (size_t)X);
        w.sum = (float *)malloc(sizeof(float) * (size_t)X);
        w.qb = w.vb = NULL;
        w.kb = w.vr = w.pa = NULL;
        w.cs = w.ob = w.sk = w.sv = NULL;
        w.kp = NULL;
        if (amx) { /* sizes are multiples of 64 bytes (D % 32 == 0) */
            const size_t nc = (size_t)(max_rows * G + 15) / 16;
            w.qb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * nh * nc * (D / 32) * 768);
            w.vb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * 2 * (size_t)(D / 16) * 256);
            w.kb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 64 * (size_t)D);
            w.vr = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 64 * (size_t)D);
            w.pa = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2048);
            w.cs = (float *)aligned_alloc(64, sizeof(float) * 1024);
            w.ob = (float *)aligned_alloc(64, sizeof(float) * 1024);
            w.sk = (float *)aligned_alloc(64, sizeof(float) * 64);
            w.sv = (float *)aligned_alloc(64, sizeof(float) * 64);
            w.kp = (const uint8_t **)malloc(sizeof(uint8_t *) * 128);
            memset(w.pa, 0, sizeof(uint16_t) * 2048);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < (int64_t)njobs; job++) {
            int t = (int)(job / (H / nh)), h0 = (int)(job % (H / nh)) * nh;
            int r0 = tile_start[t], R = tile_start[t + 1] - r0;
            int64_t seq = row_seq ? row_seq[r0] : r0 + R - 1; /* (the tile's last table) */
            size_t hoff = (size_t)h0 * G * D;
            fn(&g, q + (size_t)r0 * ldq + hoff, qstride, R, lens + r0,
               block_tables + seq * max_blocks, h0, nh, out + (size_t)r0 * qstride + hoff, &w);
        }
        free(w.kw);
        free(w.vw);
        free(w.s);
        free(w.acc);
        free(w.ks);
        free(w.vs);
        free(w.mx);
        free(w.sum);
        free(w.qb);
        free(w.vb);
        free(w.kb);
        free(w.vr);
        free(w.pa);
        free(w.cs);
        free(w.ob);
        free(w.sk);
        free(w.sv);
        free((void *)w.kp);
    }
    free(tile_start);
}

/* ---- FP8 quantize-on-write ------------------------------------------------------------
 * Twin: kvserve/kernels/reference/quant.py (fp8_compute_scales + fp8_quantize + torch's RNE
 * cast); bit-exact.
 * x [T, H, D] fp32; rows [T] (+ row_off: row ids into dst [R, H, D] / scales [R, H]).
 * scale = bf16_rne(clamp(amax, 1e-12, FLT_MAX) / FP8_MAX); q = rne_fp8(clamp(x / scale,
 * +-FP8_MAX)). NaN elements: ignored by amax (the compare is false), stored as 0.
 */
static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* |v| <= FP8_MAX, finite. mant_bits 3 (e4m3, bias 7) or 2 (e5m2, bias 15);
 * min_normal = 2^(1 - bias), sub_scale = 2^(bias - 1 + mant_bits) (hoisted: no libm calls). */
static inline uint8_t f32_to_fp8(float v, int mant_bits, int bias, float min_normal,
                                 float sub_scale) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &u, 4);
    uint32_t code;
    if (a < min_normal) {
        /* subnormal grid: multiples of 2^(1 - bias - mant_bits); rint = round half even
         * (a * 2^k is exact: a power-of-two scaling of a normal fp32) */
        code = (uint32_t)rintf(a * sub_scale);
    } else {
        int shift = 23 - mant_bits;
        u += ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
        code = (u >> shift) - ((uint32_t)(127 - bias) << mant_bits);
    }
    return sign | (uint8_t)code;
}

static void write_fp8(const float *x, int64_t ldx, const int64_t *rows, int64_t row_off, int T,
                      int H, int D, int dtype, uint8_t *dst, uint16_t *scales,
                      const uint16_t *static_scales) {
    const int mant = dtype == DT_E4M3 ? 3 : 2;
    const int bias = dtype == DT_E4M3 ? 7 : 15;
    const float fmax = dtype == DT_E4M3 ? 448.0f : 57344.0f;
    const float min_normal = ldexpf(1.0f, 1 - bias), sub_scale = ldexpf(1.0f, bias - 1 + mant);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const float *xr = x + (size_t)t * ldx + (size_t)h * D;
            const int64_t row = rows[t] + row_off;
            uint16_t sb;
            if (static_scales) {
                sb = static_scales[h];
            } else {
                float amax = 0.f;
                for (int d = 0; d < D; d++) {
                    float a = fabsf(xr[d]);
                    amax = a > amax ? a : amax;
                }
                if (!(amax >= 1e-12f)) amax = 1e-12f;
                if (amax > FLT_MAX) amax = FLT_MAX; /* inf: the scale stays finite */
                sb = f32_to_bf16_rne(amax / fmax);
            }
            float s = bf16_to_f32(sb);
            uint8_t *out = dst + ((size_t)row * H + h) * D;
            for (int d = 0; d < D; d++) {
                float v = xr[d] / s;
                v = v > fmax ? fmax : (v < -fmax ? -fmax : (v == v ? v : 0.f)); /* NaN -> 0 */
                out[d] = f32_to_fp8(v, mant, bias, min_normal, sub_scale);
            }
            scales[(size_t)row * H + h] = sb;
        }
    }
}

/* ---- INT8 quantize-on-write (symmetric, per row, log-domain 1-byte scale) --------------
 * Twin: kvserve/kernels/reference/quant.py (int8_compute_codes + int8_quantize); bit-exact.
 * x [T, H, D] fp32; rows [T] (+ row_off: row ids into dst [R, H, D] / codes [R, H] int8).
 * e = the smallest code in [-128, 127] with 127 * scale(e) >= amax (fp32 products; 127 if
 * none); q = clamp(rint(x / scale(e)), -127, 127) (rintf rounds half to even, as torch.round).
 * NaN elements: ignored by amax, stored as 0 (a NaN -> int8 cast is undefined behaviour).
 */
static void write_int8(const float *x, int64_t ldx, const int64_t *rows, int64_t row_off, int T,
                       int H, int D, int8_t *dst, int8_t *codes) {
    log8_init();
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const float *xr = x + (size_t)t * ldx + (size_t)h * D;
            const int64_t row = rows[t] + row_off;
            float amax = 0.f;
            for (int d = 0; d < D; d++) {
                float a = fabsf(xr[d]);
                amax = a > amax ? a : amax;
            }
            /* first guess from log2, then the exact search (monotone table) */
            float g = amax > 0.f ? ceilf(8.0f * log2f(amax / 127.0f)) : -128.f;
            int e = g >= -128.f ? (g <= 127.f ? (int)g : 127) : -128; /* NaN -> -128 */
            while (e > -128 && 127.0f * LOG8_TABLE[e - 1 + 128] >= amax) e--;
            while (e < 127 && 127.0f * LOG8_TABLE[e + 128] < amax) e++;
            const float s = LOG8_TABLE[e + 128];
            int8_t *out = dst + ((size_t)row * H + h) * D;
            for (int d = 0; d < D; d++) {
                float v = rintf(xr[d] / s);
                v = v > 127.f ? 127.f : (v < -127.f ? -127.f : (v == v ? v : 0.f)); /* NaN: 0 */
                out[d] = (int8_t)v;
            }
            codes[(size_t)row * H + h] = (int8_t)e;
        }
    }
}

/* ---- 16-bit / fp32 write (no scales) ---------------------------------------------------
 * Twin: torch's x.to(dtype) (round to nearest even; NaN -> 0x7FC0) + index_copy_. */
static void write_plain(const float *x, int64_t ldx, const int64_t *rows, int64_t row_off,
                        int T, int H, int D, int dtype, void *dst) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * ldx;
        const size_t off = (size_t)(rows[t] + row_off) * H * D;
        if (dtype == DT_F32) {
            memcpy((float *)dst + off, xr, sizeof(float) * (size_t)H * D);
            continue;
        }
        uint16_t *out = (uint16_t *)dst + off;
        for (int i = 0; i < H * D; i++)
            out[i] = xr[i] == xr[i] ? f32_to_bf16_rne(xr[i]) : (uint16_t)0x7FC0;
    }
}

/* The one KV write entry: T tokens x [T, H, D] fp32 (token rows ldx floats apart, heads
 * contiguous) into rows rows[t] + row_off of dst [R, H, D] of ``dtype`` (FP32, BF16, FP8,
 * INT8; not FP16), with their scales (FP8: bf16 [R, H], dynamic or ``static_scales`` [H];
 * INT8: log-scale codes [R, H]). Returns 0, or 1 for a dtype it does not write. */
int kvs_write_kv(const float *x, int64_t ldx, const int64_t *rows, int64_t row_off, int64_t T,
                 int64_t H, int64_t D, int dtype, void *dst, void *scales,
                 const uint16_t *static_scales) {
    switch (dtype) {
    case DT_F32:
    case DT_BF16:
        write_plain(x, ldx, rows, row_off, (int)T, (int)H, (int)D, dtype, dst);
        return 0;
    case DT_E4M3:
    case DT_E5M2:
        write_fp8(x, ldx, rows, row_off, (int)T, (int)H, (int)D, dtype, (uint8_t *)dst,
                  (uint16_t *)scales, static_scales);
        return 0;
    case DT_I8:
        write_int8(x, ldx, rows, row_off, (int)T, (int)H, (int)D, (int8_t *)dst,
                   (int8_t *)scales);
        return 0;
    default:
        return 1;
    }
}

/* ---- recorded-graph adapters (kvs_op.h) ------------------------------------------------ */
int kvs_write_kv_op(const int64_t *a) {
    return kvs_write_kv(OP_P(0), a[1], OP_P(2), a[3], a[4], a[5], a[6], (int)a[7], OP_P(8),
                        OP_P(9), OP_P(10));
}

int kvs_paged_attention_op(const int64_t *a) {
    kvs_paged_attention(OP_P(0), OP_P(1), (int)a[2], OP_P(3), a[4], OP_P(5), OP_P(6), OP_P(7),
                        (int)a[8], (int)a[9], (int)a[10], (int)a[11], (int)a[12], (int)a[13],
                        OP_F(14), (int)a[15], (int)a[16], OP_P(17), (int)a[18]);
    return 0;
}
