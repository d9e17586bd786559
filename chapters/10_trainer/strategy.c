// strategy.c: the trainer's contract (trainer.h) filled in by each layout, from the chapters' modules:
//
//   single    the whole model on one rank (chapter 0); with tp > 1 this rank's tp slice (chapter 6)
//   ddp       the same on every data-parallel replica, gradients all-reduced in buckets (chapter 2)
//   fsdp      ZeRO-1/2/3 over dp_shard x cp, HSDP with dp_replicate (chapters 3-4)
//   pipeline  a stage's layers per pp rank, its own schedule of micro-batches (chapter 7)
//
// Each is a handful of small functions over its chapter's module. The first three share the
// micro-batch loop below; the pipeline runs its schedule instead.
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/02_data_parallel/ddp.h"
#include "chapters/03_fsdp/fsdp.h"
#include "chapters/06_tensor_parallel/tp.h"
#include "chapters/07_pipeline_parallel/pipeline.h"
#include "chapters/08_context_parallel/cp.h"
#include "chapters/10_trainer/trainer.h"
#include "common/args.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

static void no_op(Strategy *s) { (void)s; }
static void no_op_begin(Strategy *s, bool last) { (void)s, (void)last; }
static void no_memory_model(const Strategy *s) { (void)s; }

// Forward and backward of each micro-batch in turn, gradients accumulating; each backward is scaled
// by 1/n_micro, so the sum is the gradient of the mean loss (every micro-batch has the same number of
// targets). The strategy's hooks sync the gradients around the backwards.
static double microbatch_loop(Strategy *s, const StepBatch *b) {
    int track = trace_track("compute");
    size_t rows = (size_t)b->micro * b->T;
    double loss_sum = 0;
    for (int mb = 0; mb < b->n_micro; mb++) {
        const int *inputs = b->inputs + mb * rows, *targets = b->targets + mb * rows;
        trace_begin(track, "forward", "phase");
        trace_arg_int(track, "microbatch", mb);
        double loss = model_forward(s->model, &s->acts, inputs, targets);
        trace_end(track);
        if (!isfinite(loss)) fatal("step %lld: loss is %g; stopping (try a lower --lr)", b->step, loss);
        s->begin_backward(s, mb == b->n_micro - 1);
        trace_begin(track, "backward", "phase");
        trace_arg_int(track, "microbatch", mb);
        model_backward(s->model, &s->acts, inputs, 1.0 / b->n_micro);
        trace_end(track);
        s->end_backward(s);
        loss_sum += loss;
    }
    s->finish_backward(s);
    return loss_sum / b->n_micro;
}

static size_t host_memory_in_use(const Strategy *s) { return mem_current_total(); }

static Strategy *strategy_new(const char *name, Model *model, void *impl) {
    Strategy *s = calloc(1, sizeof *s);
    *s = (Strategy){.name = name, .model = model, .impl = impl, .forward_backward = microbatch_loop,
                    .begin_backward = no_op_begin, .end_backward = no_op, .finish_backward = no_op,
                    .zero_grads = no_op, .report_memory = no_memory_model, .memory_in_use = host_memory_in_use};
    return s;
}

// ---- single process and DDP: every rank holds the whole model (its tp slice) --------------------------

typedef struct {
    real *adam_m, *adam_v;  // (table.total_numel)
    Comm *tp_group;         // NULL without tensor parallelism
    Ddp *ddp;               // NULL: one replica
} Replicated;

static void replicated_zero_grads(Strategy *s) { model_zero_grads(s->model); }

// Gradients are the same on every dp rank; tp ranks hold slices (replicated norms counted once).
static double replicated_grad_norm(Strategy *s) {
    Replicated *r = s->impl;
    const Model *m = s->model;
    if (r->tp_group) return sqrt(tp_sum_of_squares(m, r->tp_group, m->grads));
    return sqrt(sum_of_squares(m->grads, m->table.total_numel));
}

static void replicated_clip(Strategy *s, double grad_norm, double max_norm) {
    clip_by_global_norm(s->model->grads, s->model->table.total_numel, grad_norm, max_norm);
}

static void replicated_optimizer_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    Replicated *r = s->impl;
    Model *m = s->model;
    adamw_step(m->params, m->grads, r->adam_m, r->adam_v, m->table.total_numel, step, lr, cfg);
}

static real *replicated_state(Strategy *s, StateKind kind) {
    Replicated *r = s->impl;
    real *states[] = {[STATE_WEIGHTS] = s->model->params, [STATE_ADAM_M] = r->adam_m, [STATE_ADAM_V] = r->adam_v,
                      [STATE_GRADS] = s->model->grads};
    return states[kind];
}

static void replicated_gather_full(Strategy *s, StateKind kind, real *local_flat) {
    memcpy(local_flat, replicated_state(s, kind), sizeof(real) * s->model->table.total_numel);
}

static void replicated_load_full(Strategy *s, StateKind kind, const real *local_flat) {
    memcpy(replicated_state(s, kind), local_flat, sizeof(real) * s->model->table.total_numel);
}

static void replicated_free(Strategy *s) {
    Replicated *r = s->impl;
    ddp_free(r->ddp);
    mem_free(r->adam_m);
    mem_free(r->adam_v);
    free(r);
}

static void ddp_begin(Strategy *s, bool last) { ddp_begin_backward(((Replicated *)s->impl)->ddp, last); }
static void ddp_finish(Strategy *s) { ddp_finish_backward(((Replicated *)s->impl)->ddp); }

static Strategy *replicated_create(Trainer *t, const LayoutOptions *o) {
    Replicated *r = calloc(1, sizeof *r);
    size_t n = t->model.table.total_numel;
    r->adam_m = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n);
    r->adam_v = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n);
    r->tp_group = t->mesh->degree[MESH_TP] > 1 ? t->mesh->dim[MESH_TP] : NULL;
    int replicas = comm_size(t->mesh->dp_cp);  // data-parallel ranks, times cp (they average gradients too)
    Strategy *s = strategy_new(replicas > 1 ? "ddp" : "single", &t->model, r);
    s->zero_grads = replicated_zero_grads;
    s->grad_norm = replicated_grad_norm;
    s->clip = replicated_clip;
    s->optimizer_step = replicated_optimizer_step;
    s->gather_full = replicated_gather_full;
    s->load_full = replicated_load_full;
    s->free = replicated_free;
    if (replicas > 1) {
        r->ddp = ddp_create(&t->model, t->mesh->dp_cp, (size_t)(o->bucket_mb * 1048576.0), o->overlap);
        ddp_broadcast_params(r->ddp);  // replicas start equal, whatever each rank initialised
        s->begin_backward = ddp_begin;
        s->finish_backward = ddp_finish;
        log_info("ddp: %d replicas, %d micro-batch(es) of %d sequences each per rank, %d buckets of <= %g MiB, %s",
                 replicas, t->n_micro, t->micro, r->ddp->n_buckets, o->bucket_mb,
                 o->overlap ? "all-reduce overlapping backward" : "all-reduce after backward");
    }
    return s;
}

// ---- ZeRO-1/2/3 and HSDP (chapters 3-4) ----------------------------------------------------------------

static void fsdp_zero(Strategy *s) { fsdp_zero_grads(s->impl); }
static void fsdp_begin(Strategy *s, bool last) { fsdp_begin_backward(s->impl, last); }
static void fsdp_end(Strategy *s) { fsdp_end_backward(s->impl); }
static double fsdp_norm(Strategy *s) { return fsdp_grad_norm(s->impl); }
static void fsdp_clip_grads(Strategy *s, double grad_norm, double max_norm) { fsdp_clip(s->impl, grad_norm, max_norm); }
static void fsdp_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    fsdp_adamw_step(s->impl, step, lr, cfg);
}
static void fsdp_gather(Strategy *s, StateKind kind, real *local_flat) { fsdp_gather_full(s->impl, kind, local_flat); }
static void fsdp_load(Strategy *s, StateKind kind, const real *local_flat) { fsdp_load_full(s->impl, kind, local_flat); }
static void fsdp_memory(const Strategy *s) { fsdp_print_memory_estimate(s->impl); }
static void fsdp_release(Strategy *s) { fsdp_free(s->impl); }

static Strategy *sharded_create(Trainer *t, const LayoutOptions *o, const ParamSource *init) {
    Mesh *mesh = t->mesh;
    FsdpOptions options = {o->zero_stage, (ReshardPolicy)o->reshard, o->overlap, o->weight_codec, NULL};  // host memory
    Comm *replicate = mesh->degree[MESH_DP_REPLICATE] > 1 ? mesh->dim[MESH_DP_REPLICATE] : NULL;
    Comm *tp_group = mesh->degree[MESH_TP] > 1 ? mesh->dim[MESH_TP] : NULL;
    Fsdp *f = fsdp_create(&t->model, mesh->dp_shard_cp, replicate, tp_group, &options, init);
    Strategy *s = strategy_new(replicate ? "hsdp" : "fsdp", &t->model, f);
    char reshard[32];
    s->zero_grads = fsdp_zero;
    s->begin_backward = fsdp_begin;
    s->end_backward = fsdp_end;
    s->grad_norm = fsdp_norm;
    s->clip = fsdp_clip_grads;
    s->optimizer_step = fsdp_step;
    s->gather_full = fsdp_gather;
    s->load_full = fsdp_load;
    s->report_memory = fsdp_memory;
    s->free = fsdp_release;
    log_info("%s: zero stage %d over %d shards%s, %d micro-batch(es) of %d sequences per rank, reshard after "
             "forward: %s, prefetch %s%s",
             s->name, o->zero_stage, comm_size(mesh->dp_shard_cp), replicate ? " x replicated" : "", t->n_micro,
             t->micro, args_choice_name(RESHARD_POLICY_NAMES, o->reshard, reshard, sizeof reshard), o->overlap ? "on" : "off",
             o->weight_codec == &fsdp_bf16_codec ? ", weights all-gathered in bf16" : "");
    if (replicate) log_info("hsdp: %d replicas of the shard group", comm_size(replicate));
    return s;
}

// ---- pipeline stages (chapter 7) ------------------------------------------------------------------------

static double pipeline_run(Strategy *s, const StepBatch *b) {
    return pipeline_forward_backward(s->impl, b->inputs, b->targets);
}
static double pipeline_norm(Strategy *s) { return pipeline_grad_norm(s->impl); }
static void pipeline_clip_grads(Strategy *s, double grad_norm, double max_norm) {
    pipeline_clip(s->impl, grad_norm, max_norm);
}
static void pipeline_step(Strategy *s, long long step, double lr, const AdamWConfig *cfg) {
    pipeline_adamw_step(s->impl, step, lr, cfg);
}
static void pipeline_gather(Strategy *s, StateKind kind, real *local_flat) {
    pipeline_gather_full(s->impl, kind, local_flat);
}
static void pipeline_load(Strategy *s, StateKind kind, const real *local_flat) {
    pipeline_load_full(s->impl, kind, local_flat);
}
static void pipeline_release(Strategy *s) { pipeline_free(s->impl); }

static Strategy *pipeline_strategy_create(Trainer *t, const LayoutOptions *o, const ParamSource *init) {
    Mesh *mesh = t->mesh;
    bool sharded = mesh->degree[MESH_DP_SHARD] > 1;
    PipelineOptions options = {(PpScheduleKind)o->pp_schedule, t->n_micro, o->pp_virtual_stages, t->micro, t->T,
                               (ActCheckpoint)o->ac, (size_t)(o->bucket_mb * 1048576.0), o->overlap,
                               o->pp_schedule_dot, mesh->degree[MESH_TP] > 1 ? mesh->dim[MESH_TP] : NULL,
                               sharded ? mesh->dp_shard_cp : NULL, NULL, NULL, NULL};  // reference_cpu, host memory
    int replicas = comm_size(mesh->dp_cp);
    Pipeline *pl = pipeline_create(&t->model, mesh->dim[MESH_PP], replicas > 1 ? mesh->dp_cp : NULL, &options, init);
    if (replicas > 1)
        log_info("pp x %s: %d data-parallel ranks per stage%s", sharded ? "zero-1" : "ddp", replicas,
                 sharded ? ", AdamW state sharded over dp_shard" : "");
    Strategy *s = strategy_new("pipeline", &t->model, pl);
    s->forward_backward = pipeline_run;  // zeroes the stages' gradients itself
    s->grad_norm = pipeline_norm;
    s->clip = pipeline_clip_grads;
    s->optimizer_step = pipeline_step;
    s->gather_full = pipeline_gather;
    s->load_full = pipeline_load;
    s->free = pipeline_release;
    return s;
}

// ---- choosing the layout ------------------------------------------------------------------------------

void trainer_check_sequence_parallel(uint64_t micro_batch_tokens, int tp) {
    if (micro_batch_tokens % (uint64_t)tp != 0)
        fatal_input("--sequence-parallel: the %" PRIu64 " tokens of a micro-batch must divide by --tp %d",
                    micro_batch_tokens, tp);
}

// The model first (this tp rank's slice; its own weights only where no module shards or stages
// them), then the strategy the mesh calls for.
void trainer_setup_layout(Trainer *t, const ModelConfig *cfg, AttentionImpl attention, const ParamSource *init,
                          const LayoutOptions *o) {
    Mesh *mesh = t->mesh;
    int tp = mesh->degree[MESH_TP], tp_rank = mesh->coord[MESH_TP];
    bool sharded = mesh->degree[MESH_DP_SHARD] > 1, pipelined = mesh->degree[MESH_PP] > 1;
    model_init_tp(&t->model, cfg, init, attention, tp, tp_rank, !sharded && !pipelined);
    if (tp > 1) {
        if (o->sequence_parallel) trainer_check_sequence_parallel((uint64_t)t->micro * t->T, tp);
        tp_install(&t->model, mesh->dim[MESH_TP], o->sequence_parallel);
        const LocalShape *local = &t->model.local;
        log_info("tp: %d ranks%s; this one holds %d of %d heads, %d of %d kv heads, %d of %d ffn columns, vocab rows "
                 "[%d, %d)", tp, o->sequence_parallel ? " with sequence parallel" : "", local->n_heads, cfg->n_heads,
                 local->n_kv_heads, cfg->n_kv_heads, local->ffn_dim, cfg->ffn_dim, local->vocab_start,
                 local->vocab_start + local->vocab_size);
    }
    if (mesh->degree[MESH_CP] > 1) {
        t->cp = cp_install(&t->model, mesh->dim[MESH_CP], (CpMode)o->cp_mode, o->cp_load_balance, t->micro,
                           t->cp_layout.T);
        log_info("cp: %d ranks, %s, %s split: this rank holds %d of every %d tokens", mesh->degree[MESH_CP],
                 o->cp_mode == CP_RING ? "ring attention" : "all-to-all (Ulysses)",
                 o->cp_load_balance ? "zigzag" : "contiguous", t->T, t->cp_layout.T);
    }
    if (pipelined) t->strategy = pipeline_strategy_create(t, o, init);
    else if (sharded) t->strategy = sharded_create(t, o, init);
    else t->strategy = replicated_create(t, o);
    if (!pipelined) t->strategy->acts = model_acts_alloc(&t->model, t->micro, t->T, (ActCheckpoint)o->ac);
}

void trainer_free_strategy(Trainer *t) {
    t->strategy->free(t->strategy);
    cp_free(t->cp);
    model_acts_free(&t->strategy->acts);
    free(t->strategy);
    t->strategy = NULL;
}

void trainer_full_state(Trainer *t, StateKind kind, real *full) {
    real *local = mem_alloc(MEM_OTHER, sizeof(real) * t->model.table.total_numel);
    t->strategy->gather_full(t->strategy, kind, local);
    tp_gather_full(&t->model, t->mesh->dim[MESH_TP], local, full);
    mem_free(local);
}

void trainer_load_full_state(Trainer *t, StateKind kind, const real *full) {
    real *local = mem_alloc(MEM_OTHER, sizeof(real) * t->model.table.total_numel);
    tp_scatter_full(&t->model, full, local);
    t->strategy->load_full(t->strategy, kind, local);
    mem_free(local);
}
