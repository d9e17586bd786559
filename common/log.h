// log.h: messages and the two ways a run can end early.
//   fatal_input(): bad flag, bad config, bad or corrupt file -> one line on stderr, exit status 2.
//   fatal_input_local(): the same, for a check that only this rank makes (it alone holds the data:
//                  its slice of a checkpoint, a file only it reads): printed by this rank, with
//                  "[rank r]" above rank 0, since no other rank will print it.
//   fatal():       an internal failure (out of memory, NaN loss, I/O error mid-run) -> exit status 1.
#pragma once
#include <stdio.h>

#define EXIT_BAD_INPUT 2

void fatal_input(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void fatal_input_local(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
// Labs (exercises/, generated from the chapters): the part a student has not written yet. Stops the
// run with status 3 and the hint, naming the file and line.
void lab_hole(const char *lab, const char *hint, const char *file, int line) __attribute__((noreturn));
#define LAB_HOLE(lab, hint) lab_hole(lab, hint, __FILE__, __LINE__)
void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// Program name printed in front of every message ("train: --tp 3: must divide ...").
void log_set_program(const char *name);
// Under mpirun every rank runs the same checks: only rank 0 prints log_info lines and
// fatal_input's one line (the others exit with the same status, silently; a check that only some
// ranks make must use fatal_input_local, or the job ends with status 2 and no message); fatal() messages carry
// "[rank r]" from every rank. Until this is called the rank is read from Open MPI's environment
// (OMPI_COMM_WORLD_RANK), so errors before the communicator exists are printed once too.
void log_set_rank(int rank);

// Monotonic wall clock in nanoseconds.
long long now_ns(void);
