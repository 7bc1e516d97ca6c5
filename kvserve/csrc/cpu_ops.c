/*
 * Small fused ops of a decoder layer on CPU (fp32), one call each where torch takes several:
 *
 *   kvs_rope_qk       rotary embedding of q and k, in place in the fused qkv projection's output
 *                     (twin: kvserve.layers.rotary.RotaryEmbedding's torch path)
 *   kvs_silu_mul      silu(gate) * up from the fused gate_up output (twin: F.silu(g) * u)
 *   kvs_add_rms_norm  residual += x; out = residual / rms(residual) * w
 *                     (twin: kvserve.layers.norm.RMSNorm on x + residual)
 *   kvs_gather_rows   embedding lookup: table rows (fp32 / bf16 / fp16, row-major or in the
 *                     16-bit GEMM's packed tiles) widened to fp32
 *                     (twin: kvserve.quant.w16.table_rows(table, ids).float())
 *   kvs_gather_q8     embedding lookup in a GGUF Q8_0 table, dequantized to fp32
 *                     (twin: kvserve.layers.q8_embedding.Q8Embedding's torch path)
 *   kvs_rotate_heads  every head of every row times the KV rotation R (or R^T) of the
 *                     rotated 8-bit KV modes (twin: kvserve.kernels.reference.rotate_heads)
 *   kvs_gelu_tanh_mul gelu_tanh(gate) * up from the fused gate_up output (Gemma's GeGLU;
 *                     twin: F.gelu(g, approximate="tanh") * u)
 *   kvs_head_rms_norm per-head RMSNorm in place in the fused qkv output (q / k norms; twin:
 *                     kvserve.layers.norm.RMSNorm over [T, H, D])
 *   kvs_scale         x *= s in place (Gemma's sqrt(hidden) embedding scale; twin: x * s)
 *   kvs_concat_cols   up to 4 row-major parts side by side (a GGUF fused module whose shards
 *                     differ in type; twin: torch.cat(parts, dim=-1))
 *
 * Rows are independent (batch invariant): each row runs the same instructions whatever the
 * number of rows. Tests: tests/layers/test_cpu_ops.py (against the twins, native and portable
 * builds).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "vmath.h"
#include "half.h"
#include "kvs_op.h"

/*
 * x fp32 rows of `stride` floats; in each row heads 0 .. nheads-1 (each D floats, contiguous
 * from the row start) are rotated over their first rd dims at position pos[t]; cos / sin fp32
 * [max_pos, rd/2]. Neox (rotate-half): pairs (i, i + rd/2); interleaved: pairs (2i, 2i + 1).
 */
void kvs_rope_qk(float *x, int64_t T, int64_t stride, int64_t nheads, int64_t D, int64_t rd,
                 const int64_t *pos, const float *cos_t, const float *sin_t, int interleaved,
                 int num_threads) {
    const int64_t half = rd / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * nheads > 256)
    for (int64_t i = 0; i < T * nheads; i++) {
        const int64_t t = i / nheads, h = i % nheads;
        float *v = x + t * stride + h * D;
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        if (interleaved) {
            for (int64_t j = 0; j < half; j++) {
                const float a = v[2 * j], b = v[2 * j + 1];
                v[2 * j] = a * c[j] - b * s[j];
                v[2 * j + 1] = b * c[j] + a * s[j];
            }
        } else {
            for (int64_t j = 0; j < half; j++) {
                const float a = v[j], b = v[j + half];
                v[j] = a * c[j] - b * s[j];
                v[j + half] = b * c[j] + a * s[j];
            }
        }
    }
}

/* gu fp32 [T, 2I] (gate | up) -> out fp32 [T, I] = silu(gate) * up. */
void kvs_silu_mul(const float *gu, int64_t T, int64_t I, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* silu(g) = g * sigmoid(g); sigmoid from e = exp(-|g|) <= 1 (never overflows) */
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_or_ps(gv, sign)); /* exp(-|g|) */
            const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), neg);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* gu fp32 [T, 2I] (gate | up) -> out fp32 [T, I] = gelu_tanh(gate) * up, with
 * gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3). */
void kvs_gelu_tanh_mul(const float *gu, int64_t T, int64_t I, float *out, int num_threads) {
    const float c0 = 0.7978845608028654f, c1 = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* sigmoid(2z) from e = exp(-|2z|) <= 1 (never overflows), as kvs_silu_mul */
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        const __m256 k0 = _mm256_set1_ps(2.0f * c0), k1 = _mm256_set1_ps(c1);
        for (; j + 8 <= I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 g2 = _mm256_mul_ps(gv, gv);
            const __m256 z2 = _mm256_mul_ps(_mm256_mul_ps(k0, gv),
                                            _mm256_fmadd_ps(k1, g2, one)); /* 2z */
            const __m256 e = exp8(_mm256_or_ps(z2, sign)); /* exp(-|2z|) */
            const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 neg = _mm256_cmp_ps(z2, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), neg);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < I; j++) {
            const float z2 = 2.0f * c0 * g[j] * (1.0f + c1 * g[j] * g[j]);
            const float e = expf(-fabsf(z2)), r = 1.0f / (1.0f + e);
            o[j] = g[j] * (z2 < 0.0f ? e * r : r) * u[j];
        }
    }
}

/* x fp32 rows of `stride` floats; heads 0 .. nheads-1 of each row (D floats each, contiguous
 * from x) become head * rsqrt(mean(head^2) + eps) * w, in place. */
void kvs_head_rms_norm(float *x, int64_t T, int64_t stride, int64_t nheads, int64_t D,
                       const float *w, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * nheads * D > 65536)
    for (int64_t i = 0; i < T * nheads; i++) {
        float *v = x + (i / nheads) * stride + (i % nheads) * D;
        float ss = 0.0f;
        for (int64_t j = 0; j < D; j++) ss += v[j] * v[j];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t j = 0; j < D; j++) v[j] = v[j] * inv * w[j];
    }
}

/* x fp32 [T, D] (rows contiguous) *= s, in place. */
void kvs_scale(float *x, int64_t T, int64_t D, float s) {
    for (int64_t i = 0; i < T * D; i++) x[i] *= s;
}

/* residual fp32 [T, D] += x [T, D]; out [T, D] = residual * rsqrt(mean(residual^2) + eps) * w.
 * x == NULL: no add (the first layer's norm). out may alias x. */
void kvs_add_rms_norm(const float *x, float *residual, const float *w, int64_t T, int64_t D,
                      float eps, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * D;
        float ss = 0.0f;
        if (x != NULL) {
            const float *xr = x + t * D;
            for (int64_t j = 0; j < D; j++) {
                r[j] += xr[j];
                ss += r[j] * r[j];
            }
        } else {
            for (int64_t j = 0; j < D; j++) ss += r[j] * r[j];
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        float *o = out + t * D;
        for (int64_t j = 0; j < D; j++) o[j] = r[j] * inv * w[j];
    }
}

/* out fp32 [n, dim] = table[ids[i], :dim] widened; kind 0 fp32, 1 bf16, 2 fp16 (exact
 * widening). tr == 0: table [V, ld] rows. tr > 0 (16-bit kinds): the 16-bit GEMM's packed
 * tiles (kvserve/quant/w16.py) [ceil(V / tr), dim / tc, tr, tc], so row v's columns c .. c + tc
 * start at ((v / tr) * (dim / tc) + c / tc) * tr * tc + (v % tr) * tc (ld unused). Returns 0, or
 * 1 (nothing written) if an id is not in [0, V). */
int kvs_gather_rows(const void *table, int kind, int64_t V, int64_t ld, const int64_t *ids,
                    int64_t n, int64_t dim, float *out, int64_t tr, int64_t tc) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V) return 1;
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * dim;
        if (kind == 0) {
            memcpy(o, (const float *)table + ids[i] * ld, sizeof(float) * (size_t)dim);
            continue;
        }
        /* run: contiguous columns (a row, or one tile step); step: 16-bit elements between
         * one run's start and the next's */
        const int64_t run = tr ? tc : dim, step = tr ? tr * tc : 0;
        const uint16_t *r = (const uint16_t *)table +
                            (tr ? (ids[i] / tr) * tr * dim + (ids[i] % tr) * tc : ids[i] * ld);
        for (int64_t c = 0; c < dim; c += run, r += step) {
            if (kind == 1) {
                uint32_t *u = (uint32_t *)(o + c);
                for (int64_t j = 0; j < run; j++) u[j] = (uint32_t)r[j] << 16;
            } else {
                for (int64_t j = 0; j < run; j++) o[c + j] = kvs_f16f(r[j]);
            }
        }
    }
    return 0;
}

/* Q8_0 rows (value = q * d per 32 columns) dequantized: out fp32 [n, K] for ids [n] of a
 * [V, K] table stored either row-major (tiled = 0: q int8 [V, K], d fp16 [V, K/32]) or in the
 * integer-dot tiles of kvserve/quant/wq.py (tiled = 1: codes u = q + 128 as uint8
 * [V/16, K/4, 16, 4], scales fp16 [V/16, K/32, 2, 16] with s = d at index 0). Returns 0, or 1
 * (nothing written) if an id is not in [0, V). */
int kvs_gather_q8(const void *qv, const uint16_t *dv, int tiled, int64_t V, int64_t K,
                  const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V) return 1;
    const int64_t ng = K / 32;
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids[i], tile = row / 16, r = row % 16;
        float *o = out + i * K;
        for (int64_t j = 0; j < K; j++) {
            float q, d;
            if (tiled) {
                const uint8_t u = ((const uint8_t *)qv)[((tile * (K / 4) + j / 4) * 16 + r) * 4 +
                                                        j % 4];
                q = (float)((int)u - 128);
                d = kvs_f16f(dv[((tile * ng + j / 32) * 2) * 16 + r]);
            } else {
                q = (float)((const int8_t *)qv)[row * K + j];
                d = kvs_f16f(dv[row * ng + j / 32]);
            }
            o[j] = q * d;
        }
    }
    return 0;
}

/*
 * out fp32 [T, H, D] (contiguous) = x [T, H, D] R: x's rows are ldx floats apart, each row's H
 * heads of D floats contiguous from its start (q, k or v inside a fused qkv row); R fp32
 * [D, D] row-major. out[t, h, j] = sum_i x[t, h, i] R[i, j] summed over i = 0 .. D-1 in that
 * order (one FMA chain per output), so a row's result does not depend on the others.
 */
void kvs_rotate_heads(const float *x, int64_t T, int64_t ldx, int64_t H, int64_t D,
                      const float *R, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H * D * D > 262144)
    for (int64_t th = 0; th < T * H; th++) {
        const float *xr = x + (th / H) * ldx + (th % H) * D;
        float *o = out + th * D;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 16 <= D; j += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i++) {
                const __m256 xi = _mm256_set1_ps(xr[i]);
                a0 = _mm256_fmadd_ps(xi, _mm256_loadu_ps(R + i * D + j), a0);
                a1 = _mm256_fmadd_ps(xi, _mm256_loadu_ps(R + i * D + j + 8), a1);
            }
            _mm256_storeu_ps(o + j, a0);
            _mm256_storeu_ps(o + j + 8, a1);
        }
        for (; j + 8 <= D; j += 8) {
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(xr[i]), _mm256_loadu_ps(R + i * D + j), a0);
            _mm256_storeu_ps(o + j, a0);
        }
#endif
        for (; j < D; j++) {
            float a = 0.0f;
            for (int64_t i = 0; i < D; i++) a = fmaf(xr[i], R[i * D + j], a);
            o[j] = a;
        }
    }
}

/* y fp32 [T, n0 + n1 + n2 + n3] = the parts side by side; part i fp32 [T, ni], rows ldi floats
 * apart (ni == 0: unused, its pointer may be NULL). */
void kvs_concat_cols(float *y, int64_t T, const float *a0, int64_t ld0, int64_t n0,
                     const float *a1, int64_t ld1, int64_t n1, const float *a2, int64_t ld2,
                     int64_t n2, const float *a3, int64_t ld3, int64_t n3) {
    const float *a[4] = {a0, a1, a2, a3};
    const int64_t ld[4] = {ld0, ld1, ld2, ld3}, n[4] = {n0, n1, n2, n3};
    const int64_t N = n0 + n1 + n2 + n3;
    for (int64_t t = 0; t < T; t++) {
        float *o = y + t * N;
        for (int i = 0; i < 4; i++) {
            if (n[i]) memcpy(o, a[i] + t * ld[i], sizeof(float) * (size_t)n[i]);
            o += n[i];
        }
    }
}

/* ---- recorded-graph adapters (kvs_op.h) ------------------------------------------------ */
int kvs_gather_q8_op(const int64_t *a) {
    return kvs_gather_q8(OP_P(0), OP_P(1), (int)a[2], a[3], a[4], OP_P(5), a[6], OP_P(7));
}

int kvs_rope_qk_op(const int64_t *a) {
    kvs_rope_qk(OP_P(0), a[1], a[2], a[3], a[4], a[5], OP_P(6), OP_P(7), OP_P(8), (int)a[9],
                (int)a[10]);
    return 0;
}

int kvs_silu_mul_op(const int64_t *a) {
    kvs_silu_mul(OP_P(0), a[1], a[2], OP_P(3), (int)a[4]);
    return 0;
}

int kvs_add_rms_norm_op(const int64_t *a) {
    kvs_add_rms_norm(OP_P(0), OP_P(1), OP_P(2), a[3], a[4], OP_F(5), OP_P(6), (int)a[7]);
    return 0;
}

int kvs_gather_rows_op(const int64_t *a) {
    return kvs_gather_rows(OP_P(0), (int)a[1], a[2], a[3], OP_P(4), a[5], a[6], OP_P(7), a[8],
                           a[9]);
}

int kvs_rotate_heads_op(const int64_t *a) {
    kvs_rotate_heads(OP_P(0), a[1], a[2], a[3], a[4], OP_P(5), OP_P(6), (int)a[7]);
    return 0;
}

int kvs_gelu_tanh_mul_op(const int64_t *a) {
    kvs_gelu_tanh_mul(OP_P(0), a[1], a[2], OP_P(3), (int)a[4]);
    return 0;
}

int kvs_head_rms_norm_op(const int64_t *a) {
    kvs_head_rms_norm(OP_P(0), a[1], a[2], a[3], a[4], OP_P(5), OP_F(6), (int)a[7]);
    return 0;
}

int kvs_scale_op(const int64_t *a) {
    kvs_scale(OP_P(0), a[1], a[2], OP_F(3));
    return 0;
}

int kvs_concat_cols_op(const int64_t *a) {
    kvs_concat_cols(OP_P(0), a[1], OP_P(2), a[3], a[4], OP_P(5), a[6], a[7], OP_P(8), a[9], a[10],
                    OP_P(11), a[12], a[13]);
    return 0;
}
