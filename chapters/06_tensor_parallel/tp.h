// tp.h: tensor parallelism (Megatron-LM), over the mesh's tp group.
//
// Each of the n ranks of a tp group holds a slice of every large matrix (the table from
// param_table_build_tp) and computes with it; the model (reference_cpu/model.c) calls back here
// at the few points where the slices' results must be combined:
//
//   column-parallel  wq wk wv w1 w3 (and the output projection, by vocabulary): split by output
//                    features. Each rank computes its heads / ffn columns from the full input; no
//                    communication forward. Backward, each rank's input gradient is a partial sum:
//                    all-reduce (overlapped with the weight-gradient matmuls).
//   row-parallel     wo w2: split by input features, fed by the column-parallel output that is
//                    already local. Each rank's output is a partial sum: all-reduce forward; the
//                    output gradient is replicated, so backward needs nothing.
//   vocab-parallel   embedding rows and output rows split by vocabulary. The lookup gives zero rows
//                    for tokens another rank holds: all-reduce. The loss is computed over the
//                    vocabulary shards with two all-reduces: a MAX of each token's row max, then one
//                    SUM of each token's sum of exponentials and target logit together. The full
//                    logits never exist on one rank.
//
// Per block and per micro-batch: 2 all-reduces of (tokens x dim) forward and 2 backward.
// Norm weights are replicated; their gradients come out identical on every tp rank, because the
// inputs of the norms (the all-reduced activations) are.
#pragma once
#include "common/comm.h"
#include "reference_cpu/model.h"

// Sequence parallel (Megatron-SP, model.h): the norms and residuals run on this rank's B*T/n rows;
// each all-reduce becomes an all-gather before a column-parallel linear plus a reduce-scatter
// after a row-parallel one (the same bytes: an all-reduce is a reduce-scatter then an
// all-gather), and the norm weights' gradients are summed over tp.
//
// Installs the model's tensor-parallel callbacks (the model came from model_init_tp with this
// group's size and rank), before its activations are allocated.
void tp_install(Model *m, Comm *tp_group, bool sequence_parallel);

// Sum of squares of a gradient in this rank's layout (table order, local shapes), counted once
// over the tp group: the sharded tensors' parts are summed over the group, the replicated ones
// taken once.
double tp_sum_of_squares(const Model *m, Comm *tp_group, const real *local_flat);

// Checkpoints hold full tensors. gather: every rank of the group gets the full tensors (full
// table layout) from each rank's local layout; scatter: takes this rank's part of a full buffer.
void tp_gather_full(const Model *m, Comm *tp_group, const real *local_flat, real *full_flat);
void tp_scatter_full(const Model *m, const real *full_flat, real *local_flat);
