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
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/comm.h"
#include "reference_cpu/model.h"

typedef struct {
    size_t offset, count;  // a contiguous range of the flat gradient buffer (table order)
    int n_params;          // parameters in it
    int n_pending;         // parameters whose gradients are not final yet in this backward
    CommHandle *inflight;
} DdpBucket;

typedef struct {
    Model *model;
    Comm *dp;
    bool overlap;      // false: every bucket's all-reduce starts after backward (for comparison)
    bool sync;         // this backward ends with gradient averaging (the last micro-batch)
    int n_buckets;
    DdpBucket *buckets;
    int *bucket_of_param;  // (table.count)
} Ddp;

// Builds buckets of at most bucket_bytes (a parameter larger than that gets a bucket of its own)
// walking the table from the end, and installs the model's grads-ready hook.
Ddp *ddp_create(Model *model, Comm *dp, size_t bucket_bytes, bool overlap);
void ddp_free(Ddp *d);
void ddp_broadcast_params(Ddp *d);
void ddp_begin_backward(Ddp *d, bool sync);
void ddp_finish_backward(Ddp *d);
