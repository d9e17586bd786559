#include "log.h"

#include <stdarg.h>
#include <stdlib.h>
#include <time.h>

static const char *program_name = "llama";

void log_set_program(const char *name) { program_name = name; }

static void vprint_line(const char *fmt, va_list ap) {
    fprintf(stderr, "%s: ", program_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

void fatal_input(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    exit(EXIT_BAD_INPUT);
}

void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprint_line(fmt, ap);
    va_end(ap);
    exit(1);
}

void log_info(const char *fmt, ...) {
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
