// fileio.h: whole-file reads and crash-safe writes.
// atomic_create() opens "<path>.tmp.<pid>"; atomic_commit() flushes, fsyncs and renames it onto
// path, so a reader (or a crash) only ever sees the old file or the complete new one.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef struct {
    FILE *fp;
    char path[4096];
    char tmp_path[4096];
} AtomicFile;

// Returns false (and fills err) if the temporary file cannot be created.
bool atomic_create(AtomicFile *f, const char *path, char *err, size_t err_len);
// Returns false (and removes the temporary file) if any write, flush, sync or the rename failed.
bool atomic_commit(AtomicFile *f, char *err, size_t err_len);
void atomic_abort(AtomicFile *f);

// Reads a whole file into a malloc'd buffer. Returns NULL and fills err on failure.
unsigned char *read_whole_file(const char *path, size_t *size, char *err, size_t err_len);
