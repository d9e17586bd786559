// test_gpu_fp8.c: gpu/fp8.h against chapter 9's host functions (chapters/09_fp8/fp8.h), bit for bit
// (`make test-gpu` on a device; on the CPU emulator in make test). Without a CUDA device (and outside
// the emulator) it prints one SKIP line and exits 0.
//   casts      the cast of a dense sample of fp32 values (every exponent from 2^-37 to 2^32, the top 8
//              mantissa bits in every pattern, tails that make ties and near-ties; both signs; zero,
//              inf, NaN), per tensor, with a scale of 1 and of a non-power of two: the codes equal
//              fp8_quantize's. On a device this is the hardware's cvt.rn.satfinite against
//              fp8_from_float. Both formats.
//   decode     all 256 codes of each format, divided by a scale: equal to fp8_dequantize's.
//   amax       per tensor, per row, per column, on Gaussian matrices with outliers and with a NaN:
//              equal to fp8_amax's (a max is exact, whatever the order).
//   cast-back  fp8_fake_quantize's values, for each granularity with its scales: equal.
//   linear     the three GEMMs of an FP8 linear, tensorwise, composed from these kernels and
//              gpu_fp8_gemm (amaxes, scales, casts -- transposed where the GEMM needs K-major
//              operands -- then the GEMM), against chapter 9's fp8_linear_forward / _backward:
//              the forward exactly on the emulator (the same decoded values, the same matmul); the
//              two gradients there within 1e-5 of each element's sum |a||b| over its products (the
//              same products, summed by another OpenBLAS path: x W^T where the host does dY W); on
//              a device within torchao's 3e-3 of it (the tensor cores' accumulation, fast in the
//              forward). Plain Gaussian operands, so no few outputs set the scale.
//   shapes     gpu_fp8_gemm_shape_error: multiples of 16 pass, anything else is named.
//   tensor parallel (under mpirun, 2 ranks: the only check then) the GPU model's FP8 linears on
//              one rank's shards, the amaxes MAX-reduced over the ranks as gpu/fp8.h's GpuFp8Groups
//              say: a column-parallel linear (W's rows, dY's columns split) and a row-parallel one
//              (W's columns, X's split; the output and the column-parallel input gradient as fp32
//              partial sums), against chapter 9's fp8_linear_* on the same shards with its tp group,
//              with the linear's tolerances above. Without the reductions the scales are the shards'
//              own and the checks fail.
// Every output buffer is poisoned first, so an element a kernel never wrote fails.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/rng.h"
#include "gpu/comm_device.h"
#include "gpu/fp8.h"
#include "tests/gpu/gpu_test_util.h"

static float *to_device(const float *x, size_t n) {
    float *d = gpu_alloc(MEM_OTHER, sizeof(float) * n);
    gpu_upload(d, x, sizeof(float) * n);
    return d;
}

static bool same_bits(const void *a, const void *b, size_t bytes, size_t elem, size_t *first) {
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < bytes; i++)
        if (x[i] != y[i]) {
            *first = i / elem;
            return false;
        }
    return true;
}

// Floats equal bit for bit, or both NaN (a NaN's payload depends on the path it took).
static bool same_floats(const float *a, const float *b, size_t n, size_t *first) {
    for (size_t i = 0; i < n; i++) {
        uint32_t x, y;
        memcpy(&x, &a[i], 4), memcpy(&y, &b[i], 4);
        if (x != y && !(isnan(a[i]) && isnan(b[i]))) {
            *first = i;
            return false;
        }
    }
    return true;
}

static size_t cast_sample(float *out) {
    static const uint32_t tails[] = {0, 1, 0x3FFF, 0x4000, 0x7FFF};
    size_t n = 0;
    for (uint32_t sign = 0; sign < 2; sign++) {
        for (uint32_t biased = 127 - 37; biased <= 127 + 32; biased++)
            for (uint32_t top = 0; top < 256; top++)
                for (size_t t = 0; t < 5; t++) {
                    uint32_t u = sign << 31 | biased << 23 | top << 15 | tails[t];
                    memcpy(&out[n++], &u, 4);
                }
        static const uint32_t special[] = {0, 1, 0x7F800000u, 0x7FC00000u};
        for (int i = 0; i < 4; i++) {
            uint32_t u = sign << 31 | special[i];
            memcpy(&out[n++], &u, 4);
        }
    }
    return n;
}

static void test_casts(void) {
    float *x = malloc(sizeof(float) * 200000);
    size_t n = cast_sample(x);
    float *dx = to_device(x, n);
    uint8_t *want = malloc(n), *got = malloc(n), *dq = gpu_alloc(MEM_OTHER, n);
    const float scales[] = {1.0f, 3.7f};
    for (int fi = 0; fi < 2; fi++)
        for (int si = 0; si < 2; si++) {
            Fp8Format f = (Fp8Format)fi;
            float *dscale = to_device(&scales[si], 1);
            gpu_fill_bytes(dq, 0x5A, n);  // poison
            gpu_fp8_quantize(dq, dx, 1, (int)n, FP8_PER_TENSOR, dscale, f);
            gpu_download(got, dq, n);
            fp8_quantize(want, x, 1, (int)n, FP8_PER_TENSOR, &scales[si], f);
            size_t first = 0;
            bool ok = same_bits(got, want, n, 1, &first);
            char name[64];
            snprintf(name, sizeof name, "cast %s, scale %g", fp8_format_info(f)->name, scales[si]);
            if (ok) report(name, ok, "%zu values, exact", n);
            else report(name, ok, "first difference at %zu: 0x%02x vs 0x%02x", first, got[first], want[first]);
            gpu_free(dscale);
        }
    gpu_free(dq), gpu_free(dx);
    free(x), free(want), free(got);
}

static void test_decode(void) {
    uint8_t codes[256];
    for (int c = 0; c < 256; c++) codes[c] = (uint8_t)c;
    uint8_t *dq = gpu_alloc(MEM_OTHER, 256);
    gpu_upload(dq, codes, 256);
    float scale = 0.3f, want[256], got[256];
    float *dscale = to_device(&scale, 1), *dx = gpu_alloc(MEM_OTHER, sizeof got);
    for (int fi = 0; fi < 2; fi++) {
        Fp8Format f = (Fp8Format)fi;
        gpu_fill_bytes(dx, 0xFF, sizeof got);
        gpu_fp8_dequantize(dx, dq, 1, 256, FP8_PER_TENSOR, dscale, f);
        gpu_download(got, dx, sizeof got);
        fp8_dequantize(want, codes, 1, 256, FP8_PER_TENSOR, &scale, f);
        size_t first = 0;
        bool ok = same_floats(got, want, 256, &first);
        char name[64];
        snprintf(name, sizeof name, "decode %s, every code", fp8_format_info(f)->name);
        report(name, ok, ok ? "exact" : "first difference at code 0x%02zx", first);
    }
    gpu_free(dq), gpu_free(dscale), gpu_free(dx);
}

// A (rows, cols) Gaussian matrix; with_outliers: every 997th element x 1000 (what amax must find);
// with_nan: one NaN.
static float *matrix(int rows, int cols, bool with_outliers, bool with_nan, uint64_t stream) {
    size_t n = (size_t)rows * cols;
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = (float)rng_normal(7, stream, i);
    if (with_outliers)
        for (size_t i = 0; i < n; i += 997) x[i] *= 1000;
    if (with_nan) x[n / 3] = NAN;
    return x;
}

static const char *granularity_name(Fp8Granularity g) {
    return g == FP8_PER_TENSOR ? "per tensor" : g == FP8_PER_ROW ? "per row" : "per column";
}

static void test_amax_and_cast_back(void) {
    const int rows = 37, cols = 300;  // not multiples of the block sizes
    for (int nan_case = 0; nan_case < 2; nan_case++)
        for (int gi = 0; gi < 3; gi++) {
            Fp8Granularity g = (Fp8Granularity)gi;
            float *x = matrix(rows, cols, true, nan_case, 11 + gi), *dx = to_device(x, (size_t)rows * cols);
            int ns = fp8_n_scales(rows, cols, g);
            float *want = malloc(sizeof(float) * ns), *got = malloc(sizeof(float) * ns);
            float *damax = gpu_alloc(MEM_OTHER, sizeof(float) * ns);
            gpu_fill_bytes(damax, 0xFF, sizeof(float) * ns);
            gpu_fp8_amax(damax, dx, rows, cols, g);
            gpu_download(got, damax, sizeof(float) * ns);
            fp8_amax(want, x, rows, cols, g);
            size_t first = 0;
            bool ok = same_floats(got, want, (size_t)ns, &first);
            char name[80];
            snprintf(name, sizeof name, "amax %s%s", granularity_name(g), nan_case ? ", with a NaN" : "");
            if (ok) report(name, ok, "%d amaxes, exact", ns);
            else report(name, ok, "first difference at %zu: %g vs %g", first, got[first], want[first]);
            if (!nan_case) {  // the cast-back with the scales these amaxes give
                float *scale = malloc(sizeof(float) * ns);
                for (int i = 0; i < ns; i++) scale[i] = (float)fp8_scale_from_amax(want[i], FP8_E4M3, g != FP8_PER_TENSOR);
                float *dscale = to_device(scale, (size_t)ns), *dout = gpu_alloc(MEM_OTHER, sizeof(float) * rows * cols);
                float *out_want = malloc(sizeof(float) * rows * cols), *out_got = malloc(sizeof(float) * rows * cols);
                gpu_fill_bytes(dout, 0xFF, sizeof(float) * rows * cols);
                gpu_fp8_fake_quantize(dout, dx, rows, cols, g, dscale, FP8_E4M3);
                gpu_download(out_got, dout, sizeof(float) * rows * cols);
                fp8_fake_quantize(out_want, x, rows, cols, g, scale, FP8_E4M3);
                ok = same_floats(out_got, out_want, (size_t)rows * cols, &first);
                snprintf(name, sizeof name, "cast and back %s", granularity_name(g));
                if (ok) report(name, ok, "exact");
                else report(name, ok, "first difference at %zu: %.9g vs %.9g", first, out_got[first], out_want[first]);
                gpu_free(dscale), gpu_free(dout);
                free(scale), free(out_want), free(out_got);
            }
            gpu_free(dx), gpu_free(damax);
            free(x), free(want), free(got);
        }
}

// A device scalar: the tensorwise scale of x's amax (computed on the device, scaled on the host as
// fp8.c does).
static float *tensorwise_scale(const float *dx, int rows, int cols, Fp8Format f) {
    float *damax = gpu_alloc(MEM_OTHER, sizeof(float)), amax;
    gpu_fp8_amax(damax, dx, rows, cols, FP8_PER_TENSOR);
    gpu_download(&amax, damax, sizeof amax);
    gpu_free(damax);
    float scale = (float)fp8_scale_from_amax(amax, f, false);
    return to_device(&scale, 1);
}

static uint8_t *codes(size_t n) { return gpu_alloc(MEM_OTHER, n); }

// |A| |B| summed the way C (M,N) = A B sums: bound[i,j] = sum_k |a_ik| |b_kj|, with A element (i,k) at
// a[i*a_i + k*a_k] and B element (k,j) at b[k*b_k + j*b_j]. An accumulation-order error of element
// (i,j) is at most a multiple of it, whatever the signs.
static double *abs_product_sums(const float *a, size_t a_i, size_t a_k, const float *b, size_t b_k, size_t b_j,
                                int M, int N, int K) {
    double *bound = malloc(sizeof(double) * M * N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double sum = 0;
            for (int k = 0; k < K; k++) sum += fabs(a[i * a_i + k * a_k]) * fabs(b[k * b_k + j * b_j]);
            bound[(size_t)i * N + j] = sum;
        }
    return bound;
}

// Each element within tol x its |A||B| sum (abs_product_sums). The output was poisoned (NaN) before
// the GEMM, so an element never written fails.
static void compare_linear(const char *name, const float *dgot, const float *want, const double *abs_sums, size_t n,
                           double tol) {
    float *got = malloc(sizeof(float) * n);
    gpu_download(got, dgot, sizeof(float) * n);
    double worst_ratio = 0;
    size_t worst = 0;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]), ratio = abs_sums[i] > 0 ? d / abs_sums[i] : d;
        if (!(d <= tol * abs_sums[i])) ok = false;
        if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = i;
    }
    report(name, ok, "worst |diff| / sum|a||b| %.3g at [%zu] (%.9g vs %.9g; tol %g)", worst_ratio, worst, got[worst],
           want[worst], tol);
    free(got);
}

static float *poisoned(size_t n) {
    float *d = gpu_alloc(MEM_OTHER, sizeof(float) * n);
    gpu_fill_bytes(d, 0xFF, sizeof(float) * n);  // NaN
    return d;
}

// Y (M,N) = X (M,K) W (N,K)^T, dX = dY W, dW = dY^T X: inputs and weights E4M3, output gradient E5M2.
// Plain Gaussian operands: outliers would make a few outputs dominate every bound.
// Tolerances per element, of sum |a||b| over the products the element adds: 0 on the emulator in
// the forward (the same decoded values through the same matmul), 1e-5 in the gradients there (the
// same products summed by another OpenBLAS path: K <= 80 fp32 roundings, each <= 6e-8 of the sum);
// on a device torchao's 3e-3 (the tensor cores' accumulation, fast in the forward).
static void test_linear(bool emulated) {
    const int M = 64, K = 48, N = 80;
    float *x = matrix(M, K, false, false, 31), *w = matrix(N, K, false, false, 32), *dy = matrix(M, N, false, false, 33);
    for (int i = 0; i < N * K; i++) w[i] *= 0.02f;
    Fp8Options o = {FP8_TENSORWISE, 1, 0};
    Fp8 *f = fp8_create(&o, 1, (Fp8Groups){NULL, NULL});
    float *y_want = calloc((size_t)M * N, sizeof(float)), *dx_want = calloc((size_t)M * K, sizeof(float));
    float *dw_want = calloc((size_t)N * K, sizeof(float));
    fp8_linear_forward(f, 0, PROJ_WQ, y_want, x, w, M, K, N);
    fp8_linear_backward(f, 0, PROJ_WQ, dx_want, dw_want, dy, x, w, M, K, N);
    fp8_free(f);
    double *y_sums = abs_product_sums(x, K, 1, w, 1, K, M, N, K);      // X W^T
    double *dx_sums = abs_product_sums(dy, N, 1, w, K, 1, M, K, N);    // dY W
    double *dw_sums = abs_product_sums(dy, 1, N, x, K, 1, N, K, M);    // dY^T X
    double fwd_tol = emulated ? 0 : 3e-3, grad_tol = emulated ? 1e-5 : 3e-3;

    float *dx_ = to_device(x, (size_t)M * K), *dw_ = to_device(w, (size_t)N * K), *ddy = to_device(dy, (size_t)M * N);
    float *sx = tensorwise_scale(dx_, M, K, FP8_E4M3), *sw = tensorwise_scale(dw_, N, K, FP8_E4M3);
    float *sdy = tensorwise_scale(ddy, M, N, FP8_E5M2);
    // forward: x and W as they are (K-major)
    uint8_t *qx = codes((size_t)M * K), *qw = codes((size_t)N * K);
    gpu_fp8_quantize(qx, dx_, M, K, FP8_PER_TENSOR, sx, FP8_E4M3);
    gpu_fp8_quantize(qw, dw_, N, K, FP8_PER_TENSOR, sw, FP8_E4M3);
    float *dy_out = poisoned((size_t)M * N);
    gpu_fp8_gemm(dy_out, qx, FP8_E4M3, sx, qw, FP8_E4M3, sw, M, N, K, false, true);
    compare_linear("fp8 linear forward (fast accumulation)", dy_out, y_want, y_sums, (size_t)M * N, fwd_tol);
    // input gradient: dY (M,N) and W^T (K,N), both N-major
    uint8_t *qdy = codes((size_t)M * N), *qwt = codes((size_t)K * N);
    gpu_fp8_quantize(qdy, ddy, M, N, FP8_PER_TENSOR, sdy, FP8_E5M2);
    gpu_fp8_quantize_transposed(qwt, dw_, N, K, sw, FP8_E4M3);
    float *d_dx = poisoned((size_t)M * K);
    gpu_fp8_gemm(d_dx, qdy, FP8_E5M2, sdy, qwt, FP8_E4M3, sw, M, K, N, false, false);
    compare_linear("fp8 linear input gradient", d_dx, dx_want, dx_sums, (size_t)M * K, grad_tol);
    // weight gradient: dY^T (N,M) and X^T (K,M), both M-major
    uint8_t *qdyt = codes((size_t)N * M), *qxt = codes((size_t)K * M);
    gpu_fp8_quantize_transposed(qdyt, ddy, M, N, sdy, FP8_E5M2);
    gpu_fp8_quantize_transposed(qxt, dx_, M, K, sx, FP8_E4M3);
    float *d_dw = poisoned((size_t)N * K);
    gpu_fp8_gemm(d_dw, qdyt, FP8_E5M2, sdy, qxt, FP8_E4M3, sx, N, K, M, false, false);
    compare_linear("fp8 linear weight gradient", d_dw, dw_want, dw_sums, (size_t)N * K, grad_tol);

    void *owned[] = {dx_, dw_, ddy, sx, sw, sdy, qx, qw, dy_out, qdy, qwt, d_dx, qdyt, qxt, d_dw};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
    free(x), free(w), free(dy), free(y_want), free(dx_want), free(dw_want);
    free(y_sums), free(dx_sums), free(dw_sums);
}

static void test_shape_rule(void) {
    bool ok = gpu_fp8_gemm_shape_error(64, 48, 80) == NULL && gpu_fp8_gemm_shape_error(64, 48, 72) != NULL &&
              gpu_fp8_gemm_shape_error(8, 48, 80) != NULL && gpu_fp8_gemm_shape_error(64, 50, 80) != NULL;
    report("fp8 gemm shape rule (multiples of 16)", ok, "%s", ok ? "as stated" : "wrong");
}

// Columns [c0, c0 + n) of a (rows, cols) row-major matrix, as a (rows, n) one.
static float *columns(const float *a, int rows, int cols, int c0, int n) {
    float *out = malloc(sizeof(float) * rows * n);
    for (int i = 0; i < rows; i++) memcpy(out + (size_t)i * n, a + (size_t)i * cols + c0, sizeof(float) * n);
    return out;
}

// compare_linear on one rank's shard of a tensor-parallel linear's output or gradient.
static void compare_shard(const char *split, int rank, const char *what, const float *dgot, const float *want,
                          const double *abs_sums, size_t n, double tol) {
    char name[96];
    snprintf(name, sizeof name, "fp8 tp %s rank %d %s", split, rank, what);
    compare_linear(name, dgot, want, abs_sums, n, tol);
}

// This rank's shard of a column-parallel (PROJ_WQ) and a row-parallel (PROJ_WO) FP8 linear, on the
// GPU and through chapter 9 with the same tp group (the world), compared as test_linear compares.
static void test_linear_tensor_parallel(bool emulated) {
    Comm *tp = comm_world();
    const int M = 64, K = 64, N = 96, rank = comm_rank(tp), size = comm_size(tp);
    float *x = matrix(M, K, false, false, 41), *w = matrix(N, K, false, false, 42), *dy = matrix(M, N, false, false, 43);
    for (int i = 0; i < N * K; i++) w[i] *= 0.02f;
    double fwd_tol = emulated ? 0 : 3e-3, grad_tol = emulated ? 1e-5 : 3e-3;
    Fp8Options o = {FP8_TENSORWISE, 1, 0};
    Fp8 *f = fp8_create(&o, 1, (Fp8Groups){tp, NULL});

    {  // column-parallel: W's rows [r Nr, (r + 1) Nr), dY's columns likewise; X whole
        int Nr = N / size;
        const float *w_r = w + (size_t)rank * Nr * K;
        float *dy_r = columns(dy, M, N, rank * Nr, Nr);
        float *y_want = calloc((size_t)M * Nr, sizeof(float)), *dx_want = calloc((size_t)M * K, sizeof(float));
        float *dw_want = calloc((size_t)Nr * K, sizeof(float));
        fp8_linear_forward(f, 0, PROJ_WQ, y_want, x, w_r, M, K, Nr);
        fp8_linear_backward(f, 0, PROJ_WQ, dx_want, dw_want, dy_r, x, w_r, M, K, Nr);
        GpuFp8Groups g = {NULL, NULL, tp, tp};
        float *dx_ = to_device(x, (size_t)M * K), *dw_ = to_device(w_r, (size_t)Nr * K), *ddy = to_device(dy_r, (size_t)M * Nr);
        float *d_y = poisoned((size_t)M * Nr), *d_dx = poisoned((size_t)M * K);
        float *d_dw = gpu_alloc(MEM_OTHER, sizeof(float) * Nr * K);
        gpu_fill_bytes(d_dw, 0, sizeof(float) * Nr * K);  // dW accumulates
        gpu_fp8_linear_forward(d_y, dx_, dw_, M, K, Nr, false, &g);
        gpu_fp8_linear_backward_input_partial(d_dx, false, ddy, dw_, M, K, Nr, false, &g);
        gpu_fp8_linear_backward(NULL, false, d_dw, ddy, dx_, dw_, M, K, Nr, false, &g);
        double *y_sums = abs_product_sums(x, K, 1, w_r, 1, K, M, Nr, K);
        double *dx_sums = abs_product_sums(dy_r, Nr, 1, w_r, K, 1, M, K, Nr);
        double *dw_sums = abs_product_sums(dy_r, 1, Nr, x, K, 1, Nr, K, M);
        compare_shard("column-parallel", rank, "output", d_y, y_want, y_sums, (size_t)M * Nr, fwd_tol);
        compare_shard("column-parallel", rank, "dX partial", d_dx, dx_want, dx_sums, (size_t)M * K, grad_tol);
        compare_shard("column-parallel", rank, "dW", d_dw, dw_want, dw_sums, (size_t)Nr * K, grad_tol);
        void *owned[] = {dx_, dw_, ddy, d_y, d_dx, d_dw};
        for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
        free(dy_r), free(y_want), free(dx_want), free(dw_want), free(y_sums), free(dx_sums), free(dw_sums);
    }
    {  // row-parallel: W's columns [r Kr, (r + 1) Kr) and X's likewise; dY whole
        int Kr = K / size;
        float *w_r = columns(w, N, K, rank * Kr, Kr), *x_r = columns(x, M, K, rank * Kr, Kr);
        float *y_want = calloc((size_t)M * N, sizeof(float)), *dx_want = calloc((size_t)M * Kr, sizeof(float));
        float *dw_want = calloc((size_t)N * Kr, sizeof(float));
        fp8_linear_forward(f, 0, PROJ_WO, y_want, x_r, w_r, M, Kr, N);
        fp8_linear_backward(f, 0, PROJ_WO, dx_want, dw_want, dy, x_r, w_r, M, Kr, N);
        GpuFp8Groups g = {NULL, tp, tp, NULL};
        float *dx_ = to_device(x_r, (size_t)M * Kr), *dw_ = to_device(w_r, (size_t)N * Kr), *ddy = to_device(dy, (size_t)M * N);
        float *d_y = poisoned((size_t)M * N), *d_dx = poisoned((size_t)M * Kr), *d_dw = gpu_alloc(MEM_OTHER, sizeof(float) * N * Kr);
        gpu_fill_bytes(d_dw, 0, sizeof(float) * N * Kr);
        gpu_fp8_linear_forward_partial(d_y, dx_, dw_, M, Kr, N, false, &g);
        gpu_fp8_linear_backward(d_dx, true, d_dw, ddy, dx_, dw_, M, Kr, N, false, &g);
        double *y_sums = abs_product_sums(x_r, Kr, 1, w_r, 1, Kr, M, N, Kr);
        double *dx_sums = abs_product_sums(dy, N, 1, w_r, Kr, 1, M, Kr, N);
        double *dw_sums = abs_product_sums(dy, 1, N, x_r, Kr, 1, N, Kr, M);
        compare_shard("row-parallel", rank, "output partial", d_y, y_want, y_sums, (size_t)M * N, fwd_tol);
        compare_shard("row-parallel", rank, "dX", d_dx, dx_want, dx_sums, (size_t)M * Kr, grad_tol);
        compare_shard("row-parallel", rank, "dW", d_dw, dw_want, dw_sums, (size_t)N * Kr, grad_tol);
        void *owned[] = {dx_, dw_, ddy, d_y, d_dx, d_dw};
        for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
        free(w_r), free(x_r), free(y_want), free(dx_want), free(dw_want), free(y_sums), free(dx_sums), free(dw_sums);
    }
    fp8_free(f);
    free(x), free(w), free(dy);
}

int main(int argc, char **argv) {
    if (!gpu_test_start_ranks("test_gpu_fp8", &argc, &argv, false)) return 0;
    char device[256];
    gpu_device_description(device, sizeof device);
    bool emulated = strstr(device, "CPU emulation") != NULL;
    int size = comm_size(comm_world());
    if (size == 1) {
        test_casts();
        test_decode();
        test_amax_and_cast_back();
        test_linear(emulated);
        test_shape_rule();
    } else {
        gpu_comm_backend_init(GPU_COMM_AUTO);
        test_linear_tensor_parallel(emulated);
        gpu_comm_backend_shutdown();
    }
    int failed = n_failed, checks = n_checks;  // over all ranks
    comm_all_reduce(comm_world(), &failed, 1, COMM_INT32, COMM_SUM);
    comm_all_reduce(comm_world(), &checks, 1, COMM_INT32, COMM_SUM);
    n_failed = failed, n_checks = checks;
    int status = comm_rank(comm_world()) == 0 ? gpu_test_finish("test_gpu_fp8") : (gpu_shutdown(), failed ? 1 : 0);
    comm_finalize();
    return status;
}
