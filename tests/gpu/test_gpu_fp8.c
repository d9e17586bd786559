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
// Every output buffer is poisoned first, so an element a kernel never wrote fails.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/rng.h"
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

// A (rows, cols) Gaussian matrix with a few outliers (x 1000); with_nan: one NaN.
static float *matrix(int rows, int cols, bool with_nan, uint64_t stream) {
    size_t n = (size_t)rows * cols;
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = (float)rng_normal(7, stream, i);
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
            float *x = matrix(rows, cols, nan_case, 11 + gi), *dx = to_device(x, (size_t)rows * cols);
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

int main(void) {
    if (!gpu_test_start("test_gpu_fp8")) return 0;
    test_casts();
    test_decode();
    test_amax_and_cast_back();
    return gpu_test_finish("test_gpu_fp8");
}
