// no_cupti.c: activity.h where CUPTI is not built in (no libcupti found, or the CPU emulator of
// tests/gpu/emu): the per-kernel timeline is off, and says so; the marked regions stay.
#include <stdio.h>

#include "gpu/activity.h"

bool gpu_activity_start(char *why, size_t why_len) {
#ifdef GPU_EMULATOR
    snprintf(why, why_len, "the CPU emulator has no CUPTI");
#else
    snprintf(why, why_len, "this build has no CUPTI (libcupti was not found when it was compiled)");
#endif
    return false;
}
bool gpu_activity_running(void) { return false; }
void gpu_activity_flush(void) {}
void gpu_activity_stop(void) {}
