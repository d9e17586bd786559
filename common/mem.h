// mem.h: every large buffer is allocated through here, tagged with what it holds, so a run can
// report its memory by category (current and peak) and draw it as counter tracks in the trace.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef enum {
    MEM_PARAMS,       // model weights (fp32 master copy on CPU)
    MEM_GRADS,        // parameter gradients
    MEM_OPTIMIZER,    // AdamW first and second moments
    MEM_ACTIVATIONS,  // forward activations kept for backward, and backward scratch
    MEM_COMM,         // communication buffers (later chapters)
    MEM_OTHER,        // data batches, logits scratch, everything else
    MEM_N_CATEGORIES
} MemCategory;

// Zero-initialised, 64-byte aligned. Exits with an error if the allocation fails.
void *mem_alloc(MemCategory category, size_t bytes);
void mem_free(void *ptr);  // NULL is fine

size_t mem_current(MemCategory category);
size_t mem_peak(MemCategory category);
size_t mem_current_total(void);
size_t mem_peak_total(void);  // peak of the sum, not the sum of peaks
const char *mem_category_name(MemCategory category);

// The books of one kind of memory: what its blocks hold by category, now and at the peak. mem_alloc
// keeps the host's; gpu/memstats.c keeps the device's with the same function.
typedef struct {
    size_t current[MEM_N_CATEGORIES], peak[MEM_N_CATEGORIES];
    size_t current_total, peak_total;  // the peak of the sum, not the sum of the peaks
} MemLedger;
void mem_ledger_account(MemLedger *ledger, MemCategory category, size_t bytes, int sign);  // sign: +1 or -1

// Called after every change with the category and its new current size (the trace installs one).
typedef void (*MemObserver)(MemCategory category, size_t current_bytes);
void mem_set_observer(MemObserver observer);

// Prints one line per category: current and peak, in MiB.
void mem_print_report(void);

// ---- planning, before anything is allocated ------------------------------------------------------
// Sizes planned from flags are products of user-given numbers (--batch x --seq-len x vocab ...), so
// they are computed in 64 bits with these saturating forms: a product that does not fit becomes
// UINT64_MAX, which no machine has, instead of wrapping to a small number that would pass a check.
static inline uint64_t mem_mul(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
static inline uint64_t mem_add(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

// The machine's physical memory: sysconf(_SC_PHYS_PAGES) x the page size. Physical, not
// MemAvailable: the check below refuses only what can never fit, whatever else is running.
uint64_t mem_machine_bytes(void);
// The processes of this job on this machine, as mpirun tells them before MPI starts
// (OMPI_COMM_WORLD_LOCAL_SIZE), 1 outside mpirun.
int mem_local_processes(void);
// Exits with status 2 and one line naming the figures when local_processes x planned_bytes (what
// one process will allocate at least) exceeds the machine's memory. `what` names the config
// ("--model tiny --batch 8 --seq-len 32").
void mem_check_plan(const char *what, uint64_t planned_bytes, int local_processes);
