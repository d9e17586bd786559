// timeline.cu: regions of the compute stream as trace slices, timed by CUDA events (timeline.h).
#include <math.h>

#include <string>
#include <vector>

#include "gpu/activity.h"
#include "gpu/internal.cuh"
#include "gpu/timeline.h"

extern "C" {
#include "common/trace.h"
}

namespace {

struct Mark {
    bool begin;
    std::string name, category;                               // begin only
    std::vector<std::pair<std::string, int64_t>> int_args;  // begin only
    size_t event;                                           // index into events
};

std::vector<Mark> marks;           // since the last flush, in stream order
std::vector<size_t> open_regions;  // indices into marks of the open begins
std::vector<cudaEvent_t> events;   // a pool, reused after every flush
size_t events_used;
int64_t last_ts;                   // the track's clock must not go backwards, across flushes too

size_t record_event() {
    if (events_used == events.size()) {
        cudaEvent_t e;
        CUDA_CHECK(cudaEventCreate(&e));
        events.push_back(e);
    }
    CUDA_CHECK(cudaEventRecord(events[events_used], gpu_stream()));
    return events_used++;
}

}  // namespace

void gpu_timeline_begin(const char *name, const char *category) {
    if (!trace_enabled()) return;
    Mark m;
    m.begin = true;
    m.name = name;
    m.category = category ? category : "";
    m.event = record_event();
    open_regions.push_back(marks.size());
    marks.push_back(m);
}

void gpu_timeline_arg_int(const char *key, int64_t value) {
    if (!trace_enabled()) return;
    if (open_regions.empty()) fatal("gpu_timeline_arg_int(%s): no open region", key);
    marks[open_regions.back()].int_args.emplace_back(key, value);
}

void gpu_timeline_end(void) {
    if (!trace_enabled()) return;
    if (open_regions.empty()) fatal("gpu_timeline_end: no open region");
    open_regions.pop_back();
    Mark m;
    m.begin = false;
    m.event = record_event();
    marks.push_back(m);
}

// The marked regions, timed by their events against an anchor recorded now and waited for.
static void emit_regions(void) {
    size_t anchor = record_event();
    CUDA_CHECK(cudaEventSynchronize(events[anchor]));
    long long anchor_ns = now_ns();
    int track = trace_track("cuda:compute");
    for (const Mark &m : marks) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, events[m.event], events[anchor]));
        int64_t ts = anchor_ns - llround((double)ms * 1e6);
        if (ts < last_ts) ts = last_ts;  // a stream's events complete in order: only rounding could reorder them
        last_ts = ts;
        if (m.begin) {
            trace_begin_at(track, m.name.c_str(), m.category.c_str(), ts);
            for (const auto &arg : m.int_args) trace_arg_int(track, arg.first.c_str(), arg.second);
        } else {
            trace_end_at(track, ts);
        }
    }
    marks.clear();
    events_used = 0;
}

void gpu_timeline_flush(void) {
    if (!trace_enabled()) return;
    if (!open_regions.empty())
        fatal("gpu_timeline_flush: region '%s' is still open", marks[open_regions.back()].name.c_str());
    if (!marks.empty()) emit_regions();
    if (gpu_activity_running()) {  // CUPTI's records of everything finished, every stream's
        CUDA_CHECK(cudaDeviceSynchronize());
        gpu_activity_flush();
    }
}
