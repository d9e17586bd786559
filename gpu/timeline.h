// timeline.h: the GPU's side of this rank's trace (common/trace.h). Regions of work queued on the
// compute stream become slices on the thread track "cuda:compute" of the rank's process track,
// next to the host's "compute" and "comm:<group>" tracks, in the same merged Perfetto file.
//
//   gpu_timeline_begin("block fwd", "forward");  gpu_timeline_arg_int("layer", l);
//   ... kernels ...
//   gpu_timeline_end();
//   gpu_timeline_flush();   // before trace_write_*: waits for the stream, emits the slices
//
// Timing is by CUDA events recorded on the compute stream at each begin and end: they time the
// regions we mark, at the cost of two event records each, and work wherever CUDA does. CUPTI's
// activity records (activity.h), where they can be had, add every kernel on its own stream's track.
// At flush one more event is recorded and waited for, and the host clock read then (now_ns) anchors
// the others: each event's time is that instant minus its elapsed time to the anchor. Regions nest like trace_begin/trace_end. With tracing off every call returns at once.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void gpu_timeline_begin(const char *name, const char *category);
void gpu_timeline_arg_int(const char *key, int64_t value);  // on the innermost open region
void gpu_timeline_end(void);
// Waits for the compute stream and records every region marked since the last flush as a slice
// on "cuda:compute"; with CUPTI recording (activity.h), waits for the device and adds the slices of
// every kernel, copy and fill it ran, per stream. Every region must be closed.
void gpu_timeline_flush(void);

#ifdef __cplusplus
}
#endif
