// pipeline.h: pipeline parallelism, the executor of the schedules in schedule.h.
//
// The pp ranks each hold a slice of the layers and pass activations forward and gradients back.
// The L transformer blocks are cut into S = p * v stages of consecutive blocks, the embedding goes
// with stage 0 and the final norm + output projection (the head) with stage S-1. Uneven splits:
// the first L mod S stages get one block more (L = 4 on 3 stages: 2, 1, 1). Rank r holds the
// stages r, r + p, ... (its chunks); each stage's units (model.h) are one contiguous range of the
// table's flat layout, and the rank keeps, per chunk, only that range of weights, gradients and
// AdamW state, initialised element by element as the single process does (sharding-independent
// init), so the union of the stages is the single process's model bit for bit.
//
// A step runs this rank's action list (schedule.h) and nothing else:
//   FORWARD   allocates the (chunk, micro-batch)'s activations (acts_alloc below), runs the
//             stage (embedding on stage 0; the head and the loss on stage S-1)
//   BACKWARD  runs it backward (the last stage starts from d(loss)/M), then frees the activations
//             once their sends are done: memory holds what the schedule keeps in flight
//   transfers (B_micro * T * dim values each, the boundary) go to the comm stream, consecutive ones as one
//             comm_batch_start; a compute waits (a "pp wait" comm-wait slice) only for the batch
//             receiving its input
// With data parallelism each stage's chunks are DDP ranges over the data-parallel replicas of the
// stage; a chunk's all-reduces start during its last backward of the step. With --dp-shard (ZeRO-1,
// Megatron's distributed optimizer) each rank of the N-rank shard group keeps AdamW's state for 1/N of
// every chunk, updates that slice of the weights, and all-gathers the weights over the group.
//
//   Pipeline *pl = pipeline_create(&model, mesh->dim[MESH_PP], dp_or_NULL, &options, &init);
//   loss = pipeline_forward_backward(pl, inputs, targets);   // every rank: the mean over micro-batches
//   norm = pipeline_grad_norm(pl); pipeline_clip(pl, norm, max); pipeline_adamw_step(pl, step, lr, &adam);
//
// Which model the stages run is a table: the executor does its compute through a PipelineCompute
// (the stages' forward and backward, the activations of a (chunk, micro-batch), the boundary
// tensors) and its own memory work -- the chunks' weights, gradients and AdamW state, the inboxes --
// through chapter 3's FsdpMemory. Left NULL in the options: reference_cpu's model and host memory
// (pipeline_host_compute, fsdp_host_memory). gpu/pipeline_device.h gives the GPU model's stage entry
// points and device memory, so the same executor and schedules run the GPU model (gpu/strategy.c,
// --device cuda --pp).
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "chapters/02_data_parallel/ddp.h"
#include "chapters/03_fsdp/fsdp.h"
#include "chapters/07_pipeline_parallel/schedule.h"
#include "common/comm.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/model.h"

// The stage compute the executor calls. acts: one (chunk, micro-batch)'s activations, opaque here.
typedef struct {
    const char *name;          // "reference_cpu", "gpu"
    // What one boundary transfer moves (a stage's output, or the gradient of a stage's input: B_micro*T
    // rows of dim, this tp rank's rows with sequence parallelism): count elements of type.
    CommDtype boundary_type;
    size_t (*boundary_count)(void *ctx, int B, int T);
    // The activations of a stage holding blocks [first, end) for one micro-batch, and their release.
    void *(*acts_alloc)(void *ctx, int B, int T, ActCheckpoint ac, int first, int end);
    void (*acts_free)(void *ctx, void *acts);
    // The boundary buffers inside acts: where a received stage input goes (block first's input),
    // the stage's output the next stage receives (block end's input), and dx (the gradient of the
    // stage's output on entry to backward, of its input after).
    void *(*stage_input)(void *ctx, void *acts, int first);
    void *(*stage_output)(void *ctx, void *acts, int end);
    void *(*dx)(void *ctx, void *acts);
    // reference_cpu/model.h's pieces: embedding (stage 0), blocks [first, end), head + loss (the
    // last stage: returns the micro-batch's mean loss on the host), and backward in reverse.
    void (*embed_forward)(void *ctx, void *acts, const int *inputs);
    void (*blocks_forward)(void *ctx, void *acts, int first, int end);
    double (*head_forward)(void *ctx, void *acts, const int *targets);
    void (*head_backward)(void *ctx, void *acts, double dloss);
    void (*blocks_backward)(void *ctx, void *acts, int first, int end);
    void (*embed_backward)(void *ctx, void *acts, const int *inputs);
} PipelineCompute;
// reference_cpu's model: ctx is the Model given to pipeline_create.
extern const PipelineCompute pipeline_host_compute;

typedef struct {
    PpScheduleKind schedule;
    int microbatches;          // M per step on this data-parallel rank
    int virtual_stages;        // v: stages per rank (Interleaved1F1B)
    int micro_batch;           // sequences per micro-batch
    int seq_len;
    ActCheckpoint ac;
    size_t bucket_bytes;       // DDP buckets (with data parallelism)
    bool overlap;              // DDP all-reduces during backward
    const char *dot_path;      // world rank 0 writes the schedule as Graphviz here (NULL: no)
    Comm *tp_group;            // with tensor parallelism (the model holds tp slices, tp_install done); else NULL
    Comm *shard_group;         // ZeRO-1 (--dp-shard): the AdamW state sharded over these ranks; else NULL
    const PipelineCompute *compute;  // NULL: pipeline_host_compute on the Model
    void *compute_ctx;               // compute's ctx (with compute NULL: unused)
    const FsdpMemory *memory;        // the chunks' buffers, inboxes and ZeRO-1 staging; NULL: fsdp_host_memory
} PipelineOptions;

typedef struct {
    int stage;                 // virtual stage: rank + chunk * p
    int first_layer, end_layer;  // blocks [first_layer, end_layer)
    int first_unit, last_unit; // table layers, with LAYER_EMBEDDING on stage 0 and n_layers (head) last
    size_t offset, numel;      // the units' range of the flat layout
    real *params, *grads;      // (numel, padded to shard * N with zeros); in options.memory
    real *adam_m, *adam_v;     // (shard): this rank's slice [mine, mine + shard) (the whole chunk without ZeRO-1)
    size_t shard, mine;        // ZeRO-1 over N ranks: shard = ceil(numel / N); unsharded: numel, 0
    int last_backward;         // index of this chunk's last BACKWARD in the action list (DDP syncs then)
} PipelineChunk;

// One (chunk, micro-batch)'s activations and transfer bookkeeping, live from its receive or forward
// to the end of its last send.
typedef struct {
    void *acts;                // from compute->acts_alloc
    bool live, backward_done;
    void *inbox;               // (boundary) a received stage input, until the forward copies it
    int sends_left;            // transfers from acts not posted yet
    int recv_batch;            // the batch receiving into inbox or acts.dx (0: none)
    int send_batch;            // the last batch sending from acts
} PipelineSlot;

typedef struct {
    Model *model;
    Comm *pp;
    int p, rank, v, m, n_stages;
    PipelineOptions options;
    const PipelineCompute *compute;
    void *ctx;                 // compute's
    const FsdpMemory *mem;     // where the chunks' buffers and the inboxes live
    PipelineChunk *chunks;     // (v)
    PpActionList actions;      // this rank's list
    Ddp *ddp;                  // NULL without data parallelism
    PipelineSlot *slots;       // (v * m)
    // The comm batches of this step, numbered from 1 in stream order; the stream completes them in
    // that order, so "waited through n" is one number.
    CommHandle **batches;      // (actions.count + 1)
    int n_batches, waited;
    CommP2P *pending;          // transfers gathered for the next batch
    int n_pending;
    double loss_sum;           // last stage: the micro-batch losses of this step
    const int *inputs, *targets;
} Pipeline;

// NULL if the model and layout can be pipelined, else the rule broken: at least one block per
// stage; untied embeddings (tied, the head on the last stage would need the first stage's table).
const char *pipeline_check(const ModelConfig *cfg, int p, int v);
// Blocks [first, end) of stage `stage` out of n_stages (the first L mod S stages get one more).
void pipeline_stage_layers(int n_layers, int n_stages, int stage, int *first, int *end);

// Collective over pp (and dp). model: from model_init_unallocated; the pipeline installs its
// UnitStorage. dp: the stage's data-parallel group, or NULL. Builds and validates the schedule
// (exits with status 1 if the lists fail pp_validate) and logs the layout, the activations in
// flight and the ideal bubble.
Pipeline *pipeline_create(Model *model, Comm *pp, Comm *dp, const PipelineOptions *options, const ParamSource *init);
void pipeline_free(Pipeline *pl);

// One step's forward and backward of every micro-batch. inputs and targets: (M * B_micro, T), this
// data-parallel rank's slice, micro-batch k in rows [k B_micro, (k+1) B_micro) (stage 0 reads the
// inputs, stage S-1 the targets). Gradients are zeroed first and hold d(mean loss)/d(params) after,
// averaged over dp. Returns the mean loss over the micro-batches, the same on every pp rank.
double pipeline_forward_backward(Pipeline *pl, const int *inputs, const int *targets);

// sqrt of the all-reduce over pp of each stage's sum of squares.
double pipeline_grad_norm(Pipeline *pl);
void pipeline_clip(Pipeline *pl, double grad_norm, double max_norm);
void pipeline_adamw_step(Pipeline *pl, long long step, double lr, const AdamWConfig *cfg);

// Full tensors (table layout, total_numel) for checkpoints: every stage's range sent to pp rank 0,
// which alone gets the result (the other ranks' flat is left as is). Collective over pp.
void pipeline_gather_full(Pipeline *pl, StateKind kind, real *flat);
// The reverse, for --resume: every rank takes its ranges of a full tensor (not the gradients).
void pipeline_load_full(Pipeline *pl, StateKind kind, const real *flat);
