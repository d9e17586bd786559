// train.c: the training program. Today it runs the single-process reference; later chapters add
// their parallel modules behind the same flags (DESIGN.md), so every config can be compared with
// this one at equal tokens per step.
//
//   ./build/train --model small --steps 150 --trace build/small.pftrace
//   ./build/train --model tiny --steps 10 --dump ref.safetensors     (what other code checks against)
//   ./build/train --compare their_dump.safetensors                    (check their numbers against ours)
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/args.h"
#include "common/data.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/checkpoint.h"
#include "reference_cpu/dump.h"
#include "reference_cpu/model.h"

typedef struct {
    const char *model, *data, *lr_decay, *attention, *matmul;
    const char *checkpoint_dir, *resume, *trace, *trace_json, *dump, *compare;
    int steps, batch, seq_len, warmup_steps, checkpoint_every, log_every;
    long long seed;
    double lr, min_lr_ratio, weight_decay, beta1, beta2, eps, grad_clip, rope_theta, compare_rtol;
    bool model_info;
} Options;

static Options opt = {.seq_len = -1, .warmup_steps = -1, .rope_theta = -1};

#define UNBOUNDED 1e308
static const ArgSpec FLAGS[] = {
    {"model", ARG_CHOICE, &opt.model, "tiny", "model config", .choices = NULL /* set in main */},
    {"steps", ARG_INT, &opt.steps, "20", "optimizer steps (the LR schedule ends here)", .min = 1, .max = UNBOUNDED},
    {"batch", ARG_INT, &opt.batch, "8", "GLOBAL batch in sequences per optimizer step", .min = 1, .max = UNBOUNDED},
    {"seq-len", ARG_INT, &opt.seq_len, NULL, "tokens per sequence (default: the model's max_seq_len)", .min = 1,
     .max = UNBOUNDED},
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
    {"checkpoint-dir", ARG_STRING, &opt.checkpoint_dir, NULL, "write DIR/step_N.safetensors checkpoints",
     .value_name = "DIR"},
    {"checkpoint-every", ARG_INT, &opt.checkpoint_every, "0", "checkpoint period in steps (0 = only at the end)",
     .min = 0, .max = UNBOUNDED},
    {"resume", ARG_STRING, &opt.resume, NULL, "resume from a checkpoint file, or the latest one in DIR",
     .value_name = "PATH"},
    {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto timeline (.pftrace)", .value_name = "FILE"},
    {"trace-json", ARG_STRING, &opt.trace_json, NULL, "write the timeline as Chrome-trace JSON",
     .value_name = "FILE"},
    {"dump", ARG_STRING, &opt.dump, NULL, "write inputs, weights, step-1 logits and gradients, losses (safetensors)",
     .value_name = "FILE"},
    {"compare", ARG_STRING, &opt.compare, NULL, "check a dump against this reference and exit",
     .value_name = "FILE"},
    {"compare-rtol", ARG_DOUBLE, &opt.compare_rtol, "1e-4", "--compare tolerance: max|diff| / max|reference|",
     .min = 0, .max = 1},
    {"log-every", ARG_INT, &opt.log_every, "1", "print a log line every N steps", .min = 1, .max = UNBOUNDED},
    {"model-info", ARG_BOOL, &opt.model_info, NULL, "print the config, parameter count and FLOPs per token, and exit", .value_name = ""},
};
#define N_FLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

static ModelConfig resolve_config(void) {
    ModelConfig cfg;
    if (!model_config_lookup(opt.model, &cfg)) fatal_input("--model %s: unknown model", opt.model);
    if (opt.seq_len < 0) opt.seq_len = cfg.max_seq_len;
    if (opt.seq_len > cfg.max_seq_len) cfg.max_seq_len = opt.seq_len;  // the RoPE table grows with it
    if (opt.rope_theta > 0) cfg.rope_theta = opt.rope_theta;
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

typedef struct {
    double loss, grad_norm, lr;
} StepResult;

// One optimizer step: forward, backward, clip, AdamW. Returns the loss before the update.
static StepResult train_step(Model *m, ModelActs *acts, real *adam_m, real *adam_v, const int *inputs,
                             const int *targets, long long step, const LrSchedule *schedule, const AdamWConfig *adam,
                             DumpRecorder *dump) {
    int track = trace_track("compute");
    StepResult r;
    model_zero_grads(m);
    trace_begin(track, "forward", "phase");
    r.loss = model_forward(m, acts, inputs, targets);
    trace_end(track);
    if (!isfinite(r.loss)) fatal("step %lld: loss is %g; stopping (try a lower --lr)", step, r.loss);
    trace_begin(track, "backward", "phase");
    model_backward(m, acts, inputs, 1.0);
    trace_end(track);
    trace_begin(track, "optimizer", "phase");
    size_t n = m->table.total_numel;
    r.grad_norm = sqrt(sum_of_squares(m->grads, n));
    if (!isfinite(r.grad_norm)) fatal("step %lld: gradient norm is %g; stopping", step, r.grad_norm);
    r.lr = lr_at(schedule, step);
    if (dump) dump_record_step(dump, m, acts, step, inputs, targets, r.loss, r.grad_norm, r.lr);
    clip_by_global_norm(m->grads, n, r.grad_norm, opt.grad_clip);
    adamw_step(m->params, m->grads, adam_m, adam_v, n, step, r.lr, adam);
    trace_end(track);
    return r;
}

static void write_traces(void) {
    if (opt.trace && !trace_write_pftrace(opt.trace)) fatal("--trace %s: could not write the trace", opt.trace);
    if (opt.trace_json && !trace_write_json(opt.trace_json))
        fatal("--trace-json %s: could not write the trace", opt.trace_json);
    if (opt.trace) log_info("trace written to %s (open it at https://ui.perfetto.dev)", opt.trace);
    if (opt.trace_json) log_info("trace written to %s", opt.trace_json);
}

int main(int argc, char **argv) {
    ArgSpec flags[N_FLAGS];
    memcpy(flags, FLAGS, sizeof flags);
    flags[0].choices = MODEL_CONFIG_NAMES;
    args_parse(flags, N_FLAGS, argc, argv, "train",
               "Trains Llama 3 with the single-process CPU reference (the oracle every parallel module is checked "
               "against).");
    matmul_set_backend(strcmp(opt.matmul, "loop") == 0 ? MATMUL_LOOP : MATMUL_BLAS);
    AttentionImpl attention = strcmp(opt.attention, "naive") == 0 ? ATTN_NAIVE : ATTN_FLASH;
    if (opt.compare) return dump_compare(opt.compare, attention, opt.compare_rtol);

    ModelConfig cfg = resolve_config();
    print_model_info(&cfg, opt.seq_len);
    if (opt.model_info) return 0;
    int B = opt.batch, T = opt.seq_len;
    check_writable("trace", opt.trace);
    check_writable("trace-json", opt.trace_json);
    check_writable("dump", opt.dump);
    if (opt.checkpoint_dir) ensure_directory(opt.checkpoint_dir);
    if (opt.dump && opt.resume) fatal_input("--dump: records a run from step 1; it cannot be combined with --resume");

    if (opt.trace || opt.trace_json) {
        trace_init(0, "rank 0 [single process]");
        mem_set_observer(trace_memory_observer);
    }
    DataSource *data = data_open(opt.data, cfg.vocab_size, T, (uint64_t)opt.seed);
    Model model;
    model_init(&model, &cfg, (uint64_t)opt.seed, attention);
    size_t n = model.table.total_numel;
    real *adam_m = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n), *adam_v = mem_alloc(MEM_OPTIMIZER, sizeof(real) * n);
    ModelActs acts = model_acts_alloc(&model, B, T);
    int *inputs = mem_alloc(MEM_OTHER, sizeof(int) * B * T), *targets = mem_alloc(MEM_OTHER, sizeof(int) * B * T);

    RunIdentity run = {(uint64_t)opt.seed, opt.data, B, T, opt.steps};
    long long start_step = 0;
    if (opt.resume) {
        char path[4096];
        checkpoint_resolve(opt.resume, path, sizeof path);
        start_step = checkpoint_load(path, &model, adam_m, adam_v, &run);
        log_info("resumed from %s after step %lld", path, start_step);
    }
    LrSchedule schedule = {opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.steps,
                           strcmp(opt.lr_decay, "linear") == 0     ? DECAY_LINEAR
                           : strcmp(opt.lr_decay, "constant") == 0 ? DECAY_CONSTANT
                                                                   : DECAY_COSINE};
    AdamWConfig adam = {opt.beta1, opt.beta2, opt.eps, opt.weight_decay};
    DumpRecorder dump_recorder, *dump = NULL;
    if (opt.dump) {
        dump_begin(&dump_recorder, &model, opt.steps, B, T, &adam, opt.grad_clip);
        dump = &dump_recorder;
    }
    double floor = data_entropy_floor(data);
    log_info("data: %s", data_describe(data));
    if (!isnan(floor)) log_info("loss floor (entropy rate of the source): %.4f nats/token", floor);
    log_info("batch %d x seq %d = %d tokens/step, %d steps, lr %g (warmup %d, %s decay), seed %lld", B, T, B * T,
             opt.steps, opt.lr, opt.warmup_steps, opt.lr_decay, opt.seed);

    int track = trace_track("compute");
    double measured_seconds = 0;
    int measured_steps = 0;
    for (long long step = start_step + 1; step <= opt.steps; step++) {
        long long t0 = now_ns();
        trace_begin(track, "step", "step");
        trace_arg_int(track, "step", step);
        data_batch(data, step, B, 0, B, T, inputs, targets);
        StepResult r = train_step(&model, &acts, adam_m, adam_v, inputs, targets, step, &schedule, &adam, dump);
        trace_end(track);
        double seconds = (now_ns() - t0) * 1e-9;
        if (step - start_step > 2) measured_seconds += seconds, measured_steps++;  // skip warm-up steps
        if (step % opt.log_every == 0 || step == opt.steps)
            log_info("step %5lld | loss %.6f | grad_norm %.4f | lr %.3e | %.0f tok/s | mem %.1f MiB", step, r.loss,
                     r.grad_norm, r.lr, B * T / seconds, mem_current_total() / 1048576.0);
        bool periodic = opt.checkpoint_every > 0 && step % opt.checkpoint_every == 0;
        if (opt.checkpoint_dir && (periodic || step == opt.steps)) {
            char path[4096];
            checkpoint_path_for_step(opt.checkpoint_dir, step, path, sizeof path);
            trace_begin(track, "checkpoint", "io");
            checkpoint_save(path, &model, adam_m, adam_v, step, &run);
            trace_end(track);
            log_info("checkpoint written to %s", path);
        }
    }
    if (measured_steps > 0)
        log_info("timing: steps=%d measured=%d mean_step_ms=%.2f tokens_per_s=%.1f", opt.steps, measured_steps,
                 1e3 * measured_seconds / measured_steps, (double)B * T * measured_steps / measured_seconds);
    mem_print_report();
    if (dump) {
        dump_write(dump, &model, opt.dump);
        log_info("dump written to %s", opt.dump);
    }
    write_traces();

    mem_free(inputs);
    mem_free(targets);
    model_acts_free(&acts);
    mem_free(adam_m);
    mem_free(adam_v);
    model_free(&model);
    data_close(data);
    trace_shutdown();
    return 0;
}
