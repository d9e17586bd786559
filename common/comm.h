// comm.h: the communicator every parallel module talks to. Backend-neutral: Open MPI on host
// memory, and on device (GPU) memory whatever backend gpu/ registers (NCCL, or MPI staged through
// host memory): the same calls take either kind of buffer (see "Device buffers" below).
//
// Streams. Each rank has a compute stream (its main thread) and a comm stream: one worker thread
// that runs queued operations one after another, in the order they were started (like a CUDA
// stream with NCCL on it). `*_start` queues an operation and returns a handle at once; comm_wait()
// blocks until that operation has finished (on host buffers; on device buffers it orders the GPU's
// compute stream after it instead: see "device buffers" at the end). Compute on the main thread therefore really overlaps
// communication, and the timeline shows it. The blocking forms are start + wait.
//
//   CommHandle *h = comm_all_reduce_start(dp, grads, n, COMM_FLOAT32, COMM_AVG);
//   ... more backward ...                     // runs while the all-reduce is in flight
//   comm_wait(h);                              // grads now hold the average over dp
//
// Point to point. Because the stream runs one operation at a time to completion, a send that
// waits for its receiver must not be queued before the receive the receiver is waiting on. Queue
// the sends and receives that belong together as ONE operation with comm_batch_start() (as
// ncclGroupStart/End or torch.distributed.batch_isend_irecv do); comm_send/comm_recv alone are
// for one-directional transfers.
//
// Buffers passed to a *_start call belong to the comm stream until comm_wait returns: do not read
// or write them in between (the in-place all-reduce writes its result into `buf`).
//
// Failure. An operation that has not finished after the timeout ends the run with one line naming
// the operation, the group and who is missing: for point to point the peer rank, for a collective
// the members that did not arrive, each "alive, still at collective j" (not there yet) or "no
// answer: stopped or dead" (a SIGSTOPped or killed rank; mpirun may end the job first for a killed
// one; see common/COMM.md). Members that disagree on a collective (its kind, count, dtype, reduce
// op or root: every collective compares a small descriptor of each member's call) and a receive
// whose message is not the count it posted end the run with one line saying what differs.
// comm_init is not covered (a rank stopped before it returns hangs the others in MPI_Init);
// comm_finalize is, by a barrier under the timeout before MPI_Finalize.
//
// The timeout. comm_init sets it (default COMM_STARTUP_TIMEOUT_S, room for start-up work such as
// building the model), comm_set_timeout changes it at any time. A trainer that measures its steps
// derives it with comm_timeout_for_step: max(COMM_TIMEOUT_FLOOR_S, COMM_TIMEOUT_STEP_FACTOR x the
// slowest step measured), so a hung rank ends a run of 1-second steps after 60 s, not 300 s.
#pragma once
#include <stdbool.h>
#include <stddef.h>

typedef struct Comm Comm;
typedef struct CommHandle CommHandle;

typedef enum { COMM_FLOAT32, COMM_FLOAT64, COMM_INT32, COMM_BYTE } CommDtype;
typedef enum { COMM_SUM, COMM_AVG, COMM_MAX } CommReduceOp;  // AVG = SUM / group size

#define COMM_STARTUP_TIMEOUT_S 300.0
#define COMM_TIMEOUT_FLOOR_S 60.0
#define COMM_TIMEOUT_STEP_FACTOR 10.0

typedef struct {
    double timeout_seconds;  // per operation; <= 0 means the default, COMM_STARTUP_TIMEOUT_S
    bool trace;              // record a slice per operation on the track "comm:<group name>"
    size_t chunk_bytes;      // most bytes one MPI call moves (larger operations go in pieces);
                             // 0 means the default, 1 GiB. Tests set it small to exercise pieces.
} CommOptions;

// MPI_Init_thread (MPI_THREAD_SERIALIZED: after it, only the worker thread calls MPI) and the comm
// stream's worker thread. Call once, before anything else; options may be NULL (defaults). Works
// without mpirun too, as a world of one rank.
void comm_init(int *argc, char ***argv, const CommOptions *options);
// A barrier over the world under the timeout (so a peer stopped after its last collective ends the
// run instead of hanging MPI_Finalize), then waits for queued work, stops the worker, MPI_Finalize.
void comm_finalize(void);
// The timeout of every operation from now on, also one already waiting (seconds, > 0).
void comm_set_timeout(double seconds);
double comm_timeout(void);
// The rule for a timeout derived from measured steps: max(COMM_TIMEOUT_FLOOR_S,
// COMM_TIMEOUT_STEP_FACTOR x slowest_step_seconds).
double comm_timeout_for_step(double slowest_step_seconds);

Comm *comm_world(void);  // named "world"
// This process among the world's ranks on the same host (node), whatever the launcher's mapping:
// its index there and how many there are. A rank picks its GPU by it.
int comm_local_rank(void);
int comm_local_size(void);
int comm_rank(const Comm *c);
int comm_size(const Comm *c);
const char *comm_name(const Comm *c);
// The world rank of rank `r` of c (for naming peers and drawing flows).
int comm_world_rank_of(const Comm *c, int r);
// Collective over parent: ranks with the same color form a group, ordered by key (ties by rank in
// parent). name labels the group in messages and trace tracks ("dp_shard", "tp", ...). Runs on
// the comm stream (after the work queued before it) and blocks until done.
Comm *comm_split(Comm *parent, int color, int key, const char *name);
void comm_free(Comm *c);  // waits for the work queued on c; not for comm_world()

size_t comm_dtype_size(CommDtype dtype);
size_t comm_bytes(CommDtype dtype, size_t count);

// ---- collectives (count is in elements) ---------------------------------------------------------
// Every member of the group calls each collective in the same order with the same count, dtype,
// reduce op and root; the comm stream compares them (a 16-byte all-gather posted with the data,
// common/COMM.md) and ends the run naming what differs. Not checked on NCCL's device buffers.
// Reductions are bit-reproducible: every element is folded in rank order, x0 + x1 + ... + x(n-1),
// on every rank and in every run (see common/COMM.md). AVG needs a float dtype; COMM_BYTE cannot be
// reduced. MAX propagates NaN.
// In place: buf (count) becomes the reduction over the group.
CommHandle *comm_all_reduce_start(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op);
// send (count * size), recv (count): rank r receives the reduction of block r.
CommHandle *comm_reduce_scatter_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype,
                                      CommReduceOp op);
// send (count), recv (count * size): block r of recv is rank r's send.
CommHandle *comm_all_gather_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype);
CommHandle *comm_broadcast_start(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
// send (count * size): block r goes to rank r; recv (count * size): block r came from rank r.
CommHandle *comm_all_to_all_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype);
CommHandle *comm_barrier_start(Comm *c);

// ---- point to point -----------------------------------------------------------------------------
typedef enum { COMM_SEND, COMM_RECV } CommP2PKind;
typedef struct {
    CommP2PKind kind;
    void *buf;  // const for sends
    size_t count;
    CommDtype dtype;
    int peer;  // rank in c
    int tag;   // >= 0
} CommP2P;
// Posts every transfer, then waits for all of them: one operation on the stream. A receive's count
// must equal its send's (large transfers travel as several messages); a message of another length
// than the receive posted for it ends the run.
CommHandle *comm_batch_start(Comm *c, const CommP2P *ops, int n_ops);
CommHandle *comm_send_start(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer, int tag);
CommHandle *comm_recv_start(Comm *c, void *buf, size_t count, CommDtype dtype, int peer, int tag);

// Blocks until the operation finished; frees the handle. NULL is fine. (Device buffers: see below.)
void comm_wait(CommHandle *h);
bool comm_test(CommHandle *h);  // true once finished (the handle still needs comm_wait)

// ---- blocking forms -------------------------------------------------------------------------------
void comm_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op);
void comm_reduce_scatter(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype, CommReduceOp op);
void comm_all_gather(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype);
void comm_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root);
void comm_all_to_all(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype);
void comm_barrier(Comm *c);
void comm_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer, int tag);
void comm_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer, int tag);
void comm_sendrecv(Comm *c, const void *send, size_t send_count, int dst, void *recv, size_t recv_count, int src,
                   CommDtype dtype, int tag);

// ---- device buffers -------------------------------------------------------------------------------
// Every call above except the barrier also takes device buffers (GPU memory from gpu_alloc) once
// gpu/ has registered a device backend (gpu/comm_device.h: gpu_comm_backend_init, after gpu_init).
// comm.c asks the backend whether the buffers are device memory, and hands such an operation to the
// backend instead of running MPI on it: NCCL (a GPU per rank) or MPI staged through pinned host
// memory (ranks may share a GPU). One operation's buffers are all host or all device memory.
//
// What the calls mean on device buffers (the compute stream is gpu/'s gpu_stream()):
//   *_start    the operation reads its inputs as the compute-stream work queued before the call
//              leaves them: it is ordered after that work.
//   comm_wait  the compute-stream work queued after the call is ordered after the operation, so it
//              sees the results. The host is not promised them: read a result on the host through
//              the compute stream (gpu_download waits for it). NCCL: an event the compute stream
//              waits for, the host does not block. Staged: the host blocks until the MPI part has
//              finished, then the copy to the device is queued on the compute stream.
//   comm_test  true once the transfer itself has finished (comm_wait will not block the host).
// Device operations run one after another in the order they were started, as host ones do, so an
// operation reads what an earlier one writes even before that one was waited for (FSDP's
// reduce-scatter, then an all-reduce of its result). Host and device operations are ordered
// against each other only by comm_wait. Buffers belong to the operation from start to comm_wait.
// The blocking forms are start + wait here too: on NCCL they return before the data has moved.
// The timeout covers the MPI part of a staged operation; a peer that never joins an NCCL
// operation hangs the device (and the next host wait for it).

// An operation as data: what each *_start call above describes, and what a backend receives.
typedef enum {
    COMM_CALL_ALL_REDUCE, COMM_CALL_REDUCE_SCATTER, COMM_CALL_ALL_GATHER, COMM_CALL_BROADCAST,
    COMM_CALL_ALL_TO_ALL, COMM_CALL_P2P
} CommCallKind;
typedef struct {
    CommCallKind kind;
    const char *name;    // "all_reduce", "send", "sendrecv", ...: for messages and trace slices
    Comm *comm;
    const void *send;    // collectives; in place (all_reduce, broadcast): send == recv
    void *recv;
    size_t count;        // elements, as in the calls above
    CommDtype dtype;
    CommReduceOp op;     // all_reduce, reduce_scatter
    int root;            // broadcast
    const CommP2P *p2p;  // COMM_CALL_P2P: the transfers (a batch, a send, a recv); only valid
    int n_p2p;           // during the start call
} CommCall;
// Checks call and starts it, on MPI or on the device backend: every *_start above is this.
CommHandle *comm_start(const CommCall *call);

// A device backend: a table of functions, so that common/ is built without CUDA.
typedef struct {
    const char *name;                                    // "nccl", "staged": for logs
    bool (*is_device)(const void *ptr);                  // does ptr point into device memory?
    void *(*attach)(Comm *c);                            // c's state for the backend; collective over c
    void (*detach)(Comm *c, void *group_state);          // c is being freed (or the backend replaced)
    void *(*start)(const CommCall *call, void *group_state);  // queues call; returns its handle
    bool (*test)(void *op);                              // comm_test
    void (*wait)(void *op);                              // comm_wait's meaning above; frees op
} CommDeviceBackend;
// Registers backend (NULL: none): the previous one is detached from every live group and the new
// one attached to each, in the order the groups were created; groups split later are attached when
// comm_split makes them. Collective over the world: every rank calls it, with the same backend.
void comm_set_device_backend(const CommDeviceBackend *backend);
const CommDeviceBackend *comm_device_backend(void);  // NULL: none
