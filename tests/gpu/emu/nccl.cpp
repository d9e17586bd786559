// nccl.cpp: the emulator's NCCL (include/nccl.h). Ranks are the processes mpirun started on this
// machine; a communicator is a shared-memory segment holding one byte pipe per ordered pair of
// ranks (a ring buffer with a written and a read count), so that everything is point to point:
//
//   send(to q, bytes)    append the bytes to pipe (me -> q), as fast as q empties it
//   recv(from q, bytes)  take bytes from pipe (q -> me)
//
// A pair's messages therefore match in the order they were posted, as NCCL's do. Each operation is a
// set of such transfers that advance together (none waits for another to finish first), which is
// what lets a ring exchange or an all-to-all of any size complete: an all-gather sends my block to
// every peer and receives theirs; an all-reduce gathers every rank's buffer and folds them in rank
// order (x0 + x1 + ... + x(n-1), as common/comm.c); a reduce-scatter sends block q to rank q and
// folds the n copies of my block; a broadcast sends from the root.
//
// Operations are queued on their stream (emu_enqueue) and run when the host drains the queue, on the
// host's thread: the emulated device is not thread-safe, and neither is this.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "nccl.h"

extern "C" {
#include "common/log.h"
}

struct EmuNcclComm {
    int nranks, rank;
    char *segment;  // the pipes: shared memory, or private memory for one rank (its loopback pipe)
    size_t segment_bytes;
    bool shared;
};

namespace {

const size_t PIPE_BYTES = 1 << 16;
const double TIMEOUT_S = 120;

// One direction between two ranks: the writer owns `written`, the reader `read`; both only grow.
struct Pipe {
    std::atomic<uint64_t> written, read;
    char data[PIPE_BYTES];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "pipes need address-free atomics in shared memory");
struct SegmentHeader {
    std::atomic<int> joined;  // ranks that have mapped the segment
};

size_t header_bytes() { return (sizeof(SegmentHeader) + 63) / 64 * 64; }
SegmentHeader *header(EmuNcclComm *c) { return reinterpret_cast<SegmentHeader *>(c->segment); }
Pipe *pipe_between(EmuNcclComm *c, int from, int to) {
    return reinterpret_cast<Pipe *>(c->segment + header_bytes()) + (size_t)from * c->nranks + to;
}

size_t type_bytes(ncclDataType_t t) { return t == ncclUint8 ? 1 : t == ncclFloat64 ? 8 : 4; }

// Waiting for a peer: yield the core at first (ranks outnumber cores in the tests), then sleep
// between looks; after TIMEOUT_S the run ends, naming what waited.
struct Patience {
    long long start = now_ns();
    long long looks = 0;
    void wait(const EmuNcclComm *c, const char *what) {
        if (now_ns() - start > (long long)(TIMEOUT_S * 1e9))
            fatal("emulated NCCL: %s on rank %d of %d waited %g s for its peers (one never came, or started "
                  "another operation)",
                  what, c->rank, c->nranks, TIMEOUT_S);
        if (looks++ < 1000) sched_yield();
        else {
            struct timespec pause = {0, 20000};
            nanosleep(&pause, nullptr);
        }
    }
};

struct Transfer {
    bool send;
    int peer;
    char *buf;
    size_t bytes, done;
};

// Moves what the pipe allows now; true if anything moved.
bool advance(EmuNcclComm *c, Transfer &t) {
    Pipe *p = t.send ? pipe_between(c, c->rank, t.peer) : pipe_between(c, t.peer, c->rank);
    uint64_t written = p->written.load(std::memory_order_acquire), read = p->read.load(std::memory_order_acquire);
    uint64_t position = t.send ? written : read;
    size_t room = t.send ? PIPE_BYTES - (size_t)(written - read) : (size_t)(written - read);
    size_t n = std::min(room, t.bytes - t.done);
    for (size_t moved = 0; moved < n;) {  // at most two pieces: the ring wraps around
        size_t at = (size_t)((position + moved) % PIPE_BYTES), piece = std::min(n - moved, PIPE_BYTES - at);
        if (t.send) std::memcpy(p->data + at, t.buf + t.done + moved, piece);
        else std::memcpy(t.buf + t.done + moved, p->data + at, piece);
        moved += piece;
    }
    t.done += n;
    (t.send ? p->written : p->read).store(position + n, std::memory_order_release);
    return n > 0;
}

// Runs every transfer to completion, all advancing together. Transfers on the same pipe go in list
// order (a pipe is one byte stream); the others do not wait for each other.
void run_transfers(EmuNcclComm *c, std::vector<Transfer> &transfers, const char *what) {
    Patience patience;
    std::vector<char> busy(2 * (size_t)c->nranks);  // [peer * 2 + send]: an earlier transfer is unfinished
    for (;;) {
        std::fill(busy.begin(), busy.end(), 0);
        bool all_done = true, moved = false;
        for (Transfer &t : transfers) {
            if (t.done == t.bytes) continue;
            char &pipe_busy = busy[(size_t)t.peer * 2 + t.send];
            if (!pipe_busy) moved |= advance(c, t);
            if (t.done < t.bytes) pipe_busy = 1, all_done = false;
        }
        if (all_done) return;
        if (!moved) patience.wait(c, what);
    }
}

// ---- reductions, in rank order ------------------------------------------------------------------

// out[i] = copies[0][i] (op) copies[1][i] (op) ... (op) copies[n-1][i], copy r at copies + r * count.
template <typename T> void fold(T *out, const T *copies, int n, size_t count, ncclRedOp_t op) {
    for (size_t i = 0; i < count; i++) {
        T acc = copies[i];
        for (int r = 1; r < n; r++) {
            T x = copies[(size_t)r * count + i];
            if (op == ncclMax) {
                if constexpr (std::is_floating_point<T>::value) acc = x > acc || std::isnan(x) ? x : acc;
                else acc = x > acc ? x : acc;
            } else if constexpr (std::is_same<T, int32_t>::value) {
                acc = (int32_t)((uint32_t)acc + (uint32_t)x);  // wraps, as comm.c's
            } else {
                acc = acc + x;
            }
        }
        if constexpr (std::is_floating_point<T>::value)
            if (op == ncclAvg) acc /= (T)n;
        out[i] = acc;
    }
}

void fold_bytes(void *out, const std::vector<char> &copies, int n, size_t count, ncclDataType_t t, ncclRedOp_t op) {
    switch (t) {
    case ncclFloat32: fold((float *)out, (const float *)copies.data(), n, count, op); return;
    case ncclFloat64: fold((double *)out, (const double *)copies.data(), n, count, op); return;
    case ncclInt32: fold((int32_t *)out, (const int32_t *)copies.data(), n, count, op); return;
    case ncclUint8: break;
    }
    fatal("emulated NCCL: bytes cannot be reduced");
}

// ---- the operations, as the queue runs them ------------------------------------------------------

void all_gather(EmuNcclComm *c, const char *send, char *recv, size_t bytes) {
    std::memmove(recv + (size_t)c->rank * bytes, send, bytes);
    std::vector<Transfer> ts;
    for (int q = 0; q < c->nranks; q++)
        if (q != c->rank) {
            ts.push_back({true, q, const_cast<char *>(send), bytes, 0});
            ts.push_back({false, q, recv + (size_t)q * bytes, bytes, 0});
        }
    run_transfers(c, ts, "all-gather");
}

// blocks: every rank sends its block q to rank q (all_reduce: the whole buffer to everybody).
void reduce(EmuNcclComm *c, const char *send, char *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
            bool scatter) {
    size_t bytes = count * type_bytes(t);
    std::vector<char> copies((size_t)c->nranks * bytes);  // copy r: rank r's contribution
    auto block_for = [&](int q) { return send + (scatter ? (size_t)q * bytes : 0); };
    std::memcpy(copies.data() + (size_t)c->rank * bytes, block_for(c->rank), bytes);
    std::vector<Transfer> ts;
    for (int q = 0; q < c->nranks; q++)
        if (q != c->rank) {
            ts.push_back({true, q, const_cast<char *>(block_for(q)), bytes, 0});
            ts.push_back({false, q, copies.data() + (size_t)q * bytes, bytes, 0});
        }
    run_transfers(c, ts, scatter ? "reduce-scatter" : "all-reduce");
    fold_bytes(recv, copies, c->nranks, count, t, op);
}

void broadcast(EmuNcclComm *c, const char *send, char *recv, size_t bytes, int root) {
    std::vector<Transfer> ts;
    if (c->rank == root) {
        if (send != recv) std::memmove(recv, send, bytes);
        for (int q = 0; q < c->nranks; q++)
            if (q != root) ts.push_back({true, q, recv, bytes, 0});
    } else {
        ts.push_back({false, root, recv, bytes, 0});
    }
    run_transfers(c, ts, "broadcast");
}

// ---- groups of point-to-point transfers ------------------------------------------------------------

int group_depth;
struct Pending {
    ncclComm_t comm;
    cudaStream_t stream;
    std::vector<Transfer> transfers;
};
std::vector<Pending> pending;  // collected since the outermost ncclGroupStart, per (comm, stream)

size_t total_bytes(const std::vector<Transfer> &ts) {
    size_t bytes = 0;
    for (const Transfer &t : ts) bytes += t.bytes;
    return bytes;
}

void queue_transfers(ncclComm_t comm, cudaStream_t s, std::vector<Transfer> ts) {
    emu_enqueue(s, emu_copy_duration(total_bytes(ts)), [comm, ts]() mutable { run_transfers(comm, ts, "send/recv"); });
}

ncclResult_t point_to_point(bool send, const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                            cudaStream_t s) {
    if (peer < 0 || peer >= comm->nranks) return ncclInvalidArgument;
    Transfer transfer{send, peer, (char *)const_cast<void *>(buf), count * type_bytes(t), 0};
    if (group_depth == 0) {
        queue_transfers(comm, s, {transfer});
        return ncclSuccess;
    }
    for (Pending &p : pending)
        if (p.comm == comm && p.stream == s) {
            p.transfers.push_back(transfer);
            return ncclSuccess;
        }
    pending.push_back({comm, s, {transfer}});
    return ncclSuccess;
}

unsigned ids_made;

}  // namespace

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "unhandled system error (emulated NCCL: shared memory)";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    }
    return "unknown error";
}

// A name for the communicator's shared-memory segment, unique on this machine.
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    std::memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "/llama-emu-nccl-%d-%u-%llx", (int)getpid(), ids_made++,
             (unsigned long long)now_ns());
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    EmuNcclComm *c = new EmuNcclComm{nranks, rank, nullptr, 0, nranks > 1};
    *comm = c;
    c->segment_bytes = header_bytes() + (size_t)nranks * nranks * sizeof(Pipe);
    if (!c->shared) {  // nobody to meet: sends to itself go through a private pipe
        c->segment = (char *)calloc(1, c->segment_bytes);
        return c->segment ? ncclSuccess : ncclSystemError;
    }
    int fd = shm_open(id.internal, O_CREAT | O_RDWR, 0600);  // whoever comes first creates it (zeroed)
    if (fd < 0) return ncclSystemError;
    bool sized = ftruncate(fd, (off_t)c->segment_bytes) == 0;  // the same size from every rank
    void *map = sized ? mmap(nullptr, c->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (map == MAP_FAILED) return ncclSystemError;
    c->segment = (char *)map;
    header(c)->joined.fetch_add(1);
    Patience patience;
    while (header(c)->joined.load() < nranks) patience.wait(c, "ncclCommInitRank");
    shm_unlink(id.internal);  // all have it mapped; the first unlink removes the name, the others fail
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm->shared) munmap(comm->segment, comm->segment_bytes);
    else free(comm->segment);
    delete comm;
    return ncclSuccess;
}

// Each operation is queued like a copy of its bytes, and reads its buffers when the queue runs it.
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
    emu_enqueue(s, emu_copy_duration(count * type_bytes(t)), [=] {
        reduce(comm, (const char *)send, (char *)recv, count, t, op, false);
    });
    return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
    emu_enqueue(s, emu_copy_duration(count * type_bytes(t)), [=] {
        reduce(comm, (const char *)send, (char *)recv, count, t, op, true);
    });
    return ncclSuccess;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s) {
    emu_enqueue(s, emu_copy_duration(count * type_bytes(t)), [=] {
        all_gather(comm, (const char *)send, (char *)recv, count * type_bytes(t));
    });
    return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s) {
    if (root < 0 || root >= comm->nranks) return ncclInvalidArgument;
    emu_enqueue(s, emu_copy_duration(count * type_bytes(t)), [=] {
        broadcast(comm, (const char *)send, (char *)recv, count * type_bytes(t), root);
    });
    return ncclSuccess;
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
    return point_to_point(true, send, count, t, peer, comm, s);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
    return point_to_point(false, recv, count, t, peer, comm, s);
}

ncclResult_t ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return ncclInvalidUsage;
    if (--group_depth > 0) return ncclSuccess;
    for (Pending &p : pending) queue_transfers(p.comm, p.stream, std::move(p.transfers));
    pending.clear();
    return ncclSuccess;
}
