// train.c: the training program. Alone it runs the single-process reference; under mpirun the
// chapters' parallel modules split the work behind the same flags (DESIGN.md). --batch is always
// the GLOBAL batch, so every config can be compared with the single process at equal tokens/step.
//
//   ./build/train --model small --steps 150 --trace build/small.pftrace
//   ./build/train --model tiny --steps 10 --dump ref.safetensors     (what other code checks against)
//   ./build/train --compare their_dump.safetensors                    (check their numbers against ours)
//   mpirun -np 4 ./build/train --dp-replicate 4 --trace ddp.pftrace   (chapter 2: data parallel)
//   mpirun -np 4 ./build/train --dp-shard 4 --zero-stage 3            (chapter 3: FSDP)
//   mpirun -np 4 ./build/train --dp-replicate 2 --dp-shard 2          (chapter 4: HSDP)
//   mpirun -np 4 ./build/train --tp 2 --dp-shard 2                    (chapter 6: tensor parallel, with FSDP)
//   mpirun -np 4 ./build/train --pp 4 --pp-schedule 1F1B --pp-microbatches 8   (chapter 7: pipeline parallel)
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "chapters/02_data_parallel/ddp.h"
#include "chapters/03_fsdp/fsdp.h"
#include "chapters/06_tensor_parallel/tp.h"
#include "chapters/07_pipeline_parallel/pipeline.h"
#include "common/args.h"
#include "common/comm.h"
#include "common/data.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/mesh.h"
#include "common/trace.h"
#include "common/trace_dist.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/checkpoint.h"
#include "reference_cpu/dump.h"
#include "reference_cpu/model.h"

typedef struct {
    const char *model, *data, *lr_decay, *attention, *matmul, *ac, *reshard;
    const char *checkpoint_dir, *resume, *trace, *trace_json, *dump, *compare, *mesh_dot, *trace_hta, *grad_dump;
    const char *pp_schedule, *pp_schedule_dot;
    int steps, batch, seq_len, n_layers, warmup_steps, checkpoint_every, log_every;
    int dp_replicate, dp_shard, grad_accum_steps, zero_stage, tp, pp, pp_microbatches, pp_virtual_stages;
    long long seed;
    double lr, min_lr_ratio, weight_decay, beta1, beta2, eps, grad_clip, rope_theta, compare_rtol;
    double bucket_mb, comm_timeout;
    bool model_info, no_overlap, desync_init, sequence_parallel;
} Options;

static Options opt = {.seq_len = -1, .warmup_steps = -1, .rope_theta = -1};

#define UNBOUNDED 1e308
static const ArgSpec FLAGS[] = {
    {"model", ARG_CHOICE, &opt.model, "tiny", "model config", .choices = NULL /* set in main */},
    {"steps", ARG_INT, &opt.steps, "20", "optimizer steps (the LR schedule ends here)", .min = 1, .max = UNBOUNDED},
    {"batch", ARG_INT, &opt.batch, "8", "GLOBAL batch in sequences per optimizer step", .min = 1, .max = UNBOUNDED},
    {"seq-len", ARG_INT, &opt.seq_len, NULL, "tokens per sequence (default: the model's max_seq_len)", .min = 1,
     .max = UNBOUNDED},
    {"n-layers", ARG_INT, &opt.n_layers, NULL, "transformer blocks (default: the model's)", .min = 1, .max = UNBOUNDED},
    {"lr", ARG_DOUBLE, &opt.lr, "3e-4", "peak learning rate", .min = 0, .max = 10},
    {"warmup-steps", ARG_INT, &opt.warmup_steps, NULL, "linear warmup steps (default: steps/10)", .min = 0,
     .max = UNBOUNDED},
    {"lr-decay", ARG_CHOICE, &opt.lr_decay, "cosine", "decay after warmup", .choices = "cosine|linear|constant"},
    {"min-lr-ratio", ARG_DOUBLE, &opt.min_lr_ratio, "0.1", "final lr as a fraction of the peak", .min = 0, .max = 1},
    {"weight-decay", ARG_DOUBLE, &opt.weight_decay, "0.1", "AdamW decoupled weight decay", .min = 0, .max = 1},
    {"beta1", ARG_DOUBLE, &opt.beta1, "0.9", "AdamW beta1", .min = 0, .max = 0.999999},
    {"beta2", ARG_DOUBLE, &opt.beta2, "0.95", "AdamW beta2", .min = 0, .max = 0.999999999},
    {"eps", ARG_DOUBLE, &opt.eps, "1e-8", "AdamW epsilon", .min = 1e-30, .max = 1},
    {"grad-clip", ARG_DOUBLE, &opt.grad_clip, "1.0", "max global gradient norm (0 = no clipping)", .min = 0,
     .max = UNBOUNDED},
    {"seed", ARG_LONG, &opt.seed, "1234", "seed of the weights and the data", .min = 0, .max = 9.2e18},
    {"data", ARG_STRING, &opt.data, "markov",
     "markov | markov:order=K,branches=N | text:FILE | tokens:FILE (common/DATA.md)", .value_name = "SPEC"},
    {"rope-theta", ARG_DOUBLE, &opt.rope_theta, NULL, "RoPE base (default: the model's, 500000)", .min = 1,
     .max = UNBOUNDED},
    {"attention", ARG_CHOICE, &opt.attention, "flash", "attention kernel", .choices = "flash|naive"},
    {"matmul", ARG_CHOICE, &opt.matmul, "blas", "matmul backend", .choices = "blas|loop"},
    {"ac", ARG_CHOICE, &opt.ac, "none",
     "activation checkpointing: full recomputes each block in backward, selective only its element-wise ops "
     "(chapter 5)", .choices = AC_MODE_NAMES},
    {"checkpoint-dir", ARG_STRING, &opt.checkpoint_dir, NULL, "write DIR/step_N.safetensors checkpoints",
     .value_name = "DIR"},
    {"checkpoint-every", ARG_INT, &opt.checkpoint_every, "0", "checkpoint period in steps (0 = only at the end)",
     .min = 0, .max = UNBOUNDED},
    {"resume", ARG_STRING, &opt.resume, NULL, "resume from a checkpoint file, or the latest one in DIR",
     .value_name = "PATH"},
    {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto timeline (.pftrace)", .value_name = "FILE"},
    {"trace-json", ARG_STRING, &opt.trace_json, NULL, "write the timeline as Chrome-trace JSON",
     .value_name = "FILE"},
    {"trace-hta", ARG_STRING, &opt.trace_hta, NULL,
     "write one PyTorch-profiler-shaped JSON per rank into DIR, for Holistic Trace Analysis", .value_name = "DIR"},
    {"dump", ARG_STRING, &opt.dump, NULL, "write inputs, weights, step-1 logits and gradients, losses (safetensors)",
     .value_name = "FILE"},
    {"grad-dump", ARG_STRING, &opt.grad_dump, NULL,
     "write the step-1 gradients (averaged over data-parallel ranks, before clipping) in full, as grad.<name>; "
     "any layout, to compare with a --dump", .value_name = "FILE"},
    {"compare", ARG_STRING, &opt.compare, NULL, "check a dump against this reference and exit",
     .value_name = "FILE"},
    {"compare-rtol", ARG_DOUBLE, &opt.compare_rtol, "1e-4", "--compare tolerance: max|diff| / max|reference|",
     .min = 0, .max = 1},
    {"log-every", ARG_INT, &opt.log_every, "1", "print a log line every N steps", .min = 1, .max = UNBOUNDED},
    {"dp-replicate", ARG_INT, &opt.dp_replicate, "1", "data-parallel replicas (DDP, chapter 2)", .min = 1,
     .max = UNBOUNDED},
    {"dp-shard", ARG_INT, &opt.dp_shard, "1", "data-parallel shards (FSDP, chapter 3; with --dp-replicate: HSDP)",
     .min = 1, .max = UNBOUNDED},
    {"tp", ARG_INT, &opt.tp, "1", "tensor-parallel ranks (Megatron: heads, ffn columns and vocabulary split; chapter 6)",
     .min = 1, .max = UNBOUNDED},
    {"sequence-parallel", ARG_BOOL, &opt.sequence_parallel, NULL,
     "with --tp: norms and residuals on sequence shards (all-gather / reduce-scatter instead of all-reduce)",
     .value_name = ""},
    {"pp", ARG_INT, &opt.pp, "1", "pipeline-parallel ranks: each holds a slice of the layers (chapter 7)", .min = 1,
     .max = UNBOUNDED},
    {"pp-schedule", ARG_CHOICE, &opt.pp_schedule, "1F1B", "pipeline schedule", .choices = PP_SCHEDULE_NAMES},
    {"pp-microbatches", ARG_INT, &opt.pp_microbatches, NULL,
     "micro-batches per step on each data-parallel rank (default: --pp)", .min = 1, .max = UNBOUNDED},
    {"pp-virtual-stages", ARG_INT, &opt.pp_virtual_stages, "1", "stages per pipeline rank (Interleaved1F1B)",
     .min = 1, .max = UNBOUNDED},
    {"pp-schedule-dot", ARG_STRING, &opt.pp_schedule_dot, NULL, "write the pipeline schedule as a Graphviz diagram",
     .value_name = "FILE"},
    {"zero-stage", ARG_INT, &opt.zero_stage, "3",
     "with --dp-shard > 1: 1 shards the optimizer state, 2 also the gradients, 3 also the weights (FSDP)", .min = 1,
     .max = 3},
    {"reshard-after-forward", ARG_CHOICE, &opt.reshard, "default",
     "ZeRO-3: free gathered weights after forward (default: all but the embedding, head and last block)",
     .choices = RESHARD_POLICY_NAMES},
    {"grad-accum-steps", ARG_INT, &opt.grad_accum_steps, "1",
     "micro-batches per optimizer step on each rank; gradients sync after the last", .min = 1, .max = UNBOUNDED},
    {"bucket-mb", ARG_DOUBLE, &opt.bucket_mb, "25", "DDP gradient bucket size in MiB", .min = 1e-6, .max = 1e6},
    {"no-overlap", ARG_BOOL, &opt.no_overlap, NULL,
     "DDP: all-reduce every bucket after backward instead of during it; FSDP: no all-gather prefetch",
     .value_name = ""},
    {"desync-init", ARG_BOOL, &opt.desync_init, NULL,
     "give every data-parallel replica a different init (seed + dp rank) to show the initial broadcast fixes it",
     .value_name = ""},
    {"comm-timeout", ARG_DOUBLE, &opt.comm_timeout, "300", "seconds before a stuck collective ends the run",
     .min = 0.1, .max = UNBOUNDED},
    {"mesh-dot", ARG_STRING, &opt.mesh_dot, NULL, "write the device mesh as a Graphviz diagram", .value_name = "FILE"},
    {"model-info", ARG_BOOL, &opt.model_info, NULL, "print the config, parameter count and FLOPs per token, and exit", .value_name = ""},
};
#define N_FLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

static ModelConfig resolve_config(void) {
    ModelConfig cfg;
    if (!model_config_lookup(opt.model, &cfg)) fatal_input("--model %s: unknown model", opt.model);
    if (opt.seq_len < 0) opt.seq_len = cfg.max_seq_len;
    if (opt.seq_len > cfg.max_seq_len) cfg.max_seq_len = opt.seq_len;  // the RoPE table grows with it
    if (opt.rope_theta > 0) cfg.rope_theta = opt.rope_theta;
    if (opt.n_layers > 0) cfg.n_layers = opt.n_layers;
    model_config_validate(&cfg, opt.seq_len);
    if (opt.warmup_steps < 0) opt.warmup_steps = opt.steps / 10;
    if (opt.warmup_steps > opt.steps)
        fatal_input("--warmup-steps %d: must not exceed --steps %d", opt.warmup_steps, opt.steps);
    if (opt.checkpoint_every > 0 && !opt.checkpoint_dir)
        fatal_input("--checkpoint-every %d: needs --checkpoint-dir", opt.checkpoint_every);
    return cfg;
}

static void print_model_info(const ModelConfig *c, int seq_len) {
    log_info("model %s: dim %d, layers %d, heads %d, kv heads %d, head dim %d, ffn %d, vocab %d, %s, rope theta %g",
             c->name, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, model_head_dim(c), c->ffn_dim,
             c->vocab_size, c->tied ? "tied embeddings" : "untied", c->rope_theta);
    log_info("parameters %.3fM (%.3fM without embeddings); training FLOPs/token at seq %d: %.4g"
             " (6N + 6 L h s, causal)",
             model_param_count(c) / 1e6, model_param_count_non_embedding(c) / 1e6, seq_len,
             model_flops_per_token(c, seq_len));
    char *json = model_config_to_json(c);
    log_info("config: %s", json);  // the one source of the shapes: scripts/bench.sh hands it to PyTorch
    free(json);
}

static void ensure_directory(const char *dir) {
    if (mkdir(dir, 0777) != 0) {
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
            fatal_input("--checkpoint-dir %s: cannot create directory", dir);
    }
}

// Checks the output paths before training, so a typo costs a second, not a run.
static void check_writable(const char *flag, const char *path) {
    if (!path) return;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) return;
    *slash = 0;
    struct stat st;
    if (dir[0] && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)))
        fatal_input("--%s %s: directory %s does not exist", flag, path, dir);
}

// Chapter 5's figures: what each block keeps for backward and what the recompute costs, per
// micro-batch, against no checkpointing.
static void log_checkpointing(const Model *m, int B, int T, ActCheckpoint ac) {
    if (ac == AC_NONE) return;
    double kept = (double)model_acts_bytes_per_block(m, B, T, ac), all = (double)model_acts_bytes_per_block(m, B, T, AC_NONE);
    double mm, ew, fwd = model_block_forward_flops(&m->cfg, B, T);
    model_recompute_flops(m, B, T, ac, &mm, &ew);
    log_info("ac %s: each block keeps %.2f MiB of activations instead of %.2f MiB (saves %.2f MiB x %d blocks, "
             "minus %.2f MiB of shared recompute buffers); backward recomputes %.3g matmul FLOPs (+%.1f%% of the "
             "block's 3x forward) and %.3g element-wise ops per block",
             opt.ac, kept / 1048576, all / 1048576, (all - kept) / 1048576, m->cfg.n_layers, (all - kept) / 1048576,
             mm, 100 * mm / (3 * fwd), ew);
}

typedef struct {
    double loss, grad_norm, lr;
} StepResult;

// Everything one rank trains with.
typedef struct {
    Model model;
    ModelActs acts;                // for one micro-batch
    real *adam_m, *adam_v;
    int *inputs, *targets;         // one micro-batch: (micro, T); with PP the rank's slice (n_micro * micro, T)
    DataSource *data;
    Mesh *mesh;
    Ddp *ddp;                      // DDP: dp_replicate > 1 and dp_shard == 1
    Fsdp *fsdp;                    // FSDP / HSDP: dp_shard > 1 (then adam_m, adam_v and model.params are NULL)
    Pipeline *pp;                  // PP: pp > 1 (likewise NULL: each stage holds its own layers' state)
    int B, T;                      // global batch, sequence length
    int micro, n_micro;            // sequences per micro-batch, micro-batches per step on this rank
    int dp_index, dp_size;
    LrSchedule schedule;
    AdamWConfig adam;
    DumpRecorder *dump;            // single process only
} Trainer;

// Forward and backward of every micro-batch of this rank's slice of the global batch. The
// gradients accumulate; each backward is scaled by 1/n_micro and DDP averages over the dp ranks,
// so the result is the gradient of the mean loss over the global batch (each micro-batch has the
// same number of targets). Returns this rank's mean loss.
static double forward_backward(Trainer *t, long long step) {
    int track = trace_track("compute");
    double loss_sum = 0;
    int local = t->micro * t->n_micro;
    if (t->pp) {  // the schedule runs every micro-batch of the slice
        data_batch(t->data, step, t->B, t->dp_index * local, local, t->T, t->inputs, t->targets);
        return pipeline_forward_backward(t->pp, t->inputs, t->targets);
    }
    for (int mb = 0; mb < t->n_micro; mb++) {
        int first_seq = t->dp_index * local + mb * t->micro;
        data_batch(t->data, step, t->B, first_seq, t->micro, t->T, t->inputs, t->targets);
        trace_begin(track, "forward", "phase");
        trace_arg_int(track, "microbatch", mb);
        double loss = model_forward(&t->model, &t->acts, t->inputs, t->targets);
        trace_end(track);
        if (!isfinite(loss)) fatal("step %lld: loss is %g; stopping (try a lower --lr)", step, loss);
        if (t->ddp) ddp_begin_backward(t->ddp, mb == t->n_micro - 1);
        if (t->fsdp) fsdp_begin_backward(t->fsdp, mb == t->n_micro - 1);
        trace_begin(track, "backward", "phase");
        trace_arg_int(track, "microbatch", mb);
        model_backward(&t->model, &t->acts, t->inputs, 1.0 / t->n_micro);
        trace_end(track);
        if (t->fsdp) fsdp_end_backward(t->fsdp);
        loss_sum += loss;
    }
    if (t->ddp) ddp_finish_backward(t->ddp);
    return loss_sum / t->n_micro;
}

static void write_grad_dump(Trainer *t, const char *path);  // (with the checkpoint code below)

// One optimizer step: forward/backward (with gradient sync), clip, AdamW. Returns the loss over the
// global batch before the update.
static StepResult train_step(Trainer *t, long long step) {
    int track = trace_track("compute");
    StepResult r;
    model_zero_grads(&t->model);
    if (t->fsdp) fsdp_zero_grads(t->fsdp);
    r.loss = forward_backward(t, step);
    if (t->dp_size > 1) comm_all_reduce(t->mesh->dp, &r.loss, 1, COMM_FLOAT64, COMM_AVG);
    trace_begin(track, "optimizer", "phase");
    r.lr = lr_at(&t->schedule, step);
    if (opt.grad_dump && step == 1) write_grad_dump(t, opt.grad_dump);
    if (t->fsdp || t->pp) {  // each rank clips (by the global norm) and updates only what it holds
        r.grad_norm = t->fsdp ? fsdp_grad_norm(t->fsdp) : pipeline_grad_norm(t->pp);
        if (!isfinite(r.grad_norm)) fatal("step %lld: gradient norm is %g; stopping", step, r.grad_norm);
        if (t->fsdp) fsdp_clip(t->fsdp, r.grad_norm, opt.grad_clip), fsdp_adamw_step(t->fsdp, step, r.lr, &t->adam);
        else pipeline_clip(t->pp, r.grad_norm, opt.grad_clip), pipeline_adamw_step(t->pp, step, r.lr, &t->adam);
        trace_end(track);
        return r;
    }
    size_t n = t->model.table.total_numel;
    // grads are identical on every dp rank; tp ranks hold slices (replicated norms counted once)
    r.grad_norm = sqrt(t->model.tp.size > 1 ? tp_sum_of_squares(&t->model, t->mesh->dim[MESH_TP], t->model.grads)
                                            : sum_of_squares(t->model.grads, n));
    if (!isfinite(r.grad_norm)) fatal("step %lld: gradient norm is %g; stopping", step, r.grad_norm);
    if (t->dump) dump_record_step(t->dump, &t->model, &t->acts, step, t->inputs, t->targets, r.loss, r.grad_norm, r.lr);
    clip_by_global_norm(t->model.grads, n, r.grad_norm, opt.grad_clip);
    adamw_step(t->model.params, t->model.grads, t->adam_m, t->adam_v, n, step, r.lr, &t->adam);
    trace_end(track);
    return r;
}

static ActCheckpoint checkpointing_mode(void) {
    return (ActCheckpoint)args_choice_index(AC_MODE_NAMES, opt.ac);
}

static PpScheduleKind pipeline_schedule(void) {
    PpScheduleKind kind;
    pp_schedule_parse(opt.pp_schedule, &kind);  // one of the choices: args_parse checked it
    return kind;
}

// The weights, gradients and optimizer state: whole on every rank (single process, DDP), sharded
// over dp_shard (ZeRO / FSDP, replicated over dp_replicate for HSDP), or a pipeline stage's layers
// (PP, replicated over dp_replicate).
static void setup_training_state(Trainer *t, const ModelConfig *cfg, AttentionImpl attention, uint64_t seed) {
    Mesh *mesh = t->mesh;
    int tp = mesh->degree[MESH_TP], tp_rank = mesh->coord[MESH_TP];
    bool sharded = mesh->degree[MESH_DP_SHARD] > 1, pipelined = mesh->degree[MESH_PP] > 1;
    model_init_tp(&t->model, cfg, seed, attention, tp, tp_rank, !sharded && !pipelined);
    if (tp > 1) {
        if (opt.sequence_parallel && (t->micro * t->T) % tp != 0)
            fatal_input("--sequence-parallel: the %d tokens of a micro-batch must divide by --tp %d", t->micro * t->T, tp);
        tp_install(&t->model, mesh->dim[MESH_TP], opt.sequence_parallel);
        log_info("tp: %d ranks%s; this one holds %d of %d heads, %d of %d kv heads, %d of %d ffn columns, vocab rows "
                 "[%d, %d)", tp, opt.sequence_parallel ? " with sequence parallel" : "", t->model.local.n_heads, cfg->n_heads, t->model.local.n_kv_heads, cfg->n_kv_heads,
                 t->model.local.ffn_dim, cfg->ffn_dim, t->model.local.vocab_start,
                 t->model.local.vocab_start + t->model.local.vocab_size);
    }
    if (pipelined) {
        PipelineOptions options = {pipeline_schedule(), t->n_micro, opt.pp_virtual_stages, t->micro, t->T,
                                   checkpointing_mode(), (size_t)(opt.bucket_mb * 1048576.0), !opt.no_overlap,
                                   opt.pp_schedule_dot, tp > 1 ? mesh->dim[MESH_TP] : NULL,
                                   sharded ? mesh->dp_shard_cp : NULL};
        t->pp = pipeline_create(&t->model, mesh->dim[MESH_PP], t->dp_size > 1 ? mesh->dp : NULL, &options, seed);
        if (t->dp_size > 1)
            log_info("pp x %s: %d data-parallel ranks per stage%s", sharded ? "zero-1" : "ddp", t->dp_size,
                     sharded ? ", AdamW state sharded over dp_shard" : "");
        return;
    }
    if (!sharded) {
        size_t n = t->model.table.total_numel;
        t->adam_m = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n);
        t->adam_v = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n);
        return;
    }
    FsdpOptions options = {opt.zero_stage, (ReshardPolicy)args_choice_index(RESHARD_POLICY_NAMES, opt.reshard),
                           !opt.no_overlap};
    Comm *replicate = mesh->degree[MESH_DP_REPLICATE] > 1 ? mesh->dim[MESH_DP_REPLICATE] : NULL;
    t->fsdp = fsdp_create(&t->model, mesh->dp_shard_cp, replicate, tp > 1 ? mesh->dim[MESH_TP] : NULL, &options, seed);
    log_info("%s: zero stage %d over %d shards%s, %d micro-batch(es) of %d sequences per rank, reshard after "
             "forward: %s, prefetch %s",
             replicate ? "hsdp" : "fsdp", opt.zero_stage, comm_size(mesh->dp_shard_cp),
             replicate ? " x replicated" : "", t->n_micro, t->micro, opt.reshard, opt.no_overlap ? "off" : "on");
    if (replicate) log_info("hsdp: %d replicas of the shard group", comm_size(replicate));
}

// This rank's weights (which 0), AdamW m (1), v (2) or gradients (3) in its local layout (tp
// shard, table order). Pipeline stages: all of them, on pp rank 0 only.
static void local_state(Trainer *t, int which, real *out) {
    if (t->fsdp) {
        fsdp_gather_full(t->fsdp, which, out);
        return;
    }
    if (t->pp) {
        pipeline_gather_full(t->pp, which, out);
        return;
    }
    const real *sources[4] = {t->model.params, t->adam_m, t->adam_v, t->model.grads};
    memcpy(out, sources[which], sizeof(real) * t->model.table.total_numel);
}

static void set_local_state(Trainer *t, int which, const real *in) {
    if (t->fsdp) {
        fsdp_load_full(t->fsdp, which, in);
        return;
    }
    if (t->pp) {
        pipeline_load_full(t->pp, which, in);
        return;
    }
    real *dst = which == 0 ? t->model.params : which == 1 ? t->adam_m : t->adam_v;
    memcpy(dst, in, sizeof(real) * t->model.table.total_numel);
}

// The full tensors of one kind (see local_state) on every rank, in the full table's layout.
static void full_state(Trainer *t, int which, real *local, real *full) {
    local_state(t, which, local);
    tp_gather_full(&t->model, t->mesh->dim[MESH_TP], local, full);
}

static void write_grad_dump(Trainer *t, const char *path) {
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    real *local = mem_alloc(MEM_OTHER, sizeof(real) * t->model.table.total_numel);
    real *full = mem_alloc(MEM_OTHER, sizeof(real) * whole.table.total_numel);
    full_state(t, 3, local, full);
    if (t->mesh->rank == 0) {
        dump_write_flat(&whole, "grad.", full, path);
        log_info("step-1 gradients written to %s", path);
    }
    mem_free(local);
    mem_free(full);
    param_table_free(&whole.table);
}

// Checkpoints hold the full tensors whatever the layout: FSDP shards are gathered over dp_shard,
// then tensor-parallel slices over tp; every rank takes part, rank 0 writes.
static void save_state(Trainer *t, const char *path, long long step, const RunIdentity *run) {
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    size_t n_local = t->model.table.total_numel, n = whole.table.total_numel;
    real *local = mem_alloc(MEM_OTHER, sizeof(real) * n_local), *full[3];
    for (int which = 0; which < 3; which++) {
        full[which] = mem_alloc(MEM_OTHER, sizeof(real) * n);
        full_state(t, which, local, full[which]);
    }
    whole.params = full[0];
    if (t->mesh->rank == 0) checkpoint_save(path, &whole, full[1], full[2], step, run);
    for (int which = 0; which < 3; which++) mem_free(full[which]);
    mem_free(local);
    param_table_free(&whole.table);
}

static long long load_state(Trainer *t, const char *path, const RunIdentity *run) {
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    size_t n_local = t->model.table.total_numel, n = whole.table.total_numel;
    real *local = mem_alloc(MEM_OTHER, sizeof(real) * n_local), *full[3];
    for (int which = 0; which < 3; which++) full[which] = mem_alloc(MEM_OTHER, sizeof(real) * n);
    whole.params = full[0];
    long long step = checkpoint_load(path, &whole, full[1], full[2], run);
    for (int which = 0; which < 3; which++) {
        tp_scatter_full(&t->model, full[which], local);
        set_local_state(t, which, local);
        mem_free(full[which]);
    }
    mem_free(local);
    param_table_free(&whole.table);
    return step;
}

// Chapter 7's flags, before any rank starts: the schedule must exist for (p, m, v), the model must
// split into p * v stages, and what pipeline stages do not combine with yet is refused.
static void check_pipeline_flags(const ModelConfig *cfg, const ArgSpec *flags) {
    static const char *const pp_only[] = {"pp-schedule", "pp-microbatches", "pp-virtual-stages", "pp-schedule-dot"};
    if (opt.pp == 1) {
        for (int i = 0; i < 4; i++)
            if (args_given(flags, N_FLAGS, pp_only[i])) fatal_input("--%s: needs --pp 2 or more", pp_only[i]);
        return;
    }
    if (opt.pp_microbatches == 0) opt.pp_microbatches = opt.pp;
    const char *rule = pp_schedule_check(pipeline_schedule(), opt.pp, opt.pp_microbatches, opt.pp_virtual_stages);
    if (rule)
        fatal_input("--pp-schedule %s --pp %d --pp-microbatches %d --pp-virtual-stages %d: %s", opt.pp_schedule, opt.pp,
                    opt.pp_microbatches, opt.pp_virtual_stages, rule);
    rule = pipeline_check(cfg, opt.pp, opt.pp_virtual_stages);
    if (rule)
        fatal_input("--pp %d x --pp-virtual-stages %d on %d layers: %s", opt.pp, opt.pp_virtual_stages, cfg->n_layers,
                    rule);
    if (opt.dp_shard > 1 && opt.zero_stage != 1)
        fatal_input("--pp %d with --dp-shard %d: pipeline stages shard only the optimizer state; add --zero-stage 1 "
                    "(stages 2-3 would gather and scatter every micro-batch)", opt.pp, opt.dp_shard);
    if (opt.grad_accum_steps > 1)
        fatal_input("--grad-accum-steps %d: with --pp the micro-batches are --pp-microbatches", opt.grad_accum_steps);
    check_writable("pp-schedule-dot", opt.pp_schedule_dot);
}

// The parallel layout: checks the flags against the world size and the batch.
static Mesh *setup_mesh(void) {
    if (opt.sequence_parallel && opt.tp == 1) fatal_input("--sequence-parallel: needs --tp 2 or more");
    if (opt.desync_init && opt.dp_shard > 1)
        fatal_input("--desync-init: shows DDP's initial broadcast; sharded ranks each build only their own shard");
    Mesh *mesh = mesh_create(opt.pp, opt.dp_replicate, opt.dp_shard, 1, opt.tp);
    int dp = opt.dp_replicate * opt.dp_shard, micro = opt.pp > 1 ? opt.pp_microbatches : opt.grad_accum_steps;
    if (opt.batch % (dp * micro) != 0)
        fatal_input("--batch %d: must be divisible by data-parallel ranks (%d) x %s (%d) = %d", opt.batch, dp,
                    opt.pp > 1 ? "--pp-microbatches" : "--grad-accum-steps", micro, dp * micro);
    if (opt.dump && (mesh->world_size > 1 || opt.grad_accum_steps > 1))
        fatal_input("--dump: records the single-process reference; run it without mpirun and --grad-accum-steps");
    if (opt.mesh_dot && mesh->rank == 0) mesh_write_dot(mesh, opt.mesh_dot);
    return mesh;
}

int main(int argc, char **argv) {
    ArgSpec flags[N_FLAGS];
    memcpy(flags, FLAGS, sizeof flags);
    flags[0].choices = MODEL_CONFIG_NAMES;
    args_parse(flags, N_FLAGS, argc, argv, "train",
               "Trains Llama 3: the single-process CPU reference alone, the parallel modules under mpirun.");
    matmul_set_backend(strcmp(opt.matmul, "loop") == 0 ? MATMUL_LOOP : MATMUL_BLAS);
    AttentionImpl attention = strcmp(opt.attention, "naive") == 0 ? ATTN_NAIVE : ATTN_FLASH;
    if (opt.compare) return dump_compare(opt.compare, attention, opt.compare_rtol);

    ModelConfig cfg = resolve_config();
    print_model_info(&cfg, opt.seq_len);
    if (opt.model_info) return 0;
    check_pipeline_flags(&cfg, flags);
    check_writable("trace", opt.trace);
    check_writable("trace-json", opt.trace_json);
    check_writable("dump", opt.dump);
    check_writable("grad-dump", opt.grad_dump);
    check_writable("mesh-dot", opt.mesh_dot);
    if (opt.dump && opt.resume) fatal_input("--dump: records a run from step 1; it cannot be combined with --resume");

    bool tracing = opt.trace || opt.trace_json || opt.trace_hta;
    comm_init(&argc, &argv, &(CommOptions){.timeout_seconds = opt.comm_timeout, .trace = tracing});
    log_set_rank(comm_rank(comm_world()));
    Trainer t = {.B = opt.batch, .T = opt.seq_len};
    t.mesh = setup_mesh();
    t.dp_size = comm_size(t.mesh->dp);
    t.dp_index = comm_rank(t.mesh->dp);
    t.n_micro = opt.pp > 1 ? opt.pp_microbatches : opt.grad_accum_steps;
    t.micro = t.B / (t.dp_size * t.n_micro);
    if (opt.checkpoint_dir && t.mesh->rank == 0) ensure_directory(opt.checkpoint_dir);
    if (tracing) {
        trace_align_clocks(comm_world());
        trace_init(t.mesh->rank, t.mesh->label);
        mem_set_observer(trace_memory_observer);
    }

    t.data = data_open(opt.data, cfg.vocab_size, t.T, (uint64_t)opt.seed);
    // --desync-init: replicas differ (what DDP's broadcast must fix), the ranks of one replica agree
    uint64_t init_seed = (uint64_t)opt.seed + (opt.desync_init ? (uint64_t)t.dp_index : 0);
    setup_training_state(&t, &cfg, attention, init_seed);
    ActCheckpoint ac = checkpointing_mode();
    if (!t.pp) t.acts = model_acts_alloc(&t.model, t.micro, t.T, ac);  // (the pipeline's: per micro-batch in flight)
    log_checkpointing(&t.model, t.micro, t.T, ac);
    int rows = t.pp ? t.micro * t.n_micro : t.micro;
    t.inputs = mem_alloc(MEM_OTHER, sizeof(int) * rows * t.T);
    t.targets = mem_alloc(MEM_OTHER, sizeof(int) * rows * t.T);

    RunIdentity run = {(uint64_t)opt.seed, opt.data, t.B, t.T, opt.steps};
    long long start_step = 0;
    if (opt.resume) {
        char path[4096];
        checkpoint_resolve(opt.resume, path, sizeof path);
        start_step = load_state(&t, path, &run);
        log_info("resumed from %s after step %lld", path, start_step);
    }
    if (t.dp_size > 1 && !t.fsdp && !t.pp) {
        t.ddp = ddp_create(&t.model, t.mesh->dp, (size_t)(opt.bucket_mb * 1048576.0), !opt.no_overlap);
        ddp_broadcast_params(t.ddp);  // replicas start equal, whatever each rank initialised
        log_info("ddp: %d replicas, %d micro-batch(es) of %d sequences each per rank, %d buckets of <= %g MiB, %s",
                 t.dp_size, t.n_micro, t.micro, t.ddp->n_buckets, opt.bucket_mb,
                 opt.no_overlap ? "all-reduce after backward" : "all-reduce overlapping backward");
    }
    t.schedule = (LrSchedule){opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.steps,
                              strcmp(opt.lr_decay, "linear") == 0     ? DECAY_LINEAR
                              : strcmp(opt.lr_decay, "constant") == 0 ? DECAY_CONSTANT
                                                                      : DECAY_COSINE};
    t.adam = (AdamWConfig){opt.beta1, opt.beta2, opt.eps, opt.weight_decay};
    DumpRecorder dump_recorder;
    if (opt.dump) {
        dump_begin(&dump_recorder, &t.model, opt.steps, t.B, t.T, &t.adam, opt.grad_clip);
        t.dump = &dump_recorder;
    }
    double floor = data_entropy_floor(t.data);
    log_info("data: %s", data_describe(t.data));
    if (!isnan(floor)) log_info("loss floor (entropy rate of the source): %.4f nats/token", floor);
    log_info("batch %d x seq %d = %d tokens/step, %d steps, lr %g (warmup %d, %s decay), seed %lld", t.B, t.T,
             t.B * t.T, opt.steps, opt.lr, opt.warmup_steps, opt.lr_decay, opt.seed);
    if (t.mesh->world_size > 1) log_info("mesh: %d ranks; rank 0 is %s", t.mesh->world_size, t.mesh->label);

    // Step boundaries get their own track, so the compute track holds only work (and the marked waits):
    // that is what trace-summary measures overlap against.
    int track = trace_track("steps");
    double measured_seconds = 0;
    int measured_steps = 0;
    for (long long step = start_step + 1; step <= opt.steps; step++) {
        long long t0 = now_ns();
        trace_begin(track, "step", "step");
        trace_arg_int(track, "step", step);
        StepResult r = train_step(&t, step);
        trace_end(track);
        double seconds = (now_ns() - t0) * 1e-9;
        if (step - start_step > 2) measured_seconds += seconds, measured_steps++;  // skip warm-up steps
        if (step % opt.log_every == 0 || step == opt.steps)
            log_info("step %5lld | loss %.6f | grad_norm %.4f | lr %.3e | %.0f tok/s | mem %.1f MiB", step, r.loss,
                     r.grad_norm, r.lr, t.B * t.T / seconds, mem_current_total() / 1048576.0);
        bool periodic = opt.checkpoint_every > 0 && step % opt.checkpoint_every == 0;
        if (opt.checkpoint_dir && (periodic || step == opt.steps)) {
            char path[4096];
            checkpoint_path_for_step(opt.checkpoint_dir, step, path, sizeof path);
            trace_begin(track, "checkpoint", "io");
            save_state(&t, path, step, &run);
            trace_end(track);
            if (t.mesh->rank == 0) log_info("checkpoint written to %s", path);
        }
    }
    if (measured_steps > 0)
        log_info("timing: steps=%d measured=%d mean_step_ms=%.2f tokens_per_s=%.1f", opt.steps, measured_steps,
                 1e3 * measured_seconds / measured_steps, (double)t.B * t.T * measured_steps / measured_seconds);
    mem_print_report();
    if (t.fsdp) fsdp_print_memory_estimate(t.fsdp);
    if (t.dump) {
        dump_write(t.dump, &t.model, opt.dump);
        log_info("dump written to %s", opt.dump);
    }
    if (tracing) {
        TraceOutputs outputs = {opt.trace, opt.trace_json, opt.trace_hta};
        if (!trace_gather_and_write_outputs(comm_world(), &outputs)) fatal("could not write the trace");
        if (opt.trace) log_info("trace written to %s (open it at https://ui.perfetto.dev)", opt.trace);
        if (opt.trace_json) log_info("trace written to %s", opt.trace_json);
        if (opt.trace_hta) log_info("per-rank traces for Holistic Trace Analysis written to %s/", opt.trace_hta);
    }

    ddp_free(t.ddp);
    fsdp_free(t.fsdp);
    pipeline_free(t.pp);
    mem_free(t.inputs);
    mem_free(t.targets);
    model_acts_free(&t.acts);
    mem_free(t.adam_m);
    mem_free(t.adam_v);
    model_free(&t.model);
    data_close(t.data);
    mesh_free(t.mesh);
    trace_shutdown();
    comm_finalize();
    return 0;
}
