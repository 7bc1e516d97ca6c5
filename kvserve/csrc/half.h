/* fp16 -> fp32 bit conversion shared by the C kernels (exact for every fp16 value, subnormals
 * included); the AVX2 paths use F16C's vcvtph2ps instead. */
#ifndef KVS_HALF_H
#define KVS_HALF_H
#include <stdint.h>
#include <string.h>

static inline float kvs_f16f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t u;
    if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        u = sign | ((e + 112) << 23) | (m << 13);
    } else {  /* zero or subnormal: m * 2^-24, exact in fp32 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif
