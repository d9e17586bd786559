// pp_schedule: prints a pipeline schedule's per-rank action lists, checks them, and gives their
// ideal bubble and the activations each rank holds; optionally writes the Graphviz diagram. No
// training, no MPI ranks: schedules are pure functions of (p, m, v).
//
//   ./build/pp_schedule --schedule 1F1B --pp 4 --microbatches 8
//   ./build/pp_schedule --schedule Interleaved1F1B --pp 4 --microbatches 8 --virtual-stages 2 --dot pp.dot
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>

#include "chapters/07_pipeline_parallel/schedule.h"
#include "common/args.h"
#include "common/fileio.h"
#include "common/log.h"

static struct {
    const char *schedule, *dot;
    int pp, microbatches, virtual_stages;
} opt;

static const ArgSpec FLAGS[] = {
    {"schedule", ARG_CHOICE, &opt.schedule, "1F1B", "pipeline schedule", .choices = PP_SCHEDULE_NAMES},
    {"pp", ARG_INT, &opt.pp, "4", "pipeline ranks p", .min = 1, .max = 4096},
    {"microbatches", ARG_INT, &opt.microbatches, "8", "micro-batches per step m", .min = 1, .max = 1 << 20},
    {"virtual-stages", ARG_INT, &opt.virtual_stages, "1", "stages per rank v (Interleaved1F1B)", .min = 1, .max = 1024},
    {"dot", ARG_STRING, &opt.dot, NULL, "write the schedule as a Graphviz diagram", .value_name = "FILE"},
};

#define PP_SCHEDULE_MAX_PAIRS (1 << 18)

int main(int argc, char **argv) {
    args_parse(FLAGS, (int)(sizeof FLAGS / sizeof FLAGS[0]), argc, argv, "pp_schedule",
               "Prints, checks and draws a pipeline schedule (chapter 7).");
    fileio_check_output("dot", opt.dot, OUTPUT_FILE);  // before anything is printed
    PpScheduleKind kind;
    pp_schedule_parse(opt.schedule, &kind);  // one of the choices: args_parse checked it
    int p = opt.pp, m = opt.microbatches, v = opt.virtual_stages;
    // Every compute step is printed, and the lists are checked by simulation: time and memory grow
    // with the (micro-batch, stage) pairs (16M ran for minutes, then out of memory), so a quarter of
    // a million is the most taken. The bubble formula needs neither.
    if ((uint64_t)p * m * v > PP_SCHEDULE_MAX_PAIRS)
        fatal_input("--pp %d x --microbatches %d x --virtual-stages %d = %" PRIu64 " (micro-batch, stage) pairs: more "
                    "than the %d this program prints and simulates", p, m, v, (uint64_t)p * m * v, PP_SCHEDULE_MAX_PAIRS);
    PpSchedule s;
    const char *err = pp_schedule_build(kind, p, m, v, &s);
    if (err) fatal_input("--schedule %s --pp %d --microbatches %d --virtual-stages %d: %s", opt.schedule, p, m, v, err);
    int *in_flight = calloc((size_t)p, sizeof(int));
    char problem[512];
    bool valid = pp_validate(&s, in_flight, problem, sizeof problem);
    size_t line_len = 64 * (size_t)(s.ranks[0].count + 1);
    char *line = malloc(line_len);
    for (int r = 0; r < p; r++) {
        pp_action_list_format(&s.ranks[r], line, line_len);
        printf("rank %d: %s\n", r, line);
    }
    if (!valid) fatal("the %s lists are not valid: %s", opt.schedule, problem);
    const char *note = pp_schedule_note(kind, v);
    if (note) printf("note: %s\n", note);
    printf("valid: every compute after its inputs, messages paired in order, no deadlock with batched transfers\n");
    printf("in flight (activations held, in (micro-batch, stage) pairs):");
    for (int r = 0; r < p; r++) printf(" rank %d: %d%s", r, in_flight[r], r + 1 < p ? "," : "\n");
    printf("ideal bubble (forward 1, backward 2): %.4f of the step; formula (p-1)/(v*m+p-1) = %.4f, "
           "i.e. (p-1)/(v*m) = %.4f of the useful time\n",
           pp_bubble_fraction(&s), (double)(p - 1) / (v * m + p - 1), (double)(p - 1) / (v * m));
    if (opt.dot) {
        pp_schedule_write_dot_file(&s, opt.dot);
        printf("Graphviz written to %s (dot -Tsvg %s -o schedule.svg)\n", opt.dot, opt.dot);
    }
    free(line);
    free(in_flight);
    pp_schedule_free(&s);
    return 0;
}
