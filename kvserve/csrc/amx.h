/*
 * AMX (Sapphire Rapids and later) for the kernels that use its tiles: w16_gemm.c (AMX-BF16,
 * TDPBF16PS) and wq_gemm.c (AMX-INT8, TDPBSUD). Include it only where the build targets AMX
 * (__AMX_TILE__): the tile intrinsics need it. Each kernel library keeps its own on / off
 * state; the tile permission is per process, so asking twice is harmless.
 */
#ifndef KVS_AMX_H
#define KVS_AMX_H
#include <cpuid.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <immintrin.h>
long syscall(long number, ...); /* <unistd.h> declares it only with _GNU_SOURCE */

#define KVS_ARCH_REQ_XCOMP_PERM 0x1023
#define KVS_XFEATURE_XTILEDATA 18
/* CPUID.(EAX=7, ECX=0):EDX bits of the AMX units */
#define KVS_AMX_BF16_BIT 22
#define KVS_AMX_INT8_BIT 25

/* the CPU has AMX-TILE and the unit at EDX bit `unit_bit`, and Linux grants this process the
 * tile data state (arch_prctl; refused on kernels before 5.16 or where the state is off) */
static inline int kvs_amx_available(int unit_bit) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 24) & 1) || !((d >> unit_bit) & 1)) return 0; /* AMX-TILE, the unit */
    return syscall(SYS_arch_prctl, KVS_ARCH_REQ_XCOMP_PERM, KVS_XFEATURE_XTILEDATA) == 0;
}

/* palette 1 tile configuration (ldtilecfg's 64-byte operand) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) kvs_amx_cfg;

/* a zeroed palette-1 configuration; set rows / colsb of the tiles used, then _tile_loadconfig */
static inline void kvs_amx_cfg_init(kvs_amx_cfg *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->palette = 1;
}

/* request 1 turns a kernel's AMX path on where its CPU has the unit (asking Linux for the tile
 * state), 0 turns it off, -1 only asks (the first ask probes). Returns whether it is on. */
static inline int kvs_amx_request(int *state, int request, int unit_bit) {
    int s = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    if (request == 0)
        s = 0;
    else if (request == 1 || s < 0)
        s = kvs_amx_available(unit_bit);
    __atomic_store_n(state, s, __ATOMIC_RELEASE);
    return s;
}
#endif
