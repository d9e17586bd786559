// matmul.cu: the linear layer's three matmuls through cuBLASLt. gpu/matmul_plan.h maps each onto a
// column-major GEMM (tested on the host); this file turns a plan into cuBLASLt descriptors, asks the
// heuristic for an algorithm once per shape (a shape with none stops the run, naming it), and runs
// it on the compute stream. With LLAMA_CUBLASLT_AUTOTUNE=1 the heuristic's first AUTOTUNE_CANDIDATES
// algorithms are each timed once per shape, on the real operands and a scratch output, and the
// fastest is cached. Off by default: timing noise can pick another algorithm in another run, and
// algorithms sum in different orders, so two runs are bit-identical only without it.
//
//   fp32:  A, B, C in fp32, CUBLAS_COMPUTE_32F: true fp32 arithmetic (no TF32), the reference path.
//   bf16:  A, B in bf16 on the tensor cores, CUBLAS_COMPUTE_32F accumulation; out and dinp stored
//          bf16, dweight stored and accumulated (beta = 1) in fp32. A bf16 output accumulated with
//          beta = 1 (dinp +=, the residual's C) is rounded twice on an H200 (cuBLAS 13.0): the product
//          to bf16, then the sum, as an unfused matmul and add would; tests/gpu/test_gpu_ops.c counts it.
// Two fused forms for the GPU model: the residual in the epilogue (D = A B + C with C the residual
// and D the output: cuBLASLt reads C and writes D, so out = residual + inp W^T costs no add kernel
// and, in bf16, one rounding instead of two), and strided batches (several products of one shape in
// one launch: W1 and W3, whose weights sit at a fixed distance in the parameter table).
#include <cublasLt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/internal.cuh"
#include "gpu/matmul_plan.h"
#include "gpu/ops.h"

#define CUBLAS_CHECK(call)                                                                            \
    do {                                                                                              \
        cublasStatus_t st_ = (call);                                                                  \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                             \
            fatal("cuBLASLt error: %s at %s:%d: %s", #call, __FILE__, __LINE__, cublasLtGetStatusString(st_)); \
    } while (0)

#define WORKSPACE_BYTES ((size_t)32 << 20)  // what cuBLAS recommends for Hopper
#define PLAN_CACHE_SIZE 64
#define AUTOTUNE_CANDIDATES 8
#define AUTOTUNE_RUNS 3

static cublasLtHandle_t handle;
static void *workspace;

// One cached plan: the descriptors and the algorithm the heuristic chose for a shape, types and
// pointer alignments (an algorithm chosen for 256-byte aligned operands may not run on less).
typedef struct {
    int kind, M, K, N;
    cudaDataType ab_type, c_type;
    unsigned align_a, align_b, align_c;
    int batch;
    long long stride_a, stride_b, stride_c;
} PlanKey;
typedef struct {
    PlanKey key;
    bool used;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} PlanEntry;
static PlanEntry cache[PLAN_CACHE_SIZE];
static int next_victim;  // round-robin replacement once the cache is full

static void ensure_handle(void) {
    if (handle) return;
    CUBLAS_CHECK(cublasLtCreate(&handle));
    workspace = gpu_alloc(MEM_OTHER, WORKSPACE_BYTES);
}

static void release(PlanEntry *e) {
    if (!e->used) return;
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->c));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(e->desc));
    e->used = false;
}

// Called by gpu_shutdown (runtime.cu).
static void release_fp8_plans(void);

void gpu_matmul_shutdown(void) {
    for (int i = 0; i < PLAN_CACHE_SIZE; i++) release(&cache[i]);
    release_fp8_plans();
    if (handle) {
        CUBLAS_CHECK(cublasLtDestroy(handle));
        gpu_free(workspace);
    }
    handle = NULL;
    workspace = NULL;
}

static bool autotune(void) {
    static int on = -1;
    if (on < 0) {
        const char *env = getenv("LLAMA_CUBLASLT_AUTOTUNE");
        on = env && *env && strcmp(env, "0") != 0;
    }
    return on;
}

static size_t dtype_bytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

// The bytes a plan's C spans: its (m, n) with leading dimension ldc, for every product of the batch.
static size_t c_extent_bytes(const GemmPlan *p, cudaDataType c_type) {
    return ((size_t)(p->batch - 1) * p->stride_c + (size_t)p->ldc * p->n) * dtype_bytes(c_type);
}

// What cuBLASLt may assume of every product's operand in a batch: the base's alignment, and the
// stride's when the batch moves the pointer on.
static unsigned batch_alignment(const void *base, long long stride, cudaDataType t) {
    unsigned a = ptr_alignment((uintptr_t)base);
    if (stride) {
        unsigned s = ptr_alignment((uintptr_t)(stride * (long long)dtype_bytes(t)));
        if (s < a) a = s;
    }
    return a;
}

static void set_batch(cublasLtMatrixLayout_t layout, int count, long long stride) {
    if (count == 1) return;
    int32_t n = count;
    int64_t offset = stride;
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset,
                                                  sizeof offset));
}

// The fastest of the n candidates, each run once to warm up and then AUTOTUNE_RUNS times between two
// events, with beta = 0 into a scratch output (the real one may be accumulating). Candidates that
// need more workspace than we have, or that fail to launch, are skipped.
static int fastest(const PlanEntry *e, const cublasLtMatmulHeuristicResult_t *r, int n, const void *A, const void *B,
                   size_t c_bytes) {
    void *c = gpu_scratch_alloc(c_bytes);
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    float alpha = 1.0f, beta = 0.0f, best_ms = INFINITY;
    int best = 0;
    for (int i = 0; i < n; i++) {
        if (r[i].workspaceSize > WORKSPACE_BYTES) continue;
        if (cublasLtMatmul(handle, e->desc, &alpha, A, e->a, B, e->b, &beta, c, e->c, c, e->c, &r[i].algo, workspace,
                           WORKSPACE_BYTES, gpu_stream()) != CUBLAS_STATUS_SUCCESS)
            continue;
        CUDA_CHECK(cudaEventRecord(start, gpu_stream()));
        for (int k = 0; k < AUTOTUNE_RUNS; k++)
            CUBLAS_CHECK(cublasLtMatmul(handle, e->desc, &alpha, A, e->a, B, e->b, &beta, c, e->c, c, e->c,
                                        &r[i].algo, workspace, WORKSPACE_BYTES, gpu_stream()));
        CUDA_CHECK(cudaEventRecord(stop, gpu_stream()));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) best_ms = ms, best = i;
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    gpu_scratch_free(c);
    return best;
}

// What every algorithm we take must satisfy: our workspace, the operands' real alignments (the
// heuristic otherwise assumes 256 bytes, and cublasLtMatmul refuses the algorithm on less), and a
// split-K reduction, if any, in fp32 (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): the other schemes add
// the partial sums in the output type, in bf16 a rounding to 8 bits per partial.
static cublasLtMatmulPreference_t preference(unsigned align_a, unsigned align_b, unsigned align_c) {
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = WORKSPACE_BYTES;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    uint32_t align[3] = {align_a, align_b, align_c};
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2], 4));
    uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                      sizeof schemes));
    return pref;
}

static PlanEntry *plan_for(const PlanKey *key, const GemmPlan *p, const void *A, const void *B) {
    for (int i = 0; i < PLAN_CACHE_SIZE; i++)
        if (cache[i].used && memcmp(&cache[i].key, key, sizeof *key) == 0) return &cache[i];
    PlanEntry *e = NULL;
    for (int i = 0; i < PLAN_CACHE_SIZE && !e; i++)
        if (!cache[i].used) e = &cache[i];
    if (!e) {
        e = &cache[next_victim];
        next_victim = (next_victim + 1) % PLAN_CACHE_SIZE;
        release(e);
    }
    e->key = *key;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&e->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_a = p->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = p->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->a, key->ab_type, p->a_rows, p->a_cols, p->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->b, key->ab_type, p->b_rows, p->b_cols, p->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->c, key->c_type, p->m, p->n, p->ldc));
    set_batch(e->a, p->batch, p->stride_a);
    set_batch(e->b, p->batch, p->stride_b);
    set_batch(e->c, p->batch, p->stride_c);  // C and D share this layout

    cublasLtMatmulPreference_t pref = preference(key->align_a, key->align_b, key->align_c);
    cublasLtMatmulHeuristicResult_t results[AUTOTUNE_CANDIDATES];
    int n_results = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, e->desc, e->a, e->b, e->c, e->c, pref,
                                                autotune() ? AUTOTUNE_CANDIDATES : 1, results, &n_results));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0)
        fatal("cuBLASLt has no algorithm for the %s matmul M=%d K=%d N=%d", key->kind == GEMM_FORWARD ? "forward"
              : key->kind == GEMM_BACKWARD_INPUT ? "input-gradient" : "weight-gradient", key->M, key->K, key->N);
    int chosen = n_results > 1 ? fastest(e, results, n_results, A, B, c_extent_bytes(p, key->c_type)) : 0;
    e->algo = results[chosen].algo;
    e->used = true;
    return e;
}

// D = op(A) op(B) + beta C for each product of the plan's batch, with A and B the plan's choice of
// (inp, weight, dout), D = d, and C = c_in (the residual) if given, else d itself.
static void run(GemmKind kind, const GemmPlan &p, int M, int K, int N, const void *inp, const void *weight,
                const void *dout, const void *c_in, void *d, cudaDataType ab_type, cudaDataType c_type) {
    if (!c_in) c_in = d;
    if (p.m == 0 || p.n == 0 || p.batch == 0) return;
    size_t c_bytes = dtype_bytes(c_type);
    if (p.k == 0) {  // an empty sum: D = beta C (zeros, the residual, or D left as it is)
        for (int b = 0; b < p.batch; b++) {
            char *db = (char *)d + b * p.stride_c * c_bytes;
            const char *cb = (const char *)c_in + b * p.stride_c * c_bytes;
            if (p.beta == 0) gpu_fill_bytes(db, 0, (size_t)p.m * p.n * c_bytes);
            else if (cb != db) gpu_copy(db, cb, (size_t)p.m * p.n * c_bytes);
        }
        return;
    }
    ensure_handle();
    const void *operand[3];
    operand[GEMM_INP] = inp, operand[GEMM_WEIGHT] = weight, operand[GEMM_DOUT] = dout;
    const void *A = operand[p.a], *B = operand[p.b];
    PlanKey key;
    memset(&key, 0, sizeof key);  // padding bytes too: keys are compared with memcmp
    key.kind = kind, key.M = M, key.K = K, key.N = N, key.ab_type = ab_type, key.c_type = c_type;
    key.align_a = batch_alignment(A, p.stride_a, ab_type), key.align_b = batch_alignment(B, p.stride_b, ab_type);
    unsigned align_c = batch_alignment(c_in, p.stride_c, c_type), align_d = batch_alignment(d, p.stride_c, c_type);
    key.align_c = align_c < align_d ? align_c : align_d;
    key.batch = p.batch, key.stride_a = p.stride_a, key.stride_b = p.stride_b, key.stride_c = p.stride_c;
    PlanEntry *e = plan_for(&key, &p, A, B);
    float alpha = 1.0f, beta = p.beta;
    CUBLAS_CHECK(cublasLtMatmul(handle, e->desc, &alpha, A, e->a, B, e->b, &beta, c_in, e->c, d, e->c, &e->algo,
                                workspace, WORKSPACE_BYTES, gpu_stream()));
}

// One product, C = D: forward overwrites, backward accumulates unless overwrite.
static void run(GemmKind kind, int M, int K, int N, const void *inp, const void *weight, const void *dout, void *c,
                cudaDataType ab_type, cudaDataType c_type, bool overwrite = false) {
    GemmPlan p = gemm_plan(kind, M, K, N);
    if (overwrite) p.beta = 0;
    run(kind, p, M, K, N, inp, weight, dout, NULL, c, ab_type, c_type);
}

extern "C" void gpu_matmul_forward(float *out, const float *inp, const float *weight, int M, int K, int N) {
    run(GEMM_FORWARD, M, K, N, inp, weight, NULL, out, CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                                    const float *weight, int M, int K, int N) {
    if (dinp) run(GEMM_BACKWARD_INPUT, M, K, N, inp, weight, dout, dinp, CUDA_R_32F, CUDA_R_32F);
    if (dweight) run(GEMM_BACKWARD_WEIGHT, M, K, N, inp, weight, dout, dweight, CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_backward_overwrite(float *dinp, float *dweight, const float *dout, const float *inp,
                                              const float *weight, int M, int K, int N) {
    run(GEMM_BACKWARD_INPUT, M, K, N, inp, weight, dout, dinp, CUDA_R_32F, CUDA_R_32F, true);
    if (dweight) run(GEMM_BACKWARD_WEIGHT, M, K, N, inp, weight, dout, dweight, CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_backward_overwrite_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout,
                                                   const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N) {
    run(GEMM_BACKWARD_INPUT, M, K, N, inp, weight, dout, dinp, CUDA_R_16BF, CUDA_R_16BF, true);
    if (dweight) run(GEMM_BACKWARD_WEIGHT, M, K, N, inp, weight, dout, dweight, CUDA_R_16BF, CUDA_R_32F);
}
extern "C" void gpu_matmul_forward_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K,
                                        int N) {
    run(GEMM_FORWARD, M, K, N, inp, weight, NULL, out, CUDA_R_16BF, CUDA_R_16BF);
}
extern "C" void gpu_matmul_backward_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                                         const gpu_bf16 *weight, int M, int K, int N) {
    if (dinp) run(GEMM_BACKWARD_INPUT, M, K, N, inp, weight, dout, dinp, CUDA_R_16BF, CUDA_R_16BF);
    if (dweight) run(GEMM_BACKWARD_WEIGHT, M, K, N, inp, weight, dout, dweight, CUDA_R_16BF, CUDA_R_32F);
}

// Tensor parallelism's partial sums: bf16 operands, fp32 output (the accumulators unrounded).
extern "C" void gpu_matmul_forward_bf16_into_f32(float *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K,
                                                 int N) {
    run(GEMM_FORWARD, M, K, N, inp, weight, NULL, out, CUDA_R_16BF, CUDA_R_32F);
}
extern "C" void gpu_matmul_backward_input_bf16_into_f32(float *dinp, const gpu_bf16 *dout, const gpu_bf16 *weight,
                                                        int M, int K, int N, bool accumulate) {
    run(GEMM_BACKWARD_INPUT, M, K, N, NULL, weight, dout, dinp, CUDA_R_16BF, CUDA_R_32F, !accumulate);
}

// ---- the fused forms -------------------------------------------------------------------------------------
// out = residual + inp W^T: the residual is cuBLASLt's C, the output its D (beta = 1).
extern "C" void gpu_matmul_forward_residual(float *out, const float *residual, const float *inp, const float *weight,
                                            int M, int K, int N) {
    run(GEMM_FORWARD, gemm_plan_residual(M, K, N), M, K, N, inp, weight, NULL, residual, out, CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_forward_residual_bf16(gpu_bf16 *out, const gpu_bf16 *residual, const gpu_bf16 *inp,
                                                 const gpu_bf16 *weight, int M, int K, int N) {
    run(GEMM_FORWARD, gemm_plan_residual(M, K, N), M, K, N, inp, weight, NULL, residual, out, CUDA_R_16BF,
        CUDA_R_16BF);
}

static GemmBatch batch_of(int count, long long inp_stride, long long weight_stride, long long dout_stride,
                          long long out_stride) {
    GemmBatch b;
    b.count = count;
    b.stride[GEMM_INP] = inp_stride, b.stride[GEMM_WEIGHT] = weight_stride, b.stride[GEMM_DOUT] = dout_stride;
    b.out_stride = out_stride;
    return b;
}
extern "C" void gpu_matmul_forward_batched(float *out, const float *inp, const float *weight, int M, int K, int N,
                                           int batch, long long out_stride, long long inp_stride,
                                           long long weight_stride) {
    GemmBatch b = batch_of(batch, inp_stride, weight_stride, 0, out_stride);
    run(GEMM_FORWARD, gemm_plan_batched(GEMM_FORWARD, M, K, N, &b), M, K, N, inp, weight, NULL, NULL, out,
        CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_forward_batched_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M,
                                                int K, int N, int batch, long long out_stride, long long inp_stride,
                                                long long weight_stride) {
    GemmBatch b = batch_of(batch, inp_stride, weight_stride, 0, out_stride);
    run(GEMM_FORWARD, gemm_plan_batched(GEMM_FORWARD, M, K, N, &b), M, K, N, inp, weight, NULL, NULL, out,
        CUDA_R_16BF, CUDA_R_16BF);
}
extern "C" void gpu_matmul_backward_weight_batched(float *dweight, const float *dout, const float *inp, int M, int K,
                                                   int N, int batch, long long dweight_stride, long long dout_stride,
                                                   long long inp_stride) {
    GemmBatch b = batch_of(batch, inp_stride, 0, dout_stride, dweight_stride);
    run(GEMM_BACKWARD_WEIGHT, gemm_plan_batched(GEMM_BACKWARD_WEIGHT, M, K, N, &b), M, K, N, inp, NULL, dout, NULL,
        dweight, CUDA_R_32F, CUDA_R_32F);
}
extern "C" void gpu_matmul_backward_weight_batched_bf16(float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                                                        int M, int K, int N, int batch, long long dweight_stride,
                                                        long long dout_stride, long long inp_stride) {
    GemmBatch b = batch_of(batch, inp_stride, 0, dout_stride, dweight_stride);
    run(GEMM_BACKWARD_WEIGHT, gemm_plan_batched(GEMM_BACKWARD_WEIGHT, M, K, N, &b), M, K, N, inp, NULL, dout, NULL,
        dweight, CUDA_R_16BF, CUDA_R_32F);
}

// ================================ FP8 GEMMs (gpu/fp8.h) ============================================
// out (rows_a, rows_b) row-major is the column-major (rows_b, rows_a) matrix b a^T: cuBLASLt's A is our
// b (op T: its (K, rows_b) column-major storage read as (rows_b, K)), its B our a (op N), the "TN"
// layout FP8 requires. cuBLASLt scales after the sum: D = alpha * scaleA * scaleB * (A B) + beta C, so
// its scales are the inverses of the cast scales, computed on the device (the cast scales live there).
#include "gpu/fp8.h"

typedef struct {
    bool used;
    int rows_a, rows_b, K;
    Fp8Format fa, fb;
    bool fast_accum;
    unsigned align_a, align_b, align_out;  // of our a, b and out: part of the key, as in PlanKey
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    float *inverse_scales;  // device: [0] for cuBLASLt's A (our b), [SCALE_GAP] for its B (our a)
} Fp8Plan;
#define FP8_PLANS 32
// The two scale pointers 256 bytes apart, each aligned as an allocation is (TransformerEngine's
// scales are separate tensors): one of the things cuBLASLt may check, suspected while it refused these
// GEMMs on an H200 with the scales 4 bytes apart.
#define SCALE_GAP 64
static Fp8Plan fp8_plans[FP8_PLANS];

static cudaDataType fp8_type(Fp8Format f) { return f == FP8_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
static const char *fp8_name(Fp8Format f) { return f == FP8_E4M3 ? "e4m3" : "e5m2"; }

static Fp8Plan *fp8_plan(int rows_a, int rows_b, int K, Fp8Format fa, Fp8Format fb, bool fast_accum,
                         unsigned align_a, unsigned align_b, unsigned align_out) {
    for (int i = 0; i < FP8_PLANS; i++) {
        Fp8Plan *p = &fp8_plans[i];
        if (p->used && p->rows_a == rows_a && p->rows_b == rows_b && p->K == K && p->fa == fa && p->fb == fb &&
            p->fast_accum == fast_accum && p->align_a == align_a && p->align_b == align_b &&
            p->align_out == align_out)
            return p;
    }
    Fp8Plan *p = NULL;
    for (int i = 0; i < FP8_PLANS && !p; i++)
        if (!fp8_plans[i].used) p = &fp8_plans[i];
    if (!p) fatal("gpu_fp8_gemm: more than %d GEMM shapes", FP8_PLANS);
    memset(p, 0, sizeof *p);
    p->used = true, p->rows_a = rows_a, p->rows_b = rows_b, p->K = K, p->fa = fa, p->fb = fb;
    p->fast_accum = fast_accum, p->align_a = align_a, p->align_b = align_b, p->align_out = align_out;
    p->inverse_scales = (float *)gpu_alloc(MEM_OTHER, 2 * SCALE_GAP * sizeof(float));
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    const float *scale_a = p->inverse_scales, *scale_b = p->inverse_scales + SCALE_GAP;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
    int8_t fast = fast_accum ? 1 : 0;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, fp8_type(fb), K, rows_b, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, fp8_type(fa), K, rows_a, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, rows_b, rows_a, rows_b));
    cublasLtMatmulPreference_t pref = preference(align_b, align_a, align_out);
    cublasLtMatmulHeuristicResult_t result;
    int n_results = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &n_results));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0)
        fatal("cuBLASLt has no FP8 algorithm for %s x %s^T, (%d, %d) x (%d, %d)^T", fp8_name(fa), fp8_name(fb),
              rows_a, K, rows_b, K);
    p->algo = result.algo;
    return p;
}

static void release_fp8_plans(void) {
    for (int i = 0; i < FP8_PLANS; i++) {
        Fp8Plan *p = &fp8_plans[i];
        if (!p->used) continue;
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->a));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->b));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->c));
        CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
        gpu_free(p->inverse_scales);
        p->used = false;
    }
}

__global__ void inverse_scales_kernel(float *inverse, const float *scale_b, const float *scale_a) {
    inverse[0] = 1.0f / scale_b[0];
    inverse[SCALE_GAP] = 1.0f / scale_a[0];
}

extern "C" void gpu_fp8_gemm(float *out, const uint8_t *a, Fp8Format fa, const float *scale_a, const uint8_t *b,
                             Fp8Format fb, const float *scale_b, int rows_a, int rows_b, int K, bool accumulate,
                             bool fast_accum) {
    const char *why = gpu_fp8_gemm_shape_error(rows_a, rows_b, K);
    if (why) fatal("gpu_fp8_gemm (%d, %d) x (%d, %d)^T: %s", rows_a, K, rows_b, K, why);
    if (fa == FP8_E5M2 && fb == FP8_E5M2) fatal("gpu_fp8_gemm: E5M2 x E5M2 has no Hopper kernel");
    ensure_handle();
    Fp8Plan *p = fp8_plan(rows_a, rows_b, K, fa, fb, fast_accum, ptr_alignment((uintptr_t)a),
                          ptr_alignment((uintptr_t)b), ptr_alignment((uintptr_t)out));
    GPU_LAUNCH(inverse_scales_kernel, 1, 1, 0, p->inverse_scales, scale_b, scale_a);
    float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasStatus_t st = cublasLtMatmul(handle, p->desc, &alpha, b, p->a, a, p->b, &beta, out, p->c, out, p->c,
                                       &p->algo, workspace, WORKSPACE_BYTES, gpu_stream());
    // The whole call in the message, so that a refusal can be reproduced (CUBLASLT_LOG_LEVEL=5 says why).
    if (st != CUBLAS_STATUS_SUCCESS)
        fatal("gpu_fp8_gemm: cublasLtMatmul %s for %s (%d, %d) x %s (%d, %d)^T into fp32 (beta %g, fast "
              "accumulation %s; alignments a %u, b %u, out %u bytes)", cublasLtGetStatusString(st), fp8_name(fa),
              rows_a, K, fp8_name(fb), rows_b, K, beta, fast_accum ? "on" : "off", p->align_a, p->align_b,
              p->align_out);
}
