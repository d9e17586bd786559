// no_nccl.c: gpu/comm_device.h's NCCL backend where NCCL is not built in (the Makefile found no
// NCCL): there is none, so device buffers are staged through host memory.
#include "gpu/comm_device.h"

const CommDeviceBackend *gpu_nccl_backend(void) { return NULL; }
