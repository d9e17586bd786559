// strategy.c: `--device cuda`, the trainer's contract (chapters/10_trainer/trainer.h) filled in by
// the one-GPU model (gpu/model.h): bf16 compute, fp32 master weights, gradients and AdamW moments
// on the device. With --dp-replicate > 1 it is DDP: each rank runs its slice of the batch and the
// gradients are averaged over the data-parallel ranks after the last micro-batch: comm.h's
// all-reduce on the device buffer, which the device backend runs (gpu/comm_device.h: NCCL with a GPU
// per rank, else staged through host memory, so ranks may share one GPU). Also --ac full and
// --ac selective (the GPU model recomputes blocks, or their norms and SwiGLU), --fp8 (tensorwise:
// gpu/fp8.h's linears) and --trace (the GPU's timeline).
//
// With --dp-shard N it is ZeRO-1/2/3 (and HSDP with --dp-replicate too): chapter 3's module itself
// (chapters/03_fsdp/fsdp.h), given device memory (gpu/fsdp_device.h), on the GPU model built without
// its own weights (gpu_model_init_sharded). fsdp_create installs its UnitStorage and grads-ready hook
// on the trainer's Model, as it does for the CPU model; this file hands the same two to the GPU
// model, which asks for each unit's fp32 weights before the unit runs (stage 3: the all-gather,
// prefetched; in bf16 by default, chapter 3's bf16 codec) and casts them to bf16, and reports each
// unit's gradients as they are final (stages 2-3: the reduce-scatter). With --fp8 the FP8 linears
// cast each projection from its unit's gathered fp32 weights. The optimizer step, the norm, clipping
// and the checkpoint gather/load are the module's functions.
//
// With --tp N it is Megatron tensor parallelism (chapter 6) on the GPU model built from this tp rank's
// shards (gpu_model_init_tp; the sums over the tp group on device buffers, model.h "Tensor
// parallelism"), alone or with --dp-replicate (DDP over mesh->dp, the ranks holding the same shards).
// The gradient norm counts the replicated norm weights once (gpu_model_grad_sum_sq); checkpoints and
// dumps go through trainer_full_state's tp_gather_full, on the table of t->model (model_init_tp's,
// without weights). With --dp-shard too: chapter 3's module shards this tp rank's table (2D, FSDP x
// TP, the norm over both groups). With --fp8 the FP8 linears run on the shards, each operand's amax
// MAX-reduced over the tp group where tp splits it (gpu/fp8.h's GpuFp8Groups). With
// --sequence-parallel the residual stream is split by tokens over the tp group (model.h "Sequence
// parallelism": all-gathers before the column-parallel projections, reduce-scatters after the
// row-parallel ones). With --pp and with --cp too (below).
//
// With --pp N it is pipeline parallelism, every schedule of chapter 7 (GPipe, 1F1B, Interleaved1F1B):
// chapter 7's executor itself (chapters/07_pipeline_parallel/pipeline.h), given the GPU model's stage
// compute and device memory (gpu/pipeline_device.h), on the GPU model built without its own weights
// or per-block activations (gpu_model_init_stages). pipeline_create installs its UnitStorage (the
// chunks' device buffers) on the trainer's Model; the GPU model gets the same, and casts each unit to
// bf16 as it runs, as under --dp-shard (--fp8: cast to FP8 from them). With --dp-replicate, chapter
// 2's DDP over the chunks' device buffers (pipeline_create's). With --ac, each stage keeps what the
// policy keeps and recomputes the rest before each block's backward. With --tp (and
// --sequence-parallel) each stage's model holds this tp rank's shards, the stages exchange this tp
// rank's rows, and the norm sums the chunks' squares with the tp split (pipeline.c's
// chunk_sum_of_squares on the device's sum). With --dp-shard (--zero-stage 1) it is chapter 7's
// ZeRO-1 over the stages: the DDP all-reduce, AdamW on this rank's slice of each chunk, the updated
// slices all-gathered through device staging.
//
// With --cp N the GPU model's attention runs chapter 8's ring on device buffers (gpu/cp_device.h,
// gpu_model_set_context_parallel), and the layout above it averages over dp x cp (DDP) or shards
// over dp_shard x cp (FSDP), as on the CPU. With --fp8 the amaxes are MAX-reduced over dp x cp (the
// sequence's chunks split a micro-batch's tokens as the replicas do). Ring only. With --pp each stage's
// attention runs the ring, and the executor's DDP averages over dp x cp. With --tp the ring runs on
// this tp rank's heads.
//
// Each rank uses device (local rank mod device count), the local rank being its index among the
// ranks on its host (comm_local_rank): one rank per GPU under mpirun on every node, whatever the
// mapping of ranks to nodes, or several ranks sharing a GPU when a node has fewer.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/09_fp8/fp8.h"
#include "chapters/10_trainer/trainer.h"
#include "common/log.h"
#include "common/trace.h"
#include "gpu/activity.h"
#include "gpu/comm_device.h"
#include "gpu/cp_device.h"
#include "gpu/dist.h"
#include "gpu/fp8.h"
#include "gpu/fsdp_device.h"
#include "gpu/model.h"
#include "gpu/pipeline_device.h"
#include "gpu/runtime.h"
#include "gpu/timeline.h"

typedef struct {
    GpuModel m;
    Comm *dp;    // DDP: the replicas; NULL with one replica, or sharded
    Fsdp *fsdp;  // --dp-shard: chapter 3's module on device memory; NULL otherwise
    Pipeline *pipeline;  // --pp: chapter 7's executor on the GPU model's stages; NULL otherwise
    ContextParallel *cp; // --cp: chapter 8's ring on device buffers; NULL otherwise
    double *losses;      // (n_losses) device: each micro-batch's mean loss in this step
    int n_losses;
} GpuTraining;

// chapters/10_trainer/strategy.c's micro-batch loop on the GPU model: each backward between the
// layout's begin_backward / end_backward (chapter 3's hooks under --dp-shard; nothing to do for one
// GPU or DDP), finish_backward after the last. Everything is queued: each micro-batch's loss is
// copied on the stream into g->losses, and the host reads them all with one wait at the end (the
// same sum, in the same order, as reading each at once). A loss that is not finite stops the run
// there, before the optimizer step.
static double gpu_microbatch_loop(Strategy *s, const StepBatch *b) {
    GpuTraining *g = s->impl;
    size_t rows = (size_t)b->micro * b->T;
    if (g->n_losses < b->n_micro) {
        gpu_free(g->losses);
        g->losses = gpu_alloc(MEM_OTHER, sizeof(double) * b->n_micro);
        g->n_losses = b->n_micro;
    }
    for (int mb = 0; mb < b->n_micro; mb++) {
        gpu_model_forward_queued(&g->m, b->inputs + mb * rows, b->targets + mb * rows);
        gpu_copy(g->losses + mb, g->m.loss, sizeof(double));
        s->begin_backward(s, mb == b->n_micro - 1);
        gpu_model_backward(&g->m, 1.0 / b->n_micro);
        s->end_backward(s);
    }
    s->finish_backward(s);
    double *losses = mem_alloc(MEM_OTHER, sizeof(double) * b->n_micro), loss_sum = 0;
    gpu_download(losses, g->losses, sizeof(double) * b->n_micro);
    for (int mb = 0; mb < b->n_micro; mb++) {
        if (!isfinite(losses[mb]))
            fatal("step %lld: the loss of micro-batch %d is %g; stopping before the optimizer step (try a lower --lr)",
                  b->step, mb, losses[mb]);
        loss_sum += losses[mb];
    }
    mem_free(losses);
    return loss_sum / b->n_micro;
}
static void no_begin_backward(Strategy *s, bool last) { (void)s, (void)last; }
static void no_backward_hook(Strategy *s) { (void)s; }
// One GPU or DDP: the gradients averaged over the replicas after the last micro-batch. The
// optimizer's kernels, queued after the wait, read the average.
static void replicas_finish_backward(Strategy *s) {
    GpuTraining *g = s->impl;
    if (g->dp) comm_all_reduce(g->dp, g->m.grads, g->m.table.total_numel, COMM_FLOAT32, COMM_AVG);
}

static void cuda_zero_grads(Strategy *s) { gpu_model_zero_grads(&((GpuTraining *)s->impl)->m); }

// Under --tp: the whole model's norm (the split entries summed over the tp group, norms counted once).
static double cuda_grad_norm(Strategy *s) { return sqrt(gpu_model_grad_sum_sq(&((GpuTraining *)s->impl)->m)); }

static void cuda_clip(Strategy *s, double grad_norm, double max_norm) {
    GpuModel *m = &((GpuTraining *)s->impl)->m;
    double coef = clip_coefficient(grad_norm, max_norm);  // clip_by_global_norm's factor
    if (coef < 1) gpu_scale_inplace(m->grads, m->table.total_numel, coef);
}

static void cuda_optimizer_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    GpuModel *m = &((GpuTraining *)s->impl)->m;
    size_t n = m->table.total_numel;
    gpu_timeline_begin("adamw", "optimizer");
    if (m->params_bf16) gpu_adamw_step_bf16_copy(m->params, m->params_bf16, m->grads, m->adam_m, m->adam_v, n, step, lr, cfg);
    else gpu_adamw_step(m->params, m->grads, m->adam_m, m->adam_v, n, step, lr, cfg);
    gpu_timeline_end();
    gpu_timeline_flush();  // the step's GPU slices onto the trace (with tracing off: nothing)
}

static float *cuda_state(GpuModel *m, StateKind kind) {
    float *states[] = {[STATE_WEIGHTS] = m->params, [STATE_ADAM_M] = m->adam_m, [STATE_ADAM_V] = m->adam_v,
                       [STATE_GRADS] = m->grads};
    return states[kind];
}

// Checkpoints and dumps are fp32 on the host (real is float in the build that links the GPU).
static void cuda_gather_full(Strategy *s, StateKind kind, real *local_flat) {
    GpuModel *m = &((GpuTraining *)s->impl)->m;
    gpu_download(local_flat, cuda_state(m, kind), sizeof(float) * m->table.total_numel);
}

static void cuda_load_full(Strategy *s, StateKind kind, const real *local_flat) {
    GpuModel *m = &((GpuTraining *)s->impl)->m;
    size_t n = m->table.total_numel;
    gpu_upload(cuda_state(m, kind), local_flat, sizeof(float) * n);
    if (kind == STATE_WEIGHTS) gpu_model_refresh_compute_copy(m);
}

static void cuda_report_memory(const Strategy *s) { gpu_memory_report(); }
static size_t cuda_memory_in_use(const Strategy *s) { return gpu_mem_current_total(); }  // the device's

// ---- sharded: ZeRO-1/2/3 and HSDP through chapter 3's module --------------------------------------------
static Fsdp *fsdp_of(const Strategy *s) { return ((GpuTraining *)s->impl)->fsdp; }
static void sharded_begin_backward(Strategy *s, bool last) { fsdp_begin_backward(fsdp_of(s), last); }
static void sharded_end_backward(Strategy *s) { fsdp_end_backward(fsdp_of(s)); }
static void sharded_zero_grads(Strategy *s) { fsdp_zero_grads(fsdp_of(s)); }
static double sharded_grad_norm(Strategy *s) { return fsdp_grad_norm(fsdp_of(s)); }
static void sharded_clip(Strategy *s, double grad_norm, double max_norm) { fsdp_clip(fsdp_of(s), grad_norm, max_norm); }
static void sharded_optimizer_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    gpu_timeline_begin("adamw", "optimizer");
    fsdp_adamw_step(fsdp_of(s), step, lr, cfg);  // stages 1-2: and the updated weights' all-gather
    gpu_timeline_end();
    gpu_timeline_flush();
}
static void sharded_gather_full(Strategy *s, StateKind kind, real *local_flat) {
    fsdp_gather_full(fsdp_of(s), kind, local_flat);
}
// The bf16 compute copy needs nothing: each unit is cast from its fp32 weights whenever it runs.
static void sharded_load_full(Strategy *s, StateKind kind, const real *local_flat) {
    fsdp_load_full(fsdp_of(s), kind, local_flat);
}
static void sharded_report_memory(const Strategy *s) {
    gpu_memory_report();
    fsdp_print_block_counts(fsdp_of(s));  // stage 3: blocks in full at once (chapter 3)
}

// The CPU path's line (trainer_setup_layout), for the same layout.
static void log_tp(const GpuModel *m, const ModelConfig *cfg) {
    const LocalShape *local = &m->local;
    log_info("tp: %d ranks%s; this one holds %d of %d heads, %d of %d kv heads, %d of %d ffn columns, vocab rows "
             "[%d, %d) (sums over the tp group in fp32 on device buffers, %s backend)",
             m->tp_size, m->sequence_parallel ? " with sequence parallel" : "", local->n_heads, cfg->n_heads,
             local->n_kv_heads, cfg->n_kv_heads, local->ffn_dim, cfg->ffn_dim, local->vocab_start,
             local->vocab_start + local->vocab_size, gpu_comm_backend_name());
    if (m->sequence_parallel)
        log_info("sequence parallel on the GPU: %d of the %d rows of the residual stream here (all-gather before "
                 "wq wk wv, w1 w3 and the head; reduce-scatter after wo and w2)", m->rows, m->B * m->T);
}

// This rank's place in the tp group, for the GPU model.
static GpuTensorParallel tp_of(const Trainer *t, const LayoutOptions *o) {
    const Mesh *mesh = t->mesh;
    return (GpuTensorParallel){mesh->degree[MESH_TP] > 1 ? mesh->dim[MESH_TP] : NULL, mesh->degree[MESH_TP],
                               mesh->coord[MESH_TP], o->sequence_parallel};
}

// The ranks among which a micro-batch's tokens are split (dp x cp: replicas, shards and the sequence's
// chunks), over which --fp8's activation and output-gradient amaxes are MAX-reduced so that every rank
// casts with the scales of the whole micro-batch, as one GPU does; NULL when there is one.
static Comm *fp8_token_group(const Trainer *t) { return comm_size(t->mesh->dp_cp) > 1 ? t->mesh->dp_cp : NULL; }

// The module over the shard group (dp_shard; HSDP: averaged over dp_replicate too), its storage and
// grads-ready hook handed to the GPU model. Every rank asks init for its shards only.
static void create_sharded(GpuTraining *g, Trainer *t, const ModelConfig *cfg, const ParamSource *init,
                           const LayoutOptions *o) {
    Mesh *mesh = t->mesh;
    GpuTensorParallel tp = tp_of(t, o);
    gpu_model_init_sharded_tp(&g->m, cfg, GPU_BF16, t->micro, t->T, (ActCheckpoint)o->ac, &tp);
    if (tp.size > 1) log_tp(&g->m, cfg);
    FsdpOptions options = {o->zero_stage, (ReshardPolicy)o->reshard, o->overlap, o->weight_codec, &gpu_fsdp_memory};
    Comm *replicate = mesh->degree[MESH_DP_REPLICATE] > 1 ? mesh->dim[MESH_DP_REPLICATE] : NULL;
    g->fsdp = fsdp_create(&t->model, mesh->dp_shard_cp, replicate, tp.group, &options, init);
    g->m.fp8 = o->fp8;  // each projection cast to FP8 from its unit's gathered fp32 weights
    g->m.fp8_tokens = fp8_token_group(t);
    g->m.storage = t->model.storage;
    g->m.grads_ready = t->model.grads_ready;
    g->m.grads_ready_ctx = t->model.grads_ready_ctx;
    log_info("%s on the GPU: zero stage %d over %d shards%s (chapter 3's module on device buffers, %s backend); "
             "%s, each unit cast to bf16 where it runs; gradients reduce-scattered in fp32",
             replicate ? "hsdp" : "fsdp", o->zero_stage, comm_size(mesh->dp_shard_cp),
             replicate ? " x replicated" : "", gpu_comm_backend_name(),
             o->weight_codec == &fsdp_bf16_codec ? "weights all-gathered in bf16" : "fp32 weights gathered");
}

static void cuda_free(Strategy *s) {
    GpuTraining *g = s->impl;
    fsdp_free(g->fsdp);  // NULL is fine
    if (g->pipeline) pipeline_free(g->pipeline);
    cp_free(g->cp);  // NULL is fine
    gpu_activity_stop();
    log_info("device: %lld host waits for the stream over the run", gpu_host_waits());
    gpu_free(g->losses);
    gpu_model_free(&g->m);
    gpu_comm_backend_shutdown();
    gpu_shutdown();
    free(g);
}

// --fp8 on the GPU: tensorwise, and every dimension of the linears' GEMMs (the tokens of a micro-batch,
// the model's width, the heads' widths and the FFN's) passing gpu_fp8_gemm's shape rule.
static void check_fp8(const Trainer *t, const ModelConfig *c, const LayoutOptions *o) {
    if (o->fp8_recipe != FP8_TENSORWISE)
        fatal_input("--device cuda --fp8: the GPU's FP8 linears scale tensorwise only so far (not --fp8-recipe %s)",
                    o->fp8_recipe == FP8_ROWWISE ? "rowwise" : "delayed");
    int hd = model_head_dim(c), tp = t->mesh->degree[MESH_TP];  // under TP, one rank's share of each
    struct {
        const char *what;
        int value;
    } dims[] = {{"tokens per micro-batch", t->micro * t->T}, {"dim", c->dim},
                {tp > 1 ? "n_heads x head_dim / tp" : "n_heads x head_dim", c->n_heads * hd / tp},
                {tp > 1 ? "n_kv_heads x head_dim / tp" : "n_kv_heads x head_dim", c->n_kv_heads * hd / tp},
                {tp > 1 ? "ffn_dim / tp" : "ffn_dim", c->ffn_dim / tp}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (gpu_fp8_gemm_shape_error(dims[i].value, GPU_FP8_GEMM_MULTIPLE, GPU_FP8_GEMM_MULTIPLE))
            fatal_input("--device cuda --fp8: %s is %d; " GPU_FP8_GEMM_RULE, dims[i].what, dims[i].value);
}

static void refuse_layout(const Trainer *t, const LayoutOptions *o) {
    const Mesh *mesh = t->mesh;
    if (o->sequence_parallel) trainer_check_sequence_parallel((uint64_t)t->micro * t->T, mesh->degree[MESH_TP]);
    if (mesh->degree[MESH_CP] > 1) {
        if (o->cp_mode != CP_RING)
            fatal_input("--device cuda --cp %d --cp-mode alltoall: the GPU runs chapter 8's ring (its all-to-all's "
                        "layout moves are host loops); use --cp-mode ring", mesh->degree[MESH_CP]);
    }
}

// With tracing on: the regions the model marks on "cuda:compute" (always), and every kernel on its
// stream's track where CUPTI can record them.
static void start_gpu_timeline(void) {
    if (!trace_enabled()) return;
    char why[256];
    if (gpu_activity_start(why, sizeof why))
        log_info("GPU timeline: the marked regions, and every kernel, copy and fill per stream (CUPTI)");
    else log_info("GPU timeline: the marked regions, timed by CUDA events (per-kernel records off: %s)", why);
}

// ---- pipelined: chapter 7's executor on the GPU model's stages ------------------------------------------
static Pipeline *pipeline_of(const Strategy *s) { return ((GpuTraining *)s->impl)->pipeline; }
static double pipelined_forward_backward(Strategy *s, const StepBatch *b) {
    return pipeline_forward_backward(pipeline_of(s), b->inputs, b->targets);  // zeroes the gradients itself
}
static double pipelined_grad_norm(Strategy *s) { return pipeline_grad_norm(pipeline_of(s)); }
static void pipelined_clip(Strategy *s, double grad_norm, double max_norm) {
    pipeline_clip(pipeline_of(s), grad_norm, max_norm);
}
static void pipelined_optimizer_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    gpu_timeline_begin("adamw", "optimizer");
    pipeline_adamw_step(pipeline_of(s), step, lr, cfg);
    gpu_timeline_end();
    gpu_timeline_flush();
}
// Checkpoints: every stage's chunks downloaded and sent to pp rank 0 (pipeline_gather_full).
static void pipelined_gather_full(Strategy *s, StateKind kind, real *local_flat) {
    pipeline_gather_full(pipeline_of(s), kind, local_flat);
}
// The bf16 compute copy needs nothing: each unit is cast from its fp32 weights whenever it runs.
static void pipelined_load_full(Strategy *s, StateKind kind, const real *local_flat) {
    pipeline_load_full(pipeline_of(s), kind, local_flat);
}

// The executor over the pp group with the GPU model's stage compute and device memory; its storage
// (the chunks' fp32 device buffers) handed to the GPU model. Every rank initialises its chunks only.
static void create_pipelined(GpuTraining *g, Trainer *t, const ModelConfig *cfg, const ParamSource *init,
                             const LayoutOptions *o) {
    GpuTensorParallel tp = tp_of(t, o);
    bool sharded = t->mesh->degree[MESH_DP_SHARD] > 1;  // ZeRO-1 over the stages' data-parallel ranks
    gpu_model_init_stages(&g->m, cfg, GPU_BF16, t->micro, t->T, (ActCheckpoint)o->ac, &tp);
    if (tp.size > 1) log_tp(&g->m, cfg);
    g->m.fp8 = o->fp8;  // each projection cast to FP8 from its unit's fp32 weights (the chunk's buffers)
    g->m.fp8_tokens = fp8_token_group(t);  // the replicas' (and cp ranks') amaxes reduced as without stages
    PipelineOptions options = {.schedule = (PpScheduleKind)o->pp_schedule, .microbatches = t->n_micro,
                               .virtual_stages = o->pp_virtual_stages, .micro_batch = t->micro, .seq_len = t->T,
                               .ac = (ActCheckpoint)o->ac, .bucket_bytes = (size_t)(o->bucket_mb * 1048576.0),
                               .overlap = o->overlap, .dot_path = o->pp_schedule_dot, .tp_group = tp.group,
                               .shard_group = sharded ? t->mesh->dp_shard_cp : NULL, .compute = &gpu_pipeline_compute,
                               .compute_ctx = &g->m, .memory = &gpu_fsdp_memory};
    int replicas = comm_size(t->mesh->dp_cp);
    g->pipeline = pipeline_create(&t->model, t->mesh->dim[MESH_PP], replicas > 1 ? t->mesh->dp_cp : NULL, &options, init);
    g->m.storage = t->model.storage;
    // With replicas, chapter 2's DDP over the chunks' buffers (its buckets' all-reduces on device
    // buffers): the GPU model reports each unit's gradients final to the hook DDP installed.
    g->m.grads_ready = t->model.grads_ready;
    g->m.grads_ready_ctx = t->model.grads_ready_ctx;
    if (replicas > 1)
        log_info("pp x %s on the GPU: %d data-parallel ranks of every stage, gradients all-reduced in buckets (%s)%s",
                 sharded ? "zero-1" : "ddp", replicas, o->overlap ? "overlapping backward" : "after backward",
                 sharded ? "; AdamW state sharded over dp_shard, the updated slices all-gathered" : "");
    log_info("pp on the GPU: %d stages (chapter 7's executor on device buffers, %s backend); bf16 activations "
             "between stages, each unit's fp32 weights cast to bf16 where it runs",
             t->mesh->degree[MESH_PP] * o->pp_virtual_stages, gpu_comm_backend_name());
}

// --cp N: chapter 8's ring on device buffers (gpu/cp_device.h) for the GPU model's attention; the
// data-parallel layouts then average over dp x cp (DDP) or shard over dp_shard x cp (FSDP), as on the CPU.
static void install_context_parallel(GpuTraining *g, Trainer *t, const LayoutOptions *o) {
    const Mesh *mesh = t->mesh;
    if (mesh->degree[MESH_CP] == 1) return;
    const LocalShape *local = &g->m.local;  // this tp rank's heads
    bool tensor_cores = g->m.precision == GPU_BF16;  // bf16 blocks on the tensor cores, fp32 merges and sums
    g->cp = cp_create(mesh->dim[MESH_CP], CP_RING, o->cp_load_balance, t->micro, t->cp_layout.T, local->n_heads,
                      local->n_kv_heads, model_head_dim(&g->m.cfg), tensor_cores ? &gpu_cp_compute_bf16 : &gpu_cp_compute);
    gpu_model_set_context_parallel(&g->m, g->cp, cp_positions(g->cp));
    log_info("cp on the GPU: %d ranks, chapter 8's ring attention on device buffers (%s), %s split: this rank "
             "holds %d of every %d tokens", mesh->degree[MESH_CP],
             tensor_cores ? "each block on the tensor cores in bf16, merged and summed in fp32" : "fp32",
             o->cp_load_balance ? "zigzag" : "contiguous", t->T, t->cp_layout.T);
}


void trainer_cuda_start(char **argv) {
    (void)argv;
    (void)gpu_attention_tile_rows();  // a bad LLAMA_ATTN_TILE_ROWS: one line, exit 2
}

Strategy *cuda_strategy_create(Trainer *t, const ModelConfig *cfg, const ParamSource *init, const LayoutOptions *o) {
    refuse_layout(t, o);
    if (o->fp8) check_fp8(t, cfg, o);
    char why[256];
    int devices = gpu_device_count(why, sizeof why);
    if (devices == 0) fatal_input("--device cuda: no usable CUDA device (%s)", why);
    int local = comm_local_rank(), on_host = comm_local_size();
    gpu_init(local % devices);
    if (on_host > devices)
        log_info("%d ranks on this host share its %d GPU%s: each takes GPU (its index on the host mod %d)", on_host,
                 devices, devices > 1 ? "s" : "", devices);
    if (o->cuda_sync_debug) gpu_set_sync_debug(true);
    gpu_comm_backend_init(GPU_COMM_AUTO);  // collective: every rank creates the strategy
    log_info("comm on device buffers: %s (%s)", gpu_comm_backend_name(), gpu_comm_backend_reason());
    char description[256];
    gpu_device_description(description, sizeof description);
    log_info("device: %s; bf16 compute, fp32 master weights and AdamW state", description);
    start_gpu_timeline();
    int tp = t->mesh->degree[MESH_TP], tp_rank = t->mesh->coord[MESH_TP];
    // the table and shapes (this tp rank's), for checkpoints (tp_gather_full) and FSDP's units
    model_init_tp(&t->model, cfg, NULL, ATTN_FLASH, tp, tp_rank, false);
    GpuTraining *g = calloc(1, sizeof *g);
    if (o->fp8) log_info("fp8 on the GPU: wq wk wv wo w1 w2 w3 of every block as FP8 GEMMs (tensorwise)");
    if (t->mesh->degree[MESH_PP] > 1) {
        create_pipelined(g, t, cfg, init, o);
        install_context_parallel(g, t, o);
        Strategy *s = calloc(1, sizeof *s);
        *s = (Strategy){.name = "cuda-pipeline", .model = &t->model, .impl = g,
                        .forward_backward = pipelined_forward_backward, .begin_backward = no_begin_backward,
                        .end_backward = no_backward_hook, .finish_backward = no_backward_hook,
                        .zero_grads = no_backward_hook, .grad_norm = pipelined_grad_norm, .clip = pipelined_clip,
                        .optimizer_step = pipelined_optimizer_step, .gather_full = pipelined_gather_full,
                        .load_full = pipelined_load_full, .report_memory = cuda_report_memory,
                        .memory_in_use = cuda_memory_in_use, .free = cuda_free};
        return s;
    }
    if (t->mesh->degree[MESH_DP_SHARD] > 1) {
        create_sharded(g, t, cfg, init, o);
        install_context_parallel(g, t, o);
        Strategy *s = calloc(1, sizeof *s);
        *s = (Strategy){.name = "cuda-fsdp", .model = &t->model, .impl = g,
                        .forward_backward = gpu_microbatch_loop, .begin_backward = sharded_begin_backward,
                        .end_backward = sharded_end_backward, .finish_backward = no_backward_hook,
                        .zero_grads = sharded_zero_grads,
                        .grad_norm = sharded_grad_norm, .clip = sharded_clip, .optimizer_step = sharded_optimizer_step,
                        .gather_full = sharded_gather_full, .load_full = sharded_load_full,
                        .report_memory = sharded_report_memory, .memory_in_use = cuda_memory_in_use, .free = cuda_free};
        return s;
    }
    GpuTensorParallel tp_place = tp_of(t, o);
    gpu_model_init_tp(&g->m, cfg, init, GPU_BF16, t->micro, t->T, (ActCheckpoint)o->ac, &tp_place);
    if (tp > 1) log_tp(&g->m, cfg);
    g->m.fp8 = o->fp8;
    g->m.fp8_tokens = fp8_token_group(t);
    install_context_parallel(g, t, o);
    int replicas = comm_size(t->mesh->dp_cp);  // data-parallel ranks, times cp (they average gradients too)
    if (replicas > 1) {
        g->dp = t->mesh->dp_cp;
        gpu_model_broadcast(g->dp, &g->m, 0);  // replicas start equal, bf16 copies included
        log_info("ddp on the GPU: %d replicas, gradients averaged after the last micro-batch (%s backend)",
                 replicas, gpu_comm_backend_name());
    }
    Strategy *s = calloc(1, sizeof *s);
    *s = (Strategy){.name = "cuda", .model = &t->model, .impl = g, .forward_backward = gpu_microbatch_loop,
                    .begin_backward = no_begin_backward, .end_backward = no_backward_hook,
                    .finish_backward = replicas_finish_backward,
                    .zero_grads = cuda_zero_grads, .grad_norm = cuda_grad_norm, .clip = cuda_clip,
                    .optimizer_step = cuda_optimizer_step, .gather_full = cuda_gather_full,
                    .load_full = cuda_load_full, .report_memory = cuda_report_memory,
                    .memory_in_use = cuda_memory_in_use, .free = cuda_free};
    return s;
}
