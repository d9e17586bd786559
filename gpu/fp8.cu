// fp8.cu: FP8 casts, amaxes and the cast-and-back on the GPU (fp8.h).
#include "gpu/fp8.h"

#include <initializer_list>

#include "gpu/internal.cuh"

extern "C" {
#include "common/comm.h"
}

#ifndef GPU_EMULATOR
#include <cuda_fp8.h>
#endif

// Which scale element (r, c) uses (fp8.c's scale_index).
__device__ __forceinline__ int scale_at(int r, int c, Fp8Granularity g) {
    return g == FP8_PER_TENSOR ? 0 : g == FP8_PER_ROW ? r : c;
}

// The saturating cast and its inverse: the hardware's, or on the emulator chapter 9's own.
__device__ __forceinline__ uint8_t cast_to_fp8(float v, Fp8Format f) {
#ifdef GPU_EMULATOR
    return fp8_from_float(v, f);
#else
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
#endif
}

__device__ __forceinline__ float cast_from_fp8(uint8_t q, Fp8Format f) {
#ifdef GPU_EMULATOR
    return fp8_to_float(q, f);
#else
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, f == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2)));
#endif
}

// fp8.c's max_abs: |x| when larger, or when it is a NaN (which then sticks).
__device__ __forceinline__ float max_abs(float m, float x) {
    float a = fabsf(x);
    return (a > m || isnan(a)) ? a : m;
}

// ---- amax ----------------------------------------------------------------------------------------
// Per row (and stage 1 of per tensor): a block per row, its threads over the columns, then the
// block's lanes combined by max_abs (a NaN sticks whatever the order).
#define AMAX_THREADS 256
template <typename T> __global__ void amax_rows_kernel(float *amax, const T *x, int rows, int cols) {
    __shared__ float partial[AMAX_THREADS];
    const T *row = x + (size_t)blockIdx.x * cols;
    float m = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = max_abs(m, to_f32(row[c]));
    partial[threadIdx.x] = m;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) partial[threadIdx.x] = max_abs(partial[threadIdx.x], partial[threadIdx.x + half]);
        __syncthreads();
    }
    if (threadIdx.x == 0) amax[blockIdx.x] = partial[0];
}

// Per column: a thread per column walks the rows.
__global__ void amax_cols_kernel(float *amax, const float *x, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float m = 0;
    for (int r = 0; r < rows; r++) m = max_abs(m, x[(size_t)r * cols + c]);
    amax[c] = m;
}

// Per tensor, in two stages: each row's amax, then the amax of those.
template <typename T> static void amax_tensor(float *amax, const T *x, int rows, int cols) {
    float *per_row = (float *)gpu_scratch_alloc(sizeof(float) * (size_t)rows);
    GPU_LAUNCH(amax_rows_kernel<T>, rows, AMAX_THREADS, 0, per_row, x, rows, cols);
    GPU_LAUNCH(amax_rows_kernel<float>, 1, AMAX_THREADS, 0, amax, per_row, 1, rows);
    gpu_scratch_free(per_row);
}

void gpu_fp8_amax(float *amax, const float *x, int rows, int cols, Fp8Granularity g) {
    if (rows <= 0 || cols <= 0) return;
    if (g == FP8_PER_COL) {
        GPU_LAUNCH(amax_cols_kernel, (cols + 255) / 256, 256, 0, amax, x, rows, cols);
    } else if (g == FP8_PER_ROW) {
        GPU_LAUNCH(amax_rows_kernel<float>, rows, AMAX_THREADS, 0, amax, x, rows, cols);
    } else {
        amax_tensor(amax, x, rows, cols);
    }
}

// ---- casts ---------------------------------------------------------------------------------------
template <typename T>
__global__ void quantize_kernel(uint8_t *q, const T *x, int rows, int cols, Fp8Granularity g, const float *scale,
                                Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {
        int r = (int)(i / cols), c = (int)(i % cols);
        q[i] = cast_to_fp8(to_f32(x[i]) * scale[scale_at(r, c, g)], f);  // fp32 product, then the cast (fp8.c's order)
    }
}

__global__ void dequantize_kernel(float *x, const uint8_t *q, int rows, int cols, Fp8Granularity g,
                                  const float *scale, Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {
        int r = (int)(i / cols), c = (int)(i % cols);
        x[i] = cast_from_fp8(q[i], f) / scale[scale_at(r, c, g)];
    }
}

__global__ void fake_quantize_kernel(float *out, const float *x, int rows, int cols, Fp8Granularity g,
                                     const float *scale, Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {
        float s = scale[scale_at((int)(i / cols), (int)(i % cols), g)];
        out[i] = fp8_round_to_grid(x[i] * s, f) / s;
    }
}

void gpu_fp8_quantize(uint8_t *q, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                      Fp8Format f) {
    LAUNCH_1D(quantize_kernel<float>, (size_t)rows * cols, q, x, rows, cols, g, scale, f);
}

void gpu_fp8_dequantize(float *x, const uint8_t *q, int rows, int cols, Fp8Granularity g, const float *scale,
                        Fp8Format f) {
    LAUNCH_1D(dequantize_kernel, (size_t)rows * cols, x, q, rows, cols, g, scale, f);
}

void gpu_fp8_fake_quantize(float *out, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                           Fp8Format f) {
    LAUNCH_1D(fake_quantize_kernel, (size_t)rows * cols, out, x, rows, cols, g, scale, f);
}

template <typename T>
__global__ void quantize_transposed_kernel(uint8_t *q, const T *x, int rows, int cols, const float *scale,
                                           Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {  // i indexes q: (cols, rows)
        int c = (int)(i / rows), r = (int)(i % rows);
        q[i] = cast_to_fp8(to_f32(x[(size_t)r * cols + c]) * scale[0], f);
    }
}

void gpu_fp8_quantize_transposed(uint8_t *q, const float *x, int rows, int cols, const float *scale, Fp8Format f) {
    LAUNCH_1D(quantize_transposed_kernel<float>, (size_t)rows * cols, q, x, rows, cols, scale, f);
}

const char *gpu_fp8_gemm_shape_error(int rows_a, int rows_b, int K) {
    if (rows_a % GPU_FP8_GEMM_MULTIPLE || rows_b % GPU_FP8_GEMM_MULTIPLE || K % GPU_FP8_GEMM_MULTIPLE)
        return GPU_FP8_GEMM_RULE;
    return NULL;
}

// ---- the GPU model's FP8 linears --------------------------------------------------------------------
// fp8_scale_from_amax (not rounded to a power of two), on the device: in double, stored as fp32.
__global__ void tensorwise_scale_kernel(float *scale, const float *amax, double format_max) {
    double a = amax[0];
    scale[0] = (float)(format_max / (a > FP8_AMAX_EPS ? a : FP8_AMAX_EPS));
}

// One operand of a GEMM cast per tensor: its amax and scale on the device, its codes (transposed
// when the GEMM contracts over its rows).
template <typename T> struct Cast {
    uint8_t *codes;
    float *scale;  // device: [0] the scale, [1] the amax
};

// Its amax MAX-reduced over a and b, the GPUs holding the rest of the tensor (either NULL): MAX is
// exact, so the order of the two does not matter.
template <typename T>
static Cast<T> cast_operand(const T *x, int rows, int cols, Fp8Format f, bool transposed, Comm *a, Comm *b) {
    Cast<T> c;
    c.scale = (float *)gpu_scratch_alloc(2 * sizeof(float));
    c.codes = (uint8_t *)gpu_scratch_alloc((size_t)rows * cols);
    amax_tensor(c.scale + 1, x, rows, cols);
    for (Comm *g : {a, b})
        if (g && comm_size(g) > 1) comm_all_reduce(g, c.scale + 1, 1, COMM_FLOAT32, COMM_MAX);
    GPU_LAUNCH(tensorwise_scale_kernel, 1, 1, 0, c.scale, c.scale + 1, f == FP8_E4M3 ? 448.0 : 57344.0);
    if (transposed) LAUNCH_1D(quantize_transposed_kernel<T>, (size_t)rows * cols, c.codes, x, rows, cols, c.scale, f);
    else LAUNCH_1D(quantize_kernel<T>, (size_t)rows * cols, c.codes, x, rows, cols, FP8_PER_TENSOR, c.scale, f);
    return c;
}

template <typename T> static void release(Cast<T> *c) {
    gpu_scratch_free(c->codes);
    gpu_scratch_free(c->scale);
}

// out = (overwrite ? 0 : out) + y, in out's type (one rounding to bf16).
template <typename T> __global__ void store_kernel(T *out, const float *y, size_t n, bool overwrite) {
    GRID_STRIDE_LOOP(i, n) out[i] = from_f32<T>(overwrite ? y[i] : to_f32(out[i]) + y[i]);
}

// y (M,N) fp32 = x w^T, overwritten or added to.
template <typename T>
static void forward_gemm(float *y, bool accumulate, const T *x, const float *w, int M, int K, int N, const GpuFp8Groups *g) {
    Cast<T> cx = cast_operand(x, M, K, FP8_E4M3, false, g->tokens, g->x_columns);
    Cast<float> cw = cast_operand(w, N, K, FP8_E4M3, false, g->w_parts, (Comm *)NULL);
    gpu_fp8_gemm(y, cx.codes, FP8_E4M3, cx.scale, cw.codes, FP8_E4M3, cw.scale, M, N, K, accumulate, true);
    release(&cx), release(&cw);
}
// y (M,K) fp32 = dy w (both N-major, w transposed), overwritten or added to.
template <typename T>
static void input_gradient_gemm(float *y, bool accumulate, const T *dy, const float *w, int M, int K, int N,
                                const GpuFp8Groups *g) {
    Cast<T> cdy = cast_operand(dy, M, N, FP8_E5M2, false, g->tokens, g->dy_columns);
    Cast<float> cwt = cast_operand(w, N, K, FP8_E4M3, true, g->w_parts, (Comm *)NULL);
    gpu_fp8_gemm(y, cdy.codes, FP8_E5M2, cdy.scale, cwt.codes, FP8_E4M3, cwt.scale, M, K, N, accumulate, false);
    release(&cdy), release(&cwt);
}

template <typename T>
static void linear_forward(T *out, const T *x, const float *w, int M, int K, int N, const GpuFp8Groups *g) {
    float *y = (float *)gpu_scratch_alloc(sizeof(float) * (size_t)M * N);
    forward_gemm(y, false, x, w, M, K, N, g);
    LAUNCH_1D(store_kernel<T>, (size_t)M * N, out, y, (size_t)M * N, true);
    gpu_scratch_free(y);
}

template <typename T>
static void linear_backward(T *dx, bool dx_overwrite, float *dw, const T *dy, const T *x, const float *w, int M, int K,
                            int N, const GpuFp8Groups *g) {
    if (dx) {  // dX (M,K) = dY (M,N) W (N,K)
        float *y = (float *)gpu_scratch_alloc(sizeof(float) * (size_t)M * K);
        input_gradient_gemm(y, false, dy, w, M, K, N, g);
        LAUNCH_1D(store_kernel<T>, (size_t)M * K, dx, y, (size_t)M * K, dx_overwrite);
        gpu_scratch_free(y);
    }
    if (dw) {  // dW (N,K) += dY^T (N,M) X (M,K): both M-major, both transposed
        Cast<T> cdyt = cast_operand(dy, M, N, FP8_E5M2, true, g->tokens, g->dy_columns);
        Cast<T> cxt = cast_operand(x, M, K, FP8_E4M3, true, g->tokens, g->x_columns);
        gpu_fp8_gemm(dw, cdyt.codes, FP8_E5M2, cdyt.scale, cxt.codes, FP8_E4M3, cxt.scale, N, K, M, true, false);
        release(&cdyt), release(&cxt);
    }
}

void gpu_fp8_linear_forward(void *out, const void *x, const float *w, int M, int K, int N, bool activations_bf16,
                            const GpuFp8Groups *g) {
    if (activations_bf16) linear_forward((bf16 *)out, (const bf16 *)x, w, M, K, N, g);
    else linear_forward((float *)out, (const float *)x, w, M, K, N, g);
}

void gpu_fp8_linear_backward(void *dx, bool dx_overwrite, float *dw, const void *dy, const void *x, const float *w,
                             int M, int K, int N, bool activations_bf16, const GpuFp8Groups *g) {
    if (activations_bf16)
        linear_backward((bf16 *)dx, dx_overwrite, dw, (const bf16 *)dy, (const bf16 *)x, w, M, K, N, g);
    else linear_backward((float *)dx, dx_overwrite, dw, (const float *)dy, (const float *)x, w, M, K, N, g);
}

void gpu_fp8_linear_forward_partial(float *out, const void *x, const float *w, int M, int K, int N,
                                    bool activations_bf16, const GpuFp8Groups *g) {
    if (activations_bf16) forward_gemm(out, false, (const bf16 *)x, w, M, K, N, g);
    else forward_gemm(out, false, (const float *)x, w, M, K, N, g);
}

void gpu_fp8_linear_backward_input_partial(float *dx, bool accumulate, const void *dy, const float *w, int M, int K,
                                           int N, bool activations_bf16, const GpuFp8Groups *g) {
    if (activations_bf16) input_gradient_gemm(dx, accumulate, (const bf16 *)dy, w, M, K, N, g);
    else input_gradient_gemm(dx, accumulate, (const float *)dy, w, M, K, N, g);
}
