#include "chapters/08_context_parallel/cp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

enum { TAG_KV = 40, TAG_DKV = 41 };

// ---- the split ------------------------------------------------------------------------------------

const char *cp_layout_check(int n, int T, bool balanced) {
    if (n == 1) return NULL;  // one rank holds every token
    if (balanced && T % (2 * n) != 0)
        return "the sequence length must divide by 2 x cp (zigzag: two chunks per rank; --cp-load-balance off "
               "needs only cp)";
    if (!balanced && T % n != 0) return "the sequence length must divide by cp";
    return NULL;
}

CpLayout cp_layout(int n, int rank, int T, bool balanced) {
    const char *rule = cp_layout_check(n, T, balanced);
    if (rule) fatal_input("--cp %d with sequence length %d: %s", n, T, rule);
    if (n == 1) balanced = false;  // the whole sequence, in order
    return (CpLayout){n, rank, T, balanced ? T / (2 * n) : T / n, balanced};
}

int cp_local_len(const CpLayout *l) { return l->T / l->n; }

// Zigzag: chunk `rank` then chunk 2n-1-rank; contiguous: chunk `rank`.
void cp_local_positions(const CpLayout *l, int *positions) {
    // LAB cp: positions[t] for t < Tl: zigzag (balanced): chunk `rank`, then chunk 2n-1-rank; contiguous: chunk `rank` (a chunk is l->chunk tokens)
    LAB_HOLE("cp", "positions[t] for t < Tl: zigzag (balanced): chunk `rank`, then chunk 2n-1-rank; contiguous: chunk `rank` (a chunk is l->chunk tokens)");
    // END LAB
}

void cp_take_local(const CpLayout *l, const int *full, int *local, int B) {
    int Tl = cp_local_len(l);
    int *positions = malloc(sizeof(int) * (size_t)Tl);
    cp_local_positions(l, positions);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tl; t++) local[(size_t)b * Tl + t] = full[(size_t)b * l->T + positions[t]];
    free(positions);
}

// ---- state ------------------------------------------------------------------------------------------

struct ContextParallel {
    Comm *group;
    CpMode mode;
    CpLayout layout;
    int B, Tl, H, Hkv, hd;
    int *all_positions;     // (n * Tl) every rank's positions, in rank order (host)
    int *block_positions;   // the same in the compute's memory (AttnShape's positions point into it)
    const CpCompute *compute;
    real *kv[2];            // (2 * kv_count) K then V of the block at hand, and the next one arriving
    real *dkv[2];           // the same for their gradients (backward), travelling with them
    real *dkv_block;        // (2 * kv_count) one block's dK/dV, computed while the travelling sum arrives
    real *block_out;        // (Tl * H * hd) one sequence's partial output
    real *block_lse;        // (H * Tl) its log-sum-exp (and, backward, the global lse of the queries at hand)
    long long transfers;
};

static size_t kv_count(const ContextParallel *cp) { return (size_t)cp->B * cp->Tl * cp->Hkv * cp->hd; }

static real *alloc_real(const ContextParallel *cp, size_t count) {
    return cp->compute->memory->alloc(MEM_COMM, sizeof(real) * count);
}

ContextParallel *cp_create(Comm *cp_group, CpMode mode, bool balanced, int B, int T, int n_heads, int n_kv_heads,
                           int head_dim, const CpCompute *compute) {
    int n = comm_size(cp_group);
    if (!compute) compute = &cp_host_compute;
    if (compute->memory->on_device && mode != CP_RING)
        fatal_input("--cp-mode alltoall on %s buffers: the all-to-all's layout moves run on the host; use the ring",
                    compute->memory->name);
    if (mode == CP_ALLTOALL && (n_heads % n != 0 || n_kv_heads % n != 0))
        fatal_input("--cp-mode alltoall with --cp %d: the %d heads and %d kv heads (after tensor parallelism) must "
                    "divide by cp", n, n_heads, n_kv_heads);
    ContextParallel *cp = calloc(1, sizeof *cp);
    cp->group = cp_group, cp->mode = mode, cp->compute = compute;
    cp->layout = cp_layout(n, comm_rank(cp_group), T, balanced);
    cp->B = B, cp->Tl = cp_local_len(&cp->layout), cp->H = n_heads, cp->Hkv = n_kv_heads, cp->hd = head_dim;
    cp->all_positions = malloc(sizeof(int) * (size_t)n * cp->Tl);
    for (int r = 0; r < n; r++) {
        CpLayout other = cp_layout(n, r, T, balanced);
        cp_local_positions(&other, cp->all_positions + (size_t)r * cp->Tl);
    }
    if (mode == CP_RING) {
        const FsdpMemory *mem = compute->memory;
        size_t positions_bytes = sizeof(int) * (size_t)n * cp->Tl;
        cp->block_positions = mem->alloc(MEM_OTHER, positions_bytes);
        mem->upload(cp->block_positions, cp->all_positions, positions_bytes);
        for (int i = 0; i < 2; i++) {
            cp->kv[i] = alloc_real(cp, 2 * kv_count(cp));
            cp->dkv[i] = alloc_real(cp, 2 * kv_count(cp));
        }
        cp->dkv_block = alloc_real(cp, 2 * kv_count(cp));
        cp->block_out = alloc_real(cp, (size_t)cp->Tl * n_heads * head_dim);
        cp->block_lse = alloc_real(cp, (size_t)n_heads * cp->Tl);
    }
    return cp;
}

void cp_free(ContextParallel *cp) {
    if (!cp) return;
    void (*release)(void *) = cp->compute->memory->free;
    for (int i = 0; i < 2; i++) release(cp->kv[i]), release(cp->dkv[i]);
    release(cp->dkv_block);
    release(cp->block_out);
    release(cp->block_lse);
    release(cp->block_positions);
    free(cp->all_positions);
    free(cp);
}

const int *cp_positions(const ContextParallel *cp) {
    return cp->all_positions + (size_t)cp->layout.rank * cp->Tl;
}
const CpLayout *cp_get_layout(const ContextParallel *cp) { return &cp->layout; }
long long cp_transfers(const ContextParallel *cp) { return cp->transfers; }

// ---- ring: which queries meet which keys at a step ----------------------------------------------------

// Local query rows [q0, q0 + nq) against the source's key rows [k0, k0 + nk); nq == 0: nothing.
typedef struct {
    int q0, nq, k0, nk;
    bool causal;
} RingBlock;

static RingBlock ring_block(const ContextParallel *cp, int src) {
    int r = cp->layout.rank, c = cp->layout.chunk, Tl = cp->Tl;
    if (src == r) return (RingBlock){0, Tl, 0, Tl, true};  // the diagonal
    if (!cp->layout.balanced) return src < r ? (RingBlock){0, Tl, 0, Tl, false} : (RingBlock){0, 0, 0, 0, false};
    if (src < r) return (RingBlock){0, Tl, 0, c, false};  // every query, the source's first chunk
    return (RingBlock){c, c, 0, Tl, false};                // our second chunk, both of the source's
}

// The attention shape of one sequence's block (B = 1), its positions in the compute's memory.
static AttnShape block_shape(const ContextParallel *cp, RingBlock blk, int src) {
    const int *mine = cp->block_positions + (size_t)cp->layout.rank * cp->Tl;
    const int *theirs = cp->block_positions + (size_t)src * cp->Tl;
    return (AttnShape){1, blk.nq, blk.nk, cp->H, cp->Hkv, cp->hd, mine + blk.q0, theirs + blk.k0, blk.causal};
}

// Folds one block's (o_b, lse_b) into the running (o, lse) of a query row and head:
//   lse' = log(e^lse + e^lse_b) = max + log1p(e^(min - max)),  o' = o e^(lse - lse') + o_b e^(lse_b - lse')
static void merge_row(real *o, real *lse, const real *o_b, real lse_b, int hd) {
    // LAB cp: fold (o_b, lse_b) into (o, lse): a -inf lse means no keys yet; lse' = max + log1p(exp(min - max)), o' = o e^(lse - lse') + o_b e^(lse_b - lse')
    LAB_HOLE("cp", "fold (o_b, lse_b) into (o, lse): a -inf lse means no keys yet; lse' = max + log1p(exp(min - max)), o' = o e^(lse - lse') + o_b e^(lse_b - lse')");
    // END LAB
}

// The host's merge of a whole block: merge_row for each head and query row.
static void host_merge(real *out, real *lse, const real *out_b, const real *lse_b, int q0, int nq, int Tl, int H,
                       int hd) {
    size_t q_stride = (size_t)H * hd;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < nq; i++)
            merge_row(out + (size_t)(q0 + i) * q_stride + (size_t)h * hd, lse + (size_t)h * Tl + q0 + i,
                      out_b + (size_t)i * q_stride + (size_t)h * hd, lse_b[(size_t)h * nq + i], hd);
}

const CpCompute cp_host_compute = {&fsdp_host_memory, attention_flash_forward, attention_flash_backward, host_merge};

static void trace_block(const char *name, int step, int src) {
    int track = trace_track("compute");
    trace_begin(track, name, "attention");
    trace_arg_int(track, "ring_step", step);
    trace_arg_int(track, "source", src);
}

// Queries of this rank against the K/V of rank src (kv: K then V, each (B, Tl, Hkv, hd)). The first
// step writes out and lse; later ones merge into them.
static void ring_forward_block(ContextParallel *cp, int step, int src, const real *kv, real *out, real *lse,
                               const real *q) {
    RingBlock blk = ring_block(cp, src);
    if (blk.nq == 0) return;
    trace_block("ring attention fwd", step, src);
    AttnShape s = block_shape(cp, blk, src);
    size_t q_stride = (size_t)cp->H * cp->hd, k_stride = (size_t)cp->Hkv * cp->hd;
    const real *k = kv, *v = kv + kv_count(cp);
    for (int b = 0; b < cp->B; b++) {
        const real *qb = q + ((size_t)b * cp->Tl + blk.q0) * q_stride;
        const real *kb = k + ((size_t)b * cp->Tl + blk.k0) * k_stride, *vb = v + ((size_t)b * cp->Tl + blk.k0) * k_stride;
        real *ob = out + (size_t)b * cp->Tl * q_stride, *lb = lse + (size_t)b * cp->H * cp->Tl;
        if (step == 0) {  // the diagonal covers every local query
            cp->compute->attention_forward(ob, lb, qb, kb, vb, &s);
            continue;
        }
        cp->compute->attention_forward(cp->block_out, cp->block_lse, qb, kb, vb, &s);
        cp->compute->merge(ob, lb, cp->block_out, cp->block_lse, blk.q0, blk.nq, cp->Tl, cp->H, cp->hd);
    }
    trace_end(trace_track("compute"));
}

// The same block's backward: dq (local) += ..., dkv (the source's K then V gradients) += ...
static void ring_backward_block(ContextParallel *cp, int step, int src, const real *kv, real *dkv, real *dq,
                                const real *dout, const real *q, const real *out, const real *lse) {
    RingBlock blk = ring_block(cp, src);
    if (blk.nq == 0) return;
    trace_block("ring attention bwd", step, src);
    AttnShape s = block_shape(cp, blk, src);
    size_t q_stride = (size_t)cp->H * cp->hd, k_stride = (size_t)cp->Hkv * cp->hd, n_kv = kv_count(cp);
    for (int b = 0; b < cp->B; b++) {
        size_t qrow = (size_t)b * cp->Tl + blk.q0, krow = (size_t)b * cp->Tl + blk.k0;
        const real *lb = lse + (size_t)b * cp->H * cp->Tl;
        for (int h = 0; h < cp->H; h++)  // the global lse of the queries at hand, (H, nq)
            cp->compute->memory->copy(cp->block_lse + (size_t)h * blk.nq, lb + (size_t)h * cp->Tl + blk.q0,
                                      sizeof(real) * blk.nq);
        cp->compute->attention_backward(dq + qrow * q_stride, dkv + krow * k_stride, dkv + n_kv + krow * k_stride,
                                 dout + qrow * q_stride, q + qrow * q_stride, kv + krow * k_stride,
                                 kv + n_kv + krow * k_stride, out + qrow * q_stride, cp->block_lse, &s);
    }
    trace_end(trace_track("compute"));
}

// Sends buf to the next rank of the ring and receives the previous rank's into next: one operation.
static CommHandle *rotate(ContextParallel *cp, real *buf, real *next, size_t count, int tag) {
    int n = cp->layout.n, r = cp->layout.rank;
    CommP2P ops[2] = {{COMM_SEND, buf, count, COMM_REAL, (r + 1) % n, tag},
                      {COMM_RECV, next, count, COMM_REAL, (r - 1 + n) % n, tag}};
    cp->transfers++;
    return comm_batch_start(cp->group, ops, 2);
}

// The main thread waits for a cp transfer (a ring hop, an all-to-all): marked as exposed
// communication if it really waits.
static void wait_ring(CommHandle *h) {
    if (!h) return;
    bool blocked = !comm_test(h);
    int track = trace_track("compute");
    if (blocked) trace_begin(track, "cp wait", "comm-wait");
    comm_wait(h);
    if (blocked) trace_end(track);
}

static void pack_kv(ContextParallel *cp, real *kv, const real *k, const real *v) {
    cp->compute->memory->copy(kv, k, sizeof(real) * kv_count(cp));
    cp->compute->memory->copy(kv + kv_count(cp), v, sizeof(real) * kv_count(cp));
}

static void ring_forward(ContextParallel *cp, real *out, real *lse, const real *q, const real *k, const real *v) {
    int n = cp->layout.n, r = cp->layout.rank;
    pack_kv(cp, cp->kv[0], k, v);
    for (int s = 0; s < n; s++) {
        real *cur = cp->kv[s % 2];
        CommHandle *next = s + 1 < n ? rotate(cp, cur, cp->kv[(s + 1) % 2], 2 * kv_count(cp), TAG_KV) : NULL;
        ring_forward_block(cp, s, (r - s + n) % n, cur, out, lse, q);
        wait_ring(next);
    }
}

static void ring_backward(ContextParallel *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                          const real *k, const real *v, const real *out, const real *lse) {
    int n = cp->layout.n, r = cp->layout.rank;
    size_t count = 2 * kv_count(cp);
    const FsdpMemory *mem = cp->compute->memory;
    pack_kv(cp, cp->kv[0], k, v);
    // LAB cp: the ring: each step rotate K/V on (rotate, TAG_KV) while computing the block of source (r - s) mod n into a zeroed dkv_block (ring_backward_block), then add it to the dK/dV sum arriving from the previous rank and send the sum on (TAG_DKV); after n steps add your own tokens' sum into dk and dv
    LAB_HOLE("cp", "the ring: each step rotate K/V on (rotate, TAG_KV) while computing the block of source (r - s) mod n into a zeroed dkv_block (ring_backward_block), then add it to the dK/dV sum arriving from the previous rank and send the sum on (TAG_DKV); after n steps add your own tokens' sum into dk and dv");
    // END LAB
}

// ---- all-to-all (Ulysses) -----------------------------------------------------------------------------
// Layouts, with H heads split into n groups of Hl = H / n (group p: heads [p Hl, (p+1) Hl)):
//   local   (B, Tl, H, hd)          this rank's tokens, every head
//   blocks  n x (B, Tl, Hl, hd)     block p: head group p of the local tokens (what goes to rank p);
//                                   received: rank p's tokens, this rank's head group
//   full    (B, n Tl, Hl, hd)       every rank's tokens in rank order, this rank's head group
// and for the log-sum-exp, local (B, H, Tl), blocks n x (B, Hl, Tl), full (B, Hl, n Tl).

// Every move between these layouts copies contiguous runs of `run` elements, indexed by three loops;
// a layout is the element strides of those loops. `reverse` copies the other way.
typedef struct {
    size_t stride[3];
} Strides;

static void move_runs(const int n[3], size_t run, const real *a, Strides sa, real *b, Strides sb, bool reverse) {
    for (int i = 0; i < n[0]; i++)
        for (int j = 0; j < n[1]; j++)
            for (int k = 0; k < n[2]; k++) {
                real *x = (real *)a + i * sa.stride[0] + j * sa.stride[1] + k * sa.stride[2];
                real *y = b + i * sb.stride[0] + j * sb.stride[1] + k * sb.stride[2];
                if (reverse) memcpy(x, y, sizeof(real) * run);
                else memcpy(y, x, sizeof(real) * run);
            }
}

// Loops (p, b, t), runs of one token's Hl heads.
static void local_to_blocks(const ContextParallel *cp, int H, const real *local, real *blocks, bool reverse) {
    size_t n = (size_t)cp->layout.n, B = (size_t)cp->B, Tl = (size_t)cp->Tl, run = (size_t)H / n * cp->hd;
    int loops[3] = {(int)n, cp->B, cp->Tl};
    Strides loc = {{run, Tl * H * cp->hd, (size_t)H * cp->hd}}, blk = {{B * Tl * run, Tl * run, run}};
    move_runs(loops, run, local, loc, blocks, blk, reverse);
}

// Loops (p, b), runs of Tl tokens' Hl heads.
static void blocks_to_full(const ContextParallel *cp, int Hl, const real *blocks, real *full, bool reverse) {
    size_t n = (size_t)cp->layout.n, B = (size_t)cp->B, run = (size_t)cp->Tl * Hl * cp->hd;
    int loops[3] = {(int)n, cp->B, 1};
    Strides blk = {{B * run, run, 0}}, f = {{run, n * run, 0}};
    move_runs(loops, run, blocks, blk, full, f, reverse);
}

// The log-sum-exp's layouts (reverse: full -> blocks -> local). Loops (p, b, h), runs of Tl.
static void lse_local_to_blocks(const ContextParallel *cp, real *local, real *blocks, bool reverse) {
    size_t n = (size_t)cp->layout.n, B = (size_t)cp->B, Tl = (size_t)cp->Tl, Hl = (size_t)cp->H / n;
    int loops[3] = {(int)n, cp->B, (int)Hl};
    Strides loc = {{Hl * Tl, (size_t)cp->H * Tl, Tl}}, blk = {{B * Hl * Tl, Hl * Tl, Tl}};
    move_runs(loops, Tl, local, loc, blocks, blk, reverse);
}

static void lse_blocks_to_full(const ContextParallel *cp, real *blocks, real *full, bool reverse) {
    size_t n = (size_t)cp->layout.n, B = (size_t)cp->B, Tl = (size_t)cp->Tl, Hl = (size_t)cp->H / n;
    int loops[3] = {(int)n, cp->B, (int)Hl};
    Strides blk = {{B * Hl * Tl, Hl * Tl, Tl}}, f = {{Tl, Hl * n * Tl, n * Tl}};
    move_runs(loops, Tl, blocks, blk, full, f, reverse);
}

static real *alloc_comm(size_t count) { return mem_alloc(MEM_COMM, sizeof(real) * count); }

// local (B, Tl, H, hd) -> full (B, n Tl, H/n, hd): one all-to-all.
static void to_heads(ContextParallel *cp, int H, const real *local, real *full) {
    size_t count = (size_t)cp->B * cp->Tl * H * cp->hd;
    real *send = alloc_comm(count), *recv = alloc_comm(count);
    local_to_blocks(cp, H, local, send, false);
    wait_ring(comm_all_to_all_start(cp->group, send, recv, count / cp->layout.n, COMM_REAL));  // a wait: exposed
    cp->transfers++;
    blocks_to_full(cp, H / cp->layout.n, recv, full, false);
    mem_free(send), mem_free(recv);
}

// The reverse: full (B, n Tl, H/n, hd) -> local (B, Tl, H, hd); accumulate adds into local.
static void to_tokens(ContextParallel *cp, int H, const real *full, real *local, bool accumulate) {
    size_t count = (size_t)cp->B * cp->Tl * H * cp->hd;
    real *send = alloc_comm(count), *recv = alloc_comm(count), *mine = accumulate ? alloc_comm(count) : local;
    blocks_to_full(cp, H / cp->layout.n, send, (real *)full, true);
    wait_ring(comm_all_to_all_start(cp->group, send, recv, count / cp->layout.n, COMM_REAL));  // a wait: exposed
    cp->transfers++;
    local_to_blocks(cp, H, mine, recv, true);
    if (accumulate) add_inplace(local, mine, count), mem_free(mine);
    mem_free(send), mem_free(recv);
}

static void lse_move(ContextParallel *cp, real *local, real *full, bool to_full) {
    size_t count = (size_t)cp->B * cp->H * cp->Tl;
    real *send = alloc_comm(count), *recv = alloc_comm(count);
    if (to_full) lse_local_to_blocks(cp, local, send, false);
    else lse_blocks_to_full(cp, send, full, true);
    wait_ring(comm_all_to_all_start(cp->group, send, recv, count / cp->layout.n, COMM_REAL));  // a wait: exposed
    cp->transfers++;
    if (to_full) lse_blocks_to_full(cp, recv, full, false);
    else lse_local_to_blocks(cp, local, recv, true);
    mem_free(send), mem_free(recv);
}

// The whole sequence, this rank's head group (the positions give the causal mask in rank order).
static AttnShape full_shape(const ContextParallel *cp) {
    int n = cp->layout.n, T = n * cp->Tl;
    return (AttnShape){cp->B, T, T, cp->H / n, cp->Hkv / n, cp->hd, cp->all_positions, cp->all_positions, true};
}

typedef struct {
    real *q, *k, *v, *out, *lse;
} HeadSharded;

static HeadSharded heads_alloc(const ContextParallel *cp) {
    size_t tq = (size_t)cp->B * cp->Tl * cp->H * cp->hd, tkv = (size_t)cp->B * cp->Tl * cp->Hkv * cp->hd;
    return (HeadSharded){alloc_comm(tq), alloc_comm(tkv), alloc_comm(tkv), alloc_comm(tq),
                         alloc_comm((size_t)cp->B * cp->H * cp->Tl)};
}

static void heads_free(HeadSharded *x) { mem_free(x->q), mem_free(x->k), mem_free(x->v), mem_free(x->out), mem_free(x->lse); }

static void alltoall_forward(ContextParallel *cp, real *out, real *lse, const real *q, const real *k, const real *v) {
    HeadSharded x = heads_alloc(cp);
    to_heads(cp, cp->H, q, x.q);
    to_heads(cp, cp->Hkv, k, x.k);
    to_heads(cp, cp->Hkv, v, x.v);
    AttnShape s = full_shape(cp);
    trace_block("ulysses attention fwd", 0, cp->layout.rank);
    attention_flash_forward(x.out, x.lse, x.q, x.k, x.v, &s);
    trace_end(trace_track("compute"));
    to_tokens(cp, cp->H, x.out, out, false);
    lse_move(cp, lse, x.lse, false);
    heads_free(&x);
}

static void alltoall_backward(ContextParallel *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                              const real *k, const real *v, const real *out, const real *lse) {
    HeadSharded x = heads_alloc(cp), d = heads_alloc(cp);
    to_heads(cp, cp->H, q, x.q);
    to_heads(cp, cp->Hkv, k, x.k);
    to_heads(cp, cp->Hkv, v, x.v);
    to_heads(cp, cp->H, out, x.out);
    to_heads(cp, cp->H, dout, d.out);
    lse_move(cp, (real *)lse, x.lse, true);
    memset(d.q, 0, sizeof(real) * (size_t)cp->B * cp->Tl * cp->H * cp->hd);
    memset(d.k, 0, sizeof(real) * kv_count(cp));
    memset(d.v, 0, sizeof(real) * kv_count(cp));
    AttnShape s = full_shape(cp);
    trace_block("ulysses attention bwd", 0, cp->layout.rank);
    attention_flash_backward(d.q, d.k, d.v, d.out, x.q, x.k, x.v, x.out, x.lse, &s);
    trace_end(trace_track("compute"));
    to_tokens(cp, cp->H, d.q, dq, true);
    to_tokens(cp, cp->Hkv, d.k, dk, true);
    to_tokens(cp, cp->Hkv, d.v, dv, true);
    heads_free(&x), heads_free(&d);
}

// ---- entry points ------------------------------------------------------------------------------------

void cp_attention_forward(ContextParallel *cp, real *out, real *lse, const real *q, const real *k, const real *v) {
    if (cp->mode == CP_ALLTOALL) alltoall_forward(cp, out, lse, q, k, v);
    else ring_forward(cp, out, lse, q, k, v);
}

void cp_attention_backward(ContextParallel *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                           const real *k, const real *v, const real *out, const real *lse) {
    if (cp->mode == CP_ALLTOALL) alltoall_backward(cp, dq, dk, dv, dout, q, k, v, out, lse);
    else ring_backward(cp, dq, dk, dv, dout, q, k, v, out, lse);
}

static void hook_forward(void *ctx, real *out, real *lse, const real *q, const real *k, const real *v) {
    cp_attention_forward(ctx, out, lse, q, k, v);
}

static void hook_backward(void *ctx, real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                          const real *v, const real *out, const real *lse) {
    cp_attention_backward(ctx, dq, dk, dv, dout, q, k, v, out, lse);
}

ContextParallel *cp_install(Model *m, Comm *cp_group, CpMode mode, bool balanced, int B, int T) {
    ContextParallel *cp = cp_create(cp_group, mode, balanced, B, T, m->local.n_heads, m->local.n_kv_heads,
                                    model_head_dim(&m->cfg), NULL);
    m->cp = (ContextParallelHooks){cp_positions(cp), hook_forward, hook_backward, cp};
    return cp;
}
