// ring.h: all-reduce, reduce-scatter and all-gather built from nothing but point-to-point
// transfers between ring neighbours (chapter 1). Same arguments as comm_all_reduce,
// comm_reduce_scatter and comm_all_gather (common/comm.h); blocking; call them from one thread.
//
// The ring. Rank r only ever talks to two ranks: it sends to its right neighbour (r + 1) mod N and
// receives from its left neighbour (r - 1) mod N. The data is cut into N chunks, and at every step
// each rank sends one chunk right while it receives another from the left (one comm_sendrecv), so
// all N links are busy at once, each carrying the same amount.
//
//   reduce-scatter, N - 1 steps: at step s rank r sends chunk (r - s - 1) mod N, the partial
//       reduction it made at step s - 1 (at step 0: its own data), and receives chunk
//       (r - s - 2) mod N, to which it adds its own contribution. A chunk picks up one rank's
//       contribution per hop; after N - 1 hops chunk r, reduced over all N ranks, is on rank r.
//   all-gather, N - 1 steps: at step s rank r sends chunk (r - s) mod N (its own at step 0, then
//       the one it just received) and receives chunk (r - s - 1) mod N into place. After N - 1
//       steps every rank holds every chunk.
//   all-reduce = reduce-scatter + all-gather: 2(N - 1) steps.
//
// Worked example, N = 4, all-reduce of a buffer cut into chunks A B C D (chunks 0..3). "B1" is
// rank 1's copy of chunk B, "B23" the sum of ranks 2 and 3's copies. Each cell: what the rank sends
// to its right neighbour at that step (it receives what its left neighbour's cell shows).
//
//                      rank 0         rank 1         rank 2         rank 3
//   reduce-scatter 0   D0             A1             B2             C3
//   reduce-scatter 1   C03            D01            A12            B23
//   reduce-scatter 2   B023           C013           D012           A123
//     rank 0 receives A123 and adds A0: each rank r now holds chunk r summed over all four ranks
//     (A0123 on rank 0, B0123 on rank 1, C0123 on rank 2, D0123 on rank 3)
//   all-gather 0       A              B              C              D
//   all-gather 1       D              A              B              C
//   all-gather 2       C              D              A              B
//
// Each rank sent 6 chunks of S/4: 2(N - 1)/N * S bytes for a buffer of S bytes, and received as
// much, which is the least any all-reduce can move per rank (chapter README).
//
// Chunks. A buffer of `count` elements is split into N chunks, chunk k being the elements
// [floor(k * count / N), floor((k + 1) * count / N)): sizes differ by at most one, the larger ones
// spread out (count 10 on 4 ranks: 2, 3, 2, 3), and some are empty when count < N (empty
// transfers still happen, so every rank takes every step). comm.c's all-reduce cuts blocks the
// same way. Reduce-scatter and all-gather have no choice: their chunks are the count-element blocks
// of the comm.h convention (block r belongs to rank r).
//
// Order of the additions, and bit-identity with comm_*. comm_all_reduce folds every element in
// rank order, ((x0 + x1) + x2) + ... + x(N-1). The ring adds in the order the chunk travels, which
// starts at a different rank for each chunk: chunk k starts on rank k + 1 and ends on rank k. Where
// two partial results meet on a rank, the one holding the lower ranks goes first (the received
// partial, except on rank 0, where the partial comes round from the higher ranks), so:
//   - N = 2: each element is one operation on x0 and x1, in that order: bit-identical for every
//     dtype and op (and a + b == b + a exactly in IEEE arithmetic anyway).
//   - chunk N - 1 travels 0 -> 1 -> ... -> N - 1: exactly the rank-order fold, bit-identical.
//   - other chunks, float SUM and AVG, N > 2: the same terms, associated differently. On 4 ranks
//     chunk 0 is x0 + ((x1 + x2) + x3), chunk 1 (x0 + (x2 + x3)) + x1, chunk 2
//     ((x0 + x3) + x1) + x2, and only chunk 3 is ((x0 + x1) + x2) + x3. Equal up to rounding: each
//     order's result is within (N - 1) * eps/2 * sum|x| of the exact sum (to first order), so two
//     orders differ by at most (N - 1) * eps * sum|x|; main_collectives.c --check tests that.
//   - INT32 SUM wraps modulo 2^32, which is associative: always exact.
//   - MAX is associative: always the same value. Its bits can still differ between +0 and -0,
//     which compare equal, so which one survives a tie depends on who came first (N > 2 only).
// An ordered ring (every chunk folded 0, 1, ..., N - 1) would need every chunk to start on rank 0:
// a pipelined chain rather than a ring, whose last link (N - 1 -> 0) carries nothing during the
// reduction. NCCL does not promise an order either; comm.c gets rank order by having the owner of
// each block receive all N copies (an all-to-all) and fold them itself.
//
// Memory: one scratch buffer of two chunks, kept from call to call (grown, never shrunk).
//
// Trace. When tracing (common/trace.h), each collective is a slice "ring <collective>" on the
// track "ring" of the calling thread, holding one slice per step ("reduce-scatter 0", ...,
// "all-gather 2") with args step, phase, chunk (sent), recv_chunk, bytes (sent), peer (world rank
// of the right neighbour) and from (of the left one), and a flow arrow from each step's send to the
// step on the right neighbour that receives it. Flow ids are trace_flow_id(src, dst, seq) with seq
// counted from RING_FLOW_SEQ0 per (src, dst) pair, so they never collide with the comm layer's own
// flows (whose seqs count from 0) when CommOptions.trace draws those too.
#pragma once
#include <stddef.h>

#include "common/comm.h"

// Flow sequence numbers of ring messages start here (comm.c's start at 0; trace_flow_id takes
// seq < 2^29, so each space holds 2^28 messages per pair of ranks before it wraps).
#define RING_FLOW_SEQ0 ((size_t)1 << 28)

// In place: buf (count) becomes the reduction over c. Float32/float64 with SUM, AVG, MAX; INT32
// with SUM (wrapping), MAX.
void ring_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op);
// send (count * N), recv (count): rank r receives the reduction of block r.
void ring_reduce_scatter(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype, CommReduceOp op);
// send (count), recv (count * N): block r of recv is rank r's send. Any dtype, COMM_BYTE included.
void ring_all_gather(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype);

// First element of chunk k (0 <= k <= n) when `count` elements are cut into n chunks as above;
// chunk k is [ring_chunk_begin(count, n, k), ring_chunk_begin(count, n, k + 1)).
size_t ring_chunk_begin(size_t count, int n, int k);
