// comm_device.h: device buffers behind common/comm.h. After this, every comm_* call (all-reduce,
// all-gather, reduce-scatter, broadcast, all-to-all, send/recv, batches) takes GPU memory, so the
// chapters' parallel modules run unchanged on the device; the backend decides how it moves.
//
//   gpu_init(comm_local_rank() % devices);
//   gpu_comm_backend_init(GPU_COMM_AUTO);                       // collective over the world
//   CommHandle *h = comm_all_reduce_start(dp, grads, n, COMM_FLOAT32, COMM_AVG);   // device grads
//   ... more kernels ...                                         // overlap
//   comm_wait(h);                                                // later kernels see the average
//   ...
//   gpu_comm_backend_shutdown();                                 // before gpu_shutdown
//
// Two backends (common/comm.h says what start, wait and test mean for device buffers):
//   nccl    gpu/nccl.h: NCCL on one CUDA comm stream, ordered against the compute stream by events.
//           Needs a GPU per rank (NCCL refuses two ranks on one device) and a build with NCCL.
//   staged  gpu/comm_staged.c: each operation's inputs copied down into pinned host memory, the
//           MPI operation of common/comm.c on them, the outputs copied back up. Any number of ranks
//           per GPU, and the MPI backend's bit-reproducible rank-order reductions.
// GPU_COMM_AUTO takes NCCL where it is built and every host has a GPU per rank on it (asked of all
// ranks, so they agree), staged otherwise. The environment variable LLAMA_GPU_COMM=nccl|staged|auto
// overrides GPU_COMM_AUTO (the tests use it to run each backend; the emulator's NCCL, tests/gpu/emu,
// lets several ranks share its one device).
#pragma once
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/comm.h"

typedef enum { GPU_COMM_AUTO, GPU_COMM_NCCL, GPU_COMM_STAGED } GpuCommBackendKind;

// Chooses the backend and registers it with comm.h (comm_set_device_backend: NCCL makes a
// communicator for every live group). Collective over the world; after comm_init and gpu_init.
void gpu_comm_backend_init(GpuCommBackendKind kind);
// Unregisters it (NCCL's communicators and the staging memory are freed). Before gpu_shutdown.
void gpu_comm_backend_shutdown(void);
// "nccl" or "staged", and why it was chosen ("a GPU per rank", "LLAMA_GPU_COMM=staged", ...);
// "none" before init.
const char *gpu_comm_backend_name(void);
const char *gpu_comm_backend_reason(void);

// The two tables (gpu_nccl_backend is NULL in a build without NCCL: gpu/no_nccl.c).
const CommDeviceBackend *gpu_nccl_backend(void);
const CommDeviceBackend *gpu_staged_backend(void);

#ifdef __cplusplus
}
#endif
