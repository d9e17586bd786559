#include "safetensors.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "hash.h"
#include "json.h"
#include "log.h"

// Tensor bytes go between memory and file unchanged, which is only right on a little-endian host.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors stores little-endian data; this code copies it as-is"
#endif

#define METADATA_KEY "__metadata__"
#define DATA_HASH_KEY "data_hash"
#define METADATA_HASH_KEY "metadata_hash"
// Same cap as the reference Rust implementation: a larger header is a corrupt or hostile file,
// and refusing it early keeps us from allocating for a bogus length.
#define HEADER_LIMIT 100000000ULL
// Integers above 2^53 do not survive cJSON's double; no real file needs offsets that large.
#define JSON_INT_LIMIT 9007199254740992.0

static const struct {
    const char *name;
    size_t size;
} DTYPES[ST_N_DTYPES] = {
    [ST_F64] = {"F64", 8}, [ST_F32] = {"F32", 4}, [ST_F16] = {"F16", 2}, [ST_BF16] = {"BF16", 2},
    [ST_I64] = {"I64", 8}, [ST_I32] = {"I32", 4}, [ST_I16] = {"I16", 2}, [ST_I8] = {"I8", 1},
    [ST_U64] = {"U64", 8}, [ST_U32] = {"U32", 4}, [ST_U16] = {"U16", 2}, [ST_U8] = {"U8", 1},
    [ST_BOOL] = {"BOOL", 1},
};

static bool dtype_valid(StDtype dtype) { return (unsigned)dtype < ST_N_DTYPES; }

size_t st_dtype_size(StDtype dtype) { return dtype_valid(dtype) ? DTYPES[dtype].size : 0; }

const char *st_dtype_name(StDtype dtype) { return dtype_valid(dtype) ? DTYPES[dtype].name : "?"; }

bool st_dtype_parse(const char *name, StDtype *dtype) {
    for (int i = 0; i < ST_N_DTYPES; i++) {
        if (strcmp(name, DTYPES[i].name) == 0) {
            *dtype = (StDtype)i;
            return true;
        }
    }
    return false;
}

// ---- small helpers ---------------------------------------------------------------------------

// Messages quote names from the file, which may hold any character: control characters become
// '?' so that an error always stays on one line.
__attribute__((format(printf, 3, 4)))
static void set_err(char *err, size_t err_len, const char *fmt, ...) {
    if (!err || err_len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    for (char *c = err; *c; c++)
        if ((unsigned char)*c < 0x20) *c = '?';
}

static void *xrealloc(void *ptr, size_t bytes) {
    void *p = realloc(ptr, bytes ? bytes : 1);
    if (!p) fatal("safetensors: out of memory (%zu bytes)", bytes);
    return p;
}

static char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    return memcpy(xrealloc(NULL, n), s, n);
}

// Makes room for one more element in a growable array of `count` elements of `elem` bytes.
static void *grow(void *array, int count, int *capacity, size_t elem) {
    if (count < *capacity) return array;
    *capacity = *capacity ? 2 * *capacity : 16;
    return xrealloc(array, (size_t)*capacity * elem);
}

// Element and byte counts of a shape; false if a dim is negative or the product overflows size_t.
static bool shape_size(StDtype dtype, int ndim, const int64_t *shape, size_t *n_elements,
                       size_t *n_bytes) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (shape[i] != 0 && n > SIZE_MAX / (uint64_t)shape[i]) return false;
        n *= (size_t)shape[i];
    }
    size_t size = st_dtype_size(dtype);
    if (n > SIZE_MAX / size) return false;
    *n_elements = n;
    *n_bytes = n * size;
    return true;
}

// "[2, 3]" (or "[]" for a scalar), cut short if buf is too small.
static const char *format_shape(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (used < len) snprintf(buf + used, len - used, "]");
    return buf;
}

// ---- writer ----------------------------------------------------------------------------------

typedef struct {
    char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
    size_t n_bytes;
} WriterTensor;

typedef struct {
    char *key;
    char *value;
} MetadataPair;

struct StWriter {
    WriterTensor *tensors;
    int n_tensors, cap_tensors;
    MetadataPair *metadata;
    int n_metadata, cap_metadata;
};

StWriter *st_writer_new(void) {
    StWriter *w = xrealloc(NULL, sizeof *w);
    memset(w, 0, sizeof *w);
    return w;
}

void st_writer_free(StWriter *w) {
    if (!w) return;
    for (int i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    for (int i = 0; i < w->n_metadata; i++) {
        free(w->metadata[i].key);
        free(w->metadata[i].value);
    }
    free(w->tensors);
    free(w->metadata);
    free(w);
}

bool st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape,
                   const void *data, char *err, size_t err_len) {
    if (strcmp(name, METADATA_KEY) == 0) {
        set_err(err, err_len, "tensor name '%s' is reserved for metadata", name);
        return false;
    }
    for (int i = 0; i < w->n_tensors; i++) {
        if (strcmp(w->tensors[i].name, name) == 0) {
            set_err(err, err_len, "tensor '%s': duplicate name", name);
            return false;
        }
    }
    if (!dtype_valid(dtype)) {
        set_err(err, err_len, "tensor '%s': invalid dtype %d", name, (int)dtype);
        return false;
    }
    if (ndim < 0 || ndim > ST_MAX_DIMS) {
        set_err(err, err_len, "tensor '%s': %d dims, expected 0 to %d", name, ndim, ST_MAX_DIMS);
        return false;
    }
    WriterTensor t = {.dtype = dtype, .ndim = ndim, .data = data};
    size_t n_elements;
    if (!shape_size(dtype, ndim, shape, &n_elements, &t.n_bytes)) {
        char dims[256];
        set_err(err, err_len, "tensor '%s': invalid shape %s (negative dim or too large)", name,
                format_shape(dims, sizeof dims, ndim, shape));
        return false;
    }
    if (t.n_bytes > 0 && !data) {
        set_err(err, err_len, "tensor '%s': data is NULL", name);
        return false;
    }
    if (ndim > 0) memcpy(t.shape, shape, (size_t)ndim * sizeof *shape);
    t.name = xstrdup(name);
    w->tensors = grow(w->tensors, w->n_tensors, &w->cap_tensors, sizeof *w->tensors);
    w->tensors[w->n_tensors++] = t;
    return true;
}

bool st_writer_add_metadata(StWriter *w, const char *key, const char *value, char *err,
                            size_t err_len) {
    for (int i = 0; i < w->n_metadata; i++) {
        if (strcmp(w->metadata[i].key, key) == 0) {
            set_err(err, err_len, "metadata key '%s': duplicate", key);
            return false;
        }
    }
    w->metadata = grow(w->metadata, w->n_metadata, &w->cap_metadata, sizeof *w->metadata);
    w->metadata[w->n_metadata++] = (MetadataPair){xstrdup(key), xstrdup(value)};
    return true;
}

// Writes s as a JSON string. Bytes >= 0x80 pass through: names are taken to be UTF-8 already.
static void json_string(FILE *out, const char *s) {
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(out, "\\%c", *p);
        else if (*p < 0x20) fprintf(out, "\\u%04x", *p);
        else fputc(*p, out);
    }
    fputc('"', out);
}

// The JSON header, unpadded, in a malloc'd buffer. Printed by hand rather than through cJSON so
// that offsets stay plain integers (cJSON prints large doubles with exponents).
static char *build_header(const StWriter *w, size_t *len) {
    char *text = NULL;
    FILE *out = open_memstream(&text, len);
    if (!out) fatal("safetensors: cannot allocate the header");
    fputc('{', out);
    if (w->n_metadata > 0) {
        fputs("\"" METADATA_KEY "\":{", out);
        for (int i = 0; i < w->n_metadata; i++) {
            if (i) fputc(',', out);
            json_string(out, w->metadata[i].key);
            fputc(':', out);
            json_string(out, w->metadata[i].value);
        }
        fputc('}', out);
    }
    uint64_t offset = 0;
    for (int i = 0; i < w->n_tensors; i++) {
        const WriterTensor *t = &w->tensors[i];
        if (i > 0 || w->n_metadata > 0) fputc(',', out);
        json_string(out, t->name);
        fprintf(out, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) fprintf(out, "%s%" PRId64, d ? "," : "", t->shape[d]);
        fprintf(out, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", offset, offset + t->n_bytes);
        offset += t->n_bytes;
    }
    fputc('}', out);
    if (fclose(out) != 0) fatal("safetensors: cannot build the header");
    return text;
}

// ---- the data hash ----------------------------------------------------------------------------
// FNV-1a's step (hash.h), h = (h ^ word) * prime, on 8-byte words, in four lanes (words 0, 1, 2, 3
// of each 32-byte chunk: independent multiplies, so the hash runs near memory speed), then the
// lanes, the bytes past the last whole chunk and the length folded into one value. Each step is a bijection
// of h and of the word, so changing any one word changes the result. A stream: tensors given one
// by one hash as their concatenation does.
typedef struct {
    uint64_t lane[4], length;
    unsigned char pending[32];
    size_t n_pending;
} DataHash;

static void hash_chunk(DataHash *s, const unsigned char *p) {
    for (int i = 0; i < 4; i++) {
        uint64_t word;
        memcpy(&word, p + 8 * i, 8);
        s->lane[i] = fnv1a_word(s->lane[i], word);
    }
}

static void hash_update(DataHash *s, const unsigned char *p, size_t n) {
    s->length += n;
    if (s->n_pending) {
        size_t take = n < 32 - s->n_pending ? n : 32 - s->n_pending;
        memcpy(s->pending + s->n_pending, p, take);
        s->n_pending += take, p += take, n -= take;
        if (s->n_pending < 32) return;
        hash_chunk(s, s->pending);
        s->n_pending = 0;
    }
    for (; n >= 32; p += 32, n -= 32) hash_chunk(s, p);
    memcpy(s->pending, p, n);
    s->n_pending = n;
}

static uint64_t hash_final(const DataHash *s) {
    uint64_t h = FNV1A_BASIS;
    for (int i = 0; i < 4; i++) h = fnv1a_word(h, s->lane[i]);
    h = fnv1a_bytes(h, s->pending, s->n_pending);
    return fnv1a_word(h, s->length);
}

static DataHash hash_start(void) { return (DataHash){{FNV1A_BASIS, FNV1A_BASIS, FNV1A_BASIS, FNV1A_BASIS}, 0, {0}, 0}; }

uint64_t st_writer_data_hash(const StWriter *w) {
    DataHash s = hash_start();
    for (int i = 0; i < w->n_tensors; i++) hash_update(&s, w->tensors[i].data, w->tensors[i].n_bytes);
    return hash_final(&s);
}

// The metadata's hash: every pair but "metadata_hash" itself, in key order (a reader's JSON object
// may hold them in another order), each as key, NUL, value, NUL.
static int compare_pairs_by_key(const void *a, const void *b) {
    return strcmp(((const MetadataPair *)a)->key, ((const MetadataPair *)b)->key);
}
static uint64_t metadata_hash(MetadataPair *pairs, int n) {
    qsort(pairs, (size_t)n, sizeof *pairs, compare_pairs_by_key);
    DataHash s = hash_start();
    for (int i = 0; i < n; i++) {
        if (strcmp(pairs[i].key, METADATA_HASH_KEY) == 0) continue;
        hash_update(&s, (const unsigned char *)pairs[i].key, strlen(pairs[i].key) + 1);
        hash_update(&s, (const unsigned char *)pairs[i].value, strlen(pairs[i].value) + 1);
    }
    return hash_final(&s);
}

bool st_writer_add_data_hash(StWriter *w, char *err, size_t err_len) {
    char text[24];
    snprintf(text, sizeof text, "%016" PRIx64, st_writer_data_hash(w));
    if (!st_writer_add_metadata(w, DATA_HASH_KEY, text, err, err_len)) return false;
    MetadataPair *pairs = xrealloc(NULL, sizeof *pairs * (size_t)w->n_metadata);
    memcpy(pairs, w->metadata, sizeof *pairs * (size_t)w->n_metadata);  // the same strings, sorted apart
    snprintf(text, sizeof text, "%016" PRIx64, metadata_hash(pairs, w->n_metadata));
    free(pairs);
    return st_writer_add_metadata(w, METADATA_HASH_KEY, text, err, err_len);
}

bool st_write(const StWriter *w, const char *path, char *err, size_t err_len) {
    size_t header_len;
    char *header = build_header(w, &header_len);
    // Pad with spaces (valid JSON whitespace) so that the data block starts 8-byte aligned.
    size_t padded_len = (header_len + 7) / 8 * 8;
    static const char spaces[8] = "        ";
    unsigned char prefix[8];
    for (int i = 0; i < 8; i++) prefix[i] = (unsigned char)((uint64_t)padded_len >> (8 * i));

    AtomicFile file;
    if (!atomic_create(&file, path, err, err_len)) {
        free(header);
        return false;
    }
    // Write errors stick in the stream's error flag, which atomic_commit() checks.
    fwrite(prefix, 1, sizeof prefix, file.fp);
    fwrite(header, 1, header_len, file.fp);
    fwrite(spaces, 1, padded_len - header_len, file.fp);
    for (int i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].n_bytes > 0) fwrite(w->tensors[i].data, 1, w->tensors[i].n_bytes, file.fp);
    free(header);
    return atomic_commit(&file, err, err_len);
}

// ---- reader ----------------------------------------------------------------------------------

struct StFile {
    char *path;
    unsigned char *bytes;     // the whole file (st_open) or its first 8 + N bytes (st_open_header)
    size_t data_start, data_size;  // the data block: bytes[data_start ...] after st_open
    FILE *fp;                 // st_open_header only: where the tensor data is read from
    cJSON *header;            // kept: tensor names and metadata strings point into it
    const cJSON *metadata;    // the "__metadata__" object, or NULL
    StTensor *tensors;        // in header order
    int n_tensors;
    const StTensor **by_name; // sorted by name, for st_find()
};

// Where a tensor's bytes lie in the data block, kept while checking coverage.
typedef struct {
    uint64_t begin, end;
    int index;
} Span;

void st_close(StFile *f) {
    if (!f) return;
    free(f->path);
    free(f->bytes);
    if (f->fp) fclose(f->fp);
    cJSON_Delete(f->header);
    free(f->tensors);
    free(f->by_name);
    free(f);
}

// A JSON number that is an integer in [-2^53, 2^53]; false for anything else.
static bool json_integer(const cJSON *item, int64_t *value) {
    return json_whole_number(item, -JSON_INT_LIMIT, JSON_INT_LIMIT, value);
}

static bool parse_shape(const StFile *f, const char *name, const cJSON *shape_json, StTensor *t,
                        char *err, size_t err_len) {
    if (!cJSON_IsArray(shape_json)) {
        set_err(err, err_len, "%s: tensor '%s': missing or invalid shape", f->path, name);
        return false;
    }
    int ndim = cJSON_GetArraySize(shape_json);
    if (ndim > ST_MAX_DIMS) {
        set_err(err, err_len, "%s: tensor '%s': shape has %d dims, at most %d supported", f->path,
                name, ndim, ST_MAX_DIMS);
        return false;
    }
    t->ndim = 0;
    const cJSON *dim;
    cJSON_ArrayForEach(dim, shape_json) {
        int64_t value;
        if (!json_integer(dim, &value)) {
            set_err(err, err_len, "%s: tensor '%s': invalid shape (dims must be integers)", f->path,
                    name);
            return false;
        }
        if (value < 0) {
            set_err(err, err_len, "%s: tensor '%s': negative dim %" PRId64 " in shape", f->path,
                    name, value);
            return false;
        }
        t->shape[t->ndim++] = value;
    }
    return true;
}

static bool parse_offsets(const StFile *f, const char *name, const cJSON *offsets_json, Span *span,
                          char *err, size_t err_len) {
    int64_t begin, end;
    if (!cJSON_IsArray(offsets_json) || cJSON_GetArraySize(offsets_json) != 2 ||
        !json_integer(cJSON_GetArrayItem(offsets_json, 0), &begin) ||
        !json_integer(cJSON_GetArrayItem(offsets_json, 1), &end) || begin < 0 || end < begin) {
        set_err(err, err_len,
                "%s: tensor '%s': missing or invalid data_offsets (need [begin, end], "
                "0 <= begin <= end)",
                f->path, name);
        return false;
    }
    span->begin = (uint64_t)begin;
    span->end = (uint64_t)end;
    return true;
}

// Fills t (all but data) and span from one header entry.
static bool parse_entry(const StFile *f, const cJSON *entry, StTensor *t, Span *span, char *err,
                        size_t err_len) {
    const char *name = entry->string;
    t->name = name;
    if (!cJSON_IsObject(entry)) {
        set_err(err, err_len, "%s: tensor '%s': entry is not a JSON object", f->path, name);
        return false;
    }
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    if (!cJSON_IsString(dtype)) {
        set_err(err, err_len, "%s: tensor '%s': missing or non-string dtype", f->path, name);
        return false;
    }
    if (!st_dtype_parse(dtype->valuestring, &t->dtype)) {
        set_err(err, err_len, "%s: tensor '%s': unknown dtype '%s'", f->path, name,
                dtype->valuestring);
        return false;
    }
    if (!parse_shape(f, name, cJSON_GetObjectItemCaseSensitive(entry, "shape"), t, err, err_len) ||
        !parse_offsets(f, name, cJSON_GetObjectItemCaseSensitive(entry, "data_offsets"), span, err,
                       err_len))
        return false;
    char dims[256];
    format_shape(dims, sizeof dims, t->ndim, t->shape);
    if (!shape_size(t->dtype, t->ndim, t->shape, &t->n_elements, &t->n_bytes)) {
        set_err(err, err_len, "%s: tensor '%s': shape %s is too large", f->path, name, dims);
        return false;
    }
    if (t->n_bytes != span->end - span->begin) {
        set_err(err, err_len,
                "%s: tensor '%s': shape %s of %s needs %zu bytes but data_offsets [%" PRIu64
                ", %" PRIu64 "] span %" PRIu64,
                f->path, name, dims, st_dtype_name(t->dtype), t->n_bytes, span->begin, span->end,
                span->end - span->begin);
        return false;
    }
    return true;
}

static bool parse_metadata(StFile *f, const cJSON *metadata, char *err, size_t err_len) {
    if (f->metadata) {
        set_err(err, err_len, "%s: duplicate " METADATA_KEY " entry", f->path);
        return false;
    }
    if (!cJSON_IsObject(metadata)) {
        set_err(err, err_len, "%s: " METADATA_KEY " is not a JSON object", f->path);
        return false;
    }
    const cJSON *pair;
    cJSON_ArrayForEach(pair, metadata) {
        if (!cJSON_IsString(pair)) {
            set_err(err, err_len, "%s: " METADATA_KEY " value of '%s' is not a string", f->path,
                    pair->string);
            return false;
        }
    }
    f->metadata = metadata;
    return true;
}

static bool is_json_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// Parses the N header bytes into f->header; the JSON must be one object, then only whitespace.
static bool parse_json(StFile *f, const unsigned char *text, size_t len, char *err, size_t err_len) {
    // A private NUL-terminated copy, so that no parser path can run past the header.
    char *copy = xrealloc(NULL, len + 1);
    memcpy(copy, text, len);
    copy[len] = 0;
    const char *end = NULL;
    f->header = cJSON_ParseWithLengthOpts(copy, len, &end, false);
    size_t parsed = end ? (size_t)(end - copy) : 0;
    bool ok = f->header != NULL;
    if (!ok) set_err(err, err_len, "%s: header is not valid JSON (error near byte %zu)", f->path, parsed);
    while (ok && parsed < len && is_json_space(copy[parsed])) parsed++;
    if (ok && parsed < len) {
        set_err(err, err_len, "%s: header has unexpected bytes after the JSON (at byte %zu)", f->path,
                parsed);
        ok = false;
    }
    if (ok && !cJSON_IsObject(f->header)) {
        set_err(err, err_len, "%s: header is not a JSON object", f->path);
        ok = false;
    }
    free(copy);
    return ok;
}

static int compare_by_name(const void *a, const void *b) {
    return strcmp((*(const StTensor *const *)a)->name, (*(const StTensor *const *)b)->name);
}

static int compare_span(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

// Reads every entry of the header object into f->tensors (and spans, parallel to it).
static bool parse_entries(StFile *f, Span **spans, char *err, size_t err_len) {
    int n_entries = cJSON_GetArraySize(f->header);
    f->tensors = xrealloc(NULL, (size_t)n_entries * sizeof *f->tensors);
    *spans = xrealloc(NULL, (size_t)n_entries * sizeof **spans);
    const cJSON *entry;
    cJSON_ArrayForEach(entry, f->header) {
        if (strcmp(entry->string, METADATA_KEY) == 0) {
            if (!parse_metadata(f, entry, err, err_len)) return false;
            continue;
        }
        StTensor *t = &f->tensors[f->n_tensors];
        memset(t, 0, sizeof *t);
        if (!parse_entry(f, entry, t, &(*spans)[f->n_tensors], err, err_len)) return false;
        (*spans)[f->n_tensors].index = f->n_tensors;
        f->n_tensors++;
    }
    return true;
}

// Sorts the tensors by name for st_find(), rejecting a name that appears twice (cJSON keeps both).
static bool index_names(StFile *f, char *err, size_t err_len) {
    f->by_name = xrealloc(NULL, (size_t)f->n_tensors * sizeof *f->by_name);
    for (int i = 0; i < f->n_tensors; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, (size_t)f->n_tensors, sizeof *f->by_name, compare_by_name);
    for (int i = 1; i < f->n_tensors; i++) {
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0) {
            set_err(err, err_len, "%s: duplicate tensor name '%s'", f->path, f->by_name[i]->name);
            return false;
        }
    }
    return true;
}

// Checks that the spans tile [0, data_size) exactly, then points each tensor at its bytes (data is
// NULL when they stay on disk; data_start is where they begin in the file).
static bool check_coverage(StFile *f, Span *spans, const unsigned char *data, size_t data_start, size_t data_size,
                           char *err, size_t err_len) {
    uint64_t needed = 0;
    for (int i = 0; i < f->n_tensors; i++)
        if (spans[i].end > needed) needed = spans[i].end;
    if (needed > data_size) {
        set_err(err, err_len, "%s: truncated: header says %" PRIu64
                " bytes of tensor data, file has %zu", f->path, needed, data_size);
        return false;
    }
    qsort(spans, (size_t)f->n_tensors, sizeof *spans, compare_span);
    uint64_t covered = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[spans[i].index].name;
        if (spans[i].begin < covered) {
            set_err(err, err_len, "%s: tensors '%s' and '%s' overlap in the data", f->path,
                    f->tensors[spans[i - 1].index].name, name);
            return false;
        }
        if (spans[i].begin > covered) {
            set_err(err, err_len, "%s: hole in the data: bytes [%" PRIu64 ", %" PRIu64
                    ") before tensor '%s' belong to no tensor", f->path, covered, spans[i].begin, name);
            return false;
        }
        covered = spans[i].end;
    }
    if (covered < data_size) {
        set_err(err, err_len, "%s: hole in the data: the last %" PRIu64
                " bytes belong to no tensor", f->path, data_size - covered);
        return false;
    }
    for (int i = 0; i < f->n_tensors; i++) {
        StTensor *t = &f->tensors[spans[i].index];
        t->data = data ? data + spans[i].begin : NULL;
        t->file_offset = data_start + spans[i].begin;
    }
    return true;
}

// The file's header length prefix, after checking the file has room for it.
static bool read_header_length(const StFile *f, size_t size, size_t *header_len, char *err,
                               size_t err_len) {
    if (size < 8) {
        set_err(err, err_len, "%s: too short for a safetensors file (%zu bytes, need at least 8)",
                f->path, size);
        return false;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | f->bytes[i];
    if (n > HEADER_LIMIT) {
        set_err(err, err_len, "%s: header length %" PRIu64 " is absurd (limit %llu bytes)",
                f->path, n, HEADER_LIMIT);
        return false;
    }
    if (n > size - 8) {
        set_err(err, err_len, "%s: truncated: header says %" PRIu64
                " bytes of JSON, file has %zu after the length", f->path, n, size - 8);
        return false;
    }
    *header_len = (size_t)n;
    return true;
}

StFile *st_open(const char *path, char *err, size_t err_len) {
    StFile *f = xrealloc(NULL, sizeof *f);
    memset(f, 0, sizeof *f);
    f->path = xstrdup(path);
    size_t size = 0, header_len = 0;
    Span *spans = NULL;
    f->bytes = read_whole_file(path, &size, err, err_len);
    bool ok = f->bytes && read_header_length(f, size, &header_len, err, err_len) &&
              parse_json(f, f->bytes + 8, header_len, err, err_len) &&
              parse_entries(f, &spans, err, err_len) && index_names(f, err, err_len) &&
              check_coverage(f, spans, f->bytes + 8 + header_len, 8 + header_len, size - 8 - header_len, err,
                             err_len);
    free(spans);
    if (!ok) {
        st_close(f);
        return NULL;
    }
    f->data_start = 8 + header_len, f->data_size = size - 8 - header_len;
    return f;
}

// Reads n bytes at offset of f->fp into dst; false on a short read.
static bool read_at(const StFile *f, uint64_t offset, size_t n, void *dst, char *err, size_t err_len) {
    if (n == 0) return true;
    ssize_t got = pread(fileno(f->fp), dst, n, (off_t)offset);
    if (got != (ssize_t)n) {
        set_err(err, err_len, "%s: cannot read %zu bytes at offset %" PRIu64, f->path, n, offset);
        return false;
    }
    return true;
}

StFile *st_open_header(const char *path, char *err, size_t err_len) {
    StFile *f = xrealloc(NULL, sizeof *f);
    memset(f, 0, sizeof *f);
    f->path = xstrdup(path);
    size_t header_len = 0;
    Span *spans = NULL;
    struct stat st;
    f->fp = fopen_regular(path, err, err_len);
    bool ok = f->fp != NULL && fstat(fileno(f->fp), &st) == 0;
    size_t size = ok ? (size_t)st.st_size : 0;
    f->bytes = xrealloc(NULL, 8);
    ok = ok && (size < 8 || read_at(f, 0, 8, f->bytes, err, err_len)) &&
         read_header_length(f, size, &header_len, err, err_len);
    if (ok) f->bytes = xrealloc(f->bytes, 8 + header_len);
    ok = ok && read_at(f, 8, header_len, f->bytes + 8, err, err_len) &&
         parse_json(f, f->bytes + 8, header_len, err, err_len) && parse_entries(f, &spans, err, err_len) &&
         index_names(f, err, err_len) && check_coverage(f, spans, NULL, 8 + header_len, size - 8 - header_len, err, err_len);
    free(spans);
    if (!ok) {
        st_close(f);
        return NULL;
    }
    f->data_start = 8 + header_len, f->data_size = size - 8 - header_len;
    return f;
}

bool st_read_bytes(const StFile *f, const StTensor *t, size_t byte_offset, size_t n, void *dst, char *err,
                   size_t err_len) {
    if (byte_offset > t->n_bytes || n > t->n_bytes - byte_offset) {
        set_err(err, err_len, "%s: tensor '%s': bytes [%zu, %zu) are past its %zu bytes", f->path, t->name,
                byte_offset, byte_offset + n, t->n_bytes);
        return false;
    }
    if (t->data) {
        if (n > 0) memcpy(dst, (const unsigned char *)t->data + byte_offset, n);
        return true;
    }
    return read_at(f, t->file_offset + byte_offset, n, dst, err, err_len);
}

const char *st_path(const StFile *f) { return f->path; }

int st_count(const StFile *f) { return f->n_tensors; }

const StTensor *st_tensor(const StFile *f, int index) {
    return index >= 0 && index < f->n_tensors ? &f->tensors[index] : NULL;
}

static int compare_name_key(const void *key, const void *element) {
    return strcmp(key, (*(const StTensor *const *)element)->name);
}

const StTensor *st_find(const StFile *f, const char *name) {
    const StTensor **found = bsearch(name, f->by_name, (size_t)f->n_tensors, sizeof *f->by_name,
                                     compare_name_key);
    return found ? *found : NULL;
}

int st_metadata_count(const StFile *f) { return f->metadata ? cJSON_GetArraySize(f->metadata) : 0; }

bool st_metadata_entry(const StFile *f, int index, const char **key, const char **value) {
    const cJSON *pair = index >= 0 && f->metadata ? cJSON_GetArrayItem(f->metadata, index) : NULL;
    if (!pair) return false;
    *key = pair->string;
    *value = pair->valuestring;
    return true;
}

bool st_data_hash(const StFile *f, uint64_t *hash, char *err, size_t err_len) {
    DataHash s = hash_start();
    if (!f->fp) {
        hash_update(&s, f->bytes + f->data_start, f->data_size);
    } else {  // st_open_header: the data streamed from disk, a chunk at a time (the hash is chunk-blind)
        enum { CHUNK = 1 << 22 };
        unsigned char *buffer = xrealloc(NULL, CHUNK);
        for (size_t done = 0; done < f->data_size;) {
            size_t n = f->data_size - done < CHUNK ? f->data_size - done : CHUNK;
            if (!read_at(f, f->data_start + done, n, buffer, err, err_len)) {
                free(buffer);
                return false;
            }
            hash_update(&s, buffer, n);
            done += n;
        }
        free(buffer);
    }
    *hash = hash_final(&s);
    return true;
}

// False (and err) when the file records a "metadata_hash" that its metadata no longer matches.
static bool check_metadata_hash(const StFile *f, char *err, size_t err_len) {
    const char *recorded = st_metadata(f, METADATA_HASH_KEY);
    if (!recorded) return true;  // written before metadata hashes
    int n = st_metadata_count(f);
    MetadataPair *pairs = xrealloc(NULL, sizeof *pairs * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) {
        const char *key = "", *value = "";
        st_metadata_entry(f, i, &key, &value);
        pairs[i] = (MetadataPair){(char *)key, (char *)value};  // read only
    }
    char text[24];
    snprintf(text, sizeof text, "%016" PRIx64, metadata_hash(pairs, n));
    free(pairs);
    if (strcmp(text, recorded) == 0) return true;
    set_err(err, err_len, "%s: the metadata does not match the hash its writer recorded (%s, now %s): the file "
            "was damaged or edited after it was written", f->path, recorded, text);
    return false;
}

bool st_check_data_hash(const StFile *f, char *err, size_t err_len) {
    if (!check_metadata_hash(f, err, err_len)) return false;
    const char *recorded = st_metadata(f, DATA_HASH_KEY);
    uint64_t hash;
    char text[24];
    if (!recorded) return true;
    if (!st_data_hash(f, &hash, err, err_len)) return false;
    snprintf(text, sizeof text, "%016" PRIx64, hash);
    if (strcmp(text, recorded) == 0) return true;
    set_err(err, err_len, "%s: the tensor data does not match the hash its writer recorded (%s, now %s): the file "
            "was damaged after it was written", f->path, recorded, text);
    return false;
}

const char *st_metadata(const StFile *f, const char *key) {
    const cJSON *pair = f->metadata ? cJSON_GetObjectItemCaseSensitive(f->metadata, key) : NULL;
    return pair ? pair->valuestring : NULL;
}

bool st_copy_to(const StTensor *t, void *dst, size_t dst_bytes, char *err, size_t err_len) {
    if (dst_bytes != t->n_bytes) {
        set_err(err, err_len, "tensor '%s': has %zu bytes, destination holds %zu", t->name,
                t->n_bytes, dst_bytes);
        return false;
    }
    if (t->n_bytes > 0) memcpy(dst, t->data, t->n_bytes);
    return true;
}

bool st_read(const StFile *f, const char *name, StDtype dtype, int ndim, const int64_t *shape,
             void *dst, char *err, size_t err_len) {
    const StTensor *t = st_find(f, name);
    if (!t) {
        set_err(err, err_len, "%s: no tensor named '%s'", f->path, name);
        return false;
    }
    if (t->dtype != dtype) {
        set_err(err, err_len, "%s: tensor '%s': dtype %s, expected %s", f->path, name,
                st_dtype_name(t->dtype), st_dtype_name(dtype));
        return false;
    }
    if (t->ndim != ndim || (ndim > 0 && memcmp(t->shape, shape, (size_t)ndim * sizeof *shape) != 0)) {
        char have[256], want[256];
        set_err(err, err_len, "%s: tensor '%s': shape %s, expected %s", f->path, name,
                format_shape(have, sizeof have, t->ndim, t->shape),
                format_shape(want, sizeof want, ndim, shape));
        return false;
    }
    return st_copy_to(t, dst, t->n_bytes, err, err_len);
}
