#include "chapters/02_data_parallel/ddp.h"

#include <stdlib.h>

#include "common/log.h"
#include "common/trace.h"

#ifdef REF_FLOAT64
#define COMM_REAL COMM_FLOAT64
#else
#define COMM_REAL COMM_FLOAT32
#endif

static void launch_bucket(Ddp *d, DdpBucket *b) {
    b->inflight = comm_all_reduce_start(d->dp, d->model->grads + b->offset, b->count, COMM_REAL, COMM_AVG);
}

// The grads-ready hook: every parameter of `layer` is final. A bucket whose last pending parameter
// this was goes onto the comm stream now.
static void on_grads_ready(int layer, void *ctx) {
    Ddp *d = ctx;
    if (!d->sync || !d->overlap) return;
    const ParamTable *t = &d->model->table;
    for (int i = 0; i < t->count; i++) {
        if (t->items[i].layer != layer) continue;
        DdpBucket *b = &d->buckets[d->bucket_of_param[i]];
        if (--b->n_pending == 0) launch_bucket(d, b);
    }
}

Ddp *ddp_create(Model *model, Comm *dp, size_t bucket_bytes, bool overlap) {
    Ddp *d = calloc(1, sizeof *d);
    const ParamTable *t = &model->table;
    d->model = model, d->dp = dp, d->overlap = overlap;
    d->buckets = calloc((size_t)t->count, sizeof(DdpBucket));
    d->bucket_of_param = calloc((size_t)t->count, sizeof(int));
    // Walk backwards: backward finishes the last table entries first. A bucket is a run of
    // consecutive entries, hence one contiguous range of the flat buffer: one all-reduce, no copy.
    size_t max_count = bucket_bytes / sizeof(real);
    for (int i = t->count - 1; i >= 0; i--) {
        const ParamInfo *p = &t->items[i];
        DdpBucket *b = d->n_buckets ? &d->buckets[d->n_buckets - 1] : NULL;
        if (!b || b->count + p->numel > max_count) b = &d->buckets[d->n_buckets++];
        b->offset = p->offset;  // decreasing: the last one added is the start of the range
        b->count += p->numel;
        b->n_params++;
        d->bucket_of_param[i] = (int)(b - d->buckets);
    }
    model->grads_ready = on_grads_ready;
    model->grads_ready_ctx = d;
    return d;
}

void ddp_free(Ddp *d) {
    if (!d) return;
    d->model->grads_ready = NULL;
    free(d->buckets);
    free(d->bucket_of_param);
    free(d);
}

void ddp_broadcast_params(Ddp *d) {
    comm_broadcast(d->dp, d->model->params, d->model->table.total_numel, COMM_REAL, 0);
}

void ddp_begin_backward(Ddp *d, bool sync) {
    d->sync = sync;
    for (int i = 0; i < d->n_buckets; i++) {
        d->buckets[i].n_pending = d->buckets[i].n_params;
        d->buckets[i].inflight = NULL;
    }
}

// Without overlap every bucket starts here, in the same order; with overlap they are all in flight
// already. Either way the main thread now waits: the wait is the exposed communication.
void ddp_finish_backward(Ddp *d) {
    if (!d->sync) return;
    int track = trace_track("compute");
    trace_begin(track, "ddp wait", "comm-wait");
    for (int i = 0; i < d->n_buckets; i++) {
        DdpBucket *b = &d->buckets[i];
        if (!b->inflight) {
            if (d->overlap) fatal("ddp: bucket %d never became ready (%d parameters pending)", i, b->n_pending);
            launch_bucket(d, b);
        }
    }
    for (int i = 0; i < d->n_buckets; i++) {
        comm_wait(d->buckets[i].inflight);
        d->buckets[i].inflight = NULL;
    }
    trace_end(track);
}
