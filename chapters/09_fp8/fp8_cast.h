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
#include <stdint.h>

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
