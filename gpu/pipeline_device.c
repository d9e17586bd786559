// pipeline_device.c: the PipelineCompute table of the GPU model (see pipeline_device.h). Each entry is
// one of gpu/model.h's stage entry points on the (chunk, micro-batch)'s GpuStageActs; everything is
// queued on the compute stream except the last stage's loss, which head_forward reads on the host:
// one wait per micro-batch there (the executor sums the losses on the host).
#include "gpu/pipeline_device.h"

#include "common/log.h"
#include "gpu/model.h"

// What travels between stages: the (B*T, dim) activations in the model's precision, as bytes
// (bf16: 2 each; the trainer builds the model in GPU_BF16); with tensor + sequence parallelism, this
// tp rank's rows of them (m->rows).
static size_t device_boundary_count(void *ctx, int B, int T) {
    const GpuModel *m = ctx;
    if (B != m->B || T != m->T)
        fatal("gpu pipeline: micro-batches of %d x %d, the model was built for %d x %d", B, T, m->B, m->T);
    return (size_t)m->rows * m->cfg.dim * m->act_size;
}
// The model was built for the executor's checkpointing (gpu_model_init_stages): its stages keep and
// recompute what it does.
static void *device_acts_alloc(void *ctx, int B, int T, ActCheckpoint ac, int first, int end) {
    const GpuModel *m = ctx;
    if (ac != m->ac) fatal("gpu pipeline: activation checkpointing %d asked of a model built for %d", ac, m->ac);
    return gpu_model_stage_acts_alloc(m, first, end);
}
static void device_acts_free(void *ctx, void *acts) { gpu_model_stage_acts_free(ctx, acts); }
static void *device_stage_input(void *ctx, void *acts, int first) { return ((GpuStageActs *)acts)->blocks[first].x; }
static void *device_stage_output(void *ctx, void *acts, int end) { return ((GpuStageActs *)acts)->out; }
static void *device_dx(void *ctx, void *acts) { return ((GpuStageActs *)acts)->dx; }
static void device_embed_forward(void *ctx, void *acts, const int *inputs) {
    gpu_model_stage_embed_forward(ctx, acts, inputs);
}
// The stage's activations were allocated for its blocks: the executor asks for the same range.
static GpuStageActs *stage_acts(void *acts, int first, int end) {
    GpuStageActs *s = acts;
    if (s->first != first || s->end != end)
        fatal("gpu pipeline: blocks [%d, %d) on activations of blocks [%d, %d)", first, end, s->first, s->end);
    return s;
}
static void device_blocks_forward(void *ctx, void *acts, int first, int end) {
    gpu_model_stage_blocks_forward(ctx, stage_acts(acts, first, end));
}
static double device_head_forward(void *ctx, void *acts, const int *targets) {
    return gpu_model_stage_head_forward(ctx, acts, targets);  // waits for the stream
}
static void device_head_backward(void *ctx, void *acts, double dloss) {
    gpu_model_stage_head_backward(ctx, acts, dloss);
}
static void device_blocks_backward(void *ctx, void *acts, int first, int end) {
    gpu_model_stage_blocks_backward(ctx, stage_acts(acts, first, end));
}
static void device_embed_backward(void *ctx, void *acts, const int *inputs) {
    gpu_model_stage_embed_backward(ctx, acts);  // the tokens uploaded by the forward
}

const PipelineCompute gpu_pipeline_compute = {
    .name = "gpu", .boundary_type = COMM_BYTE, .boundary_count = device_boundary_count,
    .acts_alloc = device_acts_alloc, .acts_free = device_acts_free, .stage_input = device_stage_input,
    .stage_output = device_stage_output, .dx = device_dx, .embed_forward = device_embed_forward,
    .blocks_forward = device_blocks_forward, .head_forward = device_head_forward,
    .head_backward = device_head_backward, .blocks_backward = device_blocks_backward,
    .embed_backward = device_embed_backward};
