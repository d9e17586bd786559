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
//
// torchtitan's convention, printed next to it so the figures compare with its reports:
//   F_titan = 6 * (parameters less the embedding table; the output projection counts unless tied)
//           + 12 * n_layers * n_heads * head_dim * seq_len
// whose attention term is twice ours: it counts every score, not the causal half.
#pragma once
#include "reference_cpu/config.h"

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

static inline double flops_per_token_torchtitan(const ModelConfig *c, int seq_len) {
    double params = (double)model_param_count_non_embedding(c) + (c->tied ? 0.0 : (double)c->vocab_size * c->dim);
    return 6.0 * params + 12.0 * c->n_layers * c->n_heads * (double)model_head_dim(c) * seq_len;
}

// Attention alone (causal, per layer): forward = QK^T and PV over the causal half of the scores,
// 2 matmuls x 2 FLOPs x B H T^2/2 hd; backward = 2.5x forward (dV, dP, dQ, dK: 4 matmuls, plus
// recomputing S, as FlashAttention's papers count it).
static inline double attention_forward_flops(int B, int n_heads, int T, int head_dim) {
    return 2.0 * B * n_heads * (double)T * T * head_dim;
}
static inline double attention_backward_flops(int B, int n_heads, int T, int head_dim) {
    return 2.5 * attention_forward_flops(B, n_heads, T, head_dim);
}
