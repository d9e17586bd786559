// ddp.h: data parallelism with bucketed, overlapped gradient all-reduce (PyTorch DDP's design).
//
// Every rank holds the whole model and a slice of the global batch. After backward, each gradient
// must be averaged over the data-parallel group. Doing that in one all-reduce at the end leaves
// the network idle during backward and the CPU idle during the all-reduce. Instead the gradients
// are grouped into buckets of about `bucket_bytes`, in the order backward produces them (last
// layer first), and a bucket's all-reduce starts on the comm stream as soon as the last of its
// gradients is final, while backward goes on with the earlier layers.
//
//   Ddp *ddp = ddp_create(&model, mesh->dp, 25 << 20, true);
//   ddp_broadcast_params(ddp);                // every replica starts from rank 0's weights
//   for each micro-batch mb of M:
//       ddp_begin_backward(ddp, mb == M - 1);  // only the last micro-batch communicates
//       model_backward(&model, ...);           // buckets launch from the grads-ready hook
//   ddp_finish_backward(ddp);                  // waits; grads are now the dp average
//
// A pipeline stage (chapter 7) holds only some units, in buffers of its own: ddp_create_ranges
// takes them as ranges of consecutive units, and each range starts its sync on its own last
// backward (ddp_begin_backward_range), since a stage's chunks finish at different times.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/comm.h"
#include "reference_cpu/model.h"

// Units first_unit..last_unit (table layers, in order), one contiguous range of the flat layout,
// with the buffers holding that range's weights and gradients.
typedef struct {
    int first_unit, last_unit;
    real *params, *grads;
} DdpRange;

typedef struct {
    real *grads;           // the bucket's gradients: a run of consecutive table entries of one range
    size_t count;
    int n_params;          // parameters in it
    int n_pending;         // parameters whose gradients are not final yet in this backward
    bool sync;             // this backward of its range ends with the all-reduce
    CommHandle *inflight;
} DdpBucket;

typedef struct {
    Model *model;
    Comm *dp;
    bool overlap;          // false: every bucket's all-reduce starts after backward (for comparison)
    int n_ranges;
    DdpRange *ranges;
    int n_buckets;
    DdpBucket *buckets;
    int *bucket_of_param;  // (table.count) -1 for parameters outside the ranges
    int *range_of_bucket;  // (n_buckets)
} Ddp;

// Builds buckets of at most bucket_bytes (a parameter larger than that gets a bucket of its own)
// walking the table from the end, and installs the model's grads-ready hook. ddp_create covers the
// whole model in m->params / m->grads.
Ddp *ddp_create(Model *model, Comm *dp, size_t bucket_bytes, bool overlap);
Ddp *ddp_create_ranges(Model *model, Comm *dp, const DdpRange *ranges, int n_ranges, size_t bucket_bytes,
                       bool overlap);
void ddp_free(Ddp *d);
void ddp_broadcast_params(Ddp *d);
// Before a backward: sync says whether it is the last before the optimizer step. _range: only the
// buckets of ranges[range].
void ddp_begin_backward(Ddp *d, bool sync);
void ddp_begin_backward_range(Ddp *d, int range, bool sync);
// Waits for the all-reduces of every bucket whose last backward synced.
void ddp_finish_backward(Ddp *d);
