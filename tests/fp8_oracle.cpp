// fp8_oracle: chapters/09_fp8/fp8_cast.c against NVIDIA's cuda_fp8.h host conversions, bit for bit,
// in both directions and both formats. Host code only: cuda_fp8.h's conversions run on a CPU, so
// this needs CUDA's headers but no GPU (built by the Makefile where nvcc is found; run by
// tests/t_fp8_cast.sh).
//   fp8_oracle           every fp8 code -> fp32, and a dense sample of fp32 -> fp8 (below)
//   fp8_oracle --all     fp32 -> fp8 for all 2^32 bit patterns
// Prints the first mismatch and exits 1, or one "ok" line per check.
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

extern "C" {
#include "chapters/09_fp8/fp8_cast.h"
}

static const char *name(Fp8Format f) { return fp8_format_info(f)->name; }
static __nv_fp8_interpretation_t nv_format(Fp8Format f) { return f == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2; }

static uint32_t bits_of(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
static float float_of(uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

static long long n_checked = 0;

static bool check_encode(uint32_t u, Fp8Format f) {
    float x = float_of(u);
    unsigned want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, nv_format(f)), got = fp8_from_float(x, f);
    n_checked++;
    if (want == got) return true;
    std::printf("FAIL: %s encode of 0x%08x (%.9g): ours 0x%02x, cuda_fp8.h 0x%02x\n", name(f), u, x, got, want);
    return false;
}

static bool check_decode_all(Fp8Format f) {
    for (unsigned c = 0; c < 256; c++) {
        float want = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, nv_format(f))));
        float got = fp8_to_float((uint8_t)c, f);
        if (bits_of(want) != bits_of(got)) {
            std::printf("FAIL: %s decode of 0x%02x: ours 0x%08x (%g), cuda_fp8.h 0x%08x (%g)\n", name(f), c,
                        bits_of(got), got, bits_of(want), want);
            return false;
        }
    }
    std::printf("ok: %s decode: all 256 codes bit-exact\n", name(f));
    return true;
}

// The rounding decision depends on the bits kept (at most the top 12 of the 23 mantissa bits for
// either format, subnormals included, where fewer are kept), the first dropped bit and whether any
// bit below it is set. So every sign and exponent with every top-12 mantissa pattern, times low
// 11-bit tails {0, 1, a middle value, all ones, and the single bits}, covers every boundary, every
// tie and its neighbours, the subnormals, +-0, +-inf, NaNs and +-max.
static bool check_encode_sample(Fp8Format f) {
    static const uint32_t tails[] = {0x000, 0x001, 0x002, 0x155, 0x3FF, 0x400, 0x401, 0x7FE, 0x7FF, 0x200, 0x100, 0x080};
    long long before = n_checked;
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t e = 0; e < 256; e++)
            for (uint32_t top = 0; top < 4096; top++)
                for (uint32_t t : tails)
                    if (!check_encode((sign << 31) | (e << 23) | (top << 11) | t, f)) return false;
    std::printf("ok: %s encode: %lld fp32 patterns bit-exact\n", name(f), n_checked - before);
    return true;
}

static bool check_encode_all(Fp8Format f) {
    uint32_t u = 0;
    do {
        if (!check_encode(u, f)) return false;
    } while (++u != 0);
    std::printf("ok: %s encode: all 2^32 fp32 patterns bit-exact\n", name(f));
    return true;
}

int main(int argc, char **argv) {
    bool all = argc > 1 && std::strcmp(argv[1], "--all") == 0;
    for (Fp8Format f : {FP8_E4M3, FP8_E5M2}) {
        if (!check_decode_all(f)) return 1;
        if (!(all ? check_encode_all(f) : check_encode_sample(f))) return 1;
    }
    return 0;
}
