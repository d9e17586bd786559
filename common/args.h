// args.h: one table of flags drives both the parser and --help.
//
//   static ArgSpec flags[] = {
//       {"steps", ARG_INT, &opt.steps, "20", "optimizer steps to run", .min = 1},
//       {"model", ARG_CHOICE, &opt.model, "tiny", "model config", .choices = "tiny|small"},
//   };
//   args_parse(flags, n, argc, argv, "train", "trains a Llama 3 model");
//
// Flags are written --name VALUE or --name=VALUE; ARG_BOOL flags take no value. A bad flag or
// value exits with status 2 and one line naming the flag, its value and the rule it breaks. So do
// a flag given twice (rather than letting the last one win) and a number with blanks around it.
#pragma once
#include <stdbool.h>
#include <stddef.h>

typedef enum {
    ARG_INT,     // dest: int*
    ARG_LONG,    // dest: long long*
    ARG_DOUBLE,  // dest: double*
    ARG_STRING,  // dest: const char** (points into argv or the default; never freed)
    ARG_CHOICE,  // dest: const char**, value must be one of .choices ("a|b|c")
    ARG_BOOL,    // dest: bool*, set by the bare flag, default false
} ArgType;

typedef struct {
    const char *name;           // without the leading "--"
    ArgType type;
    void *dest;
    const char *default_value;  // parsed like a command-line value; NULL = leave dest untouched
    const char *help;
    const char *choices;        // ARG_CHOICE only
    double min, max;            // numeric flags: inclusive bounds, checked when min < max
    const char *value_name;     // shown in --help ("N", "FILE"); defaults from the type
} ArgSpec;

// Applies the defaults, then the command line. --help prints the table and exits 0.
void args_parse(const ArgSpec *specs, int n_specs, int argc, char **argv, const char *program,
                const char *description);
void args_print_help(const ArgSpec *specs, int n_specs, const char *program, const char *description);
// True when the flag was given on the command line (not just defaulted).
bool args_given(const ArgSpec *specs, int n_specs, const char *name);

// Position of value in "a|b|c" (0 for a), or -1: maps an ARG_CHOICE to an enum listed in that order.
int args_choice_index(const char *choices, const char *value);
// The reverse: the choice at position index of "a|b|c", copied into buf (len bytes); "?" if none.
const char *args_choice_name(const char *choices, int index, char *buf, size_t len);
