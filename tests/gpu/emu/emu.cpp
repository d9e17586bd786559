// emu.cpp: runs gpu/*.cu's kernels on the CPU, so that the GPU tests (tests/gpu/test_gpu_*.c) run
// here against the same kernel source: the thread mapping, the barriers, the shared-memory layouts
// and every index computation execute; only the hardware is missing (no timing, no memory model
// beyond "barriers order everything", no warp-synchronous execution between __syncwarp calls).
//
// Threads are fibers on one OS thread: each is started once with ucontext and then switched to and
// from with _setjmp/_longjmp (no system call per switch), running one kernel thread after another
// for as long as the emulator lives. A block's fibers run one after another until each
// reaches a barrier or returns; the scheduler then releases every warp whose live lanes all wait at
// __syncwarp (shuffles are two of those), or the block once all its threads wait at __syncthreads,
// and runs the released fibers again, in a new pseudo-random order each time, sometimes letting one
// warp run far ahead of the others (run_block): a read that no barrier orders against its write
// sees different data under different orders. A state from which nothing can be released (a
// barrier only some threads reach, or reach after others returned) ends the run as a deadlock.
//
// Also here: the device runtime of gpu/runtime.h on host memory, and the matmuls of gpu/ops.h as
// reference_cpu's (cuBLASLt is not emulated; gpu/matmul_plan.h has its own host test).
#undef _FORTIFY_SOURCE  // its longjmp check rejects jumps between stacks, which is what fibers do
#include <setjmp.h>
#include <ucontext.h>

#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "gpu/fp8.h"
#include "gpu/internal.cuh"
#include "gpu/numerics.h"
#include "gpu/ops.h"

extern "C" {
#include "common/mem.h"
}

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace {

enum FiberState { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
struct Fiber {
    jmp_buf env;  // where the fiber continues
    std::vector<char> stack;
    FiberState state;
};
const size_t STACK_BYTES = 64 << 10;
const size_t DEFAULT_SMEM_LIMIT = 48 << 10, OPT_IN_SMEM_LIMIT = 232448;  // sm_90

std::vector<Fiber> fibers;
jmp_buf scheduler_env;
ucontext_t start_context, fiber_start_context;
unsigned current;
const std::function<void()> *kernel_body;
int or_accumulator, or_result;  // __syncthreads_or: OR of this barrier's predicates; the released result
std::vector<unsigned char> dynamic_smem;
unsigned char warp_slots[32][32][8];  // [warp][lane]: the shuffles' exchange
std::map<const void *, int> smem_opt_in;
// The scheduler's pseudo-random state. GPU_EMU_SEED (an unsigned integer) picks another sequence of
// orders, so that runs with different seeds explore different interleavings of the threads.
uint64_t order_state;
bool order_seeded;
uint64_t scheduler_seed() {
    const char *env = getenv("GPU_EMU_SEED");
    if (!env || !*env) return 0;
    char *end;
    unsigned long long seed = strtoull(env, &end, 10);
    if (*end) fatal_input("GPU_EMU_SEED=%s: expected an unsigned integer", env);
    return seed;
}

void set_thread_index(unsigned t) {
    threadIdx.x = t % blockDim.x;
    threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}

// Suspends the running fiber and continues the scheduler.
void yield_to_scheduler() {
    if (!_setjmp(fibers[current].env)) _longjmp(scheduler_env, 1);
}

// A fiber's whole life: park at once (so that the scheduler can start it with a jump), then run the
// current kernel's body for every thread the scheduler hands it, forever.
void fiber_main() {
    unsigned self = current;
    if (!_setjmp(fibers[self].env)) swapcontext(&fiber_start_context, &start_context);
    for (;;) {
        (*kernel_body)();
        fibers[current].state = DONE;
        yield_to_scheduler();
    }
}

void add_fibers(unsigned n) {
    while (fibers.size() < n) {
        fibers.emplace_back();
        fibers.back().stack.resize(STACK_BYTES);
        fibers.back().state = DONE;
        current = (unsigned)fibers.size() - 1;
        // No local lives across getcontext (a function that may return twice): fibers.back() again.
        getcontext(&fiber_start_context);
        fiber_start_context.uc_stack.ss_sp = fibers.back().stack.data();
        fiber_start_context.uc_stack.ss_size = fibers.back().stack.size();
        fiber_start_context.uc_link = NULL;  // fiber_main never returns
        makecontext(&fiber_start_context, fiber_main, 0);
        swapcontext(&start_context, &fiber_start_context);  // runs to its first park
    }
}

// Runs fiber t until it parks (at a barrier, or done with its thread). A function of its own, so that
// no local of the caller lives across the jump.
__attribute__((noinline)) void resume(unsigned t) {
    current = t;
    set_thread_index(t);
    if (!_setjmp(scheduler_env)) _longjmp(fibers[t].env, 1);
}

void wait_at(FiberState barrier) {
    fibers[current].state = barrier;
    yield_to_scheduler();  // the scheduler sets threadIdx before resuming
}

uint64_t next_random();
void shuffle(std::vector<unsigned> &order) {  // Fisher-Yates
    for (size_t i = order.size(); i > 1; i--) std::swap(order[i - 1], order[next_random() % i]);
}

uint64_t next_random() {
    if (!order_seeded) {
        order_state = 0x9e3779b97f4a7c15ull ^ (scheduler_seed() * 0xbf58476d1ce4e5b9ull);
        order_seeded = true;
    }
    order_state = order_state * 6364136223846793005ull + 1442695040888963407ull;
    return order_state >> 33;
}

// Releases warp w if all its lanes wait at a __syncwarp (a full-mask shuffle or __syncwarp that a
// lane misses because it returned is an error: it stays unreleased and ends as a deadlock).
bool release_warp(unsigned w, unsigned n_threads) {
    unsigned first = w * 32, end = std::min(n_threads, first + 32);
    for (unsigned t = first; t < end; t++)
        if (fibers[t].state != AT_WARP_BARRIER) return false;
    for (unsigned t = first; t < end; t++) fibers[t].state = RUNNABLE;
    return true;
}

// Releases the block if all its threads wait at __syncthreads. Strict, as CUDA's rule is: a barrier
// that some threads skip, even by returning, is an error here (hardware may or may not hang).
bool release_block(unsigned n_threads) {
    for (unsigned t = 0; t < n_threads; t++)
        if (fibers[t].state != AT_BLOCK_BARRIER) return false;
    for (unsigned t = 0; t < n_threads; t++) fibers[t].state = RUNNABLE;
    or_result = or_accumulator;
    or_accumulator = 0;
    return true;
}

// A block runs in rounds. Each round visits the warps in a random order and runs every runnable
// lane of a warp (in a random order) to its next barrier; in half the rounds (chosen at random) a
// warp whose lanes all reach a __syncwarp is released at once and keeps running, as far ahead of
// the other warps as the next __syncthreads lets it: a read that only a warp barrier separates from
// another warp's write then sees the wrong data. Between rounds the waiting warps and then the
// block are released.
void run_block(unsigned n_threads) {
    for (unsigned t = 0; t < n_threads; t++) fibers[t].state = RUNNABLE;
    std::fill(dynamic_smem.begin(), dynamic_smem.end(), 0xff);  // NaN: unwritten reads show
    or_accumulator = 0;
    unsigned n_warps = (n_threads + 31) / 32;
    std::vector<unsigned> warps(n_warps), lanes;
    std::iota(warps.begin(), warps.end(), 0u);
    for (;;) {
        bool run_ahead = next_random() & 1;
        shuffle(warps);
        for (unsigned w : warps) {
            do {
                lanes.clear();
                for (unsigned t = w * 32; t < std::min(n_threads, w * 32 + 32); t++) lanes.push_back(t);
                shuffle(lanes);
                for (unsigned t : lanes)
                    if (fibers[t].state == RUNNABLE) resume(t);
            } while (run_ahead && release_warp(w, n_threads));
        }
        bool all_done = true, released = false;
        for (unsigned t = 0; t < n_threads; t++) all_done = all_done && fibers[t].state == DONE;
        if (all_done) return;
        for (unsigned w = 0; w < n_warps; w++) released |= release_warp(w, n_threads);
        released |= release_block(n_threads);
        if (!released)
            fatal("emulator: deadlock in block (%u,%u,%u): some threads wait at a barrier the others never reach "
                  "(or have returned without)",
                  blockIdx.x, blockIdx.y, blockIdx.z);
    }
}

}  // namespace

void __syncthreads() { wait_at(AT_BLOCK_BARRIER); }
int __syncthreads_or(int predicate) {
    or_accumulator |= predicate != 0;
    wait_at(AT_BLOCK_BARRIER);
    return or_result;
}
int __syncthreads_and(int predicate) { return !__syncthreads_or(predicate == 0); }  // all true: none false
void __syncwarp(unsigned mask) {
    if (mask != 0xffffffffu) fatal("emulator: __syncwarp with a partial mask is not emulated");
    wait_at(AT_WARP_BARRIER);
}
void *emu_warp_exchange_slot(unsigned lane) {
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    return warp_slots[(t / 32) % 32][lane % 32];
}
void *emu_dynamic_smem() { return dynamic_smem.data(); }
void emu_set_max_dynamic_smem(const void *kernel, int bytes) { smem_opt_in[kernel] = bytes; }

void emu_launch(const void *kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, EmuStream *stream,
                const std::function<void()> &body) {
    unsigned n_threads = block.x * block.y * block.z;
    if (n_threads == 0 || n_threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
        grid.z > 65535)
        fatal("emulator: invalid launch: grid (%u,%u,%u), block (%u,%u,%u)", grid.x, grid.y, grid.z, block.x, block.y,
              block.z);
    auto opt_in = smem_opt_in.find(kernel);
    size_t limit = opt_in == smem_opt_in.end() ? DEFAULT_SMEM_LIMIT : (size_t)opt_in->second;
    if (dynamic_smem_bytes > limit || dynamic_smem_bytes > OPT_IN_SMEM_LIMIT)
        fatal("emulator: launch asks for %zu bytes of dynamic shared memory; the kernel may use %zu",
              dynamic_smem_bytes, std::min(limit, OPT_IN_SMEM_LIMIT));
    long long threads = (long long)grid.x * grid.y * grid.z * n_threads;
    emu_enqueue(stream, threads, [=] {
        fibers.reserve(1024);  // the fibers' jmp_bufs must not move: a vector that never reallocates
        add_fibers(n_threads);
        dynamic_smem.assign(dynamic_smem_bytes, 0xff);
        kernel_body = &body;
        gridDim = grid, blockDim = block;
        for (unsigned z = 0; z < grid.z; z++)
            for (unsigned y = 0; y < grid.y; y++)
                for (unsigned x = 0; x < grid.x; x++) {
                    blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
                    run_block(n_threads);
                }
    });
}

// ================================ streams, events, errors ========================================
// The queue of gpu_stream() and of every stream cudaStreamCreateWithFlags made: see cuda_runtime.h.
// Simulated time is in "thread steps": a kernel lasts as many as it has threads, a copy its
// bytes / 16 (memory moves far more bytes per step than a thread computes). The host clock
// advances one step per call that queues something, and jumps to the end of the queued work when
// the host synchronises.

struct EmuStream {
    long long free_at;  // simulated time the stream's last queued operation completes
};

namespace {
struct QueuedOp {
    long long done;       // simulated completion time
    unsigned long long seq;  // issue order: breaks ties
    std::function<void()> run;
};
EmuStream compute_stream;
std::vector<QueuedOp> queued;
unsigned long long issued;
long long host_clock;
cudaError_t sticky_error = cudaSuccess;
bool draining;
std::vector<cudaEvent_t> destroyed;  // freed once the queue has run their records

EmuStream *stream_or_compute(cudaStream_t s) { return s ? s : &compute_stream; }
}  // namespace

long long emu_copy_duration(size_t bytes) { return (long long)(bytes / 16) + 1; }

void emu_enqueue(cudaStream_t s, long long duration, std::function<void()> fn) {
    if (draining) fatal("emulator: work queued from inside queued work");
    EmuStream *stream = stream_or_compute(s);
    long long start = std::max(host_clock, stream->free_at);
    stream->free_at = start + duration;
    queued.push_back(QueuedOp{stream->free_at, issued++, std::move(fn)});
    host_clock++;
}

cudaError_t emu_drain() {
    std::stable_sort(queued.begin(), queued.end(), [](const QueuedOp &a, const QueuedOp &b) {
        return a.done != b.done ? a.done < b.done : a.seq < b.seq;
    });
    std::vector<QueuedOp> now;
    now.swap(queued);
    draining = true;
    for (QueuedOp &op : now) {
        op.run();
        host_clock = std::max(host_clock, op.done);
    }
    draining = false;
    for (cudaEvent_t e : destroyed) delete e;
    destroyed.clear();
    return sticky_error;
}

void __trap() { sticky_error = cudaErrorLaunchFailure; }
cudaError_t cudaGetLastError() { return cudaSuccess; }  // launches are checked in emu_launch
const char *cudaGetErrorString(cudaError_t err) {
    return err == cudaSuccess                ? "no error"
           : err == cudaErrorLaunchFailure ? "unspecified launch failure"
           : err == cudaErrorInvalidValue  ? "invalid argument"
                                           : "error";
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new EmuEvent{0, 0};
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    destroyed.push_back(e);  // its record may still be queued: CUDA allows that

    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    e->sim_done = stream_or_compute(s)->free_at;
    emu_enqueue(s, 0, [e] { e->ns = now_ns(); });
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return emu_drain(); }
cudaError_t cudaEventQuery(cudaEvent_t) { return emu_drain(); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->ns - start->ns) * 1e-6);
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = new EmuStream{host_clock};
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    cudaError_t err = emu_drain();
    delete s;
    return err;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return emu_drain(); }
cudaError_t cudaDeviceSynchronize(void) { return emu_drain(); }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    EmuStream *stream = stream_or_compute(s);
    stream->free_at = std::max(stream->free_at, e->sim_done);
    return cudaSuccess;
}

// ================================ gpu/runtime.h on host memory ===================================

// Host-side calls that wait for the device: a fault of the queued work surfaces here, named by the
// call that waited, as on a device without sync-debug mode.
static void synchronize(const char *where) {
    cudaError_t err = emu_drain();
    if (err != cudaSuccess) fatal("CUDA error at %s (emulated): %s", where, cudaGetErrorString(err));
}
// The waits a device makes too (a blocking copy, gpu_synchronize), counted as gpu/runtime.cu counts
// them for gpu_host_waits. The emulator's other synchronisations (gpu_free, gpu_scratch_free) stand
// for stream-ordered frees, which a device does not wait for.
static long long host_waits;
static void host_wait(const char *where) {
    host_waits++;
    synchronize(where);
}

extern "C" {
int gpu_device_count(char *why, size_t why_len) { return 1; }
static bool initialized;
// The matmuls are reference_cpu's plain loops (MATMUL_LOOP): each output element is summed in k
// order whatever the shape, so splitting a batch over ranks (DDP, FP8's amaxes) changes no bit and
// the emulated GPU's data-parallel runs can be compared with its single run at fp32 rounding.
// (OpenBLAS blocks a matmul by its shape: with its AVX-512 kernels a half batch rounds differently,
// bf16 storage turns that into a 2^-8 step now and then, and the comparison would measure OpenBLAS.)
void gpu_init(int device) {
    (void)gpu_attention_tile_rows();  // as the runtime's: a bad LLAMA_ATTN_TILE_ROWS stops here
    initialized = true;
    matmul_set_backend(MATMUL_LOOP);
}
void gpu_shutdown(void) {
    synchronize("gpu_shutdown");
    initialized = false;
}
bool gpu_initialized(void) { return initialized; }
void gpu_synchronize(void) { host_wait("gpu_synchronize"); }
long long gpu_host_waits(void) { return host_waits; }
void gpu_device_description(char *out, size_t out_len) {
    snprintf(out, out_len, "CPU emulation of gpu/*.cu (tests/gpu/emu); matmuls are reference_cpu's loops");
}
}  // extern "C"
// Device memory is host memory (common/mem.h's, so the host report shows it too), with the device's
// own per-category count kept apart from the host's (gpu/memstats.c, as for gpu/runtime.cu).
namespace {
std::map<void *, std::pair<MemCategory, size_t>> device_allocations;
// Every live piece of device memory, gpu_alloc's and the scratch's (base -> bytes): what
// gpu_is_device_pointer looks pointers up in.
std::map<const char *, size_t> device_ranges;
}  // namespace
extern "C" {
void *gpu_alloc(MemCategory category, size_t bytes) {
    void *ptr = mem_alloc(category, bytes);
    device_allocations[ptr] = {category, bytes};
    device_ranges[(const char *)ptr] = bytes;
    gpu_mem_account(category, bytes, +1);
    return ptr;
}
void gpu_free(void *ptr) {  // cudaFreeAsync: after the work queued before it (simplest: all of it)
    if (!ptr) return;
    synchronize("gpu_free");
    auto a = device_allocations.find(ptr);
    if (a == device_allocations.end()) fatal("gpu_free: %p was not allocated by gpu_alloc", ptr);
    gpu_mem_account(a->second.first, a->second.second, -1);
    device_allocations.erase(a);
    device_ranges.erase((const char *)ptr);
    mem_free(ptr);
}
void gpu_upload(void *device_dst, const void *host_src, size_t bytes) {
    host_wait("gpu_upload");
    memcpy(device_dst, host_src, bytes);
}
void gpu_download(void *host_dst, const void *device_src, size_t bytes) {
    host_wait("gpu_download");
    memcpy(host_dst, device_src, bytes);
}
// The host array is copied at once (the device's pinned staging), the copy to the device queued: it
// runs in stream order, after the work queued before it, and the host never waits (the emulator's
// staging is a fresh buffer per upload, so no slot is ever busy).
void gpu_upload_queued(void *device_dst, const void *host_src, size_t bytes) {
    auto staged = std::make_shared<std::vector<char>>((const char *)host_src, (const char *)host_src + bytes);
    emu_enqueue(nullptr, emu_copy_duration(bytes), [=] { memcpy(device_dst, staged->data(), bytes); });
}
void gpu_fill_bytes(void *device_dst, int byte, size_t bytes) {
    emu_enqueue(nullptr, emu_copy_duration(bytes), [=] { memset(device_dst, byte, bytes); });
}
// Queued like the device's copies: the bytes move when the queue reaches them.
void gpu_download_async(void *pinned_dst, const void *device_src, size_t bytes) {
    emu_enqueue(nullptr, emu_copy_duration(bytes), [=] { memcpy(pinned_dst, device_src, bytes); });
}
void gpu_upload_async(void *device_dst, const void *pinned_src, size_t bytes) {
    emu_enqueue(nullptr, emu_copy_duration(bytes), [=] { memcpy(device_dst, pinned_src, bytes); });
}
void *gpu_host_alloc(size_t bytes) {
    void *ptr = calloc(bytes ? bytes : 1, 1);
    if (!ptr) fatal("out of pinned host memory allocating %.2f MiB", bytes / 1048576.0);
    return ptr;
}
void gpu_host_free(void *ptr) {
    if (!ptr) return;
    synchronize("gpu_host_free");
    free(ptr);
}
// The emulated device's memory is host memory: device pointers are those inside the allocations.
bool gpu_is_device_pointer(const void *ptr) {
    const char *p = (const char *)ptr;
    auto after = device_ranges.upper_bound(p);  // the first allocation above p
    if (after == device_ranges.begin()) return false;
    auto a = std::prev(after);
    return p < a->first + std::max(a->second, (size_t)1);
}
void gpu_copy(void *device_dst, const void *device_src, size_t bytes) {
    emu_enqueue(nullptr, emu_copy_duration(bytes), [=] { memcpy(device_dst, device_src, bytes); });
}
// The emulated device has GPU_EMU_DEVICE_BYTES of memory (default 80 GiB, an H100's), less what
// the process has allocated in it.
void gpu_memory_info(size_t *free_bytes, size_t *total_bytes) {
    const char *env = getenv("GPU_EMU_DEVICE_BYTES");
    char *end = NULL;
    size_t total = env && *env ? strtoull(env, &end, 10) : (size_t)80 << 30;
    if (end && *end) fatal_input("GPU_EMU_DEVICE_BYTES=%s: expected a number of bytes", env);
    size_t used = gpu_mem_current_total();
    *total_bytes = total;
    *free_bytes = used < total ? total - used : 0;
}
void gpu_memory_report(void) { mem_print_report(); }
}

cudaStream_t gpu_stream(void) { return &compute_stream; }
void *gpu_scratch_alloc(size_t bytes) {
    void *ptr = mem_alloc(MEM_OTHER, bytes);
    device_ranges[(const char *)ptr] = bytes;
    return ptr;
}
void gpu_scratch_free(void *ptr) {
    synchronize("gpu_scratch_free");
    device_ranges.erase((const char *)ptr);
    mem_free(ptr);
}
void gpu_matmul_shutdown(void) {}

// ================================ matmuls: reference_cpu's ========================================

namespace {
std::vector<float> widen(const gpu_bf16 *x, size_t n) {
    std::vector<float> y(n);
    for (size_t i = 0; i < n; i++) y[i] = __bfloat162float(x[i]);
    return y;
}
void narrow(gpu_bf16 *out, const std::vector<float> &x) {
    for (size_t i = 0; i < x.size(); i++) out[i] = __float2bfloat16_rn(x[i]);
}

// Queued on the compute stream like the kernels (a matmul reads what the kernels before it wrote),
// lasting M N K / 64 steps.
long long matmul_duration(int M, int K, int N) { return (long long)M * N * K / 64 + 1; }
}  // namespace

extern "C" {
void gpu_matmul_forward(float *out, const float *inp, const float *weight, int M, int K, int N) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] { matmul_forward(out, inp, weight, M, K, N); });
}
void gpu_matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         int M, int K, int N) {
    emu_enqueue(nullptr, 2 * matmul_duration(M, K, N),
                [=] { matmul_backward(dinp, dweight, dout, inp, weight, M, K, N); });
}
void gpu_matmul_forward_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] {
        std::vector<float> x = widen(inp, (size_t)M * K), w = widen(weight, (size_t)N * K), y((size_t)M * N);
        matmul_forward(y.data(), x.data(), w.data(), M, K, N);
        narrow(out, y);
    });
}
// Overwriting dinp: zero it on the queue, then accumulate as above.
void gpu_matmul_backward_overwrite(float *dinp, float *dweight, const float *dout, const float *inp,
                                   const float *weight, int M, int K, int N) {
    gpu_fill_bytes(dinp, 0, sizeof(float) * M * K);
    gpu_matmul_backward(dinp, dweight, dout, inp, weight, M, K, N);
}
void gpu_matmul_backward_overwrite_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                                        const gpu_bf16 *weight, int M, int K, int N) {
    gpu_fill_bytes(dinp, 0, sizeof(gpu_bf16) * M * K);
    gpu_matmul_backward_bf16(dinp, dweight, dout, inp, weight, M, K, N);
}
void gpu_matmul_backward_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                              const gpu_bf16 *weight, int M, int K, int N) {
    emu_enqueue(nullptr, 2 * matmul_duration(M, K, N), [=] {
        std::vector<float> dy = widen(dout, (size_t)M * N), x = widen(inp, (size_t)M * K),
                           w = widen(weight, (size_t)N * K);
        std::vector<float> dx = dinp ? widen(dinp, (size_t)M * K) : std::vector<float>();
        matmul_backward(dinp ? dx.data() : NULL, dweight, dy.data(), x.data(), w.data(), M, K, N);
        if (dinp) narrow(dinp, dx);
    });
}

// Tensor parallelism's partial sums: bf16 operands, the fp32 products stored unrounded.
void gpu_matmul_forward_bf16_into_f32(float *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] {
        std::vector<float> x = widen(inp, (size_t)M * K), w = widen(weight, (size_t)N * K);
        matmul_forward(out, x.data(), w.data(), M, K, N);
    });
}
void gpu_matmul_backward_input_bf16_into_f32(float *dinp, const gpu_bf16 *dout, const gpu_bf16 *weight, int M, int K,
                                             int N, bool accumulate) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] {
        std::vector<float> dy = widen(dout, (size_t)M * N), w = widen(weight, (size_t)N * K);
        if (!accumulate) memset(dinp, 0, sizeof(float) * M * K);
        matmul_backward(dinp, NULL, dy.data(), NULL, w.data(), M, K, N);
    });
}

// The fused forms. out = residual + inp W^T: the product in fp32, then the residual added and the
// sum stored (one rounding in bf16), as cuBLASLt's epilogue computes alpha A B + beta C.
void gpu_matmul_forward_residual(float *out, const float *residual, const float *inp, const float *weight, int M,
                                 int K, int N) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] {
        std::vector<float> y((size_t)M * N);
        matmul_forward(y.data(), inp, weight, M, K, N);
        for (size_t i = 0; i < y.size(); i++) out[i] = residual[i] + y[i];
    });
}
void gpu_matmul_forward_residual_bf16(gpu_bf16 *out, const gpu_bf16 *residual, const gpu_bf16 *inp,
                                      const gpu_bf16 *weight, int M, int K, int N) {
    emu_enqueue(nullptr, matmul_duration(M, K, N), [=] {
        std::vector<float> x = widen(inp, (size_t)M * K), w = widen(weight, (size_t)N * K), y((size_t)M * N);
        std::vector<float> r = widen(residual, (size_t)M * N);
        matmul_forward(y.data(), x.data(), w.data(), M, K, N);
        for (size_t i = 0; i < y.size(); i++) y[i] = r[i] + y[i];
        narrow(out, y);
    });
}
// Strided batches: the products one after another, each at its strides, as one queued operation.
void gpu_matmul_forward_batched(float *out, const float *inp, const float *weight, int M, int K, int N, int batch,
                                long long out_stride, long long inp_stride, long long weight_stride) {
    emu_enqueue(nullptr, batch * matmul_duration(M, K, N), [=] {
        for (int b = 0; b < batch; b++)
            matmul_forward(out + b * out_stride, inp + b * inp_stride, weight + b * weight_stride, M, K, N);
    });
}
void gpu_matmul_forward_batched_bf16(gpu_bf16 *out, const gpu_bf16 *inp, const gpu_bf16 *weight, int M, int K, int N,
                                     int batch, long long out_stride, long long inp_stride, long long weight_stride) {
    emu_enqueue(nullptr, batch * matmul_duration(M, K, N), [=] {
        for (int b = 0; b < batch; b++) {
            std::vector<float> x = widen(inp + b * inp_stride, (size_t)M * K),
                               w = widen(weight + b * weight_stride, (size_t)N * K), y((size_t)M * N);
            matmul_forward(y.data(), x.data(), w.data(), M, K, N);
            narrow(out + b * out_stride, y);
        }
    });
}
void gpu_matmul_backward_weight_batched(float *dweight, const float *dout, const float *inp, int M, int K, int N,
                                        int batch, long long dweight_stride, long long dout_stride,
                                        long long inp_stride) {
    emu_enqueue(nullptr, batch * matmul_duration(M, K, N), [=] {
        for (int b = 0; b < batch; b++)
            matmul_backward(NULL, dweight + b * dweight_stride, dout + b * dout_stride, inp + b * inp_stride, NULL, M,
                            K, N);
    });
}
void gpu_matmul_backward_weight_batched_bf16(float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp, int M, int K,
                                             int N, int batch, long long dweight_stride, long long dout_stride,
                                             long long inp_stride) {
    emu_enqueue(nullptr, batch * matmul_duration(M, K, N), [=] {
        for (int b = 0; b < batch; b++) {
            std::vector<float> dy = widen(dout + b * dout_stride, (size_t)M * N),
                               x = widen(inp + b * inp_stride, (size_t)M * K);
            matmul_backward(NULL, dweight + b * dweight_stride, dy.data(), x.data(), NULL, M, K, N);
        }
    });
}

// The FP8 GEMM (gpu/fp8.h): the codes decoded (code / scale, the values chapter 9's emulation
// multiplies) and reference_cpu's fp32 matmul, out = a b^T; accumulate adds the product. The shape
// rule is enforced as on a device.
void gpu_fp8_gemm(float *out, const uint8_t *a, Fp8Format fa, const float *scale_a, const uint8_t *b, Fp8Format fb,
                  const float *scale_b, int rows_a, int rows_b, int K, bool accumulate, bool fast_accum) {
    const char *why = gpu_fp8_gemm_shape_error(rows_a, rows_b, K);
    if (why) fatal("gpu_fp8_gemm (%d, %d) x (%d, %d)^T: %s", rows_a, K, rows_b, K, why);
    if (fa == FP8_E5M2 && fb == FP8_E5M2) fatal("gpu_fp8_gemm: E5M2 x E5M2 has no Hopper kernel");
    emu_enqueue(nullptr, matmul_duration(rows_a, K, rows_b), [=] {
        std::vector<float> x((size_t)rows_a * K), w((size_t)rows_b * K), y((size_t)rows_a * rows_b);
        fp8_dequantize(x.data(), a, rows_a, K, FP8_PER_TENSOR, scale_a, fa);
        fp8_dequantize(w.data(), b, rows_b, K, FP8_PER_TENSOR, scale_b, fb);
        matmul_forward(y.data(), x.data(), w.data(), rows_a, K, rows_b);
        for (size_t i = 0; i < y.size(); i++) out[i] = accumulate ? out[i] + y[i] : y[i];
    });
}
}
