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
//          bf16, dweight stored and accumulated (beta = 1) in fp32.
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
void gpu_matmul_shutdown(void) {
    for (int i = 0; i < PLAN_CACHE_SIZE; i++) release(&cache[i]);
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

    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = WORKSPACE_BYTES;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    uint32_t align[3] = {key->align_a, key->align_b, key->align_c};
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], 4));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2], 4));
    cublasLtMatmulHeuristicResult_t results[AUTOTUNE_CANDIDATES];
    int n_results = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, e->desc, e->a, e->b, e->c, e->c, pref,
                                                autotune() ? AUTOTUNE_CANDIDATES : 1, results, &n_results));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0)
        fatal("cuBLASLt has no algorithm for the %s matmul M=%d K=%d N=%d", key->kind == GEMM_FORWARD ? "forward"
              : key->kind == GEMM_BACKWARD_INPUT ? "input-gradient" : "weight-gradient", key->M, key->K, key->N);
    int chosen = n_results > 1 ? fastest(e, results, n_results, A, B, (size_t)p->ldc * p->n * dtype_bytes(key->c_type))
                               : 0;
    e->algo = results[chosen].algo;
    e->used = true;
    return e;
}

// C = op(A) op(B) (+ C when backward, unless overwrite), with A, B, C the plan's choice of (inp,
// weight, dout, c).
static void run(GemmKind kind, int M, int K, int N, const void *inp, const void *weight, const void *dout, void *c,
                cudaDataType ab_type, cudaDataType c_type, bool overwrite = false) {
    GemmPlan p = gemm_plan(kind, M, K, N);
    if (overwrite) p.beta = 0;
    if (p.m == 0 || p.n == 0) return;
    if (p.k == 0) {  // an empty sum: forward writes zeros, backward adds nothing
        if (p.beta == 0) gpu_fill_bytes(c, 0, (size_t)p.m * p.n * (c_type == CUDA_R_32F ? 4 : 2));
        return;
    }
    ensure_handle();
    const void *operand[3];
    operand[GEMM_INP] = inp, operand[GEMM_WEIGHT] = weight, operand[GEMM_DOUT] = dout;
    const void *A = operand[p.a], *B = operand[p.b];
    PlanKey key;
    memset(&key, 0, sizeof key);  // padding bytes too: keys are compared with memcmp
    key.kind = kind, key.M = M, key.K = K, key.N = N, key.ab_type = ab_type, key.c_type = c_type;
    key.align_a = ptr_alignment((uintptr_t)A), key.align_b = ptr_alignment((uintptr_t)B);
    key.align_c = ptr_alignment((uintptr_t)c);
    PlanEntry *e = plan_for(&key, &p, A, B);
    float alpha = 1.0f, beta = p.beta;
    CUBLAS_CHECK(cublasLtMatmul(handle, e->desc, &alpha, A, e->a, B, e->b, &beta, c, e->c, c, e->c, &e->algo,
                                workspace, WORKSPACE_BYTES, gpu_stream()));
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
