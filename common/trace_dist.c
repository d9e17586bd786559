#include "trace_dist.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "log.h"
#include "rng.h"

// Tags of this module's point-to-point messages; any value >= 0 below MPI's guaranteed 32767.
enum { TAG_PING = 31001, TAG_PONG = 31002, TAG_BLOB = 31003 };

// ================================================================================================
// Clock alignment
// ================================================================================================

#define ALIGN_ROUNDS 10

// The first alignment's table, kept for the writers; n == 0 until there is one.
static struct {
    int n;
    TraceClockOffset *first;
} clocks;

static int64_t now_clock(void) { return (int64_t)now_ns(); }

// Rank 0's side with one peer. Of all rounds the one with the shortest round trip wins: its
// midpoint is the tightest bracket around the moment the peer read its clock.
static TraceClockOffset ping_peer(Comm *world, int peer, int64_t (*clock_ns)(void)) {
    TraceClockOffset best = {.offset_ns = 0, .rtt_ns = INT64_MAX};
    for (int round = 0; round < ALIGN_ROUNDS; round++) {
        int64_t t0 = clock_ns(), tr;
        comm_send(world, &t0, sizeof t0, COMM_BYTE, peer, TAG_PING);
        comm_recv(world, &tr, sizeof tr, COMM_BYTE, peer, TAG_PONG);
        int64_t t1 = clock_ns();
        // t0 + (t1 - t0) / 2 rather than (t0 + t1) / 2: skewed test clocks may sit near INT64_MAX.
        if (t1 - t0 < best.rtt_ns) best = (TraceClockOffset){.offset_ns = tr - (t0 + (t1 - t0) / 2), .rtt_ns = t1 - t0};
    }
    return best;
}

// A peer's side: answer every ping with a fresh reading of its own clock.
static void answer_pings(Comm *world, int64_t (*clock_ns)(void)) {
    for (int round = 0; round < ALIGN_ROUNDS; round++) {
        int64_t t0;
        comm_recv(world, &t0, sizeof t0, COMM_BYTE, 0, TAG_PING);
        int64_t tr = clock_ns();
        comm_send(world, &tr, sizeof tr, COMM_BYTE, 0, TAG_PONG);
    }
}

// Drift compares with the first alignment of a world of the same size (none: drift 0).
static TraceClockReport report_of(const TraceClockOffset *now, int n) {
    TraceClockReport report = {.n_ranks = n};
    for (int r = 0; r < n; r++) {
        int64_t offset = llabs(now[r].offset_ns), error = now[r].rtt_ns / 2;
        int64_t drift = clocks.n == n ? llabs(now[r].offset_ns - clocks.first[r].offset_ns) : 0;
        if (offset > report.max_abs_offset_ns) report.max_abs_offset_ns = offset;
        if (error > report.max_error_ns) report.max_error_ns = error;
        if (drift > report.max_drift_ns) report.max_drift_ns = drift;
    }
    return report;
}

// Identifies the clock a rank reads: processes under one kernel, in one time namespace, read one
// CLOCK_MONOTONIC (a time namespace, Linux 5.6 on, shifts it: `unshare -T --monotonic 5`). The
// boot id changes at every boot and differs between machines; the host name is the fallback; the
// namespace is the link /proc/self/ns/time names (none on older kernels: the same for all).
static uint64_t clock_domain(void) {
    char id[512] = {0};
    FILE *fp = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!fp || !fgets(id, 256, fp)) gethostname(id, 255);
    if (fp) fclose(fp);
    size_t used = strlen(id);
    ssize_t n = readlink("/proc/self/ns/time", id + used, sizeof id - 1 - used);
    if (n > 0) id[used + (size_t)n] = 0;
    return hash_string(id);
}

// Ranks that share rank 0's clock get offset 0 and error 0: exact, where a measurement would only
// be right to within half a round trip (tens of microseconds here, more than the gap between a
// send and its receive, which could then be drawn in the wrong order).
static void zero_same_clock_offsets(Comm *world, TraceClockOffset *table) {
    int n = comm_size(world);
    uint64_t mine = clock_domain(), *domains = calloc((size_t)n, sizeof *domains);
    if (!domains) fatal("trace_align_clocks: out of memory for %d ranks", n);
    comm_all_gather(world, &mine, domains, sizeof mine, COMM_BYTE);
    for (int r = 1; r < n; r++)
        if (domains[r] == domains[0]) table[r] = (TraceClockOffset){0, 0};
    free(domains);
}

static TraceClockReport align_clocks(Comm *world, int64_t (*clock_ns)(void), bool trust_shared_clock) {
    int n = comm_size(world);
    TraceClockOffset *table = calloc((size_t)n, sizeof *table);
    if (!table) fatal("trace_align_clocks: out of memory for %d ranks", n);
    // Peers are measured one after another, so each ping meets a peer that waits for nothing else.
    if (comm_rank(world) == 0)
        for (int r = 1; r < n; r++) table[r] = ping_peer(world, r, clock_ns);
    else
        answer_pings(world, clock_ns);
    // Every rank gets the table: then any rank can write a trace or print the report.
    comm_broadcast(world, table, (size_t)n * sizeof *table, COMM_BYTE, 0);
    if (trust_shared_clock) zero_same_clock_offsets(world, table);
    TraceClockReport report = report_of(table, n);
    if (clocks.n == n) {
        free(table);
    } else {  // the first alignment (or one over a different world): it becomes the reference
        free(clocks.first);
        clocks.first = table;
        clocks.n = n;
    }
    return report;
}

TraceClockReport trace_align_clocks(Comm *world) { return align_clocks(world, now_clock, true); }
TraceClockReport trace_align_clocks_with(Comm *world, int64_t (*clock_ns)(void)) {
    return align_clocks(world, clock_ns, false);
}

TraceClockOffset trace_clock_offset(int rank) {
    if (rank < 0 || rank >= clocks.n) return (TraceClockOffset){0, 0};
    return clocks.first[rank];
}

void trace_clock_reset(void) {
    free(clocks.first);
    clocks.first = NULL;
    clocks.n = 0;
}

// ================================================================================================
// Gathering on rank 0
// ================================================================================================

// Rank 0 gets every rank's blob in blobs[r] (NULL, length 0, where that rank was not tracing).
// Sizes go first (all-gather) so rank 0 can allocate; then each rank sends its bytes to rank 0.
static void gather_blobs(Comm *world, void *mine, size_t my_len, void **blobs, uint64_t *lens) {
    uint64_t len = my_len;
    comm_all_gather(world, &len, lens, sizeof len, COMM_BYTE);
    int me = comm_rank(world), n = comm_size(world);
    if (me != 0) {
        if (len) comm_send(world, mine, (size_t)len, COMM_BYTE, 0, TAG_BLOB);
        return;
    }
    blobs[0] = mine;
    for (int r = 1; r < n; r++) {
        if (!lens[r]) continue;
        blobs[r] = malloc((size_t)lens[r]);
        if (!blobs[r]) fatal("trace_gather_and_write: out of memory for %llu bytes from rank %d",
                             (unsigned long long)lens[r], r);
        comm_recv(world, blobs[r], (size_t)lens[r], COMM_BYTE, r, TAG_BLOB);
    }
}

// The buffers of the ranks that were tracing, each with the correction that puts it on rank 0's
// clock. Returns how many; a corrupt blob is a bug, so it ends the run.
static int decode_blobs(void **blobs, const uint64_t *lens, int n, TraceRankInput *inputs) {
    int count = 0;
    for (int r = 0; r < n; r++) {
        if (!lens[r]) continue;
        char err[256];
        TraceRankData *data = trace_deserialize(blobs[r], (size_t)lens[r], err, sizeof err);
        if (!data) fatal("trace_gather_and_write: blob of rank %d: %s", r, err);
        inputs[count++] = (TraceRankInput){.data = data, .clock_offset_ns = -trace_clock_offset(r).offset_ns};
    }
    return count;
}

typedef bool (*RankWriter)(const char *path, const TraceRankInput *ranks, int n_ranks, char *err, size_t err_len);

static bool write_one(RankWriter writer, const char *path, const TraceRankInput *inputs, int n) {
    if (!path) return true;
    char err[512];
    if (writer(path, inputs, n, err, sizeof err)) return true;
    trace_report_write_error(path, err);
    return false;
}

static bool write_outputs(const TraceOutputs *out, const TraceRankInput *inputs, int n) {
    if (n == 0) {
        fprintf(stderr, "trace: no rank was tracing (trace_init not called); no trace written\n");
        return false;
    }
    // Every writer is tried even after one fails: a bad JSON path should not cost the pftrace.
    bool ok = write_one(trace_write_pftrace_ranks, out->pftrace_path, inputs, n);
    ok &= write_one(trace_write_json_ranks, out->json_path, inputs, n);
    ok &= write_one(trace_write_hta_dir, out->hta_dir, inputs, n);
    return ok;
}

bool trace_gather_and_write_outputs(Comm *world, const TraceOutputs *outputs) {
    int n = comm_size(world);
    void *mine = NULL;
    size_t my_len = 0;
    trace_serialize(&mine, &my_len);  // the snapshot: the gather's own comm slices come after it
    void **blobs = calloc((size_t)n, sizeof *blobs);
    uint64_t *lens = calloc((size_t)n, sizeof *lens);
    if (!blobs || !lens) fatal("trace_gather_and_write: out of memory for %d ranks", n);
    gather_blobs(world, mine, my_len, blobs, lens);
    int32_t ok = 1;
    if (comm_rank(world) == 0) {
        TraceRankInput *inputs = calloc((size_t)n, sizeof *inputs);
        if (!inputs) fatal("trace_gather_and_write: out of memory for %d ranks", n);
        int count = decode_blobs(blobs, lens, n, inputs);
        ok = write_outputs(outputs, inputs, count);
        for (int i = 0; i < count; i++) trace_rank_data_free((TraceRankData *)inputs[i].data);
        free(inputs);
        for (int r = 1; r < n; r++) free(blobs[r]);
    }
    free(mine);
    free(blobs);
    free(lens);
    // One answer everywhere, so that every rank can act on a failed write the same way.
    comm_broadcast(world, &ok, 1, COMM_INT32, 0);
    return ok != 0;
}

bool trace_gather_and_write(Comm *world, const char *pftrace_path, const char *json_path) {
    TraceOutputs outputs = {.pftrace_path = pftrace_path, .json_path = json_path};
    return trace_gather_and_write_outputs(world, &outputs);
}

// ================================================================================================
// Holistic Trace Analysis export
//
// The rank buffers are opaque here, so the export starts from the merged Chrome JSON that
// trace.c writes (which already applies the offsets and one common time shift), reads it back with
// cJSON and redistributes its slices into one kernel-only file per rank.
// ================================================================================================

enum { STREAM_NONE = 0, STREAM_COMPUTE = 7, STREAM_COMM = 8 };
#define COMM_KERNEL_PREFIX "ncclDevKernel_"

// A thread track of the merged JSON: where its slices go, and the end of its current top-level
// slice (a slice that begins before that end is nested and skipped).
typedef struct {
    int stream;
    int64_t top_end_ns;
} HtaTrack;

typedef struct {
    int64_t begin, end;  // ns
} HtaSpan;

typedef struct {
    int rank;
    cJSON *events;     // what goes into this rank's file: its process name, comm kernels, compute kernels
    HtaTrack *tracks;  // indexed by the JSON tid
    size_t n_tracks;
    cJSON *compute;    // the top-level compute slices, cut by the waits before they join events
    HtaSpan *waits;    // "comm-wait" slices on the compute track, at any depth
    size_t n_waits;
} HtaRank;

typedef struct {
    HtaRank *ranks;
    int n;
    int *index_of;  // rank number -> index in ranks, -1 if absent
    int max_rank;
} HtaSplit;

static int stream_of_track(const char *name) {
    if (strcmp(name, "compute") == 0) return STREAM_COMPUTE;
    if (strncmp(name, "comm:", 5) == 0) return STREAM_COMM;
    return STREAM_NONE;
}

static bool make_dir(const char *dir, char *err, size_t err_len) {
    struct stat st;
    if (mkdir(dir, 0777) == 0 || (errno == EEXIST && stat(dir, &st) == 0 && S_ISDIR(st.st_mode))) return true;
    snprintf(err, err_len, "%s: cannot create the directory (%s)", dir, strerror(errno));
    return false;
}

// Writes the merged JSON next to the outputs (a name HTA ignores), reads it back, removes it.
static cJSON *read_merged_json(const char *dir, const TraceRankInput *ranks, int n, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/.merged.json.part", dir);
    if (!trace_write_json_ranks(path, ranks, n, err, err_len)) return NULL;
    size_t size;
    char *text = (char *)read_whole_file(path, &size, err, err_len);
    remove(path);
    if (!text) return NULL;
    cJSON *doc = cJSON_ParseWithLength(text, size);
    free(text);
    if (!doc) snprintf(err, err_len, "%s: the merged JSON does not parse", path);
    return doc;
}

static bool split_init(HtaSplit *s, const TraceRankInput *ranks, int n) {
    *s = (HtaSplit){.n = n, .max_rank = -1};
    for (int i = 0; i < n; i++)
        if (trace_rank(ranks[i].data) > s->max_rank) s->max_rank = trace_rank(ranks[i].data);
    s->ranks = calloc((size_t)n, sizeof *s->ranks);
    s->index_of = malloc(((size_t)s->max_rank + 1) * sizeof *s->index_of);
    if (!s->ranks || !s->index_of) return false;
    for (int r = 0; r <= s->max_rank; r++) s->index_of[r] = -1;
    for (int i = 0; i < n; i++) {
        s->ranks[i] = (HtaRank){.rank = trace_rank(ranks[i].data), .events = cJSON_CreateArray(),
                                .compute = cJSON_CreateArray()};
        s->index_of[s->ranks[i].rank] = i;
    }
    return true;
}

static void split_free(HtaSplit *s) {
    for (int i = 0; s->ranks && i < s->n; i++) {
        cJSON_Delete(s->ranks[i].events);
        cJSON_Delete(s->ranks[i].compute);
        free(s->ranks[i].tracks);
        free(s->ranks[i].waits);
    }
    free(s->ranks);
    free(s->index_of);
}

static double number_of(const cJSON *event, const char *key) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(event, key);
    return cJSON_IsNumber(item) ? item->valuedouble : -1;
}

static const char *string_of(const cJSON *event, const char *key) {
    const char *s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(event, key));
    return s ? s : "";
}

static HtaRank *rank_of_event(HtaSplit *s, const cJSON *event) {
    double pid = number_of(event, "pid");
    if (pid < 0 || pid > s->max_rank || s->index_of[(int)pid] < 0) return NULL;
    return &s->ranks[s->index_of[(int)pid]];
}

// The track entry for a tid, growing the table when a metadata event names a new one.
static HtaTrack *track_of(HtaRank *r, double tid, bool create) {
    if (tid < 0 || tid > 1e6) return NULL;
    size_t t = (size_t)tid;
    if (t >= r->n_tracks) {
        if (!create) return NULL;
        HtaTrack *grown = realloc(r->tracks, (t + 1) * sizeof *grown);
        if (!grown) fatal("trace_write_hta_dir: out of memory");
        memset(grown + r->n_tracks, 0, (t + 1 - r->n_tracks) * sizeof *grown);
        r->tracks = grown;
        r->n_tracks = t + 1;
    }
    return &r->tracks[t];
}

static void replace_string(cJSON *object, const char *key, const char *value) {
    cJSON_DeleteItemFromObjectCaseSensitive(object, key);
    cJSON_AddStringToObject(object, key, value);
}

static void replace_number(cJSON *object, const char *key, double value) {
    cJSON_DeleteItemFromObjectCaseSensitive(object, key);
    cJSON_AddNumberToObject(object, key, value);
}

// Turns a top-level slice into a kernel on its stream, the way the PyTorch profiler writes one.
static void make_kernel(cJSON *event, int rank, int stream) {
    replace_string(event, "cat", "kernel");
    replace_number(event, "tid", stream);
    if (stream == STREAM_COMM) {
        const char *name = string_of(event, "name");
        size_t size = strlen(COMM_KERNEL_PREFIX) + strlen(name) + 1;
        char *kernel = malloc(size);
        if (!kernel) fatal("trace_write_hta_dir: out of memory");
        snprintf(kernel, size, "%s%s", COMM_KERNEL_PREFIX, name);
        replace_string(event, "name", kernel);
        free(kernel);
    }
    cJSON *args = cJSON_GetObjectItemCaseSensitive(event, "args");
    if (!cJSON_IsObject(args)) {
        cJSON_DeleteItemFromObjectCaseSensitive(event, "args");
        args = cJSON_AddObjectToObject(event, "args");
    }
    replace_number(args, "stream", stream);
    replace_number(args, "device", rank);
}

static HtaSpan span_of(const cJSON *event) {
    int64_t begin = llround(number_of(event, "ts") * 1000);
    return (HtaSpan){begin, begin + llround(number_of(event, "dur") * 1000)};
}

// Slices (X) on a compute or comm track that no earlier slice of the same track still encloses.
// The merged JSON lists each track's slices by begin time, a parent before its children.
static bool is_top_level_kernel(HtaRank *r, const cJSON *event, int *stream) {
    HtaTrack *track = track_of(r, number_of(event, "tid"), false);
    if (!track || track->stream == STREAM_NONE) return false;
    HtaSpan span = span_of(event);
    if (span.begin < track->top_end_ns) return false;
    track->top_end_ns = span.end;
    *stream = track->stream;
    return true;
}

// A slice where the main thread waits on a collective (category "comm-wait"): not compute, at
// whatever depth it sits in the compute track. A "pipeline-wait" stays a kernel: trace-summary
// takes the communication under it as bubble, not exposed, so for HTA's overlap (comm time under
// a compute kernel) to equal trace-summary's (1 - exposed / comm) it must count as covered.
static void note_wait(HtaRank *r, const cJSON *event) {
    if (strcmp(string_of(event, "cat"), "comm-wait") != 0) return;
    HtaTrack *track = track_of(r, number_of(event, "tid"), false);
    if (!track || track->stream != STREAM_COMPUTE) return;
    HtaSpan *grown = realloc(r->waits, (r->n_waits + 1) * sizeof *grown);
    if (!grown) fatal("trace_write_hta_dir: out of memory");
    r->waits = grown;
    r->waits[r->n_waits++] = span_of(event);
}

static int span_cmp(const void *a, const void *b) {
    const HtaSpan *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

// A compute kernel for [begin, end) of `event` (a copy, its ts and dur replaced) into r->events.
static void add_compute_piece(HtaRank *r, const cJSON *event, int64_t begin, int64_t end) {
    cJSON *piece = cJSON_Duplicate(event, true);
    if (!piece) fatal("trace_write_hta_dir: out of memory");
    replace_number(piece, "ts", (double)begin / 1000);
    replace_number(piece, "dur", (double)(end - begin) / 1000);
    cJSON_AddItemToArray(r->events, piece);
}

// HTA's overlap counts comm time under the union of its compute kernels; trace-summary's counts comm
// time under the top-level compute slices minus the collective waits (or under a pipeline wait). So
// each top-level compute slice goes out as the pieces of it no collective wait covers: a forward
// with an all-gather wait inside is two kernels, a "ddp wait" at top level none.
static void cut_compute_by_waits(HtaRank *r) {
    qsort(r->waits, r->n_waits, sizeof *r->waits, span_cmp);
    for (const cJSON *event = r->compute->child; event; event = event->next) {
        HtaSpan span = span_of(event);
        int64_t at = span.begin;
        for (size_t w = 0; w < r->n_waits && at < span.end; w++) {
            if (r->waits[w].end <= at || r->waits[w].begin >= span.end) continue;
            if (r->waits[w].begin > at) add_compute_piece(r, event, at, r->waits[w].begin);
            if (r->waits[w].end > at) at = r->waits[w].end;
        }
        if (at < span.end) add_compute_piece(r, event, at, span.end);
    }
}

// Moves what each rank's file needs out of the merged event list: its process name and its
// top-level compute and comm slices, made kernels.
static void split_events(HtaSplit *s, cJSON *events) {
    cJSON *event = events->child;
    while (event) {
        cJSON *next = event->next;
        HtaRank *r = rank_of_event(s, event);
        const char *ph = string_of(event, "ph"), *name = string_of(event, "name");
        int stream = STREAM_NONE;
        if (!r) {  // no rank's event (trace.c never writes one): left behind
            event = next;
            continue;
        }
        if (strcmp(ph, "M") == 0 && strcmp(name, "thread_name") == 0) {
            HtaTrack *track = track_of(r, number_of(event, "tid"), true);
            if (track) track->stream = stream_of_track(string_of(cJSON_GetObjectItemCaseSensitive(event, "args"), "name"));
        } else if (strcmp(ph, "M") == 0 && strcmp(name, "process_name") == 0) {
            cJSON_AddItemToArray(r->events, cJSON_DetachItemViaPointer(events, event));
        } else if (strcmp(ph, "X") == 0) {
            note_wait(r, event);
            if (is_top_level_kernel(r, event, &stream)) {
                make_kernel(event, r->rank, stream);
                cJSON *to = stream == STREAM_COMPUTE ? r->compute : r->events;
                cJSON_AddItemToArray(to, cJSON_DetachItemViaPointer(events, event));
            }
        }
        event = next;
    }
    for (int i = 0; i < s->n; i++) cut_compute_by_waits(&s->ranks[i]);
}

static void print_event(FILE *fp, const cJSON *event, const char **sep) {
    char *text = cJSON_PrintUnformatted(event);
    if (!text) fatal("trace_write_hta_dir: out of memory");
    fprintf(fp, "%s%s", *sep, text);
    free(text);
    *sep = ",\n";
}

static void print_stream_name(FILE *fp, int rank, int stream, const char *name, const char **sep) {
    fprintf(fp, "%s{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": \"%s\"}}",
            *sep, rank, stream, name);
    *sep = ",\n";
}

static bool write_rank_file(const char *dir, const HtaRank *r, int world_size, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d.json", dir, r->rank);
    AtomicFile f;
    if (!atomic_create(&f, path, err, err_len)) return false;
    // HTA finds the rank with the regex "rank":\s+(\d+) on the first line that has it.
    fprintf(f.fp, "{\"schemaVersion\": 1, \"distributedInfo\": {\"rank\": %d, \"world_size\": %d},\n\"traceEvents\": [\n",
            r->rank, world_size);
    const char *sep = "";
    print_stream_name(f.fp, r->rank, STREAM_COMPUTE, "stream 7 (compute)", &sep);
    print_stream_name(f.fp, r->rank, STREAM_COMM, "stream 8 (comm)", &sep);
    for (const cJSON *event = r->events->child; event; event = event->next) print_event(f.fp, event, &sep);
    fputs("\n]}\n", f.fp);
    return atomic_commit(&f, err, err_len);
}

bool trace_write_hta_dir(const char *dir, const TraceRankInput *ranks, int n_ranks, char *err, size_t err_len) {
    if (!make_dir(dir, err, err_len)) return false;
    cJSON *doc = read_merged_json(dir, ranks, n_ranks, err, err_len);
    if (!doc) return false;
    cJSON *events = cJSON_GetObjectItemCaseSensitive(doc, "traceEvents");
    if (!cJSON_IsArray(events)) {
        snprintf(err, err_len, "%s: the merged JSON has no traceEvents list", dir);
        cJSON_Delete(doc);
        return false;
    }
    HtaSplit split;
    if (!split_init(&split, ranks, n_ranks)) fatal("trace_write_hta_dir: out of memory for %d ranks", n_ranks);
    split_events(&split, events);
    bool ok = true;
    for (int i = 0; i < n_ranks && ok; i++) ok = write_rank_file(dir, &split.ranks[i], n_ranks, err, err_len);
    split_free(&split);
    cJSON_Delete(doc);
    return ok;
}
