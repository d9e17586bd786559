// fileio.h: whole-file reads and crash-safe writes.
// atomic_create() opens "<path>.tmp.<pid>"; atomic_commit() flushes, fsyncs and renames it onto
// path, so a reader (or a crash) only ever sees the old file or the complete new one.
//
// Only regular files are ever replaced. An output path naming a device, a FIFO, a socket, a
// directory or a symbolic link is refused: by fileio_check_output() before the run starts (exit
// 2), and again by atomic_create() as a last guard (a rename would turn /dev/null into a regular
// file, and a link into a file of its own, its target untouched). To discard an output, leave its
// flag out instead of pointing it at /dev/null.
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
// takes a new file: a probe temporary is created and removed (for a missing directory, in its parent:
// the directory is not made here but by the run, once its inputs have passed). Exits with status 2 and one line naming the flag and
// the reason otherwise.
void fileio_check_output(const char *flag, const char *path, OutputKind kind);
// Its checks of the name alone (not empty, each part within NAME_MAX with room for the temporary's
// suffix, the whole within PATH_MAX), for a file in a directory the run has yet to make.
void fileio_check_output_name(const char *flag, const char *path, OutputKind kind);

// For an output directory the run fills with files named PREFIX*SUFFIX (checkpoints step_*): exits 2
// with one line, before the run, if such an entry exists and is not a regular file (the write would
// otherwise be refused only when it comes, after the work).
void fileio_check_dir_entries(const char *flag, const char *dir, const char *prefix, const char *suffix);

// Whether paths a and b name one file: the same device and inode when both exist (links
// followed), else the same resolved directory and last name (two outputs not written yet). For
// refusing, before the run, an output that is one of its inputs or another output.
bool fileio_same_file(const char *a, const char *b);

// fopen(path, "rb") of a regular file; anything else (a directory, a FIFO, a device) is refused at
// once, never waited on. NULL, with err filled, on failure.
FILE *fopen_regular(const char *path, char *err, size_t err_len);

// Reads a whole file into a malloc'd buffer. Returns NULL and fills err on failure.
unsigned char *read_whole_file(const char *path, size_t *size, char *err, size_t err_len);
