// test_gpu_ddp.c: data parallelism on the GPU through comm.h's device backend (gpu/dist.h; ranks that
// share a GPU get the staged one, MPI through host memory), against the single-process reference. Run under mpirun; `make test-gpu` runs it on 4 ranks sharing the GPU
// (rank r uses device r % devices), t_gpu_emulated on the CPU emulator. Alone it is a world of one.
//
//   step 1: each rank runs the fp32 GPU model on its B/N sequences of the global batch; the
//           gradients averaged over the ranks must match the reference model's on the whole batch
//           (every target is valid, so the mean of the ranks' mean losses is the global mean).
//   3 steps: DDP training -- average the gradients, clip, AdamW on every rank -- against the
//           reference's loss curve on the global batch; the ranks' weights end bit-identical.
//   broadcast: a bf16 model's new fp32 weights on rank 0 reach every rank's bf16 compute copy.
// Tolerances as test_gpu_model's fp32 ones (1e-5 loss, 1e-4 gradients and curve): splitting the
// batch changes only the order of the sums over tokens.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "common/hash.h"
#include "common/rng.h"
#include "gpu/comm_device.h"
#include "gpu/dist.h"
#include "gpu/model.h"
#include "gpu/numerics.h"
#include "reference_cpu/model.h"
#include "tests/gpu/gpu_test_util.h"

#define STEPS 3

static uint64_t fnv1a(const void *data, size_t bytes) { return fnv1a_bytes(FNV1A_BASIS, data, bytes); }

// gpu_model_broadcast on a bf16 model: rank 0's fp32 weights change (as after loading a
// checkpoint), the broadcast must bring every rank's fp32 weights *and* bf16 compute copy to them,
// bit for bit (the copy is the fp32 weights rounded to nearest even). Also on one rank.
static void check_bf16_broadcast(Comm *world, const ModelConfig *cfg) {
    GpuModel m;
    gpu_model_init(&m, cfg, 42, GPU_BF16, 1, 8);
    size_t n = m.table.total_numel;
    float *params = malloc(sizeof(float) * n);
    uint16_t *copy = malloc(sizeof(uint16_t) * n);
    gpu_download(params, m.params, sizeof(float) * n);
    for (size_t i = 0; i < n; i++) params[i] = params[i] * 1.5f + 0.01f;  // what every rank expects
    if (comm_rank(world) == 0) gpu_upload(m.params, params, sizeof(float) * n);
    gpu_model_broadcast(world, &m, 0);
    float *got = malloc(sizeof(float) * n);
    gpu_download(got, m.params, sizeof(float) * n);
    gpu_download(copy, m.params_bf16, sizeof(uint16_t) * n);
    int bad = 0;
    size_t worst = 0;
    for (size_t i = 0; i < n && !bad; i++)
        if (got[i] != params[i] || copy[i] != bf16_bits_from_f32(params[i])) bad = 1, worst = i;
    if (bad) log_info("rank %d: [%zu] fp32 %g (want %g), bf16 bits %04x (want %04x)", comm_rank(world), worst,
                      got[worst], params[worst], copy[worst], bf16_bits_from_f32(params[worst]));
    comm_all_reduce(world, &bad, 1, COMM_INT32, COMM_SUM);
    if (comm_rank(world) == 0)
        report("broadcast refreshes the bf16 copy", bad == 0, "%d of %d ranks differ from rank 0's new weights", bad,
               comm_size(world));
    free(params), free(copy), free(got);
    gpu_model_free(&m);
}

int main(int argc, char **argv) {
    if (!gpu_test_start_ranks("test_gpu_ddp", &argc, &argv, false)) return 0;
    gpu_comm_backend_init(GPU_COMM_AUTO);
    Comm *world = comm_world();
    int rank = comm_rank(world), size = comm_size(world);

    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    int T = 32, B = 8, B_local = B / size;
    if (B % size) fatal("the global batch of %d sequences must split evenly over %d ranks", B, size);
    int *inputs = malloc(sizeof(int) * B * T), *targets = malloc(sizeof(int) * B * T);
    for (int i = 0; i < B * T; i++) {
        inputs[i] = (int)rng_below(9, 1, i, cfg.vocab_size);
        targets[i] = (int)rng_below(9, 2, i, cfg.vocab_size);
    }
    AdamWConfig adam = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    const double lr = 3e-3, max_norm = 1.0;

    // The reference, on rank 0: the whole batch, the same steps.
    Model ref;
    ModelActs acts;
    double ref_loss[STEPS];
    float *ref_grads1 = NULL;
    if (rank == 0) {
        model_init(&ref, &cfg, 42, ATTN_FLASH);
        acts = model_acts_alloc(&ref, B, T, AC_NONE);
        size_t n = ref.table.total_numel;
        real *m1 = calloc(n, sizeof(real)), *v1 = calloc(n, sizeof(real));
        ref_grads1 = malloc(sizeof(float) * n);
        for (int s = 0; s < STEPS; s++) {
            model_zero_grads(&ref);
            ref_loss[s] = model_forward(&ref, &acts, inputs, targets);
            model_backward(&ref, &acts, inputs, 1.0);
            if (s == 0) memcpy(ref_grads1, ref.grads, sizeof(float) * n);
            double norm = sqrt(sum_of_squares(ref.grads, n));
            clip_by_global_norm(ref.grads, n, norm, max_norm);
            adamw_step(ref.params, ref.grads, m1, v1, n, s + 1, lr, &adam);
        }
        free(m1), free(v1);
    }

    GpuModel m;
    gpu_model_init(&m, &cfg, 42, GPU_FP32, B_local, T);
    size_t n = m.table.total_numel;
    gpu_model_broadcast(world, &m, 0);  // every replica starts from rank 0's weights
    const int *my_inputs = inputs + (size_t)rank * B_local * T, *my_targets = targets + (size_t)rank * B_local * T;
    float *grads = malloc(sizeof(float) * n);
    double worst_curve = 0;
    for (int s = 0; s < STEPS; s++) {
        gpu_model_zero_grads(&m);
        double loss = gpu_model_forward(&m, my_inputs, my_targets);
        gpu_model_backward(&m, 1.0);
        comm_all_reduce(world, m.grads, n, COMM_FLOAT32, COMM_AVG);
        comm_all_reduce(world, &loss, 1, COMM_FLOAT64, COMM_AVG);
        if (rank == 0) {
            double e = fabs(loss - ref_loss[s]) / ref_loss[s];
            worst_curve = e > worst_curve || e != e ? e : worst_curve;
            if (s == 0) {
                report("DDP step 1 loss", fabs(loss - ref_loss[0]) <= 1e-5 * ref_loss[0],
                       "%.7f vs reference %.7f on the whole batch", loss, ref_loss[0]);
                gpu_download(grads, m.grads, sizeof(float) * n);
                double worst = 0;
                const char *worst_name = "";
                for (int i = 0; i < m.table.count; i++) {
                    const ParamInfo *p = &m.table.items[i];
                    double err = rel_l2(grads + p->offset, ref_grads1 + p->offset, p->numel);
                    if (!(err <= worst)) worst = err, worst_name = p->name;
                }
                report("DDP step 1 averaged gradients", worst <= 1e-4,
                       "worst tensor %s: ||d||/||ref|| = %.3g (bound 1e-4)", worst_name, worst);
            }
        }
        gpu_model_step(&m, s + 1, lr, &adam, max_norm);
    }
    if (rank == 0)
        report("DDP loss curve", worst_curve <= 1e-4, "%d steps on %d ranks, worst %.2g relative (bound 1e-4)", STEPS,
               size, worst_curve);

    // Every rank's weights, bit for bit: gather their hashes.
    float *params = malloc(sizeof(float) * n);
    gpu_download(params, m.params, sizeof(float) * n);
    uint64_t mine = fnv1a(params, sizeof(float) * n), *all = malloc(sizeof(uint64_t) * size);
    comm_all_gather(world, &mine, all, sizeof mine, COMM_BYTE);
    if (rank == 0) {
        int differ = 0;
        for (int r = 0; r < size; r++) differ += all[r] != all[0];
        report("DDP replicas identical", differ == 0, "%d of %d ranks differ from rank 0", differ, size);
    }

    check_bf16_broadcast(world, &cfg);

    int failed = n_failed;
    comm_broadcast(world, &failed, 1, COMM_INT32, 0);
    if (rank == 0) printf("test_gpu_ddp: %d checks, %d failed\n", n_checks, failed);
    gpu_model_free(&m);
    gpu_comm_backend_shutdown();
    gpu_shutdown();
    if (rank == 0) {
        model_acts_free(&acts);
        model_free(&ref);
    }
    free(inputs), free(targets), free(grads), free(params), free(all), free(ref_grads1);
    comm_finalize();
    return failed ? 1 : 0;
}
