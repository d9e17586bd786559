#include "args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#define MAX_SPECS 128
static bool given[MAX_SPECS];

int args_choice_index(const char *choices, const char *value) {
    size_t len = strlen(value);
    int index = 0;
    for (const char *p = choices; p && *p; index++) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncmp(p, value, n) == 0) return index;
        p = bar ? bar + 1 : NULL;
    }
    return -1;
}

const char *args_choice_name(const char *choices, int index, char *buf, size_t len) {
    snprintf(buf, len, "?");
    for (const char *p = choices; p && *p; index--) {
        const char *bar = strchr(p, '|');
        int n = bar ? (int)(bar - p) : (int)strlen(p);
        if (index == 0) {
            snprintf(buf, len, "%.*s", n, p);
            break;
        }
        p = bar ? bar + 1 : NULL;
    }
    return buf;
}

static bool choice_allowed(const char *choices, const char *value) { return args_choice_index(choices, value) >= 0; }

static void check_range(const ArgSpec *s, const char *text, double v) {
    if (s->min < s->max && (v < s->min || v > s->max)) {
        if (s->max >= 1e300)
            fatal_input("--%s %s: must be at least %g", s->name, text, s->min);
        fatal_input("--%s %s: must be between %g and %g", s->name, text, s->min, s->max);
    }
}

static void set_value(const ArgSpec *s, const char *text) {
    char *end = NULL;
    errno = 0;
    // strtoll and strtod skip leading blanks but stop at trailing ones: refuse both, so ' 2' and
    // '2 ' get the same answer (a quoting slip in a script, not a number)
    bool numeric = s->type == ARG_INT || s->type == ARG_LONG || s->type == ARG_DOUBLE;
    if (numeric && *text && (isspace((unsigned char)text[0]) || isspace((unsigned char)text[strlen(text) - 1])))
        fatal_input("--%s '%s': blanks around the number", s->name, text);
    switch (s->type) {
    case ARG_INT:
    case ARG_LONG: {
        long long v = strtoll(text, &end, 10);
        if (end == text || *end) fatal_input("--%s %s: not an integer", s->name, text);
        if (errno == ERANGE) fatal_input("--%s %s: out of range for a 64-bit integer", s->name, text);
        if (s->type == ARG_INT && (v < -2147483647LL || v > 2147483647LL))
            fatal_input("--%s %s: out of range for an int", s->name, text);
        check_range(s, text, (double)v);
        if (s->type == ARG_INT) *(int *)s->dest = (int)v;
        else *(long long *)s->dest = v;
        break;
    }
    case ARG_DOUBLE: {
        double v = strtod(text, &end);
        if (end == text || *end) fatal_input("--%s %s: not a number", s->name, text);
        if (!isfinite(v)) fatal_input("--%s %s: not a finite number", s->name, text);
        if (errno == ERANGE)  // a finite result with ERANGE: below the smallest double
            fatal_input("--%s %s: too small for a double (use 0, or a larger value)", s->name, text);
        check_range(s, text, v);
        *(double *)s->dest = v;
        break;
    }
    case ARG_CHOICE:
        if (!choice_allowed(s->choices, text)) fatal_input("--%s %s: must be one of %s", s->name, text, s->choices);
        *(const char **)s->dest = text;
        break;
    case ARG_STRING:
        *(const char **)s->dest = text;
        break;
    case ARG_BOOL:  // --flag alone, or --flag=true|1|false|0
        if (strcmp(text, "true") == 0 || strcmp(text, "1") == 0) *(bool *)s->dest = true;
        else if (strcmp(text, "false") == 0 || strcmp(text, "0") == 0) *(bool *)s->dest = false;
        else fatal_input("--%s=%s: a switch takes no value, or true|1|false|0", s->name, text);
        break;
    }
}

static const ArgSpec *find_spec(const ArgSpec *specs, int n, const char *name, size_t name_len) {
    for (int i = 0; i < n; i++)
        if (strlen(specs[i].name) == name_len && strncmp(specs[i].name, name, name_len) == 0) return &specs[i];
    return NULL;
}

void args_parse(const ArgSpec *specs, int n, int argc, char **argv, const char *program, const char *description) {
    if (n > MAX_SPECS) fatal("args_parse: more than %d flags", MAX_SPECS);
    log_set_program(program);
    for (int i = 0; i < n; i++) {
        given[i] = false;
        if (specs[i].type == ARG_BOOL) *(bool *)specs[i].dest = false;
        else if (specs[i].default_value) set_value(&specs[i], specs[i].default_value);
    }
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            args_print_help(specs, n, program, description);
            exit(0);
        }
        if (strncmp(arg, "--", 2) != 0) fatal_input("%s: unexpected argument (flags start with --; see --help)", arg);
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
        const ArgSpec *s = find_spec(specs, n, name, name_len);
        if (!s) fatal_input("%s: unknown flag (see --help)", arg);
        // the last one would win silently, and which of two values was meant is a guess
        if (given[s - specs]) fatal_input("--%s: given twice (give each flag once)", s->name);
        given[s - specs] = true;
        if (s->type == ARG_BOOL) {
            set_value(s, eq ? eq + 1 : "true");
            continue;
        }
        const char *value = eq ? eq + 1 : (a + 1 < argc ? argv[++a] : NULL);
        if (!value) fatal_input("--%s: needs a value", s->name);
        // `--dump --lr 1e-3` left --dump's value out: taking "--lr" as a file name would write it
        if (!eq && strncmp(value, "--", 2) == 0)
            fatal_input("--%s: needs a value, and the next argument %s is a flag (a value that starts with --: "
                        "--%s=VALUE)", s->name, value, s->name);
        set_value(s, value);
    }
}

bool args_given(const ArgSpec *specs, int n, const char *name) {
    const ArgSpec *s = find_spec(specs, n, name, strlen(name));
    return s && given[s - specs];
}

static const char *default_value_name(const ArgSpec *s) {
    if (s->value_name) return s->value_name;
    switch (s->type) {
    case ARG_INT:
    case ARG_LONG: return "N";
    case ARG_DOUBLE: return "X";
    case ARG_CHOICE: return s->choices;
    case ARG_STRING: return "STR";
    case ARG_BOOL: return "";
    }
    return "";
}

void args_print_help(const ArgSpec *specs, int n, const char *program, const char *description) {
    printf("usage: %s [flags]\n%s\n\nflags:\n", program, description);
    for (int i = 0; i < n; i++) {
        const ArgSpec *s = &specs[i];
        char left[128];
        snprintf(left, sizeof left, "--%s %s", s->name, default_value_name(s));
        printf("  %-34s %s", left, s->help);
        if (s->type != ARG_BOOL && s->default_value && *s->default_value) printf(" (default %s)", s->default_value);
        printf("\n");
    }
}
