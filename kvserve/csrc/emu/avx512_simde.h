/*
 * AVX-512 on an AVX2 CPU, for tests only: cbuild's "avx512_emu" and "bf16_emu" variants
 * compile a kernel with -march=haswell and `-include` this header, which maps every
 * _mm512_* intrinsic onto SIMDe (https://github.com/simd-everywhere/simde, Debian
 * libsimde-dev; its 512-bit vectors run as two native 256-bit halves) and then claims the
 * AVX-512 feature macros, so the kernel's AVX-512 paths (tile shapes, packed layouts, masks,
 * the vdpbf16ps dot products) compile and run against their twins on any AVX2 machine. The
 * arithmetic is emulated lane by lane: an FMA is an FMA, but vdpbf16ps's internal rounding
 * and the horizontal reductions' order may differ from the silicon's, so tests of these builds
 * compare within tolerance, as they do for a native build against its twin. Nothing here ships
 * in a kernel the engine loads (KVS_SIMDE is defined only in these variants).
 *
 * Below: the intrinsics the kernels use that SIMDe 0.7.4 (Debian 12) lacks, written on the
 * 256-bit halves with each one's documented semantics.
 */
#ifndef KVS_AVX512_SIMDE_H
#define KVS_AVX512_SIMDE_H
#if defined(__AVX512F__)
#error "avx512_simde.h emulates AVX-512: build for a target without it (-march=haswell)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef I /* SIMDe pulls in <complex.h>, whose I would rename the kernels' I variables */

#define KVS_SIMDE 1

static inline simde__m512 kvs_emu_ps(simde__m256 lo, simde__m256 hi) {
    simde__m512_private r;
    r.m256[0] = lo;
    r.m256[1] = hi;
    return simde__m512_from_private(r);
}
static inline simde__m512i kvs_emu_si(simde__m256i lo, simde__m256i hi) {
    simde__m512i_private r;
    r.m256i[0] = lo;
    r.m256i[1] = hi;
    return simde__m512i_from_private(r);
}
static inline simde__m256 kvs_emu_half(simde__m512 v, int i) {
    return simde__m512_to_private(v).m256[i];
}
static inline simde__m256i kvs_emu_halfi(simde__m512i v, int i) {
    return simde__m512i_to_private(v).m256i[i];
}

#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps(v, i) kvs_emu_half((v), (i) & 1)

#undef _mm512_cvtph_ps
static inline simde__m512 kvs_emu_cvtph_ps(simde__m256i h) {
    return kvs_emu_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                      _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtph_ps kvs_emu_cvtph_ps

#undef _mm512_cvtepu16_epi32
static inline simde__m512i kvs_emu_cvtepu16_epi32(simde__m256i h) {
    return kvs_emu_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                      _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtepu16_epi32 kvs_emu_cvtepu16_epi32

#undef _mm512_cvtepi8_epi32
static inline simde__m512i kvs_emu_cvtepi8_epi32(simde__m128i b) {
    return kvs_emu_si(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#define _mm512_cvtepi8_epi32 kvs_emu_cvtepi8_epi32

#undef _mm512_cvtepu8_epi32
static inline simde__m512i kvs_emu_cvtepu8_epi32(simde__m128i b) {
    return kvs_emu_si(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
#define _mm512_cvtepu8_epi32 kvs_emu_cvtepu8_epi32

#undef _mm512_cvtepi32_ps
static inline simde__m512 kvs_emu_cvtepi32_ps(simde__m512i v) {
    return kvs_emu_ps(_mm256_cvtepi32_ps(kvs_emu_halfi(v, 0)),
                      _mm256_cvtepi32_ps(kvs_emu_halfi(v, 1)));
}
#define _mm512_cvtepi32_ps kvs_emu_cvtepi32_ps

#undef _mm512_cvtps_epi32
static inline simde__m512i kvs_emu_cvtps_epi32(simde__m512 v) {
    return kvs_emu_si(_mm256_cvtps_epi32(kvs_emu_half(v, 0)),
                      _mm256_cvtps_epi32(kvs_emu_half(v, 1)));
}
#define _mm512_cvtps_epi32 kvs_emu_cvtps_epi32

/* GCC's order: the halves added, then the 128-bit halves, then two shuffles */
#define KVS_EMU_REDUCE(name, op128)                                                     \
    static inline float name(simde__m512 v) {                                           \
        const __m256 h = kvs_emu_half(v, 0), g = kvs_emu_half(v, 1);                   \
        const __m256 t = op128##256(g, h);                                              \
        __m128 s = op128(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));       \
        s = op128(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));                     \
        s = op128(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1)));                     \
        return _mm_cvtss_f32(s);                                                        \
    }
#define _mm_add_ps256 _mm256_add_ps
#define _mm_max_ps256 _mm256_max_ps
KVS_EMU_REDUCE(kvs_emu_reduce_add_ps, _mm_add_ps)
KVS_EMU_REDUCE(kvs_emu_reduce_max_ps, _mm_max_ps)
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_add_ps kvs_emu_reduce_add_ps
#define _mm512_reduce_max_ps kvs_emu_reduce_max_ps

#undef _mm512_maskz_loadu_epi16
static inline simde__m512i kvs_emu_maskz_loadu_epi16(uint32_t k, const void *p) {
    simde__m512i_private r;
    const uint16_t *s = (const uint16_t *)p;
    for (int l = 0; l < 32; l++) r.u16[l] = (k >> l) & 1 ? s[l] : 0; /* masked lanes: no read */
    return simde__m512i_from_private(r);
}
#define _mm512_maskz_loadu_epi16 kvs_emu_maskz_loadu_epi16

/* fp32 masked load / store: masked lanes are neither read nor written (SIMDe may blend
 * through a full 64-byte access, which races with threads owning the neighbouring floats) */
#undef _mm512_maskz_loadu_ps
static inline simde__m512 kvs_emu_maskz_loadu_ps(uint32_t k, const void *p) {
    simde__m512_private r;
    const float *s = (const float *)p;
    for (int l = 0; l < 16; l++) r.f32[l] = (k >> l) & 1 ? s[l] : 0.0f;
    return simde__m512_from_private(r);
}
#define _mm512_maskz_loadu_ps kvs_emu_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
static inline void kvs_emu_mask_storeu_ps(void *p, uint32_t k, simde__m512 v) {
    const simde__m512_private r = simde__m512_to_private(v);
    float *d = (float *)p;
    for (int l = 0; l < 16; l++)
        if ((k >> l) & 1)
            d[l] = r.f32[l];
}
#define _mm512_mask_storeu_ps kvs_emu_mask_storeu_ps

/* vcvtne2ps2bf16: lanes 0-15 from b, 16-31 from a; round to nearest even, denormal inputs
 * to signed zero, NaN quieted: per lane the rounding of w16_gemm.c's bf16_rne (its K % 32
 * tail), kept as a copy here so that the emulation does not depend on the kernel it checks */
#undef _mm512_cvtne2ps_pbh
static inline uint16_t kvs_emu_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static inline simde__m512bh kvs_emu_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    const simde__m512_private a_ = simde__m512_to_private(a), b_ = simde__m512_to_private(b);
    simde__m512bh_private r;
    for (int l = 0; l < 16; l++) {
        r.u16[l] = kvs_emu_bf16(b_.f32[l]);
        r.u16[l + 16] = kvs_emu_bf16(a_.f32[l]);
    }
    return simde__m512bh_from_private(r);
}
#define _mm512_cvtne2ps_pbh kvs_emu_cvtne2ps_pbh

#ifndef _mm512_shuffle_f32x4 /* SIMDe has it, without the alias */
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#endif

/* the kernels' own ISA checks: the emulated ISA is always there */
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#define __AVX512CD__ 1
#if defined(KVS_SIMDE_BF16)
#define __AVX512VNNI__ 1
#define __AVX512BF16__ 1
#endif
#endif
