// fp8.h: chapter 9's FP8 building blocks on the GPU, with the signatures of chapters/09_fp8/fp8.h's
// host functions on device pointers (x, q, amax, scale: all device memory). The casts are the
// hardware's (cuda_fp8.h's __nv_cvt_float_to_fp8 with saturation: cvt.rn.satfinite), which
// tests/t_fp8_cast.sh shows bit-exact with chapter 9's fp8_from_float; on the CPU emulator they are
// fp8_from_float itself. The amaxes follow fp8_amax: a NaN sticks, and a max is the same in any
// order, so the two-stage per-tensor reduction gives the host's value exactly.
//
//   gpu_fp8_amax(amax, x, rows, cols, FP8_PER_TENSOR);            // device amax[1]
//   ... scale[0] = fp8_scale_from_amax(amax, FP8_E4M3, false) ...  // (host, from the downloaded amax)
//   gpu_fp8_quantize(q, x, rows, cols, FP8_PER_TENSOR, scale, FP8_E4M3);
//
// tests/gpu/test_gpu_fp8.c checks every function against the host's, bit for bit.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "chapters/09_fp8/fp8.h"

// amax (fp8_n_scales of them) = max |x| over what each scale covers (NaN propagates).
void gpu_fp8_amax(float *amax, const float *x, int rows, int cols, Fp8Granularity g);
// q (rows*cols) = fp8(x * scale), to nearest even, saturating.
void gpu_fp8_quantize(uint8_t *q, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                      Fp8Format f);
// x (rows*cols) = q / scale.
void gpu_fp8_dequantize(float *x, const uint8_t *q, int rows, int cols, Fp8Granularity g, const float *scale,
                        Fp8Format f);
// out = dequantize(quantize(x)) in one pass (out may be x): what an emulated FP8 GEMM multiplies.
void gpu_fp8_fake_quantize(float *out, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                           Fp8Format f);

// The cast of the transpose, per tensor: q (cols, rows) = fp8(x^T * scale). The FP8 GEMM takes both
// operands K-major, so the input-gradient GEMM needs W^T and the weight-gradient GEMM dY^T and X^T.
void gpu_fp8_quantize_transposed(uint8_t *q, const float *x, int rows, int cols, const float *scale, Fp8Format f);

// The FP8 GEMM: out (rows_a, rows_b) = (a / scale_a) (b / scale_b)^T, a the (rows_a, K) codes of
// format fa and b the (rows_b, K) codes of fb, both K-major (what Hopper's FP8 tensor cores take:
// cuBLASLt's "TN"), one scale each (device scalars: the scales the operands were cast with),
// accumulated in fp32; out (fp32) overwritten, or added to with accumulate. fast_accum: the tensor
// cores' faster accumulation, for the forward GEMM only (as torchao does). Hopper takes E4M3 x E4M3
// and E4M3 x E5M2, not E5M2 x E5M2. rows_a, rows_b and K must be multiples of 16 (cuBLASLt's FP8
// rule); anything else stops the run (the trainer refuses such shapes before it starts). On the CPU
// emulator (no cuBLASLt): the codes decoded (code / scale) and reference_cpu's fp32 matmul, which is
// chapter 9's emulation.
void gpu_fp8_gemm(float *out, const uint8_t *a, Fp8Format fa, const float *scale_a, const uint8_t *b, Fp8Format fb,
                  const float *scale_b, int rows_a, int rows_b, int K, bool accumulate, bool fast_accum);
// The rule gpu_fp8_gemm enforces: NULL when (rows_a, rows_b, K) are multiples of GPU_FP8_GEMM_MULTIPLE,
// else why not (GPU_FP8_GEMM_RULE).
#define GPU_FP8_GEMM_MULTIPLE 16
#define GPU_FP8_STRINGIFY_(x) #x
#define GPU_FP8_STRINGIFY(x) GPU_FP8_STRINGIFY_(x)
#define GPU_FP8_GEMM_RULE "cuBLASLt's FP8 GEMMs need every dimension a multiple of " GPU_FP8_STRINGIFY(GPU_FP8_GEMM_MULTIPLE)
const char *gpu_fp8_gemm_shape_error(int rows_a, int rows_b, int K);

// ---- the GPU model's FP8 linears (tensorwise) ----------------------------------------------------------
// Chapter 9's FP8 linear with the tensorwise recipe, on activations of the model's type (fp32, or
// bf16 when activations_bf16 is set) and the fp32 master weights. Each GEMM's operands get dynamic scales from
// their amaxes, computed on the device as fp8_scale_from_amax does (no wait for the host); inputs and
// weights E4M3, output gradients E5M2; fast accumulation in the forward only.
// Each operand's amax is MAX-reduced over the GPUs holding the rest of its tensor, so that every GPU
// casts with the scales one GPU holding the whole tensors would use (a NULL group: nobody else).
typedef struct {
    Comm *tokens;      // the GPUs holding the batch's other tokens (dp x cp): x's and dy's other rows
    Comm *x_columns;   // the GPUs holding x's other columns (a row-parallel linear's input under TP)
    Comm *w_parts;     // the GPUs holding the rest of w (its other rows or columns under TP)
    Comm *dy_columns;  // the GPUs holding dy's other columns (a column-parallel linear's output under TP)
} GpuFp8Groups;
//   out (M,N) = x (M,K) w (N,K)^T                       (overwritten)
//   dx (M,K) = or += dy (M,N) w;  dw (N,K) += dy^T x    (dx overwritten when dx_overwrite; either NULL)
void gpu_fp8_linear_forward(void *out, const void *x, const float *w, int M, int K, int N, bool activations_bf16,
                            const GpuFp8Groups *groups);
void gpu_fp8_linear_backward(void *dx, bool dx_overwrite, float *dw, const void *dy, const void *x, const float *w,
                             int M, int K, int N, bool activations_bf16, const GpuFp8Groups *groups);
// Tensor parallelism's partial sums, in fp32 (summed over the tp group by the caller):
//   out (M,N) = x w^T, a row-parallel linear's output;  dx (M,K) = or += dy w, a column-parallel one's
//   input gradient (dx overwritten unless accumulate).
void gpu_fp8_linear_forward_partial(float *out, const void *x, const float *w, int M, int K, int N,
                                    bool activations_bf16, const GpuFp8Groups *groups);
void gpu_fp8_linear_backward_input_partial(float *dx, bool accumulate, const void *dy, const float *w, int M, int K,
                                           int N, bool activations_bf16, const GpuFp8Groups *groups);

#ifdef __cplusplus
}
#endif
