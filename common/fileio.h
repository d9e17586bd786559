// fileio.h: whole-file reads and crash-safe writes.
// atomic_create() opens "<path>.tmp.<pid>"; atomic_commit() flushes, fsyncs and renames it onto
// path, so a reader (or a crash) only ever sees the old file or the complete new one.
//
// Only regular files are ever replaced. An output path naming a device, a FIFO, a socket or a
// directory is refused: by fileio_check_output() before the run starts (exit 2), and again by
// atomic_create() as a last guard (a rename would turn /dev/null into a regular file). To discard
// an output, leave its flag out instead of pointing it at /dev/null.
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

// What an output flag names: a file written with atomic_create(), or a directory that the run
// creates if needed (one level, as mkdir does) and fills with files.
typedef enum { OUTPUT_FILE, OUTPUT_DIR } OutputKind;

// Checks, before any work, that the output `path` given to --flag can be written: not empty, every
// name within NAME_MAX (the temporary "<name>.tmp.<pid>" too), the parent an existing directory,
// an existing target of the right kind (a regular file, or a directory), and the directory really
// takes a new file: a probe temporary is created and removed (a missing directory is created, as
// the run would create it next, and kept). Exits with status 2 and one line naming the flag and
// the reason otherwise.
void fileio_check_output(const char *flag, const char *path, OutputKind kind);

// Reads a whole file into a malloc'd buffer. Returns NULL and fills err on failure.
unsigned char *read_whole_file(const char *path, size_t *size, char *err, size_t err_len);
