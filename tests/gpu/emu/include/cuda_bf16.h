// cuda_bf16.h, the emulator's: the 2-byte bf16 type and its conversions, from gpu/numerics.h (which
// the host tests hold bit-identical to cvt.rn.bf16.f32).
#pragma once
#include "cuda_runtime.h"
#include "gpu/numerics.h"

struct __nv_bfloat16 {
    unsigned short x;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{bf16_bits_from_f32(f)}; }
inline float __bfloat162float(__nv_bfloat16 b) { return f32_from_bf16_bits(b.x); }
// The bits themselves, both ways (the tensor-core kernels pack two bf16 into one 32-bit register).
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16{bits}; }
