// test_gpu_model.c: whole training steps of gpu/model.h against the reference model (`make
// test-gpu`). Without a CUDA device it prints one SKIP line and exits 0.
//
//   step 1, tiny and small: the fp32 GPU model's loss and every parameter's gradient against
//       reference_cpu's model_forward/model_backward on the same seed and batch; the bf16 model's too,
//       with a bf16-sized bound.
//   20 steps, tiny and small: the loss curve (fixed batch, clipping at 1.0, AdamW) of the fp32 and
//       bf16 GPU models against the reference's, each step queued (gpu_model_forward_queued) and its
//       loss read afterwards: the host must not wait for the stream before the loss is read, and
//       reading it must be one wait (gpu_host_waits).
//
// Tolerances, and why:
//   fp32 loss       1e-5 relative: the same ops in the same order; only summation orders inside the
//                   kernels (and expf's last bits) differ, ~1e-7 per op.
//   fp32 gradients  ||gpu - ref|| / ||ref|| <= 1e-4 per tensor: those per-op differences compound
//                   through the layers' backward chain (tens of ops), still far below the O(1) error
//                   of a wrong gradient.
//   fp32 curve      every step within 2e-3 nats of the reference's loss. AdamW divides by sqrt(v),
//                   so a parameter whose gradient is near zero moves by ~lr whatever its sign, and
//                   the ~1e-7 per-op differences grow over the steps: measured worst 5.6e-5 nats
//                   (tiny) and 2.6e-4 nats (small, step 14), on the emulator.
//   bf16            loss 2e-2 relative, gradients 5e-2 relative L2 per tensor: a bf16 model differs
//                   from fp32 by ~1e-2 (bf16's 2^-8 per rounding, over many roundings); a wrong
//                   gradient differs by O(1). The worst gradient tensor measured 0.0108 (tiny) and
//                   0.0199 (small), the same on the emulator and on an H200; 5e-2 is the trainer
//                   tests' bf16 bound too.
//   bf16 curve      every step within 0.6 nats, and the last step within 1% of the distance the
//                   reference's loss travelled (small: 5.50 nats, so 0.055; tiny: 3.76, so 0.038).
//                   The same AdamW effect on bf16's ~1e-2 gradient differences sends the curve off
//                   the fp32 one and back, by amounts that hang on single roundings. On the
//                   emulator, with the attention's exp changed by an ulp or two (the reference's
//                   exp of s scale - m, as the kernels computed it before; for today's ex2 of one
//                   fma, the host's exp2f, or exp of x ln 2), small's step 7 came out 0.40, 0.063
//                   and 0.26 nats off, and its step 20 at 0.1105, 0.1145 and 0.1108 against 0.1089:
//                   0.0016 to 0.0056 nats, 1.5% to 5.1% of that small loss but 0.03% to 0.1% of the
//                   travel (an H100, on the earlier kernels: 0.38 nats and 0.1108). tiny stays
//                   within 0.0082 nats.
//                   AdamW's bias correction frozen at step 1 fails all four curves (0.7 to
//                   1.5 nats off); weight decay dropped fails tiny's fp32 curve only (0.026 nats:
//                   lr x wd moves little in 20 steps), so test_gpu_ops checks the AdamW kernel
//                   against the reference's step itself. A gradient off by a constant factor passes
//                   every curve (AdamW and clipping are scale-free), which is why the step-1
//                   gradients are compared directly.
//   The learning rate is 3e-3 for tiny and 3e-4 for small: at 3e-3 small's loss jumps at step 3
//   (4.93 -> 6.33) and any difference, even fp32's, grows by orders of magnitude from there.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"
#include "common/trace.h"
#include "gpu/model.h"
#include "gpu/runtime.h"
#include "gpu/timeline.h"
#include "tests/gpu/gpu_test_util.h"
#include "reference_cpu/model.h"


// A batch of random tokens; every 11th target ignored.
static void make_batch(int *inputs, int *targets, int n, int vocab) {
    for (int i = 0; i < n; i++) {
        inputs[i] = (int)rng_below(5, 1, i, vocab);
        targets[i] = i % 11 == 5 ? IGNORE_INDEX : (int)rng_below(5, 2, i, vocab);
    }
}

// Every parameter's gradient: the worst tensor by relative L2 error must be within tol.
static void compare_grads(const char *label, const ParamTable *t, const float *got, const float *want, double tol) {
    double worst = 0;
    const char *worst_name = "";
    for (int i = 0; i < t->count; i++) {
        const ParamInfo *p = &t->items[i];
        double e = rel_l2(got + p->offset, want + p->offset, p->numel);
        if (!(e <= worst)) worst = e, worst_name = p->name;  // NaN wins
    }
    char name[96];
    snprintf(name, sizeof name, "%s gradients", label);
    report(name, worst <= tol, "worst tensor %s: ||d||/||ref|| = %.3g (bound %.3g)", worst_name, worst, tol);
}

// What gpu_alloc has handed out and not taken back, over all categories.
static size_t device_bytes_in_use(void) {
    size_t total = 0;
    for (int c = 0; c < MEM_N_CATEGORIES; c++) total += gpu_mem_current((MemCategory)c);
    return total;
}

static void test_first_step(const char *config, int B, int T) {
    ModelConfig cfg;
    if (!model_config_lookup(config, &cfg)) fatal("no config %s", config);
    int BT = B * T;
    int *inputs = malloc(sizeof(int) * BT), *targets = malloc(sizeof(int) * BT);
    make_batch(inputs, targets, BT, cfg.vocab_size);

    Model ref;
    model_init(&ref, &cfg, 42, ATTN_FLASH);
    ModelActs acts = model_acts_alloc(&ref, B, T, AC_NONE);
    model_zero_grads(&ref);
    double loss_ref = model_forward(&ref, &acts, inputs, targets);
    model_backward(&ref, &acts, inputs, 1.0);

    size_t n = ref.table.total_numel;
    float *grads = malloc(sizeof(float) * n);
    for (int precision = GPU_FP32; precision <= GPU_BF16; precision++) {
        bool bf16 = precision == GPU_BF16;
        char name[96];
        GpuModel m;
        size_t before = device_bytes_in_use();
        size_t planned = gpu_model_plan_bytes(&cfg, (GpuPrecision)precision, B, T, AC_NONE);
        gpu_model_init(&m, &cfg, 42, (GpuPrecision)precision, B, T);
        if (m.table.total_numel != n) fatal("the GPU model's table differs from the reference's");
        snprintf(name, sizeof name, "%s %s memory plan", config, bf16 ? "bf16" : "fp32");
        size_t used = device_bytes_in_use() - before;
        report(name, planned == used, "planned %zu bytes, gpu_model_init allocated %zu", planned, used);
        gpu_model_zero_grads(&m);
        double loss = gpu_model_forward(&m, inputs, targets);
        gpu_model_backward(&m, 1.0);
        gpu_download(grads, m.grads, sizeof(float) * n);
        char label[64];
        snprintf(label, sizeof label, "%s %s step 1", config, bf16 ? "bf16" : "fp32");
        snprintf(name, sizeof name, "%s loss", label);
        // bf16: 1e-3 (the trainer's bound on a device, tests/t_gpu_trainer.sh; measured 3.4e-5 on tiny
        // and 2.0e-5 on small on the emulator). At initialisation the loss sits near ln(vocab) whatever
        // the blocks compute (zero logits are 2e-3 from tiny's), so a looser bound would check little.
        double tol = bf16 ? 1e-3 : 1e-5;
        report(name, fabs(loss - loss_ref) <= tol * fabs(loss_ref), "%.7f vs reference %.7f (bound %.0e relative)", loss,
               loss_ref, tol);
        compare_grads(label, &ref.table, grads, ref.grads, bf16 ? 5e-2 : 1e-4);
        gpu_model_free(&m);
    }
    free(grads), free(inputs), free(targets);
    model_acts_free(&acts);
    model_free(&ref);
}

#define CURVE_STEPS 20

static void test_loss_curve(const char *config, int B, int T, double lr) {
    ModelConfig cfg;
    if (!model_config_lookup(config, &cfg)) fatal("no config %s", config);
    int BT = B * T;
    int *inputs = malloc(sizeof(int) * BT), *targets = malloc(sizeof(int) * BT);
    make_batch(inputs, targets, BT, cfg.vocab_size);
    AdamWConfig adam = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    const double max_norm = 1.0;

    // The reference, as the trainer steps: zero, forward, backward, clip, AdamW (a fixed batch, so
    // the loss must fall).
    double ref_loss[CURVE_STEPS];
    Model ref;
    model_init(&ref, &cfg, 42, ATTN_FLASH);
    ModelActs acts = model_acts_alloc(&ref, B, T, AC_NONE);
    size_t n = ref.table.total_numel;
    real *adam_m = calloc(n, sizeof(real)), *adam_v = calloc(n, sizeof(real));
    for (int s = 0; s < CURVE_STEPS; s++) {
        model_zero_grads(&ref);
        ref_loss[s] = model_forward(&ref, &acts, inputs, targets);
        model_backward(&ref, &acts, inputs, 1.0);
        double norm = sqrt(sum_of_squares(ref.grads, n));
        clip_by_global_norm(ref.grads, n, norm, max_norm);
        adamw_step(ref.params, ref.grads, adam_m, adam_v, n, s + 1, lr, &adam);
    }

    for (int precision = GPU_FP32; precision <= GPU_BF16; precision++) {
        bool bf16 = precision == GPU_BF16;
        GpuModel m;
        gpu_model_init(&m, &cfg, 42, (GpuPrecision)precision, B, T);
        double loss[CURVE_STEPS], worst = 0;
        int worst_step = 0;
        long long most_step_waits = 0, most_loss_waits = 0, fewest_loss_waits = 1 << 30;
        for (int s = 0; s < CURVE_STEPS; s++) {
            long long waits = gpu_host_waits();
            gpu_model_zero_grads(&m);
            gpu_model_forward_queued(&m, inputs, targets);
            gpu_model_backward(&m, 1.0);
            gpu_model_step(&m, s + 1, lr, &adam, max_norm);
            long long step_waits = gpu_host_waits() - waits;
            loss[s] = gpu_model_loss(&m);
            long long loss_waits = gpu_host_waits() - waits - step_waits;
            if (step_waits > most_step_waits) most_step_waits = step_waits;
            if (loss_waits > most_loss_waits) most_loss_waits = loss_waits;
            if (loss_waits < fewest_loss_waits) fewest_loss_waits = loss_waits;
            double e = fabs(loss[s] - ref_loss[s]);
            if (!(e <= worst)) worst = e, worst_step = s + 1;
        }
        char name[96];
        snprintf(name, sizeof name, "%s %s host waits per step", config, bf16 ? "bf16" : "fp32");
        report(name, most_step_waits == 0 && most_loss_waits == 1 && fewest_loss_waits == 1,
               "at most %lld before the loss is read (want 0), %lld to %lld to read it (want 1)", most_step_waits,
               fewest_loss_waits, most_loss_waits);
        double tol = bf16 ? 0.6 : 2e-3;  // nats, every step
        double last = loss[CURVE_STEPS - 1], ref_last = ref_loss[CURVE_STEPS - 1];
        double travel = ref_loss[0] - ref_last;  // how far the reference's loss came down
        double last_of_travel = fabs(last - ref_last) / travel;
        bool last_ok = !bf16 || last_of_travel <= 0.01;  // bf16 only: fp32's every-step bound is tighter
        snprintf(name, sizeof name, "%s %s %d-step loss curve", config, bf16 ? "bf16" : "fp32", CURVE_STEPS);
        report(name, worst <= tol && last_ok && last < loss[0] - 0.1,
               "%.4f -> %.4f (reference %.4f -> %.4f; last step off by %.2g of that travel, bound %s); "
               "worst step %d: %.2g nats (bound %g)",
               loss[0], last, ref_loss[0], ref_last, last_of_travel, bf16 ? "0.01" : "none", worst_step, worst, tol);
        gpu_model_free(&m);
    }
    free(inputs), free(targets), free(adam_m), free(adam_v);
    model_acts_free(&acts);
    model_free(&ref);
}

// One traced step of tiny: the GPU timeline holds one slice per piece of the model (embedding,
// every block forward and backward, the head both ways, the optimizer), closed, on "cuda:compute"
// next to the host's "compute" slice; written to `path` (tests/t_gpu_emulated.sh checks the file
// against the Perfetto schema).
static void test_timeline(const char *path) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    int B = 2, T = 16, BT = B * T;
    int *inputs = malloc(sizeof(int) * BT), *targets = malloc(sizeof(int) * BT);
    make_batch(inputs, targets, BT, cfg.vocab_size);
    AdamWConfig adam = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    GpuModel m;
    gpu_model_init(&m, &cfg, 42, GPU_BF16, B, T);
    trace_init(0, "rank 0 [gpu 0]");
    int host = trace_track("compute");
    trace_begin(host, "step 1", "step");
    gpu_model_zero_grads(&m);
    gpu_model_forward(&m, inputs, targets);
    gpu_model_backward(&m, 1.0);
    gpu_model_step(&m, 1, 1e-3, &adam, 1.0);
    trace_end(host);
    gpu_timeline_flush();
    TraceStats st = trace_stats(trace_local());
    size_t want = 1 + 2 * (size_t)cfg.n_layers + 5;  // host step; blocks fwd+bwd; embedding x2, head x2, optimizer
    report("GPU timeline of one step", st.slices == want && st.open_slices == 0 && st.tracks == 2,
           "%zu slices (want %zu), %zu open, %zu thread tracks (want 2)", st.slices, want, st.open_slices, st.tracks);
    if (path) report("GPU timeline written", trace_write_pftrace(path), "%s", path);
    trace_shutdown();
    gpu_model_free(&m);
    free(inputs), free(targets);
}

// test_gpu_model [--trace FILE]: FILE receives the traced step's Perfetto trace.
int main(int argc, char **argv) {
    if (!gpu_test_start("test_gpu_model")) return 0;
    const char *trace_path = argc == 3 && strcmp(argv[1], "--trace") == 0 ? argv[2] : NULL;
    test_first_step("tiny", 4, 32);
    test_first_step("small", 2, 128);
    test_loss_curve("tiny", 4, 32, 3e-3);
    test_loss_curve("small", 2, 64, 3e-4);
    test_timeline(trace_path);
    return gpu_test_finish("test_gpu_model");
}
