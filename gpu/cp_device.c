// cp_device.c: the CpCompute tables of device buffers (see cp_device.h). Every entry is queued on the
// compute stream, so the ring's blocks, merges and sums run in order with the transfers comm.h
// orders against that stream.
#include "gpu/cp_device.h"

#include "gpu/fsdp_device.h"
#include "gpu/ops.h"
#include "gpu/runtime.h"

const CpCompute gpu_cp_compute = {&gpu_fsdp_memory, gpu_attention_forward, gpu_attention_backward,
                                  gpu_attention_merge};

// ---- the bf16 model's table -------------------------------------------------------------------------
// Its ring buffers hold bf16 values widened to fp32 (gpu/model.c's staging: exact), so a block's
// operands go back to bf16 without rounding, into one scratch buffer a call, for the tensor-core
// kernels; those store the block's output and gradients in fp32, which the ring merges and sums as
// before. Where the tensor-core kernels do not apply (head_dim not a multiple of 16) the fp32 pair runs.
static size_t q_count(const AttnShape *s) { return (size_t)s->B * s->Tq * s->n_heads * s->head_dim; }
static size_t kv_count(const AttnShape *s) { return (size_t)s->B * s->Tk * s->n_kv_heads * s->head_dim; }

// Each float tensor of `from` as bf16 into consecutive parts of one scratch allocation (parts[i]:
// stream-ordered, not zeroed, since every element is written); every count is a multiple of 16
// elements (head_dim's), so every part stays 16-byte aligned.
static gpu_bf16 *bf16_copies(int n, const float *const *from, const size_t *counts, gpu_bf16 **parts) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += counts[i];
    gpu_bf16 *buf = (gpu_bf16 *)gpu_scratch_alloc(sizeof(gpu_bf16) * total);
    for (size_t i = 0, at = 0; i < (size_t)n; at += counts[i], i++) {
        parts[i] = buf + at;
        gpu_cast_f32_to_bf16(parts[i], from[i], counts[i]);
    }
    return buf;
}

static void tc_block_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                             const AttnShape *s) {
    if (!gpu_attention_bf16_uses_tensor_cores(s)) {
        gpu_attention_forward(out, lse, q, k, v, s);
        return;
    }
    const float *from[] = {q, k, v};
    size_t counts[] = {q_count(s), kv_count(s), kv_count(s)};
    gpu_bf16 *b[3], *buf = bf16_copies(3, from, counts, b);
    gpu_attention_forward_bf16_into_f32(out, lse, b[0], b[1], b[2], s);
    gpu_scratch_free(buf);
}

static void tc_block_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                              const float *v, const float *out, const float *lse, const AttnShape *s) {
    if (!gpu_attention_bf16_uses_tensor_cores(s)) {
        gpu_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, s);
        return;
    }
    const float *from[] = {dout, q, k, v, out};
    size_t counts[] = {q_count(s), q_count(s), kv_count(s), kv_count(s), q_count(s)};
    gpu_bf16 *b[5], *buf = bf16_copies(5, from, counts, b);
    gpu_attention_backward_bf16_into_f32(dq, dk, dv, b[0], b[1], b[2], b[3], b[4], lse, s);
    gpu_scratch_free(buf);
}

const CpCompute gpu_cp_compute_bf16 = {&gpu_fsdp_memory, tc_block_forward, tc_block_backward, gpu_attention_merge};
