/* Op adapters for recorded CPU decode graphs (kvserve/csrc/graph.c, kvserve/engine/cpu_graphs.py).
 *
 * Every kernel a decode graph may record has a twin entry point `int <name>_op(const int64_t
 * *a)` taking its arguments as one int64 array, in the order of the kernel's own signature:
 * pointers and integers as int64, floats as the bits of a double (OP_F). It returns 0, or
 * nonzero on failure (the replay stops there). */
#ifndef KVS_OP_H
#define KVS_OP_H
#include <stdint.h>
#include <string.h>

#define OP_P(i) ((void *)(intptr_t)a[i])
static inline double kvs_op_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}
#define OP_F(i) ((float)kvs_op_double(a[i]))
#endif
