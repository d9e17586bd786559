// mem.h: every large buffer is allocated through here, tagged with what it holds, so a run can
// report its memory by category (current and peak) and draw it as counter tracks in the trace.
#pragma once
#include <stddef.h>

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

// Called after every change with the category and its new current size (the trace installs one).
typedef void (*MemObserver)(MemCategory category, size_t current_bytes);
void mem_set_observer(MemObserver observer);

// Prints one line per category: current and peak, in MiB.
void mem_print_report(void);
