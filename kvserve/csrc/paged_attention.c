/*
 * CPU paged decode attention reading BF16/FP16/FP32 or FP8 (E4M3/E5M2) KV directly.
 *
 * Pure-torch twin: kvserve/attention/torch_backend.py (TorchAttentionBackend._decode); the
 * test tests/attention/test_cpu_kernel.py sweeps shapes and dtypes against it.
 *
 * Layout (see kvserve/cache/kv_cache.py):
 *   kv      [num_blocks+1, 2, bs, H, D]   (one layer; component 0 = K, 1 = V)
 *   scales  [num_blocks+1, 2, bs, H]      bf16 (FP8 only)
 *   q       [n, H*G, D] fp32,  out [n, H*G, D] fp32,  block_tables [n, max_blocks] int64
 *
 * FP8 and 16-bit values are widened to fp32 with integer ops only: the payload bits are
 * placed in an fp32 word so that the fp32 value equals the true value times 2^-bias_delta
 * (subnormals included), and 2^bias_delta is folded into the per-token scale:
 *
 *   e4m3  s eeee mmm        -> fp32 bits s<<31 | (eeee mmm)<<20    value * 2^-120
 *   e5m2  s eeeee mm        -> fp32 bits s<<31 | (eeeee mm)<<21    value * 2^-112
 *   fp16  s eeeee m(10)     -> fp32 bits s<<31 | (e m)<<13         value * 2^-112
 *   bf16                    -> fp32 bits h<<16                     exact
 *
 * For K the scale multiplies the score (q . k), for V the probability, never the D-wide row.
 * Parallel over (sequence, kv head) with OpenMP; two passes per pair (scores, then P.V).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E5M2 = 4 };

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

static float dtype_factor(int dtype) {
    switch (dtype) {
    case DT_E4M3: return ldexpf(1.0f, 120);
    case DT_E5M2: return ldexpf(1.0f, 112);
    case DT_F16: return ldexpf(1.0f, 112);
    default: return 1.0f;
    }
}

static int elem_size(int dtype) {
    return dtype == DT_F32 ? 4 : (dtype == DT_BF16 || dtype == DT_F16) ? 2 : 1;
}

void kvs_paged_decode(const void *kv, const uint16_t *scales, int dtype, const float *q,
                      const int64_t *block_tables, const int64_t *seq_lens, int n,
                      int max_blocks, int bs, int H, int G, int D, float sm_scale,
                      int num_threads, float *out) {
    const int es = elem_size(dtype);
    const float factor = dtype_factor(dtype);
    const size_t row_bytes = (size_t)D * es;
    const size_t comp_bytes = (size_t)bs * H * row_bytes;  /* one component of one block */
    const size_t block_bytes = 2 * comp_bytes;
    const size_t comp_scales = (size_t)bs * H;
    int max_len = max_blocks * bs;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)max_len * G);
        float *row = (float *)aligned_alloc(64, sizeof(float) * (size_t)((D + 15) / 16 * 16));
        float *acc = (float *)malloc(sizeof(float) * (size_t)G * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < (int64_t)n * H; job++) {
            int s = (int)(job / H), h = (int)(job % H);
            int len = (int)seq_lens[s];
            const int64_t *table = block_tables + (int64_t)s * max_blocks;
            const float *qs = q + ((int64_t)s * H * G + (int64_t)h * G) * D;
            float mx[64];
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;
            /* pass 1: scores */
            for (int t = 0; t < len; t++) {
                int64_t blk = table[t / bs];
                int off = t % bs;
                const uint8_t *base = (const uint8_t *)kv + blk * block_bytes;
                widen(base + ((size_t)off * H + h) * row_bytes, dtype, D, row);
                float ks = sm_scale * factor;
                if (scales) ks *= bf16_to_f32(scales[blk * 2 * comp_scales + (size_t)off * H + h]);
                for (int g = 0; g < G; g++) {
                    const float *qg = qs + (int64_t)g * D;
                    float dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qg[d] * row[d];
                    dot *= ks;
                    scores[(size_t)t * G + g] = dot;
                    if (dot > mx[g]) mx[g] = dot;
                }
            }
            float sum[64];
            for (int g = 0; g < G; g++) sum[g] = 0.f;
            for (int t = 0; t < len; t++)
                for (int g = 0; g < G; g++) {
                    float e = expf(scores[(size_t)t * G + g] - mx[g]);
                    scores[(size_t)t * G + g] = e;
                    sum[g] += e;
                }
            memset(acc, 0, sizeof(float) * (size_t)G * D);
            /* pass 2: P.V */
            for (int t = 0; t < len; t++) {
                int64_t blk = table[t / bs];
                int off = t % bs;
                const uint8_t *base = (const uint8_t *)kv + blk * block_bytes + comp_bytes;
                widen(base + ((size_t)off * H + h) * row_bytes, dtype, D, row);
                float vs = factor;
                if (scales)
                    vs *= bf16_to_f32(scales[blk * 2 * comp_scales + comp_scales +
                                             (size_t)off * H + h]);
                for (int g = 0; g < G; g++) {
                    float p = scores[(size_t)t * G + g] * vs;
                    float *ag = acc + (size_t)g * D;
                    for (int d = 0; d < D; d++) ag[d] += p * row[d];
                }
            }
            float *os = out + ((int64_t)s * H * G + (int64_t)h * G) * D;
            for (int g = 0; g < G; g++) {
                float inv = 1.0f / sum[g];
                for (int d = 0; d < D; d++) os[(size_t)g * D + d] = acc[(size_t)g * D + d] * inv;
            }
        }
        free(scores);
        free(row);
        free(acc);
    }
}

/* ---- FP8 quantize-on-write ------------------------------------------------------------
 * Twin: kvserve/quant/fp8.py (compute_scales + quantize + torch's RNE cast); bit-exact.
 * x [T, H, D] fp32; rows [T] (row ids into dst [R, H, D] / scales [R, H]).
 * scale = bf16_rne(max(amax, 1e-12) / FP8_MAX); q = rne_fp8(clamp(x / scale, +-FP8_MAX)).
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

void kvs_write_fp8(const float *x, const int64_t *rows, int T, int H, int D, int dtype,
                   uint8_t *dst, uint16_t *scales, const uint16_t *static_scales) {
    const int mant = dtype == DT_E4M3 ? 3 : 2;
    const int bias = dtype == DT_E4M3 ? 7 : 15;
    const float fmax = dtype == DT_E4M3 ? 448.0f : 57344.0f;
    const float min_normal = ldexpf(1.0f, 1 - bias), sub_scale = ldexpf(1.0f, bias - 1 + mant);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const float *xr = x + ((size_t)t * H + h) * D;
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
                sb = f32_to_bf16_rne(amax / fmax);
            }
            float s = bf16_to_f32(sb);
            uint8_t *out = dst + ((size_t)rows[t] * H + h) * D;
            for (int d = 0; d < D; d++) {
                float v = xr[d] / s;
                v = v > fmax ? fmax : (v < -fmax ? -fmax : v);
                out[d] = f32_to_fp8(v, mant, bias, min_normal, sub_scale);
            }
            scales[(size_t)rows[t] * H + h] = sb;
        }
    }
}
