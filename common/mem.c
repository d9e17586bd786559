#include "mem.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>  // mallopt
#endif

#include "log.h"

// Each block carries a small header in front of the pointer handed out, so mem_free knows how
// many bytes to take off which counter. 64 bytes keeps the payload cache-line aligned.
typedef struct {
    size_t bytes;
    int category;
    uint32_t magic;
} BlockHeader;
#define HEADER_SIZE 64
#define BLOCK_MAGIC 0x4d454d21u

static MemLedger host;
static MemObserver observer;

static const char *category_names[MEM_N_CATEGORIES] = {
    "params", "grads", "optimizer", "activations", "comm", "other"};

const char *mem_category_name(MemCategory category) { return category_names[category]; }

void mem_set_observer(MemObserver fn) { observer = fn; }

void mem_ledger_account(MemLedger *ledger, MemCategory category, size_t bytes, int sign) {
    if (sign > 0) {
        ledger->current[category] += bytes;
        ledger->current_total += bytes;
    } else {
        ledger->current[category] -= bytes;
        ledger->current_total -= bytes;
    }
    if (ledger->current[category] > ledger->peak[category]) ledger->peak[category] = ledger->current[category];
    if (ledger->current_total > ledger->peak_total) ledger->peak_total = ledger->current_total;
}

static void account(MemCategory category, size_t bytes, int sign) {
    mem_ledger_account(&host, category, bytes, sign);
    if (observer) observer(category, host.current[category]);
}

// Freed memory stays with the process for the next allocation, as PyTorch's caching allocator keeps
// it: FSDP's gathered units and the pipeline's activations are allocated and freed every step, and
// glibc would otherwise hand each one back to the kernel (a fresh mmap, its pages faulted in and
// cleared again: 6-9% of a 2-rank ZeRO-3 or interleaved-1F1B step of `small`). The accounting
// above counts what the program holds, not what the process keeps.
static void keep_freed_memory(void) {
#ifdef __GLIBC__
    static bool done;
    if (done) return;
    done = true;
    mallopt(M_MMAP_THRESHOLD, 32 << 20);     // blocks under 32 MiB (glibc's largest setting) from the heap
    mallopt(M_TRIM_THRESHOLD, 1 << 30);      // and the heap's free top kept up to 1 GiB
#endif
}

void *mem_alloc(MemCategory category, size_t bytes) {
    void *raw = NULL;
    keep_freed_memory();
    if (bytes > SIZE_MAX - HEADER_SIZE)  // a size computed from a wrapped product: never "allocate" it
        fatal("mem_alloc: %zu bytes for %s is beyond any machine (a size overflowed)", bytes, category_names[category]);
    if (posix_memalign(&raw, 64, HEADER_SIZE + (bytes ? bytes : 1)) != 0)
        fatal("out of memory allocating %zu bytes for %s", bytes, category_names[category]);
    memset(raw, 0, HEADER_SIZE + bytes);
    BlockHeader *header = raw;
    header->bytes = bytes;
    header->category = category;
    header->magic = BLOCK_MAGIC;
    account(category, bytes, +1);
    return (char *)raw + HEADER_SIZE;
}

void mem_free(void *ptr) {
    if (!ptr) return;
    BlockHeader *header = (BlockHeader *)((char *)ptr - HEADER_SIZE);
    if (header->magic != BLOCK_MAGIC) fatal("mem_free: pointer %p was not allocated by mem_alloc", ptr);
    header->magic = 0;
    account(header->category, header->bytes, -1);
    free(header);
}

size_t mem_current(MemCategory category) { return host.current[category]; }
size_t mem_peak(MemCategory category) { return host.peak[category]; }
size_t mem_current_total(void) { return host.current_total; }
size_t mem_peak_total(void) { return host.peak_total; }

void mem_print_report(void) {
    const double mib = 1024.0 * 1024.0;
    log_info("memory by category (MiB):   current      peak");
    for (int c = 0; c < MEM_N_CATEGORIES; c++)
        log_info("  %-12s %20.2f %9.2f", category_names[c], host.current[c] / mib, host.peak[c] / mib);
    log_info("  %-12s %20.2f %9.2f", "total", host.current_total / mib, host.peak_total / mib);
}

uint64_t mem_machine_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page_size <= 0) return UINT64_MAX;  // unknown: refuse nothing
    return mem_mul((uint64_t)pages, (uint64_t)page_size);
}

int mem_local_processes(void) {
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");  // set by Open MPI's mpirun before main
    long n = local ? strtol(local, NULL, 10) : 1;
    return n >= 1 && n <= 1 << 20 ? (int)n : 1;
}

void mem_check_plan(const char *what, uint64_t planned_bytes, int local_processes) {
    uint64_t machine = mem_machine_bytes(), all = mem_mul(planned_bytes, (uint64_t)local_processes);
    if (all <= machine) return;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    if (all == UINT64_MAX)
        fatal_input("%s: the planned memory overflows 64 bits; this machine has %.1f GiB", what, machine / gib);
    if (local_processes > 1)
        fatal_input("%s: needs at least %.1f GiB per process, %.1f GiB for the %d processes on this machine, more than "
                    "its %.1f GiB of physical memory", what, planned_bytes / gib, all / gib, local_processes,
                    machine / gib);
    fatal_input("%s: needs at least %.1f GiB per process, more than this machine's %.1f GiB of physical memory",
                what, planned_bytes / gib, machine / gib);
}
