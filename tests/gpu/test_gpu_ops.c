// test_gpu_ops.c: every kernel of gpu/ops.h against the reference op of reference_cpu on random
// inputs (`make test-gpu`). Without a CUDA device it prints one SKIP line and exits 0.
//
// A plain program rather than a Check suite: Check forks a process per test, and a CUDA context does
// not survive fork. Each comparison prints one line (PASS/FAIL, the error, the bound); the exit
// status is 1 if any failed. Outputs that a kernel overwrites are poisoned with NaN first, so an
// element it never wrote fails; outputs it accumulates into start from random values, as in the
// reference's contract (+=).
//
// Tolerances, and why (each check names its rule):
//   exact      copies, casts, embedding rows and their gradients (same adds, same order): bit-identical.
//   sum bound  matmuls: two fp32 sums of the same K products, in any order, each lie within
//              gamma_K * sum|terms| of the exact sum (Higham, gamma_K ~ K 2^-24); their difference is
//              bounded by (K + 2) 2^-23 (|x| . |w|) element-wise, computed alongside. Rigorous, so it
//              can only fail on a wrong result. bf16 outputs add their rounding, 2^-8 |ref| (1 ulp).
//   fp32       the other fp32 kernels: same formulas as the reference in a different summation
//              order, and CUDA's expf within 2 ulp of glibc's: |d| <= rtol |ref| + atol max|ref|,
//              with rtol/atol of 1e-5 (element-wise ops) or 1e-4 (attention: sums of up to a few
//              thousand exponentials per element) -- 100x above the expected differences, and 100x
//              below what a masking, indexing or rescaling bug gives (errors of order 1).
//   bf16 norm  bf16 element-wise kernels against the reference on the same bf16-rounded inputs:
//              the only difference is the one rounding of each stored output, at most 2^-8
//              relative (bf16's unit roundoff: 8 significant bits), so ||gpu - ref|| / ||ref|| <=
//              2^-8 (typically 0.4 of that). That norm cannot see a second rounding (an
//              intermediate rounded to bf16, e.g. silu before its product with up: 0.59 of the
//              bound), so each element is also compared with the fp32 reference rounded once to
//              bf16: a kernel that rounds only at the store differs from it only where its fp32
//              value (another summation order, CUDA's expf) and the reference's fall on two sides
//              of a rounding boundary, a few in 10^5 elements; a second rounding moves about a
//              quarter of them. Bound: 1/64 of the elements.
//   FA rule    bf16 attention (FlashAttention's criterion): its error against the fp32 reference on
//              the same bf16 inputs must be at most 2x the error of the same attention computed the
//              plain bf16 way (PyTorch eager order: S, P, O and every gradient rounded to bf16 as
//              separate ops), measured the same way.
//   tc vs simt bf16 attention on the tensor cores against the CUDA-core kernel on the same inputs:
//              ||tc - simt|| / ||simt|| <= 2^-6, four bf16 unit roundoffs (check_vs_simt says which).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"
#include "gpu/numerics.h"
#include "gpu/ops.h"
#include "gpu/runtime.h"
#include "tests/gpu/gpu_test_util.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/ops.h"

// ================================ host data ======================================================

static float *host_normal(size_t n, double std, uint64_t stream) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = (float)(std * rng_normal(1234, stream, i));
    return x;
}
static float *host_copy(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    memcpy(y, x, sizeof(float) * n);
    return y;
}
static void round_to_bf16(float *x, size_t n) {  // in place: the values a bf16 tensor holds
    for (size_t i = 0; i < n; i++) x[i] = bf16_round(x[i]);
}
static float *host_abs(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) y[i] = fabsf(x[i]);
    return y;
}

// ================================ device data ====================================================

static float *dev_f32(const float *host, size_t n) {
    float *d = gpu_alloc(MEM_OTHER, sizeof(float) * n);
    gpu_upload(d, host, sizeof(float) * n);
    return d;
}
static float *dev_f32_poisoned(size_t n) {  // every byte 0xff: every element NaN
    float *d = gpu_alloc(MEM_OTHER, sizeof(float) * n);
    gpu_fill_bytes(d, 0xff, sizeof(float) * n);
    return d;
}
static gpu_bf16 *dev_bf16_poisoned(size_t n) {
    gpu_bf16 *d = gpu_alloc(MEM_OTHER, sizeof(uint16_t) * n);
    gpu_fill_bytes(d, 0xff, sizeof(uint16_t) * n);  // 0xffff is a bf16 NaN
    return d;
}
// host values rounded to bf16, followed by `tail` NaNs: a kernel that reads a row past the tensor's
// end (a tile copy that takes one row too many as inside the sequence) gets NaN into its products.
static gpu_bf16 *dev_bf16_nan_tail(const float *host, size_t n, size_t tail) {
    uint16_t *bits = malloc(sizeof(uint16_t) * (n + tail ? n + tail : 1));
    for (size_t i = 0; i < n; i++) bits[i] = bf16_bits_from_f32(host[i]);
    for (size_t i = n; i < n + tail; i++) bits[i] = 0xffff;
    gpu_bf16 *d = gpu_alloc(MEM_OTHER, sizeof(uint16_t) * (n + tail));
    gpu_upload(d, bits, sizeof(uint16_t) * (n + tail));
    free(bits);
    return d;
}
static gpu_bf16 *dev_bf16(const float *host, size_t n) { return dev_bf16_nan_tail(host, n, 0); }
static int *dev_ints(const int *host, size_t n) {
    int *d = gpu_alloc(MEM_OTHER, sizeof(int) * (n ? n : 1));
    gpu_upload(d, host, sizeof(int) * n);
    return d;
}
static float *from_dev_f32(const float *d, size_t n) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    gpu_download(h, d, sizeof(float) * n);
    return h;
}
static float *from_dev_bf16(const gpu_bf16 *d, size_t n) {  // as floats (exact)
    uint16_t *bits = malloc(sizeof(uint16_t) * (n ? n : 1));
    gpu_download(bits, d, sizeof(uint16_t) * n);
    float *h = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) h[i] = f32_from_bf16_bits(bits[i]);
    free(bits);
    return h;
}

// ================================ comparisons ====================================================

static double max_abs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}

// Element-wise |got - want| <= bound_i, where bound_i = rtol |want_i| + atol + (extra ? extra_i : 0).
// NaN in got fails. Reports the worst element relative to its bound.
static void check_elementwise(const char *name, const float *got, const float *want, size_t n, double rtol,
                              double atol, const float *extra, double extra_scale) {
    double worst_ratio = 0, worst_diff = 0;
    size_t worst = 0;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)got[i] - (double)want[i]);
        double bound = rtol * fabs((double)want[i]) + atol + (extra ? extra_scale * extra[i] : 0);
        double ratio = bound > 0 ? diff / bound : (diff > 0 ? INFINITY : 0);
        if (!(diff <= bound)) ok = false;
        if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = i, worst_diff = diff;  // NaN wins
    }
    report(name, ok, "worst [%zu] got %.9g want %.9g |d| %.3g (%.3g of its bound)", worst, n ? got[worst] : 0.0,
           n ? want[worst] : 0.0, worst_diff, worst_ratio);
}
// The fp32 rule: rtol relative, atol relative to the tensor's largest element.
static void check_fp32(const char *name, const float *got, const float *want, size_t n, double tol) {
    check_elementwise(name, got, want, n, tol, tol * max_abs(want, n), NULL, 0);
}
static void check_exact(const char *name, const float *got, const float *want, size_t n) {
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) bad = i;
    if (bad == n) report(name, true, "bit-identical, %zu elements", n);
    else report(name, false, "first difference [%zu]: got %.9g want %.9g", bad, got[bad], want[bad]);
}
#define BF16_NORM_TOL 0x1p-8
#define BF16_ONCE_SHARE (1.0 / 64)
static void check_bf16_norm(const char *name, const float *got, const float *want, size_t n) {
    double e = rel_l2(got, want, n);
    size_t moved = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (f32_as_bits(got[i]) != f32_as_bits(bf16_round(want[i])) && moved++ == 0) first = i;
    double share = n ? (double)moved / (double)n : 0;
    char where[96] = "";
    if (moved) snprintf(where, sizeof where, "; first [%zu] got %.9g, once-rounded %.9g", first, got[first], bf16_round(want[first]));
    report(name, e <= BF16_NORM_TOL && share <= BF16_ONCE_SHARE,
           "||d||/||ref|| = %.3g (bound %.3g); %zu of %zu not the reference rounded once (bound %.3g%%)%s", e,
           BF16_NORM_TOL, moved, n, 100 * BF16_ONCE_SHARE, where);
}
static void check_fa_rule(const char *name, const float *gpu, const float *baseline, const float *ref, size_t n) {
    double e_gpu = rel_l2(gpu, ref, n), e_base = rel_l2(baseline, ref, n);
    report(name, e_gpu <= 2 * e_base, "error %.3g, plain bf16 error %.3g (bound 2x)", e_gpu, e_base);
}

// ================================ casts ==========================================================

static void test_casts(void) {
    // Every bf16 value (kept half) with the dropped halves that decide the rounding.
    static const uint32_t dropped[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
    size_t nd = sizeof dropped / sizeof dropped[0], n = 65536 * nd;
    float *x = malloc(sizeof(float) * n);
    for (uint32_t kept = 0; kept < 65536; kept++)
        for (size_t d = 0; d < nd; d++) x[kept * nd + d] = f32_from_bits(kept << 16 | dropped[d]);
    float *dx = dev_f32(x, n);
    gpu_bf16 *db = dev_bf16_poisoned(n);
    // n - 5 values (n is a multiple of 8): the last 3 through the one-element tail of the vector
    // kernel, and the 5 after them left as they were (the poison 0xffff).
    size_t cast = n - 5;
    gpu_cast_f32_to_bf16(db, dx, cast);
    uint16_t *bits = malloc(sizeof(uint16_t) * n);
    gpu_download(bits, db, sizeof(uint16_t) * n);
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (bits[i] != (i < cast ? bf16_bits_from_f32(x[i]) : 0xffff)) bad = i;
    if (bad == n) report("cast f32->bf16 (cvt.rn vs numerics.h)", true, "bit-identical on %zu values, none written past them", cast);
    else report("cast f32->bf16 (cvt.rn vs numerics.h)", false, "0x%08x -> 0x%04x, expected 0x%04x",
                f32_as_bits(x[bad]), bits[bad], bad < cast ? bf16_bits_from_f32(x[bad]) : 0xffff);

    // bf16 -> f32 is exact: every one of the 65536 bit patterns comes back as its top half (a NaN
    // as some NaN: the hardware may quieten its payload).
    for (uint32_t b = 0; b < 65536; b++) bits[b] = (uint16_t)b;
    gpu_bf16 *all = gpu_alloc(MEM_OTHER, sizeof(uint16_t) * 65536);
    gpu_upload(all, bits, sizeof(uint16_t) * 65536);
    float *back = dev_f32_poisoned(65536);
    gpu_cast_bf16_to_f32(back, all, 65536);
    float *got = from_dev_f32(back, 65536);
    uint32_t wrong = 65536;
    for (uint32_t b = 0; b < 65536 && wrong == 65536; b++) {
        float want = f32_from_bf16_bits((uint16_t)b);
        if (isnan(want) ? !isnan(got[b]) : f32_as_bits(got[b]) != f32_as_bits(want)) wrong = b;
    }
    if (wrong == 65536) report("cast bf16->f32", true, "exact on all 65536 bf16 values");
    else report("cast bf16->f32", false, "0x%04x -> 0x%08x", wrong, f32_as_bits(got[wrong]));
    free(x), free(bits), free(got);
    gpu_free(dx), gpu_free(db), gpu_free(back), gpu_free(all);
}

// ================================ matmul =========================================================

// (K + 2) 2^-23 (|x| . |w|): twice the worst-case error of an fp32 sum of K products in any order,
// plus the final rounding of the accumulate. Computed with the reference on absolute values.
static float *sum_bound_forward(const float *inp, const float *weight, int M, int K, int N) {
    float *ai = host_abs(inp, (size_t)M * K), *aw = host_abs(weight, (size_t)N * K), *b = malloc(sizeof(float) * M * N);
    matmul_forward(b, ai, aw, M, K, N);
    free(ai), free(aw);
    return b;
}

static void test_matmul(bool bf16) {
    // Not multiples of any tile size; K and N multiples of 8 (leading dimensions of 16 bytes in bf16,
    // which the tensor-core kernels need, as every Llama shape satisfies), M odd.
    int M = 193, K = 328, N = 264;
    size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N;
    // The weight is read at an offset of W_OFFSET elements: 32 (fp32) or 16 (bf16) bytes aligned,
    // not the 256 cuBLASLt assumes unless told, so the plan's alignment preferences are exercised.
    enum { W_OFFSET = 8 };
    float *x = host_normal(nx, 1.0, 1), *w = host_normal(nw + W_OFFSET, 0.05, 2), *dy = host_normal(ny, 1.0, 3);
    float *dx0 = host_normal(nx, 0.1, 4), *dw0 = host_normal(nw, 0.1, 5);
    if (bf16) round_to_bf16(x, nx), round_to_bf16(w, nw + W_OFFSET), round_to_bf16(dy, ny), round_to_bf16(dx0, nx);
    const float *w_host = w + W_OFFSET;
    float *y_ref = malloc(sizeof(float) * ny), *dx_ref = host_copy(dx0, nx), *dw_ref = host_copy(dw0, nw);
    matmul_forward(y_ref, x, w_host, M, K, N);
    matmul_backward(dx_ref, dw_ref, dy, x, w_host, M, K, N);
    float *fwd_bound = sum_bound_forward(x, w_host, M, K, N);
    // Bounds of the backward sums: |dy| . |W| (over N) and |dy|^T . |x| (over M), plus |init|.
    float *ady = host_abs(dy, ny), *ax = host_abs(x, nx), *aw = host_abs(w_host, nw);
    float *dx_bound = host_abs(dx0, nx), *dw_bound = host_abs(dw0, nw);
    matmul_backward(dx_bound, dw_bound, ady, ax, aw, M, K, N);
    // The overwriting backward (beta = 0) into a poisoned dinp: dout W alone, bounded by |dy| . |W|.
    float *dx_set_ref = calloc(nx, sizeof(float)), *dx_set_bound = calloc(nx, sizeof(float));
    matmul_backward(dx_set_ref, NULL, dy, x, w_host, M, K, N);
    matmul_backward(dx_set_bound, NULL, ady, ax, aw, M, K, N);
    float *y, *dx, *dw, *dx_set;
    char name[64];
    const char *tag = bf16 ? "bf16" : "f32";
    if (!bf16) {
        float *d_x = dev_f32(x, nx), *d_w = dev_f32(w, nw + W_OFFSET), *d_dy = dev_f32(dy, ny);
        float *d_y = dev_f32_poisoned(ny), *d_dx = dev_f32(dx0, nx), *d_dw = dev_f32(dw0, nw);
        float *d_dx_set = dev_f32_poisoned(nx);
        gpu_matmul_forward(d_y, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_backward(d_dx, d_dw, d_dy, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_backward_overwrite(d_dx_set, NULL, d_dy, d_x, d_w + W_OFFSET, M, K, N);
        y = from_dev_f32(d_y, ny), dx = from_dev_f32(d_dx, nx), dw = from_dev_f32(d_dw, nw);
        dx_set = from_dev_f32(d_dx_set, nx);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dx), gpu_free(d_dw);
        gpu_free(d_dx_set);
    } else {
        gpu_bf16 *d_x = dev_bf16(x, nx), *d_w = dev_bf16(w, nw + W_OFFSET), *d_dy = dev_bf16(dy, ny);
        gpu_bf16 *d_y = dev_bf16_poisoned(ny), *d_dx = dev_bf16(dx0, nx), *d_dx_set = dev_bf16_poisoned(nx);
        float *d_dw = dev_f32(dw0, nw);
        gpu_matmul_forward_bf16(d_y, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_backward_bf16(d_dx, d_dw, d_dy, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_backward_overwrite_bf16(d_dx_set, NULL, d_dy, d_x, d_w + W_OFFSET, M, K, N);
        y = from_dev_bf16(d_y, ny), dx = from_dev_bf16(d_dx, nx), dw = from_dev_f32(d_dw, nw);
        dx_set = from_dev_bf16(d_dx_set, nx);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dx), gpu_free(d_dw);
        gpu_free(d_dx_set);
    }
    double out_rtol = bf16 ? 0x1p-8 : 0x1p-23;  // the stored output's rounding
    snprintf(name, sizeof name, "matmul %s forward (sum bound)", tag);
    check_elementwise(name, y, y_ref, ny, out_rtol, 0, fwd_bound, (K + 2) * 0x1p-23);
    // Accumulating into a bf16 dinp, cuBLASLt rounds twice: dinp = bf16(bf16(dout W) + dinp) (seen on
    // an H200, cuBLAS 13.0: where dinp and the product cancel, the result is that expression bit for
    // bit, e.g. bf16(bf16(-0.340653) + 0.339844) = 0 for a true -0.000809). The product's own rounding
    // adds at most bf16's unit roundoff of it, 2^-8 |dout W| (the fp32 reference, dx_set_ref).
    if (bf16)
        for (size_t i = 0; i < nx; i++)
            dx_bound[i] = (float)((N + 2) * 0x1p-23 * dx_bound[i] + 0x1p-8 * fabsf(dx_set_ref[i]));
    snprintf(name, sizeof name, "matmul %s dinp (sum bound)", tag);
    check_elementwise(name, dx, dx_ref, nx, out_rtol, 0, dx_bound, bf16 ? 1.0 : (N + 2) * 0x1p-23);
    snprintf(name, sizeof name, "matmul %s dweight (sum bound)", tag);
    check_elementwise(name, dw, dw_ref, nw, 0x1p-23, 0, dw_bound, (M + 2) * 0x1p-23);
    snprintf(name, sizeof name, "matmul %s dinp overwritten (sum bound)", tag);
    check_elementwise(name, dx_set, dx_set_ref, nx, out_rtol, 0, dx_set_bound, (N + 2) * 0x1p-23);
    free(dx_set), free(dx_set_ref), free(dx_set_bound);
    free(x), free(w), free(dy), free(dx0), free(dw0), free(y_ref), free(dx_ref), free(dw_ref), free(fwd_bound);
    free(ady), free(ax), free(aw), free(dx_bound), free(dw_bound), free(y), free(dx), free(dw);
}

// The fused forms of gpu/model.c: the residual in the GEMM's epilogue (out = r + x W^T, against the
// reference's matmul then add), a strided batch of two forward products whose weights sit a gap
// apart (W1 and W3 with w2 between them) and share their input, and the batched weight gradient into
// the same layout, whose gap must stay untouched. Same sum bounds as above; the residual adds one
// rounding (fp32: 2^-22 |ref| covers both roundings; bf16: one rounding of the stored sum).
static void test_matmul_fused(bool bf16) {
    int M = 67, K = 72, N = 40, batch = 2;
    enum { W_OFFSET = 8 };  // read 32 (fp32) or 16 (bf16) bytes aligned, as in test_matmul
    long long w_stride = 2LL * N * K;  // one weight, then a gap of the same size (w2), then the next
    size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N, nw_all = W_OFFSET + w_stride + nw;
    float *x = host_normal(nx, 1.0, 60), *w = host_normal(nw_all, 0.05, 61), *r = host_normal(ny, 1.0, 62);
    float *dy = host_normal(batch * ny, 1.0, 63), *dw0 = host_normal(nw_all, 0.1, 64);
    if (bf16) round_to_bf16(x, nx), round_to_bf16(w, nw_all), round_to_bf16(r, ny), round_to_bf16(dy, batch * ny);
    const float *w_host = w + W_OFFSET;
    // References: the reference's matmul then add; each product of the batch on its own.
    float *res_ref = malloc(sizeof(float) * ny), *res_bound = sum_bound_forward(x, w_host, M, K, N);
    matmul_forward(res_ref, x, w_host, M, K, N);
    for (size_t i = 0; i < ny; i++) res_ref[i] += r[i];
    float *bat_ref = malloc(sizeof(float) * batch * ny), *bat_bound = malloc(sizeof(float) * batch * ny);
    float *dw_ref = host_copy(dw0, nw_all), *dw_bound = host_abs(dw0, nw_all);
    float *ax = host_abs(x, nx), *ady = host_abs(dy, batch * ny);
    for (int b = 0; b < batch; b++) {
        matmul_forward(bat_ref + b * ny, x, w_host + b * w_stride, M, K, N);
        float *bound = sum_bound_forward(x, w_host + b * w_stride, M, K, N);
        memcpy(bat_bound + b * ny, bound, sizeof(float) * ny);
        free(bound);
        matmul_backward(NULL, dw_ref + W_OFFSET + b * w_stride, dy + b * ny, x, NULL, M, K, N);
        matmul_backward(NULL, dw_bound + W_OFFSET + b * w_stride, ady + b * ny, ax, NULL, M, K, N);
    }
    float *res, *bat, *dw;
    if (!bf16) {
        float *d_x = dev_f32(x, nx), *d_w = dev_f32(w, nw_all), *d_r = dev_f32(r, ny), *d_dy = dev_f32(dy, batch * ny);
        float *d_res = dev_f32_poisoned(ny), *d_bat = dev_f32_poisoned(batch * ny), *d_dw = dev_f32(dw0, nw_all);
        gpu_matmul_forward_residual(d_res, d_r, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_forward_batched(d_bat, d_x, d_w + W_OFFSET, M, K, N, batch, (long long)ny, 0, w_stride);
        gpu_matmul_backward_weight_batched(d_dw + W_OFFSET, d_dy, d_x, M, K, N, batch, w_stride, (long long)ny, 0);
        res = from_dev_f32(d_res, ny), bat = from_dev_f32(d_bat, batch * ny), dw = from_dev_f32(d_dw, nw_all);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_r), gpu_free(d_dy), gpu_free(d_res), gpu_free(d_bat), gpu_free(d_dw);
    } else {
        gpu_bf16 *d_x = dev_bf16(x, nx), *d_w = dev_bf16(w, nw_all), *d_r = dev_bf16(r, ny);
        gpu_bf16 *d_dy = dev_bf16(dy, batch * ny), *d_res = dev_bf16_poisoned(ny);
        gpu_bf16 *d_bat = dev_bf16_poisoned(batch * ny);
        float *d_dw = dev_f32(dw0, nw_all);
        gpu_matmul_forward_residual_bf16(d_res, d_r, d_x, d_w + W_OFFSET, M, K, N);
        gpu_matmul_forward_batched_bf16(d_bat, d_x, d_w + W_OFFSET, M, K, N, batch, (long long)ny, 0, w_stride);
        gpu_matmul_backward_weight_batched_bf16(d_dw + W_OFFSET, d_dy, d_x, M, K, N, batch, w_stride, (long long)ny, 0);
        res = from_dev_bf16(d_res, ny), bat = from_dev_bf16(d_bat, batch * ny), dw = from_dev_f32(d_dw, nw_all);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_r), gpu_free(d_dy), gpu_free(d_res), gpu_free(d_bat), gpu_free(d_dw);
    }
    const char *tag = bf16 ? "bf16" : "f32";
    char name[80];
    // bf16: the product x W (bat_ref's first product) may be rounded before the residual is added, as
    // in test_matmul's dinp (+=).
    if (bf16)
        for (size_t i = 0; i < ny; i++)
            res_bound[i] = (float)((K + 2) * 0x1p-23 * res_bound[i] + 0x1p-8 * fabsf(bat_ref[i]));
    snprintf(name, sizeof name, "matmul %s forward + residual (sum bound)", tag);
    check_elementwise(name, res, res_ref, ny, bf16 ? 0x1p-8 : 0x1p-22, 0, res_bound, bf16 ? 1.0 : (K + 2) * 0x1p-23);
    snprintf(name, sizeof name, "matmul %s forward, batch of 2 (sum bound)", tag);
    check_elementwise(name, bat, bat_ref, batch * ny, bf16 ? 0x1p-8 : 0x1p-23, 0, bat_bound, (K + 2) * 0x1p-23);
    // The whole weight-gradient buffer: the two gradients within the sum bound, the gap and the
    // leading offset untouched (their bound is |dw0| 2^-23 alone: only exact values pass).
    snprintf(name, sizeof name, "matmul %s dweight, batch of 2 (sum bound)", tag);
    check_elementwise(name, dw, dw_ref, nw_all, 0x1p-23, 0, dw_bound, (M + 2) * 0x1p-23);
    free(x), free(w), free(r), free(dy), free(dw0), free(res_ref), free(res_bound), free(bat_ref), free(bat_bound);
    free(dw_ref), free(dw_bound), free(ax), free(ady), free(res), free(bat), free(dw);
}

// ================================ embedding ======================================================

static void test_embedding(void) {
    // N >> V: many repeated tokens, whose gradients add in order; V = 130 rows make tiles of 3 rows
    // (the kernel splits the table into EMBED_BWD_TILES = 64), the last of them shorter
    int N = 900, C = 96, V = 130;
    int *tokens = malloc(sizeof(int) * N);
    for (int n = 0; n < N; n++) tokens[n] = (int)rng_below(7, 1, n, V);
    float *table = host_normal((size_t)V * C, 1.0, 10), *dout = host_normal((size_t)N * C, 1.0, 11);
    float *dtable0 = host_normal((size_t)V * C, 1.0, 12);
    int *d_tokens = dev_ints(tokens, N);
    float *d_table = dev_f32(table, (size_t)V * C), *d_dout = dev_f32(dout, (size_t)N * C);

    float *ref = malloc(sizeof(float) * N * C), *d_out = dev_f32_poisoned((size_t)N * C);
    embedding_forward(ref, tokens, table, N, C);
    gpu_embedding_forward(d_out, d_tokens, d_table, N, C);
    float *got = from_dev_f32(d_out, (size_t)N * C);
    check_exact("embedding f32 forward", got, ref, (size_t)N * C);
    free(got);

    // Vocab-parallel shard: rows [10, 30) of the table.
    gpu_fill_bytes(d_out, 0xff, sizeof(float) * N * C);
    embedding_forward_rows(ref, tokens, table + 10 * C, N, C, 10, 20);
    gpu_embedding_forward_rows(d_out, d_tokens, d_table + 10 * C, N, C, 10, 20);
    got = from_dev_f32(d_out, (size_t)N * C);
    check_exact("embedding f32 forward (rows 10..29)", got, ref, (size_t)N * C);
    free(got);

    float *dref = host_copy(dtable0, (size_t)V * C), *d_dtable = dev_f32(dtable0, (size_t)V * C);
    embedding_backward(dref, dout, tokens, N, C);
    gpu_embedding_backward(d_dtable, d_dout, d_tokens, N, C);
    got = from_dev_f32(d_dtable, (size_t)V * C);
    check_exact("embedding f32 backward", got, dref, (size_t)V * C);
    free(got);

    gpu_upload(d_dtable, dtable0, sizeof(float) * V * C);
    memcpy(dref, dtable0, sizeof(float) * V * C);
    embedding_backward_rows(dref, dout, tokens, N, C, 10, 20);
    gpu_embedding_backward_rows(d_dtable, d_dout, d_tokens, N, C, 10, 20);
    got = from_dev_f32(d_dtable, (size_t)V * C);
    check_exact("embedding f32 backward (rows 10..29)", got, dref, (size_t)V * C);
    free(got);

    // bf16: the table's rows are copied exactly; dout is read as bf16, dtable accumulates in fp32.
    round_to_bf16(table, (size_t)V * C);
    round_to_bf16(dout, (size_t)N * C);
    gpu_bf16 *b_table = dev_bf16(table, (size_t)V * C), *b_out = dev_bf16_poisoned((size_t)N * C);
    gpu_bf16 *b_dout = dev_bf16(dout, (size_t)N * C);
    embedding_forward(ref, tokens, table, N, C);
    gpu_embedding_forward_bf16(b_out, d_tokens, b_table, N, C);
    got = from_dev_bf16(b_out, (size_t)N * C);
    check_exact("embedding bf16 forward", got, ref, (size_t)N * C);
    free(got);
    gpu_upload(d_dtable, dtable0, sizeof(float) * V * C);
    memcpy(dref, dtable0, sizeof(float) * V * C);
    embedding_backward(dref, dout, tokens, N, C);
    gpu_embedding_backward_bf16(d_dtable, b_dout, d_tokens, N, C);
    got = from_dev_f32(d_dtable, (size_t)V * C);
    check_exact("embedding bf16 backward (fp32 dtable)", got, dref, (size_t)V * C);
    free(got);

    free(tokens), free(table), free(dout), free(dtable0), free(ref), free(dref);
    gpu_free(d_tokens), gpu_free(d_table), gpu_free(d_dout), gpu_free(d_out), gpu_free(d_dtable);
    gpu_free(b_table), gpu_free(b_out), gpu_free(b_dout);
}

// ================================ RMSNorm ========================================================

// A check's name from a format with one int (a static buffer: used before the next call).
static const char *check_name(const char *format, int value) {
    static char buffer[128];
    snprintf(buffer, sizeof buffer, format, value);
    return buffer;
}

// C not a multiple of the block: the strided loops' tails. C = 1000: rows read in 16-byte packs
// (ops.cu's row kernels); C = 1001: rows that do not start aligned, read element by element.
static void test_rmsnorm(bool bf16, int C) {
    int N = 67;
    size_t n = (size_t)N * C;
    double eps = 1e-5;
    float *x = host_normal(n, 2.0, 20), *w = host_normal(C, 1.0, 21), *dy = host_normal(n, 1.0, 22);
    float *dx0 = host_normal(n, 1.0, 23), *dw0 = host_normal(C, 1.0, 24);
    if (bf16) round_to_bf16(x, n), round_to_bf16(w, C), round_to_bf16(dy, n), round_to_bf16(dx0, n);
    float *y_ref = malloc(sizeof(float) * n), *rstd_ref = malloc(sizeof(float) * N);
    float *dx_ref = host_copy(dx0, n), *dw_ref = host_copy(dw0, C);
    rmsnorm_forward(y_ref, rstd_ref, x, w, N, C, eps);
    rmsnorm_backward(dx_ref, dw_ref, dy, x, w, rstd_ref, N, C);
    float *d_rstd = dev_f32_poisoned(N), *d_dw = dev_f32(dw0, C), *y, *dx;
    if (!bf16) {
        float *d_x = dev_f32(x, n), *d_w = dev_f32(w, C), *d_dy = dev_f32(dy, n), *d_y = dev_f32_poisoned(n);
        float *d_dx = dev_f32(dx0, n);
        gpu_rmsnorm_forward(d_y, d_rstd, d_x, d_w, N, C, eps);
        gpu_rmsnorm_backward(d_dx, d_dw, d_dy, d_x, d_w, d_rstd, N, C);
        y = from_dev_f32(d_y, n), dx = from_dev_f32(d_dx, n);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dx);
    } else {
        gpu_bf16 *d_x = dev_bf16(x, n), *d_w = dev_bf16(w, C), *d_dy = dev_bf16(dy, n), *d_y = dev_bf16_poisoned(n);
        gpu_bf16 *d_dx = dev_bf16(dx0, n);
        gpu_rmsnorm_forward_bf16(d_y, d_rstd, d_x, d_w, N, C, eps);
        gpu_rmsnorm_backward_bf16(d_dx, d_dw, d_dy, d_x, d_w, d_rstd, N, C);
        y = from_dev_bf16(d_y, n), dx = from_dev_bf16(d_dx, n);
        gpu_free(d_x), gpu_free(d_w), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dx);
    }
    float *rstd = from_dev_f32(d_rstd, N), *dw = from_dev_f32(d_dw, C);
    if (!bf16) {
        check_fp32(check_name("rmsnorm f32 C=%d forward", C), y, y_ref, n, 1e-5);
        check_fp32(check_name("rmsnorm f32 C=%d dinp", C), dx, dx_ref, n, 1e-5);
    } else {
        check_bf16_norm(check_name("rmsnorm bf16 C=%d forward", C), y, y_ref, n);
        check_bf16_norm(check_name("rmsnorm bf16 C=%d dinp", C), dx, dx_ref, n);
    }
    check_fp32(check_name(bf16 ? "rmsnorm bf16 C=%d rstd (fp32)" : "rmsnorm f32 C=%d rstd", C), rstd, rstd_ref, N, 1e-6);
    check_fp32(check_name(bf16 ? "rmsnorm bf16 C=%d dweight (fp32)" : "rmsnorm f32 C=%d dweight", C), dw, dw_ref, C, 1e-5);
    free(x), free(w), free(dy), free(dx0), free(dw0), free(y_ref), free(rstd_ref), free(dx_ref), free(dw_ref);
    free(y), free(dx), free(rstd), free(dw);
    gpu_free(d_rstd), gpu_free(d_dw);
}

// ================================ RoPE ===========================================================

// RoPE in place on the device over x (n floats, as bf16 or fp32), the tensor placed `offset` elements
// into its allocation (1: not 16-byte aligned, the pair-by-pair path); the result as floats.
static float *rope_on_device(bool bf16, size_t offset, const float *x, size_t n, const RopeTable *table,
                             const int *d_pos, int B, int T, int H, bool backward) {
    float *x_at = calloc(n + offset, sizeof(float)), *got;
    memcpy(x_at + offset, x, sizeof(float) * n);
    if (!bf16) {
        float *d = dev_f32(x_at, n + offset);
        if (backward) gpu_rope_backward(d + offset, table, d_pos, B, T, H);
        else gpu_rope_forward(d + offset, table, d_pos, B, T, H);
        got = from_dev_f32(d + offset, n);
        gpu_free(d);
    } else {
        gpu_bf16 *d = dev_bf16(x_at, n + offset);
        if (backward) gpu_rope_backward_bf16(d + offset, table, d_pos, B, T, H);
        else gpu_rope_forward_bf16(d + offset, table, d_pos, B, T, H);
        got = from_dev_bf16(d + offset, n);
        gpu_free(d);
    }
    free(x_at);
    return got;
}

static void test_rope(bool bf16) {
    int B = 2, T = 37, H = 5, hd = 64;
    RopeTable host_table = rope_table_build(128, hd, 500000.0, 8.0, 1.0, 4.0, 64);
    RopeTable table = gpu_rope_table_upload(&host_table);
    int positions[37];
    for (int t = 0; t < T; t++) positions[t] = (int)rng_below(7, 2, t, 128);
    int *d_positions = dev_ints(positions, T);
    size_t n = (size_t)B * T * H * hd;
    for (int with_positions = 0; with_positions < 2; with_positions++)
        for (int backward = 0; backward < 2; backward++) {
            float *x = host_normal(n, 1.0, 30 + 2 * with_positions + backward);
            if (bf16) round_to_bf16(x, n);
            float *ref = host_copy(x, n), *got;
            const int *pos = with_positions ? positions : NULL, *d_pos = with_positions ? d_positions : NULL;
            if (backward) rope_backward(ref, &host_table, pos, B, T, H);
            else rope_forward(ref, &host_table, pos, B, T, H);
            got = rope_on_device(bf16, 0, x, n, &table, d_pos, B, T, H, backward);
            float *got_odd = rope_on_device(bf16, 1, x, n, &table, d_pos, B, T, H, backward);
            char name[64];
            snprintf(name, sizeof name, "rope %s %s%s", bf16 ? "bf16" : "f32", backward ? "backward" : "forward",
                     with_positions ? " (positions)" : "");
            if (bf16) check_bf16_norm(name, got, ref, n);
            else check_fp32(name, got, ref, n, 1e-5);
            snprintf(name, sizeof name, "rope %s %s pair by pair = packed%s", bf16 ? "bf16" : "f32",
                     backward ? "backward" : "forward", with_positions ? " (positions)" : "");
            check_exact(name, got_odd, got, n);
            free(x), free(ref), free(got), free(got_odd);
        }
    gpu_free(d_positions);
    gpu_rope_table_free(&table);
    rope_table_free(&host_table);
}

// The device's QKV split of `fused` and merge of `parts` (q|k|v gradients), every device tensor placed
// `offset` elements into its allocation; out = q|k|v and merged come back as floats.
static void qkv_on_device(bool bf16, size_t offset, const float *fused, const float *parts, const RopeTable *table,
                          const int *d_pos, int B, int T, int H, int KV, int hd, float **out, float **merged) {
    size_t tokens = (size_t)B * T, nq = tokens * H * hd, nk = tokens * KV * hd, nf = nq + 2 * nk;
    float *fused_at = calloc(nf + offset, sizeof(float)), *parts_at = calloc(nf + offset, sizeof(float));
    memcpy(fused_at + offset, fused, sizeof(float) * nf), memcpy(parts_at + offset, parts, sizeof(float) * nf);
    if (!bf16) {
        float *d_fused = dev_f32(fused_at, nf + offset), *d_parts = dev_f32(parts_at, nf + offset);
        float *d_out = dev_f32_poisoned(nf + offset), *d_merged = dev_f32_poisoned(nf + offset);
        float *o = d_out + offset, *p = d_parts + offset;
        gpu_qkv_split_rope(o, o + nq, o + nq + nk, d_fused + offset, table, d_pos, B, T, H, KV);
        gpu_qkv_merge_rope_backward(d_merged + offset, p, p + nq, p + nq + nk, table, d_pos, B, T, H, KV);
        *out = from_dev_f32(o, nf), *merged = from_dev_f32(d_merged + offset, nf);
        gpu_free(d_fused), gpu_free(d_parts), gpu_free(d_out), gpu_free(d_merged);
    } else {
        gpu_bf16 *d_fused = dev_bf16(fused_at, nf + offset), *d_parts = dev_bf16(parts_at, nf + offset);
        gpu_bf16 *d_out = dev_bf16_poisoned(nf + offset), *d_merged = dev_bf16_poisoned(nf + offset);
        gpu_bf16 *o = d_out + offset, *p = d_parts + offset;
        gpu_qkv_split_rope_bf16(o, o + nq, o + nq + nk, d_fused + offset, table, d_pos, B, T, H, KV);
        gpu_qkv_merge_rope_backward_bf16(d_merged + offset, p, p + nq, p + nq + nk, table, d_pos, B, T, H, KV);
        *out = from_dev_bf16(o, nf), *merged = from_dev_bf16(d_merged + offset, nf);
        gpu_free(d_fused), gpu_free(d_parts), gpu_free(d_out), gpu_free(d_merged);
    }
    free(fused_at), free(parts_at);
}

// The fused QKV layout (B,T,H + 2 KV,hd) split into q, k (rotated) and v, and merged back from their
// gradients (rotated back): against the reference's copies and rope_forward / rope_backward. v is a
// copy (exact); q and k follow RoPE's rule. The kernels' packed path (16-byte vectors) and their pair
// by pair path (unaligned tensors) must agree bit for bit.
static void test_qkv_split_merge(bool bf16) {
    int B = 2, T = 37, H = 4, KV = 2, hd = 32;
    RopeTable host_table = rope_table_build(128, hd, 500000.0, 8.0, 1.0, 4.0, 64);
    RopeTable table = gpu_rope_table_upload(&host_table);
    int positions[37];
    for (int t = 0; t < T; t++) positions[t] = (int)rng_below(7, 5, t, 128);
    int *d_positions = dev_ints(positions, T);
    size_t tokens = (size_t)B * T, nq = tokens * H * hd, nk = tokens * KV * hd, nf = nq + 2 * nk;
    size_t row = (size_t)(H + 2 * KV) * hd;  // one token's fused heads
    for (int with_positions = 0; with_positions < 2; with_positions++) {
        const int *pos = with_positions ? positions : NULL, *d_pos = with_positions ? d_positions : NULL;
        float *fused = host_normal(nf, 1.0, 70 + with_positions), *parts = host_normal(nf, 1.0, 72 + with_positions);
        if (bf16) round_to_bf16(fused, nf), round_to_bf16(parts, nf);
        const float *dq = parts, *dk = parts + nq, *dv = parts + nq + nk;
        // split reference: the token's q heads, k heads, v heads copied out, then RoPE on q and k
        float *q_ref = malloc(sizeof(float) * nq), *k_ref = malloc(sizeof(float) * nk), *v_ref = malloc(sizeof(float) * nk);
        for (size_t t = 0; t < tokens; t++) {
            memcpy(q_ref + t * H * hd, fused + t * row, sizeof(float) * H * hd);
            memcpy(k_ref + t * KV * hd, fused + t * row + H * hd, sizeof(float) * KV * hd);
            memcpy(v_ref + t * KV * hd, fused + t * row + (H + KV) * hd, sizeof(float) * KV * hd);
        }
        rope_forward(q_ref, &host_table, pos, B, T, H);
        rope_forward(k_ref, &host_table, pos, B, T, KV);
        // merge reference: dq, dk rotated back, then each token's heads laid out as the fused GEMM's
        float *dq_rot = host_copy(dq, nq), *dk_rot = host_copy(dk, nk), *merged_ref = malloc(sizeof(float) * nf);
        rope_backward(dq_rot, &host_table, pos, B, T, H);
        rope_backward(dk_rot, &host_table, pos, B, T, KV);
        for (size_t t = 0; t < tokens; t++) {
            memcpy(merged_ref + t * row, dq_rot + t * H * hd, sizeof(float) * H * hd);
            memcpy(merged_ref + t * row + H * hd, dk_rot + t * KV * hd, sizeof(float) * KV * hd);
            memcpy(merged_ref + t * row + (H + KV) * hd, dv + t * KV * hd, sizeof(float) * KV * hd);
        }
        // On the device twice: every tensor 16-byte aligned (the packed path: head_dim 32 divides by a
        // pack), then every tensor one element into its allocation (the pair-by-pair path).
        float *out, *merged, *out_odd, *merged_odd;
        qkv_on_device(bf16, 0, fused, parts, &table, d_pos, B, T, H, KV, hd, &out, &merged);
        qkv_on_device(bf16, 1, fused, parts, &table, d_pos, B, T, H, KV, hd, &out_odd, &merged_odd);
        float *q = out, *k = out + nq, *v = out + nq + nk;
        const char *tag = bf16 ? "bf16" : "f32", *with = with_positions ? " (positions)" : "";
        char name[80];
        snprintf(name, sizeof name, "qkv split %s q%s", tag, with);
        if (bf16) check_bf16_norm(name, q, q_ref, nq);
        else check_fp32(name, q, q_ref, nq, 1e-5);
        snprintf(name, sizeof name, "qkv split %s k%s", tag, with);
        if (bf16) check_bf16_norm(name, k, k_ref, nk);
        else check_fp32(name, k, k_ref, nk, 1e-5);
        snprintf(name, sizeof name, "qkv split %s v%s", tag, with);
        check_exact(name, v, v_ref, nk);
        snprintf(name, sizeof name, "qkv merge %s dqkv%s", tag, with);
        if (bf16) check_bf16_norm(name, merged, merged_ref, nf);
        else check_fp32(name, merged, merged_ref, nf, 1e-5);
        snprintf(name, sizeof name, "qkv split %s pair by pair = packed%s", tag, with);
        check_exact(name, out_odd, out, nf);
        snprintf(name, sizeof name, "qkv merge %s pair by pair = packed%s", tag, with);
        check_exact(name, merged_odd, merged, nf);
        free(fused), free(parts), free(q_ref), free(k_ref), free(v_ref), free(dq_rot), free(dk_rot), free(merged_ref);
        free(out), free(merged), free(out_odd), free(merged_odd);
    }
    gpu_free(d_positions);
    gpu_rope_table_free(&table);
    rope_table_free(&host_table);
}

// ================================ SwiGLU, add ====================================================

static void test_elementwise(bool bf16) {
    size_t n = 100003;  // not a multiple of the block
    float *gate = host_normal(n, 3.0, 40), *up = host_normal(n, 1.0, 41), *dy = host_normal(n, 1.0, 42);
    float *dg0 = host_normal(n, 1.0, 43), *du0 = host_normal(n, 1.0, 44);
    if (bf16) round_to_bf16(gate, n), round_to_bf16(up, n), round_to_bf16(dy, n), round_to_bf16(dg0, n),
        round_to_bf16(du0, n);
    float *y_ref = malloc(sizeof(float) * n), *dg_ref = host_copy(dg0, n), *du_ref = host_copy(du0, n);
    float *sum_ref = host_copy(dg0, n);
    swiglu_forward(y_ref, gate, up, n);
    swiglu_backward(dg_ref, du_ref, dy, gate, up, n);
    add_inplace(sum_ref, up, n);
    float *y, *dg, *du, *sum;
    if (!bf16) {
        float *d_g = dev_f32(gate, n), *d_u = dev_f32(up, n), *d_dy = dev_f32(dy, n), *d_y = dev_f32_poisoned(n);
        float *d_dg = dev_f32(dg0, n), *d_du = dev_f32(du0, n), *d_sum = dev_f32(dg0, n);
        gpu_swiglu_forward(d_y, d_g, d_u, n);
        gpu_swiglu_backward(d_dg, d_du, d_dy, d_g, d_u, n);
        gpu_add_inplace(d_sum, d_u, n);
        y = from_dev_f32(d_y, n), dg = from_dev_f32(d_dg, n), du = from_dev_f32(d_du, n), sum = from_dev_f32(d_sum, n);
        gpu_free(d_g), gpu_free(d_u), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dg), gpu_free(d_du), gpu_free(d_sum);
        check_fp32("swiglu f32 forward", y, y_ref, n, 1e-5);
        check_fp32("swiglu f32 dgate", dg, dg_ref, n, 1e-5);
        check_fp32("swiglu f32 dup", du, du_ref, n, 1e-5);
        check_exact("add_inplace f32", sum, sum_ref, n);
        // One element in: no pointer is 16-byte aligned, so only the scalar kernel runs.
        float *d_x1 = dev_f32(dg0, n), *d_u1 = dev_f32(up, n);
        gpu_add_inplace(d_x1 + 1, d_u1 + 1, n - 1);
        float *sum1 = from_dev_f32(d_x1, n);
        sum_ref[0] = dg0[0];
        check_exact("add_inplace f32 unaligned", sum1, sum_ref, n);
        free(sum1);
        gpu_free(d_x1), gpu_free(d_u1);
    } else {
        gpu_bf16 *d_g = dev_bf16(gate, n), *d_u = dev_bf16(up, n), *d_dy = dev_bf16(dy, n), *d_y = dev_bf16_poisoned(n);
        gpu_bf16 *d_dg = dev_bf16(dg0, n), *d_du = dev_bf16(du0, n), *d_sum = dev_bf16(dg0, n);
        gpu_swiglu_forward_bf16(d_y, d_g, d_u, n);
        gpu_swiglu_backward_bf16(d_dg, d_du, d_dy, d_g, d_u, n);
        gpu_add_inplace_bf16(d_sum, d_u, n);
        y = from_dev_bf16(d_y, n), dg = from_dev_bf16(d_dg, n), du = from_dev_bf16(d_du, n);
        sum = from_dev_bf16(d_sum, n);
        gpu_free(d_g), gpu_free(d_u), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dg), gpu_free(d_du), gpu_free(d_sum);
        check_bf16_norm("swiglu bf16 forward", y, y_ref, n);
        check_bf16_norm("swiglu bf16 dgate", dg, dg_ref, n);
        check_bf16_norm("swiglu bf16 dup", du, du_ref, n);
        // x + y of two bf16 values, rounded once: exactly what the host's rounding gives.
        for (size_t i = 0; i < n; i++) sum_ref[i] = bf16_round(sum_ref[i]);
        check_exact("add_inplace bf16", sum, sum_ref, n);
        gpu_bf16 *d_x1 = dev_bf16(dg0, n), *d_u1 = dev_bf16(up, n);  // unaligned: the scalar kernel
        gpu_add_inplace_bf16(d_x1 + 1, d_u1 + 1, n - 1);
        float *sum1 = from_dev_bf16(d_x1, n);
        sum_ref[0] = dg0[0];
        check_exact("add_inplace bf16 unaligned", sum1, sum_ref, n);
        free(sum1);
        gpu_free(d_x1), gpu_free(d_u1);
    }
    free(gate), free(up), free(dy), free(dg0), free(du0), free(y_ref), free(dg_ref), free(du_ref), free(sum_ref);
    free(y), free(dg), free(du), free(sum);
}

// ================================ cross-entropy ==================================================

// V = 5003: rows of scalars; V = 5008: rows that start 16-byte aligned, read in 16-byte packs (ops.cu).
// offset: added to every logit. At 1e3 an fp32 lse = max + log(sum) would round at 6e-5 (an ulp of
// 1e3), and each row's softmax would sum to 1 +- 3e-5: the kept rows of dlogits must sum to 0 within
// 2e-6 of coef (V fp32 roundings of probabilities summing to 1, and of their exponents (x - max) -
// log-sum, |.| < 20: measured 1e-7).
static void test_cross_entropy(bool bf16, int V, double offset) {
    int N = 64;
    size_t n = (size_t)N * V;
    // Initial dlogits far larger than the gradient's entries (coef * p ~ 1e-5): the backward writes
    // dlogits, so nothing of them may survive (an added term would dwarf the result).
    float *logits = host_normal(n, 2.0, 50), *dl0 = host_normal(n, 1e3, 51);
    for (size_t i = 0; i < n; i++) logits[i] = (float)(offset + logits[i]);
    if (bf16) round_to_bf16(logits, n), round_to_bf16(dl0, n);
    int *targets = malloc(sizeof(int) * N), *ignored = malloc(sizeof(int) * N);
    for (int i = 0; i < N; i++) {
        targets[i] = i % 7 == 3 ? IGNORE_INDEX : (int)rng_below(7, 3, i, V);
        ignored[i] = IGNORE_INDEX;
    }
    float *stats_ref = malloc(sizeof(float) * 2 * N), *dl_ref = host_copy(dl0, n);
    double loss_ref = cross_entropy_forward(stats_ref, logits, targets, N, V);
    cross_entropy_backward(dl_ref, logits, stats_ref, targets, N, V, 1.7);

    int *d_targets = dev_ints(targets, N), *d_ignored = dev_ints(ignored, N);
    float *d_stats = dev_f32_poisoned(2 * N), *stats = malloc(sizeof(float) * 2 * N), *dl, *dl_zeros;
    double loss, loss_ignored, loss_queued[3];  // left on the device: targets, all ignored, one out of range
    int *bad = malloc(sizeof(int) * N);
    memcpy(bad, targets, sizeof(int) * N);
    bad[N / 2] = V;
    int *d_bad = dev_ints(bad, N);
    double *d_loss = gpu_alloc(MEM_OTHER, 3 * sizeof(double));
    float *d_stats2 = dev_f32_poisoned(2 * N);
    long long waits_queued = 0;
    if (!bf16) {
        float *d_logits = dev_f32(logits, n), *d_dl = dev_f32(dl0, n), *d_dl2 = dev_f32(dl0, n);
        long long waits = gpu_host_waits();
        gpu_cross_entropy_forward_into(d_loss, d_stats2, d_logits, d_targets, N, V);
        gpu_cross_entropy_forward_into(d_loss + 1, d_stats2, d_logits, d_ignored, N, V);
        gpu_cross_entropy_forward_into(d_loss + 2, d_stats2, d_logits, d_bad, N, V);
        waits_queued = gpu_host_waits() - waits;
        loss = gpu_cross_entropy_forward(d_stats, d_logits, d_targets, N, V);
        gpu_download(stats, d_stats, sizeof(float) * 2 * N);
        gpu_cross_entropy_backward(d_dl, d_logits, d_stats, d_targets, N, V, 1.7);
        loss_ignored = gpu_cross_entropy_forward(d_stats, d_logits, d_ignored, N, V);
        gpu_cross_entropy_backward(d_dl2, d_logits, d_stats, d_ignored, N, V, 1.7);
        dl = from_dev_f32(d_dl, n), dl_zeros = from_dev_f32(d_dl2, n);
        gpu_free(d_logits), gpu_free(d_dl), gpu_free(d_dl2);
    } else {
        gpu_bf16 *d_logits = dev_bf16(logits, n), *d_dl = dev_bf16(dl0, n), *d_dl2 = dev_bf16(dl0, n);
        long long waits = gpu_host_waits();
        gpu_cross_entropy_forward_into_bf16(d_loss, d_stats2, d_logits, d_targets, N, V);
        gpu_cross_entropy_forward_into_bf16(d_loss + 1, d_stats2, d_logits, d_ignored, N, V);
        gpu_cross_entropy_forward_into_bf16(d_loss + 2, d_stats2, d_logits, d_bad, N, V);
        waits_queued = gpu_host_waits() - waits;
        loss = gpu_cross_entropy_forward_bf16(d_stats, d_logits, d_targets, N, V);
        gpu_download(stats, d_stats, sizeof(float) * 2 * N);
        gpu_cross_entropy_backward_bf16(d_dl, d_logits, d_stats, d_targets, N, V, 1.7);
        loss_ignored = gpu_cross_entropy_forward_bf16(d_stats, d_logits, d_ignored, N, V);
        gpu_cross_entropy_backward_bf16(d_dl2, d_logits, d_stats, d_ignored, N, V, 1.7);
        dl = from_dev_bf16(d_dl, n), dl_zeros = from_dev_bf16(d_dl2, n);
        gpu_free(d_logits), gpu_free(d_dl), gpu_free(d_dl2);
    }
    char tag[32], name[96];
    if (offset) snprintf(tag, sizeof tag, "%s V=%d offset %g", bf16 ? "bf16" : "f32", V, offset);
    else snprintf(tag, sizeof tag, "%s V=%d", bf16 ? "bf16" : "f32", V);
    snprintf(name, sizeof name, "cross-entropy %s stats (max, log-sum)", tag);
    check_fp32(name, stats, stats_ref, 2 * N, 1e-6);
    snprintf(name, sizeof name, "cross-entropy %s loss", tag);
    report(name, fabs(loss - loss_ref) <= 1e-5 * fabs(loss_ref), "%.9f vs reference %.9f", loss, loss_ref);
    snprintf(name, sizeof name, "cross-entropy %s dlogits", tag);
    if (bf16) check_bf16_norm(name, dl, dl_ref, n);
    else check_fp32(name, dl, dl_ref, n, 1e-5);
    if (offset) {
        int n_valid = 0;
        double worst = 0;
        for (int i = 0; i < N; i++) n_valid += targets[i] != IGNORE_INDEX;
        for (int i = 0; i < N; i++) {
            double row = 0;
            for (int j = 0; j < V && targets[i] != IGNORE_INDEX; j++) row += dl[(size_t)i * V + j];
            worst = fmax(worst, fabs(row) / (1.7 / n_valid));
        }
        snprintf(name, sizeof name, "cross-entropy %s dlogits rows sum to 0", tag);
        report(name, worst <= 2e-6, "worst row %.3g of coef (bound 2e-6)", worst);
    }
    bool zeros = true;
    for (size_t i = 0; i < n; i++) zeros &= dl_zeros[i] == 0.0f && !signbit(dl_zeros[i]);
    snprintf(name, sizeof name, "cross-entropy %s all targets ignored", tag);
    report(name, loss_ignored == 0.0 && zeros, "loss %g, gradients written +0: %s", loss_ignored, zeros ? "yes" : "no");
    // The loss left on the device: the same kernels as the blocking call, so the same bits; no wait
    // to queue it; NaN for a target out of range (the blocking call would stop the run).
    gpu_download(loss_queued, d_loss, sizeof loss_queued);
    snprintf(name, sizeof name, "cross-entropy %s loss left on the device", tag);
    report(name, loss_queued[0] == loss && loss_queued[1] == 0.0 && isnan(loss_queued[2]) && waits_queued == 0,
           "%.9f (blocking call %.9f), all ignored %g, a bad target %g, %lld host waits to queue (want 0)",
           loss_queued[0], loss, loss_queued[1], loss_queued[2], waits_queued);
    free(logits), free(dl0), free(targets), free(ignored), free(stats_ref), free(dl_ref), free(stats), free(dl);
    free(dl_zeros), free(bad);
    gpu_free(d_targets), gpu_free(d_ignored), gpu_free(d_stats), gpu_free(d_bad), gpu_free(d_loss), gpu_free(d_stats2);
}

// Vocab-parallel cross-entropy (tensor parallelism, gpu/model.c): the logits' columns cut into two
// shards, the kernels run on each, and the host plays the two all-reduces (MAX of the row maxes, SUM
// of the sums and target logits). The stats and loss against the reference on the whole rows (the
// fp32 rule: the same formulas, the sum of exp in another order), the gradients of each shard's
// columns against the reference's columns (bf16 norm). Targets fall in both shards, on the boundary
// column too, and some are ignored.
// V = 5004: shards of 2502 columns (scalars); V = 5024: of 2512 (16-byte packs).
static void test_cross_entropy_vocab_parallel(int V) {
    int N = 64, Vr = V / 2;
    size_t n = (size_t)N * V;
    float *logits = host_normal(n, 2.0, 52), *dl0 = host_normal(n, 1e3, 53);  // overwritten, as above
    round_to_bf16(logits, n), round_to_bf16(dl0, n);
    int *targets = malloc(sizeof(int) * N);
    for (int i = 0; i < N; i++) targets[i] = i % 7 == 3 ? IGNORE_INDEX : (int)rng_below(7, 4, i, V);
    targets[5] = Vr, targets[6] = Vr - 1;  // the first column of shard 1, the last of shard 0
    float *stats_ref = malloc(sizeof(float) * 2 * N), *dl_ref = host_copy(dl0, n);
    double loss_ref = cross_entropy_forward(stats_ref, logits, targets, N, V);
    cross_entropy_backward(dl_ref, logits, stats_ref, targets, N, V, 1.7);

    float *shard_logits[2], *shard_dl0[2], *shard_dl_ref[2], *row_max[2];
    double *sums[2];
    gpu_bf16 *d_logits[2];
    int *d_targets = dev_ints(targets, N);
    for (int r = 0; r < 2; r++) {  // shard r: columns [r Vr, (r + 1) Vr)
        shard_logits[r] = malloc(sizeof(float) * N * Vr), shard_dl0[r] = malloc(sizeof(float) * N * Vr);
        shard_dl_ref[r] = malloc(sizeof(float) * N * Vr);
        for (int i = 0; i < N; i++) {
            size_t from = (size_t)i * V + (size_t)r * Vr, to = (size_t)i * Vr;
            memcpy(shard_logits[r] + to, logits + from, sizeof(float) * Vr);
            memcpy(shard_dl0[r] + to, dl0 + from, sizeof(float) * Vr);
            memcpy(shard_dl_ref[r] + to, dl_ref + from, sizeof(float) * Vr);
        }
        d_logits[r] = dev_bf16(shard_logits[r], (size_t)N * Vr);
        float *d_max = dev_f32_poisoned(N);
        gpu_vocab_parallel_row_max_bf16(d_max, d_logits[r], N, Vr);
        row_max[r] = from_dev_f32(d_max, N);
        gpu_free(d_max);
    }
    float *group_max = malloc(sizeof(float) * N);  // all-reduce MAX
    for (int i = 0; i < N; i++) group_max[i] = fmaxf(row_max[0][i], row_max[1][i]);
    float *d_group_max = dev_f32(group_max, N);
    for (int r = 0; r < 2; r++) {
        double *d_sums = gpu_alloc(MEM_OTHER, sizeof(double) * 2 * N);
        gpu_fill_bytes(d_sums, 0xff, sizeof(double) * 2 * N);
        gpu_vocab_parallel_sums_bf16(d_sums, d_logits[r], d_group_max, d_targets, N, r * Vr, Vr);
        sums[r] = malloc(sizeof(double) * 2 * N);
        gpu_download(sums[r], d_sums, sizeof(double) * 2 * N);
        gpu_free(d_sums);
    }
    double *group_sums = malloc(sizeof(double) * 2 * N);  // all-reduce SUM
    for (int i = 0; i < 2 * N; i++) group_sums[i] = sums[0][i] + sums[1][i];
    double *d_group_sums = gpu_alloc(MEM_OTHER, sizeof(double) * 2 * N), *d_loss = gpu_alloc(MEM_OTHER, sizeof(double));
    gpu_upload(d_group_sums, group_sums, sizeof(double) * 2 * N);
    float *d_stats = dev_f32_poisoned(2 * N);
    gpu_vocab_parallel_loss(d_loss, d_stats, d_group_max, d_group_sums, d_targets, N);
    double loss;
    gpu_download(&loss, d_loss, sizeof loss);
    float *stats = from_dev_f32(d_stats, 2 * N);
    char name[96];
    snprintf(name, sizeof name, "cross-entropy vocab-parallel V=%d stats (max, log-sum)", V);
    check_fp32(name, stats, stats_ref, 2 * N, 1e-6);
    snprintf(name, sizeof name, "cross-entropy vocab-parallel V=%d loss", V);
    report(name, fabs(loss - loss_ref) <= 1e-5 * fabs(loss_ref), "%.9f vs reference %.9f", loss, loss_ref);
    for (int r = 0; r < 2; r++) {
        gpu_bf16 *d_dl = dev_bf16(shard_dl0[r], (size_t)N * Vr);
        gpu_cross_entropy_backward_columns_bf16(d_dl, d_logits[r], d_stats, d_targets, N, r * Vr, Vr, 1.7);
        float *dl = from_dev_bf16(d_dl, (size_t)N * Vr);
        snprintf(name, sizeof name, "cross-entropy vocab-parallel V=%d dlogits shard %d", V, r);
        check_bf16_norm(name, dl, shard_dl_ref[r], (size_t)N * Vr);
        free(dl), gpu_free(d_dl);
    }
    for (int r = 0; r < 2; r++) {
        free(shard_logits[r]), free(shard_dl0[r]), free(shard_dl_ref[r]), free(row_max[r]), free(sums[r]);
        gpu_free(d_logits[r]);
    }
    free(logits), free(dl0), free(targets), free(stats_ref), free(dl_ref), free(group_max), free(group_sums), free(stats);
    gpu_free(d_targets), gpu_free(d_group_max), gpu_free(d_group_sums), gpu_free(d_loss), gpu_free(d_stats);
}

// Tensor parallelism's other pieces: the partial GEMMs with fp32 outputs (the sum bound of
// test_matmul, no output rounding), the vocab-parallel lookup into fp32 and its backward from bf16
// (exact: copies and the reference's adds), and bf16(residual + partial) (exact: one rounding of the
// fp32 sum, computed on the host).
static void test_tensor_parallel_pieces(void) {
    int M = 67, K = 72, N = 40;
    size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N;
    float *x = host_normal(nx, 1.0, 60), *w = host_normal(nw, 0.05, 61), *dy = host_normal(ny, 1.0, 62);
    float *dx0 = host_normal(nx, 0.1, 63);
    round_to_bf16(x, nx), round_to_bf16(w, nw), round_to_bf16(dy, ny);
    float *y_ref = malloc(sizeof(float) * ny), *dx_ref = host_copy(dx0, nx), *dx_set_ref = calloc(nx, sizeof(float));
    matmul_forward(y_ref, x, w, M, K, N);
    matmul_backward(dx_ref, NULL, dy, x, w, M, K, N);
    matmul_backward(dx_set_ref, NULL, dy, x, w, M, K, N);
    float *fwd_bound = sum_bound_forward(x, w, M, K, N), *ady = host_abs(dy, ny), *aw = host_abs(w, nw);
    float *dx_bound = host_abs(dx0, nx), *dx_set_bound = calloc(nx, sizeof(float));
    matmul_backward(dx_bound, NULL, ady, NULL, aw, M, K, N);
    matmul_backward(dx_set_bound, NULL, ady, NULL, aw, M, K, N);
    gpu_bf16 *d_x = dev_bf16(x, nx), *d_w = dev_bf16(w, nw), *d_dy = dev_bf16(dy, ny);
    float *d_y = dev_f32_poisoned(ny), *d_dx = dev_f32(dx0, nx), *d_dx_set = dev_f32_poisoned(nx);
    gpu_matmul_forward_bf16_into_f32(d_y, d_x, d_w, M, K, N);
    gpu_matmul_backward_input_bf16_into_f32(d_dx, d_dy, d_w, M, K, N, true);
    gpu_matmul_backward_input_bf16_into_f32(d_dx_set, d_dy, d_w, M, K, N, false);
    float *y = from_dev_f32(d_y, ny), *dx = from_dev_f32(d_dx, nx), *dx_set = from_dev_f32(d_dx_set, nx);
    check_elementwise("matmul bf16 -> f32 forward (sum bound)", y, y_ref, ny, 0x1p-23, 0, fwd_bound, (K + 2) * 0x1p-23);
    check_elementwise("matmul bf16 -> f32 dinp accumulated (sum bound)", dx, dx_ref, nx, 0x1p-23, 0, dx_bound,
                      (N + 2) * 0x1p-23);
    check_elementwise("matmul bf16 -> f32 dinp overwritten (sum bound)", dx_set, dx_set_ref, nx, 0x1p-23, 0,
                      dx_set_bound, (N + 2) * 0x1p-23);

    // out = bf16(residual + partial), against the host's sum and rounding.
    float *residual = host_normal(ny, 1.0, 64), *sum_ref = malloc(sizeof(float) * ny);
    round_to_bf16(residual, ny);
    for (size_t i = 0; i < ny; i++) sum_ref[i] = residual[i] + y[i];
    round_to_bf16(sum_ref, ny);
    gpu_bf16 *d_residual = dev_bf16(residual, ny), *d_sum = dev_bf16_poisoned(ny);
    // ny - 3 elements: the vectorised kernel's last 3 through its one-element tail (ny is a multiple
    // of 8); the 3 after them must stay as they were (the poison's NaN).
    gpu_add_f32_into_bf16(d_sum, d_residual, d_y, ny - 3);
    float *sum = from_dev_bf16(d_sum, ny);
    check_exact("bf16(residual + f32 partial), 3 through the tail", sum, sum_ref, ny - 3);
    report("bf16(residual + f32 partial): nothing written past n", isnan(sum[ny - 3]) && isnan(sum[ny - 1]),
           "elements n, n + 2: %g %g", (double)sum[ny - 3], (double)sum[ny - 1]);

    // The vocab-parallel lookup: rows [10, 30) of a bf16 table of 50, into fp32; and its backward.
    int T = 300, C = 96, V = 50;
    int *tokens = malloc(sizeof(int) * T);
    for (int t = 0; t < T; t++) tokens[t] = (int)rng_below(7, 5, t, V);
    float *table = host_normal((size_t)V * C, 1.0, 65), *dout = host_normal((size_t)T * C, 1.0, 66);
    float *dtable0 = host_normal((size_t)20 * C, 1.0, 67);
    round_to_bf16(table, (size_t)V * C), round_to_bf16(dout, (size_t)T * C);
    float *rows_ref = malloc(sizeof(float) * T * C), *dref = host_copy(dtable0, (size_t)20 * C);
    embedding_forward_rows(rows_ref, tokens, table + 10 * C, T, C, 10, 20);
    embedding_backward_rows(dref, dout, tokens, T, C, 10, 20);
    int *d_tokens = dev_ints(tokens, T);
    gpu_bf16 *d_table = dev_bf16(table, (size_t)V * C), *d_dout = dev_bf16(dout, (size_t)T * C);
    float *d_rows = dev_f32_poisoned((size_t)T * C), *d_dtable = dev_f32(dtable0, (size_t)20 * C);
    gpu_embedding_forward_rows_bf16_into_f32(d_rows, d_tokens, d_table + 10 * C, T, C, 10, 20);
    gpu_embedding_backward_rows_bf16(d_dtable, d_dout, d_tokens, T, C, 10, 20);
    float *rows = from_dev_f32(d_rows, (size_t)T * C), *dtable = from_dev_f32(d_dtable, (size_t)20 * C);
    check_exact("embedding bf16 -> f32 forward (rows 10..29)", rows, rows_ref, (size_t)T * C);
    check_exact("embedding bf16 backward (rows 10..29)", dtable, dref, (size_t)20 * C);

    free(x), free(w), free(dy), free(dx0), free(y_ref), free(dx_ref), free(dx_set_ref), free(fwd_bound), free(ady);
    free(aw), free(dx_bound), free(dx_set_bound), free(y), free(dx), free(dx_set), free(residual), free(sum_ref);
    free(sum), free(tokens), free(table), free(dout), free(dtable0), free(rows_ref), free(dref), free(rows), free(dtable);
    gpu_free(d_x), gpu_free(d_w), gpu_free(d_dy), gpu_free(d_y), gpu_free(d_dx), gpu_free(d_dx_set);
    gpu_free(d_residual), gpu_free(d_sum), gpu_free(d_tokens), gpu_free(d_table), gpu_free(d_dout), gpu_free(d_rows);
    gpu_free(d_dtable);
}

// ================================ AdamW ==========================================================

static void test_adamw(void) {
    size_t n = 100003;
    AdamWConfig cfg = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *p = host_normal(n, 0.02, 60), *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
    float *d_p = dev_f32(p, n), *d_m = dev_f32(m, n), *d_v = dev_f32(v, n);
    gpu_bf16 *d_pb = dev_bf16_poisoned(n);
    for (long long step = 1; step <= 3; step++) {
        float *g = host_normal(n, step == 2 ? 1e-6 : 1.0, 60 + step);
        float *d_g = dev_f32(g, n);
        adamw_step(p, g, m, v, n, step, 1e-3, &cfg);
        if (step < 3) gpu_adamw_step(d_p, d_g, d_m, d_v, n, step, 1e-3, &cfg);
        else gpu_adamw_step_bf16_copy(d_p, d_pb, d_g, d_m, d_v, n, step, 1e-3, &cfg);
        free(g);
        gpu_free(d_g);
    }
    float *gp = from_dev_f32(d_p, n), *gm = from_dev_f32(d_m, n), *gv = from_dev_f32(d_v, n);
    float *gpb = from_dev_bf16(d_pb, n);
    // Same formula in the same order (gpu/numerics.h, checked on the host against adamw.c): only
    // fused multiply-adds chosen differently by the two compilers separate them, an ulp of the
    // larger term -- relative to m itself where b1 m and (1 - b1) g cancel, hence the atol.
    check_fp32("adamw params (3 steps)", gp, p, n, 1e-6);
    check_fp32("adamw m", gm, m, n, 1e-6);
    check_fp32("adamw v", gv, v, n, 1e-6);
    for (size_t i = 0; i < n; i++) gp[i] = bf16_round(gp[i]);
    check_exact("adamw bf16 copy = bf16(params)", gpb, gp, n);
    free(p), free(m), free(v), free(gp), free(gm), free(gv), free(gpb);
    gpu_free(d_p), gpu_free(d_m), gpu_free(d_v), gpu_free(d_pb);
}

// Clipping folded into AdamW, two steps: max_norm 1 (the gradients' norm is ~300: clipped), then
// max_norm 0 (none). The reference clips a copy with the norm the device computed, then steps; the
// GPU's gradients must come back untouched.
static void test_adamw_clipped(void) {
    size_t n = 100003;
    AdamWConfig cfg = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *p = host_normal(n, 0.02, 70), *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
    float *d_p = dev_f32(p, n), *d_m = dev_f32(m, n), *d_v = dev_f32(v, n);
    gpu_bf16 *d_pb = dev_bf16_poisoned(n);
    double *d_sum_sq = gpu_alloc(MEM_OTHER, sizeof(double)), sum_sq = 0;
    bool untouched = true;
    for (long long step = 1; step <= 2; step++) {
        double max_norm = step == 1 ? 1.0 : 0.0;
        float *g = host_normal(n, 1.0, 70 + step), *d_g = dev_f32(g, n);
        gpu_sum_of_squares_into(d_sum_sq, d_g, n);
        gpu_adamw_step_clipped(d_p, d_pb, d_g, d_m, d_v, n, step, 1e-3, &cfg, d_sum_sq, max_norm);
        gpu_download(&sum_sq, d_sum_sq, sizeof sum_sq);
        float *g_after = from_dev_f32(d_g, n);
        untouched = untouched && memcmp(g_after, g, sizeof(float) * n) == 0;
        clip_by_global_norm(g, n, sqrt(sum_sq), max_norm);
        adamw_step(p, g, m, v, n, step, 1e-3, &cfg);
        free(g), free(g_after);
        gpu_free(d_g);
    }
    float *gp = from_dev_f32(d_p, n), *gm = from_dev_f32(d_m, n), *gv = from_dev_f32(d_v, n);
    float *gpb = from_dev_bf16(d_pb, n);
    check_fp32("adamw clipped params (clip, then none)", gp, p, n, 1e-6);  // tolerances: test_adamw's
    check_fp32("adamw clipped m", gm, m, n, 1e-6);
    check_fp32("adamw clipped v", gv, v, n, 1e-6);
    for (size_t i = 0; i < n; i++) gp[i] = bf16_round(gp[i]);
    check_exact("adamw clipped bf16 copy = bf16(params)", gpb, gp, n);
    report("adamw clipped leaves the gradients", untouched, "%s", untouched ? "bit-identical" : "changed");
    free(p), free(m), free(v), free(gp), free(gm), free(gv), free(gpb);
    gpu_free(d_p), gpu_free(d_m), gpu_free(d_v), gpu_free(d_pb), gpu_free(d_sum_sq);
}

// ================================ clipping =======================================================

static void test_clipping(void) {
    size_t n = 1000003;
    float *x = host_normal(n, 1.0, 90), *d_x = dev_f32(x, n);
    double want = sum_of_squares(x, n), got = gpu_sum_of_squares(d_x, n);
    // Both sum in double, in different orders: at worst n 2^-53 = 1e-10 relative apart, but the
    // roundings of positive terms add as a random walk, ~sqrt(n) 2^-53 = 1e-13; 1e-12 is ten times
    // that, while one element dropped or counted twice moves the sum by ~1e-6.
    report("sum_of_squares", fabs(got - want) <= 1e-12 * want, "%.15g vs reference %.15g", got, want);
    report("sum_of_squares of nothing", gpu_sum_of_squares(d_x, 0) == 0.0, "0 elements");
    gpu_scale_inplace(d_x, n, 0.37);
    scale_inplace(x, n, 0.37);
    float *scaled = from_dev_f32(d_x, n);
    check_exact("scale_inplace", scaled, x, n);
    free(x), free(scaled);
    gpu_free(d_x);
}

// ================================ attention ======================================================

enum { POS_NONE, POS_SCATTERED, POS_KEYS_LATER, POS_KEYS_FROM_TILE_END };
typedef struct {
    const char *name;
    int B, Tq, Tk, H, KV, hd;
    bool causal;
    int positions;  // POS_NONE (0..T-1), POS_SCATTERED (make_positions), the others: case_positions
} AttnCase;

static size_t q_elems(const AttnShape *s) { return (size_t)s->B * s->Tq * s->n_heads * s->head_dim; }
static size_t kv_elems(const AttnShape *s) { return (size_t)s->B * s->Tk * s->n_kv_heads * s->head_dim; }
static size_t row_elems(const AttnShape *s) { return (size_t)s->B * s->n_heads * s->Tq; }

// Query positions: the first 4 before every key (they see nothing: lse -inf, output 0, no gradient),
// the rest spread over the keys; key positions run backwards, so whole tiles are masked for some rows.
static void make_positions(int *q_pos, int *k_pos, int Tq, int Tk) {
    for (int i = 0; i < Tq; i++) q_pos[i] = i < 4 ? -1 - i : (int)((long)i * Tk / Tq);
    for (int j = 0; j < Tk; j++) k_pos[j] = Tk - 1 - j;
}

// lse: -inf where the row saw no key, on both sides (compared, then zeroed in both copies so that
// the fp32 rule sees only the finite ones).
static void check_lse(const char *name, float *got, float *want, size_t n, double tol) {
    size_t inf_mismatch = 0;
    for (size_t r = 0; r < n; r++)
        if (isinf(want[r]) || isinf(got[r])) {
            inf_mismatch += !(isinf(want[r]) && isinf(got[r]) && want[r] < 0 && got[r] < 0);
            got[r] = want[r] = 0;
        }
    if (inf_mismatch) report(name, false, "%zu rows -inf on one side only", inf_mismatch);
    else check_fp32(name, got, want, n, tol);
}

static void test_attention_f32(const AttnCase *c) {
    int *q_pos = malloc(sizeof(int) * c->Tq), *k_pos = malloc(sizeof(int) * c->Tk);
    make_positions(q_pos, k_pos, c->Tq, c->Tk);
    AttnShape s = {c->B, c->Tq, c->Tk, c->H, c->KV, c->hd, NULL, NULL, c->causal};
    if (c->positions == POS_SCATTERED) s.q_pos = q_pos, s.k_pos = k_pos;
    size_t nq = q_elems(&s), nk = kv_elems(&s), nr = row_elems(&s);
    float *q = host_normal(nq, 1.0, 70), *k = host_normal(nk, 1.0, 71), *v = host_normal(nk, 1.0, 72);
    float *dout = host_normal(nq, 1.0, 73), *dq0 = host_normal(nq, 0.1, 74), *dk0 = host_normal(nk, 0.1, 75);
    float *dv0 = host_normal(nk, 0.1, 76);
    float *out_ref = malloc(sizeof(float) * nq), *lse_ref = malloc(sizeof(float) * nr);
    float *dq_ref = host_copy(dq0, nq), *dk_ref = host_copy(dk0, nk), *dv_ref = host_copy(dv0, nk);
    attention_flash_forward(out_ref, lse_ref, q, k, v, &s);
    attention_flash_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, &s);

    int *d_qpos = dev_ints(q_pos, c->Tq), *d_kpos = dev_ints(k_pos, c->Tk);
    AttnShape ds = s;  // the same shape with device positions
    if (c->positions == POS_SCATTERED) ds.q_pos = d_qpos, ds.k_pos = d_kpos;
    float *d_q = dev_f32(q, nq), *d_k = dev_f32(k, nk), *d_v = dev_f32(v, nk), *d_dout = dev_f32(dout, nq);
    float *d_out = dev_f32_poisoned(nq), *d_lse = dev_f32_poisoned(nr);
    float *d_dq = dev_f32(dq0, nq), *d_dk = dev_f32(dk0, nk), *d_dv = dev_f32(dv0, nk);
    gpu_attention_forward(d_out, d_lse, d_q, d_k, d_v, &ds);
    gpu_attention_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, &ds);
    float *out = from_dev_f32(d_out, nq), *lse = from_dev_f32(d_lse, nr), *dq = from_dev_f32(d_dq, nq);
    float *dk = from_dev_f32(d_dk, nk), *dv = from_dev_f32(d_dv, nk);

    char name[96];
    snprintf(name, sizeof name, "attention f32 %s out", c->name);
    check_fp32(name, out, out_ref, nq, 1e-4);
    snprintf(name, sizeof name, "attention f32 %s lse", c->name);
    check_lse(name, lse, lse_ref, nr, 1e-5);
    snprintf(name, sizeof name, "attention f32 %s dq", c->name);
    check_fp32(name, dq, dq_ref, nq, 1e-4);
    snprintf(name, sizeof name, "attention f32 %s dk", c->name);
    check_fp32(name, dk, dk_ref, nk, 1e-4);
    snprintf(name, sizeof name, "attention f32 %s dv", c->name);
    check_fp32(name, dv, dv_ref, nk, 1e-4);

    free(q_pos), free(k_pos), free(q), free(k), free(v), free(dout), free(dq0), free(dk0), free(dv0);
    free(out_ref), free(lse_ref), free(dq_ref), free(dk_ref), free(dv_ref);
    free(out), free(lse), free(dq), free(dk), free(dv);
    gpu_free(d_qpos), gpu_free(d_kpos), gpu_free(d_q), gpu_free(d_k), gpu_free(d_v), gpu_free(d_dout);
    gpu_free(d_out), gpu_free(d_lse), gpu_free(d_dq), gpu_free(d_dk), gpu_free(d_dv);
}

// ---- bf16 attention: the tensor-core kernels (and the CUDA-core ones they replace) ---------------

// Attention the plain bf16 way, as PyTorch eager runs softmax(Q K^T * scale + mask) V on bf16 tensors
// with K, V expanded over the group: every op's output rounded to bf16 (matmuls accumulate in fp32,
// softmax computes in fp32), then autograd in the same ops; the expanded K, V gradients are summed
// over the group's heads in fp32 and rounded once. The mask is s's (causal by its host positions, or
// none); a row that sees no key gets P = 0 (as the reference: output 0, no gradient).
static void attention_plain_bf16(float *out, float *dq, float *dk, float *dv, const float *q, const float *k,
                                 const float *v, const float *dout, const AttnShape *s) {
    int B = s->B, Tq = s->Tq, Tk = s->Tk, H = s->n_heads, KV = s->n_kv_heads, hd = s->head_dim, group = H / KV;
    float scale = (float)(1.0 / sqrt((double)hd));
    size_t nk = kv_elems(s);
    float *P = malloc(sizeof(float) * Tq * Tk), *dS = malloc(sizeof(float) * Tq * Tk), *dp = malloc(sizeof(float) * Tk);
    bool *vis = malloc(sizeof(bool) * Tq * Tk);
    float *dk_heads = calloc(nk * group, sizeof(float)), *dv_heads = calloc(nk * group, sizeof(float));
    for (int i = 0; i < Tq; i++)
        for (int j = 0; j < Tk; j++)
            vis[(size_t)i * Tk + j] = !s->causal || (s->k_pos ? s->k_pos[j] : j) <= (s->q_pos ? s->q_pos[i] : i);
#define Q_AT(x, b, i, h) ((x) + (((size_t)(b) * Tq + (i)) * H + (h)) * hd)
#define KV_AT(x, b, j, g) ((x) + (((size_t)(b) * Tk + (j)) * KV + (g)) * hd)
#define VIS(i, j) vis[(size_t)(i) * Tk + (j)]
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            int g = h / group;
            for (int i = 0; i < Tq; i++) {  // P row i: S = bf16(bf16(q.k) * scale), softmax in fp32
                float *p_row = P + (size_t)i * Tk, m = -INFINITY, sum = 0;
                for (int j = 0; j < Tk; j++) {
                    if (!VIS(i, j)) continue;
                    float dot = 0;
                    for (int d = 0; d < hd; d++) dot += Q_AT(q, b, i, h)[d] * KV_AT(k, b, j, g)[d];
                    p_row[j] = bf16_round(bf16_round(dot) * scale);
                    m = fmaxf(m, p_row[j]);
                }
                for (int j = 0; j < Tk; j++)
                    if (VIS(i, j)) sum += expf(p_row[j] - m);
                for (int j = 0; j < Tk; j++) p_row[j] = VIS(i, j) ? bf16_round(expf(p_row[j] - m) / sum) : 0;
                for (int d = 0; d < hd; d++) {  // O = bf16(P V)
                    float acc = 0;
                    for (int j = 0; j < Tk; j++) acc += p_row[j] * KV_AT(v, b, j, g)[d];
                    Q_AT(out, b, i, h)[d] = bf16_round(acc);
                }
            }
            for (int i = 0; i < Tq; i++) {  // dP = bf16(dO V^T); dS = bf16(softmax backward); bf16(dS * scale)
                float rowsum = 0;
                for (int j = 0; j < Tk; j++) {
                    float acc = 0;
                    for (int d = 0; d < hd; d++) acc += Q_AT(dout, b, i, h)[d] * KV_AT(v, b, j, g)[d];
                    dp[j] = bf16_round(acc);
                    rowsum += P[(size_t)i * Tk + j] * dp[j];
                }
                for (int j = 0; j < Tk; j++)
                    dS[(size_t)i * Tk + j] = bf16_round(bf16_round(P[(size_t)i * Tk + j] * (dp[j] - rowsum)) * scale);
            }
            for (int i = 0; i < Tq; i++)  // dQ = bf16(dS K)
                for (int d = 0; d < hd; d++) {
                    float acc = 0;
                    for (int j = 0; j < Tk; j++) acc += dS[(size_t)i * Tk + j] * KV_AT(k, b, j, g)[d];
                    Q_AT(dq, b, i, h)[d] = bf16_round(acc);
                }
            for (int j = 0; j < Tk; j++)  // per head: dK_h = bf16(dS^T Q), dV_h = bf16(P^T dO)
                for (int d = 0; d < hd; d++) {
                    float acc_k = 0, acc_v = 0;
                    for (int i = 0; i < Tq; i++) {
                        acc_k += dS[(size_t)i * Tk + j] * Q_AT(q, b, i, h)[d];
                        acc_v += P[(size_t)i * Tk + j] * Q_AT(dout, b, i, h)[d];
                    }
                    size_t at = (size_t)(h % group) * nk + (KV_AT(dk, b, j, g) - dk) + d;
                    dk_heads[at] = bf16_round(acc_k);
                    dv_heads[at] = bf16_round(acc_v);
                }
        }
    for (size_t e = 0; e < nk; e++) {  // the expand's backward: sum over the group, one rounding
        float sk = 0, sv = 0;
        for (int r = 0; r < group; r++) sk += dk_heads[r * nk + e], sv += dv_heads[r * nk + e];
        dk[e] = bf16_round(sk), dv[e] = bf16_round(sv);
    }
#undef Q_AT
#undef KV_AT
#undef VIS
    free(P), free(dS), free(dp), free(vis), free(dk_heads), free(dv_heads);
}

// The positions of an AttnCase (host arrays, both allocated; unused for POS_NONE).
static void case_positions(const AttnCase *c, int *q_pos, int *k_pos) {
    if (c->positions == POS_KEYS_LATER) {  // a ring-attention chunk from later in the sequence: nothing visible
        for (int i = 0; i < c->Tq; i++) q_pos[i] = i;
        for (int j = 0; j < c->Tk; j++) k_pos[j] = c->Tq + 100 + j;
    } else if (c->positions == POS_KEYS_FROM_TILE_END) {
        // Keys from the position of the first query tile's last query on: in that tile pair one query
        // sees one key, and the block vote must not skip it (the smallest key position equals the
        // largest query position); the later query tiles see more.
        for (int i = 0; i < c->Tq; i++) q_pos[i] = i;
        for (int j = 0; j < c->Tk; j++) k_pos[j] = 63 + j;
    } else {
        make_positions(q_pos, k_pos, c->Tq, c->Tk);
    }
}

// Host copies of one bf16 attention's results.
typedef struct {
    float *out, *lse, *dq, *dk, *dv;
} AttnResults;
static void free_results(AttnResults *r) { free(r->out), free(r->lse), free(r->dq), free(r->dk), free(r->dv); }

// Forward, then backward on the forward's own out and lse, of the bf16 API (tensor cores where
// supported) or of the _simt pair, on the host bf16 values given (s: host positions). The gradients
// accumulate into dq0, dk0, dv0 (NULL: zeros). Outputs start as NaN.
static AttnResults run_attention_bf16(bool simt, const AttnShape *s, const float *q, const float *k, const float *v,
                                      const float *dout, const float *dq0, const float *dk0, const float *dv0) {
    size_t nq = q_elems(s), nk = kv_elems(s), nr = row_elems(s);
    AttnShape ds = *s;  // with device positions
    int *d_qpos = s->q_pos ? dev_ints(s->q_pos, s->Tq) : NULL, *d_kpos = s->k_pos ? dev_ints(s->k_pos, s->Tk) : NULL;
    ds.q_pos = d_qpos, ds.k_pos = d_kpos;
    float *zeros = calloc(nq > nk ? nq : nk, sizeof(float));
    const size_t row = (size_t)s->n_heads * s->head_dim;  // a row of q or dout; k and v's are shorter
    gpu_bf16 *d_q = dev_bf16_nan_tail(q, nq, row), *d_k = dev_bf16_nan_tail(k, nk, row);
    gpu_bf16 *d_v = dev_bf16_nan_tail(v, nk, row), *d_dout = dev_bf16_nan_tail(dout, nq, row);
    gpu_bf16 *d_out = dev_bf16_poisoned(nq);
    gpu_bf16 *d_dq = dev_bf16(dq0 ? dq0 : zeros, nq), *d_dk = dev_bf16(dk0 ? dk0 : zeros, nk);
    gpu_bf16 *d_dv = dev_bf16(dv0 ? dv0 : zeros, nk);
    float *d_lse = dev_f32_poisoned(nr);
    if (simt) {
        gpu_attention_forward_bf16_simt(d_out, d_lse, d_q, d_k, d_v, &ds);
        gpu_attention_backward_bf16_simt(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, &ds);
    } else {
        gpu_attention_forward_bf16(d_out, d_lse, d_q, d_k, d_v, &ds);
        gpu_attention_backward_bf16(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, &ds);
    }
    AttnResults r = {from_dev_bf16(d_out, nq), from_dev_f32(d_lse, nr), from_dev_bf16(d_dq, nq),
                     from_dev_bf16(d_dk, nk), from_dev_bf16(d_dv, nk)};
    free(zeros);
    gpu_free(d_qpos), gpu_free(d_kpos), gpu_free(d_q), gpu_free(d_k), gpu_free(d_v), gpu_free(d_dout);
    gpu_free(d_out), gpu_free(d_lse), gpu_free(d_dq), gpu_free(d_dk), gpu_free(d_dv);
    return r;
}

// The tensor-core kernels against the CUDA-core ones on the same inputs: norm-wise within
// TC_VS_SIMT_TOL. Both compute in fp32 from the same bf16 values; they differ by the roundings
// each stores (one per output element on each side, at most 2^-8 relative) and by the TC kernel's
// rounding of P and dS to bf16 before its second products (2^-8 relative per term; two chained
// products for dQ and dK), and the order of the sums: 4 unit roundoffs, 2^-6. (The emulator
// measures 0.12 to 0.21 of it; a masking, indexing or rescaling bug moves results by O(1).)
#define TC_VS_SIMT_TOL 0x1p-6
static void check_vs_simt(const char *name, const float *tc, const float *simt, size_t n) {
    double e = rel_l2(tc, simt, n);
    report(name, e <= TC_VS_SIMT_TOL, "||tc - simt||/||simt|| = %.3g (bound %.3g)", e, TC_VS_SIMT_TOL);
}

// One bf16 case: the API (the tensor-core kernels where the shape allows) against the reference
// (FA rule; lse by the fp32 rule) with gradients from zero, then against the _simt kernels with
// gradients accumulated into random initial values, and twice, bit for bit. Seen to fail (on the
// emulator): a wrong lane, register or half in any fragment load, in the accumulator-to-operand
// reuse or in the emulated instruction; the causal mask missing in one tile (forward, dQ or dK/dV;
// even only in the last diagonal tile); the last key tile (or, in dK/dV, query tile) dropped; the
// output accumulator not rescaled; the kv head of a query head wrong; D left out of dS; gradients
// stored instead of accumulated; either block vote off by one (`<` for `<=`); the query positions
// ignored; the end-of-tile barrier of the forward or dK/dV kernel removed.
static void test_attention_bf16(const AttnCase *c) {
    int *q_pos = malloc(sizeof(int) * c->Tq), *k_pos = malloc(sizeof(int) * c->Tk);
    case_positions(c, q_pos, k_pos);
    AttnShape s = {c->B, c->Tq, c->Tk, c->H, c->KV, c->hd, NULL, NULL, c->causal};
    if (c->positions != POS_NONE) s.q_pos = q_pos, s.k_pos = k_pos;
    size_t nq = q_elems(&s), nk = kv_elems(&s), nr = row_elems(&s);
    float *q = host_normal(nq, 1.0, 80), *k = host_normal(nk, 1.0, 81), *v = host_normal(nk, 1.0, 82);
    float *dout = host_normal(nq, 1.0, 83);
    float *dq0 = host_normal(nq, 0.1, 84), *dk0 = host_normal(nk, 0.1, 85), *dv0 = host_normal(nk, 0.1, 86);
    round_to_bf16(q, nq), round_to_bf16(k, nk), round_to_bf16(v, nk), round_to_bf16(dout, nq);
    round_to_bf16(dq0, nq), round_to_bf16(dk0, nk), round_to_bf16(dv0, nk);
    char name[128];
    snprintf(name, sizeof name, "attention bf16 %s on tensor cores", c->name);
    bool tc = gpu_attention_bf16_uses_tensor_cores(&s);
    report(name, tc, "head_dim %d", c->hd);

    // Reference: fp32 on the same bf16 values (its own error is ~1e-6, far below bf16's ~1e-3).
    float *out_ref = malloc(sizeof(float) * nq), *lse_ref = malloc(sizeof(float) * nr);
    float *dq_ref = calloc(nq, sizeof(float)), *dk_ref = calloc(nk, sizeof(float)), *dv_ref = calloc(nk, sizeof(float));
    attention_flash_forward(out_ref, lse_ref, q, k, v, &s);
    attention_flash_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, &s);
    float *out_base = malloc(sizeof(float) * nq), *dq_base = malloc(sizeof(float) * nq);
    float *dk_base = malloc(sizeof(float) * nk), *dv_base = malloc(sizeof(float) * nk);
    attention_plain_bf16(out_base, dq_base, dk_base, dv_base, q, k, v, dout, &s);

    // Against the reference, gradients from zero; then twice from dq0, dk0, dv0, and the SIMT kernels too.
    AttnResults r = run_attention_bf16(false, &s, q, k, v, dout, NULL, NULL, NULL);
    AttnResults r1 = run_attention_bf16(false, &s, q, k, v, dout, dq0, dk0, dv0);
    AttnResults r2 = run_attention_bf16(false, &s, q, k, v, dout, dq0, dk0, dv0);
    AttnResults simt = run_attention_bf16(true, &s, q, k, v, dout, dq0, dk0, dv0);
    // Every kernel's other tile (64 or 128 rows of its own side): the same arithmetic per query and
    // per key, so the same bits.
    const GpuAttnTileRows rows = gpu_attention_tile_rows();
    const GpuAttnTileRows flipped = {192 - rows.forward, 192 - rows.dq, 192 - rows.dkdv};  // 64 <-> 128 each
    gpu_attention_set_tile_rows(flipped);
    AttnResults other = run_attention_bf16(false, &s, q, k, v, dout, dq0, dk0, dv0);
    gpu_attention_set_tile_rows(rows);

    if (c->positions == POS_KEYS_LATER) {
        // No query sees a key: the reference's output is 0, its lse -inf, its gradients 0 -- exactly.
        float *zeros = calloc(nq, sizeof(float));
        snprintf(name, sizeof name, "attention bf16 %s out = 0", c->name);
        check_exact(name, r.out, zeros, nq);
        size_t finite = 0;
        for (size_t i = 0; i < nr; i++) finite += !(isinf(r.lse[i]) && r.lse[i] < 0);
        snprintf(name, sizeof name, "attention bf16 %s lse = -inf", c->name);
        report(name, finite == 0, "%zu of %zu rows not -inf", finite, nr);
        snprintf(name, sizeof name, "attention bf16 %s dq unchanged", c->name);
        check_exact(name, r1.dq, dq0, nq);
        snprintf(name, sizeof name, "attention bf16 %s dk unchanged", c->name);
        check_exact(name, r1.dk, dk0, nk);
        snprintf(name, sizeof name, "attention bf16 %s dv unchanged", c->name);
        check_exact(name, r1.dv, dv0, nk);
        free(zeros);
    } else {
        snprintf(name, sizeof name, "attention bf16 %s out (FA rule)", c->name);
        check_fa_rule(name, r.out, out_base, out_ref, nq);
        snprintf(name, sizeof name, "attention bf16 %s lse (fp32)", c->name);
        float *lse_ref_copy = host_copy(lse_ref, nr), *lse_copy = host_copy(r.lse, nr);
        check_lse(name, lse_copy, lse_ref_copy, nr, 1e-5);
        free(lse_ref_copy), free(lse_copy);
        snprintf(name, sizeof name, "attention bf16 %s dq (FA rule)", c->name);
        check_fa_rule(name, r.dq, dq_base, dq_ref, nq);
        snprintf(name, sizeof name, "attention bf16 %s dk (FA rule)", c->name);
        check_fa_rule(name, r.dk, dk_base, dk_ref, nk);
        snprintf(name, sizeof name, "attention bf16 %s dv (FA rule)", c->name);
        check_fa_rule(name, r.dv, dv_base, dv_ref, nk);

        snprintf(name, sizeof name, "attention bf16 %s out vs simt", c->name);
        check_vs_simt(name, r1.out, simt.out, nq);
        snprintf(name, sizeof name, "attention bf16 %s lse vs simt (fp32)", c->name);
        float *lse_simt = host_copy(simt.lse, nr), *lse_tc = host_copy(r1.lse, nr);
        check_lse(name, lse_tc, lse_simt, nr, 1e-5);
        free(lse_simt), free(lse_tc);
        snprintf(name, sizeof name, "attention bf16 %s dq += vs simt", c->name);
        check_vs_simt(name, r1.dq, simt.dq, nq);
        snprintf(name, sizeof name, "attention bf16 %s dk += vs simt", c->name);
        check_vs_simt(name, r1.dk, simt.dk, nk);
        snprintf(name, sizeof name, "attention bf16 %s dv += vs simt", c->name);
        check_vs_simt(name, r1.dv, simt.dv, nk);
    }
    // Determinism: a second run gives the same bits (the -inf lse of rows that see nothing included).
    // And the other tiles' results, the same bits again.
    const struct { const char *what; const float *a, *b, *other; size_t n; } same[] = {
        {"out", r1.out, r2.out, other.out, nq}, {"lse", r1.lse, r2.lse, other.lse, nr},
        {"dq", r1.dq, r2.dq, other.dq, nq},     {"dk", r1.dk, r2.dk, other.dk, nk},
        {"dv", r1.dv, r2.dv, other.dv, nk},
    };
    for (size_t t = 0; t < sizeof same / sizeof same[0]; t++) {
        snprintf(name, sizeof name, "attention bf16 %s %s run twice", c->name, same[t].what);
        check_exact(name, same[t].a, same[t].b, same[t].n);
        snprintf(name, sizeof name, "attention bf16 %s %s: tiles %d,%d,%d = %d,%d,%d", c->name, same[t].what,
                 flipped.forward, flipped.dq, flipped.dkdv, rows.forward, rows.dq, rows.dkdv);
        check_exact(name, same[t].other, same[t].a, same[t].n);
    }

    free(q_pos), free(k_pos), free(q), free(k), free(v), free(dout), free(dq0), free(dk0), free(dv0);
    free(out_ref), free(lse_ref), free(dq_ref), free(dk_ref), free(dv_ref);
    free(out_base), free(dq_base), free(dk_base), free(dv_base);
    free_results(&r), free_results(&r1), free_results(&r2), free_results(&simt), free_results(&other);
}

// A head_dim the tensor cores do not take (not a multiple of 16): the bf16 API must run the
// CUDA-core kernels, bit for bit.
static void test_attention_bf16_fallback(void) {
    AttnShape s = {1, 40, 40, 2, 1, 24, NULL, NULL, true};
    size_t nq = q_elems(&s), nk = kv_elems(&s), nr = row_elems(&s);
    float *q = host_normal(nq, 1.0, 87), *k = host_normal(nk, 1.0, 88), *v = host_normal(nk, 1.0, 89);
    float *dout = host_normal(nq, 1.0, 90);
    bool tc = gpu_attention_bf16_uses_tensor_cores(&s);
    report("attention bf16 hd24 not on tensor cores", !tc, "head_dim %d", s.head_dim);
    AttnResults api = run_attention_bf16(false, &s, q, k, v, dout, NULL, NULL, NULL);
    AttnResults simt = run_attention_bf16(true, &s, q, k, v, dout, NULL, NULL, NULL);
    check_exact("attention bf16 hd24 out = simt's", api.out, simt.out, nq);
    check_exact("attention bf16 hd24 lse = simt's", api.lse, simt.lse, nr);
    check_exact("attention bf16 hd24 dq = simt's", api.dq, simt.dq, nq);
    check_exact("attention bf16 hd24 dk = simt's", api.dk, simt.dk, nk);
    check_exact("attention bf16 hd24 dv = simt's", api.dv, simt.dv, nk);
    free(q), free(k), free(v), free(dout);
    free_results(&api), free_results(&simt);
}

// The fragment bookkeeping of the tensor-core kernels (gpu/mma.cuh) against plain matrix products,
// exactly: small integers are exact in bf16, and so are their products and sums in fp32 (|c| <= 16 *
// 4 * 4 = 256 stays exact when c is rounded to bf16 for e). A wrong lane, register or half anywhere
// in the loads, the accumulator-to-operand reuse or the (emulated) instruction moves some element.
static void test_mma_fragments(void) {
    float a[256], b[256], c_ref[256], e_ref[256];
    for (int x = 0; x < 256; x++) {
        a[x] = (float)((int)rng_below(91, 1, x, 9) - 4);  // -4 .. 4
        b[x] = (float)((int)rng_below(91, 2, x, 9) - 4);
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float sum = 0;
            for (int kk = 0; kk < 16; kk++) sum += a[i * 16 + kk] * b[kk * 16 + j];
            c_ref[i * 16 + j] = sum;
        }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float sum = 0;
            for (int kk = 0; kk < 16; kk++) sum += c_ref[i * 16 + kk] * b[kk * 16 + j];
            e_ref[i * 16 + j] = sum;
        }
    gpu_bf16 *d_a = dev_bf16(a, 256), *d_b = dev_bf16(b, 256);
    float *d_c = dev_f32_poisoned(256), *d_ct = dev_f32_poisoned(256), *d_e = dev_f32_poisoned(256);
    gpu_attention_tc_fragment_check(d_c, d_ct, d_e, d_a, d_b);
    float *c = from_dev_f32(d_c, 256), *ct = from_dev_f32(d_ct, 256), *e = from_dev_f32(d_e, 256);
    check_exact("mma fragments: a b, b as stored (as V)", c, c_ref, 256);
    check_exact("mma fragments: a b, b transposed (as K)", ct, c_ref, 256);
    check_exact("mma fragments: bf16(a b) b, A from C (as P)", e, e_ref, 256);
    free(c), free(ct), free(e);
    gpu_free(d_a), gpu_free(d_b), gpu_free(d_c), gpu_free(d_ct), gpu_free(d_e);
}

int main(void) {
    if (!gpu_test_start("test_gpu_ops")) return 0;

    test_casts();
    for (int bf16 = 0; bf16 < 2; bf16++) {
        test_matmul(bf16);
        test_matmul_fused(bf16);
        for (int C = 1000; C <= 1001; C++) test_rmsnorm(bf16, C);
        test_rope(bf16);
        test_qkv_split_merge(bf16);
        test_elementwise(bf16);
        for (int V = 5003; V <= 5008; V += 5) test_cross_entropy(bf16, V, 0);
    }
    test_cross_entropy(false, 5008, 1e3);
    test_cross_entropy_vocab_parallel(5004);
    test_cross_entropy_vocab_parallel(5024);
    test_embedding();
    test_tensor_parallel_pieces();
    test_adamw();
    test_adamw_clipped();
    test_clipping();
    const AttnCase f32_cases[] = {
        {"causal GQA 2x130 H8/KV2 hd64", 2, 130, 130, 8, 2, 64, true, POS_NONE},
        {"full Tq70 Tk130 H4/KV4 hd32", 2, 70, 130, 4, 4, 32, false, POS_NONE},
        {"causal 1x200 H4/KV1 hd128", 1, 200, 200, 4, 1, 128, true, POS_NONE},
        {"causal positions Tq50 Tk150 hd64", 2, 50, 150, 4, 2, 64, true, POS_SCATTERED},
        {"tiny 4x32 H8/KV4 hd8", 4, 32, 32, 8, 4, 8, true, POS_NONE},
    };
    for (size_t i = 0; i < sizeof f32_cases / sizeof f32_cases[0]; i++) test_attention_f32(&f32_cases[i]);
    test_mma_fragments();
    // T not a multiple of 64 (3 tiles, the last of 2 rows; 2 tiles, the last one row short), causal ones
    // with whole tiles skipped. The inputs are followed by NaNs (dev_bf16_nan_tail).
    const AttnCase bf16_cases[] = {
        {"causal GQA 2x130 H4/KV2 hd32", 2, 130, 130, 4, 2, 32, true, POS_NONE},
        {"full Tq70 Tk130 H2/KV2 hd16", 1, 70, 130, 2, 2, 16, false, POS_NONE},
        {"causal 1x130 H2/KV1 hd64", 1, 130, 130, 2, 1, 64, true, POS_NONE},
        {"causal 1x127 H2/KV1 hd64", 1, 127, 127, 2, 1, 64, true, POS_NONE},  // a last tile one row short
        {"causal positions Tq60 Tk130 hd64", 1, 60, 130, 4, 2, 64, true, POS_SCATTERED},
        {"causal 1x100 H2/KV2 hd96", 1, 100, 100, 2, 2, 96, true, POS_NONE},
        {"causal 1x130 H4/KV2 hd128", 1, 130, 130, 4, 2, 128, true, POS_NONE},
        {"keys after queries Tq64 Tk70 hd32", 1, 64, 70, 2, 1, 32, true, POS_KEYS_LATER},
        {"keys from query 63 on Tq128 Tk70 hd16", 1, 128, 70, 2, 1, 16, true, POS_KEYS_FROM_TILE_END},
    };
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0]; i++) test_attention_bf16(&bf16_cases[i]);
    test_attention_bf16_fallback();

    return gpu_test_finish("test_gpu_ops");
}
