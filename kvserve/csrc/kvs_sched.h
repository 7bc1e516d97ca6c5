/* Work sharing of the kernels' OpenMP loops over output tiles (wq_gemm.c, kq_gemm.c): each
 * thread's static share, with the shares of a thread that falls behind taken over by the
 * others, a chunk at a time.
 *
 * On a host with no spare core (2 OpenMP threads on 2 cores, a server's event loop and a
 * streaming client beside them) the OS now and then takes a core from one thread for a while.
 * With a plain static split the other thread finishes its share and waits at the region's
 * barrier: the loop loses that time on both cores. Here each thread runs its own share
 * [n t / T, n (t + 1) / T) front to back, a chunk at a time, and a thread done with its share
 * takes chunks from the back of the share with the most left. Undisturbed, every thread runs
 * exactly its static share as one stream of consecutive tiles (the prefetch runs on into the
 * next tile); a plain dynamic schedule (chunks handed out in turn) measured slower there, its
 * last chunks leaving one thread idle and each thread's stream cut at every chunk.
 *
 * Each iteration is computed whole by one thread, with that thread's own scratch, in the same
 * order whichever thread runs it: the outputs are bit for bit those of the static split (and
 * as batch-invariant). A share is one 64-bit word (lo | hi << 32) changed by compare-and-swap:
 * its owner moves lo up, a thief moves hi down, so no iteration is taken twice.
 *
 * Use (shares set up before the region; a team smaller than num_threads -- an if() clause,
 * nested parallelism -- steals the missing threads' shares):
 *
 *     kvs_share sh;
 *     kvs_share_init(&sh, n, num_threads);
 *   #pragma omp parallel num_threads(num_threads)
 *     KVS_SHARE_FOR(sh, i) { ... iteration i ... }
 *
 * KVS_CHUNKS_PER_THREAD: chunks per share (chunk = n / (T * it), at least 1). -DKVS_SCHED_STATIC
 * builds the plain static split (no stealing: benchmarks/omp_contention.py's baseline). */
#ifndef KVS_SCHED_H
#define KVS_SCHED_H
#include <stdint.h>
#include <omp.h>

#ifndef KVS_CHUNKS_PER_THREAD
#define KVS_CHUNKS_PER_THREAD 8
#endif
#define KVS_MAX_SHARES 64 /* more threads: the extra ones only steal */

typedef struct {
    _Alignas(64) uint64_t r; /* lo | hi << 32, one cache line per share */
} kvs_range;

typedef struct {
    kvs_range s[KVS_MAX_SHARES];
    int n;         /* shares */
    int64_t chunk; /* iterations per grab */
} kvs_share;

static inline void kvs_share_init(kvs_share *sh, int64_t n, int num_threads) {
    const int T = num_threads < 1 ? 1 : num_threads > KVS_MAX_SHARES ? KVS_MAX_SHARES
                                                                       : num_threads;
    sh->n = T;
    const int64_t c = n / ((int64_t)T * KVS_CHUNKS_PER_THREAD);
    sh->chunk = c > 1 ? c : 1;
    for (int t = 0; t < T; t++) {
        const uint64_t lo = (uint64_t)(n * t / T), hi = (uint64_t)(n * (t + 1) / T);
        __atomic_store_n(&sh->s[t].r, lo | hi << 32, __ATOMIC_RELAXED);
    }
}

/* Thread me's next iterations [*i0, *i1): from the front of its own share, else from the back
 * of the share with the most left; 0 when every share is empty. */
static inline int kvs_share_next(kvs_share *sh, int me, int64_t *i0, int64_t *i1) {
    const uint64_t c = (uint64_t)sh->chunk;
    if (me < sh->n) {
        uint64_t v = __atomic_load_n(&sh->s[me].r, __ATOMIC_RELAXED);
        for (;;) {
            const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
            if (lo >= hi) break;
            const uint64_t end = hi - lo > c ? lo + c : hi;
            if (__atomic_compare_exchange_n(&sh->s[me].r, &v, end | hi << 32, 0,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *i0 = (int64_t)lo;
                *i1 = (int64_t)end;
                return 1;
            }
        }
    }
#ifndef KVS_SCHED_STATIC
    for (;;) {
        int best = -1;
        uint64_t most = 0, v = 0;
        for (int t = 0; t < sh->n; t++) {
            const uint64_t w = __atomic_load_n(&sh->s[t].r, __ATOMIC_RELAXED);
            const uint64_t lo = w & 0xffffffffu, hi = w >> 32;
            if (hi > lo && hi - lo > most) {
                most = hi - lo;
                best = t;
                v = w;
            }
        }
        if (best < 0) return 0;
        for (;;) {
            const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
            if (lo >= hi) break; /* emptied meanwhile: look again */
            const uint64_t start = hi - lo > c ? hi - c : lo;
            if (__atomic_compare_exchange_n(&sh->s[best].r, &v, lo | start << 32, 0,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *i0 = (int64_t)start;
                *i1 = (int64_t)hi;
                return 1;
            }
        }
    }
#else
    return 0;
#endif
}

/* for each iteration i this thread gets (inside the parallel region) */
#define KVS_SHARE_FOR(sh, i)                                                                 \
    for (int64_t i##_0, i##_1; kvs_share_next(&(sh), omp_get_thread_num(), &i##_0, &i##_1);) \
        for (int64_t i = i##_0; i < i##_1; i++)
#endif
