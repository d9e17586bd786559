// test_comm_mpi.c: the comm stream (common/comm.c) and the device mesh (common/mesh.c), under
// mpirun. tests/t_comm.sh runs it on 2, 3, 4 and 8 ranks; run alone (a world of one rank, as
// tests/run_tests.sh does) it runs the same checks on one rank, skipping those that need two.
//
//   test_comm_mpi [--chunk-bytes N] [--trace PATH]   every check; --chunk-bytes cuts every MPI call
//                                                    to N bytes; --trace also writes the gathered
//                                                    trace of a traced section to PATH (+ PATH.json)
//   test_comm_mpi --mesh PP DR DS CP TP [--mesh-dot PATH]   only build that mesh (and draw it)
//   test_comm_mpi --kill-rank R [--timeout S]        rank R dies by SIGKILL in the middle of a loop
//   test_comm_mpi --hang p2p|collective|stop|late|skip --hang-rank R --timeout S   rank R stops taking part
//   test_comm_mpi --mismatch root|op|count|dtype|kind|finalize|recv-short|recv-long|recv-pieces
//                 [--chunk-bytes N]   rank 1 makes a call that does not match the others' (the
//                                     comm layer must end the run with a line saying so)
//
// Every rank's input is a pure function of (rank, index), so each rank computes what every
// collective must return, for all ranks, by itself. Reductions must match a sequential fold in
// rank order bit for bit (that is comm.c's determinism promise), which also makes them identical
// across ranks; that is checked separately through a hash of each result.
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/comm.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/mesh.h"
#include "common/trace.h"

static int failures;

__attribute__((format(printf, 3, 4))) static void fail_at(const char *file, int line, const char *fmt, ...) {
    fprintf(stderr, "rank %d: FAIL %s:%d: ", comm_rank(comm_world()), file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    failures++;
}
#define CHECK(cond, ...)                                    \
    do {                                                    \
        if (!(cond)) fail_at(__FILE__, __LINE__, __VA_ARGS__); \
    } while (0)

static void *zeros(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) fatal("out of memory (%zu bytes)", bytes);
    return p;
}

static const char *dtype_name(CommDtype d) {
    static const char *names[] = {"float32", "float64", "int32", "byte"};
    return names[d];
}
static const char *op_name(CommReduceOp op) {
    static const char *names[] = {"sum", "avg", "max"};
    return names[op];
}

// ---- inputs and expected results -----------------------------------------------------------------

static uint64_t mix(uint64_t x) {  // splitmix64's finalizer
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Rank r's element i. Floats span seven decades, so that their sum depends on its order.
// noinline: gcc's default -ffp-contract=fast would otherwise fuse the last multiply here into the
// caller's sum (one rounding instead of two) and the expected value would not be a plain sum.
__attribute__((noinline)) static double input_real(int rank, size_t i) {
    uint64_t h = mix(mix((uint64_t)rank + 1) ^ i);
    return ((double)(h >> 11) / 9007199254740992.0 - 0.5) * pow(10.0, (double)(h % 7) - 3.0);
}
static int32_t input_int(int rank, size_t i) { return (int32_t)(mix(mix((uint64_t)rank + 7) ^ i) % 200001) - 100000; }

// buf[k] = rank's element first + k.
static void make_input(void *buf, CommDtype d, int rank, size_t first, size_t n) {
    for (size_t k = 0; k < n; k++) {
        if (d == COMM_FLOAT32) ((float *)buf)[k] = (float)input_real(rank, first + k);
        if (d == COMM_FLOAT64) ((double *)buf)[k] = input_real(rank, first + k);
        if (d == COMM_INT32) ((int32_t *)buf)[k] = input_int(rank, first + k);
        if (d == COMM_BYTE) ((unsigned char *)buf)[k] = (unsigned char)input_int(rank, first + k);
    }
}

// out[k] = the reduction over ranks 0..n-1 of element first + k, folded one element at a time in
// rank order, in the dtype's own arithmetic.
static void expected_reduction(void *out, CommDtype d, CommReduceOp op, int n, size_t first, size_t len) {
    for (size_t k = 0; k < len; k++) {
        size_t i = first + k;
        if (d == COMM_FLOAT32) {
            float acc = (float)input_real(0, i);
            for (int r = 1; r < n; r++) {
                float x = (float)input_real(r, i);
                acc = op == COMM_MAX ? (x > acc ? x : acc) : acc + x;
            }
            ((float *)out)[k] = op == COMM_AVG ? acc / (float)n : acc;
        } else if (d == COMM_FLOAT64) {
            double acc = input_real(0, i);
            for (int r = 1; r < n; r++) {
                double x = input_real(r, i);
                acc = op == COMM_MAX ? (x > acc ? x : acc) : acc + x;
            }
            ((double *)out)[k] = op == COMM_AVG ? acc / n : acc;
        } else {
            int64_t acc = input_int(0, i);
            for (int r = 1; r < n; r++) acc = op == COMM_MAX ? (input_int(r, i) > acc ? input_int(r, i) : acc) : acc + input_int(r, i);
            ((int32_t *)out)[k] = (int32_t)acc;
        }
    }
}

static double element_value(const void *buf, CommDtype d, size_t i) {
    switch (d) {
    case COMM_FLOAT32: return ((const float *)buf)[i];
    case COMM_FLOAT64: return ((const double *)buf)[i];
    case COMM_INT32: return ((const int32_t *)buf)[i];
    case COMM_BYTE: return ((const unsigned char *)buf)[i];
    }
    return NAN;
}

// Bit-exact comparison; a failure names the first differing element.
static void expect_same_bits(const char *what, const void *got, const void *want, CommDtype d, size_t n) {
    size_t size = comm_dtype_size(d);
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)got + i * size, (const char *)want + i * size, size) != 0) {
            fail_at(__FILE__, __LINE__, "%s: first difference at element %zu of %zu: got %.17g, want %.17g", what, i, n,
                    element_value(got, d, i), element_value(want, d, i));
            return;
        }
}

// Every rank of c must hold the same bytes.
static void expect_identical_across(Comm *c, const char *what, const void *buf, size_t bytes) {
    uint64_t hash = fnv1a_bytes(FNV1A_BASIS, buf, bytes), *all = zeros(sizeof hash * (size_t)comm_size(c));
    comm_all_gather(c, &hash, all, sizeof hash, COMM_BYTE);
    for (int r = 0; r < comm_size(c); r++) CHECK(all[r] == hash, "%s: rank %d's result differs from this rank's", what, r);
    free(all);
}

// ---- collectives -----------------------------------------------------------------------------------

static const size_t counts[] = {1, 7, 1000, 100003};  // divisible by no rank count but 1, and by all
#define N_COUNTS (sizeof counts / sizeof *counts)
static const CommDtype reducible[] = {COMM_FLOAT32, COMM_FLOAT64, COMM_INT32};
static const CommReduceOp reduce_ops[] = {COMM_SUM, COMM_AVG, COMM_MAX};

static void test_reductions(Comm *c) {
    int n = comm_size(c), me = comm_rank(c);
    for (int di = 0; di < 3; di++)
        for (int oi = 0; oi < 3; oi++)
            for (size_t ci = 0; ci < N_COUNTS; ci++) {
                CommDtype d = reducible[di];
                CommReduceOp op = reduce_ops[oi];
                if (op == COMM_AVG && d == COMM_INT32) continue;
                size_t count = counts[ci], size = comm_dtype_size(d);
                char what[96];
                void *buf = zeros(count * size), *want = zeros(count * size);
                void *send = zeros(count * (size_t)n * size), *recv = zeros(count * size);

                snprintf(what, sizeof what, "all_reduce %s %s of %zu", op_name(op), dtype_name(d), count);
                make_input(buf, d, me, 0, count);
                comm_all_reduce(c, buf, count, d, op);
                expected_reduction(want, d, op, n, 0, count);
                expect_same_bits(what, buf, want, d, count);
                expect_identical_across(c, what, buf, count * size);

                snprintf(what, sizeof what, "reduce_scatter %s %s of %zu per rank", op_name(op), dtype_name(d), count);
                make_input(send, d, me, 0, count * (size_t)n);
                comm_reduce_scatter(c, send, recv, count, d, op);
                expected_reduction(want, d, op, n, (size_t)me * count, count);
                expect_same_bits(what, recv, want, d, count);
                free(buf), free(want), free(send), free(recv);
            }
}

// All-gather, broadcast and all-to-all only move data: exact copies, every dtype.
static void test_data_movement(Comm *c) {
    int n = comm_size(c), me = comm_rank(c);
    for (CommDtype d = COMM_FLOAT32; d <= COMM_BYTE; d++)
        for (size_t ci = 0; ci < N_COUNTS; ci++) {
            size_t count = counts[ci], size = comm_dtype_size(d), all = count * (size_t)n;
            char what[96];
            void *send = zeros(all * size), *recv = zeros(all * size), *want = zeros(all * size);

            snprintf(what, sizeof what, "all_gather %s of %zu", dtype_name(d), count);
            make_input(send, d, me, 0, count);
            comm_all_gather(c, send, recv, count, d);
            for (int r = 0; r < n; r++) make_input((char *)want + (size_t)r * count * size, d, r, 0, count);
            expect_same_bits(what, recv, want, d, all);

            // Block b of rank r's send is r's elements [b * count, (b + 1) * count).
            snprintf(what, sizeof what, "all_to_all %s of %zu per rank", dtype_name(d), count);
            make_input(send, d, me, 0, all);
            comm_all_to_all(c, send, recv, count, d);
            for (int r = 0; r < n; r++) make_input((char *)want + (size_t)r * count * size, d, r, (size_t)me * count, count);
            expect_same_bits(what, recv, want, d, all);

            int roots[2] = {0, n - 1};
            for (int k = 0; k < 2; k++) {
                snprintf(what, sizeof what, "broadcast %s of %zu from %d", dtype_name(d), count, roots[k]);
                memset(recv, 0xab, count * size);
                if (me == roots[k]) make_input(recv, d, me, 0, count);
                comm_broadcast(c, recv, count, d, roots[k]);
                make_input(want, d, roots[k], 0, count);
                expect_same_bits(what, recv, want, d, count);
            }
            free(send), free(recv), free(want);
        }
    comm_barrier(c);
}

// Several operations in flight while the main thread computes, waited for out of order.
static double busy_work(void) {
    double x = 0;
    for (int i = 1; i < 3000000; i++) x += 1.0 / i;
    return x;
}

static void test_async(Comm *c) {
    int n = comm_size(c), me = comm_rank(c);
    size_t count = 100003;
    float *sum = zeros(count * sizeof *sum), *want = zeros(count * sizeof *want);
    double *gathered = zeros(1000 * (size_t)n * sizeof *gathered), *mine = zeros(1000 * sizeof *mine);
    int32_t *bcast = zeros(777 * sizeof *bcast), *bcast_want = zeros(777 * sizeof *bcast_want);
    make_input(sum, COMM_FLOAT32, me, 0, count);
    make_input(mine, COMM_FLOAT64, me, 0, 1000);
    if (me == n - 1) make_input(bcast, COMM_INT32, me, 0, 777);

    CommHandle *h_sum = comm_all_reduce_start(c, sum, count, COMM_FLOAT32, COMM_SUM);
    CommHandle *h_gather = comm_all_gather_start(c, mine, gathered, 1000, COMM_FLOAT64);
    CommHandle *h_bcast = comm_broadcast_start(c, bcast, 777, COMM_INT32, n - 1);
    CommHandle *h_barrier = comm_barrier_start(c);
    double x = busy_work();  // the main thread keeps computing meanwhile
    CHECK(x > 1, "busy work");
    comm_wait(h_bcast);
    comm_wait(h_sum);
    while (!comm_test(h_barrier)) usleep(100);  // test polls, wait then frees
    comm_wait(h_barrier);
    comm_wait(h_gather);
    comm_wait(NULL);

    expected_reduction(want, COMM_FLOAT32, COMM_SUM, n, 0, count);
    expect_same_bits("async all_reduce", sum, want, COMM_FLOAT32, count);
    make_input(bcast_want, COMM_INT32, n - 1, 0, 777);
    expect_same_bits("async broadcast", bcast, bcast_want, COMM_INT32, 777);
    for (int r = 0; r < n; r++) {
        make_input(mine, COMM_FLOAT64, r, 0, 1000);
        expect_same_bits("async all_gather", gathered + (size_t)r * 1000, mine, COMM_FLOAT64, 1000);
    }
    free(sum), free(want), free(gathered), free(mine), free(bcast), free(bcast_want);
}

// ---- point to point ----------------------------------------------------------------------------------

// Everybody sends 4 MB right and receives from the left, and the same leftwards, in one batch.
// Queued one transfer at a time, the rendezvous sends would wait on each other forever.
static void test_ring(Comm *c) {
    int n = comm_size(c), me = comm_rank(c), right = (me + 1) % n, left = (me + n - 1) % n;
    size_t count = 1 << 20;  // 4 MB of floats
    float *to_right = zeros(count * 4), *to_left = zeros(count * 4), *from_left = zeros(count * 4);
    float *from_right = zeros(count * 4), *want = zeros(count * 4);
    make_input(to_right, COMM_FLOAT32, me, 0, count);
    make_input(to_left, COMM_FLOAT32, me, count, count);
    CommP2P ops[4] = {{COMM_SEND, to_right, count, COMM_FLOAT32, right, 1},
                      {COMM_RECV, from_left, count, COMM_FLOAT32, left, 1},
                      {COMM_SEND, to_left, count, COMM_FLOAT32, left, 2},
                      {COMM_RECV, from_right, count, COMM_FLOAT32, right, 2}};
    comm_wait(comm_batch_start(c, ops, 4));
    make_input(want, COMM_FLOAT32, left, 0, count);
    expect_same_bits("ring: from the left", from_left, want, COMM_FLOAT32, count);
    make_input(want, COMM_FLOAT32, right, count, count);
    expect_same_bits("ring: from the right", from_right, want, COMM_FLOAT32, count);
    free(to_right), free(to_left), free(from_left), free(from_right), free(want);
}

// Tags pick the message: rank 1 receives in the opposite order from rank 0's sends. Then plain
// send/recv, an empty message, and sendrecv two ranks around the ring.
static void test_tags(Comm *c) {
    int n = comm_size(c), me = comm_rank(c);
    double a[100], b[200], got_a[100], got_b[200];
    make_input(a, COMM_FLOAT64, 0, 0, 100);
    make_input(b, COMM_FLOAT64, 0, 100, 200);
    if (me == 0) {
        CommP2P sends[2] = {{COMM_SEND, a, 100, COMM_FLOAT64, 1, 10}, {COMM_SEND, b, 200, COMM_FLOAT64, 1, 20}};
        comm_wait(comm_batch_start(c, sends, 2));
    } else if (me == 1) {
        CommP2P recvs[2] = {{COMM_RECV, got_b, 200, COMM_FLOAT64, 0, 20}, {COMM_RECV, got_a, 100, COMM_FLOAT64, 0, 10}};
        comm_wait(comm_batch_start(c, recvs, 2));
        expect_same_bits("tag 10", got_a, a, COMM_FLOAT64, 100);
        expect_same_bits("tag 20", got_b, b, COMM_FLOAT64, 200);
    }

    int32_t msg[1000], got[1000];
    make_input(msg, COMM_INT32, 0, 0, 1000);
    if (me == 0) {
        comm_send(c, msg, 1000, COMM_INT32, n - 1, 5);
        comm_send(c, NULL, 0, COMM_INT32, n - 1, 6);
    }
    if (me == n - 1) {
        comm_recv(c, got, 1000, COMM_INT32, 0, 5);
        expect_same_bits("send/recv tag 5", got, msg, COMM_INT32, 1000);
        comm_recv(c, NULL, 0, COMM_INT32, 0, 6);
    }

    float out[777], in[777], want[777];
    make_input(out, COMM_FLOAT32, me, 0, 777);
    comm_sendrecv(c, out, 777, (me + 2) % n, in, 777, (me + n - 2) % n, COMM_FLOAT32, 3);
    make_input(want, COMM_FLOAT32, (me + n - 2) % n, 0, 777);
    expect_same_bits("sendrecv by 2", in, want, COMM_FLOAT32, 777);
}

// ---- mesh ------------------------------------------------------------------------------------------

// The group of dimension set `dims` must hold exactly the ranks that differ from this one only
// there, in mesh order, and an all-reduce over it must see exactly them.
static void expect_group(const Mesh *m, Comm *g, unsigned dims, const char *name) {
    int size = 1, index = 0;
    for (int d = 0; d < MESH_N_DIMS; d++)
        if (dims & (1u << d)) size *= m->degree[d], index = index * m->degree[d] + m->coord[d];
    CHECK(comm_size(g) == size, "mesh %s: %d ranks, want %d", name, comm_size(g), size);
    CHECK(comm_rank(g) == index, "mesh %s: rank %d, want %d", name, comm_rank(g), index);
    CHECK(strcmp(comm_name(g), name) == 0, "mesh group named '%s', want '%s'", comm_name(g), name);
    if (comm_size(g) != size) return;
    int32_t want_sum = 0;
    for (int i = 0; i < size; i++) {
        int c[MESH_N_DIMS], rest = i;
        for (int d = MESH_N_DIMS - 1; d >= 0; d--) {
            c[d] = m->coord[d];
            if (dims & (1u << d)) c[d] = rest % m->degree[d], rest /= m->degree[d];
        }
        int member = mesh_rank_of(m, c);
        CHECK(comm_world_rank_of(g, i) == member, "mesh %s: member %d is world rank %d, want %d", name, i,
              comm_world_rank_of(g, i), member);
        want_sum += member;
    }
    int32_t sum = m->rank;
    comm_all_reduce(g, &sum, 1, COMM_INT32, COMM_SUM);
    CHECK(sum == want_sum, "mesh %s: all-reduce of world ranks gave %d, want %d", name, sum, want_sum);
}

static void check_mesh(const int degree[MESH_N_DIMS]) {
    Mesh *m = mesh_create(degree[0], degree[1], degree[2], degree[3], degree[4]);
    const int *c = m->coord;
    int r = (((c[0] * degree[1] + c[1]) * degree[2] + c[2]) * degree[3] + c[3]) * degree[4] + c[4];
    CHECK(r == m->rank, "mesh coordinates of rank %d give rank %d", m->rank, r);
    CHECK(mesh_rank_of(m, c) == m->rank, "mesh_rank_of");
    for (int d = 0; d < MESH_N_DIMS; d++) expect_group(m, m->dim[d], 1u << d, mesh_dim_name((MeshDim)d));
    expect_group(m, m->dp_shard_cp, 1u << MESH_DP_SHARD | 1u << MESH_CP, "dp_shard_cp");
    expect_group(m, m->dp, 1u << MESH_DP_REPLICATE | 1u << MESH_DP_SHARD, "dp");
    char label[96];
    snprintf(label, sizeof label, "rank %d [pp%d dp%d cp%d tp%d]", m->rank, c[0], c[1] * degree[2] + c[2], c[3], c[4]);
    CHECK(strcmp(m->label, label) == 0, "mesh label '%s', want '%s'", m->label, label);
    mesh_free(m);
}

// Every way to write the world size as pp x dp_replicate x dp_shard x cp x tp.
static int test_all_meshes(int degree[MESH_N_DIMS], int d, int left) {
    if (d == MESH_N_DIMS - 1) {
        degree[d] = left;
        check_mesh(degree);
        return 1;
    }
    int n = 0;
    for (int k = 1; k <= left; k++)
        if (left % k == 0) degree[d] = k, n += test_all_meshes(degree, d + 1, left / k);
    return n;
}

// ---- trace -----------------------------------------------------------------------------------------

// Rank 0 gathers every rank's buffer (padded to the longest) and writes one merged trace.
static void write_gathered_trace(Comm *c, const char *path) {
    int n = comm_size(c);
    void *blob;
    size_t len;
    if (!trace_serialize(&blob, &len)) fatal("trace_serialize");
    uint64_t my_len = len, *lens = zeros(sizeof *lens * (size_t)n), longest = 0;
    comm_all_gather(c, &my_len, lens, sizeof my_len, COMM_BYTE);
    for (int r = 0; r < n; r++) longest = lens[r] > longest ? lens[r] : longest;
    char *padded = zeros(longest), *all = zeros(longest * (size_t)n);
    memcpy(padded, blob, len);
    comm_all_gather(c, padded, all, longest, COMM_BYTE);
    if (comm_rank(c) == 0) {
        TraceRankInput *inputs = zeros(sizeof *inputs * (size_t)n);
        char err[256], json[4096];
        for (int r = 0; r < n; r++) {
            inputs[r].data = trace_deserialize(all + (size_t)r * longest, lens[r], err, sizeof err);
            if (!inputs[r].data) fatal("rank %d's trace: %s", r, err);
        }
        snprintf(json, sizeof json, "%s.json", path);
        CHECK(trace_write_pftrace_ranks(path, inputs, n, err, sizeof err), "%s: %s", path, err);
        CHECK(trace_write_json_ranks(json, inputs, n, err, sizeof err), "%s: %s", json, err);
        for (int r = 0; r < n; r++) trace_rank_data_free((TraceRankData *)inputs[r].data);
        free(inputs);
    }
    free(blob), free(lens), free(padded), free(all);
}

// The main thread records compute slices while the worker records its own, at the same time.
static void test_trace(Comm *c, const char *path) {
    int n = comm_size(c), me = comm_rank(c), right = (me + 1) % n, left = (me + n - 1) % n;
    char label[64];
    snprintf(label, sizeof label, "rank %d", me);
    trace_init(me, label);
    int compute = trace_track("compute");
    size_t count = 100003, n_ops = 0, n_compute = 0;
    float *buf = zeros(count * 4), *gathered = zeros(count * 4 * (size_t)n), *got = zeros(count * 4);
    make_input(buf, COMM_FLOAT32, me, 0, count);
    for (int step = 0; step < 3; step++) {
        CommP2P ring[2] = {{COMM_SEND, buf, count, COMM_FLOAT32, right, 0},
                           {COMM_RECV, got, count, COMM_FLOAT32, left, 0}};
        CommHandle *h[3] = {comm_batch_start(c, ring, 2), comm_all_gather_start(c, buf, gathered, count, COMM_FLOAT32),
                            comm_barrier_start(c)};
        n_ops += 3;
        for (int k = 0; k < 20; k++, n_compute++) {
            trace_begin(compute, "matmul", "compute");
            trace_arg_int(compute, "step", step);
            busy_work();
            trace_end(compute);
        }
        for (int k = 0; k < 3; k++) comm_wait(h[k]);
    }
    comm_all_reduce(c, buf, count, COMM_FLOAT32, COMM_AVG);
    n_ops++;
    TraceStats st = trace_stats(trace_local());
    CHECK(st.tracks == 2, "trace: %zu tracks, want compute and comm:world", st.tracks);
    CHECK(st.slices == n_compute + n_ops, "trace: %zu slices, want %zu compute + %zu comm", st.slices, n_compute, n_ops);
    CHECK(st.open_slices == 0, "trace: %zu slices left open", st.open_slices);
    CHECK(st.flows == 3 * 2, "trace: %zu flow ends, want a send and a receive per ring step", st.flows);
    CHECK(st.args >= n_compute + 4 * n_ops, "trace: %zu args", st.args);
    if (path) write_gathered_trace(c, path);
    trace_shutdown();
    free(buf), free(gathered), free(got);
}

// ---- failure modes (driven by tests/t_comm.sh) ----------------------------------------------------

static void run_until_killed(Comm *c, int victim) {
    for (int step = 0;; step++) {
        if (step == 3 && comm_rank(c) == victim) {
            fprintf(stderr, "rank %d: killing myself (SIGKILL) at step %d\n", victim, step);
            raise(SIGKILL);
        }
        float x = 1;
        comm_all_reduce(c, &x, 1, COMM_FLOAT32, COMM_SUM);
        if (step > 100000) fatal("rank %d never died", victim);
    }
}

// The victim stops taking part without dying: only the timeout can end the run. "p2p" and
// "collective": it sleeps (alive: its comm thread still answers); "stop": after two barriers it
// stops itself with SIGSTOP, as `kill -STOP` would (nothing of it runs, not even its comm thread);
// "late": it stops itself after its last collective, while the others are in comm_finalize;
// "skip": it skips the second barrier of a subgroup and goes on to comm_finalize, alive (its comm
// thread must still answer that it is behind).
static void run_until_timeout(Comm *c, int victim, const char *what) {
    if (strcmp(what, "late") == 0) {
        comm_barrier(c);
        if (comm_rank(c) == victim) raise(SIGSTOP);
        comm_finalize();
        fatal("comm_finalize returned although rank %d is stopped", victim);
    }
    if (strcmp(what, "skip") == 0) {
        Comm *sub = comm_split(c, 0, comm_rank(c), "sub");
        comm_barrier(sub);
        if (comm_rank(c) != victim) comm_barrier(sub);
        comm_finalize();
        fatal("comm_finalize returned although rank %d skipped a barrier", victim);
    }
    if (strcmp(what, "stop") == 0) {
        comm_barrier(c);
        comm_barrier(c);
        if (comm_rank(c) == victim) raise(SIGSTOP);
        comm_barrier(c);
        sleep(120);
        fatal("the timeout never fired");
    }
    if (comm_rank(c) == victim) sleep(120);
    if (strcmp(what, "p2p") == 0 && comm_rank(c) == 0) {
        float x;
        comm_recv(c, &x, 1, COMM_FLOAT32, victim, 9);
    } else if (strcmp(what, "collective") == 0) {
        comm_barrier(c);
    }
    sleep(120);
    fatal("the timeout never fired");
}

// Rank 1 makes a call that does not match the others' (world rank 0's, for point to point). The
// comm layer must end the run with a line naming the difference; the barrier after it lets every
// rank see whether it did, and a run that gets past it has let the mismatch through.
static void run_mismatch(Comm *c, const char *what) {
    int me = comm_rank(c), odd = me == 1;
    float buf[1600] = {0}, out[1600 * 8];
    for (int i = 0; i < 1600; i++) buf[i] = (float)(me + 1);
    if (comm_size(c) < 2) fatal("--mismatch needs two ranks");
    if (strcmp(what, "root") == 0)
        comm_broadcast(c, buf, 4, COMM_FLOAT32, odd ? 1 : 0);
    else if (strcmp(what, "op") == 0)
        comm_all_reduce(c, buf, 4, COMM_FLOAT32, odd ? COMM_MAX : COMM_SUM);
    else if (strcmp(what, "count") == 0)
        comm_all_reduce(c, buf, odd ? 5 : 4, COMM_FLOAT32, COMM_SUM);
    else if (strcmp(what, "dtype") == 0)
        comm_all_reduce(c, buf, 4, odd ? COMM_INT32 : COMM_FLOAT32, COMM_SUM);
    else if (strcmp(what, "kind") == 0) {
        if (odd) comm_all_gather(c, buf, out, 4, COMM_FLOAT32);
        else comm_all_reduce(c, buf, 4, COMM_FLOAT32, COMM_SUM);
    } else if (strcmp(what, "finalize") == 0) {  // rank 1 skips a barrier and finishes
        comm_barrier(c);
        if (!odd) comm_barrier(c);
        comm_finalize();
        fatal("comm_finalize returned although rank 1 skipped a barrier");
    } else if (strncmp(what, "recv-", 5) == 0) {
        // short: 3 sent, 5 posted; long: 5 sent, 3 posted; pieces (with --chunk-bytes 4000, 1000
        // floats a piece): 500 sent, 1500 posted, so the second piece would take the next message
        bool pieces = strcmp(what, "recv-pieces") == 0;
        size_t sent = pieces ? 500 : strcmp(what, "recv-short") == 0 ? 3 : 5;
        size_t posted = pieces ? 1500 : strcmp(what, "recv-short") == 0 ? 5 : 3;
        if (me == 0) {
            comm_send(c, buf, sent, COMM_FLOAT32, 1, 7);
            comm_send(c, buf, 10, COMM_FLOAT32, 1, 7);
        } else if (me == 1) {
            comm_recv(c, buf, posted, COMM_FLOAT32, 0, 7);
            comm_recv(c, buf, 10, COMM_FLOAT32, 0, 7);
        }
    } else
        fatal_input("--mismatch %s: unknown case", what);
    comm_barrier(c);
    fatal("--mismatch %s: the mismatch went unnoticed", what);
}

// ---- main ------------------------------------------------------------------------------------------

typedef struct {
    CommOptions comm;
    const char *trace_path, *mesh_dot, *hang, *mismatch;
    int mesh[MESH_N_DIMS];
    bool only_mesh;
    int kill_rank, hang_rank;
} Args;

static Args parse_args(int argc, char **argv) {
    Args a = {.comm = {.trace = true}, .kill_rank = -1, .hang_rank = 1};
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        bool has_value = i + 1 < argc;
        if (strcmp(flag, "--chunk-bytes") == 0 && has_value)
            a.comm.chunk_bytes = strtoull(argv[++i], NULL, 10);
        else if (strcmp(flag, "--timeout") == 0 && has_value)
            a.comm.timeout_seconds = atof(argv[++i]);
        else if (strcmp(flag, "--trace") == 0 && has_value)
            a.trace_path = argv[++i];
        else if (strcmp(flag, "--mesh-dot") == 0 && has_value)
            a.mesh_dot = argv[++i];
        else if (strcmp(flag, "--kill-rank") == 0 && has_value)
            a.kill_rank = atoi(argv[++i]);
        else if (strcmp(flag, "--hang") == 0 && has_value)
            a.hang = argv[++i];
        else if (strcmp(flag, "--mismatch") == 0 && has_value)
            a.mismatch = argv[++i];
        else if (strcmp(flag, "--hang-rank") == 0 && has_value)
            a.hang_rank = atoi(argv[++i]);
        else if (strcmp(flag, "--mesh") == 0 && i + MESH_N_DIMS < argc) {
            a.only_mesh = true;
            for (int d = 0; d < MESH_N_DIMS; d++) a.mesh[d] = atoi(argv[++i]);
        } else
            fatal_input("%s: unknown flag or missing value (see the comment at the top of tests/test_comm_mpi.c)", flag);
    }
    return a;
}

static void run_mesh_only(const Args *a) {
    Mesh *m = mesh_create(a->mesh[0], a->mesh[1], a->mesh[2], a->mesh[3], a->mesh[4]);
    printf("%s\n", m->label);  // every rank (log_info speaks for rank 0 only)
    fflush(stdout);
    if (a->mesh_dot && m->rank == 0) mesh_write_dot(m, a->mesh_dot);
    mesh_free(m);
}

// Returns the number of meshes checked.
// The tests start every rank on this one host: each one's local rank is its world rank, and the
// local size is the world size (a launcher's node mapping would change the first, not the count).
static void test_local_rank(Comm *world) {
    CHECK(comm_local_size() == comm_size(world), "local size %d, world size %d, all on one host", comm_local_size(),
          comm_size(world));
    int32_t sum = comm_local_rank();  // every local rank once: their sum is 0 + 1 + ... + n-1
    comm_all_reduce(world, &sum, 1, COMM_INT32, COMM_SUM);
    int n = comm_size(world);
    CHECK(sum == n * (n - 1) / 2 && comm_local_rank() >= 0 && comm_local_rank() < n,
          "local ranks sum to %d on %d ranks (this one: %d)", sum, n, comm_local_rank());
}

static int run_checks(Comm *world, const Args *a) {
    int n = comm_size(world);
    test_local_rank(world);
    test_reductions(world);
    test_data_movement(world);
    test_async(world);
    test_ring(world);
    if (n > 1) test_tags(world);
    int degree[MESH_N_DIMS];
    int meshes = test_all_meshes(degree, 0, n);
    test_trace(world, a->trace_path);
    return meshes;
}

static void report(int n, int total, int meshes) {
    if (total)
        printf("test_comm_mpi: %d ranks: %d failed checks\n", n, total);
    else if (n == 1)
        printf("test_comm_mpi: world size 1: single-rank checks passed (%d mesh); tests/t_comm.sh runs the "
               "multi-rank ones under mpirun\n", meshes);
    else
        printf("test_comm_mpi: %d ranks: all checks passed (%d meshes)\n", n, meshes);
}

int main(int argc, char **argv) {
    log_set_program("test_comm_mpi");
    Args a = parse_args(argc, argv);
    comm_init(&argc, &argv, &a.comm);
    Comm *world = comm_world();
    int meshes = 0;
    if (a.only_mesh)
        run_mesh_only(&a);
    else if (a.kill_rank >= 0)
        run_until_killed(world, a.kill_rank);
    else if (a.hang)
        run_until_timeout(world, a.hang_rank, a.hang);
    else if (a.mismatch)
        run_mismatch(world, a.mismatch);
    else
        meshes = run_checks(world, &a);
    int32_t total = failures;
    comm_all_reduce(world, &total, 1, COMM_INT32, COMM_SUM);
    if (!a.only_mesh && comm_rank(world) == 0) report(comm_size(world), total, meshes);
    comm_finalize();
    return total ? 1 : 0;
}
