#include "chapters/02_data_parallel/ddp.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/trace.h"

static void launch_bucket(Ddp *d, DdpBucket *b) {
    b->inflight = comm_all_reduce_start(d->dp, b->grads, b->count, COMM_REAL, COMM_AVG);
}

// The grads-ready hook: every parameter of `layer` is final. A bucket whose last pending parameter
// this was goes onto the comm stream now, if this backward of its range syncs.
static void on_grads_ready(int layer, void *ctx) {
    Ddp *d = ctx;
    // LAB ddp: with overlap on: for each parameter of this layer that has a bucket, if the bucket syncs in this backward count it down; the bucket's last one launches it (launch_bucket)
    LAB_HOLE("ddp", "with overlap on: for each parameter of this layer that has a bucket, if the bucket syncs in this backward count it down; the bucket's last one launches it (launch_bucket)");
    // END LAB
}

static int range_of_layer(const Ddp *d, int layer) {
    for (int r = 0; r < d->n_ranges; r++)
        if (layer >= d->ranges[r].first_unit && layer <= d->ranges[r].last_unit) return r;
    return -1;
}

static size_t range_numel(const Ddp *d, const DdpRange *r) {
    size_t first = model_unit_offset(d->model, r->first_unit);
    return model_unit_offset(d->model, r->last_unit) + model_unit_numel(d->model, r->last_unit) - first;
}

Ddp *ddp_create_ranges(Model *model, Comm *dp, const DdpRange *ranges, int n_ranges, size_t bucket_bytes,
                       bool overlap) {
    Ddp *d = calloc(1, sizeof *d);
    const ParamTable *t = &model->table;
    d->model = model, d->dp = dp, d->overlap = overlap, d->n_ranges = n_ranges;
    d->ranges = calloc((size_t)n_ranges, sizeof(DdpRange));
    memcpy(d->ranges, ranges, sizeof(DdpRange) * (size_t)n_ranges);
    d->buckets = calloc((size_t)t->count, sizeof(DdpBucket));
    d->bucket_of_param = calloc((size_t)t->count, sizeof(int));
    d->range_of_bucket = calloc((size_t)t->count, sizeof(int));
    // Walk backwards: backward finishes the last table entries first. A bucket is a run of
    // consecutive entries of one range, hence one contiguous piece of its buffer: one all-reduce,
    // no copy.
    size_t max_count = bucket_bytes / sizeof(real);
    // LAB ddp: walk the table from its last entry: open a new bucket when the entry is in another range or would take the current one past max_count; the bucket's grads point at its lowest entry (range->grads + offset within the range); count, n_params, bucket_of_param (-1 outside every range), range_of_bucket
    LAB_HOLE("ddp", "walk the table from its last entry: open a new bucket when the entry is in another range or would take the current one past max_count; the bucket's grads point at its lowest entry (range->grads + offset within the range); count, n_params, bucket_of_param (-1 outside every range), range_of_bucket");
    // END LAB
    model->grads_ready = on_grads_ready;
    model->grads_ready_ctx = d;
    return d;
}

Ddp *ddp_create(Model *model, Comm *dp, size_t bucket_bytes, bool overlap) {
    DdpRange all = {LAYER_EMBEDDING, model->cfg.n_layers, model->params, model->grads};
    return ddp_create_ranges(model, dp, &all, 1, bucket_bytes, overlap);
}

void ddp_free(Ddp *d) {
    if (!d) return;
    d->model->grads_ready = NULL;
    free(d->ranges);
    free(d->buckets);
    free(d->bucket_of_param);
    free(d->range_of_bucket);
    free(d);
}

// A fingerprint of this rank's weights: up to 4096 evenly spaced elements of each range, their bytes
// hashed (FNV-1a). Sampled, so that it costs nothing next to the broadcast, whatever the model size.
static uint64_t params_fingerprint(const Ddp *d) {
    uint64_t h = FNV1A_BASIS;
    for (int r = 0; r < d->n_ranges; r++) {
        size_t n = range_numel(d, &d->ranges[r]), stride = n > 4096 ? n / 4096 : 1;
        for (size_t i = 0; i < n; i += stride) {
            h = fnv1a_bytes(h, &d->ranges[r].params[i], sizeof(real));
        }
    }
    return h;
}

// Whether every replica has this rank's fingerprint: its largest value and its smallest (the
// largest negation) over the replicas are the same. 52 bits of it, exact in a double.
static bool replicas_agree(const Ddp *d) {
    double mine = (double)(params_fingerprint(d) >> 12), v[2] = {mine, -mine};
    comm_all_reduce(d->dp, v, 2, COMM_FLOAT64, COMM_MAX);
    return v[0] == -v[1];
}

void ddp_broadcast_params(Ddp *d) {
    bool agreed = replicas_agree(d);
    for (int r = 0; r < d->n_ranges; r++)
        comm_broadcast(d->dp, d->ranges[r].params, range_numel(d, &d->ranges[r]), COMM_REAL, 0);
    if (!replicas_agree(d)) fatal("ddp: the replicas' weights still differ after the broadcast from rank 0");
    log_info("ddp: the replicas' weights were %s before the broadcast from rank 0, and are equal after "
             "(compared by a sample of each range)", agreed ? "equal" : "different");
}

void ddp_begin_backward_range(Ddp *d, int range, bool sync) {
    for (int i = 0; i < d->n_buckets; i++) {
        DdpBucket *b = &d->buckets[i];
        // LAB ddp: each bucket of this range: every parameter pending again, and whether this backward ends with its all-reduce (only the last micro-batch's does)
        LAB_HOLE("ddp", "each bucket of this range: every parameter pending again, and whether this backward ends with its all-reduce (only the last micro-batch's does)");
        // END LAB
    }
}

void ddp_begin_backward(Ddp *d, bool sync) {
    for (int r = 0; r < d->n_ranges; r++) ddp_begin_backward_range(d, r, sync);
}

// Without overlap every syncing bucket starts here, in the same order; with overlap they are all in
// flight already. Either way the main thread now waits: the wait is the exposed communication.
void ddp_finish_backward(Ddp *d) {
    bool any = false;
    for (int i = 0; i < d->n_buckets; i++) any |= d->buckets[i].sync;
    if (!any) return;
    int track = trace_track("compute");
    trace_begin(track, "ddp wait", "comm-wait");
    for (int i = 0; i < d->n_buckets; i++) {
        DdpBucket *b = &d->buckets[i];
        if (!b->sync || b->inflight) continue;
        if (d->overlap) fatal("ddp: bucket %d never became ready (%d parameters pending)", i, b->n_pending);
        launch_bucket(d, b);
    }
    for (int i = 0; i < d->n_buckets; i++) {
        DdpBucket *b = &d->buckets[i];
        if (!b->sync) continue;
        comm_wait(b->inflight);
        b->inflight = NULL;
        b->sync = false;
    }
    trace_end(track);
}
