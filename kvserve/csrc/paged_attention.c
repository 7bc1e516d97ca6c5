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
    /* tiles: runs of consecutive rows of one sequence whose lens step by one, <= ROW_TILE */
    int *tile_start = (int *)malloc(sizeof(int) * (size_t)(n + 1));
    int ntiles = 0, max_len = 0, max_rows = 1;
    for (int i = 0; i < n; i++) {
        max_len = lens[i] > max_len ? (int)lens[i] : max_len;
        int same = i > 0 && fn != job_rows_scalar && row_seq && row_seq[i] == row_seq[i - 1] &&
                   lens[i] == lens[i - 1] + 1 && i - tile_start[ntiles - 1] < ROW_TILE;
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
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < (int64_t)njobs; job++) {
            int t = (int)(job / (H / nh)), h0 = (int)(job % (H / nh)) * nh;
            int r0 = tile_start[t], R = tile_start[t + 1] - r0;
            int64_t seq = row_seq ? row_seq[r0] : r0;
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
