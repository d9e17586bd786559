// main_bench_gpu.c -> build/bench_gpu: training steps of a Llama-shaped model on one GPU (gpu/model.h):
// zero grads, forward with the loss, backward, clip, AdamW, on a fixed random batch, each step queued
// without a host wait (the loss is read only in the warm-up and at the end). Prints tokens/s,
// achieved TFLOP/s and MFU (gpu/mfu.h) over the steps after the warm-up, the host waits per measured
// step (gpu_host_waits: 0 unless the host ran GPU_UPLOAD_SLOTS uploads ahead), and the memory report. scripts/bench_gpu.sh runs it next to PyTorch; without a CUDA device it prints SKIP.
//
//   build/bench_gpu --model llama3_1b --batch 4 --seq-len 2048 --steps 12
//   build/bench_gpu --model llama3_1b --batch 0 --seq-len 8192      # the largest batch that fits
//   build/bench_gpu --model llama3_1b --seq-len 2048 --attention-only # one layer's attention, bf16
//
// MFU is printed by the project's FLOP count (mfu) and by torchtitan's convention (mfu_titan),
// gpu/mfu.h.
#include <stdbool.h>
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
    bool attention_only;
} opt;

// The largest batch whose planned memory (gpu_model_plan_bytes) fits in 90% of the free memory: the
// rest is for cuBLASLt's workspace, the per-call scratch and the pool's rounding.
static int largest_batch(const ModelConfig *cfg, GpuPrecision precision, int T) {
    size_t free_bytes, total_bytes;
    gpu_memory_info(&free_bytes, &total_bytes);
    int B = 0;
    while (B < (1 << 16) && gpu_model_plan_bytes(cfg, precision, B + 1, T, AC_NONE) <= 0.9 * free_bytes) B++;
    if (B == 0)
        fatal("out of GPU memory: one sequence of %d tokens needs %.2f MiB, the device has %.2f MiB free", T,
              gpu_model_plan_bytes(cfg, precision, 1, T, AC_NONE) / 1048576.0, free_bytes / 1048576.0);
    return B;
}

// One layer's attention, bf16, forward and backward timed apart with CUDA-synchronised host clocks:
// the kernels alone, against PyTorch's SDPA at the same shapes (scripts/bench_attention_torch_gpu.py).
static void bench_attention(const ModelConfig *cfg, int B, int T, int steps, int warmup) {
    int H = cfg->n_heads, KV = cfg->n_kv_heads, hd = model_head_dim(cfg);
    size_t nq = (size_t)B * T * H * hd, nkv = (size_t)B * T * KV * hd;
    gpu_bf16 *q = gpu_alloc(MEM_ACTIVATIONS, 2 * nq), *k = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv);
    gpu_bf16 *v = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv), *out = gpu_alloc(MEM_ACTIVATIONS, 2 * nq);
    gpu_bf16 *dout = gpu_alloc(MEM_ACTIVATIONS, 2 * nq), *dq = gpu_alloc(MEM_ACTIVATIONS, 2 * nq);
    gpu_bf16 *dk = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv), *dv = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv);
    float *lse = gpu_alloc(MEM_ACTIVATIONS, sizeof(float) * B * H * T);
    float *host = malloc(sizeof(float) * nq);  // random inputs: scores of a realistic spread
    float *dev = gpu_alloc(MEM_OTHER, sizeof(float) * nq);
    gpu_bf16 *targets[] = {q, k, v, dout};
    size_t counts[] = {nq, nkv, nkv, nq};
    for (int t = 0; t < 4; t++) {
        for (size_t i = 0; i < counts[t]; i++) host[i] = (float)(rng_normal(5, (uint64_t)t, i));
        gpu_upload(dev, host, sizeof(float) * counts[t]);
        gpu_cast_f32_to_bf16(targets[t], dev, counts[t]);
    }
    AttnShape s = {B, T, T, H, KV, hd, NULL, NULL, true};
    double fwd_s = 0, bwd_s = 0;
    for (int i = 0; i < steps; i++) {
        gpu_synchronize();
        long long t0 = now_ns();
        gpu_attention_forward_bf16(out, lse, q, k, v, &s);
        gpu_synchronize();
        long long t1 = now_ns();
        gpu_attention_backward_bf16(dq, dk, dv, dout, q, k, v, out, lse, &s);
        gpu_synchronize();
        long long t2 = now_ns();
        if (i >= warmup) fwd_s += (t1 - t0) * 1e-9, bwd_s += (t2 - t1) * 1e-9;
    }
    int measured = steps - warmup;
    double fwd_tflops = attention_forward_flops(B, H, T, hd) * measured / fwd_s / 1e12;
    double bwd_tflops = attention_backward_flops(B, H, T, hd) * measured / bwd_s / 1e12;
    printf("attention: batch=%d seq=%d heads=%d kv_heads=%d head_dim=%d fwd_ms=%.3f bwd_ms=%.3f fwd_tflops=%.2f "
           "bwd_tflops=%.2f\n",
           B, T, H, KV, hd, fwd_s * 1e3 / measured, bwd_s * 1e3 / measured, fwd_tflops, bwd_tflops);
    void *owned[] = {q, k, v, out, dout, dq, dk, dv, lse, dev};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
    free(host);
}

int main(int argc, char **argv) {
    log_set_program("bench_gpu");
    const ArgSpec flags[] = {
        {"model", ARG_CHOICE, &opt.model, "llama3_1b", "model config", .choices = MODEL_CONFIG_NAMES},
        {"precision", ARG_CHOICE, &opt.precision, "bf16", "compute precision", .choices = "bf16|fp32"},
        {"batch", ARG_INT, &opt.batch, "4", "sequences per step (0: the largest that fits)", .min = 0, .max = 1 << 20},
        {"seq-len", ARG_INT, &opt.seq_len, "2048", "tokens per sequence", .min = 1, .max = 1 << 20},
        {"steps", ARG_INT, &opt.steps, "12", "steps, warm-up included", .min = 2, .max = 1 << 20},
        {"warmup", ARG_INT, &opt.warmup, "2", "first steps left out of the timing", .min = 1, .max = 1 << 20},
        {"layers", ARG_INT, &opt.layers, "0", "override n_layers (0: the config's)", .min = 0, .max = 1 << 10},
        {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto trace: host steps and the GPU timeline",
         .value_name = "FILE"},
        {"attention-only", ARG_BOOL, &opt.attention_only, NULL, "time one layer's attention alone (bf16)",
         .value_name = ""},
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
    GpuPrecision precision = opt.precision[0] == 'b' ? GPU_BF16 : GPU_FP32;
    if (opt.batch == 0) opt.batch = largest_batch(&cfg, precision, opt.seq_len);
    if (opt.attention_only) {
        printf("bench_gpu: %s; attention of model %s\n", device, cfg.name);
        bench_attention(&cfg, opt.batch, opt.seq_len, opt.steps, opt.warmup);
        gpu_shutdown();
        return 0;
    }
    GpuModel m;
    gpu_model_init(&m, &cfg, 1, precision, opt.batch, opt.seq_len);
    int BT = opt.batch * opt.seq_len;
    int *inputs = malloc(sizeof(int) * BT), *targets = malloc(sizeof(int) * BT);
    for (int i = 0; i < BT; i++) {
        inputs[i] = (int)rng_below(3, 1, i, cfg.vocab_size);
        targets[i] = (int)rng_below(3, 2, i, cfg.vocab_size);
    }
    double flops_per_token = model_flops_per_token(&cfg, opt.seq_len);
    double flops_titan = flops_per_token_torchtitan(&cfg, opt.seq_len);
    printf("bench_gpu: %s; model %s with %d layers (%.3f B params), batch=%d x %d tokens, %s, "
           "flops_per_token=%.6g flops_per_token_titan=%.6g\n",
           device, cfg.name, cfg.n_layers, m.table.total_numel / 1e9, opt.batch, opt.seq_len, opt.precision,
           flops_per_token, flops_titan);

    AdamWConfig adam = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    if (opt.trace) trace_init(0, "rank 0 [gpu 0]");
    int host = trace_track("compute");
    long long t0 = 0, waits0 = 0;
    for (int step = 1; step <= opt.steps; step++) {
        if (step == opt.warmup + 1) {
            gpu_synchronize();
            t0 = now_ns();
            waits0 = gpu_host_waits();
        }
        trace_begin(host, "step", "step");
        trace_arg_int(host, "step", step);
        gpu_model_zero_grads(&m);
        gpu_model_forward_queued(&m, inputs, targets);
        gpu_model_backward(&m, 1.0);
        gpu_model_step(&m, step, 3e-4, &adam, 1.0);
        trace_end(host);
        if (step <= opt.warmup) printf("warm-up step %d: loss %.4f\n", step, gpu_model_loss(&m));
    }
    long long waits = gpu_host_waits() - waits0;
    gpu_synchronize();
    double seconds = (now_ns() - t0) * 1e-9;
    double loss = gpu_model_loss(&m);
    if (opt.trace) {
        gpu_timeline_flush();
        if (!trace_write_pftrace(opt.trace)) fatal("could not write %s", opt.trace);
        printf("trace: %s\n", opt.trace);
    }
    int measured = opt.steps - opt.warmup;
    Throughput t = throughput((double)BT * measured, seconds, flops_per_token, opt.peak_tflops * 1e12);
    Throughput titan = throughput((double)BT * measured, seconds, flops_titan, opt.peak_tflops * 1e12);
    printf("timing: steps=%d measured=%d mean_step_ms=%.3f tokens_per_s=%.1f tflops=%.2f mfu=%.4f mfu_titan=%.4f "
           "last_loss=%.4f host_waits_per_step=%.2f\n",
           opt.steps, measured, seconds * 1e3 / measured, t.tokens_per_s, t.flops_per_s / 1e12, t.mfu, titan.mfu, loss,
           (double)waits / measured);
    gpu_memory_report();
    gpu_model_free(&m);
    gpu_shutdown();
    free(inputs), free(targets);
    return 0;
}
