// Tests for common/data.c: batches are pure functions of (source, seed, step, sequence), the
// Markov source has the entropy it claims, files round-trip, and every bad input exits with
// status 2 and a message that says what is wrong.
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/data.h"

#define MAX_B 16
#define MAX_T 1000

static int inputs[MAX_B * MAX_T], targets[MAX_B * MAX_T];

// ---- files under $TEST_TMP ---------------------------------------------------------------------

static const char *tmp_path(const char *name) {
    static char path[8][4096];  // a few may be in use at once
    static int next;
    char *out = path[next++ % 8];
    snprintf(out, sizeof path[0], "%s/%s", getenv("TEST_TMP"), name);
    return out;
}

static void write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *fp = fopen(path, "wb");
    ck_assert_msg(fp != NULL, "cannot create %s", path);
    ck_assert_uint_eq(fwrite(bytes, 1, n, fp), n);
    ck_assert_int_eq(fclose(fp), 0);
}

static void put_le(unsigned char *out, uint64_t value, int n) {
    for (int i = 0; i < n; i++) out[i] = (unsigned char)(value >> (8 * i));
}

// A token file with a chosen header (so tests can break each field) and n_written tokens.
static const char *write_token_file(const char *name, const char *magic, uint32_t width, uint32_t reserved,
                                    uint64_t count, const uint32_t *tokens, size_t n_written) {
    size_t size = 24 + n_written * width;
    unsigned char *blob = calloc(1, size);
    memcpy(blob, magic, 8);
    put_le(blob + 8, width, 4);
    put_le(blob + 12, reserved, 4);
    put_le(blob + 16, count, 8);
    for (size_t i = 0; i < n_written; i++) put_le(blob + 24 + i * width, tokens[i], (int)width);
    const char *path = tmp_path(name);
    write_bytes(path, blob, size);
    free(blob);
    return path;
}

static const char *good_token_file(const char *name, uint32_t width, const uint32_t *tokens, size_t n) {
    return write_token_file(name, "LLMTOK1", width, 0, n, tokens, n);
}

static const char *spec_for(const char *kind, const char *path) {
    static char spec[4][4200];
    static int next;
    char *out = spec[next++ % 4];
    snprintf(out, sizeof spec[0], "%s:%s", kind, path);
    return out;
}

// ---- purity ------------------------------------------------------------------------------------

// The batch at step 7 of 8 sequences, asked for whole and in slices, in a scrambled order with
// other steps in between, from a fresh source: every way must give the same tokens.
static void check_purity(const char *spec, int vocab, int seq_len, int T) {
    enum { B = 8 };
    static int full_in[B * MAX_T], full_tg[B * MAX_T], other[B * MAX_T];
    DataSource *src = data_open(spec, vocab, seq_len, 42);
    data_batch(src, 7, B, 0, B, T, full_in, full_tg);
    data_close(src);

    src = data_open(spec, vocab, seq_len, 42);
    const int slices[][2] = {{5, 3}, {0, 2}, {2, 3}};  // (first_seq, n_seqs), out of order
    for (int s = 0; s < 3; s++) {
        data_batch(src, 3, B, 0, B, T, other, targets);  // unrelated request in between
        int first = slices[s][0], n = slices[s][1];
        data_batch(src, 7, B, first, n, T, inputs, targets);
        ck_assert_msg(memcmp(inputs, full_in + first * T, (size_t)(n * T) * sizeof(int)) == 0,
                      "%s: slice %d+%d inputs differ from the full batch", spec, first, n);
        ck_assert_msg(memcmp(targets, full_tg + first * T, (size_t)(n * T) * sizeof(int)) == 0,
                      "%s: slice %d+%d targets differ from the full batch", spec, first, n);
    }
    data_batch(src, 8, B, 0, B, T, other, targets);
    ck_assert_msg(memcmp(other, full_in, (size_t)(B * T) * sizeof(int)) != 0, "%s: step 8 repeats step 7", spec);
    data_close(src);

    src = data_open(spec, vocab, seq_len, 43);
    data_batch(src, 7, B, 0, B, T, other, targets);
    ck_assert_msg(memcmp(other, full_in, (size_t)(B * T) * sizeof(int)) != 0, "%s: seed 43 repeats seed 42", spec);
    data_close(src);
}

static const char *counting_text_file(void) {
    static unsigned char text[5000];
    for (size_t i = 0; i < sizeof text; i++) text[i] = (unsigned char)(i % 251);
    const char *path = tmp_path("counting.txt");
    write_bytes(path, text, sizeof text);
    return path;
}

// Token i is i: a sequence then shows exactly where in the file it was read from.
static const char *counting_token_file(const char *name, size_t n) {
    uint32_t *tokens = malloc(n * sizeof *tokens);
    for (size_t i = 0; i < n; i++) tokens[i] = (uint32_t)i;
    const char *path = good_token_file(name, 4, tokens, n);
    free(tokens);
    return path;
}

START_TEST(test_purity_every_source) {
    check_purity("markov", 256, 64, 64);
    check_purity("markov:order=3,branches=5,table=7", 100, 64, 48);
    check_purity(spec_for("text", counting_text_file()), 256, 64, 64);
    check_purity(spec_for("tokens", counting_token_file("count.tok", 70000)), 70000, 64, 64);
}
END_TEST

// targets are the inputs shifted by one, and a shorter T gives a prefix of the longer sequence
// (so the last target really is the token after the last input).
START_TEST(test_targets_and_prefix) {
    const char *specs[] = {"markov:order=2", spec_for("tokens", counting_token_file("prefix.tok", 3000))};
    for (int s = 0; s < 2; s++) {
        enum { B = 4, T = 32 };
        static int long_in[B * (T + 1)], long_tg[B * (T + 1)];
        DataSource *src = data_open(specs[s], 3000, T + 1, 5);
        data_batch(src, 2, B, 0, B, T, inputs, targets);
        data_batch(src, 2, B, 0, B, T + 1, long_in, long_tg);
        for (int j = 0; j < B; j++) {
            for (int t = 0; t + 1 < T; t++) ck_assert_int_eq(targets[j * T + t], inputs[j * T + t + 1]);
            for (int t = 0; t < T; t++) ck_assert_int_eq(inputs[j * T + t], long_in[j * (T + 1) + t]);
            ck_assert_int_eq(targets[j * T + T - 1], long_in[j * (T + 1) + T]);
        }
        data_close(src);
    }
}
END_TEST

// ---- Markov statistics -------------------------------------------------------------------------

typedef struct {
    double entropy;         // plug-in conditional entropy of the next token, nats
    int well_visited;       // contexts seen at least min_visits times
    int min_successors;     // fewest distinct next tokens seen after a well-visited context
    int max_successors;     // most, over all contexts
    double rank_share[16];  // share of transitions to each context's r-th most frequent successor
    long long transitions;
} ChainStats;

static int compare_desc(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x < y) - (x > y);
}

// Counts next-token frequencies after every full context (the K inputs ending at position t)
// in steps batches of MAX_B sequences of MAX_T tokens, and summarises them.
static void count_transitions(const char *spec, int V, int K, int steps, int *counts, ChainStats *stats) {
    DataSource *src = data_open(spec, V, MAX_T, 1);
    for (int step = 0; step < steps; step++) {
        data_batch(src, step, MAX_B, 0, MAX_B, MAX_T, inputs, targets);
        for (int j = 0; j < MAX_B; j++) {
            for (int t = K - 1; t < MAX_T; t++) {
                int context = 0;
                for (int k = t - K + 1; k <= t; k++) context = context * V + inputs[j * MAX_T + k];
                counts[(size_t)context * V + targets[j * MAX_T + t]]++;
                stats->transitions++;
            }
        }
    }
    data_close(src);
}

// A context visited only a few times (say only as the random start of a sequence) need not
// show all its candidates, so the successor count is checked on contexts with >= min_visits.
static ChainStats measure_chain(const char *spec, int V, int K, int steps, int min_visits) {
    int n_contexts = 1;
    for (int k = 0; k < K; k++) n_contexts *= V;
    int *counts = calloc((size_t)n_contexts * V, sizeof(int));
    ChainStats stats = {.min_successors = V + 1};
    count_transitions(spec, V, K, steps, counts, &stats);
    for (int c = 0; c < n_contexts; c++) {
        int *row = counts + (size_t)c * V, total = 0, distinct = 0;
        qsort(row, (size_t)V, sizeof(int), compare_desc);
        for (int v = 0; v < V; v++) total += row[v], distinct += row[v] > 0;
        if (distinct > stats.max_successors) stats.max_successors = distinct;
        if (total >= min_visits) {
            stats.well_visited++;
            if (distinct < stats.min_successors) stats.min_successors = distinct;
        }
        for (int v = 0; v < distinct; v++) {
            stats.entropy -= (double)row[v] / (double)stats.transitions * log((double)row[v] / total);
            if (v < 16) stats.rank_share[v] += row[v];
        }
    }
    for (int r = 0; r < 16; r++) stats.rank_share[r] /= (double)stats.transitions;
    free(counts);
    return stats;
}

static double zipf_p(int i, int n) {
    double norm = 0.0;
    for (int j = 0; j < n; j++) norm += 1.0 / (j + 1);
    return 1.0 / (i + 1) / norm;
}

// Visits after which a candidate of probability p has been missed with chance below 1e-5.
static int visits_to_see(double p) { return (int)ceil(log(1e-5) / log1p(-p)); }

// 13 * 16 * 1000 = 208k transitions. The plug-in estimate is biased low by about (cells - contexts) / (2n)
// (Miller-Madow): 64 * 3 / 4e5 = 0.0005 for order 1, 256 * 2 / 4e5 = 0.0013 for order 2. Its
// spread is sqrt(Var[-ln p] / n) = sqrt(0.28 / 2e5) = 0.0012 nats. A tolerance of 0.01 nats is
// thus some 7 standard deviations beyond the bias, yet a chain whose candidates collided or whose
// p were off by a few percent would miss it.
static void check_chain_entropy(const char *spec, int V, int K, int N) {
    ChainStats stats = measure_chain(spec, V, K, 13, visits_to_see(zipf_p(N - 1, N)));
    double expected = 0.0;
    for (int i = 0; i < N; i++) expected -= zipf_p(i, N) * log(zipf_p(i, N));
    DataSource *src = data_open(spec, V, MAX_T, 1);
    ck_assert_double_eq_tol(data_entropy_floor(src), expected, 1e-12);
    data_close(src);
    ck_assert_msg(fabs(stats.entropy - expected) < 0.01, "%s: empirical entropy %.5f, H(p) = %.5f", spec,
                  stats.entropy, expected);
    // Every context leads to exactly N distinct tokens: the candidates never collide, and most
    // contexts are visited often enough (~800 to 3000 times) to show even the rarest.
    ck_assert_int_ge(stats.well_visited, V);
    ck_assert_int_eq(stats.min_successors, N);
    ck_assert_int_eq(stats.max_successors, N);
    for (int i = 0; i < N; i++)
        ck_assert_msg(fabs(stats.rank_share[i] - zipf_p(i, N)) < 0.01, "%s: rank %d share %.4f, p = %.4f", spec, i,
                      stats.rank_share[i], zipf_p(i, N));
}

START_TEST(test_markov_entropy_order1) { check_chain_entropy("markov:branches=4", 64, 1, 4); }
END_TEST

START_TEST(test_markov_entropy_order2) { check_chain_entropy("markov:order=2,branches=3,table=9", 16, 2, 3); }
END_TEST

// branches = vocab: every context's candidates are a full permutation of the vocabulary. Odd
// and tiny vocabularies exercise the cycle walking of the permutation.
START_TEST(test_markov_full_permutation) {
    const int vocabs[] = {2, 7, 37};
    for (int i = 0; i < 3; i++) {
        int V = vocabs[i];
        char spec[64];
        snprintf(spec, sizeof spec, "markov:branches=%d", V);
        ChainStats stats = measure_chain(spec, V, 1, 13, visits_to_see(zipf_p(V - 1, V)));
        ck_assert_msg(stats.well_visited >= V / 4, "V=%d: only %d contexts visited enough", V, stats.well_visited);
        ck_assert_msg(stats.min_successors == V && stats.max_successors == V, "V=%d: %d..%d successors", V,
                      stats.min_successors, stats.max_successors);
    }
}
END_TEST

START_TEST(test_markov_describe) {
    DataSource *src = data_open("markov", 256, 16, 0);
    ck_assert_ptr_nonnull(strstr(data_describe(src), "order 1, 4 branches"));
    ck_assert_double_eq_tol(data_entropy_floor(src), 1.242458, 1e-6);  // p = (12, 6, 4, 3) / 25
    ck_assert_double_eq_tol(data_mean_loss_floor(src, 16), 1.242458, 1e-6);  // order 1: the same
    data_close(src);
}
END_TEST

// DATA.md's mean over a sequence for order K: (K-1) uniform targets at ln V, the rest at H(p); its
// worked numbers (V = 256, T = 256, 4 branches: +0.017 for K = 2, +0.118 for K = 8), and a
// sequence shorter than the starting context (all uniform).
START_TEST(test_markov_mean_loss_floor) {
    const double H = 1.2424583, lnV = log(256.0);
    DataSource *k2 = data_open("markov:order=2", 256, 256, 0), *k8 = data_open("markov:order=8", 256, 256, 0);
    ck_assert_double_eq_tol(data_mean_loss_floor(k2, 256) - H, 0.017, 5e-4);
    ck_assert_double_eq_tol(data_mean_loss_floor(k8, 256) - H, 0.118, 5e-4);
    ck_assert_double_eq_tol(data_mean_loss_floor(k8, 16), (7 * lnV + 9 * H) / 16, 1e-6);
    ck_assert_double_eq_tol(data_mean_loss_floor(k8, 5), lnV, 1e-12);
    data_close(k2);
    data_close(k8);
}
END_TEST

// ---- files -------------------------------------------------------------------------------------

// A file of exactly T+1 tokens has one possible offset, so every sequence is the whole file.
START_TEST(test_text_round_trip) {
    const char text[] = "hello, world\n";
    const int T = (int)strlen(text) - 1;
    const char *path = tmp_path("hello.txt");
    write_bytes(path, text, strlen(text));
    DataSource *src = data_open(spec_for("text", path), 300, T, 9);
    ck_assert(isnan(data_entropy_floor(src)));
    ck_assert(isnan(data_mean_loss_floor(src, T)));
    ck_assert_ptr_nonnull(strstr(data_describe(src), "13 bytes"));
    data_batch(src, 4, 3, 0, 3, T, inputs, targets);
    for (int j = 0; j < 3; j++)
        for (int t = 0; t < T; t++) {
            ck_assert_int_eq(inputs[j * T + t], (unsigned char)text[t]);
            ck_assert_int_eq(targets[j * T + t], (unsigned char)text[t + 1]);
        }
    data_close(src);
}
END_TEST

START_TEST(test_tokens_round_trip) {
    const uint32_t tokens[] = {0, 65535, 7, 40000, 1, 2, 3, 65534};
    const int n = 8, T = n - 1;
    for (uint32_t width = 2; width <= 4; width += 2) {
        const char *spec = spec_for("tokens", good_token_file("exact.tok", width, tokens, n));
        DataSource *src = data_open(spec, 65536, T, 3);
        data_batch(src, 0, 2, 1, 1, T, inputs, targets);
        for (int t = 0; t < T; t++) {
            ck_assert_int_eq(inputs[t], (int)tokens[t]);
            ck_assert_int_eq(targets[t], (int)tokens[t + 1]);
        }
        data_close(src);
    }
}
END_TEST

// Offsets cover [0, n - (seq_len+1)], both ends included, and nothing beyond.
START_TEST(test_offset_range) {
    const int T = 10, n = T + 3;
    const char *spec = spec_for("tokens", counting_token_file("range.tok", (size_t)n));
    DataSource *src = data_open(spec, n, T, 11);
    int seen[3] = {0};
    for (int step = 0; step < 20; step++) {
        data_batch(src, step, MAX_B, 0, MAX_B, T, inputs, targets);
        for (int j = 0; j < MAX_B; j++) {
            int offset = inputs[j * T];
            ck_assert_int_ge(offset, 0);
            ck_assert_int_le(offset, 2);
            seen[offset]++;
            for (int t = 0; t < T; t++) ck_assert_int_eq(inputs[j * T + t], offset + t);
        }
    }
    ck_assert(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    data_close(src);
}
END_TEST

// ---- bad input ---------------------------------------------------------------------------------

// Runs data_open in a child and checks that it exits with status 2 and says `needle` on stderr.
static void expect_bad_input(const char *spec, int vocab, int seq_len, const char *needle) {
    int pipe_fds[2];
    ck_assert_int_eq(pipe(pipe_fds), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
        dup2(pipe_fds[1], STDERR_FILENO);
        close(pipe_fds[0]);
        data_close(data_open(spec, vocab, seq_len, 0));
        _exit(0);
    }
    close(pipe_fds[1]);
    char message[8192] = {0};
    size_t used = 0;
    ssize_t got;
    while (used + 1 < sizeof message && (got = read(pipe_fds[0], message + used, sizeof message - 1 - used)) > 0)
        used += (size_t)got;
    close(pipe_fds[0]);
    int status = 0;
    ck_assert_int_eq(waitpid(child, &status, 0), child);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 2, "'%s': expected exit status 2, got %d (%s)", spec,
                  WIFEXITED(status) ? WEXITSTATUS(status) : -1, message);
    ck_assert_msg(strstr(message, needle) != NULL, "'%s': message '%s' lacks '%s'", spec, message, needle);
    ck_assert_msg(strchr(message, '\n') == message + used - 1, "'%s': not one line: '%s'", spec, message);
}

START_TEST(test_bad_specs) {
    expect_bad_input("nonsense", 256, 16, "unknown (expected markov");
    expect_bad_input("markovian", 256, 16, "unknown (expected markov");
    expect_bad_input("", 256, 16, "unknown");
    expect_bad_input("markov:order=2,", 256, 16, "an empty option (a stray comma)");
    expect_bad_input("markov:,order=2", 256, 16, "an empty option (a stray comma)");
    expect_bad_input("markov:order=2,,branches=3", 256, 16, "an empty option (a stray comma)");
    expect_bad_input("markov:order=0", 256, 16, "order=0: must be in 1..8");
    expect_bad_input("markov:order=9", 256, 16, "order=9: must be in 1..8");
    expect_bad_input("markov:order=x", 256, 16, "order=x: not a non-negative integer");
    expect_bad_input("markov:order=-1", 256, 16, "order=-1: not a non-negative integer");
    expect_bad_input("markov:order=2x", 256, 16, "order=2x: not a non-negative integer");
    expect_bad_input("markov:branches=0", 256, 16, "branches=0: must be in 1..");
    expect_bad_input("markov:branches=300", 256, 16, "branches=300: must be in 1..256");
    expect_bad_input("markov:depth=2", 256, 16, "unknown option 'depth'");
    expect_bad_input("markov:order", 256, 16, "option 'order' is not key=value");
    expect_bad_input("markov:table=99999999999999999999999", 256, 16, "not a non-negative integer");
    expect_bad_input("markov", 1, 16, "vocab_size 1: needs at least 2");
    expect_bad_input("markov", 256, 0, "seq_len 0: must be at least 1");
}
END_TEST

START_TEST(test_bad_text_files) {
    const char *short_path = tmp_path("short.txt");
    write_bytes(short_path, "abcdef", 6);
    expect_bad_input("text:", 256, 16, "no file named");
    expect_bad_input("text:/nonexistent/dir/file.txt", 256, 16, "/nonexistent/dir/file.txt: cannot open");
    expect_bad_input(spec_for("text", short_path), 128, 4, "vocab_size 128: text is bytes and needs at least 256");
    expect_bad_input(spec_for("text", short_path), 256, 6, "6 bytes, fewer than seq_len+1 = 7");
}
END_TEST

START_TEST(test_bad_token_files) {
    uint32_t tokens[100];
    for (int i = 0; i < 100; i++) tokens[i] = (uint32_t)i % 50;
    tokens[7] = 50;
    const char *good = "LLMTOK1";
    write_bytes(tmp_path("tiny.tok"), "LLMTOK1", 8);
    expect_bad_input(spec_for("tokens", tmp_path("missing.tok")), 256, 16, "missing.tok: cannot open");
    expect_bad_input(spec_for("tokens", tmp_path("tiny.tok")), 256, 16,
                     "truncated: 8 bytes, shorter than the 24-byte header");
    expect_bad_input(spec_for("tokens", write_token_file("magic.tok", "LLMTOK2", 2, 0, 10, tokens, 10)), 256, 4,
                     "not a token file");
    expect_bad_input(spec_for("tokens", write_token_file("width.tok", good, 3, 0, 10, tokens, 10)), 256, 4,
                     "bytes per token is 3, must be 2 or 4");
    expect_bad_input(spec_for("tokens", write_token_file("reserved.tok", good, 2, 1, 10, tokens, 10)), 256, 4,
                     "reserved header field is 1, must be 0");
    expect_bad_input(spec_for("tokens", write_token_file("truncated.tok", good, 2, 0, 100, tokens, 75)), 256, 4,
                     "truncated: header says 100 tokens x 2 bytes, so 224 bytes with the header; the file has 174");
    expect_bad_input(spec_for("tokens", write_token_file("trailing.tok", good, 4, 0, 10, tokens, 11)), 256, 4,
                     "trailing bytes: header says 10 tokens x 4 bytes, so 64 bytes");
    expect_bad_input(spec_for("tokens", write_token_file("huge.tok", good, 4, 0, UINT64_MAX / 2, tokens, 10)), 256,
                     4, "truncated: header says 9223372036854775807 tokens");
    expect_bad_input(spec_for("tokens", good_token_file("vocab.tok", 2, tokens, 100)), 50, 16,
                     "token 7 is 50, not below vocab_size 50");
    expect_bad_input(spec_for("tokens", good_token_file("short.tok", 2, tokens, 5)), 256, 5,
                     "5 tokens, fewer than seq_len+1 = 6");
}
END_TEST

// A caller asking for sequences outside the batch is a bug, not bad input: status 1.
START_TEST(test_batch_out_of_range) {
    DataSource *src = data_open("markov", 256, 8, 0);
    data_batch(src, 0, 4, 3, 2, 8, inputs, targets);
}
END_TEST

// ---- scripts/make_token_file.py ----------------------------------------------------------------

static const char *python_command(void) {
    const char *python = getenv("PYTHON");
    if (python && access(python, X_OK) == 0) return python;
    if (access("build/venv/bin/python", X_OK) == 0) return "build/venv/bin/python";
    return "python3";
}

static int run_writer(const char *arguments) {
    char command[8192 + 256];  // room for the interpreter around the arguments
    snprintf(command, sizeof command, "%s scripts/make_token_file.py %s >/dev/null 2>&1", python_command(), arguments);
    return system(command);
}

// What the script writes, the reader reads back unchanged; what it refuses, it refuses.
START_TEST(test_python_writer) {
    ck_assert_msg(access("scripts/make_token_file.py", R_OK) == 0, "run from the repository root");
    const int ids[] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5}, n = 11;
    const char *ids_path = tmp_path("ids.txt");
    write_bytes(ids_path, "3 1 4 1 5,9 2\n6 5 3 5\n", 22);
    const char *widths[] = {"", "--width 4"};
    for (int w = 0; w < 2; w++) {
        char arguments[8192];
        const char *out = tmp_path("py.tok");
        snprintf(arguments, sizeof arguments, "--ids %s --vocab-size 10 %s %s", ids_path, widths[w], out);
        ck_assert_msg(run_writer(arguments) == 0, "make_token_file.py %s failed", arguments);
        DataSource *src = data_open(spec_for("tokens", out), 10, n - 1, 0);
        data_batch(src, 0, 1, 0, 1, n - 1, inputs, targets);
        for (int t = 0; t < n - 1; t++) {
            ck_assert_int_eq(inputs[t], ids[t]);
            ck_assert_int_eq(targets[t], ids[t + 1]);
        }
        data_close(src);
    }
    char arguments[8192];
    snprintf(arguments, sizeof arguments, "--ids %s --vocab-size 9 %s", ids_path, tmp_path("refused.tok"));
    ck_assert_msg(run_writer(arguments) != 0, "an id >= --vocab-size was accepted");

    const char *text_path = tmp_path("py.txt"), *out = tmp_path("text.tok");
    write_bytes(text_path, "abc\xff", 4);
    snprintf(arguments, sizeof arguments, "--text %s %s", text_path, out);
    ck_assert_int_eq(run_writer(arguments), 0);
    DataSource *src = data_open(spec_for("tokens", out), 256, 3, 0);
    data_batch(src, 0, 1, 0, 1, 3, inputs, targets);
    ck_assert_int_eq(inputs[0], 'a');
    ck_assert_int_eq(targets[2], 0xff);
    data_close(src);
}
END_TEST

// ---- runner ------------------------------------------------------------------------------------

// Without $TEST_TMP (a manual run), a private directory in /tmp, emptied at the end.
static char *make_private_tmp(void) {
    if (getenv("TEST_TMP")) return NULL;
    static char dir[] = "/tmp/test_data.XXXXXX";
    if (!mkdtemp(dir)) return NULL;
    setenv("TEST_TMP", dir, 1);
    return dir;
}

static void remove_private_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char path[4096];
    for (struct dirent *entry; (entry = readdir(d));) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, entry->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

int main(void) {
    char *private_tmp = make_private_tmp();
    Suite *suite = suite_create("data");
    TCase *purity = tcase_create("purity");
    tcase_add_test(purity, test_purity_every_source);
    tcase_add_test(purity, test_targets_and_prefix);
    tcase_add_exit_test(purity, test_batch_out_of_range, 1);
    suite_add_tcase(suite, purity);
    TCase *markov = tcase_create("markov");
    tcase_add_test(markov, test_markov_entropy_order1);
    tcase_add_test(markov, test_markov_entropy_order2);
    tcase_add_test(markov, test_markov_full_permutation);
    tcase_add_test(markov, test_markov_describe);
    tcase_add_test(markov, test_markov_mean_loss_floor);
    suite_add_tcase(suite, markov);
    TCase *files = tcase_create("files");
    tcase_add_test(files, test_text_round_trip);
    tcase_add_test(files, test_tokens_round_trip);
    tcase_add_test(files, test_offset_range);
    tcase_add_test(files, test_python_writer);
    suite_add_tcase(suite, files);
    TCase *bad = tcase_create("bad_input");
    tcase_add_test(bad, test_bad_specs);
    tcase_add_test(bad, test_bad_text_files);
    tcase_add_test(bad, test_bad_token_files);
    suite_add_tcase(suite, bad);

    SRunner *runner = srunner_create(suite);
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    if (private_tmp) remove_private_tmp(private_tmp);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
