// fp8_cast.h: the two FP8 formats of the OCP spec (as NVIDIA's cuda_fp8.h implements them), as
// bytes, converted from fp32 and back. No dependencies: the cast oracle (tests/fp8_oracle.cpp)
// compiles this file next to cuda_fp8.h and compares the two bit for bit.
//
//   format  bits      bias  max normal       min normal  min subnormal  inf   NaN
//   E4M3    s eeee mmm   7  448   (0x7E)     2^-6        2^-9           none  s.1111.111
//   E5M2    s eeeee mm  15  57344 (0x7B)     2^-14       2^-16          yes   s.11111.{01,10,11}
//
// fp32 -> fp8 rounds to nearest, ties to even, from the exact value, and saturates: a finite value
// past the largest one, and +-inf, give +-max (cuda_fp8.h's __NV_SATFINITE). NaN gives 0x7F in both
// formats (cuda_fp8.h drops the sign of a NaN). -0 keeps its sign.
// fp8 -> fp32 is exact (every FP8 value is an fp32 value); NaN gives the NaN cuda_fp8.h gives
// (0x7FFFFFFF, by way of fp16).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef enum { FP8_E4M3, FP8_E5M2 } Fp8Format;

typedef struct {
    const char *name;
    int exp_bits, man_bits, bias;
    double max;       // largest finite value
    uint8_t max_code; // its bits (positive)
} Fp8FormatInfo;

const Fp8FormatInfo *fp8_format_info(Fp8Format f);
uint8_t fp8_from_float(float x, Fp8Format f);
float fp8_to_float(uint8_t code, Fp8Format f);

// The FP8 value nearest x, as an fp32 value: fp8_to_float(fp8_from_float(x, f), f) bit for bit,
// without going through the code, for the emulated GEMMs' inner loops (where the pair costs more
// than the matmul). On the fp32 bits: from the smallest normal up, round the mantissa to the
// format's bits, ties to even (adding 2^(d-1) - 1 plus the last kept bit, then clearing the d
// dropped bits; a carry moves into the next binade by itself), and saturate to +-max (also inf);
// below it, round to the subnormal quantum (an exact scaling by a power of two, then rintf: ties to
// even). The sign is kept (also on zero); NaN gives fp8_to_float's NaN. tests/test_fp8_cast.c checks
// it against the pair over the cast's whole sample.
#ifdef __CUDACC__
#define FP8_HOST_DEVICE __host__ __device__  // gpu/fp8.cu's kernels use it too
#else
#define FP8_HOST_DEVICE
#endif
static inline FP8_HOST_DEVICE float fp8_round_to_grid(float x, Fp8Format f) {
    const int dropped = f == FP8_E4M3 ? 23 - 3 : 23 - 2;
    const float max = f == FP8_E4M3 ? 448.0f : 57344.0f;
    const float min_normal = f == FP8_E4M3 ? 0x1p-6f : 0x1p-14f, quanta_per_unit = f == FP8_E4M3 ? 0x1p9f : 0x1p16f;
    uint32_t u, a, r_bits;
    memcpy(&u, &x, sizeof u);
    a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) {
        uint32_t nan_bits = 0x7FFFFFFFu;
        float nan;
        memcpy(&nan, &nan_bits, sizeof nan);
        return nan;
    }
    float magnitude, r;
    memcpy(&magnitude, &a, sizeof magnitude);
    if (magnitude >= min_normal) {
        r_bits = (a + ((1u << (dropped - 1)) - 1) + ((a >> dropped) & 1)) & ~((1u << dropped) - 1);
        memcpy(&r, &r_bits, sizeof r);
        if (r > max) r = max;
    } else {
        r = rintf(magnitude * quanta_per_unit) / quanta_per_unit;
    }
    memcpy(&r_bits, &r, sizeof r_bits);
    r_bits |= u & 0x80000000u;
    memcpy(&r, &r_bits, sizeof r);
    return r;
}
