// cp_device.c: the CpCompute table of device buffers (see cp_device.h). Every entry is queued on the
// compute stream, so the ring's blocks, merges and sums run in order with the transfers comm.h
// orders against that stream.
#include "gpu/cp_device.h"

#include "gpu/fsdp_device.h"
#include "gpu/ops.h"

const CpCompute gpu_cp_compute = {&gpu_fsdp_memory, gpu_attention_forward, gpu_attention_backward,
                                  gpu_attention_merge};
