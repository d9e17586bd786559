// model.h: the Llama 3 model of reference_cpu/model.h on one GPU, from the kernels of gpu/ops.h:
// the same parameter table (flat layout, names, init from the seed), the same block math in the
// same order, the same loss, AdamW and global-norm clipping. One process, one device: no tensor
// parallelism, no sharding (those stay with the CPU chapters). Activation checkpointing: AC_FULL
// keeps each block's input alone and recomputes the block before its backward (bit-identical
// gradients); AC_SELECTIVE is refused.
//
//   GpuModel m;
//   gpu_model_init(&m, &cfg, seed, GPU_BF16, B, T);
//   gpu_model_zero_grads(&m);
//   double loss = gpu_model_forward(&m, inputs, targets);   // host token arrays (B*T)
//   gpu_model_backward(&m, 1.0);
//   gpu_model_step(&m, step, lr, &adam, 1.0);              // clip to 1.0, then AdamW, on the device
//   double norm = gpu_model_grad_norm(&m);                 // only when it is logged: a wait
//
// With tracing on (common/trace.h), each piece -- embedding, every block, the head, forward and
// backward, and the optimizer step -- is a slice on the GPU timeline (gpu/timeline.h), named as
// reference_cpu's model names its host slices.
//
// Precision. GPU_FP32 computes everything in fp32 (compared with the reference by
// tests/gpu/test_gpu_model.c). GPU_BF16 keeps fp32 master weights, gradients and moments, and a
// bf16 copy of the weights (refreshed by the fused AdamW) that forward and backward read;
// activations are bf16, per-row statistics fp32.
#pragma once
#include <stdint.h>

#include "gpu/ops.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/config.h"
#include "reference_cpu/model.h"  // ActCheckpoint
#include "reference_cpu/params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { GPU_FP32, GPU_BF16 } GpuPrecision;

// Word offsets of one block's tensors in the flat parameter layout.
typedef struct {
    size_t attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
} GpuBlockOffsets;

// What one block keeps from forward for backward (device; activation dtype, stats fp32).
typedef struct {
    void *x, *xn1, *q, *k, *v, *attn, *h, *xn2, *gate, *up, *act;
    float *rstd1, *rstd2, *lse;
} GpuBlockActs;

typedef struct {
    ModelConfig cfg;
    ParamTable table;
    GpuPrecision precision;
    size_t act_size;                  // bytes per activation element: 4 (fp32) or 2 (bf16)
    int B, T;
    ActCheckpoint ac;                 // AC_NONE, or AC_FULL: blocks[l] share block 0's buffers but x
    bool fp8;                         // the blocks' projections as FP8 linears (gpu/fp8.h; set after init)
    struct Comm *fp8_tokens;          // with fp8 under data parallelism: the replicas (amaxes reduced), else NULL
    float *params, *grads, *adam_m, *adam_v;  // (table.total_numel) fp32 on the device
    gpu_bf16 *params_bf16;            // the compute copy (GPU_BF16), else NULL
    RopeTable rope;                   // device copy of reference_cpu's table
    GpuBlockOffsets *offsets;         // (n_layers), host
    size_t tok_embeddings, norm, output;  // offsets; output == tok_embeddings when tied
    GpuBlockActs *blocks;             // (n_layers)
    void *x_final, *xn_final, *logits;
    float *rstd_final, *lse_final;
    // backward scratch, shared by the blocks
    void *dx, *dx_next, *dxn, *dh, *dq, *dk, *dv, *dattn, *dgate, *dup, *dact, *dlogits;
    int *inputs, *targets;            // device copies of the last batch (B*T)
    double *grad_sum_sq;              // device: the last step's gradient sum of squares
} GpuModel;

// Builds the table, initialises the weights exactly as model_init does (on the host, then copied),
// allocates the optimizer state and the activations for batches of B sequences of T tokens. Stops
// (before allocating) if gpu_model_plan_bytes is more than the device's free memory.
void gpu_model_init(GpuModel *m, const ModelConfig *cfg, uint64_t seed, GpuPrecision precision, int B, int T);
// The same with the weights from init (params.h: the seed, or a Hugging Face checkpoint).
void gpu_model_init_from(GpuModel *m, const ModelConfig *cfg, const ParamSource *init, GpuPrecision precision, int B,
                         int T, ActCheckpoint ac);
void gpu_model_free(GpuModel *m);
// The device memory gpu_model_init will allocate (bytes, as gpu_alloc counts them):
// init compares it with the device's free memory and stops with both figures when it does not fit.
size_t gpu_model_plan_bytes(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac);
void gpu_model_zero_grads(GpuModel *m);
// After m->params was written other than by gpu_model_step (a broadcast, a loaded checkpoint): the
// bf16 compute copy is cast again from the fp32 master weights (nothing to do in GPU_FP32).
void gpu_model_refresh_compute_copy(GpuModel *m);
// inputs, targets: host arrays of B*T tokens. Returns the mean loss (waits for the stream).
double gpu_model_forward(GpuModel *m, const int *inputs, const int *targets);
// Accumulates d(dloss * loss)/d(params) into m->grads, for the batch of the last forward.
void gpu_model_backward(GpuModel *m, double dloss);
// As the trainer's step: the global gradient norm, clipping to max_norm (<= 0: none), AdamW -- two
// passes on the device (the sum of squares, then AdamW with the clip folded in) and no wait for the
// host. m->grads are left unscaled.
void gpu_model_step(GpuModel *m, long long step, double lr, const AdamWConfig *adam, double max_norm);
// The last step's gradient norm before clipping (waits for the stream: call it when logging).
double gpu_model_grad_norm(const GpuModel *m);

#ifdef __cplusplus
}
#endif
