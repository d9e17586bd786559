// trainer.h: the trainer's contract. Every way of holding and updating the training state (the
// single process, DDP, ZeRO-1/2/3 and HSDP, pipeline stages) fills in one Strategy, a table of
// functions; the step loop (train.c) calls the table and nothing else, so a layout is chosen once,
// at setup, and never by a branch inside a step. Capabilities that act on every layout (a dump of
// the reference's numbers, the step-1 gradient dump) are TrainerExtensions, called at fixed points
// of the step. docs/ARCHITECTURE.md shows where each chapter plugs in.
//
//   one step (train.c, train_step):
//     s->zero_grads(s)
//     loss = s->forward_backward(s, &batch)         micro-batches: begin_backward / end_backward
//                                                    around each backward, finish_backward after all
//     loss = mean over the data-parallel ranks
//     norm = s->grad_norm(s)                         the global norm, whatever the layout
//     every extension's after_gradients(...)
//     s->clip(s, norm, max); s->optimizer_step(s, step, lr, &adamw)
//     every extension's after_step(...)
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "chapters/03_fsdp/fsdp.h"
#include "chapters/08_context_parallel/cp.h"
#include "common/mesh.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/model.h"

// One optimizer step's tokens on this rank: n_micro micro-batches of `micro` sequences of T tokens,
// micro-batch k in rows [k micro, (k+1) micro) of inputs and targets (n_micro * micro, T).
typedef struct {
    const int *inputs, *targets;
    int n_micro, micro, T;
    long long step;
} StepBatch;

typedef struct Strategy Strategy;
struct Strategy {
    const char *name;  // "single", "ddp", "fsdp", "hsdp", "pipeline"
    Model *model;
    void *impl;        // the chapter module's state (Ddp, Fsdp, Pipeline) or the single process's
    // Forward and backward of every micro-batch in b; afterwards the gradients hold d(mean loss)/d(params)
    // averaged over the data-parallel ranks. Returns this rank's mean loss over its micro-batches.
    double (*forward_backward)(Strategy *s, const StepBatch *b);
    // Around each micro-batch's backward (last: the step's final one), and once after the last.
    void (*begin_backward)(Strategy *s, bool last);
    void (*end_backward)(Strategy *s);
    void (*finish_backward)(Strategy *s);
    void (*zero_grads)(Strategy *s);
    double (*grad_norm)(Strategy *s);  // the global gradient norm, the same on every rank
    void (*clip)(Strategy *s, double grad_norm, double max_norm);
    void (*optimizer_step)(Strategy *s, long long step, double lr, const AdamWConfig *cfg);
    // This rank's state of one kind in its local layout (the tp slice in table order, every unit),
    // gathered from wherever the layout keeps it; and the reverse, for --resume. Collective.
    void (*gather_full)(Strategy *s, StateKind kind, real *local_flat);
    void (*load_full)(Strategy *s, StateKind kind, const real *local_flat);
    void (*report_memory)(const Strategy *s);  // the layout's memory model next to the measured peaks
    size_t (*memory_in_use)(const Strategy *s);  // bytes held now, for the step line: host or device
    void (*free)(Strategy *s);
    ModelActs acts;  // one micro-batch's activations (the pipeline keeps its own per micro-batch in flight)
};

// Everything one rank trains with.
typedef struct {
    Model model;
    Strategy *strategy;
    Mesh *mesh;
    int *inputs, *targets;  // this rank's slice of the step's batch (n_micro * micro, T)
    int *full_inputs, *full_targets;  // the same rows, whole sequences (n_micro * micro, cp_layout.T)
    int B, T;               // global batch, tokens per sequence on this rank (the whole length / cp)
    CpLayout cp_layout;     // which tokens of each sequence this rank holds (all of them when cp = 1)
    ContextParallel *cp;    // NULL when cp = 1
    int micro, n_micro;     // sequences per micro-batch, micro-batches per step on this rank
    int dp_index, dp_size;
} Trainer;

typedef struct {
    double loss, grad_norm, lr;
} StepResult;

// A capability that watches or acts on every step, whatever the layout. NULL members are skipped.
typedef struct {
    const char *name;
    void *ctx;
    // After the gradients are final and their norm is known, before clipping.
    void (*after_gradients)(void *ctx, Trainer *t, const StepBatch *b, const StepResult *r);
    // After the optimizer step.
    void (*after_step)(void *ctx, Trainer *t, const StepBatch *b, const StepResult *r);
    // When training ends (write outputs, free ctx).
    void (*finish)(void *ctx, Trainer *t);
} TrainerExtension;

typedef enum { DEVICE_CPU, DEVICE_CUDA } Device;
#define DEVICE_NAMES "cpu|cuda"  // in enum order (--device)

// How the layout is built: the mesh's degrees say which strategy, these the details.
typedef struct {
    int zero_stage;            // with dp_shard > 1
    int reshard;               // ReshardPolicy (chapter 3)
    bool overlap;              // DDP all-reduces during backward; FSDP prefetch
    double bucket_mb;          // DDP buckets
    int ac;                    // ActCheckpoint (chapter 5)
    bool sequence_parallel;    // with tp > 1
    int pp_schedule;           // PpScheduleKind (chapter 7)
    int pp_virtual_stages;
    const char *pp_schedule_dot;
    int cp_mode;               // CpMode (chapter 8)
    bool cp_load_balance;      // zigzag split
    bool cuda_sync_debug;      // --device cuda: synchronize after every kernel launch, name the failing one
    bool fp8;                  // --device cuda: the GPU model's FP8 linears (the CPU layouts take the Fp8 hook)
    int fp8_recipe;            // Fp8Recipe (chapter 9)
    const FsdpWeightCodec *weight_codec;  // ZeRO-3: how weights travel in the all-gather (chapter 3's bf16,
                                          // chapter 9's FP8); NULL: fp32
} LayoutOptions;

// Builds t->model (this tp rank's slice, sharded or staged as the layout needs, each rank asking
// init for only the elements it holds: the seed, or a Hugging Face checkpoint) and t->strategy for
// t->mesh. Logs the layout.
void trainer_setup_layout(Trainer *t, const ModelConfig *cfg, AttentionImpl attention, const ParamSource *init,
                          const LayoutOptions *options);
// --sequence-parallel splits the tokens of a micro-batch (on one cp rank) over the tp ranks: exits 2
// (fatal_input) unless they divide evenly. train.c checks it before any work; both devices' layouts
// check it again for callers that build a layout without train.c's checks.
void trainer_check_sequence_parallel(uint64_t micro_batch_tokens, int tp);
// --device cuda (gpu/strategy.c): the one-GPU model behind the same contract; single process, DDP, and
// ZeRO-1/2/3 and HSDP (chapter 3's module on device buffers).
// Linked into build/train-cuda in place of chapters/10_trainer/no_cuda.c, which build/train uses.
// trainer_cuda_start(), first thing under --device cuda: in build/train it replaces the process with
// build/train-cuda, same arguments (or exits 2 when there is none); in build/train-cuda it checks the
// GPU library's settings from the environment (LLAMA_ATTN_TILE_ROWS: gpu/ops.h), exiting 2 on a bad
// one before any work.
void trainer_cuda_start(char **argv);
Strategy *cuda_strategy_create(Trainer *t, const ModelConfig *cfg, const ParamSource *init, const LayoutOptions *o);
void trainer_free_strategy(Trainer *t);
// The state of one kind in the full table's layout, on every rank (pipeline: pp rank 0 only).
void trainer_full_state(Trainer *t, StateKind kind, real *full);
// Takes this rank's part of a full-layout state (the reverse, for --resume).
void trainer_load_full_state(Trainer *t, StateKind kind, const real *full);
