// trace.h: per-rank timeline recording, written as one merged Perfetto trace.
//
//   trace_init(rank, "rank 0 [pp0 dp0 cp0 tp0]");
//   int compute = trace_track("compute");
//   trace_begin(compute, "attention", "fwd");
//   trace_arg_int(compute, "layer", 3);
//   trace_end(compute);
//   trace_counter("mem activations", bytes);
//   trace_write_pftrace("run.pftrace");
//
// Until trace_init() (or after trace_shutdown()) every recording call returns at once, so
// instrumented code costs one pointer test when tracing is off. Recording is thread-safe (one
// lock per process): the main thread records compute while the comm stream's worker thread
// records its own tracks. Each track must still be recorded from one thread only, since a slice's
// begin, args and end are separate calls; call trace_init()/trace_shutdown() while no other thread
// is between a begin and its end.
//
// Misuse is a bug in the instrumentation, so it ends the run with fatal() (exit status 1) and a
// message naming the track and slice: trace_end() or an arg/flow on a track with no open slice, an
// unknown track handle, or a timestamp earlier than the last one recorded on the same track (per
// track, time must not go backwards, which is what keeps nesting valid after merging). A slice
// still open when a trace is written is reported by the writer, which then returns false.
//
// Multi-rank: each rank records into its own buffer, trace_serialize() flattens it, rank 0 gathers
// the blobs, trace_deserialize()s them and passes them to trace_write_*_ranks() with each rank's
// clock offset. Timestamps in the files are shifted so the earliest event is at 1000 ns.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mem.h"

typedef struct TraceRankData TraceRankData;

// ---- recording (this process) ------------------------------------------------------------------
// Starts recording for `rank`; process_name labels the rank's process track. Calling it again
// drops what was recorded so far and starts over.
void trace_init(int rank, const char *process_name);
// Frees this process's buffer and disables recording.
void trace_shutdown(void);
bool trace_enabled(void);

// Handle of the thread track called `name` on this rank (created on first use; the same name gives
// the same handle). Returns 0 when tracing is disabled; handles must be taken after trace_init().
int trace_track(const char *name);

// Slices: on one track they must nest. category may be NULL.
void trace_begin(int track, const char *name, const char *category);
void trace_end(int track);
// The same with explicit timestamps (ns on the now_ns() clock), for times measured elsewhere.
void trace_begin_at(int track, const char *name, const char *category, int64_t ts_ns);
void trace_end_at(int track, int64_t ts_ns);

// Arguments of the innermost open slice on `track` (layer, microbatch, bytes, FLOPs, op, group).
void trace_arg_int(int track, const char *key, int64_t value);
void trace_arg_double(int track, const char *key, double value);
void trace_arg_str(int track, const char *key, const char *value);

// One sample of the counter track `name` (unit: bytes) on this rank's process.
void trace_counter(const char *name, double value);
void trace_counter_at(const char *name, double value, int64_t ts_ns);
// Matches MemObserver: install with mem_set_observer(trace_memory_observer) to draw memory by
// category as counters "mem <category>".
void trace_memory_observer(MemCategory category, size_t current_bytes);

// Flow arrows, from the innermost open slice on the sending track to the one on the receiving
// track; the two ranks must use the same id. Ids are global to the merged trace.
void trace_flow_out(int track, uint64_t flow_id);
void trace_flow_in(int track, uint64_t flow_id);
// Unique non-zero id for the seq-th message from src_rank to dst_rank. Ranks < 4096 and
// seq < 2^29, so every id stays below 2^53 (exact as a double in JSON readers).
uint64_t trace_flow_id(int src_rank, int dst_rank, uint64_t seq);

// ---- buffers: gather and merge -----------------------------------------------------------------
// This process's buffer (owned by the module; NULL when disabled).
const TraceRankData *trace_local(void);
// Flattens this process's buffer into a malloc'd blob (caller frees). False when disabled.
bool trace_serialize(void **blob, size_t *len);
bool trace_serialize_rank(const TraceRankData *data, void **blob, size_t *len);
// Rebuilds a buffer from a blob; NULL (and a message in err) if the blob is malformed.
TraceRankData *trace_deserialize(const void *blob, size_t len, char *err, size_t err_len);
void trace_rank_data_free(TraceRankData *data);  // for deserialized buffers; NULL is fine

typedef struct {
    size_t tracks, counters;       // thread tracks, counter tracks
    size_t slices, open_slices;    // open_slices: begun but not yet ended
    size_t args, flows, samples;   // samples: counter values
} TraceStats;
TraceStats trace_stats(const TraceRankData *data);  // all zero for NULL
int trace_rank(const TraceRankData *data);

// ---- writers -----------------------------------------------------------------------------------
typedef struct {
    const TraceRankData *data;
    int64_t clock_offset_ns;  // added to every timestamp of this rank
} TraceRankInput;

// Both write atomically (temporary file, then rename). On failure they return false and put the
// reason in err; the previous file at path is left untouched. Ranks must be distinct.
bool trace_write_pftrace_ranks(const char *path, const TraceRankInput *ranks, int n_ranks, char *err,
                               size_t err_len);
// PyTorch-profiler-shaped JSON; distributedInfo gives the first buffer's rank and world_size n_ranks.
bool trace_write_json_ranks(const char *path, const TraceRankInput *ranks, int n_ranks, char *err,
                            size_t err_len);
// This process's buffer alone, offset 0; failures are printed on stderr.
bool trace_write_pftrace(const char *path);
bool trace_write_json(const char *path);
// A failed write as one line on stderr: "trace: <err>", with the path in front when err does not
// begin with it (the file layer's messages do).
void trace_report_write_error(const char *path, const char *err);
