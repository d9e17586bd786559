// debug.c: sync-debug mode (gpu/runtime.h). Plain C, shared by the CUDA build and the emulator's.
#include <stdlib.h>
#include <string.h>

#include "gpu/runtime.h"

static int sync_debug = -1;  // -1: not decided yet, read from the environment at the first launch

void gpu_set_sync_debug(bool on) { sync_debug = on; }

bool gpu_sync_debug(void) {
    if (sync_debug < 0) {
        const char *env = getenv("LLAMA_CUDA_SYNC_DEBUG");
        sync_debug = env && *env && strcmp(env, "0") != 0;
    }
    return sync_debug;
}
