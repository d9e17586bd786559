// fsdp_device.c: the FsdpMemory table of device memory (see fsdp_device.h). Every operation is
// queued on the compute stream, as the model's kernels are, so the module's copies, sums and
// optimizer steps run in order with the forward and backward that read and write the same buffers;
// only the sum of squares (the norm, which the host needs) and the downloads wait for the stream.
#include "gpu/fsdp_device.h"

#include "gpu/ops.h"
#include "gpu/runtime.h"

static void device_zero(void *p, size_t bytes) { gpu_fill_bytes(p, 0, bytes); }
static void device_upload(void *dst, const void *host_src, size_t bytes) {
    if (bytes) gpu_upload(dst, host_src, bytes);
}
static void device_download(void *host_dst, const void *src, size_t bytes) {
    if (bytes) gpu_download(host_dst, src, bytes);
}
static void device_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) gpu_copy(dst, src, bytes);
}
static void device_add(real *acc, const real *x, size_t n) {
    if (n) gpu_add_inplace(acc, x, n);
}
static void device_scale(real *x, size_t n, double factor) {
    if (n) gpu_scale_inplace(x, n, factor);
}
static void device_adamw(real *params, const real *grads, real *m, real *v, size_t n, long long step, double lr,
                         const AdamWConfig *cfg) {
    if (n) gpu_adamw_step(params, grads, m, v, n, step, lr, cfg);
}
static double device_sum_of_squares(const real *x, size_t n) { return n ? gpu_sum_of_squares(x, n) : 0; }
// The bf16 all-gather's casts: gpu_bf16 is 16 bits with common/bf16.h's rounding (the same bits as the host's).
static void device_to_bf16(uint16_t *out, const real *x, size_t n) {
    if (n) gpu_cast_f32_to_bf16((gpu_bf16 *)out, x, n);
}
static void device_from_bf16(real *out, const uint16_t *in, size_t n) {
    if (n) gpu_cast_bf16_to_f32(out, (const gpu_bf16 *)in, n);
}

const FsdpMemory gpu_fsdp_memory = {.name = "device", .on_device = true, .alloc = gpu_alloc, .free = gpu_free,
                                    .copy = device_copy, .zero = device_zero, .upload = device_upload,
                                    .download = device_download, .add = device_add, .scale = device_scale,
                                    .adamw = device_adamw, .sum_of_squares = device_sum_of_squares,
                                    .to_bf16 = device_to_bf16, .from_bf16 = device_from_bf16};
