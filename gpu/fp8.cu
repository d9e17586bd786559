// fp8.cu: FP8 casts, amaxes and the cast-and-back on the GPU (fp8.h).
#include "gpu/fp8.h"
#include "gpu/internal.cuh"

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
__global__ void amax_rows_kernel(float *amax, const float *x, int rows, int cols) {
    __shared__ float partial[AMAX_THREADS];
    const float *row = x + (size_t)blockIdx.x * cols;
    float m = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = max_abs(m, row[c]);
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

void gpu_fp8_amax(float *amax, const float *x, int rows, int cols, Fp8Granularity g) {
    if (rows <= 0 || cols <= 0) return;
    if (g == FP8_PER_COL) {
        GPU_LAUNCH(amax_cols_kernel, (cols + 255) / 256, 256, 0, amax, x, rows, cols);
    } else if (g == FP8_PER_ROW) {
        GPU_LAUNCH(amax_rows_kernel, rows, AMAX_THREADS, 0, amax, x, rows, cols);
    } else {  // two stages: each row's amax, then the amax of those
        float *per_row = (float *)gpu_scratch_alloc(sizeof(float) * (size_t)rows);
        GPU_LAUNCH(amax_rows_kernel, rows, AMAX_THREADS, 0, per_row, x, rows, cols);
        GPU_LAUNCH(amax_rows_kernel, 1, AMAX_THREADS, 0, amax, per_row, 1, rows);
        gpu_scratch_free(per_row);
    }
}

// ---- casts ---------------------------------------------------------------------------------------
__global__ void quantize_kernel(uint8_t *q, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                                Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {
        int r = (int)(i / cols), c = (int)(i % cols);
        q[i] = cast_to_fp8(x[i] * scale[scale_at(r, c, g)], f);  // fp32 product, then the cast (fp8.c's order)
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
    LAUNCH_1D(quantize_kernel, (size_t)rows * cols, q, x, rows, cols, g, scale, f);
}

void gpu_fp8_dequantize(float *x, const uint8_t *q, int rows, int cols, Fp8Granularity g, const float *scale,
                        Fp8Format f) {
    LAUNCH_1D(dequantize_kernel, (size_t)rows * cols, x, q, rows, cols, g, scale, f);
}

void gpu_fp8_fake_quantize(float *out, const float *x, int rows, int cols, Fp8Granularity g, const float *scale,
                           Fp8Format f) {
    LAUNCH_1D(fake_quantize_kernel, (size_t)rows * cols, out, x, rows, cols, g, scale, f);
}

__global__ void quantize_transposed_kernel(uint8_t *q, const float *x, int rows, int cols, const float *scale,
                                           Fp8Format f) {
    GRID_STRIDE_LOOP(i, (size_t)rows * cols) {  // i indexes q: (cols, rows)
        int c = (int)(i / rows), r = (int)(i % rows);
        q[i] = cast_to_fp8(x[(size_t)r * cols + c] * scale[0], f);
    }
}

void gpu_fp8_quantize_transposed(uint8_t *q, const float *x, int rows, int cols, const float *scale, Fp8Format f) {
    LAUNCH_1D(quantize_transposed_kernel, (size_t)rows * cols, q, x, rows, cols, scale, f);
}

const char *gpu_fp8_gemm_shape_error(int rows_a, int rows_b, int K) {
    if (rows_a % 16 || rows_b % 16 || K % 16)
        return "cuBLASLt's FP8 GEMMs need every dimension a multiple of 16";
    return NULL;
}
