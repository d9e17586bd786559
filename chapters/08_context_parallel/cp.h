// cp.h: context parallelism. The N ranks of the cp group each hold a share of every sequence's
// tokens (the activations of a block are O(tokens), so a sequence too long for one rank's memory
// fits on N), and attention, the one place where tokens meet, is computed across the group.
//
// The split (zigzag). Each sequence of T tokens is cut into 2N chunks of c = T / 2N tokens; cp rank
// i holds chunks i and 2N-1-i, 2c tokens, in that order. Under the causal mask an early chunk sees
// few keys and a late one many, so pairing the i-th earliest with the i-th latest gives every rank
// the same attention work. `balanced = false` gives rank i the contiguous chunk [i T/N, (i+1) T/N)
// instead, to show the imbalance. RoPE and the mask use the tokens' global positions.
//
// Ring attention (CP_RING). K and V of the local tokens travel around the ring: at step s rank r
// holds the K/V of rank (r - s) mod N, computes its queries against them, and merges the partial
// output into its running (out, lse) through the log-sum-exp. The next step's K/V are already on
// their way (comm stream, double-buffered) while this step computes. Zigzag steps:
//   s = 0           the local chunks against themselves, causal
//   source j < r    all local queries against the source's first chunk (chunk j: earlier than both
//                   of ours), no mask; its second chunk is later than both and skipped
//   source j > r    our second chunk against both of the source's chunks (both earlier than it), no
//                   mask; our first chunk sees neither
// so every step off the diagonal is half a block. Backward runs the ring again: each block's
// gradients from the saved global lse and the final output (so the pieces are exact partial sums);
// dQ accumulates here; each block's dK/dV is added to a buffer that travels with the K/V (one step
// behind, its transfer hidden behind the next block) and, after N steps,
// arrives back at the rank that owns those tokens.
//   transfers per attention: forward N-1 (K and V of 2c tokens each), backward N-1 K/V plus N dK/dV.
//
// All-to-all (CP_ALLTOALL, DeepSpeed-Ulysses). One all-to-all turns the sequence-sharded q, k, v
// into head-sharded ones (every token, H/N heads), attention runs locally on the whole sequence, and
// one all-to-all brings the output back. Needs the heads (kv heads after tensor parallelism) to
// divide by N.
#pragma once
#include <stdbool.h>

#include "chapters/03_fsdp/fsdp.h"  // FsdpMemory
#include "common/comm.h"
#include "reference_cpu/model.h"
#include "reference_cpu/ops.h"

typedef enum { CP_RING, CP_ALLTOALL } CpMode;
#define CP_MODE_NAMES "ring|alltoall"  // in enum order (--cp-mode)

// Which tokens of a sequence of T this rank holds.
typedef struct {
    int n, rank;    // cp degree and this rank's index
    int T, chunk;   // full length; chunk = T / 2n (zigzag) or T / n (contiguous)
    bool balanced;  // zigzag (true) or contiguous
} CpLayout;

// NULL if T splits under this layout, else the rule broken.
const char *cp_layout_check(int n, int T, bool balanced);
CpLayout cp_layout(int n, int rank, int T, bool balanced);
int cp_local_len(const CpLayout *l);  // tokens per sequence on this rank: T / n
// positions (cp_local_len): the global position of each local token, in local order.
void cp_local_positions(const CpLayout *l, int *positions);
// full (B, T) -> local (B, cp_local_len): this rank's tokens of each sequence.
void cp_take_local(const CpLayout *l, const int *full, int *local, int B);

typedef struct ContextParallel ContextParallel;

// Where the module's buffers live and the computations it runs itself; everything else is comm.h's,
// which takes host and device buffers alike. The ring needs chapter 3's memory table (alloc, free,
// copy, zero, add, upload), the attention pair with reference_cpu/ops.h's meaning (AttnShape's
// positions in that memory), and the merge of one block's partial output into the running one.
// gpu/cp_device.c gives the device's, so the same ring runs on the GPU's buffers.
typedef struct {
    const FsdpMemory *memory;
    void (*attention_forward)(real *out, real *lse, const real *q, const real *k, const real *v, const AttnShape *s);
    void (*attention_backward)(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                               const real *v, const real *out, const real *lse, const AttnShape *s);
    // One sequence: folds the block's (out_b (nq, H, hd), lse_b (H, nq)) into rows [q0, q0 + nq) of the
    // running (out (Tl, H, hd), lse (H, Tl)) through the log-sum-exp (cp.c's merge_row, row by row).
    void (*merge)(real *out, real *lse, const real *out_b, const real *lse_b, int q0, int nq, int Tl, int H, int hd);
} CpCompute;
extern const CpCompute cp_host_compute;  // host memory, reference_cpu's attention, cp.c's merge

// Collective over cp_group. B sequences per micro-batch; heads are this (tp) rank's. compute: NULL
// for the host's; on a device, the ring only (the all-to-all's layout moves are host loops).
ContextParallel *cp_create(Comm *cp_group, CpMode mode, bool balanced, int B, int T, int n_heads, int n_kv_heads,
                           int head_dim, const CpCompute *compute);
void cp_free(ContextParallel *cp);
const int *cp_positions(const ContextParallel *cp);  // this rank's tokens' global positions
const CpLayout *cp_get_layout(const ContextParallel *cp);

// Causal attention over the whole sequence for this rank's queries. q (B, Tl, H, hd), k and v
// (B, Tl, Hkv, hd): the local tokens, after RoPE at their global positions. out (B, Tl, H, hd),
// lse (B, H, Tl): as attention_flash_forward would give for these queries on the full sequence.
void cp_attention_forward(ContextParallel *cp, real *out, real *lse, const real *q, const real *k, const real *v);
// Accumulates (+=) into dq, dk, dv (local tokens) the gradients of the whole sequence's attention
// with respect to this rank's q, k, v, given dout for this rank's queries and forward's out and lse.
void cp_attention_backward(ContextParallel *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                           const real *k, const real *v, const real *out, const real *lse);
// Installs the model's context-parallel hooks (reference_cpu/model.h) for micro-batches of B sequences
// of T tokens (the whole length), with the model's (tp-local) heads. Collective over cp_group.
ContextParallel *cp_install(Model *m, Comm *cp_group, CpMode mode, bool balanced, int B, int T);
// Transfers this rank has posted so far (K/V and dK/dV messages, all-to-alls): for the tests.
long long cp_transfers(const ContextParallel *cp);
