// mfu.h: model FLOPs utilisation, as scripts/bench_gpu.sh and gpu/bench_gpu.cu report it.
//
//   model FLOPs per token F = model_flops_per_token(cfg, seq_len)      (reference_cpu/config.h)
//       = 6 * (every weight that takes part in a matmul, the output projection included)
//       + 6 * n_layers * (n_heads * head_dim) * seq_len               (QK^T and PV, causal half)
//   achieved FLOP/s = tokens per second * F
//   MFU = achieved FLOP/s / peak FLOP/s of the device
//
// Model FLOPs, not hardware FLOPs: recomputation (activation checkpointing, attention's backward
// recomputing P) is not credited, so MFU does not improve by doing more work.
#pragma once

#define PEAK_FLOPS_H100_SXM_BF16_DENSE 989e12  // NVIDIA's datasheet, dense (no 2:4 sparsity)

typedef struct {
    double tokens_per_s, flops_per_s, mfu;
} Throughput;

static inline Throughput throughput(double tokens, double seconds, double flops_per_token, double peak_flops) {
    Throughput t;
    t.tokens_per_s = tokens / seconds;
    t.flops_per_s = t.tokens_per_s * flops_per_token;
    t.mfu = t.flops_per_s / peak_flops;
    return t;
}
