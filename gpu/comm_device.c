// comm_device.c: which device backend common/comm.h hands device buffers to (gpu/comm_device.h).
#include "gpu/comm_device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "gpu/runtime.h"

static const CommDeviceBackend *registered;
static char reason[160] = "no backend registered";

// The kind the environment asks for (LLAMA_GPU_COMM), or `asked` when it says nothing or "auto".
// *who names who asked, for the log.
static GpuCommBackendKind kind_asked(GpuCommBackendKind asked, const char **who) {
    const char *env = getenv("LLAMA_GPU_COMM");
    *who = "asked for by the program";
    if (!env || !*env || strcmp(env, "auto") == 0) return asked;
    *who = strcmp(env, "nccl") == 0 ? "LLAMA_GPU_COMM=nccl" : "LLAMA_GPU_COMM=staged";
    if (strcmp(env, "nccl") == 0) return GPU_COMM_NCCL;
    if (strcmp(env, "staged") == 0) return GPU_COMM_STAGED;
    fatal_input("LLAMA_GPU_COMM=%s: expected nccl, staged or auto", env);
}

// True when no host has more ranks than GPUs. Every rank asks the others (a MAX over the world),
// so all of them take the same backend: one NCCL rank among staged ones would wait forever.
static bool gpu_per_rank_everywhere(void) {
    char why[256];
    int devices = gpu_device_count(why, sizeof why);
    int crowded = comm_local_size() > devices;
    comm_all_reduce(comm_world(), &crowded, 1, COMM_INT32, COMM_MAX);
    return !crowded;
}

static const CommDeviceBackend *choose(GpuCommBackendKind kind, const char *who) {
    const CommDeviceBackend *nccl = gpu_nccl_backend();
    if (kind == GPU_COMM_STAGED) {
        snprintf(reason, sizeof reason, "%s", who);
        return gpu_staged_backend();
    }
    if (kind == GPU_COMM_NCCL) {
        if (!nccl) fatal_input("%s: this build has no NCCL (the Makefile did not find it)", who);
#ifndef GPU_EMULATOR  // the emulator's NCCL lets ranks share its one device, which real NCCL refuses
        if (!gpu_per_rank_everywhere())
            fatal_input("%s: a host has more ranks than GPUs, and NCCL needs a GPU per rank (staged shares them)", who);
#endif
        snprintf(reason, sizeof reason, "%s", who);
        return nccl;
    }
    bool own_gpus = gpu_per_rank_everywhere();
    if (nccl && own_gpus) {
        snprintf(reason, sizeof reason, "a GPU per rank");
        return nccl;
    }
    snprintf(reason, sizeof reason, "%s", nccl ? "ranks share a GPU" : "built without NCCL");
    return gpu_staged_backend();
}

void gpu_comm_backend_init(GpuCommBackendKind kind) {
    if (registered) fatal("gpu_comm_backend_init: called twice");
    if (!gpu_initialized()) fatal("gpu_comm_backend_init: call gpu_init first");
    const char *who;
    GpuCommBackendKind chosen = kind_asked(kind, &who);
    registered = choose(chosen, who);
    comm_set_device_backend(registered);
}

void gpu_comm_backend_shutdown(void) {
    if (!registered) return;
    comm_set_device_backend(NULL);
    registered = NULL;
    snprintf(reason, sizeof reason, "no backend registered");
}

const char *gpu_comm_backend_name(void) { return registered ? registered->name : "none"; }
const char *gpu_comm_backend_reason(void) { return reason; }
