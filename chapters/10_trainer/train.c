// train.c: the training program. Alone it runs the single-process reference; under mpirun the
// chapters' parallel modules split the work behind the same flags, each reached through one
// contract (trainer.h; docs/ARCHITECTURE.md). --batch is always the GLOBAL batch, so every config
// can be compared with the single process at equal tokens/step.
//
//   ./build/train --model small --steps 150 --trace build/small.pftrace
//   ./build/train --model tiny --steps 10 --dump ref.safetensors     (what other code checks against)
//   ./build/train --compare their_dump.safetensors                    (check their numbers against ours)
//   mpirun -np 4 ./build/train --dp-replicate 4 --trace ddp.pftrace   (chapter 2: data parallel)
//   mpirun -np 4 ./build/train --dp-shard 4 --zero-stage 3            (chapter 3: FSDP)
//   mpirun -np 4 ./build/train --dp-replicate 2 --dp-shard 2          (chapter 4: HSDP)
//   mpirun -np 4 ./build/train --tp 2 --dp-shard 2                    (chapter 6: tensor parallel, with FSDP)
//   mpirun -np 4 ./build/train --pp 4 --pp-schedule 1F1B --pp-microbatches 8   (chapter 7: pipeline parallel)
#include <dirent.h>
#include <errno.h>
//   ./build/train --init-from hf:llama-3.2-1b --seq-len 512 --data tokens:t.bin --export-hf tuned   (HF.md)
//   ./build/train --model small --fp8 --fp8-recipe rowwise            (chapter 9: FP8 linears, emulated)
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "chapters/03_fsdp/fsdp.h"
#include "chapters/07_pipeline_parallel/pipeline.h"
#include "chapters/09_fp8/fp8.h"
#include "chapters/10_trainer/trainer.h"
#include "common/args.h"
#include "common/comm.h"
#include "common/data.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/mesh.h"
#include "common/safetensors.h"
#include "common/trace.h"
#include "common/trace_dist.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/checkpoint.h"
#include "reference_cpu/dump.h"
#include "reference_cpu/hf.h"
#include "reference_cpu/model.h"

typedef struct {
    const char *model, *data, *lr_decay, *attention, *matmul, *ac, *reshard;
    const char *checkpoint_dir, *resume, *trace, *trace_json, *dump, *compare, *mesh_dot, *trace_hta, *grad_dump;
    const char *pp_schedule, *pp_schedule_dot, *device, *cp_mode, *cp_load_balance, *init_from, *export_hf, *fp8_recipe;
    int fp8_amax_history;
    int steps, batch, seq_len, n_layers, warmup_steps, checkpoint_every, log_every;
    int dp_replicate, dp_shard, grad_accum_steps, zero_stage, tp, pp, pp_microbatches, pp_virtual_stages, cp;
    long long seed;
    double lr, min_lr_ratio, weight_decay, beta1, beta2, eps, grad_clip, rope_theta, compare_rtol;
    double bucket_mb, comm_timeout, export_hf_shard_mb, peak_tflops;
    bool model_info, no_overlap, desync_init, sequence_parallel, fp8, fp8_all_gather, cuda_sync_debug;
    const char *all_gather_dtype;
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
    {"lr-decay", ARG_CHOICE, &opt.lr_decay, "cosine", "decay after warmup", .choices = LR_DECAY_NAMES},
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
    {"rope-theta", ARG_DOUBLE, &opt.rope_theta, NULL, "RoPE base (default: the model's)", .min = 1,
     .max = UNBOUNDED},
    {"device", ARG_CHOICE, &opt.device, "cpu",
     "where the model runs: cpu (the reference and every chapter), cuda (the GPU model: the single process, "
     "--dp-replicate, --dp-shard, --tp, --pp, --cp)", .choices = DEVICE_NAMES},
    {"cuda-sync-debug", ARG_BOOL, &opt.cuda_sync_debug, NULL,
     "with --device cuda: wait for every kernel as it is launched, so a fault names the kernel and its file:line "
     "(slow; the same as LLAMA_CUDA_SYNC_DEBUG=1)", .value_name = ""},
    {"peak-tflops", ARG_DOUBLE, &opt.peak_tflops, "0",
     "one device's (rank's) peak TFLOP/s: the log line adds MFU, the job's model FLOP/s over ranks x this peak",
     .min = 0, .max = UNBOUNDED},
    {"attention", ARG_CHOICE, &opt.attention, "flash", "attention kernel", .choices = ATTENTION_IMPL_NAMES},
    {"matmul", ARG_CHOICE, &opt.matmul, "blas", "matmul backend", .choices = MATMUL_BACKEND_NAMES},
    {"ac", ARG_CHOICE, &opt.ac, "none",
     "activation checkpointing: full recomputes each block in backward, selective only its element-wise ops "
     "(chapter 5)", .choices = AC_MODE_NAMES},
    {"init-from", ARG_STRING, &opt.init_from, NULL,
     "initial weights and model config from a Hugging Face Llama checkpoint directory (config.json, safetensors); "
     "each rank reads only what it holds", .value_name = "hf:DIR"},
    {"export-hf", ARG_STRING, &opt.export_hf, NULL,
     "after the last step, write the weights as a Hugging Face Llama checkpoint (config.json, safetensors)",
     .value_name = "DIR"},
    {"export-hf-shard-mb", ARG_DOUBLE, &opt.export_hf_shard_mb, "5120",
     "--export-hf: tensor data per safetensors file in MiB (its header on top); more weights than that are split "
     "into shards with an index",
     .min = 0.001, .max = UNBOUNDED},
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
    {"cp", ARG_INT, &opt.cp, "1",
     "context-parallel ranks: each holds 1/cp of every sequence's tokens, attention runs across them (chapter 8)",
     .min = 1, .max = UNBOUNDED},
    {"cp-mode", ARG_CHOICE, &opt.cp_mode, "ring", "with --cp: ring attention, or all-to-all (DeepSpeed-Ulysses)",
     .choices = CP_MODE_NAMES},
    {"cp-load-balance", ARG_CHOICE, &opt.cp_load_balance, "on",
     "with --cp: on = zigzag split (2 chunks per rank, equal causal work), off = contiguous chunks",
     .choices = "on|off"},
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
    {"fp8", ARG_BOOL, &opt.fp8, NULL,
     "FP8 linears: the three GEMMs of every block projection on FP8 operands, emulated on the CPU (chapter 9)",
     .value_name = ""},
    {"fp8-recipe", ARG_CHOICE, &opt.fp8_recipe, "tensorwise", "with --fp8: how tensors are scaled into FP8",
     .choices = FP8_RECIPE_NAMES},
    {"fp8-amax-history", ARG_INT, &opt.fp8_amax_history, "1024",
     "with --fp8-recipe delayed: steps of amax history a scale comes from", .min = 1, .max = 65536},
    {"fp8-all-gather", ARG_BOOL, &opt.fp8_all_gather, NULL,
     "with --fp8 (tensorwise) and --zero-stage 3: all-gather the projections' weights as E4M3 bytes", .value_name = ""},
    {"all-gather-dtype", ARG_CHOICE, &opt.all_gather_dtype, "auto",
     "ZeRO-3: the weights' all-gather in fp32, or in bf16 (half the bytes; gradients still reduce-scattered in "
     "fp32); auto: bf16 with --device cuda (without --fp8), whose bf16 compute gives the same numbers, fp32 on the CPU",
     .choices = "auto|fp32|bf16"},
    {"grad-accum-steps", ARG_INT, &opt.grad_accum_steps, "1",
     "micro-batches per optimizer step on each rank; DDP and ZeRO-1 sync gradients after the last, ZeRO-2/3 "
     "reduce-scatter after each", .min = 1, .max = UNBOUNDED},
    {"bucket-mb", ARG_DOUBLE, &opt.bucket_mb, "25", "DDP gradient bucket size in MiB", .min = 1e-6, .max = 1e6},
    {"no-overlap", ARG_BOOL, &opt.no_overlap, NULL,
     "DDP: all-reduce every bucket after backward instead of during it; FSDP: no all-gather prefetch",
     .value_name = ""},
    {"desync-init", ARG_BOOL, &opt.desync_init, NULL,
     "give every data-parallel replica a different init (seed + dp rank) to show the initial broadcast fixes it",
     .value_name = ""},
    {"comm-timeout", ARG_DOUBLE, &opt.comm_timeout, NULL,
     "seconds before a stuck collective ends the run (default: 300 until two steps are measured, then "
     "max(60, 10 x the slowest step); common/COMM.md)", .min = 0.1, .max = 1e9},  // 1e9 s in ns fits an int64
    {"mesh-dot", ARG_STRING, &opt.mesh_dot, NULL, "write the device mesh as a Graphviz diagram", .value_name = "FILE"},
    {"model-info", ARG_BOOL, &opt.model_info, NULL, "print the config, parameter count and FLOPs per token, and exit", .value_name = ""},
};
#define N_FLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

// "/" to print after a directory the user named without one ("hta" -> "hta/", "hta/" stays).
static const char *dir_slash(const char *dir) {
    size_t n = strlen(dir);
    return n > 0 && dir[n - 1] == '/' ? "" : "/";
}

// The special tokens' ids of --init-from's config.json, which --export-hf writes into its own (the
// model's shapes come from ModelConfig; the ids are the tokenizer's, kept as the source spelled them).
static char *init_token_ids;

// --init-from hf:DIR: the checkpoint's config.json is the model; the flags that would change its
// shapes or numerics are refused rather than silently overridden.
static HfCheckpoint *open_init_checkpoint(const ArgSpec *flags, ModelConfig *cfg) {
    if (strncmp(opt.init_from, "hf:", 3) != 0 || !opt.init_from[3])
        fatal_input("--init-from %s: expected hf:DIR (a Hugging Face Llama checkpoint directory)", opt.init_from);
    // its files' names are built as DIR/NAME: a DIR near PATH_MAX would be cut short, and another file opened
    if (strlen(opt.init_from + 3) + NAME_MAX + 2 >= PATH_MAX)
        fatal_input("--init-from %.60s...: path too long", opt.init_from);
    static const char *const shape_flags[] = {"model", "n-layers", "rope-theta", "desync-init"};
    for (int i = 0; i < 4; i++)
        if (args_given(flags, N_FLAGS, shape_flags[i]))
            fatal_input("--%s: not with --init-from, whose config.json sets the model and its weights", shape_flags[i]);
    HfCheckpoint *h = hf_open(opt.init_from + 3, cfg);
    init_token_ids = hf_token_ids_json(opt.init_from + 3);
    return h;
}

static ModelConfig resolve_config(const ArgSpec *flags, HfCheckpoint **init_checkpoint) {
    ModelConfig cfg;
    *init_checkpoint = NULL;
    if (opt.init_from) *init_checkpoint = open_init_checkpoint(flags, &cfg);
    else if (!model_config_lookup(opt.model, &cfg)) fatal_input("--model %s: unknown model", opt.model);
    if (opt.seq_len < 0) opt.seq_len = cfg.max_seq_len;
    if (opt.seq_len > cfg.max_seq_len) {  // the RoPE table grows with it: allowed, but said
        log_info("--seq-len %d: beyond model %s's max_seq_len %d, which grows to %d (a checkpoint records it)",
                 opt.seq_len, cfg.name, cfg.max_seq_len, opt.seq_len);
        cfg.max_seq_len = opt.seq_len;
    }
    if (opt.rope_theta > 0) cfg.rope_theta = opt.rope_theta;
    if (opt.n_layers > 0) cfg.n_layers = opt.n_layers;
    model_config_validate(&cfg, opt.seq_len);
    if (opt.warmup_steps < 0) opt.warmup_steps = opt.steps / 10;
    if (opt.warmup_steps > opt.steps)
        fatal_input("--warmup-steps %d: must not exceed --steps %d", opt.warmup_steps, opt.steps);
    if (opt.checkpoint_every > 0 && !opt.checkpoint_dir)
        fatal_input("--checkpoint-every %d: needs --checkpoint-dir", opt.checkpoint_every);
    if (args_given(FLAGS, N_FLAGS, "min-lr-ratio") && strcmp(opt.lr_decay, "constant") == 0)
        fatal_input("--min-lr-ratio: needs a decaying --lr-decay (cosine or linear); constant keeps the peak");
    const char *decay_flag = args_given(FLAGS, N_FLAGS, "min-lr-ratio") ? "min-lr-ratio"
                             : args_given(FLAGS, N_FLAGS, "lr-decay") && strcmp(opt.lr_decay, "constant") != 0 ? "lr-decay"
                             : NULL;
    if (decay_flag && opt.warmup_steps == opt.steps)
        fatal_input("--%s: --warmup-steps %d takes all %d steps, so no step decays (give fewer warmup steps)",
                    decay_flag, opt.warmup_steps, opt.steps);
    return cfg;
}

// A mode that does one thing and exits (what says what it does) refuses every flag but the ones
// it uses (NULL-terminated): a flag of the training run would be ignored.
static void refuse_flags_but(const ArgSpec *flags, const char *const *used, const char *what) {
    for (int i = 0; i < N_FLAGS; i++) {
        bool is_used = false;
        for (int u = 0; used[u]; u++) is_used |= strcmp(flags[i].name, used[u]) == 0;
        if (!is_used && args_given(flags, N_FLAGS, flags[i].name))
            fatal_input("%s; --%s would be ignored (leave it out)", what, flags[i].name);
    }
}

// Flags that mean something only with another one are refused without it: they would be ignored.
// (--bucket-mb and --no-overlap, which change when communication happens and not the numbers, are
// accepted by every layout, so that one set of flags can run them all.)
static void check_flags_that_need_others(const ArgSpec *flags) {
    const struct {
        const char *flag;
        bool has_effect;
        const char *needs;
    } rules[] = {
        {"export-hf-shard-mb", opt.export_hf != NULL, "--export-hf"},
        {"compare-rtol", opt.compare != NULL, "--compare"},
        {"desync-init", opt.dp_replicate > 1 || opt.dp_shard > 1,  // with --dp-shard: refused with the reason, later
         "--dp-replicate 2 or more (the replicas it makes differ)"},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++)
        if (!rules[i].has_effect && args_given(flags, N_FLAGS, rules[i].flag))
            fatal_input("--%s: needs %s; without it the flag would be ignored", rules[i].flag, rules[i].needs);
    if (opt.model_info) {
        static const char *const used[] = {"model-info", "model", "n-layers", "rope-theta", "seq-len", "init-from", NULL};
        refuse_flags_but(flags, used, "--model-info: prints the model and exits");
    }
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

// The file beside a checkpoint that holds delayed FP8 scaling's amax history.
static void fp8_companion(const char *checkpoint, char *out, size_t n) { snprintf(out, n, "%s.fp8", checkpoint); }

// ---- promises kept before any work (README: "What is promised, and how it is tested") -----------

// Every output can be created (fileio_check_output), the sizes fit int where the code indexes with
// int, and the planned memory fits the machine; flags that would be ignored are refused. Runs on
// every rank before comm_init, so a typo costs a second, not a run.
// A flag and the path it names.
typedef struct {
    const char *flag, *path;
} FlagPath;

// A directory output and a pattern of the names the run writes in it: prefix...suffix.
typedef struct {
    const char *flag, *dir, *prefix, *suffix;
} DirOutput;

// The file outputs, in one list for every check of them. Returns how many.
enum { N_FILE_OUTPUTS = 6 };
static int file_outputs(FlagPath out[N_FILE_OUTPUTS]) {
    const FlagPath all[N_FILE_OUTPUTS] = {{"trace", opt.trace},         {"trace-json", opt.trace_json},
                                          {"dump", opt.dump},           {"grad-dump", opt.grad_dump},
                                          {"mesh-dot", opt.mesh_dot},   {"pp-schedule-dot", opt.pp_schedule_dot}};
    memcpy(out, all, sizeof all);
    return N_FILE_OUTPUTS;
}

// path's directory ("." for a bare name) into parent; returns path's last component.
static const char *split_path(const char *path, char parent[PATH_MAX]) {
    const char *slash = strrchr(path, '/');
    snprintf(parent, PATH_MAX, "%.*s", slash ? (int)(slash - path) + 1 : 1, slash ? path : ".");
    return slash ? slash + 1 : path;
}

// Whether path names what d's directory will hold: the directory itself, or a file of its pattern in it.
static bool written_by(const DirOutput *d, const char *path) {
    if (fileio_same_file(path, d->dir)) return true;
    char parent[PATH_MAX];
    const char *base = split_path(path, parent);
    size_t n = strlen(base), np = strlen(d->prefix), ns = strlen(d->suffix);
    if (strncmp(base, d->prefix, np) != 0 || n < np + ns || strcmp(base + n - ns, d->suffix) != 0) return false;
    return fileio_same_file(parent, d->dir);
}

// The directory outputs and the names the run writes in each (checkpoints, the Hugging Face
// export, the per-rank traces for HTA). Returns how many.
enum { N_DIR_OUTPUTS = 7 };
static int dir_outputs(DirOutput dirs[N_DIR_OUTPUTS]) {
    const DirOutput all[N_DIR_OUTPUTS] = {
        {"checkpoint-dir", opt.checkpoint_dir, "step_", ""},  // step_N.safetensors, its .fp8, temporaries
        {"checkpoint-dir", opt.checkpoint_dir, ".lock", ""},  // the run's claim on the directory
        {"export-hf", opt.export_hf, "config.json", ""},      {"export-hf", opt.export_hf, "model", ".safetensors"},
        {"export-hf", opt.export_hf, "model", ".json"},        // model.safetensors.index.json
        {"trace-hta", opt.trace_hta, "rank", ".json"},         {"trace-hta", opt.trace_hta, ".merged.json.part", ""},
    };
    memcpy(dirs, all, sizeof all);
    return N_DIR_OUTPUTS;
}

// An output file may not be a file that a directory output writes: one of the two would be lost.
static void check_not_written_by_dir_outputs(const char *flag, const char *path) {
    DirOutput dirs[N_DIR_OUTPUTS];
    for (int d = 0, n = dir_outputs(dirs); d < n; d++)
        if (dirs[d].dir && written_by(&dirs[d], path))
            fatal_input("--%s %s: the run writes that into --%s %s; one of the two outputs would be lost", flag, path,
                        dirs[d].flag, dirs[d].dir);
}

// Nor may a directory output be a name another directory output writes (--checkpoint-dir
// EXPORT/model.safetensors beside --export-hf EXPORT): the second would fail after the training.
// Two outputs in one directory are fine where their names differ.
static void check_dir_outputs_apart(void) {
    DirOutput dirs[N_DIR_OUTPUTS];
    int n = dir_outputs(dirs);
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++)
            if (dirs[a].dir && dirs[b].dir && strcmp(dirs[a].flag, dirs[b].flag) != 0 &&
                !fileio_same_file(dirs[a].dir, dirs[b].dir) && written_by(&dirs[b], dirs[a].dir))
                fatal_input("--%s %s: the run writes that into --%s %s; one of the two outputs would be lost",
                            dirs[a].flag, dirs[a].dir, dirs[b].flag, dirs[b].dir);
}

// An input that a directory output writes over (the training text inside --trace-hta, the
// checkpoint resumed from named like an export's file): the run would destroy what it reads.
static void check_input_not_written_by_dir_outputs(const FlagPath *input) {
    DirOutput dirs[N_DIR_OUTPUTS];
    for (int d = 0, n = dir_outputs(dirs); d < n; d++) {
        // a resumed run writes later steps only (checkpoint_dir_claim refuses a directory holding them)
        if (strcmp(dirs[d].flag, "checkpoint-dir") == 0 && strcmp(input->flag, "resume") == 0) continue;
        if (dirs[d].dir && written_by(&dirs[d], input->path))
            fatal_input("--%s %s: is the file --%s reads (%s); the run would overwrite it", dirs[d].flag, dirs[d].dir,
                        input->flag, input->path);
    }
}

// The file --data reads (text: or tokens:), NULL for a generated source.
static const char *data_file_path(void) {
    return strncmp(opt.data, "text:", 5) == 0 ? opt.data + 5 : strncmp(opt.data, "tokens:", 7) == 0 ? opt.data + 7 : NULL;
}

// No output file may be one of the run's inputs (it would overwrite what the run reads: the
// training text, the checkpoint it resumes from and its FP8 companion, any file of the checkpoint
// it starts from, shards included) or another output (one of the two would be lost); no directory
// output may write over an input; --export-hf may not write over --init-from's checkpoint.
static void check_outputs_distinct(void) {
    FlagPath outputs[N_FILE_OUTPUTS];
    enum { N_INIT = 3 };
    file_outputs(outputs);
    // The inputs: the data file, the checkpoint resumed from (and delayed FP8's companion beside it),
    // the Hugging Face checkpoint's files; its shards, whatever their number, by their pattern.
    static const char *const init_names[N_INIT] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
    char resume[PATH_MAX] = "", companion[PATH_MAX + 8] = "", init_files[N_INIT][PATH_MAX + 48];
    if (opt.resume) checkpoint_resolve(opt.resume, resume, sizeof resume);
    if (opt.resume) fp8_companion(resume, companion, sizeof companion);
    const char *data_file = data_file_path();
    const char *init_dir = opt.init_from && strncmp(opt.init_from, "hf:", 3) == 0 ? opt.init_from + 3 : NULL;
    FlagPath inputs[3 + N_INIT] = {
        {"data", data_file}, {"resume", opt.resume ? resume : NULL}, {"resume", opt.resume ? companion : NULL}};
    for (int i = 0; init_dir && i < N_INIT; i++) {
        snprintf(init_files[i], sizeof init_files[i], "%s/%s", init_dir, init_names[i]);
        inputs[3 + i].flag = "init-from", inputs[3 + i].path = init_files[i];
    }
    const DirOutput init_shards = {"init-from", init_dir, "model", ".safetensors"};
    for (int o = 0; o < N_FILE_OUTPUTS; o++) {
        if (!outputs[o].path) continue;
        for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++)
            if (inputs[i].path && fileio_same_file(outputs[o].path, inputs[i].path))
                fatal_input("--%s %s: is the file --%s reads (%s); the run would overwrite it", outputs[o].flag,
                            outputs[o].path, inputs[i].flag, inputs[i].path);
        if (init_dir && written_by(&init_shards, outputs[o].path))
            fatal_input("--%s %s: is a file of the checkpoint --init-from reads (%s); the run would overwrite it",
                        outputs[o].flag, outputs[o].path, init_dir);
        for (int p = o + 1; p < N_FILE_OUTPUTS; p++)
            if (outputs[p].path && fileio_same_file(outputs[o].path, outputs[p].path))
                fatal_input("--%s %s and --%s %s: the same file; one of the two outputs would be lost", outputs[o].flag,
                            outputs[o].path, outputs[p].flag, outputs[p].path);
    }
    if (opt.export_hf && init_dir && fileio_same_file(opt.export_hf, init_dir))
        fatal_input("--export-hf %s: is the checkpoint --init-from reads; export to another directory", opt.export_hf);
    for (int o = 0; o < N_FILE_OUTPUTS; o++)
        if (outputs[o].path) check_not_written_by_dir_outputs(outputs[o].flag, outputs[o].path);
    check_dir_outputs_apart();
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++)
        if (inputs[i].path) check_input_not_written_by_dir_outputs(&inputs[i]);
}

// HolisticTraceAnalysis reads every .json and .gz file of its directory as a rank's trace (the
// rank from inside the file), so --trace-hta DIR may hold only the rankN.json files this run writes:
// an earlier run's rank2.json or rank2.json.gz, another output's JSON (--trace-json into DIR,
// --export-hf's config.json) would be read as one of this run's ranks.
static bool hta_reads(const char *name) {
    size_t n = strlen(name);
    return (n >= 5 && strcmp(name + n - 5, ".json") == 0) || (n >= 3 && strcmp(name + n - 3, ".gz") == 0);
}
static bool rank_file_of_this_run(const char *name, long long world) {
    long long rank;
    int consumed = 0;
    char canonical[64];
    if (sscanf(name, "rank%lld.json%n", &rank, &consumed) != 1 || name[consumed] != 0) return false;
    snprintf(canonical, sizeof canonical, "rank%lld.json", rank);
    return strcmp(canonical, name) == 0 && rank >= 0 && rank < world;
}
static void check_hta_dir_is_this_runs(long long world) {
    FlagPath files[N_FILE_OUTPUTS];
    for (int i = 0, n = file_outputs(files); i < n; i++) {
        if (!files[i].path) continue;
        char parent[PATH_MAX];
        const char *base = split_path(files[i].path, parent);
        if (hta_reads(base) && fileio_same_file(parent, opt.trace_hta))
            fatal_input("--%s %s: is inside --trace-hta %s, where HTA would read it as a rank's trace; write it "
                        "elsewhere", files[i].flag, files[i].path, opt.trace_hta);
    }
    if (opt.export_hf && fileio_same_file(opt.export_hf, opt.trace_hta))
        fatal_input("--export-hf %s: is --trace-hta's directory, where HTA would read its config.json as a rank's "
                    "trace; export to another directory", opt.export_hf);
    DIR *d = opendir(opt.trace_hta);
    if (!d) return;  // a new directory
    for (struct dirent *e; (e = readdir(d));)
        if (hta_reads(e->d_name) && !rank_file_of_this_run(e->d_name, world))
            fatal_input("--trace-hta %s: holds %s, which this run of %lld rank(s) does not write and HTA would read as "
                        "one of its ranks (it reads every .json and .gz file there); remove it or give another "
                        "directory", opt.trace_hta, e->d_name, world);
    closedir(d);
}

static void check_before_work(const ModelConfig *cfg, const ArgSpec *flags) {
    static const struct {
        const char *flag, **path;
        OutputKind kind;
    } outputs[] = {
        {"trace", &opt.trace, OUTPUT_FILE},          {"trace-json", &opt.trace_json, OUTPUT_FILE},
        {"trace-hta", &opt.trace_hta, OUTPUT_DIR},   {"dump", &opt.dump, OUTPUT_FILE},
        {"grad-dump", &opt.grad_dump, OUTPUT_FILE},  {"checkpoint-dir", &opt.checkpoint_dir, OUTPUT_DIR},
        {"mesh-dot", &opt.mesh_dot, OUTPUT_FILE},    {"pp-schedule-dot", &opt.pp_schedule_dot, OUTPUT_FILE},
        {"export-hf", &opt.export_hf, OUTPUT_DIR},
    };
    for (size_t i = 0; i < sizeof outputs / sizeof outputs[0]; i++)
        fileio_check_output(outputs[i].flag, *outputs[i].path, outputs[i].kind);
    check_outputs_distinct();
    DirOutput dirs[N_DIR_OUTPUTS];  // what the run will write in them must be replaceable
    for (int d = 0, n = dir_outputs(dirs); d < n; d++)
        // the export's: hf_export_check's, below; the lock: checkpoint_dir_claim's (it is opened, not renamed over)
        if (strcmp(dirs[d].flag, "export-hf") != 0 && strcmp(dirs[d].prefix, ".lock") != 0)
            fileio_check_dir_entries(dirs[d].flag, dirs[d].dir, dirs[d].prefix, dirs[d].suffix);
    if (opt.export_hf) hf_export_check(opt.export_hf, cfg, ST_F32, (size_t)(opt.export_hf_shard_mb * 1048576.0));
    if (opt.trace_hta)
        check_hta_dir_is_this_runs((long long)opt.pp * opt.dp_replicate * opt.dp_shard * opt.cp * opt.tp);
    if (args_given(flags, N_FLAGS, "zero-stage") && opt.dp_shard == 1)
        fatal_input("--zero-stage %d: shards over --dp-shard, which is 1 here (give --dp-shard 2 or more, or leave "
                    "--zero-stage out)", opt.zero_stage);
    // the tokens of a step (B, T) are counted and indexed with int
    if ((uint64_t)opt.batch * (uint64_t)opt.seq_len > INT32_MAX)
        fatal_input("--batch %d x --seq-len %d: %" PRIu64 " tokens per step, more than 2^31 - 1", opt.batch,
                    opt.seq_len, (uint64_t)opt.batch * (uint64_t)opt.seq_len);
    uint64_t dp = (uint64_t)opt.dp_replicate * (uint64_t)opt.dp_shard;
    uint64_t n_micro = (uint64_t)(opt.pp > 1 ? opt.pp_microbatches : opt.grad_accum_steps);
    uint64_t micro = (uint64_t)opt.batch / dp / n_micro;  // sequences per micro-batch on one rank
    if (opt.tp > 1) param_check_tp(cfg, opt.tp);  // what trainer_setup_layout would refuse, after MPI started
    uint64_t sp_tokens = micro * (uint64_t)(opt.seq_len / opt.cp);  // a micro-batch's tokens on one cp rank
    if (opt.sequence_parallel) trainer_check_sequence_parallel(sp_tokens, opt.tp);
    // The plan is of host memory: with --device cuda the state lives on the GPU, whose allocator
    // reports what does not fit.
    if (args_choice_index(DEVICE_NAMES, opt.device) != DEVICE_CPU) return;
    uint64_t ranks = mem_mul(mem_mul(mem_mul(dp, (uint64_t)opt.pp), (uint64_t)opt.tp), (uint64_t)opt.cp);
    char what[200];
    snprintf(what, sizeof what, "--model %s --n-layers %d --batch %d --seq-len %d on %" PRIu64 " rank(s)", cfg->name,
             cfg->n_layers, opt.batch, opt.seq_len, ranks);
    bool sharded = opt.dp_shard > 1;  // FSDP (chapter 3) over dp_shard x cp; cp alone runs DDP
    ModelSplit split = {opt.pp, opt.tp, opt.cp, sharded ? opt.dp_shard * opt.cp : 1, sharded ? opt.zero_stage : 0,
                        opt.sequence_parallel};
    // Every rank reads the --data file whole, and holds it twice while it loads (common/data.c).
    struct stat data_st;
    const char *data_file = data_file_path();
    uint64_t data_bytes = data_file && stat(data_file, &data_st) == 0 ? mem_mul((uint64_t)data_st.st_size, 2) : 0;
    if (data_bytes) snprintf(what + strlen(what), sizeof what - strlen(what), " with its --data file");
    mem_check_plan(what, mem_add(model_plan_bytes(cfg, micro ? micro : 1, (uint64_t)opt.seq_len, &split), data_bytes),
                   mem_local_processes());
}

// The comm timeout follows the measured steps unless --comm-timeout fixes it (common/COMM.md):
// max(60 s, 10 x the slowest step) once two steps are measured; the start-up value around the
// writes of rank 0 (checkpoints, dumps, traces), which the other ranks wait for.
static void adapt_comm_timeout(double step_seconds, bool measured, const ArgSpec *flags) {
    static double slowest, derived;  // derived: the value last set from the steps (0: none yet)
    static int n_measured;
    if (args_given(flags, N_FLAGS, "comm-timeout")) return;
    if (!measured) {
        comm_set_timeout(COMM_STARTUP_TIMEOUT_S);
        return;
    }
    if (step_seconds > slowest) slowest = step_seconds;
    if (++n_measured < 2) return;
    double now = comm_timeout_for_step(slowest);
    comm_set_timeout(now);
    // Logged when it changes, compared with what was derived before (the timeout itself is stored
    // in nanoseconds, so reading it back need not give the same double).
    if (now != derived)
        log_info("comm timeout: %.0f s = max(%.0f s, %.0f x the slowest step (%.3f s))", now, COMM_TIMEOUT_FLOOR_S,
                 COMM_TIMEOUT_STEP_FACTOR, slowest);
    derived = now;
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

// This rank's slice of the step's global batch: every micro-batch it runs.
static StepBatch load_step_batch(Trainer *t, const DataSource *data, long long step) {
    int local = t->micro * t->n_micro;
    data_batch(data, step, t->B, t->dp_index * local, local, t->cp_layout.T, t->full_inputs, t->full_targets);
    cp_take_local(&t->cp_layout, t->full_inputs, t->inputs, local);  // this cp rank's tokens (all: a copy)
    cp_take_local(&t->cp_layout, t->full_targets, t->targets, local);
    return (StepBatch){t->inputs, t->targets, t->n_micro, t->micro, t->T, step};
}

// One optimizer step through the contract: forward/backward (with gradient sync), the extensions,
// clip, AdamW. Returns the loss over the global batch before the update.
static StepResult train_step(Trainer *t, const DataSource *data, long long step, const LrSchedule *schedule,
                             const AdamWConfig *adam, TrainerExtension *ext, int n_ext) {
    Strategy *s = t->strategy;
    int track = trace_track("compute");  // every part of the step is a slice: no untraced gap in it
    trace_begin(track, "data", "phase");
    StepBatch batch = load_step_batch(t, data, step);
    trace_end(track);
    StepResult r = {.lr = lr_at(schedule, step)};
    trace_begin(track, "zero grads", "phase");
    s->zero_grads(s);
    trace_end(track);
    r.loss = s->forward_backward(s, &batch);
    // the mean over the dp ranks' sequences and the cp ranks' tokens (each holds as many)
    if (comm_size(t->mesh->dp_cp) > 1) comm_all_reduce(t->mesh->dp_cp, &r.loss, 1, COMM_FLOAT64, COMM_AVG);
    trace_begin(track, "optimizer", "phase");
    r.grad_norm = s->grad_norm(s);  // every rank clips by the global norm and updates what it holds
    if (!isfinite(r.grad_norm)) fatal("step %lld: gradient norm is %g; stopping", step, r.grad_norm);
    for (int i = 0; i < n_ext; i++)
        if (ext[i].after_gradients) ext[i].after_gradients(ext[i].ctx, t, &batch, &r);
    s->clip(s, r.grad_norm, opt.grad_clip);
    s->optimizer_step(s, step, r.lr, adam);
    for (int i = 0; i < n_ext; i++)
        if (ext[i].after_step) ext[i].after_step(ext[i].ctx, t, &batch, &r);
    trace_end(track);
    return r;
}

// ---- extensions: the reference dump (--dump) and the step-1 gradients of any layout (--grad-dump) --

typedef struct {
    DumpRecorder recorder;
    const char *path;
} ReferenceDump;

static void dump_after_gradients(void *ctx, Trainer *t, const StepBatch *b, const StepResult *r) {
    ReferenceDump *d = ctx;
    dump_record_step(&d->recorder, &t->model, &t->strategy->acts, b->step, b->inputs, b->targets, r->loss,
                     r->grad_norm, r->lr);
}

static void dump_finish(void *ctx, Trainer *t) {
    ReferenceDump *d = ctx;
    dump_write(&d->recorder, &t->model, d->path);
    log_info("dump written to %s", d->path);
    free(d);
}

static TrainerExtension reference_dump(Trainer *t, const AdamWConfig *adam) {
    ReferenceDump *d = calloc(1, sizeof *d);
    d->path = opt.dump;
    dump_begin(&d->recorder, &t->model, opt.steps, t->B, t->T, adam, opt.grad_clip);
    return (TrainerExtension){"dump", d, dump_after_gradients, NULL, dump_finish};
}

static void grad_dump_after_gradients(void *ctx, Trainer *t, const StepBatch *b, const StepResult *r) {
    const char *path = ctx;
    if (b->step != 1) return;
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    real *full = mem_alloc(MEM_OTHER, sizeof(real) * whole.table.total_numel);
    trainer_full_state(t, STATE_GRADS, full);
    if (t->mesh->rank == 0) {
        dump_write_flat(&whole, "grad.", full, path, "--grad-dump");
        log_info("step-1 gradients written to %s", path);
    }
    mem_free(full);
    param_table_free(&whole.table);
}

static TrainerExtension grad_dump(void) {
    return (TrainerExtension){"grad-dump", (void *)opt.grad_dump, grad_dump_after_gradients, NULL, NULL};
}

// ---- checkpoints: the full tensors whatever the layout (every rank takes part, rank 0 writes) ------

// ---- FP8 linears (chapter 9): a hook on the model, and an extension that ends each step ----------------

static Fp8 *fp8;  // --fp8, else NULL
static Fp8Hook fp8_model_hook;

// Each amax is reduced over the ranks that hold other pieces of its tensor: the tp group (features)
// and the data- and context-parallel ranks (tokens). Created before the layout, which takes the
// FP8 all-gather's codec.
static FsdpWeightCodec fp8_gather_codec;

// The options fp8_create_for and fp8_check_companion give the FP8 module.
static Fp8Options fp8_options(void) {
    return (Fp8Options){(Fp8Recipe)args_choice_index(FP8_RECIPE_NAMES, opt.fp8_recipe), opt.fp8_amax_history, 0};
}

static void fp8_create_for(Trainer *t, int n_layers, LayoutOptions *layout) {
    Fp8Options o = fp8_options();
    Comm *tokens = t->mesh->dp_cp;
    Fp8Groups groups = {t->mesh->degree[MESH_TP] > 1 ? t->mesh->dim[MESH_TP] : NULL, comm_size(tokens) > 1 ? tokens : NULL};
    fp8 = fp8_create(&o, n_layers, groups);
    if (opt.fp8_all_gather) {
        fp8_gather_codec = fp8_all_gather_codec(fp8);
        layout->weight_codec = &fp8_gather_codec;
    }
}

static void fp8_install(Trainer *t) {
    fp8_model_hook = fp8_hook(fp8);
    t->model.fp8 = &fp8_model_hook;
    const char *what = "fp8: wq wk wv wo w1 w2 w3 of every block in FP8 (emulated)";
    if (opt.fp8_recipe[0] == 'd')
        log_info("%s, delayed scaling, amax history %d", what, opt.fp8_amax_history);
    else log_info("%s, %s scaling%s", what, opt.fp8_recipe,
                  opt.fp8_all_gather ? "; ZeRO-3 all-gathers them as E4M3 bytes" : "");
}

static void fp8_after_step(void *ctx, Trainer *t, const StepBatch *b, const StepResult *r) { fp8_step_end(fp8); }

static void fp8_finish(void *ctx, Trainer *t) {
    t->model.fp8 = NULL;
    fp8_free(fp8);
    fp8 = NULL;
}

// Delayed scaling's history sits next to the checkpoint, in <checkpoint>.fp8 (fp8_companion). Pipeline
// stages each give their own blocks' entries (zeros elsewhere: fp8_state_get_own), the other ranks
// the same values: the MAX over the world is the whole state. It is only written: a stage's live
// state keeps zeros (or what a resume loaded) where other stages' blocks are, which it never updates.
static void fp8_save(Trainer *t, const char *path, long long step) {
    if (!fp8 || fp8_state_numel(fp8) == 0) return;
    size_t n = fp8_state_numel(fp8);
    float *state = mem_alloc(MEM_OTHER, sizeof(float) * n);
    fp8_state_get_own(fp8, state);
    comm_all_reduce(t->mesh->world, state, n, COMM_FLOAT32, COMM_MAX);
    char companion[4200];
    fp8_companion(path, companion, sizeof companion);
    if (t->mesh->rank == 0) fp8_state_save(fp8, state, step, companion);
    mem_free(state);
}

// The FP8 recipe a checkpoint's run recorded in its settings ("... fp8 delayed"; "none" without
// --fp8) into out; "" when it recorded none (or cannot be read: checkpoint_check has refused that).
static void recorded_fp8_recipe(const char *checkpoint, char *out, size_t n) {
    char err[1024];
    *out = 0;
    StFile *f = st_open_header(checkpoint, err, sizeof err);
    const char *settings = f ? st_metadata(f, "settings") : NULL, *at = settings ? strstr(settings, "fp8 ") : NULL;
    if (at) snprintf(out, n, "%.*s", (int)strcspn(at + 4, ", "), at + 4);
    st_close(f);
}

// Before anything is written: the companion of --resume's checkpoint exists, its data matches its
// recorded hash, and it was written with this run's history length and blocks, under its data x
// context parallel degree (fp8_state_load checks it again when it reads the state: fp8.c says why dp).
static void fp8_check_companion(const char *checkpoint, long long step, int n_layers, int dp_cp) {
    char companion[4200], err[1024], want[128], recipe[32];
    // The history beside a checkpoint is that checkpoint's only if its run was a delayed-scaling one:
    // a companion left by an earlier run in the directory would otherwise be taken for it.
    recorded_fp8_recipe(checkpoint, recipe, sizeof recipe);
    if (*recipe && strcmp(recipe, "delayed") != 0)
        fatal_input("--resume with delayed FP8 scaling: %s was written by a run with fp8 %s; delayed scaling resumes only a "
                    "delayed-scaling run's amax history (resume with that run's recipe)", checkpoint, recipe);
    fp8_companion(checkpoint, companion, sizeof companion);
    StFile *f = st_open_header(companion, err, sizeof err);
    struct stat st;
    bool missing = !f && stat(companion, &st) != 0 && errno == ENOENT;
    if (missing && *recipe)  // recorded as delayed (the check above), yet no history: its write failed
        fatal_input("--resume with delayed FP8 scaling: %s was written by a delayed-scaling run, but its amax history "
                    "%s is missing (its write failed?); resume from an earlier checkpoint", checkpoint, companion);
    if (missing)  // a checkpoint that records no recipe (written before they were recorded): no history
        fatal_input("--resume with delayed FP8 scaling: %s (it resumes the amax history written next to a delayed-scaling "
                    "run's checkpoint; from another recipe's, resume with that recipe)", err);
    if (!f) fatal_input("--resume with delayed FP8 scaling: %s", err);  // there, but damaged
    if (!st_check_data_hash(f, err, sizeof err)) fatal_input("--resume with delayed FP8 scaling: %s", err);
    const char *identity = st_metadata(f, "fp8");
    Fp8Options o = fp8_options();
    fp8_state_identity(&o, n_layers, dp_cp, want, sizeof want);
    if (!identity || strcmp(identity, want) != 0)
        fatal_input("%s: FP8 state written with %s, this run has %s (delayed scaling resumes with the same history "
                    "length and blocks, under the same data x context parallel degree: the output gradients' amaxes "
                    "scale with it)", companion, identity ? identity : "(none)", want);
    // ... and beside the checkpoint it was written with: another step's history copied there would
    // resume scales that step's amaxes made (a history from before steps were recorded has none)
    const char *their_step = st_metadata(f, "step");
    char our_step[32];
    snprintf(our_step, sizeof our_step, "%lld", step);
    if (their_step && strcmp(their_step, our_step) != 0)
        fatal_input("%s: the amax history of step %s, beside the checkpoint of step %lld; delayed scaling resumes the "
                    "history written with its checkpoint", companion, their_step, step);
    st_close(f);
}

static void fp8_load(const char *path) {
    if (!fp8 || fp8_state_numel(fp8) == 0) return;
    char companion[4200];
    fp8_companion(path, companion, sizeof companion);
    fp8_state_load(fp8, companion);
}

// The table mem_print_report logs is rank 0's. What every rank still holds of activations after
// the last step (0 when each micro-batch's were freed): a pipeline stage that never frees what it
// sent shows only on its own rank, and chapter 7's lab checks this line.
static void log_activations_held(Comm *world) {
    if (comm_size(world) == 1) return;
    float held = (float)(mem_current(MEM_ACTIVATIONS) / 1048576.0);
    comm_all_reduce(world, &held, 1, COMM_FLOAT32, COMM_MAX);
    log_info("activations held after the last step, the most on any rank: %.2f MiB", held);
}

static void save_state(Trainer *t, const char *path, long long step, const RunIdentity *run) {
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    real *full[N_CHECKPOINT_STATES];
    for (int kind = 0; kind < N_CHECKPOINT_STATES; kind++) {
        full[kind] = mem_alloc(MEM_OTHER, sizeof(real) * whole.table.total_numel);
        trainer_full_state(t, (StateKind)kind, full[kind]);
    }
    whole.params = full[STATE_WEIGHTS];
    fp8_save(t, path, step);  // first: a checkpoint whose companion failed to write would be the latest, unresumable
    if (t->mesh->rank == 0) checkpoint_save(path, &whole, full[STATE_ADAM_M], full[STATE_ADAM_V], step, run);
    for (int kind = 0; kind < N_CHECKPOINT_STATES; kind++) mem_free(full[kind]);
    param_table_free(&whole.table);
}

static long long load_state(Trainer *t, const char *path, const RunIdentity *run) {
    Model whole = t->model;
    whole.table = param_table_build(&t->model.cfg);
    real *full[N_CHECKPOINT_STATES];
    for (int kind = 0; kind < N_CHECKPOINT_STATES; kind++)
        full[kind] = mem_alloc(MEM_OTHER, sizeof(real) * whole.table.total_numel);
    whole.params = full[STATE_WEIGHTS];
    long long step = checkpoint_load(path, &whole, full[STATE_ADAM_M], full[STATE_ADAM_V], run);
    fp8_load(path);
    for (int kind = 0; kind < N_CHECKPOINT_STATES; kind++) {
        trainer_load_full_state(t, (StateKind)kind, full[kind]);
        mem_free(full[kind]);
    }
    param_table_free(&whole.table);
    return step;
}

// --export-hf: the full weights gathered from whatever layout (every rank takes part), written by rank 0.
static void export_hf(Trainer *t) {
    ParamTable full_table = param_table_build(&t->model.cfg);
    real *full = mem_alloc(MEM_OTHER, sizeof(real) * full_table.total_numel);
    trainer_full_state(t, STATE_WEIGHTS, full);
    if (t->mesh->rank == 0) {
        hf_export(opt.export_hf, &t->model.cfg, full, ST_F32, (size_t)(opt.export_hf_shard_mb * 1048576.0),
                  init_token_ids);
        log_info("Hugging Face checkpoint written to %s%s", opt.export_hf, dir_slash(opt.export_hf));
    }
    mem_free(full);
    param_table_free(&full_table);
}

static ActCheckpoint checkpointing_mode(void) {
    return (ActCheckpoint)args_choice_index(AC_MODE_NAMES, opt.ac);
}

static PpScheduleKind pipeline_schedule(void) {
    PpScheduleKind kind;
    pp_schedule_parse(opt.pp_schedule, &kind);  // one of the choices: args_parse checked it
    return kind;
}

static LayoutOptions layout_options(void) {
    return (LayoutOptions){.zero_stage = opt.zero_stage,
                           .reshard = args_choice_index(RESHARD_POLICY_NAMES, opt.reshard),
                           .overlap = !opt.no_overlap,
                           .bucket_mb = opt.bucket_mb,
                           .ac = checkpointing_mode(),
                           .sequence_parallel = opt.sequence_parallel,
                           .pp_schedule = pipeline_schedule(),
                           .pp_virtual_stages = opt.pp_virtual_stages,
                           .pp_schedule_dot = opt.pp_schedule_dot,
                           .cp_mode = args_choice_index(CP_MODE_NAMES, opt.cp_mode),
                           .cp_load_balance = strcmp(opt.cp_load_balance, "on") == 0,
                           .cuda_sync_debug = opt.cuda_sync_debug,
                           .fp8 = opt.fp8,
                           .fp8_recipe = args_choice_index(FP8_RECIPE_NAMES, opt.fp8_recipe)};
}

// --fp8-all-gather casts what ZeRO-3 gathers; it needs that all-gather, and one cast per weight.
static void check_fp8_all_gather_flags(void) {
    if (!opt.fp8_all_gather) return;
    if (!opt.fp8) fatal_input("--fp8-all-gather: needs --fp8");
    if (strcmp(opt.fp8_recipe, "tensorwise") != 0)
        fatal_input("--fp8-all-gather: needs --fp8-recipe tensorwise (%s scales a weight along each GEMM's contraction "
                    "or from a history, not one gathered copy's scale)", opt.fp8_recipe);
    if (opt.dp_shard == 1 || opt.zero_stage != 3 || opt.pp > 1)
        fatal_input("--fp8-all-gather: casts ZeRO-3's weight all-gather; needs --dp-shard 2 or more with --zero-stage 3 "
                    "and no --pp");
}

// --all-gather-dtype: which codec ZeRO-3's weight all-gather uses (chapter 3's bf16, chapter 9's FP8,
// or none: fp32). bf16 needs that all-gather; auto takes it where it changes nothing but the bytes.
static bool zero3_gathers_weights(void) { return opt.dp_shard > 1 && opt.zero_stage == 3 && opt.pp == 1; }
static void check_all_gather_dtype_flags(void) {
    if (strcmp(opt.all_gather_dtype, "fp32") == 0 && opt.fp8_all_gather)
        fatal_input("--all-gather-dtype fp32: not with --fp8-all-gather, which gathers the weights in FP8 (one codec "
                    "per all-gather)");
    if (strcmp(opt.all_gather_dtype, "bf16") != 0) return;
    if (!zero3_gathers_weights())
        fatal_input("--all-gather-dtype bf16: casts ZeRO-3's weight all-gather; needs --dp-shard 2 or more with "
                    "--zero-stage 3 and no --pp");
    if (opt.fp8_all_gather) fatal_input("--all-gather-dtype bf16: not with --fp8-all-gather (one codec per all-gather)");
}
// auto on the GPU without --fp8 only: the FP8 linears cast from the gathered fp32 weights, which a
// bf16 all-gather would round first (the single GPU casts from the unrounded master weights).
static bool bf16_all_gather(bool cuda) {
    if (strcmp(opt.all_gather_dtype, "auto") == 0) return cuda && zero3_gathers_weights() && !opt.fp8;
    return strcmp(opt.all_gather_dtype, "bf16") == 0;
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
}

// Chapter 8's flags: the sequence must split into the cp ranks' chunks, all-to-all needs the heads
// (after tp) to divide by cp, and the ring runs the blockwise kernel.
static void check_context_parallel_flags(const ModelConfig *cfg, const ArgSpec *flags) {
    static const char *const cp_only[] = {"cp-mode", "cp-load-balance"};
    if (opt.cp == 1) {
        for (int i = 0; i < 2; i++)
            if (args_given(flags, N_FLAGS, cp_only[i])) fatal_input("--%s: needs --cp 2 or more", cp_only[i]);
        return;
    }
    const char *rule = cp_layout_check(opt.cp, opt.seq_len, strcmp(opt.cp_load_balance, "on") == 0);
    if (rule) fatal_input("--cp %d with --seq-len %d: %s", opt.cp, opt.seq_len, rule);
    int heads = cfg->n_heads / opt.tp, kv_heads = cfg->n_kv_heads / opt.tp;
    if (args_choice_index(CP_MODE_NAMES, opt.cp_mode) == CP_ALLTOALL && (heads % opt.cp || kv_heads % opt.cp))
        fatal_input("--cp-mode alltoall --cp %d: each rank attends with heads/cp of the %d heads and %d kv heads "
                    "left after --tp %d, so both must divide by cp (or use --cp-mode ring)", opt.cp, heads, kv_heads,
                    opt.tp);
    if (args_choice_index(ATTENTION_IMPL_NAMES, opt.attention) == ATTN_NAIVE)
        fatal_input("--attention naive with --cp %d: ring attention merges blocks through their log-sum-exp, which "
                    "the blockwise kernel returns; use --attention flash", opt.cp);
}

// The parallel layout: checks the flags against the world size and the batch.
static Mesh *setup_mesh(void) {
    if (opt.sequence_parallel && opt.tp == 1) fatal_input("--sequence-parallel: needs --tp 2 or more");
    if (opt.desync_init && opt.dp_shard > 1)
        fatal_input("--desync-init: shows DDP's initial broadcast; sharded ranks each build only their own shard");
    Mesh *mesh = mesh_create(opt.pp, opt.dp_replicate, opt.dp_shard, opt.cp, opt.tp);
    int dp = opt.dp_replicate * opt.dp_shard, micro = opt.pp > 1 ? opt.pp_microbatches : opt.grad_accum_steps;
    if (opt.batch % (dp * micro) != 0)
        fatal_input("--batch %d: must be divisible by data-parallel ranks (%d) x %s (%d) = %d", opt.batch, dp,
                    opt.pp > 1 ? "--pp-microbatches" : "--grad-accum-steps", micro, dp * micro);
    if (opt.dump && (mesh->world_size > 1 || opt.grad_accum_steps > 1))
        fatal_input("--dump: records the single-process reference; run it without mpirun and --grad-accum-steps");
    return mesh;
}

int main(int argc, char **argv) {
    ArgSpec flags[N_FLAGS];
    memcpy(flags, FLAGS, sizeof flags);
    flags[0].choices = MODEL_CONFIG_NAMES;
    args_parse(flags, N_FLAGS, argc, argv, "train",
               "Trains Llama 3: the single-process CPU reference alone, the parallel modules under mpirun.");
    bool cuda = args_choice_index(DEVICE_NAMES, opt.device) == DEVICE_CUDA;
    if (cuda) trainer_cuda_start(argv);  // before MPI starts: the GPU build takes over, or checks its settings
    matmul_set_backend((MatmulBackend)args_choice_index(MATMUL_BACKEND_NAMES, opt.matmul));
    AttentionImpl attention = (AttentionImpl)args_choice_index(ATTENTION_IMPL_NAMES, opt.attention);
    if (opt.compare) {  // a check of a dump, then exit
        static const char *const used[] = {"compare", "compare-rtol", "attention", "matmul", NULL};
        refuse_flags_but(flags, used, "--compare: checks a dump and exits");
        return dump_compare(opt.compare, attention, opt.compare_rtol);
    }

    check_flags_that_need_others(flags);
    HfCheckpoint *init_checkpoint;
    ModelConfig cfg = resolve_config(flags, &init_checkpoint);
    print_model_info(&cfg, opt.seq_len);
    if (opt.model_info) return 0;
    if (matmul_get_backend() == MATMUL_BLAS) {
        char kernels[192];
        int cpus = matmul_cpus_usable();
        log_info("matmuls: %s; %d threads on %d CPU%s", matmul_blas_kernels(kernels, sizeof kernels),
                 matmul_threads(), cpus, cpus == 1 ? "" : "s");
    }
    check_pipeline_flags(&cfg, flags);
    check_context_parallel_flags(&cfg, flags);
    if (!opt.fp8 && (args_given(flags, N_FLAGS, "fp8-recipe") || args_given(flags, N_FLAGS, "fp8-amax-history")))
        fatal_input("--fp8-recipe and --fp8-amax-history: need --fp8");
    if (args_given(flags, N_FLAGS, "fp8-amax-history") && strcmp(opt.fp8_recipe, "delayed") != 0)
        fatal_input("--fp8-amax-history: only with --fp8-recipe delayed");
    check_fp8_all_gather_flags();
    check_all_gather_dtype_flags();
    check_before_work(&cfg, flags);
    if (opt.dump && opt.resume) fatal_input("--dump: records a run from step 1; it cannot be combined with --resume");
    if (opt.grad_dump && opt.resume)
        fatal_input("--grad-dump: writes step 1's gradients; it cannot be combined with --resume");
    if (opt.cuda_sync_debug && !cuda) fatal_input("--cuda-sync-debug: needs --device cuda");
    if (opt.dump && cuda)
        fatal_input("--dump: records the CPU reference; run it with --device cpu and compare with --grad-dump");
    if (cuda && (strcmp(opt.attention, "flash") != 0 || strcmp(opt.matmul, "blas") != 0))
        fatal_input("--device cuda: runs its own FlashAttention and cuBLASLt kernels; --attention %s and --matmul %s "
                    "choose the CPU reference's (leave them out)", opt.attention, opt.matmul);

    bool tracing = opt.trace || opt.trace_json || opt.trace_hta;
    comm_init(&argc, &argv, &(CommOptions){.timeout_seconds = opt.comm_timeout, .trace = tracing});
    log_set_rank(comm_rank(comm_world()));
    Trainer t = {.B = opt.batch, .T = opt.seq_len};
    t.mesh = setup_mesh();
    t.cp_layout = cp_layout(opt.cp, t.mesh->coord[MESH_CP], opt.seq_len, strcmp(opt.cp_load_balance, "on") == 0);
    t.T = cp_local_len(&t.cp_layout);
    t.dp_size = comm_size(t.mesh->dp);
    t.dp_index = comm_rank(t.mesh->dp);
    t.n_micro = opt.pp > 1 ? opt.pp_microbatches : opt.grad_accum_steps;
    t.micro = t.B / (t.dp_size * t.n_micro);
    if (tracing) {
        trace_align_clocks(comm_world());
        trace_init(t.mesh->rank, t.mesh->label);
        mem_set_observer(trace_memory_observer);
    }

    DataSource *data = data_open(opt.data, cfg.vocab_size, t.cp_layout.T, (uint64_t)opt.seed);
    char schedule_text[128];  // the checkpoint records it; a resume with another one says so
    snprintf(schedule_text, sizeof schedule_text, "%s, warmup %d, min_lr_ratio %g", opt.lr_decay, opt.warmup_steps,
             opt.min_lr_ratio);
    char settings_text[256];  // recorded too; a resume that changes them says so (grad_accum: the micro-batches
                              // a step sums, --pp-microbatches under a pipeline)
    snprintf(settings_text, sizeof settings_text,
             "weight_decay %g, beta1 %g, beta2 %g, eps %g, grad_clip %g, grad_accum %d, fp8 %s", opt.weight_decay,
             opt.beta1, opt.beta2, opt.eps, opt.grad_clip, t.n_micro, opt.fp8 ? opt.fp8_recipe : "none");
    char data_text[128];
    RunIdentity run = {(uint64_t)opt.seed, opt.data, data_identity(data, data_text, sizeof data_text), t.B, t.cp_layout.T,
                       opt.steps, opt.lr, schedule_text, settings_text};
    char resume_path[4096];
    long long resumed_step = 0;
    if (opt.resume) {  // checked whole now (header and data hash), before the diagrams below are written
        checkpoint_resolve(opt.resume, resume_path, sizeof resume_path);
        resumed_step = checkpoint_check(resume_path, &cfg, &run);
        if (opt.fp8 && !cuda && strcmp(opt.fp8_recipe, "delayed") == 0)
            fp8_check_companion(resume_path, resumed_step, cfg.n_layers, comm_size(t.mesh->dp_cp));
    }
    // another run's directory (its lock held, its checkpoints there): refused now, before the model
    // is built (checkpoint_dir_claim takes the directory once it is)
    if (opt.checkpoint_dir && t.mesh->rank == 0)
        checkpoint_dir_check(opt.checkpoint_dir, opt.resume ? resume_path : NULL, resumed_step);
    // --desync-init: replicas differ (what DDP's broadcast must fix), the ranks of one replica agree
    uint64_t init_seed = (uint64_t)opt.seed + (opt.desync_init ? (uint64_t)t.dp_index : 0);
    ParamSource init = init_checkpoint ? hf_param_source(init_checkpoint) : param_source_seed(init_seed);
    LayoutOptions layout = layout_options();
    if (opt.fp8 && !cuda) fp8_create_for(&t, cfg.n_layers, &layout);  // on the GPU: the GPU model's own
    if (bf16_all_gather(cuda)) layout.weight_codec = &fsdp_bf16_codec;
    if (cuda) t.strategy = cuda_strategy_create(&t, &cfg, &init, &layout);
    else trainer_setup_layout(&t, &cfg, attention, &init, &layout);
    if (init_checkpoint) log_info("initial weights from %s", opt.init_from);
    hf_close(init_checkpoint);
    if (fp8) fp8_install(&t);
    log_checkpointing(&t.model, t.micro, t.T, (ActCheckpoint)layout.ac);
    t.inputs = mem_alloc(MEM_OTHER, sizeof(int) * t.micro * t.n_micro * t.T);
    t.targets = mem_alloc(MEM_OTHER, sizeof(int) * t.micro * t.n_micro * t.T);
    t.full_inputs = mem_alloc(MEM_OTHER, sizeof(int) * t.micro * t.n_micro * t.cp_layout.T);
    t.full_targets = mem_alloc(MEM_OTHER, sizeof(int) * t.micro * t.n_micro * t.cp_layout.T);

    long long start_step = 0;
    if (opt.resume) {
        start_step = load_state(&t, resume_path, &run);
        log_info("resumed from %s after step %lld", resume_path, start_step);
    }
    if (opt.checkpoint_dir && t.mesh->rank == 0) {  // made now that every input has passed, the
        // layout (and the device) took the mesh and --resume loaded
        if (mkdir(opt.checkpoint_dir, 0777) != 0 && errno != EEXIST)  // its parent was checked above
            fatal("--checkpoint-dir %s: %s", opt.checkpoint_dir, strerror(errno));
        checkpoint_dir_claim(opt.checkpoint_dir, opt.resume ? resume_path : NULL, start_step);  // this run's alone
        checkpoint_clean_stale(opt.checkpoint_dir);
    }
    if (opt.mesh_dot && t.mesh->rank == 0) mesh_write_dot(t.mesh, opt.mesh_dot);
    LrSchedule schedule = {opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.steps,
                           (LrDecay)args_choice_index(LR_DECAY_NAMES, opt.lr_decay)};
    AdamWConfig adam = {opt.beta1, opt.beta2, opt.eps, opt.weight_decay};
    TrainerExtension extensions[3];
    int n_ext = 0;
    if (fp8) extensions[n_ext++] = (TrainerExtension){"fp8", NULL, NULL, fp8_after_step, fp8_finish};
    if (opt.dump) extensions[n_ext++] = reference_dump(&t, &adam);
    if (opt.grad_dump) extensions[n_ext++] = grad_dump();
    double floor = data_entropy_floor(data);
    log_info("data: %s", data_describe(data));
    double mean_floor = data_mean_loss_floor(data, t.cp_layout.T);
    if (!isnan(floor) && mean_floor > floor)  // order K > 1: the logged mean includes K-1 uniform targets
        log_info("loss floor (entropy rate of the source): %.4f nats/token at a full context; %.4f for the mean "
                 "over %d positions that the log shows (common/DATA.md)", floor, mean_floor, t.cp_layout.T);
    else if (!isnan(floor))
        log_info("loss floor (entropy rate of the source): %.4f nats/token", floor);
    log_info("batch %d x seq %d = %d tokens/step, %d steps, lr %g (warmup %d, %s decay), seed %lld", t.B,
             t.cp_layout.T, t.B * t.cp_layout.T, opt.steps, opt.lr, opt.warmup_steps, opt.lr_decay, opt.seed);
    if (t.mesh->world_size > 1) log_info("mesh: %d ranks; rank 0 is %s", t.mesh->world_size, t.mesh->label);

    // Step boundaries get their own track, so the compute track holds only work (and the marked waits):
    // that is what trace-summary measures overlap against.
    int track = trace_track("steps");
    double measured_seconds = 0, measured_gemm_flops = 0;  // over the measured steps
    int measured_steps = 0;
    for (long long step = start_step + 1; step <= opt.steps; step++) {
        long long t0 = now_ns();
        double gemm_flops0 = matmul_flops_counted();
        trace_begin(track, "step", "step");
        trace_arg_int(track, "step", step);
        StepResult r = train_step(&t, data, step, &schedule, &adam, extensions, n_ext);
        trace_end(track);
        double seconds = (now_ns() - t0) * 1e-9;
        if (step - start_step > 2)  // skip warm-up steps
            measured_seconds += seconds, measured_gemm_flops += matmul_flops_counted() - gemm_flops0, measured_steps++;
        adapt_comm_timeout(seconds, step - start_step > 2, flags);
        char rate[64];
        double tokens_per_s = t.B * t.cp_layout.T / seconds;
        if (step % opt.log_every == 0 || step == opt.steps)
            log_info("step %5lld | loss %.6f | grad_norm %.4f | lr %.3e | %.0f tok/s%s | mem %.1f MiB", step, r.loss,
                     r.grad_norm, r.lr, tokens_per_s,
                     model_throughput_text(&cfg, t.cp_layout.T, tokens_per_s, t.mesh->world_size, opt.peak_tflops, rate,
                                           sizeof rate),
                     t.strategy->memory_in_use(t.strategy) / 1048576.0);
        bool periodic = opt.checkpoint_every > 0 && step % opt.checkpoint_every == 0;
        if (opt.checkpoint_dir && (periodic || step == opt.steps)) {
            char path[4096];
            checkpoint_path_for_step(opt.checkpoint_dir, step, path, sizeof path);
            trace_begin(track, "checkpoint", "io");
            adapt_comm_timeout(0, false, flags);  // rank 0 writes, the others wait in the next step
            save_state(&t, path, step, &run);
            trace_end(track);
            if (t.mesh->rank == 0) log_info("checkpoint written to %s", path);
        }
    }
    adapt_comm_timeout(0, false, flags);  // the dump and trace writes below
    if (measured_steps > 0) {
        char gemm[64] = "";  // the host GEMMs' work (none counted when the step runs on a GPU)
        if (measured_gemm_flops > 0)
            snprintf(gemm, sizeof gemm, " gemm_gflop_per_step=%.3f", measured_gemm_flops / measured_steps / 1e9);
        log_info("timing: steps=%d measured=%d mean_step_ms=%.2f tokens_per_s=%.1f%s", opt.steps, measured_steps,
                 1e3 * measured_seconds / measured_steps, (double)t.B * t.cp_layout.T * measured_steps / measured_seconds,
                 gemm);
    }
    if (opt.export_hf) export_hf(&t);
    // On a GPU the strategy's report is the device's; the host's categories hold nothing there.
    if (!cuda) mem_print_report();
    if (!cuda) log_activations_held(comm_world());
    t.strategy->report_memory(t.strategy);
    for (int i = 0; i < n_ext; i++)
        if (extensions[i].finish) extensions[i].finish(extensions[i].ctx, &t);
    if (tracing) {
        TraceOutputs outputs = {opt.trace, opt.trace_json, opt.trace_hta};
        if (!trace_gather_and_write_outputs(comm_world(), &outputs)) fatal("could not write the trace");
        if (opt.trace) log_info("trace written to %s (open it at https://ui.perfetto.dev)", opt.trace);
        if (opt.trace_json) log_info("trace written to %s", opt.trace_json);
        if (opt.trace_hta) log_info("per-rank traces for Holistic Trace Analysis written to %s%s", opt.trace_hta, dir_slash(opt.trace_hta));
    }

    trainer_free_strategy(&t);
    mem_free(t.inputs);
    mem_free(t.targets);
    mem_free(t.full_inputs);
    mem_free(t.full_targets);
    model_free(&t.model);
    data_close(data);
    mesh_free(t.mesh);
    free(init_token_ids);
    trace_shutdown();
    comm_finalize();
    return 0;
}
