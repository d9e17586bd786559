// trace_dist.h: the multi-rank side of tracing. Every rank records into its own buffer (trace.h);
// this module puts the ranks on one clock and merges their buffers into one timeline on rank 0.
//
//   comm_init(&argc, &argv, &(CommOptions){.trace = true});
//   trace_align_clocks(comm_world());            // once, before tracing starts (all ranks)
//   trace_init(rank, mesh->label);
//   ... train ...
//   TraceClockReport end = trace_align_clocks(comm_world());   // optional: end.max_drift_ns
//   trace_gather_and_write(comm_world(), "run.pftrace", "run.json");   // all ranks
//
// Clocks. now_ns() is CLOCK_MONOTONIC, whose zero differs from host to host. trace_align_clocks()
// measures each rank's offset against rank 0 by ping-pong: rank 0 reads t0 and sends it, rank r
// answers with its own reading tr, rank 0 reads t1 when the answer arrives. tr was read somewhere
// between t0 and t1 (causality), so offset = tr - (t0 + t1) / 2 is off by at most (t1 - t0) / 2,
// half the round trip, whatever the latency of each direction. Of ~10 rounds per rank the one with
// the shortest round trip is kept, as it has the tightest bound. The writers then subtract each
// rank's offset from its timestamps. Only the first alignment is used for that; later calls
// measure again and report how far the clocks drifted since (the error a constant correction
// makes at that point). Ranks on the same kernel as rank 0 (same boot id, same time namespace) share its
// CLOCK_MONOTONIC: trace_align_clocks() gives them offset 0 with error 0 rather than a
// measurement, which would only be right to within half a round trip and could draw a receive as
// ending before its send began. trace_align_clocks_with() (another clock) always measures.
//
// Comm slices: with CommOptions.trace, the ping-pong and the gather are comm operations too. The
// gather snapshots each buffer before it communicates, so its own operations never reach the file;
// an alignment made while tracing is on shows up as sends and receives on "comm:world".
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/trace.h"

typedef struct {
    int64_t offset_ns;  // this rank's clock minus rank 0's clock at the same instant
    int64_t rtt_ns;     // shortest round trip seen; |error of offset_ns| <= rtt_ns / 2
} TraceClockOffset;

typedef struct {
    int n_ranks;
    int64_t max_abs_offset_ns;  // largest |offset| over the ranks
    int64_t max_error_ns;       // largest error bound (half a rank's best round trip)
    int64_t max_drift_ns;       // largest |offset now - offset at the first alignment|; 0 the first time
} TraceClockReport;

// Collective over world (all ranks call it; the result is the same on every rank). Exits through
// the comm layer's timeout if a rank never answers.
TraceClockReport trace_align_clocks(Comm *world);
// The same with another clock than now_ns(): tests give ranks deliberately skewed clocks.
TraceClockReport trace_align_clocks_with(Comm *world, int64_t (*clock_ns)(void));
// Offset of world rank `rank` from the first alignment (any rank may ask); {0, 0} before it or
// for a rank outside the world that was aligned.
TraceClockOffset trace_clock_offset(int rank);
// Forgets every alignment, so the next call is a first one again.
void trace_clock_reset(void);

// What rank 0 writes; a NULL path is skipped.
typedef struct {
    const char *pftrace_path;  // native Perfetto protobuf
    const char *json_path;     // one Chrome-trace JSON with every rank
    const char *hta_dir;       // one PyTorch-profiler-shaped JSON per rank (trace_write_hta_dir)
} TraceOutputs;

// Collective over world. Each rank serializes its buffer (nothing when its tracing is off), rank 0
// gathers the blobs (sizes first, then bytes), applies the clock offsets and writes the files.
// Only rank 0's outputs/paths are used (other ranks may pass NULL). Returns, on every rank, whether rank 0 wrote everything asked for; false (with a line on stderr
// from rank 0) when a write failed or no rank was tracing.
bool trace_gather_and_write_outputs(Comm *world, const TraceOutputs *outputs);
bool trace_gather_and_write(Comm *world, const char *pftrace_path, const char *json_path);

// Holistic Trace Analysis input, written from buffers already gathered (no communication, so it
// also works on buffers fabricated in one process). Creates dir if needed and writes
// dir/rank<N>.json for each rank: HTA reads a directory of PyTorch-profiler traces, one per rank,
// and only looks at GPU kernels, so the timeline is mapped onto two pretend streams:
//   - top-level slices of the "compute" track become kernels on stream 7, named as recorded;
//   - top-level slices of every "comm:<group>" track become kernels on stream 8 named
//     "ncclDevKernel_<name>" (HTA 0.5 counts a kernel as communication when its name matches
//     ^nccl.*Kernel, as real NCCL kernels' names do);
//   - everything else (nested slices, other tracks, counters, flows) is left out.
// Kernels keep their args and get "stream" and "device" (= the rank). Times are those of the merged
// JSON (same clock shift for all ranks). Files of other ranks already in dir are not removed.
bool trace_write_hta_dir(const char *dir, const TraceRankInput *ranks, int n_ranks, char *err, size_t err_len);
