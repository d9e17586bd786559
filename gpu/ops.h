// ops.h: the ops of reference_cpu/ops.h (and AdamW) on the GPU, with the same signatures and the
// same semantics: the same argument order, row-major layouts, backward functions ACCUMULATE (+=)
// into their gradient outputs, IGNORE_INDEX targets, positions for causal masking, -inf lse for a
// query row that sees no key. Every pointer is a device pointer (gpu_alloc), except the RopeTable
// and AttnShape structs themselves, which are host structs holding device pointers. Each call is
// queued on gpu_stream() and returns at once; only cross_entropy_forward waits, to return the loss.
//
// Two storage types:
//   float  (no suffix): fp32 in, fp32 arithmetic, fp32 out. The path tests compare with the
//          reference op by op (tests/gpu/test_gpu_ops.c); matmuls through cuBLASLt in true fp32.
//   bf16   (_bf16):  activations and weights stored in bf16, arithmetic and accumulation in fp32,
//          one rounding to bf16 per stored output. Parameter gradients (dweight, dtable) and the
//          per-row statistics (rstd, lse, the loss's max and log-sum) stay fp32; AdamW keeps fp32
//          master weights and moments and can write the bf16 copy the next forward reads.
// The kernels' per-element arithmetic is gpu/numerics.h, tested on the host.
#pragma once
#include <math.h>  // before extern "C": reference_cpu's headers include it, and C++'s must not be C-linked
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#include <cuda_bf16.h>
typedef __nv_bfloat16 gpu_bf16;
extern "C" {
#else
// The same 2 bytes as CUDA's __nv_bfloat16 (C code only passes pointers to it, or fills it with
// gpu/numerics.h's bf16_bits_from_f32).
typedef struct {
    uint16_t bits;
} gpu_bf16;
#endif

#include "reference_cpu/adamw.h"
#include "reference_cpu/ops.h"

// ---- matmul y = x W^T (cuBLASLt) -----------------------------------------------------------------------
// out (M,N) = inp (M,K) . weight (N,K)^T; dinp (M,K) += dout . weight; dweight (N,K) += dout^T . inp.
void gpu_matmul_forward(float *out, const float *inp, const float *weight, int M, int K, int N);
void gpu_matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         int M, int K, int N);
// bf16 operands on the tensor cores, fp32 accumulation; dweight accumulates in fp32.
void gpu_matmul_forward_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N);
// The first writer of dinp: dinp = dout W, overwriting (cuBLASLt's beta = 0), so no zero-fill has to
// come before it; dweight (if not NULL) still accumulates.
void gpu_matmul_backward_overwrite(float *dinp, float *dweight, const float *dout, const float *inp,
                                   const float *weight, int M, int K, int N);
void gpu_matmul_backward_overwrite_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                                        const gpu_bf16 *weight, int M, int K, int N);
void gpu_matmul_backward_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                              const gpu_bf16 *weight, int M, int K, int N);

// The fused forms the GPU model uses (gpu/model.c), the same conventions:
// out (M,N) = residual (M,N) + inp . weight^T: the residual added in the GEMM's epilogue (cuBLASLt's
// beta = 1 with C = residual, D = out; out must not overlap residual unless it is residual), one
// rounding per stored element in bf16.
void gpu_matmul_forward_residual(float *out, const float *residual, const float *inp, const float *weight, int M,
                                 int K, int N);
void gpu_matmul_forward_residual_bf16(gpu_bf16 *out, const gpu_bf16 *residual, const gpu_bf16 *inp,
                                      const gpu_bf16 *weight, int M, int K, int N);
// A strided batch of `batch` products in one launch: product b reads inp + b inp_stride and
// weight + b weight_stride and writes out + b out_stride (strides in elements; 0 gives every product
// the same operand).  out[b] (M,N) = inp[b] (M,K) . weight[b] (N,K)^T.
void gpu_matmul_forward_batched(float *out, const float *inp, const float *weight, int M, int K, int N, int batch,
                                long long out_stride, long long inp_stride, long long weight_stride);
void gpu_matmul_forward_batched_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N,
                                     int batch, long long out_stride, long long inp_stride, long long weight_stride);
// dweight[b] (N,K) += dout[b]^T (N,M) . inp[b] (M,K), strided as above; dweight fp32 in both variants.
void gpu_matmul_backward_weight_batched(float *dweight, const float *dout, const float *inp, int M, int K, int N,
                                        int batch, long long dweight_stride, long long dout_stride,
                                        long long inp_stride);
void gpu_matmul_backward_weight_batched_bf16(float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp, int M, int K,
                                             int N, int batch, long long dweight_stride, long long dout_stride,
                                             long long inp_stride);
// Tensor parallelism's partial sums (gpu/model.c): bf16 operands, the fp32 accumulators stored as
// they are, unrounded, for an fp32 all-reduce over the tp group. out (M,N) = inp . weight^T
// (overwriting); dinp (M,K) = dout . weight, overwriting (accumulate false) or adding (true).
void gpu_matmul_forward_bf16_into_f32(float *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N);
void gpu_matmul_backward_input_bf16_into_f32(float *dinp, const gpu_bf16 *dout, const gpu_bf16 *weight, int M, int K,
                                             int N, bool accumulate);

// ---- embedding ------------------------------------------------------------------------------------------
void gpu_embedding_forward(float *out, const int *tokens, const float *table, int N, int C);
void gpu_embedding_backward(float *dtable, const float *dout, const int *tokens, int N, int C);
void gpu_embedding_forward_rows(float *out, const int *tokens, const float *table, int N, int C, int row_start,
                                int n_rows);
void gpu_embedding_backward_rows(float *dtable, const float *dout, const int *tokens, int N, int C, int row_start,
                                 int n_rows);
void gpu_embedding_forward_bf16(gpu_bf16 *out, const int *tokens, const gpu_bf16 *table, int N, int C);
void gpu_embedding_backward_bf16(float *dtable, const gpu_bf16 *dout, const int *tokens, int N, int C);
// Vocab-parallel (tensor parallelism): the table holds rows [row_start, row_start + n_rows); a token
// outside them gives a zero row. The lookup written in fp32 (the bf16 rows exactly), for the fp32 sum
// over the tp group, in which one rank contributes each row.
void gpu_embedding_forward_rows_bf16_into_f32(float *out, const int *tokens, const gpu_bf16 *table, int N, int C,
                                              int row_start, int n_rows);
void gpu_embedding_backward_rows_bf16(float *dtable, const gpu_bf16 *dout, const int *tokens, int N, int C,
                                      int row_start, int n_rows);

// ---- RMSNorm ----------------------------------------------------------------------------------------------
void gpu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, double eps);
void gpu_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                          const float *rstd, int N, int C);
void gpu_rmsnorm_forward_bf16(gpu_bf16 *out, float *rstd, const gpu_bf16 *inp, const gpu_bf16 *weight, int N, int C,
                              double eps);
void gpu_rmsnorm_backward_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                               const gpu_bf16 *weight, const float *rstd, int N, int C);

// ---- RoPE ------------------------------------------------------------------------------------------------------
// A copy of a host table (reference_cpu's rope_table_build) in device memory; free with gpu_rope_table_free.
RopeTable gpu_rope_table_upload(const RopeTable *host);
void gpu_rope_table_free(RopeTable *t);
// t: a table from gpu_rope_table_upload; positions (T) on the device, or NULL for 0..T-1.
void gpu_rope_forward(float *x, const RopeTable *t, const int *positions, int B, int T, int n_heads);
void gpu_rope_backward(float *dx, const RopeTable *t, const int *positions, int B, int T, int n_heads);
void gpu_rope_forward_bf16(gpu_bf16 *x, const RopeTable *t, const int *positions, int B, int T, int n_heads);
void gpu_rope_backward_bf16(gpu_bf16 *dx, const RopeTable *t, const int *positions, int B, int T, int n_heads);
// The fused QKV projection's output and gradient. qkv (B,T,n_heads + 2 n_kv_heads,head_dim) is what
// one GEMM with [wq; wk; wv] writes: each token's q heads, then its k heads, then its v heads.
// Split: q (B,T,n_heads,hd) = rope(q part), k (B,T,n_kv_heads,hd) = rope(k part), v = the v part,
// overwritten: the contiguous tensors attention takes. Merge (backward, the transpose): dqkv =
// [rope^T(dq) | rope^T(dk) | dv], overwritten: the gradient the fused GEMMs take.
void gpu_qkv_split_rope(float *q, float *k, float *v, const float *qkv, const RopeTable *t, const int *positions,
                        int B, int T, int n_heads, int n_kv_heads);
void gpu_qkv_merge_rope_backward(float *dqkv, const float *dq, const float *dk, const float *dv, const RopeTable *t,
                                 const int *positions, int B, int T, int n_heads, int n_kv_heads);
void gpu_qkv_split_rope_bf16(gpu_bf16 *q, gpu_bf16 *k, gpu_bf16 *v, const gpu_bf16 *qkv, const RopeTable *t,
                             const int *positions, int B, int T, int n_heads, int n_kv_heads);
void gpu_qkv_merge_rope_backward_bf16(gpu_bf16 *dqkv, const gpu_bf16 *dq, const gpu_bf16 *dk, const gpu_bf16 *dv,
                                      const RopeTable *t, const int *positions, int B, int T, int n_heads,
                                      int n_kv_heads);

// ---- attention: FlashAttention-2 (tiled, online softmax, lse kept, P recomputed in backward) --------------
// s->q_pos and s->k_pos are device pointers (or NULL). head_dim <= 128 and even; n_heads a multiple
// of n_kv_heads. lse (B,n_heads,Tq) is fp32 in both variants.
void gpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v, const AttnShape *s);
void gpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                            const float *v, const float *out, const float *lse, const AttnShape *s);
void gpu_attention_forward_bf16(gpu_bf16 *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v,
                                const AttnShape *s);
void gpu_attention_backward_bf16(gpu_bf16 *dq, gpu_bf16 *dk, gpu_bf16 *dv, const gpu_bf16 *dout, const gpu_bf16 *q,
                                 const gpu_bf16 *k, const gpu_bf16 *v, const gpu_bf16 *out, const float *lse,
                                 const AttnShape *s);
// The bf16 pair runs on the tensor cores (gpu/attention_tc.cu: mma.sync with bf16 operands and fp32
// accumulators; P and dS rounded to bf16 before their products, as FlashAttention-2) where
// gpu_attention_bf16_uses_tensor_cores(s) -- head_dim a multiple of 16 -- and every tensor is 16-byte
// aligned; elsewhere on the CUDA cores in fp32 (gpu/attention.cu), which the _simt pair always runs.
bool gpu_attention_bf16_uses_tensor_cores(const AttnShape *s);
// The rows of the tile each tensor-core kernel holds, the side it keeps while streaming the other
// (queries in the forward and dQ kernels, keys in dK/dV): 64 (16 a warp, the default) or 128 (32 a
// warp as two fragments of 16: FlashAttention-2's forward tiling, in which each fragment of the other
// side a warp loads from shared memory serves twice the products). The backward kernels take 128 only
// where head_dim is at most 64 (their 128-wide accumulators would spill). Every choice gives the same
// bits. The default is 64, 64, 128 (forward, dQ, dK/dV): on an H200 at llama3_1b's attention, 16 x 2048,
// the fastest of the four mixes `bench_gpu --attention-only` times (gpu/README.md, *Benchmark*). The
// environment's LLAMA_ATTN_TILE_ROWS sets the starting values: "128" (all three) or "128,128,64"
// (forward, dQ, dK/dV). gpu_init reads the environment's value (a bad one stops the program there,
// exit status 2).
typedef struct {
    int forward, dq, dkdv;
} GpuAttnTileRows;
void gpu_attention_set_tile_rows(GpuAttnTileRows rows);
GpuAttnTileRows gpu_attention_tile_rows(void);
// The same tensor-core kernels with fp32 results: out (written) and dq, dk, dv (accumulated, +=) in
// float, each stored once from the fp32 accumulators; lse as above. For context parallelism's ring,
// which merges its blocks' outputs and sums their gradients in fp32 (gpu/cp_device.h). Only where
// gpu_attention_bf16_uses_tensor_cores(s), with the bf16 tensors 16-byte aligned.
void gpu_attention_forward_bf16_into_f32(float *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k,
                                         const gpu_bf16 *v, const AttnShape *s);
void gpu_attention_backward_bf16_into_f32(float *dq, float *dk, float *dv, const gpu_bf16 *dout, const gpu_bf16 *q,
                                          const gpu_bf16 *k, const gpu_bf16 *v, const gpu_bf16 *out, const float *lse,
                                          const AttnShape *s);
// Ring attention (chapter 8, gpu/cp_device.h), one sequence: folds a block's partial result
// (out_b (nq, H, hd), lse_b (H, nq)) into rows [q0, q0 + nq) of the running (out (Tl, H, hd),
// lse (H, Tl)) through the log-sum-exp (numerics.h's lse_merge), as chapter 8's merge_row does.
void gpu_attention_merge(float *out, float *lse, const float *out_b, const float *lse_b, int q0, int nq, int Tl, int H,
                         int hd);
void gpu_attention_forward_bf16_simt(gpu_bf16 *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k,
                                     const gpu_bf16 *v, const AttnShape *s);
void gpu_attention_backward_bf16_simt(gpu_bf16 *dq, gpu_bf16 *dk, gpu_bf16 *dv, const gpu_bf16 *dout,
                                      const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v, const gpu_bf16 *out,
                                      const float *lse, const AttnShape *s);
// The tensor-core kernels' fragment bookkeeping alone, for tests: one warp loads a and b (16x16 bf16,
// row-major, device) into mma.m16n8k16 fragments as the kernels do and writes (16x16 fp32, device)
// c = a b from b as stored (as V in O = P V), c_t = a b from a transposed copy of b (as K in
// S = Q K^T), and e = bf16(c) b, its A operand taken from c's accumulators (as P in O = P V).
void gpu_attention_tc_fragment_check(float *c, float *c_t, float *e, const gpu_bf16 *a, const gpu_bf16 *b);

// ---- SwiGLU ---------------------------------------------------------------------------------------------------
void gpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void gpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);
void gpu_swiglu_forward_bf16(gpu_bf16 *out, const gpu_bf16 *gate, const gpu_bf16 *up, size_t n);
void gpu_swiglu_backward_bf16(gpu_bf16 *dgate, gpu_bf16 *dup, const gpu_bf16 *dout, const gpu_bf16 *gate,
                              const gpu_bf16 *up, size_t n);

// ---- cross-entropy, mean over targets != IGNORE_INDEX -------------------------------------------------------
// Returns the loss (waits for the stream). A target outside [0, V) other than IGNORE_INDEX ends the
// run with a message (the reference would read out of bounds).
// The backward writes dlogits (ignored rows 0), as the reference's: no fill needed before it.
// stats (N, 2): each row's max and log of its sum of exp(x - max), as the reference's.
double gpu_cross_entropy_forward(float *stats, const float *logits, const int *targets, int N, int V);
void gpu_cross_entropy_backward(float *dlogits, const float *logits, const float *stats, const int *targets, int N,
                                int V, double dloss);
double gpu_cross_entropy_forward_bf16(float *stats, const gpu_bf16 *logits, const int *targets, int N, int V);
void gpu_cross_entropy_backward_bf16(gpu_bf16 *dlogits, const gpu_bf16 *logits, const float *stats,
                                     const int *targets, int N, int V, double dloss);
// The same loss left on the device: *loss (one device double) = the mean, queued, no wait. A target
// outside [0, V) other than IGNORE_INDEX makes it NaN (naming the row would need a wait: check the
// targets where they come from, on the host).
void gpu_cross_entropy_forward_into(double *loss, float *stats, const float *logits, const int *targets, int N, int V);
void gpu_cross_entropy_forward_into_bf16(double *loss, float *stats, const gpu_bf16 *logits, const int *targets, int N,
                                         int V);

// Vocab-parallel cross-entropy (tensor parallelism, gpu/model.c): logits (N, v_count) hold vocabulary
// entries [v_start, v_start + v_count). Three kernels around two all-reduces over the tp group, as
// chapters/06_tensor_parallel/tp.c's loss_forward does on the host:
//   gpu_vocab_parallel_row_max_bf16   row_max (N) = each row's max over this rank's columns   -> all-reduce MAX
//   gpu_vocab_parallel_sums_bf16      sums (2, N) = [sum_j exp(x_nj - row_max_n) (double, as the single
//                                     GPU's kernel sums); x_n,target if this rank holds the target, else 0]
//                                                                                                 -> all-reduce SUM
//   gpu_vocab_parallel_loss           stats (N, 2) = (row_max, log(sum)); *loss (device) = the mean of
//                                     (row_max - target logit) + log(sum) over rows whose target is not
//                                     IGNORE_INDEX
// The same stats and loss as gpu_cross_entropy_forward_into_bf16 on the whole row, up to the sum's order.
void gpu_vocab_parallel_row_max_bf16(float *row_max, const gpu_bf16 *logits, int N, int v_count);
void gpu_vocab_parallel_sums_bf16(double *sums, const gpu_bf16 *logits, const float *row_max, const int *targets,
                                  int N, int v_start, int v_count);
void gpu_vocab_parallel_loss(double *loss, float *stats, const float *row_max, const double *sums, const int *targets,
                             int N);
// dlogits (N, v_count) = dloss / n_valid * (softmax - onehot(target)) on this rank's columns, stats
// being the whole row's: gpu_cross_entropy_backward_bf16's arithmetic, the target's column shifted.
void gpu_cross_entropy_backward_columns_bf16(gpu_bf16 *dlogits, const gpu_bf16 *logits, const float *stats,
                                             const int *targets, int N, int v_start, int v_count, double dloss);

// ---- element-wise -------------------------------------------------------------------------------------------
void gpu_add_inplace(float *x, const float *y, size_t n);  // x += y
void gpu_add_inplace_bf16(gpu_bf16 *x, const gpu_bf16 *y, size_t n);
void gpu_cast_f32_to_bf16(gpu_bf16 *out, const float *inp, size_t n);  // round to nearest even
void gpu_cast_bf16_to_f32(float *out, const gpu_bf16 *inp, size_t n);  // exact
// out = bf16(residual + partial): a row-parallel linear's summed fp32 output added to the residual
// stream with one rounding, as the one-GPU GEMM's residual epilogue rounds once.
void gpu_add_f32_into_bf16(gpu_bf16 *out, const gpu_bf16 *residual, const float *partial, size_t n);

// ---- AdamW (fused: one pass over params, grads, m, v) ---------------------------------------------------------
// The arithmetic of reference_cpu/adamw.c, element by element (gpu/numerics.h: adamw_update).
void gpu_adamw_step(float *params, const float *grads, float *m, float *v, size_t n, long long step, double lr,
                    const AdamWConfig *cfg);
// The same, also writing the updated parameters rounded to bf16 into params_bf16 (the compute copy).
void gpu_adamw_step_bf16_copy(float *params, gpu_bf16 *params_bf16, const float *grads, float *m, float *v, size_t n,
                              long long step, double lr, const AdamWConfig *cfg);

// ---- gradient clipping (reference_cpu/adamw.h) -----------------------------------------------------------------
// Sum of x^2 in double, in a fixed order (a deterministic two-level tree, not the reference's index
// order); waits for the stream to return it.
double gpu_sum_of_squares(const float *x, size_t n);
// The same sum left on the device, in *sum_sq (device memory): queued, no wait.
void gpu_sum_of_squares_into(double *sum_sq, const float *x, size_t n);
void gpu_scale_inplace(float *x, size_t n, double factor);  // x *= (float)factor

// Clipping folded into AdamW: one pass that reads the gradient's global sum of squares from the
// device (*sum_sq, from gpu_sum_of_squares_into) and steps with each gradient as
// clip_by_global_norm would have left it -- times (float)(max_norm / (norm + 1e-6)) when that is
// below 1 (max_norm <= 0: no clipping) -- then AdamW; params_bf16 (or NULL) gets the bf16 copy.
// Nothing waits for the host, and the gradients themselves are left unscaled.
void gpu_adamw_step_clipped(float *params, gpu_bf16 *params_bf16, const float *grads, float *m, float *v, size_t n,
                            long long step, double lr, const AdamWConfig *cfg, const double *sum_sq,
                            double max_norm);

#ifdef __cplusplus
}
#endif
