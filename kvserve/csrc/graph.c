/*
 * Replay of a recorded CPU decode graph: ops run in order, each an adapter of one kernel
 * (kvs_op.h) over its recorded int64 arguments. Graphs are recorded once at the largest batch
 * (kvserve/engine/cpu_graphs.py) with every buffer laid out rows-first, so a batch of n <= B
 * rows replays the same ops over the buffers' [:n] prefixes: the argument at rows_at[i] of op
 * i (-1: none) is the op's row count and is set to n before the call.
 *
 *   fns [n_ops]; args: op i's arguments at args[offsets[i] ..]; rows_at [n_ops]
 *
 * Returns 0, or i + 1 when op i failed (the ops after it did not run).
 */
#include <stdint.h>

typedef int (*kvs_op_fn)(const int64_t *);

int64_t kvs_graph_run(const int64_t *fns, int64_t *args, const int64_t *offsets,
                      const int64_t *rows_at, int64_t n_ops, int64_t rows) {
    for (int64_t i = 0; i < n_ops; i++) {
        int64_t *a = args + offsets[i];
        if (rows_at[i] >= 0) a[rows_at[i]] = rows;
        if (((kvs_op_fn)(intptr_t)fns[i])(a)) return i + 1;
    }
    return 0;
}
