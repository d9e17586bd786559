#include "chapters/06_tensor_parallel/tp.h"
#include "common/log.h"  // LAB_HOLE

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "common/trace.h"
#include "reference_cpu/adamw.h"

// ---- the model's callbacks -------------------------------------------------------------------------
static void *sum_start(void *ctx, real *buf, size_t n) { return comm_all_reduce_start(ctx, buf, n, COMM_REAL, COMM_SUM); }
static void *gather_start(void *ctx, const real *shard, real *full, size_t n) {
    return comm_all_gather_start(ctx, shard, full, n, COMM_REAL);
}
static void *sum_scatter_start(void *ctx, const real *full, real *shard, size_t n) {
    return comm_reduce_scatter_start(ctx, full, shard, n, COMM_REAL, COMM_SUM);
}
// The main thread blocks here until the collective is done: marked "comm-wait" on the compute
// track, so trace-summary counts it as exposed communication, not compute.
static void wait_pending(void *ctx, void *pending) {
    (void)ctx;
    int track = trace_track("compute");
    trace_begin(track, "tp wait", "comm-wait");
    comm_wait(pending);
    trace_end(track);
}

static bool target_here(int target, int v_start, int v_count) {
    return target != IGNORE_INDEX && target >= v_start && target < v_start + v_count;
}

// Vocab-parallel cross-entropy: logits (BT, v_count) hold vocab entries [v_start, v_start + v_count).
//   max_n   = max over the group of each rank's row max              (all-reduce MAX)
//   sum_n   = sum over the group of sum_j exp(logit_nj - max_n)       (all-reduce SUM)
//   stats_n = (max_n, log(sum_n));  target logit from the rank holding it (all-reduce SUM)
//   loss_n  = (max_n - target logit) + log(sum_n), in double (max_n + log(sum_n) in fp32 would
//             round at the max's scale: ops.h)
// Every rank ends with the same stats (BT, 2) and loss as the single process's cross_entropy_forward.
static double loss_forward(void *ctx, real *stats, const real *logits, const int *targets, int BT, int v_start,
                           int v_count) {
    Comm *tp = ctx;
    // LAB tp: per token, the max over the whole vocabulary (all-reduce MAX), the sum of exp(logit - max) and the target's logit (all-reduce SUM: only the rank holding the target has it); write stats = (max, log(sum)) and return the mean of (max - target logit) + log(sum) over tokens whose target is not IGNORE_INDEX
    LAB_HOLE("tp", "per token, the max over the whole vocabulary (all-reduce MAX), the sum of exp(logit - max) and the target's logit (all-reduce SUM: only the rank holding the target has it); write stats = (max, log(sum)) and return the mean of (max - target logit) + log(sum) over tokens whose target is not IGNORE_INDEX");
    // END LAB
}

// d loss / d logit_nj = coef * (softmax_nj - [j == target_n]) on this rank's columns: local work.
static void loss_backward(void *ctx, real *dlogits, const real *logits, const real *stats, const int *targets, int BT,
                          int v_start, int v_count, double dloss) {
    (void)ctx;
    cross_entropy_backward_columns(dlogits, logits, stats, targets, BT, v_start, v_count, dloss);
}

void tp_install(Model *m, Comm *tp_group, bool sequence_parallel) {
    m->tp.sequence_parallel = sequence_parallel;
    m->tp.sum_start = sum_start;
    m->tp.gather_start = gather_start;
    m->tp.sum_scatter_start = sum_scatter_start;
    m->tp.wait = wait_pending;
    m->tp.loss_forward = loss_forward;
    m->tp.loss_backward = loss_backward;
    m->tp.ctx = tp_group;
}

// ---- gradient norm and checkpoints -------------------------------------------------------------------
double tp_sum_of_squares(const Model *m, Comm *tp_group, const real *local_flat) {
    double sums[2] = {0, 0};  // tp-sharded, replicated
    sum_of_squares_by_tp_split(&m->table, local_flat, 0, m->table.total_numel, sums);
    if (m->tp.size > 1) comm_all_reduce(tp_group, sums, 1, COMM_FLOAT64, COMM_SUM);
    return sums[0] + sums[1];
}

// Where local element (row, col) of rank r's shard of p lives in the full tensor.
static size_t full_index(const ParamInfo *p, int r, int tp, size_t row, size_t col) {
    size_t cols = p->ndim == 2 ? (size_t)p->shape[1] : 1;
    if (p->tp_split == TP_ROWS) return ((size_t)r * p->shape[0] + row) * cols + col;
    if (p->tp_split == TP_COLS) return row * cols * tp + (size_t)r * cols + col;
    return row * cols + col;
}

// The full table's offset of each local entry (same order and names, full shapes).
static size_t full_offset(const Model *m, int i) {
    size_t offset = 0;
    for (int j = 0; j < i; j++) offset += m->table.items[j].numel * (m->table.items[j].tp_split == TP_NONE ? 1 : m->tp.size);
    return offset;
}

// Copies rank r's shard between its local layout and the full one, row by row.
static void copy_shard(const Model *m, int r, real *local_flat, real *full_flat, bool to_full) {
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        size_t rows = (size_t)p->shape[0], cols = p->ndim == 2 ? (size_t)p->shape[1] : 1, base = full_offset(m, i);
        for (size_t row = 0; row < rows; row++) {
            real *full = full_flat + base + full_index(p, r, m->tp.size, row, 0);
            real *local = local_flat + p->offset + row * cols;
            if (to_full) memcpy(full, local, sizeof(real) * cols);
            else memcpy(local, full, sizeof(real) * cols);
        }
    }
}

void tp_gather_full(const Model *m, Comm *tp_group, const real *local_flat, real *full_flat) {
    int n_ranks = m->tp.size;
    size_t n = m->table.total_numel;
    real *all = mem_alloc(MEM_COMM, sizeof(real) * n * n_ranks);  // (n_ranks, local layout)
    if (n_ranks > 1) comm_all_gather(tp_group, local_flat, all, n, COMM_REAL);
    else memcpy(all, local_flat, sizeof(real) * n);
    for (int r = 0; r < n_ranks; r++) copy_shard(m, r, all + (size_t)r * n, full_flat, true);
    mem_free(all);
}

void tp_scatter_full(const Model *m, const real *full_flat, real *local_flat) {
    copy_shard(m, m->tp.rank, local_flat, (real *)full_flat, false);  // reads full_flat only
}
