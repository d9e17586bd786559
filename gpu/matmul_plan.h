// matmul_plan.h: how the three matmuls of a linear layer map onto one column-major GEMM, the form
// cuBLAS(Lt) computes:  C (m,n) = alpha op(A) (m,k) . op(B) (k,n) + beta C,  op = identity or ^T.
//
// Our tensors are row-major. A row-major (r, c) matrix with row stride c is, read column-major,
// its transpose (c, r) with leading dimension c. So each row-major product is computed as its
// transpose, with the operands swapped:
//   forward      out (M,N) = inp (M,K) W^T     ->  out^T (N,M) = W (N,K) . inp^T (K,M)
//                A = weight stored (K,N) col-major, op T;   B = inp stored (K,M), op N
//   input grad   dinp (M,K) += dout (M,N) W    ->  dinp^T (K,M) = W^T (K,N) . dout^T (N,M)
//                A = weight stored (K,N), op N;             B = dout stored (N,M), op N
//   weight grad  dW (N,K) += dout^T (N,M) inp  ->  dW^T (K,N) = inp^T (K,M) . dout (M,N)
//                A = inp stored (K,M), op N;                B = dout stored (N,M), op T
// Two variants for the fused GEMMs of the GPU model (gpu/model.c): a strided batch of such products
// (W1 and W3 in one launch, gemm_plan_batched) and the forward with the residual added in the GEMM's
// epilogue (gemm_plan_residual: beta = 1 with C the residual, D the output).
// Pure functions, so tests/test_gpu_host.c runs the plans through a plain column-major GEMM on the
// host and compares with reference_cpu's matmul_forward / matmul_backward.
#pragma once
#include <stdbool.h>

typedef enum { GEMM_FORWARD, GEMM_BACKWARD_INPUT, GEMM_BACKWARD_WEIGHT } GemmKind;
typedef enum { GEMM_INP, GEMM_WEIGHT, GEMM_DOUT } GemmOperand;  // which tensor plays A or B

typedef struct {
    GemmOperand a, b;       // C is the op's output (out, dinp or dweight)
    bool trans_a, trans_b;  // op(A), op(B)
    int m, n, k;            // C is (m,n), the product's inner dimension k
    int a_rows, a_cols, lda;  // A as stored, column-major: (a_rows, a_cols), leading dimension lda
    int b_rows, b_cols, ldb;
    int ldc;                  // C is (m, n) with leading dimension ldc
    float beta;               // 0: overwrite (forward); 1: accumulate (backward, as reference_cpu)
    int batch;                // products in a strided batch (1: one product)
    long long stride_a, stride_b, stride_c;  // elements between one product's A, B, C and the next's
} GemmPlan;

static inline GemmPlan gemm_plan(GemmKind kind, int M, int K, int N) {
    GemmPlan p;
    switch (kind) {
    case GEMM_FORWARD:
        p.a = GEMM_WEIGHT, p.trans_a = true, p.a_rows = K, p.a_cols = N, p.lda = K;
        p.b = GEMM_INP, p.trans_b = false, p.b_rows = K, p.b_cols = M, p.ldb = K;
        p.m = N, p.n = M, p.k = K, p.ldc = N, p.beta = 0;
        break;
    case GEMM_BACKWARD_INPUT:
        p.a = GEMM_WEIGHT, p.trans_a = false, p.a_rows = K, p.a_cols = N, p.lda = K;
        p.b = GEMM_DOUT, p.trans_b = false, p.b_rows = N, p.b_cols = M, p.ldb = N;
        p.m = K, p.n = M, p.k = N, p.ldc = K, p.beta = 1;
        break;
    case GEMM_BACKWARD_WEIGHT:
    default:
        p.a = GEMM_INP, p.trans_a = false, p.a_rows = K, p.a_cols = M, p.lda = K;
        p.b = GEMM_DOUT, p.trans_b = true, p.b_rows = N, p.b_cols = M, p.ldb = N;
        p.m = K, p.n = N, p.k = M, p.ldc = K, p.beta = 1;
        break;
    }
    p.batch = 1, p.stride_a = p.stride_b = p.stride_c = 0;
    return p;
}

// ---- strided batches and residuals ---------------------------------------------------------------------
// A strided batch of `count` products of one shape (cuBLASLt's batch count and strided-batch offsets):
// product b reads each operand at its base + b * its stride and writes its output at base + b *
// out_stride (strides in elements; a stride of 0 hands every product the same operand, as W1 and W3
// share their input xn). Unbatched: count 1, every stride 0.
typedef struct {
    int count;
    long long stride[3];   // by GemmOperand: inp, weight, dout
    long long out_stride;  // out, dinp or dweight
} GemmBatch;

// The plan of one product of the batch, with the batch strides of A, B and C: A and B take the
// strides of the operands the plan chose for them.
static inline GemmPlan gemm_plan_batched(GemmKind kind, int M, int K, int N, const GemmBatch *b) {
    GemmPlan p = gemm_plan(kind, M, K, N);
    p.batch = b->count;
    p.stride_a = b->stride[p.a], p.stride_b = b->stride[p.b], p.stride_c = b->out_stride;
    return p;
}

// The forward with a residual in the epilogue: D = op(A) op(B) + C, C the residual and D the output
// (two tensors: cuBLASLt reads C and writes D), so out = residual + inp W^T in one GEMM.
static inline GemmPlan gemm_plan_residual(int M, int K, int N) {
    GemmPlan p = gemm_plan(GEMM_FORWARD, M, K, N);
    p.beta = 1;
    return p;
}
