// main_bench_gpu.c -> build/bench_gpu: training steps of a Llama-shaped model on one GPU (gpu/model.h):
// zero grads, forward with the loss, backward, clip, AdamW, on a fixed random batch, each step queued
// without a host wait (the loss is read only in the warm-up and at the end). Prints tokens/s,
// achieved TFLOP/s and MFU (gpu/mfu.h) over the steps after the warm-up, the host waits per measured
// step (gpu_host_waits: 0 unless the host ran GPU_UPLOAD_SLOTS uploads ahead), and the memory report. scripts/bench_gpu.sh runs it next to PyTorch; without a CUDA device it prints SKIP.
//
//   build/bench_gpu --model llama3_1b --batch 4 --seq-len 2048 --steps 12
//   build/bench_gpu --model llama3_1b --batch 0 --seq-len 8192      # the largest batch that fits
//   build/bench_gpu --model llama3_1b --seq-len 2048 --attention-only # one layer's attention, bf16
//   build/bench_gpu --model llama3_1b --seq-len 2048 --gemm-only      # the linears' GEMMs, bf16 and FP8
//
// --attention-only and --gemm-only give the efficiencies a cluster profile of chapter 11's planner
// holds (scripts/gpu_profile.py turns them into one: scripts/bench_gpu.sh does, and predicts the
// step it measured with it).
//
// MFU is printed by the project's FLOP count (mfu) and by torchtitan's convention (mfu_titan),
// gpu/mfu.h.
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/trace.h"
#include "gpu/activity.h"
#include "gpu/fp8.h"
#include "gpu/mfu.h"
#include "gpu/model.h"
#include "gpu/runtime.h"
#include "gpu/timeline.h"

static struct {
    const char *model, *precision, *trace;
    int batch, seq_len, steps, warmup, layers;
    double peak_tflops;
    bool attention_only, gemm_only;
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

// Random operands are drawn on the host for the first FILL_DRAWN elements and that block is repeated
// over the rest of the buffer by device copies: the head's (B T, V) operand of llama3_1b at 16 x 2048
// is 4.2 G elements, minutes of host draws, and a matmul's speed does not depend on where its
// values repeat.
#define FILL_DRAWN ((size_t)1 << 24)

// buf (bytes) = its first `block` bytes repeated, by doubling copies.
static void repeat_block(void *buf, size_t block, size_t bytes) {
    for (size_t have = block; have < bytes; have *= 2)
        gpu_copy((char *)buf + have, buf, have < bytes - have ? have : bytes - have);
}

// The first min(n, FILL_DRAWN) Gaussian values of stream `stream`, drawn on the host, in a device
// fp32 buffer (the caller frees it); *drawn: how many.
static float *gaussians_on_device(size_t n, uint64_t stream, size_t *drawn) {
    *drawn = n < FILL_DRAWN ? n : FILL_DRAWN;
    float *host = malloc(sizeof(float) * *drawn), *dev = gpu_alloc(MEM_OTHER, sizeof(float) * *drawn);
    for (size_t i = 0; i < *drawn; i++) host[i] = (float)rng_normal(6, stream, i);
    gpu_upload(dev, host, sizeof(float) * *drawn);
    free(host);
    return dev;
}

// x (n) = bf16 of Gaussian values (stream `stream`).
static void fill_bf16(gpu_bf16 *x, size_t n, uint64_t stream) {
    size_t drawn;
    float *dev = gaussians_on_device(n, stream, &drawn);
    gpu_cast_f32_to_bf16(x, dev, drawn);
    repeat_block(x, 2 * drawn, 2 * n);
    gpu_free(dev);
}

// Whether two device buffers hold the same bytes (copied to the host).
static bool same_device_bytes(const void *a, const void *b, size_t bytes) {
    unsigned char *ha = malloc(bytes), *hb = malloc(bytes);
    if (!ha || !hb) fatal("bench_gpu: out of host memory for a %zu-byte comparison", bytes);
    gpu_download(ha, a, bytes);
    gpu_download(hb, b, bytes);
    bool same = memcmp(ha, hb, bytes) == 0;
    free(ha), free(hb);
    return same;
}

// One attention's results on the device: out, dq (nq bf16 each), dk, dv (nkv), lse (n_rows fp32).
typedef struct {
    gpu_bf16 *out, *dq, *dk, *dv;
    float *lse;
    size_t nq, nkv, n_rows;
} AttnOutputs;
static AttnOutputs attn_outputs_alloc(size_t nq, size_t nkv, size_t n_rows) {
    AttnOutputs o = {gpu_alloc(MEM_ACTIVATIONS, 2 * nq), gpu_alloc(MEM_ACTIVATIONS, 2 * nq),
                     gpu_alloc(MEM_ACTIVATIONS, 2 * nkv), gpu_alloc(MEM_ACTIVATIONS, 2 * nkv),
                     gpu_alloc(MEM_ACTIVATIONS, sizeof(float) * n_rows), nq, nkv, n_rows};
    return o;
}
static void attn_outputs_free(AttnOutputs *o) {
    gpu_free(o->out), gpu_free(o->dq), gpu_free(o->dk), gpu_free(o->dv), gpu_free(o->lse);
}
static bool attn_outputs_same(const AttnOutputs *a, const AttnOutputs *b) {
    return same_device_bytes(a->out, b->out, 2 * a->nq) && same_device_bytes(a->dq, b->dq, 2 * a->nq) &&
           same_device_bytes(a->dk, b->dk, 2 * a->nkv) && same_device_bytes(a->dv, b->dv, 2 * a->nkv) &&
           same_device_bytes(a->lse, b->lse, sizeof(float) * a->n_rows);
}

// `steps` forward and backward passes into o (the gradients accumulating), each synchronised; the
// seconds of the last steps - warmup forward passes into *fwd_s, backward into *bwd_s.
static void time_attention(const AttnShape *s, const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v,
                           const gpu_bf16 *dout, AttnOutputs *o, int steps, int warmup, double *fwd_s, double *bwd_s) {
    *fwd_s = *bwd_s = 0;
    for (int i = 0; i < steps; i++) {
        gpu_synchronize();
        long long t0 = now_ns();
        gpu_attention_forward_bf16(o->out, o->lse, q, k, v, s);
        gpu_synchronize();
        long long t1 = now_ns();
        gpu_attention_backward_bf16(o->dq, o->dk, o->dv, dout, q, k, v, o->out, o->lse, s);
        gpu_synchronize();
        long long t2 = now_ns();
        if (i >= warmup) *fwd_s += (t1 - t0) * 1e-9, *bwd_s += (t2 - t1) * 1e-9;
    }
}

// One layer's attention, bf16, forward and backward timed apart with CUDA-synchronised host clocks:
// the kernels alone, against PyTorch's SDPA at the same shapes (scripts/bench_attention_torch_gpu.py).
// Then the same with the other tile sizes (64 or 128 rows: gpu_attention_set_tile_rows; the backward
// kernels keep 64 where head_dim is over 64), in the same run, each one's results compared with the
// first's bit for bit (each accumulates `steps` backward passes from zeroed gradients: equal bits iff
// every pass was).
static void bench_attention(const ModelConfig *cfg, int B, int T, int steps, int warmup) {
    int H = cfg->n_heads, KV = cfg->n_kv_heads, hd = model_head_dim(cfg);
    size_t nq = (size_t)B * T * H * hd, nkv = (size_t)B * T * KV * hd, n_rows = (size_t)B * H * T;
    gpu_bf16 *q = gpu_alloc(MEM_ACTIVATIONS, 2 * nq), *k = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv);
    gpu_bf16 *v = gpu_alloc(MEM_ACTIVATIONS, 2 * nkv), *dout = gpu_alloc(MEM_ACTIVATIONS, 2 * nq);
    gpu_bf16 *targets[] = {q, k, v, dout};  // random inputs: scores of a realistic spread
    size_t counts[] = {nq, nkv, nkv, nq};
    for (int t = 0; t < 4; t++) fill_bf16(targets[t], counts[t], (uint64_t)t);
    AttnShape s = {B, T, T, H, KV, hd, NULL, NULL, true};
    const int measured = steps - warmup;
    const double fwd_flops = attention_forward_flops(B, H, T, hd) * measured;
    const double bwd_flops = attention_backward_flops(B, H, T, hd) * measured;

    AttnOutputs first = attn_outputs_alloc(nq, nkv, n_rows);
    double fwd_s, bwd_s;
    time_attention(&s, q, k, v, dout, &first, steps, warmup, &fwd_s, &bwd_s);
    const GpuAttnTileRows rows = gpu_attention_tile_rows();
    printf("attention: batch=%d seq=%d heads=%d kv_heads=%d head_dim=%d rows=%d,%d,%d fwd_ms=%.3f bwd_ms=%.3f "
           "fwd_tflops=%.2f bwd_tflops=%.2f\n",
           B, T, H, KV, hd, rows.forward, rows.dq, rows.dkdv, fwd_s * 1e3 / measured, bwd_s * 1e3 / measured,
           fwd_flops / fwd_s / 1e12, bwd_flops / bwd_s / 1e12);

    // The other tile sizes: 128-row query tiles in the forward and dQ kernels, a 128-row key tile in
    // dK/dV, and both (the backward's time tells dQ's part from dK/dV's).
    const GpuAttnTileRows variants[] = {{64, 64, 64}, {128, 128, 64}, {64, 64, 128}, {128, 128, 128}};
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        const GpuAttnTileRows r = variants[i];
        if (r.forward == rows.forward && r.dq == rows.dq && r.dkdv == rows.dkdv) continue;
        gpu_attention_set_tile_rows(r);
        AttnOutputs other = attn_outputs_alloc(nq, nkv, n_rows);
        time_attention(&s, q, k, v, dout, &other, steps, warmup, &fwd_s, &bwd_s);
        printf("attention-tiles: rows=%d,%d,%d fwd_ms=%.3f bwd_ms=%.3f fwd_tflops=%.2f bwd_tflops=%.2f same_bits=%s\n",
               r.forward, r.dq, r.dkdv, fwd_s * 1e3 / measured, bwd_s * 1e3 / measured, fwd_flops / fwd_s / 1e12,
               bwd_flops / bwd_s / 1e12, attn_outputs_same(&first, &other) ? "yes" : "no");
        attn_outputs_free(&other);
    }
    gpu_attention_set_tile_rows(rows);
    attn_outputs_free(&first);
    gpu_free(q), gpu_free(k), gpu_free(v), gpu_free(dout);
}

// q (n) = FP8 codes of Gaussian values (per tensor, scale 16: well inside E4M3's and E5M2's range).
static void fill_fp8(uint8_t *q, size_t n, uint64_t stream, Fp8Format f, const float *scale) {
    size_t drawn;
    float *dev = gaussians_on_device(n, stream, &drawn);
    gpu_fp8_quantize(q, dev, 1, (int)drawn, FP8_PER_TENSOR, scale, f);
    repeat_block(q, drawn, n);
    gpu_free(dev);
}

// The linears of one block and the output head as the model runs them at B x T tokens: for each
// (K, N), the forward GEMM and both backward ones (input and weight gradients), M = B T; the
// FLOPs (3 x 2 M K N each) over the CUDA-synchronised host time. In bf16 (the model's GEMMs), and
// with FP8 codes (E4M3 x E4M3 forward with fast accumulation, E5M2 x E4M3 gradients: chapter 9's
// tensorwise linear; the head stays bf16 in FP8 training, so it is left out there). Then a
// device-to-device copy of 1 GiB: the memory bandwidth the element-wise ops run at. The line
// `gemm:` holds what a cluster profile's gemm_eff, fp8_gemm_eff and hbm_bw are made of.
static void bench_gemms(const ModelConfig *cfg, int B, int T, int steps, int warmup) {
    int M = B * T, D = cfg->dim, F = cfg->ffn_dim, V = cfg->vocab_size, hd = model_head_dim(cfg);
    int hq = cfg->n_heads * hd, hkv = cfg->n_kv_heads * hd;
    enum { N_SHAPES = 6 };
    const int shape[N_SHAPES][2] = {{D, hq + 2 * hkv}, {hq, D}, {D, F}, {D, F}, {F, D}, {D, V}};  // (K, N): QKV wo W1 W3 W2 head
    const bool in_fp8[N_SHAPES] = {true, true, true, true, true, false};
    // the largest operand of each kind over the shapes (every FP8 operand in both of its layouts)
    size_t x_n = 0, y_n = 0, w_n = 0, fa_n = 0, fb_n = 0, fout_n = 0;
#define AT_LEAST(v, n) (v) = (v) > (size_t)(n) ? (v) : (size_t)(n)
    for (int i = 0; i < N_SHAPES; i++) {
        size_t K = shape[i][0], N = shape[i][1], rows = (size_t)M;
        AT_LEAST(x_n, rows * K), AT_LEAST(y_n, rows * N), AT_LEAST(w_n, N * K);
        if (in_fp8[i]) AT_LEAST(fa_n, rows * (K > N ? K : N)), AT_LEAST(fb_n, K * (N > rows ? N : rows)), AT_LEAST(fb_n, N * K),
            AT_LEAST(fout_n, rows * (K > N ? K : N)), AT_LEAST(fout_n, N * K);
    }
#undef AT_LEAST
    gpu_bf16 *x = gpu_alloc(MEM_ACTIVATIONS, 2 * x_n), *w = gpu_alloc(MEM_PARAMS, 2 * w_n);
    gpu_bf16 *y = gpu_alloc(MEM_ACTIVATIONS, 2 * y_n), *dx = gpu_alloc(MEM_ACTIVATIONS, 2 * x_n);
    float *dw = gpu_alloc(MEM_GRADS, sizeof(float) * w_n);
    fill_bf16(x, x_n, 1), fill_bf16(w, w_n, 2), fill_bf16(y, y_n, 3);
    bool fp8_ok = true;  // cuBLASLt's FP8 GEMMs take multiples of 16 only
    for (int i = 0; i < N_SHAPES; i++)
        if (in_fp8[i] && (gpu_fp8_gemm_shape_error(M, shape[i][1], shape[i][0]) ||
                          gpu_fp8_gemm_shape_error(M, shape[i][0], shape[i][1]) ||
                          gpu_fp8_gemm_shape_error(shape[i][1], shape[i][0], M)))
            fp8_ok = false;
    float sixteen = 16, *scale = gpu_alloc(MEM_OTHER, sizeof(float));
    gpu_upload(scale, &sixteen, sizeof sixteen);
    // codes: qa holds the (M, K), (M, N) or (N, M) operand, qb the (N, K), (K, N) or (K, M) one
    uint8_t *qa = fp8_ok ? gpu_alloc(MEM_ACTIVATIONS, fa_n) : NULL, *qb = fp8_ok ? gpu_alloc(MEM_PARAMS, fb_n) : NULL;
    float *out = fp8_ok ? gpu_alloc(MEM_ACTIVATIONS, sizeof(float) * fout_n) : NULL;
    if (fp8_ok) fill_fp8(qa, fa_n, 4, FP8_E4M3, scale), fill_fp8(qb, fb_n, 5, FP8_E4M3, scale);
    double flops[2] = {0, 0}, seconds[2] = {0, 0};  // bf16, FP8
    for (int i = 0; i < N_SHAPES; i++) {
        double f = 3 * 2.0 * M * shape[i][0] * shape[i][1];
        flops[0] += f, flops[1] += in_fp8[i] ? f : 0;
    }
    for (int step = 0; step < steps; step++) {
        gpu_synchronize();
        long long t0 = now_ns();
        for (int i = 0; i < N_SHAPES; i++) {
            int K = shape[i][0], N = shape[i][1];
            gpu_matmul_forward_bf16(y, x, w, M, K, N);
            gpu_matmul_backward_bf16(dx, dw, y, x, w, M, K, N);
        }
        gpu_synchronize();
        long long t1 = now_ns();
        for (int i = 0; fp8_ok && i < N_SHAPES; i++) {
            if (!in_fp8[i]) continue;
            int K = shape[i][0], N = shape[i][1];
            gpu_fp8_gemm(out, qa, FP8_E4M3, scale, qb, FP8_E4M3, scale, M, N, K, false, true);   // y = x w^T
            gpu_fp8_gemm(out, qa, FP8_E5M2, scale, qb, FP8_E4M3, scale, M, K, N, false, false);  // dx = dy w
            gpu_fp8_gemm(out, qa, FP8_E5M2, scale, qb, FP8_E4M3, scale, N, K, M, false, false);  // dw = dy^T x
        }
        gpu_synchronize();
        long long t2 = now_ns();
        if (step >= warmup) seconds[0] += (t1 - t0) * 1e-9, seconds[1] += (t2 - t1) * 1e-9;
    }
    int measured = steps - warmup;
    // memory: a 1 GiB device-to-device copy, read and written (capped at a quarter of what is free)
    size_t free_bytes, total_bytes;
    gpu_memory_info(&free_bytes, &total_bytes);
    size_t copy_bytes = (size_t)1 << 30;
    if (copy_bytes > free_bytes / 4) copy_bytes = free_bytes / 4 & ~(size_t)255;
    void *src = gpu_alloc(MEM_OTHER, copy_bytes), *dst = gpu_alloc(MEM_OTHER, copy_bytes);
    double copy_s = 0;
    for (int step = 0; step < steps; step++) {
        gpu_synchronize();
        long long t0 = now_ns();
        gpu_copy(dst, src, copy_bytes);
        gpu_synchronize();
        if (step >= warmup) copy_s += (now_ns() - t0) * 1e-9;
    }
    printf("gemm: tokens=%d bf16_flops=%.6g bf16_ms=%.6g fp8_flops=%.6g fp8_ms=%.6g bf16_tflops=%.2f fp8_tflops=%.2f "
           "copy_bytes_per_s=%.6g device_bytes=%zu\n",
           M, flops[0], seconds[0] * 1e3 / measured, fp8_ok ? flops[1] : 0, fp8_ok ? seconds[1] * 1e3 / measured : 0,
           flops[0] * measured / seconds[0] / 1e12, fp8_ok ? flops[1] * measured / seconds[1] / 1e12 : 0,
           2.0 * copy_bytes * measured / copy_s, total_bytes);
    void *owned[] = {x, w, y, dx, dw, scale, qa, qb, out, src, dst};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
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
        {"n-layers", ARG_INT, &opt.layers, "0", "override n_layers (0: the config's; the trainer's flag)", .min = 0, .max = 1 << 10},
        {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto trace: host steps and the GPU timeline",
         .value_name = "FILE"},
        {"attention-only", ARG_BOOL, &opt.attention_only, NULL, "time one layer's attention alone (bf16)",
         .value_name = ""},
        {"gemm-only", ARG_BOOL, &opt.gemm_only, NULL,
         "time the linears' GEMMs alone (bf16 and FP8) and a device copy: the planner's efficiencies", .value_name = ""},
        {"peak-tflops", ARG_DOUBLE, &opt.peak_tflops, "989", "the device's dense bf16 peak, for MFU (H100 SXM: 989)",
         .min = 1, .max = 1e6},
    };
    args_parse(flags, sizeof flags / sizeof flags[0], argc, argv, "bench_gpu",
               "times training steps of a Llama-shaped model on the GPU");
    if (opt.steps <= opt.warmup) fatal_input("--steps %d: must exceed --warmup %d", opt.steps, opt.warmup);
    if (opt.attention_only && opt.gemm_only) fatal_input("--attention-only and --gemm-only: one at a time");
    fileio_check_output("trace", opt.trace, OUTPUT_FILE);  // before the timed steps, and before a SKIP
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
    if (opt.gemm_only) {
        printf("bench_gpu: %s; the linears of model %s\n", device, cfg.name);
        bench_gemms(&cfg, opt.batch, opt.seq_len, opt.steps, opt.warmup);
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
    if (opt.trace) {  // the regions the model marks, and every kernel per stream where CUPTI can record them
        trace_init(0, "rank 0 [gpu 0]");
        char why[256];
        if (gpu_activity_start(why, sizeof why)) printf("trace: every kernel per stream (CUPTI), timings included\n");
        else printf("trace: the marked regions only (per-kernel records off: %s)\n", why);
    }
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
        gpu_activity_stop();
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
