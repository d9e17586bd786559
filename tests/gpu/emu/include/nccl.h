// nccl.h, the emulator's: NCCL for a world of one rank on the emulated device (gpu/nccl.cu's calls,
// with their single-rank results: every collective leaves the data as it is, or copies it from send
// to recv). Several ranks need real NCCL and a GPU each; ncclCommInitRank refuses them here.
#pragma once
#include <cstring>

#include "cuda_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum { ncclSuccess = 0, ncclInvalidUsage = 5 } ncclResult_t;
typedef enum { ncclInt32 = 2, ncclUint8 = 1, ncclFloat32 = 7, ncclFloat64 = 8 } ncclDataType_t;
typedef enum { ncclSum = 0, ncclMax = 3, ncclAvg = 4 } ncclRedOp_t;
struct EmuNcclComm {
    int nranks;
};
typedef EmuNcclComm *ncclComm_t;

inline const char *ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess ? "no error" : "the emulated NCCL has one rank only";
}
inline ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    std::memset(id->internal, 0x5a, sizeof id->internal);
    return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId, int rank) {
    if (nranks != 1 || rank != 0) return ncclInvalidUsage;
    *comm = new EmuNcclComm{nranks};
    return ncclSuccess;
}
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    delete comm;
    return ncclSuccess;
}
inline size_t emu_nccl_size(ncclDataType_t t) { return t == ncclUint8 ? 1 : t == ncclFloat64 ? 8 : 4; }
// Queued on the NCCL stream like a real collective: it reads send when the stream gets to it.
inline ncclResult_t emu_nccl_copy(const void *send, void *recv, size_t count, ncclDataType_t t, cudaStream_t s) {
    size_t bytes = count * emu_nccl_size(t);
    emu_enqueue(s, emu_copy_duration(bytes), [=] {
        if (send != recv) std::memmove(recv, send, bytes);
    });
    return ncclSuccess;
}
inline ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t s) {
    return emu_nccl_copy(send, recv, count, t, s);
}
inline ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t,
                                      ncclComm_t, cudaStream_t s) {
    return emu_nccl_copy(send, recv, count, t, s);
}
inline ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t,
                                  cudaStream_t s) {
    return emu_nccl_copy(send, recv, count, t, s);
}
inline ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int, ncclComm_t,
                                  cudaStream_t s) {
    return emu_nccl_copy(send, recv, count, t, s);
}
