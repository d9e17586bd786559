// bf16.h: bfloat16 as 16 bits, and its conversion from and to fp32, for every compiler in the
// project: the GPU kernels (gpu/numerics.h), the CPU emulator of them, and the host code that moves
// weights as bf16 (chapter 3's bf16 all-gather). One rounding rule everywhere: round to nearest,
// ties to even, bit-identical to cvt.rn.bf16.f32 / cuda_bf16.h (tests/test_gpu_host.c checks it).
#pragma once
#include <stdint.h>
#include <string.h>

#include "common/hd.h"

// ---- bf16 ------------------------------------------------------------------------------------------
// bf16 is the top half of a float: sign, 8 exponent bits, 7 mantissa bits. Same exponent range as
// float, so conversion never overflows except by rounding up past the largest finite value.
GPU_HD uint32_t f32_as_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}
GPU_HD float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// Round to nearest, ties to even. Adding 0x7FFF + (the bit that will become the last kept one)
// carries into the kept half exactly when the dropped half is above one half, or equal to it with
// an odd kept half. The carry may ripple into the exponent (rounding up to the next binade, or
// from the largest finite value to infinity): that is correct IEEE rounding. Subnormals are kept
// (no flush to zero). Any NaN becomes the canonical quiet NaN 0x7FFF, as the hardware does.
GPU_HD uint16_t bf16_bits_from_f32(float x) {
    uint32_t u = f32_as_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    uint32_t kept_lsb = (u >> 16) & 1u;
    return (uint16_t)((u + 0x7fffu + kept_lsb) >> 16);
}
GPU_HD float f32_from_bf16_bits(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }
// x rounded to the nearest bf16, as a float (what a bf16 store followed by a load gives).
GPU_HD float bf16_round(float x) { return f32_from_bf16_bits(bf16_bits_from_f32(x)); }
