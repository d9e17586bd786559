// cp.h: context parallelism, over the mesh's cp group of N ranks.
//
// Every rank holds T/N of each sample's tokens (and their global positions); everything but
// attention is per token, so only attention needs the other ranks. Two ways to give it them:
//
//   ring (default)   K and V of the local tokens travel round the cp ring, one hop per step, while
//                    each rank computes its queries against the block it holds; the N partial
//                    outputs are merged through their log-sum-exp (the online-softmax merge).
//                    Backward runs the ring again, recomputing each block from the saved global
//                    lse: dQ stays here, dK/dV travel a second ring back to the owner of K/V.
//   alltoall         (DeepSpeed-Ulysses) one all-to-all turns sequence-sharded Q, K, V into
//                    head-sharded ones over the whole sequence; ordinary attention runs on H/N
//                    heads; another all-to-all brings the output back. Needs kv heads % N == 0.
//
// The split (cp_positions): the sequence is cut into 2N chunks of c = T/(2N) tokens and rank i
// holds chunks i and 2N-1-i (zigzag), so that every rank has the same amount of causal work; with
// load balancing off rank i holds the contiguous chunk [i*T/N, (i+1)*T/N).
//
// Zigzag ring, rank r, step s, the K/V of rank src = (r - s) mod N (chunks src and 2N-1-src):
//   s = 0      both local Q chunks against both local K/V chunks, causal (the diagonal);
//   src < r    all local Q against the first K/V chunk (wholly in the past): no mask;
//   src > r    the second Q chunk against both K/V chunks (the first Q chunk sees neither): no mask.
// Each off-diagonal step is half of a full (2c x 2c) block, on every rank. Contiguous: src < r is a
// full block, src > r nothing (the K/V is still passed on), so rank N-1 works N times rank 0.
//
// Communication per layer and micro-batch (ring): forward N-1 K/V hops; backward N-1 K/V hops and
// N dK/dV hops (the last one home), each hop one batched send+recv started before the block that
// it overlaps computes. The bytes of one hop: 2 * B * (T/N) * H_kv * head_dim * sizeof(real).
#pragma once
#include <stdbool.h>

#include "common/comm.h"
#include "reference_cpu/model.h"

typedef enum { CP_RING, CP_ALLTOALL } CpMode;
#define CP_MODE_NAMES "ring|alltoall"  // in enum order (the trainer's --cp-mode choices)

typedef struct CpAttention CpAttention;

// Why this layout cannot run, or NULL: the sequence length must divide by 2N (zigzag) or N
// (contiguous); alltoall needs n_kv_heads (this tp rank's) % N == 0. The text is one line.
const char *cp_check(int cp_size, CpMode mode, bool load_balance, int seq_len, int n_kv_heads);
// For the cp group (size N, this rank's position in it); seq_len is the full sequence length T.
// Exits with status 2 (cp_check's line) on a layout that cannot run.
CpAttention *cp_create(Comm *cp_group, CpMode mode, bool load_balance, int seq_len, int n_kv_heads);
void cp_free(CpAttention *cp);
int cp_local_len(const CpAttention *cp);      // T/N
const int *cp_positions(const CpAttention *cp);  // (T/N) global positions of this rank's tokens, ascending

// Fills positions (T/N) with those of `rank` of N (what cp_positions returns on that rank).
void cp_chunk_positions(int *positions, int rank, int N, int seq_len, bool load_balance);
// This rank's tokens of B samples: local (B, T/N) = full (B, T) at cp_positions.
void cp_take_tokens(const CpAttention *cp, int *local, const int *full, int B);
// The same for any per-token tensor: local (B, T/N, width) = full (B, T, width) at cp_positions.
void cp_take_rows(const CpAttention *cp, real *local, const real *full, int B, int width);

// Attention of this rank's queries against the whole sequence, the same contract as
// attention_flash_forward / _backward on local tensors: q, out, dq (B, T/N, n_heads, hd); k, v, dk,
// dv (B, T/N, n_kv_heads, hd); lse (B, n_heads, T/N), the log-sum-exp over ALL keys. s->Tq = s->Tk
// = T/N; s->causal must be set and its positions NULL (the module knows its tokens' positions).
// Backward accumulates (+=) into dq, dk, dv. Collective over the cp group.
void cp_attention_forward(CpAttention *cp, real *out, real *lse, const real *q, const real *k, const real *v,
                          const AttnShape *s);
void cp_attention_backward(CpAttention *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                           const real *k, const real *v, const real *out, const real *lse, const AttnShape *s);

// Installs cp as the model's ContextParallel callbacks (model.h); cp must outlive the model's use.
void cp_install(Model *m, CpAttention *cp);

// Transfers (one batched send+recv, or one all-to-all) this rank has started since cp_create.
long cp_transfers(const CpAttention *cp);
