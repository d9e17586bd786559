// dump.h: what the reference computed, as safetensors, for other implementations to check against;
// and the check of someone else's dump against the reference (--dump / --compare).
//
// Dump format "llama-ref-dump-v1" (real = F32, or F64 from the float64 build):
//   metadata  format, config (JSON), optimizer (JSON: beta1 beta2 eps weight_decay grad_clip), steps
//   inputs    I32 (steps, B, T)        targets  I32 (steps, B, T)
//   param.<name>   real  initial weights          logits real (B, T, vocab) of step 1
//   loss, grad_norm, lr   F64 (steps): loss before each update, gradient norm before clipping, lr used
//   grad.<name>    real  step-1 gradients (before clipping)
//   final.<name>   real  weights after the last step
#pragma once
#include <stdio.h>

#include "reference_cpu/adamw.h"
#include "reference_cpu/model.h"

typedef struct {
    int steps, B, T;
    int *inputs, *targets;             // (steps, B, T)
    double *loss, *grad_norm, *lr;     // (steps)
    real *initial_params, *logits, *grads;
    AdamWConfig optimizer;
    double grad_clip;
} DumpRecorder;

void dump_begin(DumpRecorder *d, const Model *m, int steps, int B, int T, const AdamWConfig *opt, double grad_clip);
// step counts from 1; logits and grads are taken from the first step only.
void dump_record_step(DumpRecorder *d, const Model *m, const ModelActs *acts, long long step, const int *inputs,
                      const int *targets, double loss, double grad_norm, double lr);
void dump_write(DumpRecorder *d, const Model *m, const char *path);  // also frees the recorder
// One flat buffer in m's table layout as safetensors "<prefix><name>" (real dtype), e.g. the
// step-1 gradients of a parallel run (train --grad-dump), to compare with a dump's "grad." tensors.
void dump_write_flat(const Model *m, const char *prefix, const real *flat, const char *path, const char *flag);

// Loads a dump (ours or another implementation's, F32 or F64), runs step 1 of the reference on its
// inputs and weights, and prints for logits, loss and every gradient: max abs error, max relative
// error (max|ours - theirs| / max|theirs|) and the worst index. Returns 0 if every tensor is within
// rtol, 1 otherwise. A malformed dump exits with status 2.
int dump_compare(const char *path, AttentionImpl attention, double rtol);
