#include "log.h"

#include <stdarg.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static const char *program_name = "llama";
static int log_rank = -1;  // -1: not set yet, look at the launcher's environment

void log_set_program(const char *name) { program_name = name; }
void log_set_rank(int rank) { log_rank = rank; }

static int current_rank(void) {
    if (log_rank >= 0) return log_rank;
    const char *env = getenv("OMPI_COMM_WORLD_RANK");
    return env ? atoi(env) : 0;
}

static void vprint_line(const char *fmt, va_list ap) {
    if (current_rank() > 0) fprintf(stderr, "%s [rank %d]: ", program_name, current_rank());
    else fprintf(stderr, "%s: ", program_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

void fatal_input(const char *fmt, ...) {
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
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    fflush(stderr);
    exit(EXIT_BAD_INPUT);
}

void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    exit(1);
}

void lab_hole(const char *lab, const char *hint, const char *file, int line) {
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
    fflush(stdout);
}

long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
