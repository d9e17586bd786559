#include "data.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "hash.h"
#include "log.h"
#include "mem.h"
#include "rng.h"

#define MARKOV_DEFAULT_ORDER 1
#define MARKOV_DEFAULT_BRANCHES 4
#define MARKOV_MAX_ORDER 8
#define FEISTEL_ROUNDS 4  // Luby-Rackoff: four rounds of a pseudo-random function give a permutation

#define TOKEN_MAGIC "LLMTOK1"  // 8 bytes with its terminating NUL
#define TOKEN_MAGIC_BYTES 8
#define TOKEN_HEADER_BYTES 24  // magic, u32 bytes per token, u32 reserved, u64 token count

typedef enum { SOURCE_MARKOV, SOURCE_FILE } SourceKind;

struct DataSource {
    SourceKind kind;
    int vocab_size;
    int seq_len;
    uint64_t seed;
    char description[512];
    // Markov chain
    int order;            // K: how many previous tokens make a context
    int branches;         // N: candidate next tokens per context
    uint64_t table_seed;  // picks the chain (which tokens follow which context)
    int half_bits;        // the token permutation is a Feistel network on 2 * half_bits bits
    double *cdf;          // cdf[i] = p_0 + ... + p_i, cdf[N-1] = 1
    double entropy;       // H(p), nats
    // File: every token in memory, width bytes each, host byte order
    void *tokens;
    int width;  // 1 (text), 2 or 4
    size_t n_tokens;
};

// ---- spec parsing ------------------------------------------------------------------------------

static bool has_prefix(const char *text, const char *prefix) {
    return strncmp(text, prefix, strlen(prefix)) == 0;
}

// Parses a whole option value as an unsigned decimal number; anything else is bad input.
static uint64_t parse_option_value(const char *spec, const char *key, const char *value) {
    char *end = NULL;
    errno = 0;
    unsigned long long parsed = strtoull(value, &end, 10);
    if (value[0] < '0' || value[0] > '9' || *end != '\0' || errno == ERANGE)
        fatal_input("data source '%s': %s=%s: not a non-negative integer", spec, key, value);
    return parsed;
}

static int parse_bounded_option(const char *spec, const char *key, const char *value, int min, int max) {
    uint64_t parsed = parse_option_value(spec, key, value);
    if (parsed < (uint64_t)min || parsed > (uint64_t)max)
        fatal_input("data source '%s': %s=%s: must be in %d..%d", spec, key, value, min, max);
    return (int)parsed;
}

// options: "" or "key=value,key=value" with keys order, branches and table.
static void parse_markov_options(DataSource *src, const char *spec, const char *options) {
    char buffer[256];
    if (strlen(options) >= sizeof buffer) fatal_input("data source '%s': options too long", spec);
    snprintf(buffer, sizeof buffer, "%s", options);
    size_t n = strlen(options);  // strtok_r would skip an empty item: "order=2," would pass
    if (n && (options[0] == ',' || options[n - 1] == ',' || strstr(options, ",,")))
        fatal_input("data source '%s': an empty option (a stray comma)", spec);
    char *saveptr = NULL;
    char seen[256] = ",";  // ",order,branches,": keys given so far; a repeated one is refused
    for (char *item = strtok_r(buffer, ",", &saveptr); item; item = strtok_r(NULL, ",", &saveptr)) {
        char *equals = strchr(item, '=');
        if (!equals) fatal_input("data source '%s': option '%s' is not key=value", spec, item);
        *equals = '\0';
        const char *value = equals + 1;
        char key[64];
        snprintf(key, sizeof key, ",%.40s,", item);
        if (strstr(seen, key)) fatal_input("data source '%s': option '%s' is given twice", spec, item);
        if (strlen(seen) + strlen(item) + 2 < sizeof seen) strcat(strcat(seen, item), ",");
        if (strcmp(item, "order") == 0)
            src->order = parse_bounded_option(spec, item, value, 1, MARKOV_MAX_ORDER);
        else if (strcmp(item, "branches") == 0)
            // candidates are distinct tokens: at most the vocabulary
            src->branches = parse_bounded_option(spec, item, value, 1, src->vocab_size >= 1 ? src->vocab_size : INT_MAX);
        else if (strcmp(item, "table") == 0)
            src->table_seed = parse_option_value(spec, item, value);
        else
            fatal_input("data source '%s': unknown option '%s' (expected order, branches, table)", spec, item);
    }
}

// ---- Markov source -----------------------------------------------------------------------------

// p_i = (1 / (i + 1)) / sum_j 1 / (j + 1): Zipf-like, as word frequencies are, and its entropy
// keeps growing with N (2^-i would flatten out at 2 ln 2), so branches sets the difficulty.
static void markov_probabilities(DataSource *src) {
    int n = src->branches;
    double norm = 0.0;
    for (int i = 0; i < n; i++) norm += 1.0 / (i + 1);
    src->cdf = mem_alloc(MEM_OTHER, (size_t)n * sizeof(double));
    double cumulative = 0.0, entropy = 0.0;
    for (int i = 0; i < n; i++) {
        double p = 1.0 / (i + 1) / norm;
        cumulative += p;
        entropy -= p * log(p);
        src->cdf[i] = cumulative;
    }
    src->cdf[n - 1] = 1.0;  // rounding must not leave a uniform draw past the last candidate
    src->entropy = entropy;
}

static void open_markov(DataSource *src, const char *spec, const char *options) {
    src->kind = SOURCE_MARKOV;
    src->order = MARKOV_DEFAULT_ORDER;
    src->branches = MARKOV_DEFAULT_BRANCHES;
    parse_markov_options(src, spec, options);
    if (src->vocab_size < 2) fatal_input("data source '%s': vocab_size %d: needs at least 2", spec, src->vocab_size);
    if (src->branches > src->vocab_size)  // the default's 4 on a smaller vocabulary
        fatal_input("data source '%s': branches=%d: must be in 1..%d, the vocab_size (candidates are distinct tokens)",
                    spec, src->branches, src->vocab_size);
    // Smallest h with 4^h >= V: the permutation's domain is then under 4V, so cycle walking
    // (below) needs fewer than 4 passes on average.
    while ((1ull << (2 * src->half_bits)) < (unsigned long long)src->vocab_size) src->half_bits++;
    markov_probabilities(src);
    snprintf(src->description, sizeof src->description,
             "markov: order %d, %d branches (p_i ~ 1/(i+1)), table %" PRIu64 ", vocab %d; entropy floor %.4f nats/token",
             src->order, src->branches, src->table_seed, src->vocab_size, src->entropy);
}

// splitmix64's finaliser: a bijective 64-bit mixer, so chaining it over the context tokens gives
// each context its own well-spread key.
static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t context_key(const DataSource *src, const int *context) {
    uint64_t key = mix64(src->table_seed);
    for (int k = 0; k < src->order; k++) key = mix64(key ^ (uint32_t)context[k]);
    return key;
}

static uint32_t feistel_round(const DataSource *src, uint64_t key, int round, uint32_t half) {
    const uint32_t counter[4] = {half, (uint32_t)round, (uint32_t)key, (uint32_t)(key >> 32)};
    const uint32_t philox_key[2] = {(uint32_t)src->table_seed, (uint32_t)(src->table_seed >> 32)};
    uint32_t out[4];
    philox4x32_10(counter, philox_key, out);
    return out[0];
}

// A pseudo-random permutation of [0, V), one per context key. Candidate i of a context is
// permute(key, i), so the N candidates are distinct by construction and any one of them costs
// O(1) to find. The Feistel network permutes [0, 4^h); re-applying it until the value falls
// below V ("cycle walking") restricts that permutation to [0, V).
static uint32_t permute_token(const DataSource *src, uint64_t key, uint32_t x) {
    const int h = src->half_bits;
    const uint32_t mask = (uint32_t)((1ull << h) - 1);
    do {
        uint32_t left = x >> h, right = x & mask;
        for (int round = 0; round < FEISTEL_ROUNDS; round++) {
            uint32_t next = left ^ (feistel_round(src, key, round, right) & mask);
            left = right;
            right = next;
        }
        x = (left << h) | right;
    } while (x >= (uint32_t)src->vocab_size);
    return x;
}

// The smallest i with u < cdf[i]; exists because u < 1 = cdf[N-1].
static int sample_rank(const DataSource *src, double u) {
    int lo = 0, hi = src->branches - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (u < src->cdf[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// Token t of a sequence: the first K are uniform (the starting context), each later one is the
// candidate of rank r ~ p for the K tokens before it. tokens[0..t-1] must already be filled.
static int markov_token(const DataSource *src, uint64_t stream, int t, const int *tokens) {
    if (t < src->order) return (int)rng_below(src->seed, stream, (uint64_t)t, (uint64_t)src->vocab_size);
    uint64_t key = context_key(src, tokens + t - src->order);
    int rank = sample_rank(src, rng_uniform(src->seed, stream, (uint64_t)t));
    return (int)permute_token(src, key, (uint32_t)rank);
}

// ---- file sources ------------------------------------------------------------------------------

static unsigned char *read_file_or_die(const char *spec, const char *path, size_t *size) {
    if (!path[0]) fatal_input("data source '%s': no file named", spec);
    char err[4352];
    unsigned char *bytes = read_whole_file(path, size, err, sizeof err);
    if (!bytes) fatal_input("data source '%s': %s", spec, err);
    return bytes;
}

static void require_sequence_fits(const DataSource *src, const char *spec, const char *unit) {
    if (src->n_tokens < (size_t)src->seq_len + 1)
        fatal_input("data source '%s': %zu %s, fewer than seq_len+1 = %d", spec, src->n_tokens, unit,
                    src->seq_len + 1);
}

static void open_text(DataSource *src, const char *spec, const char *path) {
    if (src->vocab_size < 256)
        fatal_input("data source '%s': vocab_size %d: text is bytes and needs at least 256", spec, src->vocab_size);
    size_t size = 0;
    unsigned char *bytes = read_file_or_die(spec, path, &size);
    src->kind = SOURCE_FILE;
    src->width = 1;
    src->n_tokens = size;
    require_sequence_fits(src, spec, "bytes");
    // Copied into a mem_alloc buffer so the memory report counts the data.
    src->tokens = mem_alloc(MEM_OTHER, size);
    memcpy(src->tokens, bytes, size);
    free(bytes);
    snprintf(src->description, sizeof src->description, "text '%s': %zu bytes as tokens (vocab 256 of %d)", path,
             size, src->vocab_size);
}

static uint64_t read_le(const unsigned char *bytes, int n) {
    uint64_t value = 0;
    for (int i = n - 1; i >= 0; i--) value = (value << 8) | bytes[i];
    return value;
}

// Checks magic, width, reserved field and that the size is exactly header + count * width.
static void check_token_header(const char *spec, const unsigned char *bytes, size_t size) {
    if (size < TOKEN_HEADER_BYTES)
        fatal_input("data source '%s': truncated: %zu bytes, shorter than the %d-byte header", spec, size,
                    TOKEN_HEADER_BYTES);
    if (memcmp(bytes, TOKEN_MAGIC, TOKEN_MAGIC_BYTES) != 0)
        fatal_input("data source '%s': not a token file (the first 8 bytes are not \"%s\\0\")", spec, TOKEN_MAGIC);
    uint64_t width = read_le(bytes + 8, 4), reserved = read_le(bytes + 12, 4), count = read_le(bytes + 16, 8);
    if (width != 2 && width != 4)
        fatal_input("data source '%s': bytes per token is %" PRIu64 ", must be 2 or 4", spec, width);
    if (reserved != 0) fatal_input("data source '%s': reserved header field is %" PRIu64 ", must be 0", spec, reserved);
    uint64_t payload = size - TOKEN_HEADER_BYTES;
    if (count > payload / width || count * width != payload) {
        // In long double so that an absurd count cannot overflow the message.
        long double expected = (long double)TOKEN_HEADER_BYTES + (long double)count * (long double)width;
        fatal_input("data source '%s': %s: header says %" PRIu64 " tokens x %" PRIu64 " bytes, so %.0Lf bytes "
                    "with the header; the file has %zu",
                    spec, count > payload / width ? "truncated" : "trailing bytes", count, width, expected, size);
    }
}

// Copies the little-endian tokens into a host-order array, checking each against the vocabulary.
static void load_tokens(DataSource *src, const char *spec, const unsigned char *payload) {
    src->tokens = mem_alloc(MEM_OTHER, src->n_tokens * (size_t)src->width);
    for (size_t i = 0; i < src->n_tokens; i++) {
        uint64_t token = read_le(payload + i * (size_t)src->width, src->width);
        if (token >= (uint64_t)src->vocab_size)
            fatal_input("data source '%s': token %zu is %" PRIu64 ", not below vocab_size %d", spec, i, token,
                        src->vocab_size);
        if (src->width == 2) ((uint16_t *)src->tokens)[i] = (uint16_t)token;
        else ((uint32_t *)src->tokens)[i] = (uint32_t)token;
    }
}

static void open_tokens(DataSource *src, const char *spec, const char *path) {
    size_t size = 0;
    unsigned char *bytes = read_file_or_die(spec, path, &size);
    check_token_header(spec, bytes, size);
    src->kind = SOURCE_FILE;
    src->width = (int)read_le(bytes + 8, 4);
    src->n_tokens = (size_t)read_le(bytes + 16, 8);
    require_sequence_fits(src, spec, "tokens");
    load_tokens(src, spec, bytes + TOKEN_HEADER_BYTES);
    free(bytes);
    snprintf(src->description, sizeof src->description, "tokens '%s': %zu tokens x %d bytes, vocab %d", path,
             src->n_tokens, src->width, src->vocab_size);
}

static int token_at(const DataSource *src, size_t i) {
    switch (src->width) {
    case 1: return ((const uint8_t *)src->tokens)[i];
    case 2: return ((const uint16_t *)src->tokens)[i];
    default: return (int)((const uint32_t *)src->tokens)[i];
    }
}

// ---- public API --------------------------------------------------------------------------------

DataSource *data_open(const char *spec, int vocab_size, int seq_len, uint64_t seed) {
    if (!spec) spec = "";
    if (seq_len < 1) fatal_input("data source '%s': seq_len %d: must be at least 1", spec, seq_len);
    DataSource *src = mem_alloc(MEM_OTHER, sizeof *src);
    src->vocab_size = vocab_size;
    src->seq_len = seq_len;
    src->seed = seed;
    if (strcmp(spec, "markov") == 0) open_markov(src, spec, "");
    else if (strcmp(spec, "markov:") == 0)
        fatal_input("data source 'markov:': no options after the colon (plain 'markov' takes the defaults)");
    else if (has_prefix(spec, "markov:")) open_markov(src, spec, spec + strlen("markov:"));
    else if (has_prefix(spec, "text:")) open_text(src, spec, spec + strlen("text:"));
    else if (has_prefix(spec, "tokens:")) open_tokens(src, spec, spec + strlen("tokens:"));
    else
        fatal_input("data source '%s': unknown (expected markov, markov:order=K,branches=N, text:PATH or tokens:PATH)",
                    spec);
    return src;
}

// Writes tokens 0..T of one sequence: token t < T to inputs[t], token T to *last.
static void fill_sequence(const DataSource *src, uint64_t stream, int T, int *inputs, int *last) {
    // Offsets come from [0, n - (seq_len+1)] whatever T is, so a shorter T reads a prefix.
    size_t offset = 0;
    if (src->kind == SOURCE_FILE)
        offset = (size_t)rng_below(src->seed, stream, 0, (uint64_t)(src->n_tokens - (size_t)src->seq_len));
    for (int t = 0; t <= T; t++) {
        int token = src->kind == SOURCE_MARKOV ? markov_token(src, stream, t, inputs) : token_at(src, offset + (size_t)t);
        if (t < T) inputs[t] = token;
        else *last = token;
    }
}

void data_batch(const DataSource *src, long long step, int global_batch, int first_seq, int n_seqs, int T,
                int *inputs, int *targets) {
    if (step < 0 || first_seq < 0 || n_seqs < 0 || (long long)first_seq + n_seqs > global_batch || T < 1 ||
        T > src->seq_len)
        fatal("data_batch: step %lld, sequences %d..%d of %d, T %d (seq_len %d): out of range", step, first_seq,
              first_seq + n_seqs, global_batch, T, src->seq_len);
    for (int j = 0; j < n_seqs; j++) {
        // One counter stream per sequence of the run: the same whichever slice or rank asks.
        uint64_t stream = (uint64_t)step * (uint64_t)global_batch + (uint64_t)(first_seq + j);
        int *row_inputs = inputs + (size_t)j * T, *row_targets = targets + (size_t)j * T;
        fill_sequence(src, stream, T, row_inputs, &row_targets[T - 1]);
        memcpy(row_targets, row_inputs + 1, (size_t)(T - 1) * sizeof(int));
    }
}

double data_entropy_floor(const DataSource *src) { return src->kind == SOURCE_MARKOV ? src->entropy : NAN; }

// The first min(K-1, T) targets are tokens of the uniform starting context (floor ln V), the rest
// have their full context (floor H(p)): DATA.md's ((K-1) ln V + (T-K+1) H(p)) / T.
double data_mean_loss_floor(const DataSource *src, int T) {
    if (src->kind != SOURCE_MARKOV || T < 1) return NAN;
    int uniform = src->order - 1 < T ? src->order - 1 : T;
    return (uniform * log((double)src->vocab_size) + (T - uniform) * src->entropy) / T;
}

const char *data_describe(const DataSource *src) { return src->description; }

// FNV-1a over the token ids, each as 4 little-endian bytes: a changed token changes it, and the
// same tokens hash alike whatever the file's width (a text file, or its tokens: conversion at 2 or
// 4 bytes a token, trains the same).
static uint64_t tokens_hash(const DataSource *src) {
    uint64_t h = FNV1A_BASIS;
    for (size_t i = 0; i < src->n_tokens; i++) {
        uint32_t id = (uint32_t)token_at(src, i);
        for (int b = 0; b < 4; b++) h = fnv1a_byte(h, (uint8_t)(id >> (8 * b)));
    }
    return h;
}

const char *data_identity(const DataSource *src, char *out, size_t len) {
    if (src->kind == SOURCE_MARKOV)
        snprintf(out, len, "markov:order=%d,branches=%d,table=%" PRIu64, src->order, src->branches, src->table_seed);
    else
        snprintf(out, len, "%zu tokens, hash %016" PRIx64, src->n_tokens, tokens_hash(src));
    return out;
}

void data_close(DataSource *src) {
    if (!src) return;
    mem_free(src->cdf);
    mem_free(src->tokens);
    mem_free(src);
}
