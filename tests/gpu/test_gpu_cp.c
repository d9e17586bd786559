// test_gpu_cp.c: chapter 8's ring attention on device buffers (gpu/cp_device.h) against the same module
// on host buffers. Run under mpirun with 1, 2 or 4 ranks (t_gpu_emulated: 2 and 4 on the emulator,
// through the staged backend). Each rank holds its tokens of B sequences of T (zigzag and
// contiguous splits); the forward's out and lse and the backward's dq, dk, dv (accumulated onto
// non-zero starting values, to check +=) from cp_attention_forward/backward with gpu_cp_compute are
// compared with cp_create's host compute on the same inputs, and the two rings must post the same
// number of transfers. The device's results are also checked against plain attention on the whole
// sequence (reference_cpu's, on one rank: this rank's rows of it), so a fault in the module both
// rings share fails too.
//
// Tolerances. Against the whole sequence: CP_ATTENTION_RTOL of each tensor's largest value
// (tests/tolerances.h: the log-sum-exp merges and the dK/dV partial sums). Device against host ring
// (the "fp32" rule of test_gpu_ops): |gpu - host| <= 1e-4 |host| + 1e-4 max|host| per
// element. Both sides run the same blocks, merges and ring sums in the same order; what differs is
// inside each block (the GPU kernel's tile order and CUDA's expf against the reference's exp), a few
// 1e-7 relative, 100x below the bound; a block skipped, merged twice, taken from the wrong source or
// a dK/dV returned to the wrong rank is off by order 1.
//
// Then the same with gpu_cp_compute_bf16, the bf16 model's table (each block on the tensor-core
// kernels with fp32 results), on inputs that are bf16 values: against the host ring and the whole
// sequence norm-wise within BF16_BLOCKS_TOL (below), lse by the fp32 rule.
//
// Mutations tried (each fails here): gpu_attention_merge's weights swapped (a <-> b); the device
// positions left un-uploaded (zeros: the causal mask of every block wrong); the dK/dV ring's add of
// the block's share dropped (in the shared module: the whole-sequence check); the tensor-core dQ
// kernel storing its fp32 result instead of adding it (3.3 against 2^-6); the bf16 table's forward
// reading V's block from K's (1.5).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/08_context_parallel/cp.h"
#include "common/rng.h"
#include "gpu/comm_device.h"
#include "gpu/cp_device.h"
#include "gpu/numerics.h"
#include "gpu/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/tolerances.h"

#define RTOL 1e-4
#define ATOL 1e-4

enum { B = 2, T = 32, H = 4, HKV = 2, HD = 16 };

static float *host_floats(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) fatal("out of memory");
    return p;
}

// The bf16 table's run draws every input as bf16 values (what a bf16 model's tensors hold).
static bool bf16_inputs;

// This rank's tokens (positions) of B full sequences of T rows of `width` floats, drawn from stream
// (rounded to bf16 under bf16_inputs).
static float *local_rows(const int *positions, int Tl, int width, uint64_t stream) {
    float *x = host_floats((size_t)B * Tl * width);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tl; t++)
            for (int j = 0; j < width; j++) {
                uint64_t full_index = ((uint64_t)b * T + positions[t]) * width + j;  // the same on every rank
                float value = (float)rng_normal(7, stream, full_index);
                x[((size_t)b * Tl + t) * width + j] = bf16_inputs ? bf16_round(value) : value;
            }
    return x;
}

static float *to_device(const float *host, size_t n) {
    float *d = gpu_alloc(MEM_OTHER, sizeof(float) * n);
    gpu_upload(d, host, sizeof(float) * n);
    return d;
}

static float *from_device(const float *device, size_t n) {
    float *h = host_floats(n);
    gpu_download(h, device, sizeof(float) * n);
    return h;
}

static void compare(const char *what, const char *split, const float *gpu, const float *host, size_t n) {
    double scale = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(host[i]));
    double worst = 0;
    size_t worst_i = 0;
    bool ok = scale > 0;  // an all-zero reference would prove nothing
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)gpu[i] - host[i]);
        if (!(d <= RTOL * fabs(host[i]) + ATOL * scale)) ok = false;
        if (!(d <= worst)) worst = d, worst_i = i;
    }
    char name[96];
    snprintf(name, sizeof name, "ring %s (%s)", what, split);
    report(name, ok, "max abs %.3e, max rel %.3e at [%zu]: %.7g vs %.7g (rtol %g + atol %g x %.3g)", worst,
           worst / scale, worst_i, gpu[worst_i], host[worst_i], RTOL, ATOL, scale);
}

// The bf16 table (tensor-core blocks) against an fp32 computation on the same bf16 values, norm-wise
// on what attention added (got - start against want - start; start NULL for out and lse):
// ||.|| <= BF16_BLOCKS_TOL ||want - start||. The tensor-core blocks round P and dS to bf16 before their
// second products (2^-8 relative per term, two chained products for dQ and dK) and sum in another
// order; their outputs are stored in fp32, unrounded: within 4 unit roundoffs, 2^-6, as test_gpu_ops'
// tensor-core against CUDA-core bound. A block dropped, merged twice or masked wrongly is off by O(1).
#define BF16_BLOCKS_TOL 0x1p-6
static void compare_bf16(const char *what, const char *against, const char *split, const float *got,
                         const float *want, const float *start, size_t n) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < n; i++) {
        double w = want[i] - (start ? start[i] : 0), g = got[i] - (start ? start[i] : 0);
        diff += (g - w) * (g - w), norm += w * w;
    }
    double e = norm > 0 ? sqrt(diff / norm) : INFINITY;  // an all-zero reference would prove nothing
    char name[128];
    snprintf(name, sizeof name, "ring %s vs %s (%s)", what, against, split);
    report(name, e <= BF16_BLOCKS_TOL, "||got - want|| / ||want|| = %.3g (bound %.3g)", e, BF16_BLOCKS_TOL);
}

// Element-wise against the whole sequence's attention: |gpu - want| <= CP_ATTENTION_RTOL max|want|.
static void compare_whole(const char *what, const char *split, const float *gpu, const float *want, size_t n) {
    double scale = 0, worst = 0;
    size_t worst_i = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)gpu[i] - want[i]);
        if (!(d <= worst)) worst = d, worst_i = i;
    }
    char name[96];
    snprintf(name, sizeof name, "ring %s vs whole sequence (%s)", what, split);
    report(name, scale > 0 && worst <= CP_ATTENTION_RTOL * scale, "max abs %.3e = %.3e of max|want| at [%zu] (bound %s)",
           worst, worst / scale, worst_i, CP_ATTENTION_RTOL_TEXT);
}

// Plain attention on the whole sequences (every rank computes it), and this rank's rows of each
// result: out (B, Tl, H, HD), lse (B, H, Tl), and start + the gradients of its tokens.
typedef struct {
    float *out, *lse, *dq, *dk, *dv;
} Whole;

static Whole whole_sequence(const int *positions, int Tl, const float *start_q, const float *start_kv) {
    int *all = malloc(sizeof(int) * T);
    for (int t = 0; t < T; t++) all[t] = t;
    float *q = local_rows(all, T, H * HD, 1), *k = local_rows(all, T, HKV * HD, 2), *v = local_rows(all, T, HKV * HD, 3);
    float *dout = local_rows(all, T, H * HD, 4);
    size_t nq = (size_t)B * T * H * HD, nkv = (size_t)B * T * HKV * HD;
    float *out = host_floats(nq), *lse = host_floats((size_t)B * H * T);
    float *dq = host_floats(nq), *dk = host_floats(nkv), *dv = host_floats(nkv);
    AttnShape s = {B, T, T, H, HKV, HD, all, all, true};
    attention_flash_forward(out, lse, q, k, v, &s);
    attention_flash_backward(dq, dk, dv, dout, q, k, v, out, lse, &s);
    Whole w = {host_floats((size_t)B * Tl * H * HD), host_floats((size_t)B * H * Tl), host_floats((size_t)B * Tl * H * HD),
               host_floats((size_t)B * Tl * HKV * HD), host_floats((size_t)B * Tl * HKV * HD)};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tl; t++) {
            size_t from = (size_t)b * T + positions[t], to = (size_t)b * Tl + t;
            for (int j = 0; j < H * HD; j++) {
                w.out[to * H * HD + j] = out[from * H * HD + j];
                w.dq[to * H * HD + j] = start_q[to * H * HD + j] + dq[from * H * HD + j];
            }
            for (int j = 0; j < HKV * HD; j++) {
                w.dk[to * HKV * HD + j] = start_kv[to * HKV * HD + j] + dk[from * HKV * HD + j];
                w.dv[to * HKV * HD + j] = start_kv[to * HKV * HD + j] + dv[from * HKV * HD + j];
            }
            for (int h = 0; h < H; h++) w.lse[((size_t)b * H + h) * Tl + t] = lse[((size_t)b * H + h) * T + positions[t]];
        }
    float *buffers[] = {q, k, v, dout, out, lse, dq, dk, dv};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) free(buffers[i]);
    free(all);
    return w;
}

static void ring_on_both(Comm *group, bool balanced) {
    const char *split = balanced ? (bf16_inputs ? "zigzag, bf16 table" : "zigzag")
                                 : (bf16_inputs ? "contiguous, bf16 table" : "contiguous");
    int n = comm_size(group);
    CpLayout layout = cp_layout(n, comm_rank(group), T, balanced);
    int Tl = cp_local_len(&layout);
    int *positions = malloc(sizeof(int) * Tl);
    cp_local_positions(&layout, positions);
    size_t nq = (size_t)B * Tl * H * HD, nkv = (size_t)B * Tl * HKV * HD, nlse = (size_t)B * H * Tl;
    float *q = local_rows(positions, Tl, H * HD, 1), *k = local_rows(positions, Tl, HKV * HD, 2);
    float *v = local_rows(positions, Tl, HKV * HD, 3), *dout = local_rows(positions, Tl, H * HD, 4);
    float *start_q = local_rows(positions, Tl, H * HD, 5), *start_kv = local_rows(positions, Tl, HKV * HD, 6);

    // The host ring.
    ContextParallel *host = cp_create(group, CP_RING, balanced, B, T, H, HKV, HD, NULL);
    float *out = host_floats(nq), *lse = host_floats(nlse);
    float *dq = host_floats(nq), *dk = host_floats(nkv), *dv = host_floats(nkv);
    memcpy(dq, start_q, sizeof(float) * nq), memcpy(dk, start_kv, sizeof(float) * nkv);
    memcpy(dv, start_kv, sizeof(float) * nkv);
    cp_attention_forward(host, out, lse, q, k, v);
    cp_attention_backward(host, dq, dk, dv, dout, q, k, v, out, lse);

    // The device ring, on the same inputs.
    const CpCompute *table = bf16_inputs ? &gpu_cp_compute_bf16 : &gpu_cp_compute;
    ContextParallel *dev = cp_create(group, CP_RING, balanced, B, T, H, HKV, HD, table);
    float *d_q = to_device(q, nq), *d_k = to_device(k, nkv), *d_v = to_device(v, nkv), *d_dout = to_device(dout, nq);
    float *d_out = gpu_alloc(MEM_OTHER, sizeof(float) * nq), *d_lse = gpu_alloc(MEM_OTHER, sizeof(float) * nlse);
    float *d_dq = to_device(start_q, nq), *d_dk = to_device(start_kv, nkv), *d_dv = to_device(start_kv, nkv);
    cp_attention_forward(dev, d_out, d_lse, d_q, d_k, d_v);
    cp_attention_backward(dev, d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse);

    float *g_out = from_device(d_out, nq), *g_lse = from_device(d_lse, nlse), *g_dq = from_device(d_dq, nq);
    float *g_dk = from_device(d_dk, nkv), *g_dv = from_device(d_dv, nkv);
    char name[96];
    Whole whole = whole_sequence(positions, Tl, start_q, start_kv);
    if (bf16_inputs) {  // lse comes from fp32 scores on both sides: the fp32 rule
        compare("forward lse", split, g_lse, lse, nlse);
        const float *got[] = {g_out, g_dq, g_dk, g_dv}, *ring[] = {out, dq, dk, dv};
        const float *wholes[] = {whole.out, whole.dq, whole.dk, whole.dv}, *starts[] = {NULL, start_q, start_kv, start_kv};
        const char *what[] = {"forward out", "backward dq (+=)", "backward dk (+=)", "backward dv (+=)"};
        size_t counts[] = {nq, nq, nkv, nkv};
        for (int i = 0; i < 4; i++) {
            compare_bf16(what[i], "host ring", split, got[i], ring[i], starts[i], counts[i]);
            compare_bf16(what[i], "whole sequence", split, got[i], wholes[i], starts[i], counts[i]);
        }
    } else {
        compare("forward out", split, g_out, out, nq);
        compare("forward lse", split, g_lse, lse, nlse);
        compare("backward dq (+=)", split, g_dq, dq, nq);
        compare("backward dk (+=)", split, g_dk, dk, nkv);
        compare("backward dv (+=)", split, g_dv, dv, nkv);
        compare_whole("forward out", split, g_out, whole.out, nq);
        compare_whole("forward lse", split, g_lse, whole.lse, nlse);
        compare_whole("backward dq (+=)", split, g_dq, whole.dq, nq);
        compare_whole("backward dk (+=)", split, g_dk, whole.dk, nkv);
        compare_whole("backward dv (+=)", split, g_dv, whole.dv, nkv);
    }
    free(whole.out), free(whole.lse), free(whole.dq), free(whole.dk), free(whole.dv);
    snprintf(name, sizeof name, "ring transfers (%s)", split);
    report(name, cp_transfers(dev) == cp_transfers(host), "device %lld, host %lld", cp_transfers(dev),
           cp_transfers(host));

    cp_free(host), cp_free(dev);
    float *device_buffers[] = {d_q, d_k, d_v, d_dout, d_out, d_lse, d_dq, d_dk, d_dv};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) gpu_free(device_buffers[i]);
    float *host_buffers[] = {q, k, v, dout, start_q, start_kv, out, lse, dq, dk, dv, g_out, g_lse, g_dq, g_dk, g_dv};
    for (size_t i = 0; i < sizeof host_buffers / sizeof host_buffers[0]; i++) free(host_buffers[i]);
    free(positions);
}

int main(int argc, char **argv) {
    if (!gpu_test_start_ranks("test_gpu_cp", &argc, &argv, false)) return 0;
    gpu_comm_backend_init(GPU_COMM_AUTO);
    Comm *world = comm_world();
    if (argc > 1 && strcmp(argv[1], "alltoall") == 0)  // must stop with one line: the ring only on a device
        cp_create(world, CP_ALLTOALL, true, B, T, H, HKV, HD, &gpu_cp_compute);
    ring_on_both(world, true);
    ring_on_both(world, false);
    bf16_inputs = true;  // the bf16 model's table: blocks on the tensor cores
    ring_on_both(world, true);
    ring_on_both(world, false);
    int failed = n_failed, checks = n_checks;
    comm_all_reduce(world, &failed, 1, COMM_INT32, COMM_SUM);
    comm_all_reduce(world, &checks, 1, COMM_INT32, COMM_SUM);
    if (comm_rank(world) == 0) printf("test_gpu_cp: %d checks, %d failed\n", checks, failed);  // over all ranks
    gpu_comm_backend_shutdown();
    gpu_shutdown();
    comm_finalize();
    return failed ? 1 : 0;
}
