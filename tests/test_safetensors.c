// test_safetensors.c: the safetensors reader and writer.
//
// Without arguments: the Check suite (round trips, every rejection, truncation and byte-flip
// robustness, atomic writes). With arguments it is the C half of t_safetensors_python.sh:
//   test_safetensors write PATH   writes the shared fixture
//   test_safetensors check PATH   checks that PATH holds exactly the shared fixture (exit 1 if not)
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/safetensors.h"

// ---- the fixture shared with tests/t_safetensors_python.sh (keep the two in step) -----------

static const double F64[6] = {0.1, -2.5, 1e300, 3.141592653589793, -0.0, 1.0 / 3.0};
static const float F32[12] = {-1.5, -1.25, -1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 1.25};
static const uint16_t F16[4] = {0x3C00, 0xC000, 0x3800, 0x7BFF};  // 1, -2, 0.5, 65504
static const int64_t I64[4] = {-(1LL << 40), 0, (1LL << 40) + 5, INT64_MAX};
static const int32_t I32[4] = {-7, 0, 100000, INT32_MAX};
static const int8_t I8[4] = {-128, -1, 0, 127};
static const uint8_t U8[3] = {0, 128, 255};
static const uint16_t U16[2] = {0, 65535};
static const uint32_t U32[2] = {1, UINT32_MAX};
static const float SCALAR = 3.5f;
static const int32_t ODD_NAME_VALUE = 42;
static const uint8_t LONG_NAME_VALUE = 7;
#define ODD_NAME "odd \"name\" \\ \xc3\xa9\t"  // quote, backslash, UTF-8 e-acute, tab
static char long_name[301];                     // 300 x 'x', filled in by main()

typedef struct {
    const char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[3];
    const void *data;
} Fixture;

static const Fixture PORTABLE[] = {
    {"f64", ST_F64, 2, {2, 3}, F64},
    {"f32", ST_F32, 2, {3, 4}, F32},
    {"f16", ST_F16, 1, {4}, F16},
    {"i64", ST_I64, 1, {4}, I64},
    {"i32", ST_I32, 2, {2, 2}, I32},
    {"i8", ST_I8, 1, {4}, I8},
    {"u8", ST_U8, 1, {3}, U8},
    {"u16", ST_U16, 1, {2}, U16},
    {"u32", ST_U32, 1, {2}, U32},
    {"scalar", ST_F32, 0, {0}, &SCALAR},
    {"empty", ST_F32, 2, {0, 3}, NULL},
    {ODD_NAME, ST_I32, 1, {1}, &ODD_NAME_VALUE},
    {long_name, ST_U8, 1, {1}, &LONG_NAME_VALUE},
};
#define N_PORTABLE (int)(sizeof PORTABLE / sizeof PORTABLE[0])

static const char *const METADATA[][2] = {
    {"format", "pt"}, {"step", "150"}, {"note", "quote \" and newline \n"}};
#define N_METADATA (int)(sizeof METADATA / sizeof METADATA[0])

// Dtypes the Python module does not know, so they only round-trip through C.
static const uint16_t BF16[4] = {0x3F80, 0xC000, 0x0000, 0x7F80};  // 1, -2, 0, inf
static const int16_t I16[3] = {-32768, 0, 32767};
static const uint64_t U64[2] = {0, UINT64_MAX};
static const uint8_t BOOLS[5] = {1, 0, 0, 1, 1};
static const Fixture C_ONLY[] = {
    {"bf16", ST_BF16, 2, {2, 2}, BF16},
    {"i16", ST_I16, 1, {3}, I16},
    {"u64", ST_U64, 1, {2}, U64},
    {"bool", ST_BOOL, 1, {5}, BOOLS},
    {"i64_scalar", ST_I64, 0, {0}, &I64[3]},
    {"u8_empty", ST_U8, 3, {2, 0, 3}, NULL},
};
#define N_C_ONLY (int)(sizeof C_ONLY / sizeof C_ONLY[0])

static void add_fixtures(StWriter *w, const Fixture *fixtures, int n) {
    char err[512];
    for (int i = 0; i < n; i++) {
        const Fixture *x = &fixtures[i];
        if (!st_writer_add(w, x->name, x->dtype, x->ndim, x->shape, x->data, err, sizeof err)) {
            fprintf(stderr, "st_writer_add: %s\n", err);
            exit(1);
        }
    }
}

static bool write_fixture(const char *path, bool with_c_only, char *err, size_t err_len) {
    StWriter *w = st_writer_new();
    add_fixtures(w, PORTABLE, N_PORTABLE);
    if (with_c_only) add_fixtures(w, C_ONLY, N_C_ONLY);
    for (int i = 0; i < N_METADATA; i++)
        if (!st_writer_add_metadata(w, METADATA[i][0], METADATA[i][1], err, err_len)) return false;
    bool ok = st_write(w, path, err, err_len);
    st_writer_free(w);
    return ok;
}

// Checks that each fixture is in f with its dtype, shape and exact bytes; message in err if not.
static bool check_fixtures(const StFile *f, const Fixture *fixtures, int n, char *err,
                           size_t err_len) {
    for (int i = 0; i < n; i++) {
        const Fixture *x = &fixtures[i];
        size_t n_elements = 1;
        for (int d = 0; d < x->ndim; d++) n_elements *= (size_t)x->shape[d];
        size_t n_bytes = n_elements * st_dtype_size(x->dtype);
        unsigned char *got = malloc(n_bytes + 1);
        bool ok = st_read(f, x->name, x->dtype, x->ndim, x->shape, got, err, err_len);
        if (ok && n_bytes > 0 && memcmp(got, x->data, n_bytes) != 0) {
            snprintf(err, err_len, "tensor '%s': values differ", x->name);
            ok = false;
        }
        free(got);
        if (!ok) return false;
    }
    return true;
}

static bool check_metadata(const StFile *f, char *err, size_t err_len) {
    if (st_metadata_count(f) != N_METADATA) {
        snprintf(err, err_len, "%d metadata pairs, expected %d", st_metadata_count(f), N_METADATA);
        return false;
    }
    for (int i = 0; i < N_METADATA; i++) {
        const char *value = st_metadata(f, METADATA[i][0]);
        if (!value || strcmp(value, METADATA[i][1]) != 0) {
            snprintf(err, err_len, "metadata '%s' is '%s', expected '%s'", METADATA[i][0],
                     value ? value : "(missing)", METADATA[i][1]);
            return false;
        }
    }
    return true;
}

// `check PATH`: the file must hold the portable fixture and nothing else.
static int tool_check(const char *path) {
    char err[1024];
    StFile *f = st_open(path, err, sizeof err);
    bool ok = f != NULL;
    if (ok && st_count(f) != N_PORTABLE) {
        snprintf(err, sizeof err, "%s: %d tensors, expected %d", path, st_count(f), N_PORTABLE);
        ok = false;
    }
    ok = ok && check_fixtures(f, PORTABLE, N_PORTABLE, err, sizeof err) &&
         check_metadata(f, err, sizeof err);
    st_close(f);
    if (!ok) {
        fprintf(stderr, "check %s: %s\n", path, err);
        return 1;
    }
    printf("check %s: %d tensors and %d metadata pairs as expected\n", path, N_PORTABLE, N_METADATA);
    return 0;
}

static int tool_write(const char *path) {
    char err[1024];
    if (!write_fixture(path, false, err, sizeof err)) {
        fprintf(stderr, "write %s: %s\n", path, err);
        return 1;
    }
    return 0;
}

// ---- helpers for the suite -------------------------------------------------------------------

static char tmp_dir[256];

typedef struct {
    char s[512];
} Path;

static Path tmp_file(const char *name) {
    Path path;
    snprintf(path.s, sizeof path.s, "%s/%s", tmp_dir, name);
    return path;
}

static void write_file(const char *path, const void *bytes, size_t n) {
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    ck_assert_uint_eq(fwrite(bytes, 1, n, fp), n);
    ck_assert_int_eq(fclose(fp), 0);
}

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    ck_assert_ptr_nonnull(fp);
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *bytes = malloc(*n + 1);
    ck_assert_uint_eq(fread(bytes, 1, *n, fp), *n);
    fclose(fp);
    return bytes;
}

static void put_u64(unsigned char *out, uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char *in) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | in[i];
    return v;
}

// A hand-made file: the given length prefix, the header text unpadded, then data_len bytes of
// data (or of 0x5A where data is NULL).
static void write_raw(const char *path, uint64_t prefix, const char *header, const void *data,
                      size_t data_len) {
    size_t header_len = strlen(header), n = 8 + header_len + data_len;
    unsigned char *bytes = malloc(n);
    put_u64(bytes, prefix);
    memcpy(bytes + 8, header, header_len);
    if (data) memcpy(bytes + 8 + header_len, data, data_len);
    else memset(bytes + 8 + header_len, 0x5A, data_len);
    write_file(path, bytes, n);
    free(bytes);
}

// st_open must succeed.
static StFile *open_ok(const char *path) {
    char err[1024];
    StFile *f = st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    return f;
}

// st_open and st_open_header (the same checks without reading the data) must both fail with one
// line naming the file and containing `word`.
static void expect_rejected(const char *path, const char *word) {
    StFile *(*const openers[2])(const char *, char *, size_t) = {st_open, st_open_header};
    for (int o = 0; o < 2; o++) {
        char err[1024] = "";
        StFile *f = openers[o](path, err, sizeof err);
        ck_assert_msg(f == NULL, "%s: accepted by opener %d, expected an error containing '%s'", path, o, word);
        ck_assert_msg(strstr(err, word) != NULL, "error '%s' does not contain '%s'", err, word);
        ck_assert_msg(strstr(err, path) != NULL, "error '%s' does not name the file", err);
        ck_assert_msg(strchr(err, '\n') == NULL, "error '%s' is not one line", err);
    }
}

static int count_dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
    closedir(d);
    return n;
}

// ---- round trips -----------------------------------------------------------------------------

START_TEST(test_round_trip) {
    char err[1024];
    Path path_buf = tmp_file("round_trip.safetensors");
    const char *path = path_buf.s;
    ck_assert_msg(write_fixture(path, true, err, sizeof err), "%s", err);
    StFile *f = open_ok(path);
    ck_assert_str_eq(st_path(f), path);
    ck_assert_int_eq(st_count(f), N_PORTABLE + N_C_ONLY);
    ck_assert_msg(check_fixtures(f, PORTABLE, N_PORTABLE, err, sizeof err), "%s", err);
    ck_assert_msg(check_fixtures(f, C_ONLY, N_C_ONLY, err, sizeof err), "%s", err);
    ck_assert_msg(check_metadata(f, err, sizeof err), "%s", err);
    ck_assert_ptr_null(st_metadata(f, "absent"));

    // Index order is insertion order; each tensor describes itself fully.
    for (int i = 0; i < st_count(f); i++) {
        const Fixture *x = i < N_PORTABLE ? &PORTABLE[i] : &C_ONLY[i - N_PORTABLE];
        const StTensor *t = st_tensor(f, i);
        ck_assert_str_eq(t->name, x->name);
        ck_assert_ptr_eq(st_find(f, x->name), t);
        ck_assert_int_eq(t->dtype, x->dtype);
        ck_assert_int_eq(t->ndim, x->ndim);
        size_t n_elements = 1;
        for (int d = 0; d < x->ndim; d++) {
            ck_assert_int_eq(t->shape[d], x->shape[d]);
            n_elements *= (size_t)x->shape[d];
        }
        ck_assert_uint_eq(t->n_elements, n_elements);
        ck_assert_uint_eq(t->n_bytes, n_elements * st_dtype_size(x->dtype));
    }
    ck_assert_ptr_null(st_tensor(f, -1));
    ck_assert_ptr_null(st_tensor(f, st_count(f)));
    ck_assert_ptr_null(st_find(f, "absent"));
    const char *key, *value;
    ck_assert(st_metadata_entry(f, 2, &key, &value));
    ck_assert_str_eq(key, "note");
    ck_assert(!st_metadata_entry(f, N_METADATA, &key, &value));
    st_close(f);

    // The header length is padded to a multiple of 8, so the data block is 8-byte aligned.
    size_t n;
    unsigned char *bytes = read_file(path, &n);
    ck_assert_uint_eq(get_u64(bytes) % 8, 0);
    free(bytes);
}
END_TEST

// st_open_header keeps the data on disk: st_read_bytes must give every tensor's bytes (whole and in
// pieces) as st_open has them in memory, and refuse a range past a tensor's end.
START_TEST(test_header_only_reads) {
    char err[1024];
    Path path_buf = tmp_file("header_only.safetensors");
    const char *path = path_buf.s;
    ck_assert_msg(write_fixture(path, true, err, sizeof err), "%s", err);
    StFile *whole = open_ok(path), *lazy = st_open_header(path, err, sizeof err);
    ck_assert_msg(lazy != NULL, "%s", err);
    ck_assert_int_eq(st_count(lazy), st_count(whole));
    for (int i = 0; i < st_count(whole); i++) {
        const StTensor *a = st_tensor(whole, i), *b = st_find(lazy, a->name);
        ck_assert_ptr_nonnull(b);
        ck_assert_ptr_null(b->data);
        ck_assert_uint_eq(a->file_offset, b->file_offset);
        unsigned char *got = malloc(a->n_bytes + 1);
        ck_assert_msg(st_read_bytes(lazy, b, 0, b->n_bytes, got, err, sizeof err), "%s", err);
        ck_assert(a->n_bytes == 0 || memcmp(got, a->data, a->n_bytes) == 0);
        if (a->n_bytes > 2) {  // a piece from the middle
            ck_assert_msg(st_read_bytes(lazy, b, 1, b->n_bytes - 2, got, err, sizeof err), "%s", err);
            ck_assert(memcmp(got, (const unsigned char *)a->data + 1, a->n_bytes - 2) == 0);
        }
        ck_assert(!st_read_bytes(lazy, b, 1, b->n_bytes, got, err, sizeof err));
        ck_assert_msg(strstr(err, "past its") != NULL, "%s", err);
        free(got);
    }
    st_close(whole);
    st_close(lazy);
}
END_TEST

START_TEST(test_empty_file) {
    char err[512];
    Path path_buf = tmp_file("empty.safetensors");
    const char *path = path_buf.s;
    StWriter *w = st_writer_new();
    ck_assert_msg(st_write(w, path, err, sizeof err), "%s", err);
    st_writer_free(w);
    StFile *f = open_ok(path);
    ck_assert_int_eq(st_count(f), 0);
    ck_assert_int_eq(st_metadata_count(f), 0);
    ck_assert_ptr_null(st_find(f, "x"));
    st_close(f);
}
END_TEST

// A foreign file whose header length is not a multiple of 8: data arrive unaligned but intact.
START_TEST(test_unaligned_foreign_file) {
    const char *header = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                         "\"b\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[1,17]}}";
    const double b[2] = {1.5, -2.25};
    unsigned char data[17] = {9};
    memcpy(data + 1, b, sizeof b);
    Path path_buf = tmp_file("unaligned.safetensors");
    const char *path = path_buf.s;
    write_raw(path, strlen(header), header, data, sizeof data);

    char err[512];
    StFile *f = open_ok(path);
    double got[2];
    ck_assert(st_copy_to(st_find(f, "b"), got, sizeof got, err, sizeof err));
    ck_assert(got[0] == 1.5 && got[1] == -2.25);
    ck_assert(!st_copy_to(st_find(f, "b"), got, sizeof got - 1, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "destination holds 15"));
    uint8_t a;
    ck_assert(st_read(f, "a", ST_U8, 1, (int64_t[]){1}, &a, err, sizeof err));
    ck_assert_int_eq(a, 9);
    st_close(f);
}
END_TEST

START_TEST(test_read_mismatches) {
    char err[1024];
    Path path_buf = tmp_file("mismatch.safetensors");
    const char *path = path_buf.s;
    ck_assert_msg(write_fixture(path, false, err, sizeof err), "%s", err);
    StFile *f = open_ok(path);
    float dst[12];
    ck_assert(!st_read(f, "f32", ST_F64, 2, (int64_t[]){3, 4}, dst, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "tensor 'f32': dtype F32, expected F64"));
    ck_assert(!st_read(f, "f32", ST_F32, 2, (int64_t[]){4, 3}, dst, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "shape [3, 4], expected [4, 3]"));
    ck_assert(!st_read(f, "f32", ST_F32, 1, (int64_t[]){12}, dst, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "expected [12]"));
    ck_assert(!st_read(f, "scalar", ST_F32, 1, (int64_t[]){1}, dst, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "shape [], expected [1]"));
    ck_assert(!st_read(f, "nope", ST_F32, 0, NULL, dst, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "no tensor named 'nope'"));
    ck_assert_ptr_nonnull(strstr(err, path));
    st_close(f);
}
END_TEST

START_TEST(test_writer_rejects) {
    char err[512];
    float x[2] = {0};
    StWriter *w = st_writer_new();
    ck_assert(st_writer_add(w, "a", ST_F32, 1, (int64_t[]){2}, x, err, sizeof err));
    ck_assert(!st_writer_add(w, "a", ST_F32, 1, (int64_t[]){2}, x, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "duplicate"));
    ck_assert(!st_writer_add(w, "__metadata__", ST_F32, 0, NULL, x, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "reserved"));
    ck_assert(!st_writer_add(w, "neg", ST_F32, 2, (int64_t[]){2, -1}, x, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "invalid shape [2, -1]"));
    ck_assert(!st_writer_add(w, "deep", ST_F32, ST_MAX_DIMS + 1, NULL, x, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "dims"));
    ck_assert(!st_writer_add(w, "bad", (StDtype)ST_N_DTYPES, 0, NULL, x, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "dtype"));
    ck_assert(!st_writer_add(w, "null", ST_F32, 0, NULL, NULL, err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "NULL"));
    ck_assert(st_writer_add_metadata(w, "k", "v", err, sizeof err));
    ck_assert(!st_writer_add_metadata(w, "k", "w", err, sizeof err));
    ck_assert_ptr_nonnull(strstr(err, "duplicate"));
    st_writer_free(w);
}
END_TEST

START_TEST(test_dtype_names) {
    for (int i = 0; i < ST_N_DTYPES; i++) {
        StDtype parsed;
        ck_assert(st_dtype_parse(st_dtype_name((StDtype)i), &parsed));
        ck_assert_int_eq(parsed, i);
        ck_assert_uint_gt(st_dtype_size((StDtype)i), 0);
    }
    StDtype parsed;
    ck_assert(!st_dtype_parse("f32", &parsed));
    ck_assert_uint_eq(st_dtype_size(ST_BF16), 2);
    ck_assert_uint_eq(st_dtype_size(ST_BOOL), 1);
    ck_assert_uint_eq(st_dtype_size(ST_U64), 8);
}
END_TEST

// ---- rejections ------------------------------------------------------------------------------

#define ENTRY(name, dtype, shape, offsets) \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":" offsets "}"

static const struct {
    const char *header;
    size_t data_len;
    const char *word;  // the error must contain it
} BAD_HEADERS[] = {
    {"", 0, "not valid JSON"},
    {"{\"a\": ", 0, "not valid JSON"},
    {"[1, 2]", 0, "not a JSON object"},
    {"{} x", 0, "unexpected bytes after the JSON"},
    {"{\"a\": 5}", 0, "tensor 'a': entry is not a JSON object"},
    {"{\"a\\nb\": 5}", 0, "tensor 'a?b': entry"},  // a newline in a name stays off the message
    {"{" ENTRY("a", "F8", "[1]", "[0,1]") "}", 1, "unknown dtype 'F8'"},
    {"{" ENTRY("a", "f32", "[1]", "[0,4]") "}", 4, "unknown dtype 'f32'"},
    {"{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "dtype"},
    {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "dtype"},
    {"{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, "missing or invalid shape"},
    {"{" ENTRY("a", "U8", "3", "[0,3]") "}", 3, "missing or invalid shape"},
    {"{" ENTRY("a", "U8", "[1.5]", "[0,1]") "}", 1, "invalid shape"},
    {"{" ENTRY("a", "U8", "[\"2\"]", "[0,2]") "}", 2, "invalid shape"},
    {"{" ENTRY("a", "U8", "[1e300]", "[0,1]") "}", 1, "invalid shape"},
    {"{" ENTRY("a", "U8", "[2,-3]", "[0,0]") "}", 0, "negative dim -3"},
    {"{" ENTRY("a", "U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1, "9 dims"},
    {"{" ENTRY("a", "U8", "[4294967296,4294967296,4294967296]", "[0,0]") "}", 0, "too large"},
    {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "[0]") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "[0,1,2]") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "[1,0]") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "[-1,0]") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "[\"0\",1]") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "U8", "[1]", "{}") "}", 1, "data_offsets"},
    {"{" ENTRY("a", "F32", "[2]", "[0,4]") "}", 4, "needs 8 bytes but data_offsets [0, 4] span 4"},
    {"{" ENTRY("a", "F32", "[2]", "[0,8]") "}", 4,
     "truncated: header says 8 bytes of tensor data, file has 4"},
    {"{" ENTRY("a", "U8", "[1]", "[1e15,1000000000000001]") "}", 4, "truncated"},
    {"{" ENTRY("a", "F32", "[2]", "[0,8]") "," ENTRY("b", "F32", "[2]", "[4,12]") "}", 12,
     "tensors 'a' and 'b' overlap"},
    {"{" ENTRY("a", "U8", "[4]", "[0,4]") "," ENTRY("b", "U8", "[4]", "[8,12]") "}", 12,
     "hole in the data: bytes [4, 8)"},
    {"{" ENTRY("a", "U8", "[4]", "[4,8]") "}", 8, "hole"},
    {"{" ENTRY("a", "U8", "[4]", "[0,4]") "}", 8, "hole in the data: the last 4 bytes"},
    {"{}", 1, "hole"},
    {"{" ENTRY("a", "U8", "[4]", "[0,4]") "," ENTRY("a", "U8", "[4]", "[4,8]") "}", 8,
     "duplicate tensor name 'a'"},
    {"{\"__metadata__\": [1]}", 0, "__metadata__ is not a JSON object"},
    {"{\"__metadata__\": {\"k\": 1}}", 0, "value of 'k' is not a string"},
    {"{\"__metadata__\": {}, \"__metadata__\": {}}", 0, "duplicate __metadata__"},
};
#define N_BAD_HEADERS (int)(sizeof BAD_HEADERS / sizeof BAD_HEADERS[0])

START_TEST(test_rejects_bad_header) {
    Path path_buf = tmp_file("bad_header.safetensors");
    const char *path = path_buf.s;
    const char *header = BAD_HEADERS[_i].header;
    write_raw(path, strlen(header), header, NULL, BAD_HEADERS[_i].data_len);
    expect_rejected(path, BAD_HEADERS[_i].word);
}
END_TEST

START_TEST(test_rejects_bad_file) {
    Path path_buf = tmp_file("bad_file.safetensors");
    const char *path = path_buf.s;
    expect_rejected(tmp_file("does_not_exist.safetensors").s, "cannot open");
    write_file(path, "", 0);
    expect_rejected(path, "too short");
    write_file(path, "\x02\0\0\0\0", 5);
    expect_rejected(path, "(5 bytes, need at least 8)");
    write_raw(path, 1ULL << 40, "{}", NULL, 0);
    expect_rejected(path, "absurd");
    write_raw(path, 100000001, "{}", NULL, 0);
    expect_rejected(path, "absurd");
    write_raw(path, UINT64_MAX, "{}", NULL, 0);
    expect_rejected(path, "absurd");
    write_raw(path, 64, "{}", NULL, 0);
    expect_rejected(path, "truncated: header says 64 bytes of JSON, file has 2");
}
END_TEST

// ---- robustness: every truncation and many byte flips return cleanly -------------------------

// Writes a small valid file and returns its bytes (and the header length in *header_len).
static unsigned char *small_valid_file(const char *path, size_t *n, size_t *header_len) {
    char err[512];
    const float a[3] = {1, 2, 3};
    const int16_t b[2] = {-1, 1};
    StWriter *w = st_writer_new();
    ck_assert(st_writer_add(w, "a", ST_F32, 1, (int64_t[]){3}, a, err, sizeof err));
    ck_assert(st_writer_add(w, "s", ST_U8, 0, NULL, "z", err, sizeof err));
    ck_assert(st_writer_add(w, "b", ST_I16, 2, (int64_t[]){1, 2}, b, err, sizeof err));
    ck_assert(st_writer_add(w, "e", ST_F64, 1, (int64_t[]){0}, NULL, err, sizeof err));
    ck_assert(st_writer_add_metadata(w, "k", "v", err, sizeof err));
    ck_assert_msg(st_write(w, path, err, sizeof err), "%s", err);
    st_writer_free(w);
    unsigned char *bytes = read_file(path, n);
    *header_len = get_u64(bytes);
    return bytes;
}

// Opens path; a file it accepts must be self-consistent.
static void open_cleanly(const char *path, size_t file_size) {
    char err[1024] = "";
    StFile *f = st_open(path, err, sizeof err);
    if (!f) {
        ck_assert_msg(err[0] != 0, "rejected without a message");
        ck_assert_msg(strchr(err, '\n') == NULL, "error '%s' is not one line", err);
        return;
    }
    size_t total = 0;
    for (int i = 0; i < st_count(f); i++) {
        const StTensor *t = st_tensor(f, i);
        ck_assert_ptr_eq(st_find(f, t->name), t);
        total += t->n_bytes;
        unsigned char *copy = malloc(t->n_bytes + 1);  // reads every byte, for valgrind to vouch for
        ck_assert(st_copy_to(t, copy, t->n_bytes, err, sizeof err));
        free(copy);
    }
    ck_assert_uint_le(total, file_size);
    st_close(f);
}

START_TEST(test_every_truncation) {
    size_t n, header_len;
    unsigned char *bytes = small_valid_file(tmp_file("whole.safetensors").s, &n, &header_len);
    Path path_buf = tmp_file("truncated.safetensors");
    const char *path = path_buf.s;
    for (size_t len = 0; len < n; len++) {
        write_file(path, bytes, len);
        char err[1024] = "";
        StFile *f = st_open(path, err, sizeof err);
        ck_assert_msg(f == NULL, "truncated to %zu of %zu bytes but accepted", len, n);
        ck_assert_msg(err[0] != 0, "truncated to %zu: no message", len);
    }
    free(bytes);
}
END_TEST

START_TEST(test_header_byte_flips) {
    size_t n, header_len;
    unsigned char *bytes = small_valid_file(tmp_file("flip_source.safetensors").s, &n, &header_len);
    Path path_buf = tmp_file("flipped.safetensors");
    const char *path = path_buf.s;
    for (size_t pos = 0; pos < 8 + header_len; pos++) {
        unsigned char original = bytes[pos];
        const unsigned char values[] = {0x00, 0xFF, '"', '{', ']', '9', '-', original ^ 0x01,
                                        original ^ 0x80};
        for (size_t v = 0; v < sizeof values; v++) {
            bytes[pos] = values[v];
            write_file(path, bytes, n);
            open_cleanly(path, n);
        }
        bytes[pos] = original;
    }
    free(bytes);
}
END_TEST

// The data hash: the writer's (tensors hashed one by one, sizes that split the 8-byte words and
// 32-byte chunks) equals the reader's over the written block, whether the file was read whole or
// only its header (then the data is hashed from disk); changing any one byte of the block changes
// both.
START_TEST(test_data_hash) {
    char err[512];
    static const uint8_t odd[5] = {1, 2, 3, 4, 5};
    float ramp[40];
    for (int i = 0; i < 40; i++) ramp[i] = (float)i * 0.5f;
    StWriter *w = st_writer_new();
    ck_assert(st_writer_add(w, "a", ST_F32, 1, (int64_t[]){3}, F32, err, sizeof err));
    ck_assert(st_writer_add(w, "b", ST_U8, 1, (int64_t[]){5}, odd, err, sizeof err));
    ck_assert(st_writer_add(w, "c", ST_F32, 1, (int64_t[]){40}, ramp, err, sizeof err));
    uint64_t written = st_writer_data_hash(w), read;
    Path path_buf = tmp_file("hash.safetensors");
    const char *path = path_buf.s;
    ck_assert_msg(st_write(w, path, err, sizeof err), "%s", err);
    st_writer_free(w);
    StFile *f = open_ok(path);
    ck_assert(st_data_hash(f, &read, err, sizeof err));
    ck_assert_uint_eq(read, written);
    st_close(f);
    size_t n;
    unsigned char *bytes = read_file(path, &n);
    size_t data_start = 8 + get_u64(bytes);
    ck_assert_uint_eq(n - data_start, 12 + 5 + 160);
    for (size_t pos = data_start; pos < n; pos++) {
        bytes[pos] ^= 0x01;
        write_file(path, bytes, n);
        f = open_ok(path);
        ck_assert(st_data_hash(f, &read, err, sizeof err));
        ck_assert_msg(read != written, "a flipped bit at byte %zu left the hash unchanged", pos);
        st_close(f);
        StFile *lazy = st_open_header(path, err, sizeof err);
        ck_assert_msg(lazy != NULL, "%s", err);
        ck_assert(st_data_hash(lazy, &read, err, sizeof err));
        ck_assert_msg(read != written, "header-only: a flipped bit at byte %zu left the hash unchanged", pos);
        st_close(lazy);
        bytes[pos] ^= 0x01;
    }
    write_file(path, bytes, n);  // the file as written again
    free(bytes);
    StFile *lazy = st_open_header(path, err, sizeof err);
    ck_assert_msg(lazy != NULL, "%s", err);
    ck_assert(st_data_hash(lazy, &read, err, sizeof err));
    ck_assert_uint_eq(read, written);
    st_close(lazy);
}
END_TEST

// A data block larger than the chunk the header-only hash reads at a time (4 MiB), with a length
// that is no multiple of it nor of 32: both readers give the writer's hash.
START_TEST(test_data_hash_large) {
    char err[512];
    const int64_t n = (int64_t)(1 << 20) + 1234567;  // floats: 9.2 MB
    float *values = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) values[i] = (float)(i % 1000) - 0.25f;
    static const uint8_t tail[3] = {7, 8, 9};
    StWriter *w = st_writer_new();
    ck_assert(st_writer_add(w, "big", ST_F32, 1, (int64_t[]){n}, values, err, sizeof err));
    ck_assert(st_writer_add(w, "tail", ST_U8, 1, (int64_t[]){3}, tail, err, sizeof err));
    ck_assert(st_writer_add_data_hash(w, err, sizeof err));
    uint64_t written = st_writer_data_hash(w), whole, streamed;
    Path path_buf = tmp_file("hash_large.safetensors");
    ck_assert_msg(st_write(w, path_buf.s, err, sizeof err), "%s", err);
    st_writer_free(w);
    free(values);
    StFile *f = open_ok(path_buf.s);
    ck_assert(st_data_hash(f, &whole, err, sizeof err));
    st_close(f);
    StFile *lazy = st_open_header(path_buf.s, err, sizeof err);
    ck_assert_msg(lazy != NULL, "%s", err);
    ck_assert(st_data_hash(lazy, &streamed, err, sizeof err));
    ck_assert_msg(st_check_data_hash(lazy, err, sizeof err), "%s", err);
    st_close(lazy);
    ck_assert_uint_eq(whole, written);
    ck_assert_uint_eq(streamed, written);
}
END_TEST

// ---- atomic writes ---------------------------------------------------------------------------

START_TEST(test_write_into_missing_directory) {
    char err[512] = "", dir[512], path[600];
    snprintf(dir, sizeof dir, "%s", tmp_file("no_such_dir").s);
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    StWriter *w = st_writer_new();
    ck_assert(!st_write(w, path, err, sizeof err));
    st_writer_free(w);
    ck_assert_msg(strstr(err, "cannot create") && strstr(err, dir), "message: %s", err);
    struct stat st;
    ck_assert_int_ne(stat(dir, &st), 0);
}
END_TEST

START_TEST(test_overwrite_replaces_wholly) {
    char err[512], dir[512], path[600];
    snprintf(dir, sizeof dir, "%s", tmp_file("overwrite").s);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);

    // First a large file, then a small one over it: nothing of the first may remain.
    ck_assert_msg(write_fixture(path, true, err, sizeof err), "%s", err);
    const uint8_t one = 1;
    StWriter *w = st_writer_new();
    ck_assert(st_writer_add(w, "only", ST_U8, 1, (int64_t[]){1}, &one, err, sizeof err));
    ck_assert_msg(st_write(w, path, err, sizeof err), "%s", err);
    st_writer_free(w);
    StFile *f = open_ok(path);
    ck_assert_int_eq(st_count(f), 1);
    ck_assert_ptr_nonnull(st_find(f, "only"));
    ck_assert_int_eq(st_metadata_count(f), 0);
    st_close(f);
    ck_assert_int_eq(count_dir_entries(dir), 1);  // no temporary file left behind

    // A failed rename (the target is a directory) leaves the directory as it was and no temp.
    char blocker[700];
    snprintf(blocker, sizeof blocker, "%s/blocker", dir);
    ck_assert_int_eq(mkdir(blocker, 0700), 0);
    w = st_writer_new();
    ck_assert(!st_write(w, blocker, err, sizeof err));
    st_writer_free(w);
    ck_assert_ptr_nonnull(strstr(err, blocker));
    ck_assert_int_eq(count_dir_entries(dir), 2);
    ck_assert_int_eq(rmdir(blocker), 0);
    ck_assert_int_eq(unlink(path), 0);
    ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

// ---- main ------------------------------------------------------------------------------------

static Suite *safetensors_suite(void) {
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("core");
    // The robustness tests write a couple of thousand small files; Check's default 4 s is tight
    // on a loaded machine or under valgrind.
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_header_only_reads);
    tcase_add_test(tc, test_empty_file);
    tcase_add_test(tc, test_unaligned_foreign_file);
    tcase_add_test(tc, test_read_mismatches);
    tcase_add_test(tc, test_writer_rejects);
    tcase_add_test(tc, test_dtype_names);
    tcase_add_loop_test(tc, test_rejects_bad_header, 0, N_BAD_HEADERS);
    tcase_add_test(tc, test_rejects_bad_file);
    tcase_add_test(tc, test_every_truncation);
    tcase_add_test(tc, test_header_byte_flips);
    tcase_add_test(tc, test_data_hash);
    tcase_add_test(tc, test_data_hash_large);
    tcase_add_test(tc, test_write_into_missing_directory);
    tcase_add_test(tc, test_overwrite_replaces_wholly);
    suite_add_tcase(s, tc);
    return s;
}

// Removes the files the suite left in tmp_dir (it creates no subdirectories that outlive a test).
static void remove_tmp_dir(void) {
    DIR *d = opendir(tmp_dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) unlink(tmp_file(e->d_name).s);
    closedir(d);
    rmdir(tmp_dir);
}

int main(int argc, char **argv) {
    memset(long_name, 'x', sizeof long_name - 1);
    if (argc == 3 && strcmp(argv[1], "write") == 0) return tool_write(argv[2]);
    if (argc == 3 && strcmp(argv[1], "check") == 0) return tool_check(argv[2]);
    if (argc != 1) {
        fprintf(stderr, "usage: %s [write PATH | check PATH]\n", argv[0]);
        return 2;
    }
    const char *base = getenv("TEST_TMP") ? getenv("TEST_TMP") : "/tmp";
    snprintf(tmp_dir, sizeof tmp_dir, "%s/test_safetensors.XXXXXX", base);
    if (!mkdtemp(tmp_dir)) {
        perror(tmp_dir);
        return 1;
    }
    SRunner *runner = srunner_create(safetensors_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    remove_tmp_dir();
    return failed == 0 ? 0 : 1;
}
