// pipeline_device.h: chapter 7's pipeline executor (chapters/07_pipeline_parallel/pipeline.h) on the
// GPU model. The executor does its compute through a PipelineCompute table; this is the GPU model's
// (gpu/model.h's stage entry points, ctx: the GpuModel, built by gpu_model_init_stages with its
// storage set to the executor's UnitStorage), and its memory work through gpu_fsdp_memory
// (gpu/fsdp_device.h): the chunks' fp32 weights, gradients and AdamW moments, the inboxes, on the
// device. The boundary tensors are the model's bf16 activations: they travel as bytes, B_micro*T*dim*2
// per transfer, device to device (comm.h's batches on device buffers, gpu/comm_device.h).
#pragma once
#include "chapters/07_pipeline_parallel/pipeline.h"

extern const PipelineCompute gpu_pipeline_compute;
