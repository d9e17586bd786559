// fsdp.h: sharded data parallelism, ZeRO stages 1, 2 and 3 (FSDP), and HSDP, as one module.
//
// Every data-parallel rank still runs the whole model on its slice of the batch, but the training
// state is divided across the N ranks of the shard group (dp_shard x cp) instead of copied:
//
//   stage 1  optimizer state (AdamW m and v) sharded; each rank updates only its shard of the
//            weights, then the weights are all-gathered. Gradients: full, one reduce-scatter
//            per step (after the last micro-batch).
//   stage 2  + gradients sharded: each unit's gradients are reduce-scattered as soon as its
//            backward ends, into the rank's gradient shard; the full gradient buffer is freed.
//   stage 3  + weights sharded (FSDP): a unit's weights exist in full only between an all-gather
//            just before it is used and its release after; the next unit's all-gather is
//            prefetched on the comm stream while the current one computes.
//
// The shard unit is the model's unit (model.h): the embedding, each transformer block, the head.
// A unit's tensors are one contiguous range of the table's flat layout (U elements); it is padded
// with zeros to a multiple of N, and rank r owns elements [r*S, (r+1)*S) with S = ceil(U/N). The
// padding is never read by the model; its gradients are zero and AdamW keeps it at zero.
//
// HSDP: with dp_replicate > 1 the shard group is one replica; the gradient shards are then
// averaged over the replicate group (all-reduce), queued right behind the reduce-scatter.
//
//   Fsdp *f = fsdp_create(&model, shard_group, replicate_group, &options, &init);  // installs UnitStorage
//   fsdp_zero_grads(f);
//   for each micro-batch:  model_forward(...); fsdp_begin_backward(f, last); model_backward(...);
//                          fsdp_end_backward(f);
//   norm = fsdp_grad_norm(f); fsdp_clip(f, norm, max); fsdp_adamw_step(f, step, lr, &adam);
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/mem.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/model.h"

typedef struct Fsdp Fsdp;
typedef struct FsdpUnit FsdpUnit;

// How a unit's weights travel in stage 3's all-gather. NULL: as the fp32 shards themselves. A codec
// sends fewer bytes (chapter 9's FP8 all-gather casts the projections to E4M3): each rank encodes its
// shard into shard_bytes bytes (the same count on every rank), the all-gather moves those, and every
// rank decodes all of them into the unit's full weights.
typedef struct {
    // After every change of the weights (creation, each optimizer step, a load), on every rank of the
    // shard group: what the encoding needs to agree on across it (FP8: one scale per tensor). Collective.
    void (*prepare)(void *ctx, const Fsdp *f);
    size_t (*shard_bytes)(void *ctx, const Fsdp *f, const FsdpUnit *u);
    // This rank's shard of u (u->params_shard) into shard_bytes bytes.
    void (*encode)(void *ctx, const Fsdp *f, const FsdpUnit *u, unsigned char *out);
    // Every rank's bytes (rank r's at r x shard_bytes) into u's full weights (u->shard x N elements).
    void (*decode)(void *ctx, const Fsdp *f, const FsdpUnit *u, const unsigned char *in, real *full);
    void *ctx;
    // true: encode and decode work through the module's FsdpMemory (any memory, device included);
    // false: they read and write host buffers themselves (host memory only).
    bool any_memory;
} FsdpWeightCodec;

// The bf16 all-gather (torchtitan's mixed-precision policy: parameters travel in bf16, gradients are
// reduce-scattered in fp32): each rank rounds its shard to bf16 (round to nearest even), the
// all-gather moves 2 bytes per weight instead of 4, and every rank widens the gathered bf16 back
// into the unit's full weights. The master weights, gradients and AdamW stay fp32. On the host the
// forward and backward then compute with bf16-rounded weights (a change of the numbers, like any
// mixed precision); a GPU model that casts its weights to bf16 anyway computes with the same bits as
// with the fp32 all-gather (round(widen(round(w))) == round(w)), for half the bytes.
extern const FsdpWeightCodec fsdp_bf16_codec;

// Where the shards, the gathered units and the gradient buffers live, and the few operations the
// module does on them itself (everything else is comm.h's, which takes host and device buffers
// alike). NULL in FsdpOptions: host memory, fsdp_host_memory. gpu/fsdp_device.c gives the device's
// (gpu_alloc, gpu_copy, the AdamW and sum-of-squares kernels), so the same module shards the GPU
// model: the all-gathers and reduce-scatters below are the same comm.h calls on device buffers.
typedef struct {
    const char *name;                                            // "host", "device"
    bool on_device;                                              // init and checkpoints go through upload/download
    void *(*alloc)(MemCategory category, size_t bytes);          // zeroed
    void (*free)(void *p);                                       // NULL is fine
    void (*copy)(void *dst, const void *src, size_t bytes);      // within this memory
    void (*zero)(void *p, size_t bytes);
    void (*upload)(void *dst, const void *host_src, size_t bytes);   // host -> this memory
    void (*download)(void *host_dst, const void *src, size_t bytes); // this memory -> host
    void (*add)(real *acc, const real *x, size_t n);             // acc += x
    void (*scale)(real *x, size_t n, double factor);             // x *= factor (clipping)
    void (*adamw)(real *params, const real *grads, real *m, real *v, size_t n, long long step, double lr,
                  const AdamWConfig *cfg);
    // The sum of squares of x (n); NULL: the host's sum_of_squares_by_tp_split. With tensor
    // parallelism the module sums parameter by parameter, to count the replicated norm weights once.
    double (*sum_of_squares)(const real *x, size_t n);
    // For the bf16 all-gather: x (n) rounded to bf16 bits (common/bf16.h's rounding), and back.
    void (*to_bf16)(uint16_t *out, const real *x, size_t n);
    void (*from_bf16)(real *out, const uint16_t *in, size_t n);
} FsdpMemory;
extern const FsdpMemory fsdp_host_memory;

typedef enum { RESHARD_DEFAULT, RESHARD_ALWAYS, RESHARD_NEVER } ReshardPolicy;
#define RESHARD_POLICY_NAMES "default|always|never"  // in enum order (--reshard-after-forward)

typedef struct {
    int stage;                // 1, 2 or 3
    ReshardPolicy reshard;    // stage 3: free a unit's gathered weights after its forward?
                              //   default: yes, except the root units (embedding, head) and the last
                              //   block, which backward needs first (as torchtitan does)
    bool prefetch;            // stage 3: all-gather the next unit while this one computes
    const FsdpWeightCodec *codec;  // stage 3: how the weights travel (NULL: fp32); must outlive the Fsdp
    const FsdpMemory *memory;      // where the buffers live (NULL: fsdp_host_memory); must outlive the Fsdp
} FsdpOptions;

struct FsdpUnit {
    int unit;                  // the table layer: LAYER_EMBEDDING, 0..n_layers-1, n_layers
    size_t offset, numel;      // the unit's range in the flat layout
    size_t shard;              // S: elements per rank (the unit is padded to S * N)
    real *params_shard;        // (S) this rank's weights; stages 1-2: a view into full
    real *grads_shard;         // (S) this rank's averaged gradients; stage 1: a view into full_grads
    real *adam_m, *adam_v;     // (S)
    real *full;                // (S * N) gathered weights; stage 3: NULL while resharded
    real *full_grads;          // (S * N) this rank's gradients; stages 2-3: only during backward
    real *reduced;             // (S) the reduce-scatter's output while it is in flight
    CommHandle *gather;        // all-gather into full (with a codec: into wire_full), in flight
    unsigned char *wire_shard, *wire_full;  // with a codec, while the gather is in flight: this rank's
                                            // encoded shard, and everyone's (shard_bytes x N)
    CommHandle *reduce, *replicate_reduce;  // reduce-scatter (+ HSDP all-reduce), in flight
    bool reshard_after_forward;
};

struct Fsdp {
    Model *model;
    Comm *shard_group;         // N ranks: dp_shard x cp
    Comm *replicate_group;     // HSDP: dp_replicate; NULL when there is one replica
    Comm *tp_group;            // with tensor parallelism (the model holds tp slices); else NULL
    FsdpOptions options;
    int n_units;               // n_layers + 2, in forward order: embedding, blocks, head
    FsdpUnit *units;
    bool sync;                 // this backward ends the step (the last micro-batch)
    int frontier;              // stage 3 prefetch: the furthest unit gathered ahead in this pass
    int blocks_full, most_blocks_full;  // stage 3: transformer blocks in full now, and the most at once
    int most_blocks_left;      // stage 3: the most blocks still in full when a backward ended (0: none kept)
    real *staging;             // (max S) stages 1-2: this rank's shard, sent by the all-gather
    const FsdpMemory *mem;     // options.memory, or &fsdp_host_memory
};

// ZeRO's slices, shared with the pipeline's ZeRO-1 (chapter 7). A buffer of numel elements padded to
// shard x N; the rank whose slice starts at element `mine` owns the real elements of
// [mine, mine + shard): fewer (or none) at the end, where the padding is.
size_t zero_slice_len(size_t numel, size_t shard, size_t mine);
// After the optimizer updated this rank's slice inside `full` (shard x N, rank r's slice at r x shard):
// all-gathers every rank's slice into everyone's full copy. The slice lives inside the receive
// buffer, so it is sent from `staging` (shard elements). full and staging are in mem's memory (NULL:
// the host's). Returns the handle of the all-gather.
CommHandle *zero_gather_slices_start(Comm *group, real *full, size_t shard, real *staging, const FsdpMemory *mem);

// Collective over shard_group (and replicate_group). The model must come from
// model_init_unallocated; every rank builds only its shards, asking init for just those elements
// (from the seed: a sharding-independent init, so the weights equal the single process's; from a
// checkpoint: only its shards' bytes are read). Installs the model's UnitStorage and hook.
Fsdp *fsdp_create(Model *model, Comm *shard_group, Comm *replicate_group, Comm *tp_group,
                  const FsdpOptions *options, const ParamSource *init);
void fsdp_free(Fsdp *f);

void fsdp_zero_grads(Fsdp *f);
// Around each micro-batch's model_backward. sync: the last micro-batch of the step (stage 1
// reduces only then; stages 2-3 reduce every micro-batch into the shards). end waits for the
// reductions still in flight.
void fsdp_begin_backward(Fsdp *f, bool sync);
void fsdp_end_backward(Fsdp *f);

// The global gradient norm (sum of squares of every shard, all-reduced over the shard group; with
// tensor parallelism also over tp, the replicated norm weights counted once).
double fsdp_grad_norm(Fsdp *f);
void fsdp_clip(Fsdp *f, double grad_norm, double max_norm);
// AdamW on this rank's shards; stages 1-2 then all-gather the updated weights into the full copy.
void fsdp_adamw_step(Fsdp *f, long long step, double lr, const AdamWConfig *cfg);

// This rank's full tensors (its table layout, total_numel: the tp slice with tensor parallelism) for checkpoints: gathered on every rank of the shard
// group. Gradients: gather only.
void fsdp_gather_full(Fsdp *f, StateKind kind, real *flat);
// The reverse, for --resume: takes this rank's shard of a full tensor.
void fsdp_load_full(Fsdp *f, StateKind kind, const real *flat);

// The ZeRO memory model per rank, in bytes: P parameters, N ranks sharing them, `stage` 0 (plain
// data parallelism: nothing sharded) to 3, with weight_bytes, grad_bytes and optim_bytes stored per
// parameter (fp32 here: 4, 4, 8; mixed precision with Adam: 2, 2, 12). Stage 1 divides the
// optimizer state by N, stage 2 also the gradients, stage 3 also the weights. The transient full
// units of stages 2-3 are not in it (see fsdp_print_memory_estimate). Chapter 11 plans with it.
typedef struct {
    double params, grads, optimizer;
} ZeroMemory;
ZeroMemory zero_memory_model(int stage, double P, double N, double weight_bytes, double grad_bytes,
                             double optim_bytes);

// Prints the memory model of this stage next to the measured peaks (bytes by category):
//   stage 1: params 4P, grads 4P, optimizer 8P/N
//   stage 2: params 4P, grads 4P/N + the units in flight, optimizer 8P/N
//   stage 3: params 4P/N + the gathered units, grads 4P/N + the units in flight, optimizer 8P/N
// (fp32: 4 bytes per weight and per gradient, 8 for AdamW's two moments; P = parameter count.)
// Stage 3 adds fsdp_print_block_counts' line.
void fsdp_print_memory_estimate(const Fsdp *f);
// Stage 3: the most transformer blocks in full at once, what the reshard policy and prefetch allow,
// and the most still in full when a backward ended (each block's backward frees it: 0). The GPU's
// sharded strategy prints it beside its own memory table.
void fsdp_print_block_counts(const Fsdp *f);
