// test_trace_dist.c: clock alignment, gathering and the merged writers of common/trace_dist.c.
//
//   test_trace_dist                      one process: self-checks, 3 ranks fabricated in-process
//   mpirun -n N test_trace_dist --out D  N ranks: clock checks, then D/synthetic.{pftrace,json},
//                                        D/synthetic_hta/ and D/real.{pftrace,json}, D/real_hta/
//   test_trace_dist --fabricate N --out D   the synthetic files for N ranks without MPI
//
// The synthetic timeline has known numbers (tests/t_trace_dist.sh checks traces/trace_summary.py
// and Holistic Trace Analysis against them). Each rank records it with trace_begin_at/trace_end_at
// on a clock deliberately skewed by rank * SKEW_NS, starting at the same instant of rank 0's clock
// (converted with the measured offset): once the writer has corrected the offsets, every rank's
// first slice must sit at the same time in the file. The real timeline runs real comm operations
// (an all-reduce overlapped with compute, a ring exchange) with comm tracing on.
// Failures print one line and exit 1 (no Check: its fork does not mix with MPI).
#define _GNU_SOURCE  // nftw
#include <cJSON.h>
#include <errno.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/comm.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/trace.h"
#include "common/trace_dist.h"

#define US ((int64_t)1000)
#define SKEW_NS (2500 * US + 1234)  // rank r's test clock runs r * SKEW_NS ahead of now_ns()
#define FABRICATED_RANKS 3

static int failures;
#define EXPECT(cond, ...)                                                    \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "test_trace_dist: FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
            failures++;                                                      \
        }                                                                    \
    } while (0)

static int64_t skew_of_this_rank;
static int64_t skewed_clock(void) { return (int64_t)now_ns() + skew_of_this_rank; }

// ---- the synthetic timeline (microseconds from base; r = rank) ------------------------------------
//   compute     forward [0,100) holding attention [10,50); backward [150,350); optimizer [400+20r,450+20r)
//   comm:dp     all_reduce [80,160); all_reduce [300,420) holding chunk [310,330)
//   comm:pp     send [500+20r,520+20r)
//   data        load [-30,-10)   (neither compute nor comm: outside every figure)
// plus one counter sample at -100. tests/t_trace_dist.sh derives the expected figures from this.

static void slice(int track, const char *name, const char *category, int64_t base, int64_t begin_us, int64_t end_us) {
    trace_begin_at(track, name, category, base + begin_us * US);
    trace_end_at(track, base + end_us * US);
}

static void record_synthetic(int rank, int64_t base) {
    int compute = trace_track("compute"), dp = trace_track("comm:dp"), pp = trace_track("comm:pp");
    int data = trace_track("data");
    int64_t late = 20 * rank;
    trace_counter_at("mem activations", 1 << 20, base - 100 * US);
    slice(data, "load", NULL, base, -30, -10);
    trace_begin_at(compute, "forward", "compute", base);
    trace_arg_int(compute, "layer", 0);
    slice(compute, "attention", "compute", base, 10, 50);
    trace_end_at(compute, base + 100 * US);
    slice(compute, "backward", "compute", base, 150, 350);
    slice(compute, "optimizer", "compute", base, 400 + late, 450 + late);
    slice(dp, "all_reduce", "comm", base, 80, 160);
    trace_begin_at(dp, "all_reduce", "comm", base + 300 * US);
    trace_arg_int(dp, "bytes", 4096);
    slice(dp, "chunk", "comm", base, 310, 330);
    trace_end_at(dp, base + 420 * US);
    slice(pp, "send", "comm", base, 500 + late, 520 + late);
}

static void start_rank_trace(int rank) {
    char label[64];
    snprintf(label, sizeof label, "rank %d [synthetic]", rank);
    trace_init(rank, label);
}

// ---- outputs -------------------------------------------------------------------------------------

typedef struct {
    char pftrace[4096], json[4096], hta[4096];
} Paths;

static Paths paths_in(const char *dir, const char *stem) {
    Paths p;
    snprintf(p.pftrace, sizeof p.pftrace, "%s/%s.pftrace", dir, stem);
    snprintf(p.json, sizeof p.json, "%s/%s.json", dir, stem);
    snprintf(p.hta, sizeof p.hta, "%s/%s_hta", dir, stem);
    return p;
}

static TraceOutputs outputs_of(const Paths *p) {
    return (TraceOutputs){.pftrace_path = p->pftrace, .json_path = p->json, .hta_dir = p->hta};
}

// ---- one process: ranks fabricated by recording, serializing and starting over ----------------

static void write_fabricated(const char *dir, int n) {
    TraceRankInput inputs[64];
    if (n < 1 || n > 64) fatal("--fabricate: 1 to 64 ranks, not %d", n);
    int64_t t0 = (int64_t)now_ns();
    for (int r = 0; r < n; r++) {
        start_rank_trace(r);
        record_synthetic(r, t0 + r * SKEW_NS);  // rank 0's instant t0 on rank r's skewed clock
        void *blob;
        size_t len;
        trace_serialize(&blob, &len);
        char err[256];
        inputs[r] = (TraceRankInput){.data = trace_deserialize(blob, len, err, sizeof err), .clock_offset_ns = -r * SKEW_NS};
        EXPECT(inputs[r].data, "rank %d blob: %s", r, err);
        free(blob);
    }
    trace_shutdown();
    Paths p = paths_in(dir, "synthetic");
    char err[512];
    EXPECT(trace_write_pftrace_ranks(p.pftrace, inputs, n, err, sizeof err), "%s", err);
    EXPECT(trace_write_json_ranks(p.json, inputs, n, err, sizeof err), "%s", err);
    EXPECT(trace_write_hta_dir(p.hta, inputs, n, err, sizeof err), "%s", err);
    for (int r = 0; r < n; r++) trace_rank_data_free((TraceRankData *)inputs[r].data);
}

// What an HTA file must hold: the rank line HTA's regex reads, three compute and three comm
// kernels (nested slices and the data track left out), comm named for HTA, and the first kernel
// at the same time on every rank (the skew corrected). Returns that first kernel's ts.
static double check_hta_file(const char *dir, int rank) {
    char path[4200], err[256];
    snprintf(path, sizeof path, "%s/rank%d.json", dir, rank);
    size_t size;
    char *text = (char *)read_whole_file(path, &size, err, sizeof err);
    EXPECT(text, "%s", err);
    if (!text) return -1;
    char want[64];
    snprintf(want, sizeof want, "\"distributedInfo\": {\"rank\": %d,", rank);
    EXPECT(strstr(text, want), "%s: no %s", path, want);
    cJSON *doc = cJSON_ParseWithLength(text, size);
    EXPECT(doc, "%s does not parse", path);
    int kernels[9] = {0};
    double first_ts = -1;
    const cJSON *event;
    cJSON_ArrayForEach(event, cJSON_GetObjectItemCaseSensitive(doc, "traceEvents")) {
        if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(event, "ph")), "X") != 0) continue;
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(event, "name"));
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(event, "args");
        int stream = (int)cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(args, "stream"));
        EXPECT(stream == 7 || stream == 8, "%s: kernel %s on stream %d", path, name, stream);
        EXPECT((stream == 8) == (strncmp(name, "ncclDevKernel_", 14) == 0), "%s: kernel %s on stream %d", path, name,
               stream);
        if (stream == 7 || stream == 8) kernels[stream]++;
        if (first_ts < 0) first_ts = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(event, "ts"));
    }
    EXPECT(kernels[7] == 3 && kernels[8] == 3, "%s: %d compute and %d comm kernels, want 3 and 3", path, kernels[7],
           kernels[8]);
    cJSON_Delete(doc);
    free(text);
    return first_ts;
}

static void check_hta_dir(const char *dir, int n) {
    double first0 = check_hta_file(dir, 0);
    for (int r = 1; r < n; r++) {
        double first = check_hta_file(dir, r);
        EXPECT(first == first0, "rank %d starts at %.3f us, rank 0 at %.3f us: skew not corrected", r, first, first0);
    }
}

static void self_check_fabricated(const char *dir) {
    write_fabricated(dir, FABRICATED_RANKS);
    check_hta_dir(paths_in(dir, "synthetic").hta, FABRICATED_RANKS);
    char err[512];
    EXPECT(!trace_write_hta_dir("/proc/no/such/dir", NULL, 0, err, sizeof err), "wrote HTA files into /proc");
}

// World of one: alignment is trivial, the gather gathers this rank, and without tracing it fails.
static void self_check_world_of_one(const char *dir) {
    Comm *world = comm_world();
    TraceClockReport report = trace_align_clocks(world);
    EXPECT(report.n_ranks == 1 && report.max_abs_offset_ns == 0 && report.max_error_ns == 0,
           "one rank: offset %" PRId64 " error %" PRId64, report.max_abs_offset_ns, report.max_error_ns);
    start_rank_trace(0);
    record_synthetic(0, (int64_t)now_ns());
    Paths p = paths_in(dir, "single");
    TraceOutputs out = outputs_of(&p);
    EXPECT(trace_gather_and_write_outputs(world, &out), "gather of one rank failed");
    EXPECT(access(p.pftrace, R_OK) == 0 && access(p.json, R_OK) == 0, "%s or %s missing", p.pftrace, p.json);
    check_hta_file(p.hta, 0);
    trace_shutdown();
    fprintf(stderr, "test_trace_dist: a 'no rank was tracing' line is expected next\n");
    EXPECT(!trace_gather_and_write(world, p.pftrace, NULL), "gather without tracing claimed success");
}

// ---- under mpirun ----------------------------------------------------------------------------------

static void print_offsets(Comm *world, const char *what) {
    if (comm_rank(world) != 0) return;
    for (int r = 0; r < comm_size(world); r++) {
        TraceClockOffset o = trace_clock_offset(r);
        printf("clock %s: rank %d offset %+" PRId64 " ns, best rtt %" PRId64 " ns (error <= %" PRId64 " ns)\n", what,
               r, o.offset_ns, o.rtt_ns, o.rtt_ns / 2);
    }
}

// The skewed clocks' true offsets are known (rank * SKEW_NS, ranks sharing one host), so each
// estimate must fall within its own bound: half its round trip.
static void check_skewed_alignment(Comm *world) {
    trace_clock_reset();
    skew_of_this_rank = comm_rank(world) * SKEW_NS;
    TraceClockReport first = trace_align_clocks_with(world, skewed_clock);
    print_offsets(world, "skewed");
    for (int r = 0; r < comm_size(world); r++) {
        TraceClockOffset o = trace_clock_offset(r);
        EXPECT(llabs(o.offset_ns - r * SKEW_NS) <= o.rtt_ns / 2,
               "rank %d: offset %" PRId64 " ns, true %" PRId64 " ns, bound %" PRId64 " ns", r, o.offset_ns,
               r * SKEW_NS, o.rtt_ns / 2);
    }
    // Again: no drift beyond the two measurements' error bounds.
    TraceClockReport again = trace_align_clocks_with(world, skewed_clock);
    EXPECT(again.max_drift_ns <= first.max_error_ns + again.max_error_ns,
           "drift %" PRId64 " ns exceeds the error bounds %" PRId64 " + %" PRId64, again.max_drift_ns,
           first.max_error_ns, again.max_error_ns);
    if (comm_rank(world) == 0)
        printf("clock skewed: max |offset| %" PRId64 " ns, max error %" PRId64 " ns, drift on re-alignment %" PRId64
               " ns\n",
               first.max_abs_offset_ns, first.max_error_ns, again.max_drift_ns);
}

// Every rank starts its layout at the same instant: rank 0's clock reading t0, moved onto its own
// clock with its measured offset.
static void write_synthetic_mpi(Comm *world, const char *dir) {
    int rank = comm_rank(world);
    int64_t t0 = skewed_clock();
    comm_broadcast(world, &t0, sizeof t0, COMM_BYTE, 0);
    start_rank_trace(rank);
    record_synthetic(rank, t0 + trace_clock_offset(rank).offset_ns);
    Paths p = paths_in(dir, "synthetic");
    TraceOutputs out = outputs_of(&p);
    EXPECT(trace_gather_and_write_outputs(world, &out), "synthetic gather failed");
    trace_shutdown();
    if (rank == 0) check_hta_dir(p.hta, comm_size(world));
}

static void spin_ns(int64_t duration) {
    volatile double x = 1;
    for (int64_t end = (int64_t)now_ns() + duration; (int64_t)now_ns() < end;) x = x * 1.0000001 + 1e-9;
}

// Real comm operations with comm tracing on: an all-reduce running under a compute slice, then a
// ring exchange (flows between neighbours). The results are checked, not just the timeline.
static void write_real_mpi(Comm *world, const char *dir) {
    int rank = comm_rank(world), n = comm_size(world);
    trace_clock_reset();
    trace_align_clocks(world);  // the real clock now; before trace_init, so not in the trace
    char label[64];
    snprintf(label, sizeof label, "rank %d [real]", rank);
    trace_init(rank, label);
    int compute = trace_track("compute");
    enum { COUNT = 1 << 16 };
    float *buf = malloc(COUNT * sizeof *buf);
    for (int step = 0; step < 3; step++) {
        for (int i = 0; i < COUNT; i++) buf[i] = (float)(rank + i);
        CommHandle *h = comm_all_reduce_start(world, buf, COUNT, COMM_FLOAT32, COMM_SUM);
        trace_begin(compute, "matmul", "compute");
        spin_ns(1000 * US);
        trace_end(compute);
        comm_wait(h);
        for (int i = 0; i < COUNT; i += 4099)
            EXPECT(buf[i] == (float)(n * (n - 1) / 2 + n * i), "all_reduce[%d] = %g", i, buf[i]);
        int32_t mine = rank * 10 + step, left = -1;
        CommP2P ring[2] = {{COMM_SEND, &mine, 1, COMM_INT32, (rank + 1) % n, step},
                           {COMM_RECV, &left, 1, COMM_INT32, (rank + n - 1) % n, step}};
        comm_wait(comm_batch_start(world, ring, 2));
        EXPECT(left == ((rank + n - 1) % n) * 10 + step, "ring: got %d from the left", left);
        trace_begin(compute, "optimizer", "compute");
        spin_ns(300 * US);
        trace_end(compute);
    }
    free(buf);
    Paths p = paths_in(dir, "real");
    TraceOutputs out = outputs_of(&p);
    EXPECT(trace_gather_and_write_outputs(world, &out), "real gather failed");
    trace_shutdown();
}

// ---- main --------------------------------------------------------------------------------------

// Scratch files go to a fresh folder (the pid keeps parallel runs apart), removed at the end.
static const char *make_scratch_dir(char *buf, size_t size) {
    const char *tmp = getenv("TEST_TMP") ? getenv("TEST_TMP") : "/tmp";
    snprintf(buf, size, "%s/test_trace_dist_%d", tmp, (int)getpid());
    if (mkdir(buf, 0777) != 0) fatal("%s: cannot create (%s)", buf, strerror(errno));
    return buf;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tree(const char *dir) { nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

int main(int argc, char **argv) {
    log_set_program("test_trace_dist");
    const char *out = NULL;
    int fabricate = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out = argv[++i];
        else if (strcmp(argv[i], "--fabricate") == 0 && i + 1 < argc)
            fabricate = atoi(argv[++i]);
        else
            fatal_input("usage: test_trace_dist [--out DIR] [--fabricate N]");
    }
    if (fabricate) {  // no MPI at all
        write_fabricated(out ? out : ".", fabricate);
        return failures ? 1 : 0;
    }
    comm_init(&argc, &argv, &(CommOptions){.timeout_seconds = 60, .trace = true});
    Comm *world = comm_world();
    int n_ranks = comm_size(world);
    char scratch[4096];
    const char *dir = out ? out : make_scratch_dir(scratch, sizeof scratch);
    if (n_ranks == 1) {
        self_check_fabricated(dir);
        self_check_world_of_one(dir);
    } else {
        trace_align_clocks(world);
        print_offsets(world, "real");
        check_skewed_alignment(world);
        write_synthetic_mpi(world, dir);
        write_real_mpi(world, dir);
    }
    comm_finalize();
    if (!out) remove_tree(dir);
    if (!failures && n_ranks == 1) printf("test_trace_dist: OK (one rank; run under mpirun for more)\n");
    return failures ? 1 : 0;
}
