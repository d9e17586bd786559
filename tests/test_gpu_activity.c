// test_gpu_activity.c: gpu/activity.c, the GPU activity records (CUPTI's, on a GPU) to trace slices,
// on any machine: records are fed by hand, the trace is written as JSON and read back.
//   - one thread track per stream, "cuda:stream <id>", each record a slice at its device times plus
//     the clock offset, in start order whatever order the records came in;
//   - categories: "nccl" for NCCL's kernels, "kernel" for the others, "memcpy"/"memset" with bytes;
//   - a record starting before the previous one on its stream ended is moved to that end (a
//     stream runs its work in order), also across emits;
//   - records queued from another thread (CUPTI delivers buffers on its own) all arrive.
#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <unistd.h>

#include "common/fileio.h"
#include "gpu/activity.c"  // the unit under test
#include "tests/test_util.h"

// Every X slice of the written trace: (track name, name, category, ts in ns, dur in ns, bytes or -1).
// The writer counts ts from its own origin: tests compare slices with one another.
typedef struct {
    char track[48], name[64], category[16];
    int64_t ts, dur, bytes;
} Slice;

static int read_slices(Slice *out, int cap) {
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/gpu_activity_%d.json", getenv("TEST_TMP") ? getenv("TEST_TMP") : "/tmp",
             (int)getpid());
    ck_assert_msg(trace_write_json(path), "trace_write_json failed");
    size_t size;
    char *text = (char *)read_whole_file(path, &size, err, sizeof err);
    ck_assert_msg(text != NULL, "%s", err);
    cJSON *doc = cJSON_Parse(text), *events = cJSON_GetObjectItem(doc, "traceEvents");
    if (!events) events = doc;
    char names[16][48] = {{0}};
    int tids[16], n_tracks = 0, n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, events) {  // thread names first (metadata events)
        const cJSON *name = cJSON_GetObjectItem(e, "name"), *ph = cJSON_GetObjectItem(e, "ph");
        if (strcmp(ph->valuestring, "M") == 0 && strcmp(name->valuestring, "thread_name") == 0 && n_tracks < 16) {
            tids[n_tracks] = cJSON_GetObjectItem(e, "tid")->valueint;
            snprintf(names[n_tracks++], 48, "%.47s", cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), "name")->valuestring);
        }
    }
    cJSON_ArrayForEach(e, events) {
        if (strcmp(cJSON_GetObjectItem(e, "ph")->valuestring, "X") != 0 || n == cap) continue;
        Slice *s = &out[n++];
        int tid = cJSON_GetObjectItem(e, "tid")->valueint;
        snprintf(s->track, sizeof s->track, "?");
        for (int t = 0; t < n_tracks; t++)
            if (tids[t] == tid) snprintf(s->track, sizeof s->track, "%.47s", names[t]);
        snprintf(s->name, sizeof s->name, "%.63s", cJSON_GetObjectItem(e, "name")->valuestring);
        const cJSON *cat = cJSON_GetObjectItem(e, "cat");
        snprintf(s->category, sizeof s->category, "%.15s", cat ? cat->valuestring : "");
        s->ts = llround(cJSON_GetObjectItem(e, "ts")->valuedouble * 1000);
        s->dur = llround(cJSON_GetObjectItem(e, "dur")->valuedouble * 1000);
        const cJSON *args = cJSON_GetObjectItem(e, "args"), *bytes = args ? cJSON_GetObjectItem(args, "bytes") : NULL;
        s->bytes = bytes ? (int64_t)bytes->valuedouble : -1;
    }
    cJSON_Delete(doc);
    free(text);
    remove(path);
    return n;
}

static void add(GpuActivityKind kind, const char *name, uint32_t stream, uint64_t start, uint64_t end, uint64_t bytes) {
    GpuActivity a = {kind, name, stream, start, end, bytes};
    gpu_activity_add(&a);
}

static const Slice *find(const Slice *s, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(s[i].name, name) == 0) return &s[i];
    ck_abort_msg("no slice named %s", name);
    return NULL;
}

static void assert_slice(const Slice *s, const char *track, const char *category, int64_t ts, int64_t dur,
                         int64_t bytes) {
    ck_assert_msg(strcmp(s->track, track) == 0 && strcmp(s->category, category) == 0 && s->ts == ts &&
                      s->dur == dur && s->bytes == bytes,
                  "%s: got track %s category %s ts %lld dur %lld bytes %lld; want %s %s %lld %lld %lld", s->name,
                  s->track, s->category, (long long)s->ts, (long long)s->dur, (long long)s->bytes, track, category,
                  (long long)ts, (long long)dur, (long long)bytes);
}

START_TEST(test_records_to_slices) {
    trace_init(0, "rank 0");
    const int64_t offset = 5000000;  // device clock + 5 ms = trace clock
    add(GPU_ACTIVITY_KERNEL, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 13, 2000, 9000, 0);
    add(GPU_ACTIVITY_KERNEL, "flash_attention_fwd", 7, 3000, 4000, 0);  // queued before its predecessor
    add(GPU_ACTIVITY_KERNEL, "rmsnorm_fwd", 7, 1000, 2500, 0);
    add(GPU_ACTIVITY_MEMCPY, "memcpy HtoD", 7, 4000, 4600, 65536);
    add(GPU_ACTIVITY_MEMSET, "memset", 13, 500, 700, 4096);
    gpu_activity_emit(offset);
    int host = trace_track("compute");  // a host slice at trace time offset + 2000: where the NCCL kernel starts
    trace_begin_at(host, "host", "train", offset + 2000);
    trace_end_at(host, offset + 2100);
    Slice s[16];
    int n = read_slices(s, 16);
    ck_assert_int_eq(n, 6);
    int64_t t0 = find(s, n, "host")->ts - 2000;  // the writer's ts of device time 0
    assert_slice(find(s, n, "rmsnorm_fwd"), "cuda:stream 7", "kernel", t0 + 1000, 1500, -1);
    assert_slice(find(s, n, "flash_attention_fwd"), "cuda:stream 7", "kernel", t0 + 3000, 1000, -1);
    assert_slice(find(s, n, "memcpy HtoD"), "cuda:stream 7", "memcpy", t0 + 4000, 600, 65536);
    assert_slice(find(s, n, "memset"), "cuda:stream 13", "memset", t0 + 500, 200, 4096);
    assert_slice(find(s, n, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"), "cuda:stream 13", "nccl", t0 + 2000, 7000,
                 -1);
    trace_shutdown();
}
END_TEST

START_TEST(test_a_stream_runs_in_order) {
    trace_init(0, "rank 0");
    add(GPU_ACTIVITY_KERNEL, "first", 3, 100, 500, 0);
    add(GPU_ACTIVITY_KERNEL, "overlapping", 3, 400, 900, 0);  // starts before first ends: moved to 500
    gpu_activity_emit(0);
    add(GPU_ACTIVITY_KERNEL, "next_emit", 3, 850, 1000, 0);  // before the last end of the earlier emit
    gpu_activity_emit(0);
    Slice s[8];
    int n = read_slices(s, 8);
    ck_assert_int_eq(n, 3);
    int64_t t0 = find(s, n, "first")->ts - 100;
    assert_slice(find(s, n, "first"), "cuda:stream 3", "kernel", t0 + 100, 400, -1);
    assert_slice(find(s, n, "overlapping"), "cuda:stream 3", "kernel", t0 + 500, 400, -1);
    assert_slice(find(s, n, "next_emit"), "cuda:stream 3", "kernel", t0 + 900, 100, -1);
    trace_shutdown();
}
END_TEST

static void *add_many(void *arg) {
    uint32_t stream = (uint32_t)(uintptr_t)arg;
    for (int i = 0; i < 1000; i++) add(GPU_ACTIVITY_KERNEL, "k", stream, 10 * (uint64_t)i, 10 * (uint64_t)i + 5, 0);
    return NULL;
}

START_TEST(test_records_from_another_thread) {
    trace_init(0, "rank 0");
    pthread_t other;
    pthread_create(&other, NULL, add_many, (void *)(uintptr_t)1);
    add_many((void *)(uintptr_t)2);
    pthread_join(other, NULL);
    gpu_activity_emit(0);
    ck_assert_int_eq(trace_stats(trace_local()).slices, 2000);
    trace_shutdown();
}
END_TEST

START_TEST(test_kernel_categories) {
    ck_assert_str_eq(gpu_activity_kernel_category("ncclDevKernel_AllGather_RING_LL"), "nccl");
    ck_assert_str_eq(gpu_activity_kernel_category("ncclKernel_ReduceScatter"), "nccl");
    ck_assert_str_eq(gpu_activity_kernel_category("sm90_xmma_gemm_bf16"), "kernel");
}
END_TEST

START_TEST(test_tracing_off_records_nothing) {  // the records are dropped, and freed
    add(GPU_ACTIVITY_KERNEL, "k", 1, 0, 10, 0);
    gpu_activity_emit(0);
    ck_assert_int_eq((int)n_queued, 0);
}
END_TEST

int main(void) {
    Suite *s = suite_create("gpu_activity");
    TCase *tc = tcase_create("records to slices");
    tcase_add_test(tc, test_records_to_slices);
    tcase_add_test(tc, test_a_stream_runs_in_order);
    tcase_add_test(tc, test_records_from_another_thread);
    tcase_add_test(tc, test_kernel_categories);
    tcase_add_test(tc, test_tracing_off_records_nothing);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
