// test_trace.c: recording, serialization round trip, multi-rank merge and both writers of
// common/trace.c. With TRACE_TEST_OUT=DIR the two-rank files are kept there as two_ranks.pftrace
// and two_ranks.json (tests/t_trace_schema.sh then checks them against the Perfetto schema);
// otherwise files go to $TEST_TMP (or /tmp) and are removed.
#include <check.h>
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

// ---- helpers -----------------------------------------------------------------------------------

static bool keep_outputs(void) { return getenv("TRACE_TEST_OUT") != NULL; }

// Kept files get fixed names for the schema script; scratch files get the pid, so parallel runs
// sharing /tmp do not collide.
static void out_path(char *path, size_t size, const char *name) {
    const char *dir = getenv("TRACE_TEST_OUT");
    if (dir) {
        snprintf(path, size, "%s/%s", dir, name);
        return;
    }
    dir = getenv("TEST_TMP") ? getenv("TEST_TMP") : "/tmp";
    snprintf(path, size, "%s/test_trace_%d_%s", dir, (int)getpid(), name);
}

static void remove_scratch(const char *path) {
    if (!keep_outputs()) remove(path);
}

static char *read_text(const char *path, size_t *size) {
    char err[512];
    char *text = (char *)read_whole_file(path, size, err, sizeof err);
    ck_assert_msg(text != NULL, "cannot read back %s: %s", path, err);
    return text;
}

static void assert_stats_eq(TraceStats got, TraceStats want) {
    ck_assert_msg(memcmp(&got, &want, sizeof got) == 0,
                  "stats differ: got tracks %zu counters %zu slices %zu open %zu args %zu flows %zu samples %zu, "
                  "want %zu %zu %zu %zu %zu %zu %zu",
                  got.tracks, got.counters, got.slices, got.open_slices, got.args, got.flows, got.samples,
                  want.tracks, want.counters, want.slices, want.open_slices, want.args, want.flows, want.samples);
}

static void assert_files_equal(const char *a, const char *b) {
    size_t size_a, size_b;
    char *text_a = read_text(a, &size_a), *text_b = read_text(b, &size_b);
    size_t i = 0;
    while (i < size_a && i < size_b && text_a[i] == text_b[i]) i++;
    ck_assert_msg(size_a == size_b && i == size_a, "%s (%zu bytes) and %s (%zu bytes) first differ at byte %zu", a,
                  size_a, b, size_b, i);
    free(text_a);
    free(text_b);
}

// The recording clock of rank r starts at a different origin, as on another machine; the clock
// offset passed to the writer maps it back (plus 50 ns per rank, to see that offsets apply).
#define RANK_CLOCK_ORIGIN(r) (5000000LL + (r) * 1000000000LL)
#define RANK_OFFSET(r) (-(r) * 1000000000LL + (r) * 50LL)

// One training step on a rank: nested compute slices with args (a child starting with its parent,
// a zero-length child ending with its parent), memory counters, and a send to and a receive from
// the other of two ranks, joined by flows.
static void record_step(int rank) {
    char process[64];
    snprintf(process, sizeof process, "rank %d [pp0 dp%d cp0 tp0]", rank, rank);
    trace_init(rank, process);
    int compute = trace_track("compute"), comm = trace_track("comm:dp");
    int64_t t = RANK_CLOCK_ORIGIN(rank);
    int peer = 1 - rank;

    trace_begin_at(compute, "step", "train", t);
    trace_arg_int(compute, "step", 7);
    trace_begin_at(compute, "forward", "fwd", t);
    trace_arg_int(compute, "layer", 0);
    trace_arg_int(compute, "microbatch", 2);
    trace_arg_double(compute, "flops", 1.5e9);
    trace_arg_str(compute, "op", "matmul");
    trace_end_at(compute, t + 100);
    trace_counter_at("mem params", 1 << 20, t + 5);
    trace_counter_at("mem activations", 4096, t + 20);

    trace_begin_at(comm, "send", "comm", t + 110);
    trace_arg_int(comm, "bytes", 4096);
    trace_arg_str(comm, "group", "dp");
    trace_flow_out(comm, trace_flow_id(rank, peer, 0));
    trace_end_at(comm, t + 150);
    trace_begin_at(comm, "recv", "comm", t + 160);
    trace_arg_int(comm, "bytes", 4096);
    trace_flow_in(comm, trace_flow_id(peer, rank, 0));
    trace_end_at(comm, t + 300);

    trace_begin_at(compute, "backward", "bwd", t + 200);
    trace_arg_int(compute, "layer", 0);
    trace_counter_at("mem activations", 0, t + 450);
    trace_begin_at(compute, "marker", "bwd", t + 500);
    trace_end_at(compute, t + 500);
    trace_end_at(compute, t + 500);
    trace_end_at(compute, t + 500);
}

static const TraceStats STEP_STATS = {
    .tracks = 2, .counters = 2, .slices = 6, .open_slices = 0, .args = 9, .flows = 2, .samples = 3};

static void *serialize_local(size_t *len) {
    void *blob;
    ck_assert_msg(trace_serialize(&blob, len), "trace_serialize failed with tracing enabled");
    return blob;
}

static TraceRankData *deserialize_ok(const void *blob, size_t len) {
    char err[256] = "";
    TraceRankData *data = trace_deserialize(blob, len, err, sizeof err);
    ck_assert_msg(data != NULL, "deserializing a %zu-byte blob failed: %s", len, err);
    return data;
}

static void write_both(const char *pftrace, const char *json, const TraceRankInput *ranks, int n) {
    char err[512] = "";
    ck_assert_msg(trace_write_pftrace_ranks(pftrace, ranks, n, err, sizeof err), "pftrace: %s", err);
    ck_assert_msg(trace_write_json_ranks(json, ranks, n, err, sizeof err), "json: %s", err);
}

// ---- recording ---------------------------------------------------------------------------------

START_TEST(test_disabled_records_nothing) {
    ck_assert_msg(!trace_enabled(), "tracing enabled before trace_init");
    int track = trace_track("compute");
    ck_assert_int_eq(track, 0);
    trace_begin(track, "forward", "fwd");
    trace_arg_int(track, "layer", 1);
    trace_flow_out(track, 42);
    trace_end(track);
    trace_end(track);  // unbalanced, but disabled: ignored
    trace_counter("mem params", 1.0);
    trace_memory_observer(MEM_PARAMS, 100);
    ck_assert_ptr_null(trace_local());

    void *blob = NULL;
    size_t len = 1;
    ck_assert_msg(!trace_serialize(&blob, &len) && blob == NULL && len == 0, "serialize while disabled gave %zu bytes",
                  len);
    char path[512];
    out_path(path, sizeof path, "disabled.json");
    ck_assert_msg(!trace_write_json(path), "trace_write_json succeeded while disabled");
    ck_assert_msg(access(path, F_OK) != 0, "%s was created while disabled", path);

    trace_init(0, "rank 0");
    assert_stats_eq(trace_stats(trace_local()), (TraceStats){0});
    trace_shutdown();
    ck_assert_msg(!trace_enabled(), "still enabled after trace_shutdown");
    trace_begin(0, "after", NULL);
    ck_assert_ptr_null(trace_local());
}
END_TEST

START_TEST(test_track_handles) {
    trace_init(3, "rank 3");
    int compute = trace_track("compute"), comm = trace_track("comm:dp");
    ck_assert_int_eq(compute, 0);
    ck_assert_int_eq(comm, 1);
    ck_assert_int_eq(trace_track("compute"), compute);
    ck_assert_int_eq(trace_track("comm:tp"), 2);
    ck_assert_int_eq(trace_rank(trace_local()), 3);
    ck_assert_uint_eq(trace_stats(trace_local()).tracks, 3);
}
END_TEST

START_TEST(test_recording_counts) {
    record_step(0);
    assert_stats_eq(trace_stats(trace_local()), STEP_STATS);
}
END_TEST

START_TEST(test_live_clock_and_memory_observer) {
    trace_init(0, "rank 0");
    int compute = trace_track("compute");
    trace_begin(compute, "outer", "train");
    trace_begin(compute, "inner", NULL);
    trace_arg_double(compute, "x", 0.25);
    trace_end(compute);
    trace_end(compute);
    trace_counter("loss scale", 1.0);
    mem_set_observer(trace_memory_observer);
    void *p = mem_alloc(MEM_ACTIVATIONS, 1000);
    mem_free(p);
    mem_set_observer(NULL);
    TraceStats want = {.tracks = 1, .counters = 2, .slices = 2, .args = 1, .samples = 3};
    assert_stats_eq(trace_stats(trace_local()), want);

    char pftrace[512], json[512];
    out_path(pftrace, sizeof pftrace, "live.pftrace");
    out_path(json, sizeof json, "live.json");
    ck_assert_msg(trace_write_pftrace(pftrace) && trace_write_json(json), "writing the live trace failed");
    size_t size;
    char *text = read_text(json, &size);
    ck_assert_msg(strstr(text, "\"name\": \"mem activations\"") != NULL, "no 'mem activations' counter in:\n%s", text);
    free(text);
    remove_scratch(pftrace);
    remove_scratch(json);
}
END_TEST

START_TEST(test_flow_ids) {
    uint64_t a = trace_flow_id(0, 1, 0), b = trace_flow_id(1, 0, 0), c = trace_flow_id(0, 1, 1);
    ck_assert_msg(a && b && c && a != b && a != c && b != c, "ids not distinct and non-zero: %llu %llu %llu",
                  (unsigned long long)a, (unsigned long long)b, (unsigned long long)c);
    uint64_t max = trace_flow_id(4095, 4095, (1ull << 29) - 1);
    ck_assert_msg(max <= (1ull << 53), "largest id %llu exceeds 2^53", (unsigned long long)max);
}
END_TEST

START_TEST(test_flow_id_out_of_range) { trace_flow_id(4096, 0, 0); }
END_TEST

// ---- misuse: each of these ends the run with fatal() (exit status 1) --------------------------

START_TEST(test_end_without_begin) {
    trace_init(0, "rank 0");
    trace_end(trace_track("compute"));
}
END_TEST

START_TEST(test_arg_without_open_slice) {
    trace_init(0, "rank 0");
    int compute = trace_track("compute");
    trace_begin(compute, "a", NULL);
    trace_end(compute);
    trace_arg_int(compute, "layer", 1);
}
END_TEST

START_TEST(test_unknown_track_handle) {
    trace_init(0, "rank 0");
    trace_begin(5, "a", NULL);
}
END_TEST

START_TEST(test_time_going_backwards) {
    trace_init(0, "rank 0");
    int compute = trace_track("compute");
    trace_begin_at(compute, "a", NULL, 1000);
    trace_end_at(compute, 999);
}
END_TEST

// A slice still open at write time is reported by the writer, which writes nothing.
START_TEST(test_write_with_open_slice_fails) {
    trace_init(2, "rank 2");
    int compute = trace_track("compute");
    trace_begin(compute, "step", NULL);
    ck_assert_uint_eq(trace_stats(trace_local()).open_slices, 1);
    char path[512], err[512] = "";
    out_path(path, sizeof path, "open.pftrace");
    TraceRankInput input = {trace_local(), 0};
    ck_assert_msg(!trace_write_pftrace_ranks(path, &input, 1, err, sizeof err), "wrote a trace with an open slice");
    ck_assert_msg(strstr(err, "'step' was never ended") && strstr(err, "rank 2"), "unhelpful message: %s", err);
    ck_assert_msg(access(path, F_OK) != 0, "%s was created", path);
}
END_TEST

START_TEST(test_write_errors) {
    record_step(0);
    char path[512], err[512] = "";
    out_path(path, sizeof path, "twice.json");
    TraceRankInput twice[2] = {{trace_local(), 0}, {trace_local(), 10}};
    ck_assert_msg(!trace_write_json_ranks(path, twice, 2, err, sizeof err) && strstr(err, "twice"),
                  "duplicate ranks accepted: %s", err);
    ck_assert_msg(!trace_write_pftrace_ranks("/nonexistent-dir/t.pftrace", twice, 1, err, sizeof err) &&
                      strstr(err, "cannot create"),
                  "unwritable path accepted: %s", err);
}
END_TEST

// ---- serialization -----------------------------------------------------------------------------

START_TEST(test_round_trip) {
    record_step(1);
    size_t len;
    void *blob = serialize_local(&len);
    TraceRankData *copy = deserialize_ok(blob, len);
    assert_stats_eq(trace_stats(copy), trace_stats(trace_local()));
    ck_assert_int_eq(trace_rank(copy), 1);

    void *again;
    size_t again_len;
    ck_assert(trace_serialize_rank(copy, &again, &again_len));
    size_t i = 0;
    while (i < len && i < again_len && ((unsigned char *)blob)[i] == ((unsigned char *)again)[i]) i++;
    ck_assert_msg(len == again_len && i == len, "re-serialized blob (%zu bytes) differs from the original (%zu) at byte %zu",
                  again_len, len, i);

    // Everything the writers use survived: the files from the copy equal those from the original.
    char original[2][512], copied[2][512];
    out_path(original[0], 512, "orig.pftrace");
    out_path(original[1], 512, "orig.json");
    out_path(copied[0], 512, "copy.pftrace");
    out_path(copied[1], 512, "copy.json");
    TraceRankInput from_original = {trace_local(), 123}, from_copy = {copy, 123};
    write_both(original[0], original[1], &from_original, 1);
    write_both(copied[0], copied[1], &from_copy, 1);
    for (int k = 0; k < 2; k++) {
        assert_files_equal(original[k], copied[k]);
        remove_scratch(original[k]);
        remove_scratch(copied[k]);
    }
    free(again);
    free(blob);
    trace_rank_data_free(copy);
}
END_TEST

// Truncated, foreign or bit-flipped blobs are refused or, where still consistent, written safely.
START_TEST(test_corrupt_blobs) {
    record_step(0);
    size_t len;
    unsigned char *blob = serialize_local(&len);
    char err[256] = "";
    ck_assert_ptr_null(trace_deserialize(blob, 0, err, sizeof err));
    ck_assert_msg(trace_deserialize(blob, len - 1, err, sizeof err) == NULL && strstr(err, "corrupt"),
                  "truncated blob accepted (message: %s)", err);
    unsigned char *longer = malloc(len + 1);
    memcpy(longer, blob, len);
    longer[len] = 0;
    ck_assert_msg(trace_deserialize(longer, len + 1, err, sizeof err) == NULL, "blob with a trailing byte accepted");
    free(longer);

    char path[512];
    out_path(path, sizeof path, "fuzz.pftrace");
    for (size_t i = 0; i < len; i++) {
        blob[i] ^= 0xff;
        TraceRankData *data = trace_deserialize(blob, len, err, sizeof err);
        if (data) {  // consistent enough to accept: the writer must cope with it without crashing
            TraceRankInput input = {data, 0};
            trace_write_pftrace_ranks(path, &input, 1, err, sizeof err);
            trace_rank_data_free(data);
        }
        blob[i] ^= 0xff;
    }
    remove(path);
    free(blob);
}
END_TEST

// ---- two ranks, both formats -------------------------------------------------------------------

static const cJSON *find_slice(const cJSON *events, const char *name, int pid) {
    const cJSON *e;
    cJSON_ArrayForEach(e, events) {
        const cJSON *ph = cJSON_GetObjectItem(e, "ph"), *n = cJSON_GetObjectItem(e, "name");
        if (cJSON_IsString(ph) && !strcmp(ph->valuestring, "X") && cJSON_IsString(n) && !strcmp(n->valuestring, name) &&
            cJSON_GetObjectItem(e, "pid")->valueint == pid)
            return e;
    }
    return NULL;
}

static int count_phase(const cJSON *events, const char *phase) {
    int count = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, events) count += !strcmp(cJSON_GetObjectItem(e, "ph")->valuestring, phase);
    return count;
}

static void check_two_rank_json(const char *path) {
    size_t size;
    char *text = read_text(path, &size);
    ck_assert_msg(strstr(text, "\"distributedInfo\": {\"rank\": 0, \"world_size\": 2}"),
                  "no distributedInfo for HTA at the start of:\n%.300s", text);
    cJSON *doc = cJSON_Parse(text);
    ck_assert_msg(doc != NULL, "%s does not parse as JSON near: %.80s", path, cJSON_GetErrorPtr());
    const cJSON *events = cJSON_GetObjectItem(doc, "traceEvents");
    ck_assert_int_eq(count_phase(events, "X"), 2 * (int)STEP_STATS.slices);
    ck_assert_int_eq(count_phase(events, "s"), 2);
    ck_assert_int_eq(count_phase(events, "f"), 2);
    ck_assert_int_eq(count_phase(events, "C"), 2 * (int)STEP_STATS.samples);

    // The earliest event lands at 1 us; rank 1's offset puts its step 50 ns after rank 0's.
    const cJSON *step0 = find_slice(events, "step", 0), *step1 = find_slice(events, "step", 1);
    ck_assert_msg(step0 && step1, "a 'step' slice is missing");
    double ts0 = cJSON_GetObjectItem(step0, "ts")->valuedouble, ts1 = cJSON_GetObjectItem(step1, "ts")->valuedouble;
    double dur0 = cJSON_GetObjectItem(step0, "dur")->valuedouble;
    ck_assert_msg(fabs(ts0 - 1.0) < 1e-9 && fabs(ts1 - 1.05) < 1e-9 && fabs(dur0 - 0.5) < 1e-9,
                  "step: rank 0 ts %.3f dur %.3f, rank 1 ts %.3f; want 1.000, 0.500 and 1.050", ts0, dur0, ts1);
    const cJSON *forward = find_slice(events, "forward", 1);
    const cJSON *flops = cJSON_GetObjectItem(cJSON_GetObjectItem(forward, "args"), "flops");
    ck_assert_msg(cJSON_IsNumber(flops) && flops->valuedouble == 1.5e9, "forward's flops arg lost: %s",
                  cJSON_PrintUnformatted(forward));

    double last = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, events) {
        const cJSON *ts = cJSON_GetObjectItem(e, "ts");
        if (!ts) continue;
        ck_assert_msg(ts->valuedouble >= last, "events not sorted by ts: %.3f after %.3f", ts->valuedouble, last);
        last = ts->valuedouble;
    }
    cJSON_Delete(doc);
    free(text);
}

START_TEST(test_two_ranks_both_formats) {
    size_t len[2];
    void *blob[2];
    for (int r = 0; r < 2; r++) {
        record_step(r);
        blob[r] = serialize_local(&len[r]);
    }
    trace_shutdown();
    TraceRankInput ranks[2];
    for (int r = 0; r < 2; r++) ranks[r] = (TraceRankInput){deserialize_ok(blob[r], len[r]), RANK_OFFSET(r)};

    char pftrace[512], json[512];
    out_path(pftrace, sizeof pftrace, "two_ranks.pftrace");
    out_path(json, sizeof json, "two_ranks.json");
    write_both(pftrace, json, ranks, 2);
    size_t size;
    unsigned char *proto = (unsigned char *)read_text(pftrace, &size);
    ck_assert_msg(size > 100 && proto[0] == 0x0a, "%s: %zu bytes, first byte 0x%02x (want a Trace.packet, 0x0a)",
                  pftrace, size, size ? proto[0] : 0);
    free(proto);
    check_two_rank_json(json);
    remove_scratch(pftrace);
    remove_scratch(json);
    for (int r = 0; r < 2; r++) {
        trace_rank_data_free((TraceRankData *)ranks[r].data);
        free(blob[r]);
    }
}
END_TEST

START_TEST(test_json_escaping) {
    const char *nasty = "quote \" backslash \\ newline \n tab \t bell \x07 utf8 \xc3\xa9";
    trace_init(0, nasty);
    int track = trace_track(nasty);
    trace_begin_at(track, nasty, nasty, 10);
    trace_arg_str(track, nasty, nasty);
    trace_arg_double(track, "nan", NAN);
    trace_end_at(track, 20);
    char path[512];
    out_path(path, sizeof path, "escaping.json");
    ck_assert(trace_write_json(path));
    size_t size;
    char *text = read_text(path, &size);
    cJSON *doc = cJSON_Parse(text);
    ck_assert_msg(doc != NULL, "escaped JSON does not parse near: %.80s", cJSON_GetErrorPtr());
    const cJSON *slice = find_slice(cJSON_GetObjectItem(doc, "traceEvents"), nasty, 0);
    ck_assert_msg(slice != NULL, "slice name did not survive escaping:\n%s", text);
    const cJSON *arg = cJSON_GetObjectItem(cJSON_GetObjectItem(slice, "args"), nasty);
    ck_assert_msg(cJSON_IsString(arg) && !strcmp(arg->valuestring, nasty), "string arg did not survive: %s",
                  cJSON_PrintUnformatted(slice));
    cJSON_Delete(doc);
    free(text);
    remove_scratch(path);
}
END_TEST

// ---- scale: millions of events, no quadratic step ----------------------------------------------
// The times are printed, not asserted: on a loaded machine any bound is a guess (timings belong in
// `make bench`). A quadratic step would take hours here and end at the suite's timeout.

START_TEST(test_many_events) {
    enum { N_SLICES = 1000000 };
    trace_init(0, "rank 0");
    int compute = trace_track("compute"), comm = trace_track("comm:tp");
    long long start = now_ns();
    char name[32];
    for (int i = 0; i < N_SLICES; i++) {
        int track = i % 2 ? comm : compute;
        snprintf(name, sizeof name, "op %d", i % 100000);  // many distinct names grow the string table
        trace_begin_at(track, name, "fwd", 2LL * i);
        if (i % 10 == 0) trace_arg_int(track, "layer", i);
        trace_end_at(track, 2LL * i + 1);
        if (i % 100 == 0) trace_counter_at("mem activations", i, 2LL * i);
    }
    double record_s = (now_ns() - start) * 1e-9;

    size_t len;
    void *blob = serialize_local(&len);
    TraceRankData *copy = deserialize_ok(blob, len);
    assert_stats_eq(trace_stats(copy), trace_stats(trace_local()));
    char path[512], err[512] = "";
    out_path(path, sizeof path, "many.pftrace");
    TraceRankInput input = {copy, 0};
    start = now_ns();
    ck_assert_msg(trace_write_pftrace_ranks(path, &input, 1, err, sizeof err), "%s", err);
    double write_s = (now_ns() - start) * 1e-9;
    printf("trace scale: %d slices recorded in %.2f s, written in %.2f s (not asserted)\n", N_SLICES, record_s,
           write_s);
    remove(path);
    trace_rank_data_free(copy);
    free(blob);
}
END_TEST

static Suite *trace_suite(void) {
    Suite *s = suite_create("trace");
    TCase *rec = tcase_create("recording");
    tcase_add_test(rec, test_disabled_records_nothing);
    tcase_add_test(rec, test_track_handles);
    tcase_add_test(rec, test_recording_counts);
    tcase_add_test(rec, test_live_clock_and_memory_observer);
    tcase_add_test(rec, test_flow_ids);
    suite_add_tcase(s, rec);

    TCase *misuse = tcase_create("misuse");
    tcase_add_exit_test(misuse, test_flow_id_out_of_range, 1);
    tcase_add_exit_test(misuse, test_end_without_begin, 1);
    tcase_add_exit_test(misuse, test_arg_without_open_slice, 1);
    tcase_add_exit_test(misuse, test_unknown_track_handle, 1);
    tcase_add_exit_test(misuse, test_time_going_backwards, 1);
    tcase_add_test(misuse, test_write_with_open_slice_fails);
    tcase_add_test(misuse, test_write_errors);
    suite_add_tcase(s, misuse);

    TCase *merge = tcase_create("serialize and write");
    tcase_add_test(merge, test_round_trip);
    tcase_add_test(merge, test_corrupt_blobs);
    tcase_add_test(merge, test_two_ranks_both_formats);
    tcase_add_test(merge, test_json_escaping);
    tcase_add_test(merge, test_many_events);
    tcase_set_timeout(merge, 120);
    suite_add_tcase(s, merge);
    return s;
}

int main(void) {
    SRunner *runner = srunner_create(trace_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
