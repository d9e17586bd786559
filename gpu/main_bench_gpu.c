// main_bench_gpu.c -> build/bench_gpu: training steps of a Llama-shaped model on one GPU (gpu/model.h):
// zero grads, forward with the loss, backward, clip, AdamW, on a fixed random batch. Prints
// tokens/s, achieved TFLOP/s and MFU (gpu/mfu.h) over the steps after the warm-up, and the memory
// report. scripts/bench_gpu.sh runs it next to PyTorch; without a CUDA device it prints SKIP.
//
//   build/bench_gpu --model llama3_1b --batch 4 --seq-len 2048 --steps 12
#include <stdio.h>
#include <stdlib.h>

#include "common/args.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/trace.h"
#include "gpu/mfu.h"
#include "gpu/model.h"
#include "gpu/runtime.h"
#include "gpu/timeline.h"

static struct {
    const char *model, *precision, *trace;
    int batch, seq_len, steps, warmup, layers;
    double peak_tflops;
} opt;

int main(int argc, char **argv) {
    log_set_program("bench_gpu");
    const ArgSpec flags[] = {
        {"model", ARG_CHOICE, &opt.model, "llama3_1b", "model config", .choices = MODEL_CONFIG_NAMES},
        {"precision", ARG_CHOICE, &opt.precision, "bf16", "compute precision", .choices = "bf16|fp32"},
        {"batch", ARG_INT, &opt.batch, "4", "sequences per step", .min = 1, .max = 1 << 20},
        {"seq-len", ARG_INT, &opt.seq_len, "2048", "tokens per sequence", .min = 1, .max = 1 << 20},
        {"steps", ARG_INT, &opt.steps, "12", "steps, warm-up included", .min = 2, .max = 1 << 20},
        {"warmup", ARG_INT, &opt.warmup, "2", "first steps left out of the timing", .min = 1, .max = 1 << 20},
        {"layers", ARG_INT, &opt.layers, "0", "override n_layers (0: the config's)", .min = 0, .max = 1 << 10},
        {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto trace: host steps and the GPU timeline",
         .value_name = "FILE"},
        {"peak-tflops", ARG_DOUBLE, &opt.peak_tflops, "989", "the device's dense bf16 peak, for MFU (H100 SXM: 989)",
         .min = 1, .max = 1e6},
    };
    args_parse(flags, sizeof flags / sizeof flags[0], argc, argv, "bench_gpu",
               "times training steps of a Llama-shaped model on the GPU");
    if (opt.steps <= opt.warmup) fatal_input("--steps %d: must exceed --warmup %d", opt.steps, opt.warmup);
    char why[256];
    if (gpu_device_count(why, sizeof why) == 0) {
        printf("SKIP: no CUDA device (%s)\n", why);
        return 0;
    }
    ModelConfig cfg;
    model_config_lookup(opt.model, &cfg);
    if (opt.layers > 0) cfg.n_layers = opt.layers;
    model_config_validate(&cfg, opt.seq_len);

    gpu_init(0);
    char device[256];
    gpu_device_description(device, sizeof device);
    GpuModel m;
    gpu_model_init(&m, &cfg, 1, opt.precision[0] == 'b' ? GPU_BF16 : GPU_FP32, opt.batch, opt.seq_len);
    int BT = opt.batch * opt.seq_len;
    int *inputs = malloc(sizeof(int) * BT), *targets = malloc(sizeof(int) * BT);
    for (int i = 0; i < BT; i++) {
        inputs[i] = (int)rng_below(3, 1, i, cfg.vocab_size);
        targets[i] = (int)rng_below(3, 2, i, cfg.vocab_size);
    }
    double flops_per_token = model_flops_per_token(&cfg, opt.seq_len);
    printf("bench_gpu: %s; model %s with %d layers (%.3f B params), batch %d x %d tokens, %s, "
           "flops_per_token=%.6g\n",
           device, cfg.name, cfg.n_layers, m.table.total_numel / 1e9, opt.batch,
           opt.seq_len, opt.precision, flops_per_token);

    AdamWConfig adam = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    if (opt.trace) trace_init(0, "rank 0 [gpu 0]");
    int host = trace_track("compute");
    long long t0 = 0;
    double loss = 0;
    for (int step = 1; step <= opt.steps; step++) {
        if (step == opt.warmup + 1) {
            gpu_synchronize();
            t0 = now_ns();
        }
        trace_begin(host, "step", "step");
        trace_arg_int(host, "step", step);
        gpu_model_zero_grads(&m);
        loss = gpu_model_forward(&m, inputs, targets);
        gpu_model_backward(&m, 1.0);
        gpu_model_step(&m, step, 3e-4, &adam, 1.0);
        trace_end(host);
        if (step <= opt.warmup) printf("warm-up step %d: loss %.4f\n", step, loss);
    }
    gpu_synchronize();
    double seconds = (now_ns() - t0) * 1e-9;
    if (opt.trace) {
        gpu_timeline_flush();
        if (!trace_write_pftrace(opt.trace)) fatal("could not write %s", opt.trace);
        printf("trace: %s\n", opt.trace);
    }
    int measured = opt.steps - opt.warmup;
    Throughput t = throughput((double)BT * measured, seconds, flops_per_token, opt.peak_tflops * 1e12);
    printf("timing: steps=%d measured=%d mean_step_ms=%.3f tokens_per_s=%.1f tflops=%.2f mfu=%.4f last_loss=%.4f\n",
           opt.steps, measured, seconds * 1e3 / measured, t.tokens_per_s, t.flops_per_s / 1e12, t.mfu, loss);
    gpu_memory_report();
    gpu_model_free(&m);
    gpu_shutdown();
    free(inputs), free(targets);
    return 0;
}
