// fsdp_device.h: chapter 3's FSDP module (chapters/03_fsdp/fsdp.h) on device buffers. The module
// does its few memory operations through an FsdpMemory table; this is the device's: the shards,
// gathered units, gradient buffers and AdamW moments in GPU memory, the module's own arithmetic as
// kernels (gpu/ops.h). Its all-gathers and reduce-scatters are comm.h's calls, which run on device
// buffers unchanged (gpu/comm_device.h: NCCL, or staged through host memory when ranks share a GPU).
#pragma once
#include "chapters/03_fsdp/fsdp.h"

extern const FsdpMemory gpu_fsdp_memory;
