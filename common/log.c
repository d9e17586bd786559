#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *program_name = "llama";
static int log_rank = -1;  // -1: not set yet, look at the launcher's environment

static bool exiting_on_error;  // set by the fatal functions below: their status and message stand
static int stdout_errno;        // why log_info's first failed write failed

// A report written to a full disk or a closed file would otherwise be lost with exit status 0: at
// exit, standard output's last buffer is flushed and any failed write turns the status into 1.
static void check_stdout_at_exit(void) {
    if (exiting_on_error) return;
    int failed = fflush(stdout) != 0 ? errno : stdout_errno;
    if (!failed && !ferror(stdout)) return;
    fprintf(stderr, "%s: standard output: write error (%s)\n", program_name,
            failed ? strerror(failed) : "a write failed");
    _exit(1);
}

void log_set_program(const char *name) {
    static bool registered;
    program_name = name;
    if (!registered) atexit(check_stdout_at_exit);
    registered = true;
}
void log_set_rank(int rank) { log_rank = rank; }

static int current_rank(void) {
    if (log_rank >= 0) return log_rank;
    const char *env = getenv("OMPI_COMM_WORLD_RANK");
    return env ? atoi(env) : 0;
}

// One line, whatever the message quotes: a newline or another control character in a user's input
// (--data "text:a<newline>b") is written as \n, \t or \xNN.
static void vprint_line(const char *fmt, va_list ap) {
    char message[8192];
    vsnprintf(message, sizeof message, fmt, ap);
    if (current_rank() > 0) fprintf(stderr, "%s [rank %d]: ", program_name, current_rank());
    else fprintf(stderr, "%s: ", program_name);
    for (const unsigned char *c = (const unsigned char *)message; *c; c++) {
        if (*c == '\n') fputs("\\n", stderr);
        else if (*c == '\t') fputs("\\t", stderr);
        else if (*c < 0x20 || *c == 0x7f) fprintf(stderr, "\\x%02x", *c);
        else fputc(*c, stderr);
    }
    fputc('\n', stderr);
}

void fatal_input(const char *fmt, ...) {
    exiting_on_error = true;
    if (current_rank() > 0) {  // rank 0 says it once; give it time to, before mpirun ends the job
        sleep(1);
        exit(EXIT_BAD_INPUT);
    }
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    exit(EXIT_BAD_INPUT);
}

// A check only this rank makes (it holds the data: a slice of a checkpoint it reads, its own file):
// no other rank will say it, so this one does, with "[rank r]" as vprint_line adds above rank 0.
void fatal_input_local(const char *fmt, ...) {
    exiting_on_error = true;
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    fflush(stderr);
    exit(EXIT_BAD_INPUT);
}

void fatal(const char *fmt, ...) {
    exiting_on_error = true;
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    exit(1);
}

void lab_hole(const char *lab, const char *hint, const char *file, int line) {
    exiting_on_error = true;
    fprintf(stderr, "lab %s: %s:%d is yours to write: %s\n", lab, file, line, hint);
    exit(3);
}

void log_info(const char *fmt, ...) {
    if (current_rank() > 0) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    if (fflush(stdout) != 0 && !stdout_errno) stdout_errno = errno;
}

long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
