// cp_device.h: chapter 8's ring attention on device buffers. The context-parallel module
// (chapters/08_context_parallel/cp.h) runs its ring through a CpCompute table; this is the device's:
// chapter 3's device memory table (gpu/fsdp_device.h) for its buffers, copies, fills and sums, the
// fp32 FlashAttention-2 pair (gpu_attention_forward/backward, positions on the device) for each
// block, and gpu_attention_merge for folding a block into the running output. K/V and their
// gradients travel around the ring with the same comm.h calls as on the host, on device buffers.
//
//   ContextParallel *cp = cp_create(group, CP_RING, true, B, T, H, Hkv, hd, &gpu_cp_compute);
//   cp_attention_forward(cp, out, lse, q, k, v);   // device pointers, fp32
#pragma once
#include "chapters/08_context_parallel/cp.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const CpCompute gpu_cp_compute;
// The bf16 model's: its fp32 ring buffers hold bf16 values (exactly), and each block runs on the
// tensor-core kernels (gpu/attention_tc.cu) with fp32 results; merges and sums as gpu_cp_compute.
extern const CpCompute gpu_cp_compute_bf16;

#ifdef __cplusplus
}
#endif
