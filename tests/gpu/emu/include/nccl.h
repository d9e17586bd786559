// nccl.h, the emulator's: NCCL for ranks that are processes on this machine, on the emulated device
// (gpu/nccl.cu's calls). Every call is queued on its stream like a real one and runs when the host
// drains the queue (tests/gpu/emu/nccl.cpp); the data moves between the processes through shared
// memory, a byte pipe per ordered pair of ranks. Reductions fold in rank order, as common/comm.c's.
//
// Unlike real NCCL, several ranks may share the (one) emulated device. Like real NCCL, an operation
// waits for its peers; here it waits on the host thread that drains the queue, so every rank must
// reach a point that drains (a synchronisation, a blocking copy) before it waits for its peers in
// some other way, e.g. an MPI call. A peer that never comes ends the run after 120 s with a message.
#pragma once
#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum { ncclSuccess = 0, ncclSystemError = 2, ncclInvalidArgument = 4, ncclInvalidUsage = 5 } ncclResult_t;
typedef enum { ncclUint8 = 1, ncclInt32 = 2, ncclFloat32 = 7, ncclFloat64 = 8 } ncclDataType_t;  // NCCL's values
typedef enum { ncclSum = 0, ncclMax = 2, ncclAvg = 4 } ncclRedOp_t;
struct EmuNcclComm;
typedef EmuNcclComm *ncclComm_t;

const char *ncclGetErrorString(ncclResult_t r);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
// Collective: waits until all nranks ranks have joined (or fails after the timeout).
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s);
// Point to point: alone, or collected between ncclGroupStart and ncclGroupEnd and then queued as one
// operation per communicator that moves all of them together.
ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
