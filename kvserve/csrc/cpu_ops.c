/*
 * Small fused ops of a decoder layer on CPU (fp32), one call each where torch takes several:
 *
 *   kvs_rope_qk       rotary embedding of q and k, in place in the fused qkv projection's output
 *                     (twin: kvserve.layers.rotary.RotaryEmbedding's torch path)
 *   kvs_silu_mul      silu(gate) * up from the fused gate_up output (twin: F.silu(g) * u)
 *   kvs_add_rms_norm  residual += x; out = residual / rms(residual) * w
 *                     (twin: kvserve.layers.norm.RMSNorm on x + residual)
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
