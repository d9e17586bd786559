// cp.c: context parallelism (cp.h): the split of the sequence, ring attention and all-to-all
// attention, forward and backward, built from reference_cpu's blockwise attention.
#include "chapters/08_context_parallel/cp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

enum { TAG_KV = 80, TAG_DKV = 81 };

struct CpAttention {
    Comm *group;
    int size, rank, seq_len, local_len;
    CpMode mode;
    bool load_balance;
    int *positions;       // (N, local_len): the global positions of every rank's tokens
    real *scratch;        // grown on demand, reused by every call (MEM_COMM)
    size_t scratch_numel;
    long transfers;
};

// ---- the split ----------------------------------------------------------------------------------

const char *cp_check(int cp_size, CpMode mode, bool load_balance, int seq_len, int n_kv_heads) {
    static char why[200];
    int parts = load_balance ? 2 * cp_size : cp_size;
    if (cp_size < 1) {
        snprintf(why, sizeof why, "--cp %d: must be at least 1", cp_size);
        return why;
    }
    if (seq_len % parts != 0) {
        snprintf(why, sizeof why, "--cp %d: the sequence length %d must divide by %s = %d", cp_size, seq_len,
                 load_balance ? "2 x cp (zigzag chunks)" : "cp", parts);
        return why;
    }
    if (mode == CP_ALLTOALL && n_kv_heads % cp_size != 0) {
        snprintf(why, sizeof why,
                 "--cp-mode alltoall: the %d kv heads (per tensor-parallel rank) must divide by --cp %d "
                 "(each cp rank takes whole kv heads); use --cp-mode ring",
                 n_kv_heads, cp_size);
        return why;
    }
    return NULL;
}

void cp_chunk_positions(int *positions, int rank, int N, int seq_len, bool load_balance) {
    if (!load_balance) {
        int L = seq_len / N;
        for (int i = 0; i < L; i++) positions[i] = rank * L + i;
        return;
    }
    int c = seq_len / (2 * N);  // chunks `rank` and 2N-1-rank: a early one and its mirror image
    for (int i = 0; i < c; i++) {
        positions[i] = rank * c + i;
        positions[c + i] = (2 * N - 1 - rank) * c + i;
    }
}

CpAttention *cp_create(Comm *cp_group, CpMode mode, bool load_balance, int seq_len, int n_kv_heads) {
    int N = comm_size(cp_group);
    const char *why = cp_check(N, mode, load_balance, seq_len, n_kv_heads);
    if (why) fatal_input("%s", why);
    CpAttention *cp = calloc(1, sizeof *cp);
    if (!cp) fatal("out of memory");
    *cp = (CpAttention){.group = cp_group, .size = N, .rank = comm_rank(cp_group), .seq_len = seq_len,
                        .local_len = seq_len / N, .mode = mode, .load_balance = load_balance};
    cp->positions = malloc(sizeof(int) * seq_len);
    if (!cp->positions) fatal("out of memory");
    for (int r = 0; r < N; r++) cp_chunk_positions(cp->positions + (size_t)r * cp->local_len, r, N, seq_len, load_balance);
    return cp;
}

void cp_free(CpAttention *cp) {
    if (!cp) return;
    mem_free(cp->scratch);
    free(cp->positions);
    free(cp);
}

int cp_local_len(const CpAttention *cp) { return cp->local_len; }
static const int *positions_of(const CpAttention *cp, int rank) { return cp->positions + (size_t)rank * cp->local_len; }
const int *cp_positions(const CpAttention *cp) { return positions_of(cp, cp->rank); }
long cp_transfers(const CpAttention *cp) { return cp->transfers; }

void cp_take_tokens(const CpAttention *cp, int *local, const int *full, int B) {
    const int *pos = cp_positions(cp);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < cp->local_len; i++) local[(size_t)b * cp->local_len + i] = full[(size_t)b * cp->seq_len + pos[i]];
}

void cp_take_rows(const CpAttention *cp, real *local, const real *full, int B, int width) {
    const int *pos = cp_positions(cp);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < cp->local_len; i++)
            memcpy(local + ((size_t)b * cp->local_len + i) * width, full + ((size_t)b * cp->seq_len + pos[i]) * width,
                   sizeof(real) * width);
}

// At least n elements of scratch (grown, never shrunk: the same shapes come every layer).
static real *scratch(CpAttention *cp, size_t n) {
    if (n > cp->scratch_numel) {
        mem_free(cp->scratch);
        cp->scratch = mem_alloc(MEM_COMM, sizeof(real) * n);
        cp->scratch_numel = n;
    }
    return cp->scratch;
}

static void fill(real *x, size_t n, real value) {
    for (size_t i = 0; i < n; i++) x[i] = value;
}

// ---- ring attention ----------------------------------------------------------------------------

// One hop round the ring: send (n) goes to the next rank while recv (n) arrives from the previous
// one, as one batched operation on the comm stream.
static CommHandle *ring_hop_start(CpAttention *cp, const real *send, real *recv, size_t n, int tag) {
    int next = (cp->rank + 1) % cp->size, prev = (cp->rank + cp->size - 1) % cp->size;
    CommP2P ops[2] = {{COMM_SEND, (void *)send, n, COMM_REAL, next, tag}, {COMM_RECV, recv, n, COMM_REAL, prev, tag}};
    cp->transfers++;
    return comm_batch_start(cp->group, ops, 2);
}

// The part of this rank's (local_len x local_len) block against the K/V of rank src that the
// causal mask leaves: query rows [q0, q0+nq) against key rows [k0, k0+nk). Returns false when no
// query sees any of those keys (contiguous split, src after this rank).
typedef struct {
    int q0, nq, k0, nk;
    bool causal;  // only the diagonal (src == rank) needs the mask
} RingBlock;

static bool ring_block(const CpAttention *cp, int src, RingBlock *blk) {
    int L = cp->local_len, c = L / 2, r = cp->rank;
    if (src == r) *blk = (RingBlock){0, L, 0, L, true};
    else if (!cp->load_balance) {
        if (src > r) return false;
        *blk = (RingBlock){0, L, 0, L, false};
    } else if (src < r) *blk = (RingBlock){0, L, 0, c, false};  // src's first chunk precedes both of ours
    else *blk = (RingBlock){c, c, 0, L, false};  // both src chunks lie between our two chunks
    return true;
}

static AttnShape block_shape(const CpAttention *cp, const AttnShape *s, const RingBlock *blk, int src) {
    return (AttnShape){1, blk->nq, blk->nk, s->n_heads, s->n_kv_heads, s->head_dim, cp_positions(cp) + blk->q0,
                       positions_of(cp, src) + blk->k0, blk->causal};
}

// Online-softmax merge of a block's (out_b, lse_b) into the running (out, lse), per query row and
// head: lse' = log(e^lse + e^lse_b) and out' = out e^(lse - lse') + out_b e^(lse_b - lse'), i.e. each
// partial output is reweighted by its share of the softmax normaliser (README.md derives it).
// out, out_b (nq, H, hd); lse rows h*lse_stride + i; lse_b (H, nq). A row whose block saw no key
// (lse_b = -inf) keeps its state; the first block (lse = -inf, out = 0) is copied exactly.
static void merge_block(real *out, real *lse, const real *out_b, const real *lse_b, int nq, int H, int hd,
                        int lse_stride) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; h++)
        for (int i = 0; i < nq; i++) {
            real lb = lse_b[(size_t)h * nq + i], *l = &lse[(size_t)h * lse_stride + i];
            if (lb == -INFINITY) continue;
            double hi = *l > lb ? *l : lb, lo = *l > lb ? lb : *l;
            real merged = (real)(hi + log1p(exp(lo - hi)));
            real wa = exp_r(*l - merged), wb = exp_r(lb - merged);
            real *o = out + ((size_t)i * H + h) * hd;
            const real *ob = out_b + ((size_t)i * H + h) * hd;
            for (int d = 0; d < hd; d++) o[d] = o[d] * wa + ob[d] * wb;
            *l = merged;
        }
}

// comm_wait, marked on the compute track as time the main thread is blocked on the cp ring (what
// trace-summary counts as exposed communication).
static void cp_wait(CommHandle *h) {
    if (!h) return;
    int track = trace_track("compute");
    trace_begin(track, "cp wait", "comm-wait");
    comm_wait(h);
    trace_end(track);
}

static void trace_step(int track, const char *name, int step, int src) {
    trace_begin(track, name, "cp");
    trace_arg_int(track, "step", step);
    trace_arg_int(track, "kv_rank", src);
}

static void ring_forward(CpAttention *cp, real *out, real *lse, const real *q, const real *k, const real *v,
                         const AttnShape *s) {
    int N = cp->size, L = cp->local_len, H = s->n_heads, hd = s->head_dim;
    size_t kv_n = (size_t)s->B * L * s->n_kv_heads * hd;  // one of K, V
    real *buf = scratch(cp, 4 * kv_n + (size_t)L * H * hd + (size_t)H * L);
    real *kv[2] = {buf, buf + 2 * kv_n};  // double buffer: compute on one, receive into the other
    real *out_b = buf + 4 * kv_n, *lse_b = out_b + (size_t)L * H * hd;
    memcpy(kv[0], k, sizeof(real) * kv_n);
    memcpy(kv[0] + kv_n, v, sizeof(real) * kv_n);
    fill(out, (size_t)s->B * L * H * hd, 0);
    fill(lse, (size_t)s->B * H * L, -INFINITY);
    int track = trace_track("compute");
    for (int step = 0; step < N; step++) {
        // The next K/V travels while this one computes. Reading a buffer whose send is in flight
        // is safe (MPI and NCCL only read a send buffer); writing it would not be.
        const real *cur = kv[step % 2];
        CommHandle *hop = step + 1 < N ? ring_hop_start(cp, cur, kv[(step + 1) % 2], 2 * kv_n, TAG_KV) : NULL;
        int src = (cp->rank - step + N) % N;
        RingBlock blk;
        trace_step(track, "ring attention step", step, src);
        if (ring_block(cp, src, &blk)) {
            AttnShape bs = block_shape(cp, s, &blk, src);
            for (int b = 0; b < s->B; b++) {  // one sample at a time: its rows of a block are contiguous
                size_t k_off = ((size_t)b * L + blk.k0) * s->n_kv_heads * hd, q_off = ((size_t)b * L + blk.q0) * H * hd;
                attention_flash_forward(out_b, lse_b, q + q_off, cur + k_off, cur + kv_n + k_off, &bs);
                merge_block(out + q_off, lse + (size_t)b * H * L + blk.q0, out_b, lse_b, blk.nq, H, hd, L);
            }
        }
        trace_end(track);
        cp_wait(hop);
    }
}

// Backward, the same ring again. Each block's flash backward uses the GLOBAL lse and the final
// out/dout, so its dq, dk, dv are exact partial sums of the full gradients: dq adds up here; the
// dK/dV of the block travel with a second ring (the same direction, one step behind the K/V) and
// collect every rank's part, arriving home after the last step.
static void ring_backward(CpAttention *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                          const real *k, const real *v, const real *out, const real *lse, const AttnShape *s) {
    int N = cp->size, L = cp->local_len, H = s->n_heads, hd = s->head_dim;
    size_t kv_n = (size_t)s->B * L * s->n_kv_heads * hd;
    real *buf = scratch(cp, 10 * kv_n + (size_t)H * L);
    real *kv[2] = {buf, buf + 2 * kv_n};
    real *acc[2] = {buf + 4 * kv_n, buf + 6 * kv_n};  // this step's dK/dV (one being sent, one computed)
    real *arrived = buf + 8 * kv_n;                    // dK/dV from the ranks before us on the ring
    real *lse_b = buf + 10 * kv_n;
    memcpy(kv[0], k, sizeof(real) * kv_n);
    memcpy(kv[0] + kv_n, v, sizeof(real) * kv_n);
    int track = trace_track("compute");
    CommHandle *dkv_hop = NULL;
    for (int step = 0; step < N; step++) {
        const real *cur = kv[step % 2];
        CommHandle *hop = step + 1 < N ? ring_hop_start(cp, cur, kv[(step + 1) % 2], 2 * kv_n, TAG_KV) : NULL;
        int src = (cp->rank - step + N) % N;
        real *dkv = acc[step % 2];
        fill(dkv, 2 * kv_n, 0);
        RingBlock blk;
        trace_step(track, "ring attention backward step", step, src);
        if (ring_block(cp, src, &blk)) {
            AttnShape bs = block_shape(cp, s, &blk, src);
            for (int b = 0; b < s->B; b++) {
                size_t k_off = ((size_t)b * L + blk.k0) * s->n_kv_heads * hd, q_off = ((size_t)b * L + blk.q0) * H * hd;
                for (int h = 0; h < H; h++)  // the block's rows of the global lse, (H, nq)
                    memcpy(lse_b + (size_t)h * blk.nq, lse + ((size_t)b * H + h) * L + blk.q0, sizeof(real) * blk.nq);
                attention_flash_backward(dq + q_off, dkv + k_off, dkv + kv_n + k_off, dout + q_off, q + q_off, cur + k_off,
                                         cur + kv_n + k_off, out + q_off, lse_b, &bs);
            }
        }
        trace_end(track);
        cp_wait(dkv_hop);  // the previous step's hop: `arrived` holds src's dK/dV from the ranks before us
        if (step > 0) add_inplace(dkv, arrived, 2 * kv_n);
        dkv_hop = ring_hop_start(cp, dkv, arrived, 2 * kv_n, TAG_DKV);
        cp_wait(hop);
    }
    cp_wait(dkv_hop);  // our own K/V's gradient, summed over every rank's queries
    add_inplace(dk, arrived, kv_n);
    add_inplace(dv, arrived + kv_n, kv_n);
}

// ---- all-to-all (Ulysses) ----------------------------------------------------------------------

// x (B, L, Hx, w) sequence-sharded -> full (B, T, Hx/N, w) head-sharded: rank j gets heads
// [j*Hx/N, (j+1)*Hx/N) of every rank's tokens, each placed at its global position (so attention
// on `full` is exactly the single process's on those heads). send, recv: (B*L*Hx*w) scratch.
static void seq_to_heads(CpAttention *cp, real *full, const real *x, int B, int Hx, int w, real *send, real *recv) {
    int N = cp->size, L = cp->local_len, n = Hx / N;
    size_t block = (size_t)B * L * n * w;
    for (int j = 0; j < N; j++)
        for (size_t t = 0; t < (size_t)B * L; t++)
            memcpy(send + j * block + t * n * w, x + (t * Hx + (size_t)j * n) * w, sizeof(real) * n * w);
    cp->transfers++;
    cp_wait(comm_all_to_all_start(cp->group, send, recv, block, COMM_REAL));  // attention needs all of it
    for (int j = 0; j < N; j++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < L; i++)
                memcpy(full + ((size_t)b * cp->seq_len + positions_of(cp, j)[i]) * n * w,
                       recv + j * block + ((size_t)b * L + i) * n * w, sizeof(real) * n * w);
}

// The inverse: full (B, T, Hx/N, w) head-sharded -> x (B, L, Hx, w) sequence-sharded.
static void heads_to_seq(CpAttention *cp, real *x, const real *full, int B, int Hx, int w, real *send, real *recv) {
    int N = cp->size, L = cp->local_len, n = Hx / N;
    size_t block = (size_t)B * L * n * w;
    for (int j = 0; j < N; j++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < L; i++)
                memcpy(send + j * block + ((size_t)b * L + i) * n * w,
                       full + ((size_t)b * cp->seq_len + positions_of(cp, j)[i]) * n * w, sizeof(real) * n * w);
    cp->transfers++;
    cp_wait(comm_all_to_all_start(cp->group, send, recv, block, COMM_REAL));  // attention needs all of it
    for (int j = 0; j < N; j++)
        for (size_t t = 0; t < (size_t)B * L; t++)
            memcpy(x + (t * Hx + (size_t)j * n) * w, recv + j * block + t * n * w, sizeof(real) * n * w);
}

// lse is head-major, (B, H, T); the all-to-alls move token-major rows: dst (B, T, H) = src^T per sample.
static void swap_last_two(real *dst, const real *src, int B, int rows, int cols) {
    for (int b = 0; b < B; b++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++)
                dst[((size_t)b * cols + c) * rows + r] = src[((size_t)b * rows + r) * cols + c];
}

// The head-sharded tensors of one call: q, out, dout, dq (B, T, H/N, hd); k, v, dk, dv (B, T,
// KV/N, hd); lse (B, H/N, T); and the all-to-all staging.
typedef struct {
    real *q, *k, *v, *out, *dout, *dq, *dk, *dv, *lse, *lse_t, *send, *recv;
} HeadBuffers;

static HeadBuffers head_buffers(CpAttention *cp, const AttnShape *s) {
    size_t BT = (size_t)s->B * cp->seq_len, q_n = BT * s->n_heads / cp->size * s->head_dim,
           kv_n = BT * s->n_kv_heads / cp->size * s->head_dim, lse_n = BT * s->n_heads / cp->size,
           stage_n = (size_t)s->B * cp->local_len * s->n_heads * s->head_dim;
    real *p = scratch(cp, 4 * q_n + 4 * kv_n + 2 * lse_n + 2 * stage_n);
    HeadBuffers hb;
    real **q_like[] = {&hb.q, &hb.out, &hb.dout, &hb.dq}, **kv_like[] = {&hb.k, &hb.v, &hb.dk, &hb.dv};
    for (int i = 0; i < 4; i++) *q_like[i] = p, p += q_n;
    for (int i = 0; i < 4; i++) *kv_like[i] = p, p += kv_n;
    hb.lse = p, p += lse_n;
    hb.lse_t = p, p += lse_n;
    hb.send = p, p += stage_n;
    hb.recv = p;
    return hb;
}

static AttnShape full_shape(const CpAttention *cp, const AttnShape *s) {
    return (AttnShape){s->B, cp->seq_len, cp->seq_len, s->n_heads / cp->size, s->n_kv_heads / cp->size,
                       s->head_dim, NULL, NULL, true};
}

static void alltoall_forward(CpAttention *cp, real *out, real *lse, const real *q, const real *k, const real *v,
                             const AttnShape *s) {
    HeadBuffers hb = head_buffers(cp, s);
    int B = s->B, H = s->n_heads, KV = s->n_kv_heads, hd = s->head_dim, L = cp->local_len;
    seq_to_heads(cp, hb.q, q, B, H, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.k, k, B, KV, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.v, v, B, KV, hd, hb.send, hb.recv);
    AttnShape fs = full_shape(cp, s);
    int track = trace_track("compute");
    trace_begin(track, "alltoall attention", "cp");
    attention_flash_forward(hb.out, hb.lse, hb.q, hb.k, hb.v, &fs);
    trace_end(track);
    heads_to_seq(cp, out, hb.out, B, H, hd, hb.send, hb.recv);
    swap_last_two(hb.lse_t, hb.lse, B, fs.n_heads, cp->seq_len);  // (B, H/N, T) -> (B, T, H/N)
    heads_to_seq(cp, hb.dq, hb.lse_t, B, H, 1, hb.send, hb.recv);  // -> (B, L, H), in dq's space
    swap_last_two(lse, hb.dq, B, L, H);
}

static void alltoall_backward(CpAttention *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                              const real *k, const real *v, const real *out, const real *lse, const AttnShape *s) {
    HeadBuffers hb = head_buffers(cp, s);
    int B = s->B, H = s->n_heads, KV = s->n_kv_heads, hd = s->head_dim, L = cp->local_len;
    AttnShape fs = full_shape(cp, s);
    seq_to_heads(cp, hb.q, q, B, H, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.k, k, B, KV, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.v, v, B, KV, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.out, out, B, H, hd, hb.send, hb.recv);
    seq_to_heads(cp, hb.dout, dout, B, H, hd, hb.send, hb.recv);
    swap_last_two(hb.dq, lse, B, H, L);                             // (B, H, L) -> (B, L, H)
    seq_to_heads(cp, hb.lse_t, hb.dq, B, H, 1, hb.send, hb.recv);   // -> (B, T, H/N)
    swap_last_two(hb.lse, hb.lse_t, B, cp->seq_len, fs.n_heads);    // -> (B, H/N, T)
    size_t q_n = (size_t)B * cp->seq_len * fs.n_heads * hd, kv_n = (size_t)B * cp->seq_len * fs.n_kv_heads * hd;
    fill(hb.dq, q_n, 0);
    fill(hb.dk, kv_n, 0);
    fill(hb.dv, kv_n, 0);
    int track = trace_track("compute");
    trace_begin(track, "alltoall attention backward", "cp");
    attention_flash_backward(hb.dq, hb.dk, hb.dv, hb.dout, hb.q, hb.k, hb.v, hb.out, hb.lse, &fs);
    trace_end(track);
    // back to sequence-sharded, added into the caller's gradients (hb.out, hb.q: free by now)
    real *back = hb.out;
    heads_to_seq(cp, back, hb.dq, B, H, hd, hb.send, hb.recv);
    add_inplace(dq, back, (size_t)B * L * H * hd);
    heads_to_seq(cp, back, hb.dk, B, KV, hd, hb.send, hb.recv);
    add_inplace(dk, back, (size_t)B * L * KV * hd);
    heads_to_seq(cp, back, hb.dv, B, KV, hd, hb.send, hb.recv);
    add_inplace(dv, back, (size_t)B * L * KV * hd);
}

// ---- entry points ------------------------------------------------------------------------------

static void check_shape(const CpAttention *cp, const AttnShape *s) {
    if (s->Tq != cp->local_len || s->Tk != cp->local_len || !s->causal || s->q_pos || s->k_pos)
        fatal("cp attention: expected causal (Tq, Tk) = (%d, %d) without positions, got (%d, %d)", cp->local_len,
              cp->local_len, s->Tq, s->Tk);
}

void cp_attention_forward(CpAttention *cp, real *out, real *lse, const real *q, const real *k, const real *v,
                          const AttnShape *s) {
    check_shape(cp, s);
    if (cp->size == 1) attention_flash_forward(out, lse, q, k, v, s);  // exactly the single process
    else if (cp->mode == CP_RING) ring_forward(cp, out, lse, q, k, v, s);
    else alltoall_forward(cp, out, lse, q, k, v, s);
}

void cp_attention_backward(CpAttention *cp, real *dq, real *dk, real *dv, const real *dout, const real *q,
                           const real *k, const real *v, const real *out, const real *lse, const AttnShape *s) {
    check_shape(cp, s);
    if (cp->size == 1) attention_flash_backward(dq, dk, dv, dout, q, k, v, out, lse, s);
    else if (cp->mode == CP_RING) ring_backward(cp, dq, dk, dv, dout, q, k, v, out, lse, s);
    else alltoall_backward(cp, dq, dk, dv, dout, q, k, v, out, lse, s);
}

static void hook_forward(void *ctx, real *out, real *lse, const real *q, const real *k, const real *v,
                         const AttnShape *s) {
    cp_attention_forward(ctx, out, lse, q, k, v, s);
}
static void hook_backward(void *ctx, real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                          const real *v, const real *out, const real *lse, const AttnShape *s) {
    cp_attention_backward(ctx, dq, dk, dv, dout, q, k, v, out, lse, s);
}

void cp_install(Model *m, CpAttention *cp) {
    if (m->attention != ATTN_FLASH) fatal_input("--cp %d: needs --attention flash (ring attention merges lse)", cp->size);
    m->cp = (ContextParallel){.size = cp->size, .positions = cp_positions(cp), .attention_forward = hook_forward,
                              .attention_backward = hook_backward, .ctx = cp};
}
