#include "trace.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "hash.h"
#include "log.h"

// ================================================================================================
// Growable arrays and byte buffers
// ================================================================================================

#define ARRAY(T) struct { T *at; size_t n, cap; }
// Appends one element and returns a pointer to it; doubling keeps millions of appends linear.
#define PUSH(a) ((a).at = grow_for((a).at, &(a).cap, (a).n + 1, sizeof *(a).at), &(a).at[(a).n++])

static void *grow_for(void *ptr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return ptr;
    size_t new_cap = *cap ? *cap * 2 : 16;
    if (new_cap < need) new_cap = need;
    void *grown = realloc(ptr, new_cap * elem);
    if (!grown) fatal("trace: out of memory growing a buffer to %zu elements", new_cap);
    *cap = new_cap;
    return grown;
}

typedef struct {
    unsigned char *at;
    size_t n, cap;
} Bytes;

static void bytes_put(Bytes *b, const void *src, size_t len) {
    b->at = grow_for(b->at, &b->cap, b->n + len, 1);
    memcpy(b->at + b->n, src, len);
    b->n += len;
}

// ================================================================================================
// The per-rank buffer
// ================================================================================================

#define NONE UINT32_MAX
#define OPEN_END INT64_MIN  // Slice.end of a slice that has not ended yet

// Every name, category, key and string value is stored once; records hold 32-bit ids.
// chars holds the strings back to back, each NUL-terminated. slots (an open-addressing hash table
// of id+1, 0 = empty) exists only while recording.
typedef struct {
    Bytes chars;
    ARRAY(uint32_t) offsets;
    uint32_t *slots;
    size_t n_slots;
} Strings;

typedef struct {
    uint32_t name;
    uint32_t open;    // innermost open slice (recording only)
    int64_t last_ts;  // latest timestamp on this track (recording only)
} Track;

typedef struct {
    int64_t begin, end;
    uint32_t track, name, category;
    uint32_t parent;               // enclosing open slice when this one began (recording only)
    uint32_t first_att, last_att;  // linked list of attachments, in the order they were added
} Slice;

typedef enum { ATT_INT, ATT_DOUBLE, ATT_STR, ATT_FLOW_OUT, ATT_FLOW_IN, ATT_N_KINDS } AttKind;

// An arg or a flow end of a slice. value holds an int64, a double's bits, a string id or a flow id.
static bool is_arg(uint32_t kind) { return kind == ATT_INT || kind == ATT_DOUBLE || kind == ATT_STR; }

typedef struct {
    uint32_t kind, key, next;
    uint64_t value;
} Attachment;

typedef struct {
    double value;
    uint32_t counter;
} Sample;

typedef enum { EV_BEGIN, EV_END, EV_COUNTER, EV_N_KINDS } EventKind;

// The log of begins, ends and counter samples in recording order. Per track it is in time order
// and in nesting order, so a stable sort by time of all logs keeps every track's nesting intact,
// even where a child begins or ends at the same nanosecond as its parent.
typedef struct {
    int64_t ts;
    uint32_t kind, ref;  // ref: slice index (begin, end) or sample index (counter)
} Event;

struct TraceRankData {
    int32_t rank;
    uint32_t process_name;
    Strings strings;
    ARRAY(Track) tracks;
    ARRAY(uint32_t) counters;  // name id of each counter track
    ARRAY(Slice) slices;
    ARRAY(Attachment) atts;
    ARRAY(Sample) samples;
    ARRAY(Event) events;
};

static const char *string_at(const TraceRankData *d, uint32_t id) {
    return (const char *)d->strings.chars.at + d->strings.offsets.at[id];
}

static void strings_rehash(Strings *st, size_t n_slots) {
    free(st->slots);
    st->slots = calloc(n_slots, sizeof *st->slots);
    if (!st->slots) fatal("trace: out of memory for the string table");
    st->n_slots = n_slots;
    for (uint32_t id = 0; id < st->offsets.n; id++) {
        size_t i = fnv1a_string(FNV1A_BASIS, (const char *)st->chars.at + st->offsets.at[id]) & (n_slots - 1);
        while (st->slots[i]) i = (i + 1) & (n_slots - 1);
        st->slots[i] = id + 1;
    }
}

static uint32_t intern(TraceRankData *d, const char *s) {
    Strings *st = &d->strings;
    if (!s) s = "";
    if (2 * (st->offsets.n + 1) > st->n_slots) strings_rehash(st, st->n_slots ? 2 * st->n_slots : 64);
    size_t i = fnv1a_string(FNV1A_BASIS, s) & (st->n_slots - 1);
    for (; st->slots[i]; i = (i + 1) & (st->n_slots - 1))
        if (strcmp(string_at(d, st->slots[i] - 1), s) == 0) return st->slots[i] - 1;
    size_t len = strlen(s) + 1;
    if (st->chars.n + len > UINT32_MAX) fatal("trace: more than 4 GiB of distinct strings");
    *PUSH(st->offsets) = (uint32_t)st->chars.n;
    bytes_put(&st->chars, s, len);
    st->slots[i] = (uint32_t)st->offsets.n;
    return (uint32_t)st->offsets.n - 1;
}

void trace_rank_data_free(TraceRankData *d) {
    if (!d) return;
    free(d->strings.chars.at);
    free(d->strings.offsets.at);
    free(d->strings.slots);
    free(d->tracks.at);
    free(d->counters.at);
    free(d->slices.at);
    free(d->atts.at);
    free(d->samples.at);
    free(d->events.at);
    free(d);
}

static TraceRankData *rank_data_new(void) {
    TraceRankData *d = calloc(1, sizeof *d);
    if (!d) fatal("trace: out of memory");
    return d;
}

// ================================================================================================
// Recording
// ================================================================================================

// The only state: NULL means disabled, and every recording call tests just this.
static TraceRankData *local;

// Two threads record: the main thread (compute) and the comm stream's worker (common/comm.c). One
// lock guards the buffer; it is recursive because entry points call one another (trace_serialize,
// the writers). The unlocked atomic read of `local` in front of it keeps disabled tracing at one
// load and no lock. `local` only changes under the lock.
static pthread_mutex_t buffer_lock;
static pthread_once_t buffer_lock_once = PTHREAD_ONCE_INIT;

static void create_buffer_lock(void) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&buffer_lock, &attr);
    pthread_mutexattr_destroy(&attr);
}

static void lock_buffer(void) {
    pthread_once(&buffer_lock_once, create_buffer_lock);
    pthread_mutex_lock(&buffer_lock);
}

static void unlock_buffer(void) { pthread_mutex_unlock(&buffer_lock); }

static bool is_recording(void) { return __atomic_load_n(&local, __ATOMIC_ACQUIRE) != NULL; }

// Takes the lock when recording is on. False, without the lock, when it is off (or was switched
// off by another thread between the test and the lock).
static bool lock_if_recording(void) {
    if (!is_recording()) return false;
    lock_buffer();
    if (local) return true;
    unlock_buffer();
    return false;
}

static void set_local(TraceRankData *d) { __atomic_store_n(&local, d, __ATOMIC_RELEASE); }

void trace_init(int rank, const char *process_name) {
    if (rank < 0) fatal("trace_init: rank %d is negative", rank);
    lock_buffer();
    trace_shutdown();
    TraceRankData *d = rank_data_new();
    d->rank = rank;
    d->process_name = intern(d, process_name);
    set_local(d);
    unlock_buffer();
}

void trace_shutdown(void) {
    lock_buffer();
    trace_rank_data_free(local);
    set_local(NULL);
    unlock_buffer();
}

bool trace_enabled(void) { return is_recording(); }
const TraceRankData *trace_local(void) { return local; }
int trace_rank(const TraceRankData *d) { return d ? d->rank : -1; }

// Thread ids in the pftrace are pid * 1000 + handle + 1, unique across ranks.
#define MAX_TRACKS 999

int trace_track(const char *name) {
    if (!lock_if_recording()) return 0;
    uint32_t id = intern(local, name);
    size_t handle = 0;
    while (handle < local->tracks.n && local->tracks.at[handle].name != id) handle++;
    if (handle == local->tracks.n) {
        if (handle == MAX_TRACKS) fatal("trace_track(\"%s\"): more than %d tracks", name, MAX_TRACKS);
        *PUSH(local->tracks) = (Track){.name = id, .open = NONE, .last_ts = INT64_MIN};
    }
    unlock_buffer();
    return (int)handle;
}

static Track *checked_track(int track, const char *caller) {
    if (track < 0 || (size_t)track >= local->tracks.n)
        fatal("%s: track handle %d was not returned by trace_track() (%zu tracks exist)", caller, track,
              local->tracks.n);
    return &local->tracks.at[track];
}

// Time may not go backwards on a track: that is what makes per-track nesting survive the sort.
static void advance_track_clock(Track *t, int64_t ts, const char *caller, const char *slice_name) {
    if (ts < t->last_ts)
        fatal("%s: track '%s', slice '%s': timestamp %" PRId64 " ns is earlier than the track's last "
              "event at %" PRId64 " ns",
              caller, string_at(local, t->name), slice_name, ts, t->last_ts);
    t->last_ts = ts;
}

static void log_event(int64_t ts, EventKind kind, size_t ref) {
    if (ref >= NONE) fatal("trace: more than %u records of one kind", NONE - 1);
    *PUSH(local->events) = (Event){.ts = ts, .kind = kind, .ref = (uint32_t)ref};
}

void trace_begin_at(int track, const char *name, const char *category, int64_t ts_ns) {
    if (!lock_if_recording()) return;
    Track *t = checked_track(track, "trace_begin");
    advance_track_clock(t, ts_ns, "trace_begin", name ? name : "");
    size_t index = local->slices.n;
    *PUSH(local->slices) = (Slice){
        .begin = ts_ns, .end = OPEN_END, .track = (uint32_t)track, .name = intern(local, name),
        .category = intern(local, category), .parent = t->open, .first_att = NONE, .last_att = NONE};
    log_event(ts_ns, EV_BEGIN, index);
    t->open = (uint32_t)index;
    unlock_buffer();
}

void trace_end_at(int track, int64_t ts_ns) {
    if (!lock_if_recording()) return;
    Track *t = checked_track(track, "trace_end");
    if (t->open == NONE) fatal("trace_end: track '%s' has no open slice", string_at(local, t->name));
    Slice *s = &local->slices.at[t->open];
    advance_track_clock(t, ts_ns, "trace_end", string_at(local, s->name));
    s->end = ts_ns;
    log_event(ts_ns, EV_END, t->open);
    t->open = s->parent;
    unlock_buffer();
}

void trace_begin(int track, const char *name, const char *category) {
    if (is_recording()) trace_begin_at(track, name, category, now_ns());
}

void trace_end(int track) {
    if (is_recording()) trace_end_at(track, now_ns());
}

// Called with the lock held.
static void attach(int track, const char *caller, AttKind kind, uint32_t key, uint64_t value) {
    Track *t = checked_track(track, caller);
    if (t->open == NONE) fatal("%s: track '%s' has no open slice to attach to", caller, string_at(local, t->name));
    uint32_t index = (uint32_t)local->atts.n;
    if (local->atts.n >= NONE) fatal("trace: more than %u args and flows", NONE - 1);
    *PUSH(local->atts) = (Attachment){.kind = kind, .key = key, .next = NONE, .value = value};
    Slice *s = &local->slices.at[t->open];
    if (s->last_att == NONE)
        s->first_att = index;
    else
        local->atts.at[s->last_att].next = index;
    s->last_att = index;
}

void trace_arg_int(int track, const char *key, int64_t value) {
    if (!lock_if_recording()) return;
    attach(track, "trace_arg_int", ATT_INT, intern(local, key), (uint64_t)value);
    unlock_buffer();
}

void trace_arg_double(int track, const char *key, double value) {
    if (!lock_if_recording()) return;
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    attach(track, "trace_arg_double", ATT_DOUBLE, intern(local, key), bits);
    unlock_buffer();
}

void trace_arg_str(int track, const char *key, const char *value) {
    if (!lock_if_recording()) return;
    attach(track, "trace_arg_str", ATT_STR, intern(local, key), intern(local, value));
    unlock_buffer();
}

void trace_flow_out(int track, uint64_t flow_id) {
    if (!lock_if_recording()) return;
    attach(track, "trace_flow_out", ATT_FLOW_OUT, 0, flow_id);
    unlock_buffer();
}

void trace_flow_in(int track, uint64_t flow_id) {
    if (!lock_if_recording()) return;
    attach(track, "trace_flow_in", ATT_FLOW_IN, 0, flow_id);
    unlock_buffer();
}

uint64_t trace_flow_id(int src_rank, int dst_rank, uint64_t seq) {
    if (src_rank < 0 || src_rank >= 4096 || dst_rank < 0 || dst_rank >= 4096 || seq >= (1ull << 29))
        fatal("trace_flow_id(%d, %d, %" PRIu64 "): ranks must be in [0, 4096) and seq below 2^29", src_rank,
              dst_rank, seq);
    // +1 so that no id is 0, which trace readers treat as "no flow".
    return ((uint64_t)src_rank << 41 | (uint64_t)dst_rank << 29 | seq) + 1;
}

void trace_counter_at(const char *name, double value, int64_t ts_ns) {
    if (!lock_if_recording()) return;
    uint32_t id = intern(local, name);
    size_t counter = 0;
    while (counter < local->counters.n && local->counters.at[counter] != id) counter++;
    if (counter == local->counters.n) *PUSH(local->counters) = id;
    log_event(ts_ns, EV_COUNTER, local->samples.n);
    *PUSH(local->samples) = (Sample){.value = value, .counter = (uint32_t)counter};
    unlock_buffer();
}

void trace_counter(const char *name, double value) {
    if (is_recording()) trace_counter_at(name, value, now_ns());
}

void trace_memory_observer(MemCategory category, size_t current_bytes) {
    if (!is_recording()) return;
    char name[64];
    snprintf(name, sizeof name, "mem %s", mem_category_name(category));
    trace_counter(name, (double)current_bytes);
}

TraceStats trace_stats(const TraceRankData *d) {
    TraceStats st = {0};
    if (!d) return st;
    lock_buffer();  // d may be the buffer the other thread records into
    st.tracks = d->tracks.n;
    st.counters = d->counters.n;
    st.slices = d->slices.n;
    st.samples = d->samples.n;
    for (size_t i = 0; i < d->slices.n; i++) st.open_slices += d->slices.at[i].end == OPEN_END;
    for (size_t i = 0; i < d->atts.n; i++) {
        if (is_arg(d->atts.at[i].kind))
            st.args++;
        else
            st.flows++;
    }
    unlock_buffer();
    return st;
}

// ================================================================================================
// Serialization: one codec walks the buffer for both directions, so the two cannot drift apart.
// All integers are little-endian; recording-only fields are not stored.
// ================================================================================================

#define BLOB_MAGIC 0x31435254u  // "TRC1"
#define BLOB_VERSION 1u

typedef struct {
    bool reading, failed;
    Bytes out;                // writing
    const unsigned char *in;  // reading
    size_t in_len, pos;
} Codec;

static void io_le(Codec *c, uint64_t *v, int n_bytes) {
    if (!c->reading) {
        unsigned char raw[8];
        for (int k = 0; k < n_bytes; k++) raw[k] = (unsigned char)(*v >> (8 * k));
        bytes_put(&c->out, raw, (size_t)n_bytes);
        return;
    }
    if (c->failed || c->in_len - c->pos < (size_t)n_bytes) {
        c->failed = true;
        return;
    }
    uint64_t x = 0;
    for (int k = 0; k < n_bytes; k++) x |= (uint64_t)c->in[c->pos + k] << (8 * k);
    c->pos += (size_t)n_bytes;
    *v = x;
}

static void io_u32(Codec *c, uint32_t *v) {
    uint64_t x = *v;
    io_le(c, &x, 4);
    if (c->reading) *v = (uint32_t)x;
}

static void io_i64(Codec *c, int64_t *v) {
    uint64_t x = (uint64_t)*v;
    io_le(c, &x, 8);
    if (c->reading) *v = (int64_t)x;
}

static void io_f64(Codec *c, double *v) {
    uint64_t x;
    memcpy(&x, v, sizeof x);
    io_le(c, &x, 8);
    if (c->reading) memcpy(v, &x, sizeof x);
}

// The element count; when reading, also allocates the array. A count that the remaining bytes
// cannot hold marks the blob corrupt before anything large is allocated.
static void *io_array(Codec *c, void *at, size_t *n, size_t *cap, size_t elem, size_t min_bytes) {
    uint64_t count = *n;
    io_le(c, &count, 8);
    if (!c->reading) return at;
    if (c->failed || count > (c->in_len - c->pos) / min_bytes) {
        c->failed = true;
        return NULL;
    }
    void *fresh = calloc(count ? count : 1, elem);
    if (!fresh) fatal("trace: out of memory reading a blob");
    *n = *cap = count;
    return fresh;
}
#define IO_ARRAY(c, a, min_bytes) ((a).at = io_array(c, (a).at, &(a).n, &(a).cap, sizeof *(a).at, min_bytes))

static void io_strings(Codec *c, Strings *st) {
    IO_ARRAY(c, st->chars, 1);
    if (c->failed) return;
    if (!c->reading) {
        bytes_put(&c->out, st->chars.at, st->chars.n);
        return;
    }
    memcpy(st->chars.at, c->in + c->pos, st->chars.n);
    c->pos += st->chars.n;
    if (st->chars.n > UINT32_MAX || (st->chars.n && st->chars.at[st->chars.n - 1] != 0)) {
        c->failed = true;
        return;
    }
    for (size_t i = 0; i < st->chars.n; i++)
        if (i == 0 || st->chars.at[i - 1] == 0) *PUSH(st->offsets) = (uint32_t)i;
}

static void io_slice(Codec *c, Slice *s) {
    io_i64(c, &s->begin);
    io_i64(c, &s->end);
    io_u32(c, &s->track);
    io_u32(c, &s->name);
    io_u32(c, &s->category);
    io_u32(c, &s->first_att);
    io_u32(c, &s->last_att);
    if (c->reading) s->parent = NONE;
}

static void io_rank_data(Codec *c, TraceRankData *d) {
    uint32_t magic = BLOB_MAGIC, version = BLOB_VERSION, rank = (uint32_t)d->rank;
    io_u32(c, &magic);
    io_u32(c, &version);
    if (magic != BLOB_MAGIC || version != BLOB_VERSION) c->failed = true;
    io_u32(c, &rank);
    if (c->reading) d->rank = (int32_t)rank;
    io_u32(c, &d->process_name);
    io_strings(c, &d->strings);
    IO_ARRAY(c, d->tracks, 4);
    for (size_t i = 0; i < d->tracks.n; i++) {
        io_u32(c, &d->tracks.at[i].name);
        if (c->reading) d->tracks.at[i].open = NONE;
    }
    IO_ARRAY(c, d->counters, 4);
    for (size_t i = 0; i < d->counters.n; i++) io_u32(c, &d->counters.at[i]);
    IO_ARRAY(c, d->slices, 36);
    for (size_t i = 0; i < d->slices.n; i++) io_slice(c, &d->slices.at[i]);
    IO_ARRAY(c, d->atts, 20);
    for (size_t i = 0; i < d->atts.n; i++) {
        io_u32(c, &d->atts.at[i].kind);
        io_u32(c, &d->atts.at[i].key);
        io_u32(c, &d->atts.at[i].next);
        io_le(c, &d->atts.at[i].value, 8);
    }
    IO_ARRAY(c, d->samples, 12);
    for (size_t i = 0; i < d->samples.n; i++) {
        io_f64(c, &d->samples.at[i].value);
        io_u32(c, &d->samples.at[i].counter);
    }
    IO_ARRAY(c, d->events, 16);
    for (size_t i = 0; i < d->events.n; i++) {
        io_i64(c, &d->events.at[i].ts);
        io_u32(c, &d->events.at[i].kind);
        io_u32(c, &d->events.at[i].ref);
    }
}

bool trace_serialize_rank(const TraceRankData *d, void **blob, size_t *len) {
    *blob = NULL;
    *len = 0;
    if (!d) return false;
    Codec c = {.reading = false};
    lock_buffer();
    io_rank_data(&c, (TraceRankData *)d);  // writing only reads from d
    unlock_buffer();
    *blob = c.out.at;
    *len = c.out.n;
    return true;
}

bool trace_serialize(void **blob, size_t *len) {
    lock_buffer();
    bool ok = trace_serialize_rank(local, blob, len);
    unlock_buffer();
    return ok;
}

static bool is_index(uint32_t id, size_t n) { return id < n; }
static bool is_link(uint32_t id, size_t n) { return id == NONE || id < n; }

// Every id in a deserialized buffer must point inside its arrays, so the writers can trust them.
// Returns what is wrong, or NULL.
static const char *broken_reference(const TraceRankData *d) {
    size_t n_strings = d->strings.offsets.n;
    if (d->rank < 0) return "rank";
    if (!is_index(d->process_name, n_strings)) return "process name";
    for (size_t i = 0; i < d->tracks.n; i++)
        if (!is_index(d->tracks.at[i].name, n_strings)) return "track name";
    for (size_t i = 0; i < d->counters.n; i++)
        if (!is_index(d->counters.at[i], n_strings)) return "counter name";
    for (size_t i = 0; i < d->slices.n; i++) {
        const Slice *s = &d->slices.at[i];
        if (!is_index(s->track, d->tracks.n) || !is_index(s->name, n_strings) ||
            !is_index(s->category, n_strings) || !is_link(s->first_att, d->atts.n) ||
            !is_link(s->last_att, d->atts.n))
            return "slice";
        if (s->end != OPEN_END && s->end < s->begin) return "slice ends before it begins";
    }
    for (size_t i = 0; i < d->atts.n; i++) {
        const Attachment *a = &d->atts.at[i];
        // A later index only: a corrupt list can then never loop.
        if (a->kind >= ATT_N_KINDS || (a->next != NONE && (a->next <= i || a->next >= d->atts.n)) ||
            (is_arg(a->kind) && !is_index(a->key, n_strings)) || (a->kind == ATT_STR && a->value >= n_strings))
            return "arg or flow";
    }
    for (size_t i = 0; i < d->samples.n; i++)
        if (!is_index(d->samples.at[i].counter, d->counters.n)) return "counter sample";
    for (size_t i = 0; i < d->events.n; i++) {
        const Event *e = &d->events.at[i];
        size_t n_refs = e->kind == EV_COUNTER ? d->samples.n : d->slices.n;
        if (e->kind >= EV_N_KINDS || !is_index(e->ref, n_refs)) return "event";
        if (e->kind == EV_END && d->slices.at[e->ref].end == OPEN_END) return "end of an open slice";
    }
    return NULL;
}

TraceRankData *trace_deserialize(const void *blob, size_t len, char *err, size_t err_len) {
    TraceRankData *d = rank_data_new();
    Codec c = {.reading = true, .in = blob, .in_len = len};
    io_rank_data(&c, d);
    const char *broken = NULL;
    if (c.failed)
        broken = "truncated, or not a trace blob of this version";
    else if (c.pos != len)
        broken = "trailing bytes";
    else
        broken = broken_reference(d);
    if (broken) {
        snprintf(err, err_len, "trace blob (%zu bytes): corrupt: %s", len, broken);
        trace_rank_data_free(d);
        return NULL;
    }
    return d;
}

// ================================================================================================
// Merging ranks for the writers
// ================================================================================================

// Checks what both writers need and finds the shift that puts the earliest event at 1000 ns.
static bool check_ranks(const TraceRankInput *ranks, int n, int64_t *shift, char *err, size_t err_len) {
    if (n < 1) {
        snprintf(err, err_len, "no rank buffers to write");
        return false;
    }
    int64_t earliest = INT64_MAX;
    for (int r = 0; r < n; r++) {
        const TraceRankData *d = ranks[r].data;
        if (!d) {
            snprintf(err, err_len, "rank buffer %d is NULL", r);
            return false;
        }
        for (int q = 0; q < r; q++)
            if (ranks[q].data->rank == d->rank) {
                snprintf(err, err_len, "rank %d appears twice", d->rank);
                return false;
            }
        for (size_t i = 0; i < d->slices.n; i++) {
            const Slice *s = &d->slices.at[i];
            if (s->end == OPEN_END) {
                snprintf(err, err_len, "rank %d, track '%s': slice '%s' was never ended", d->rank,
                         string_at(d, d->tracks.at[s->track].name), string_at(d, s->name));
                return false;
            }
        }
        for (size_t i = 0; i < d->events.n; i++)
            if (d->events.at[i].ts + ranks[r].clock_offset_ns < earliest)
                earliest = d->events.at[i].ts + ranks[r].clock_offset_ns;
    }
    *shift = earliest == INT64_MAX ? 0 : 1000 - earliest;
    return true;
}

// One entry of the merged timeline. order breaks ties in time by insertion, which keeps each
// track's recording order (nesting) and puts a flow right after the slice it belongs to.
typedef enum { ITEM_BEGIN, ITEM_END, ITEM_COUNTER, ITEM_FLOW_OUT, ITEM_FLOW_IN } ItemKind;
typedef struct {
    int64_t ts;
    uint64_t order;
    uint32_t rank_index, kind, ref;  // ref: slice, sample or attachment index
} Item;
typedef ARRAY(Item) Items;

static int compare_items(const void *pa, const void *pb) {
    const Item *a = pa, *b = pb;
    if (a->ts != b->ts) return a->ts < b->ts ? -1 : 1;
    return a->order < b->order ? -1 : a->order > b->order;
}

static void add_item(Items *items, int64_t ts, int rank_index, ItemKind kind, size_t ref) {
    Item item = {.ts = ts, .order = items->n, .rank_index = (uint32_t)rank_index, .kind = kind, .ref = (uint32_t)ref};
    *PUSH(*items) = item;
}

// Begins, ends and counter samples of all ranks, in time order, timestamps shifted.
static Items merge_events(const TraceRankInput *ranks, int n, int64_t shift) {
    Items items = {0};
    for (int r = 0; r < n; r++) {
        const TraceRankData *d = ranks[r].data;
        for (size_t i = 0; i < d->events.n; i++) {
            const Event *e = &d->events.at[i];
            ItemKind kind = e->kind == EV_BEGIN ? ITEM_BEGIN : e->kind == EV_END ? ITEM_END : ITEM_COUNTER;
            add_item(&items, e->ts + ranks[r].clock_offset_ns + shift, r, kind, e->ref);
        }
    }
    if (items.n) qsort(items.at, items.n, sizeof *items.at, compare_items);
    return items;
}

static double att_double(const Attachment *a) {
    double v;
    memcpy(&v, &a->value, sizeof v);
    return v;
}

// ================================================================================================
// Perfetto protobuf writer
// ================================================================================================

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2 };

// Field numbers, from protos/perfetto/trace/... (see shared/notes/perfetto.md).
enum {
    TRACE_PACKET = 1,
    PACKET_TIMESTAMP = 8, PACKET_SEQUENCE_ID = 10, PACKET_TRACK_EVENT = 11, PACKET_SEQUENCE_FLAGS = 13,
    PACKET_TRACK_DESCRIPTOR = 60, PACKET_FIRST_ON_SEQUENCE = 87,
    TRACK_UUID = 1, TRACK_NAME = 2, TRACK_PROCESS = 3, TRACK_THREAD = 4, TRACK_PARENT_UUID = 5,
    TRACK_COUNTER = 8, TRACK_SIBLING_MERGE = 15,
    PROCESS_PID = 1, PROCESS_NAME = 6,
    THREAD_PID = 1, THREAD_TID = 2, THREAD_NAME = 5,
    COUNTER_UNIT = 3,
    EVENT_DEBUG_ANNOTATION = 4, EVENT_TYPE = 9, EVENT_TRACK_UUID = 11, EVENT_CATEGORY = 22, EVENT_NAME = 23,
    EVENT_DOUBLE_COUNTER = 44, EVENT_FLOW_IDS = 47, EVENT_TERMINATING_FLOW_IDS = 48,
    ANNOTATION_INT = 4, ANNOTATION_DOUBLE = 5, ANNOTATION_STRING = 6, ANNOTATION_NAME = 10,
};
enum { TYPE_SLICE_BEGIN = 1, TYPE_SLICE_END = 2, TYPE_COUNTER = 4 };
enum { SEQ_INCREMENTAL_STATE_CLEARED = 1, UNIT_BYTES = 3, SIBLING_MERGE_NONE = 2 };

static size_t varint_encode(unsigned char *out, uint64_t v) {
    size_t n = 0;
    for (; v >= 0x80; v >>= 7) out[n++] = (unsigned char)(v | 0x80);
    out[n++] = (unsigned char)v;
    return n;
}

static void pb_varint(Bytes *b, uint64_t v) {
    unsigned char raw[10];
    bytes_put(b, raw, varint_encode(raw, v));
}

static void pb_key(Bytes *b, uint32_t field, int wire) { pb_varint(b, (uint64_t)field << 3 | (uint64_t)wire); }

static void pb_uint(Bytes *b, uint32_t field, uint64_t v) {
    pb_key(b, field, WIRE_VARINT);
    pb_varint(b, v);
}

// int32/int64 fields: negative values are their 64-bit two's complement, 10 bytes.
static void pb_int(Bytes *b, uint32_t field, int64_t v) { pb_uint(b, field, (uint64_t)v); }

static void pb_fixed64(Bytes *b, uint32_t field, uint64_t v) {
    unsigned char raw[8];
    for (int k = 0; k < 8; k++) raw[k] = (unsigned char)(v >> (8 * k));
    pb_key(b, field, WIRE_FIXED64);
    bytes_put(b, raw, 8);
}

static void pb_double(Bytes *b, uint32_t field, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    pb_fixed64(b, field, bits);
}

static void pb_string(Bytes *b, uint32_t field, const char *s) {
    size_t len = strlen(s);
    pb_key(b, field, WIRE_LEN);
    pb_varint(b, len);
    bytes_put(b, s, len);
}

// A nested message is written in place; pb_close() then slides it right to insert its length.
// Messages here are small, so the move costs little and the length stays minimal.
static size_t pb_open(Bytes *b, uint32_t field) {
    pb_key(b, field, WIRE_LEN);
    return b->n;
}

static void pb_close(Bytes *b, size_t start) {
    unsigned char raw[10];
    size_t body = b->n - start, k = varint_encode(raw, body);
    b->at = grow_for(b->at, &b->cap, b->n + k, 1);
    memmove(b->at + start + k, b->at + start, body);
    memcpy(b->at + start, raw, k);
    b->n += k;
}

// Each rank is one packet sequence, one process (pid rank+1) and its tracks.
static uint32_t sequence_of(const TraceRankData *d) { return (uint32_t)d->rank + 1; }
static int64_t pid_of(const TraceRankData *d) { return (int64_t)d->rank + 1; }
static uint64_t process_uuid(const TraceRankData *d) { return (uint64_t)pid_of(d) << 32; }
static uint64_t thread_uuid(const TraceRankData *d, uint32_t track) { return process_uuid(d) | 1u << 30 | track; }
static uint64_t counter_uuid(const TraceRankData *d, uint32_t c) { return process_uuid(d) | 2u << 30 | c; }

static size_t packet_open(Bytes *b, const TraceRankData *d) {
    b->n = 0;
    size_t packet = pb_open(b, TRACE_PACKET);
    pb_uint(b, PACKET_SEQUENCE_ID, sequence_of(d));
    return packet;
}

static void packet_close(Bytes *b, size_t packet, FILE *fp) {
    pb_close(b, packet);
    fwrite(b->at, 1, b->n, fp);
}

// A TrackDescriptor packet: open it, fill in the kind-specific part, close it. The first packet
// of each sequence (the process descriptor) also says so.
typedef struct {
    size_t packet, track;
} OpenDescriptor;

static OpenDescriptor descriptor_open(Bytes *b, const TraceRankData *d, uint64_t uuid, bool first_on_sequence) {
    OpenDescriptor o = {.packet = packet_open(b, d)};
    if (first_on_sequence) {
        pb_uint(b, PACKET_FIRST_ON_SEQUENCE, 1);
        pb_uint(b, PACKET_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED);
    }
    o.track = pb_open(b, PACKET_TRACK_DESCRIPTOR);
    pb_uint(b, TRACK_UUID, uuid);
    return o;
}

static void descriptor_close(Bytes *b, OpenDescriptor o, FILE *fp) {
    pb_close(b, o.track);
    packet_close(b, o.packet, fp);
}

static void write_process_descriptor(Bytes *b, FILE *fp, const TraceRankData *d) {
    OpenDescriptor o = descriptor_open(b, d, process_uuid(d), true);
    size_t process = pb_open(b, TRACK_PROCESS);
    pb_int(b, PROCESS_PID, pid_of(d));
    pb_string(b, PROCESS_NAME, string_at(d, d->process_name));
    pb_close(b, process);
    descriptor_close(b, o, fp);
}

// Thread and counter tracks: names repeat across ranks, so no merging by name.
static void write_thread_descriptor(Bytes *b, FILE *fp, const TraceRankData *d, uint32_t t) {
    OpenDescriptor o = descriptor_open(b, d, thread_uuid(d, t), false);
    pb_uint(b, TRACK_SIBLING_MERGE, SIBLING_MERGE_NONE);
    size_t thread = pb_open(b, TRACK_THREAD);
    pb_int(b, THREAD_PID, pid_of(d));
    pb_int(b, THREAD_TID, pid_of(d) * 1000 + t + 1);
    pb_string(b, THREAD_NAME, string_at(d, d->tracks.at[t].name));
    pb_close(b, thread);
    descriptor_close(b, o, fp);
}

static void write_counter_descriptor(Bytes *b, FILE *fp, const TraceRankData *d, uint32_t c) {
    OpenDescriptor o = descriptor_open(b, d, counter_uuid(d, c), false);
    pb_uint(b, TRACK_SIBLING_MERGE, SIBLING_MERGE_NONE);
    pb_uint(b, TRACK_PARENT_UUID, process_uuid(d));
    pb_string(b, TRACK_NAME, string_at(d, d->counters.at[c]));
    size_t counter = pb_open(b, TRACK_COUNTER);
    pb_uint(b, COUNTER_UNIT, UNIT_BYTES);
    pb_close(b, counter);
    descriptor_close(b, o, fp);
}

static void write_annotation(Bytes *b, const TraceRankData *d, const Attachment *a) {
    size_t annotation = pb_open(b, EVENT_DEBUG_ANNOTATION);
    pb_string(b, ANNOTATION_NAME, string_at(d, a->key));
    if (a->kind == ATT_INT) pb_int(b, ANNOTATION_INT, (int64_t)a->value);
    if (a->kind == ATT_DOUBLE) pb_double(b, ANNOTATION_DOUBLE, att_double(a));
    if (a->kind == ATT_STR) pb_string(b, ANNOTATION_STRING, string_at(d, (uint32_t)a->value));
    pb_close(b, annotation);
}

// A flow starts at its sender's slice begin and ends at its receiver's slice end: a receive may
// well begin before the send does, but it cannot end before, and the importer drops a flow whose
// end it reads before its start.
static void write_slice_event(Bytes *b, FILE *fp, const TraceRankData *d, const Item *item) {
    const Slice *s = &d->slices.at[item->ref];
    bool begin = item->kind == ITEM_BEGIN;
    size_t packet = packet_open(b, d);
    pb_uint(b, PACKET_TIMESTAMP, (uint64_t)item->ts);
    size_t event = pb_open(b, PACKET_TRACK_EVENT);
    pb_uint(b, EVENT_TYPE, begin ? TYPE_SLICE_BEGIN : TYPE_SLICE_END);
    pb_uint(b, EVENT_TRACK_UUID, thread_uuid(d, s->track));
    if (begin) {
        pb_string(b, EVENT_NAME, string_at(d, s->name));
        if (*string_at(d, s->category)) pb_string(b, EVENT_CATEGORY, string_at(d, s->category));
    }
    for (uint32_t i = s->first_att; i != NONE; i = d->atts.at[i].next) {
        const Attachment *a = &d->atts.at[i];
        if (begin && a->kind == ATT_FLOW_OUT) pb_fixed64(b, EVENT_FLOW_IDS, a->value);
        if (!begin && a->kind == ATT_FLOW_IN) pb_fixed64(b, EVENT_TERMINATING_FLOW_IDS, a->value);
        if (begin && is_arg(a->kind)) write_annotation(b, d, a);
    }
    pb_close(b, event);
    packet_close(b, packet, fp);
}

static void write_counter_event(Bytes *b, FILE *fp, const TraceRankData *d, const Item *item) {
    const Sample *sample = &d->samples.at[item->ref];
    size_t packet = packet_open(b, d);
    pb_uint(b, PACKET_TIMESTAMP, (uint64_t)item->ts);
    size_t event = pb_open(b, PACKET_TRACK_EVENT);
    pb_uint(b, EVENT_TYPE, TYPE_COUNTER);
    pb_uint(b, EVENT_TRACK_UUID, counter_uuid(d, sample->counter));
    pb_double(b, EVENT_DOUBLE_COUNTER, sample->value);
    pb_close(b, event);
    packet_close(b, packet, fp);
}

static void write_pftrace_body(FILE *fp, const TraceRankInput *ranks, int n, int64_t shift) {
    Bytes b = {0};
    for (int r = 0; r < n; r++) {
        const TraceRankData *d = ranks[r].data;
        write_process_descriptor(&b, fp, d);
        for (uint32_t t = 0; t < d->tracks.n; t++) write_thread_descriptor(&b, fp, d, t);
        for (uint32_t c = 0; c < d->counters.n; c++) write_counter_descriptor(&b, fp, d, c);
    }
    Items items = merge_events(ranks, n, shift);
    for (size_t i = 0; i < items.n; i++) {
        const Item *item = &items.at[i];
        const TraceRankData *d = ranks[item->rank_index].data;
        if (item->kind == ITEM_COUNTER)
            write_counter_event(&b, fp, d, item);
        else
            write_slice_event(&b, fp, d, item);
    }
    free(items.at);
    free(b.at);
}

// Both writers: check, open the temporary file, write, commit.
typedef void (*BodyWriter)(FILE *fp, const TraceRankInput *ranks, int n, int64_t shift);

static bool write_atomically(const char *path, BodyWriter body, const TraceRankInput *ranks, int n, char *err,
                             size_t err_len) {
    lock_buffer();  // one of the buffers may be this process's, still recording on another thread
    int64_t shift;
    AtomicFile f;
    bool ok = check_ranks(ranks, n, &shift, err, err_len) && atomic_create(&f, path, err, err_len);
    if (ok) {
        body(f.fp, ranks, n, shift);
        ok = atomic_commit(&f, err, err_len);
    }
    unlock_buffer();
    return ok;
}

bool trace_write_pftrace_ranks(const char *path, const TraceRankInput *ranks, int n_ranks, char *err,
                               size_t err_len) {
    return write_atomically(path, write_pftrace_body, ranks, n_ranks, err, err_len);
}

// ================================================================================================
// Chrome-trace JSON writer (the PyTorch profiler's shape)
// ================================================================================================

static void json_string(FILE *fp, const char *s) {
    fputc('"', fp);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(fp, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", fp);
        else if (ch == '\t')
            fputs("\\t", fp);
        else if (ch < 0x20)
            fprintf(fp, "\\u%04x", ch);
        else
            fputc(ch, fp);
    }
    fputc('"', fp);
}

// Shortest form that reads back to the same double; JSON has no NaN or infinity, so those
// become strings.
static void json_double(FILE *fp, double v) {
    if (!isfinite(v)) {
        fputs(isnan(v) ? "\"nan\"" : v > 0 ? "\"inf\"" : "\"-inf\"", fp);
        return;
    }
    char text[32];
    snprintf(text, sizeof text, "%.15g", v);
    if (strtod(text, NULL) != v) snprintf(text, sizeof text, "%.17g", v);
    fputs(text, fp);
}

// Microseconds with the nanoseconds as an exact three-digit fraction (ns is never negative here).
static void json_us(FILE *fp, int64_t ns) { fprintf(fp, "%" PRId64 ".%03d", ns / 1000, (int)(ns % 1000)); }

static void json_args(FILE *fp, const TraceRankData *d, const Slice *s) {
    fputs("{", fp);
    const char *sep = "";
    for (uint32_t i = s->first_att; i != NONE; i = d->atts.at[i].next) {
        const Attachment *a = &d->atts.at[i];
        if (!is_arg(a->kind)) continue;
        fputs(sep, fp);
        json_string(fp, string_at(d, a->key));
        fputs(": ", fp);
        if (a->kind == ATT_INT) fprintf(fp, "%" PRId64, (int64_t)a->value);
        if (a->kind == ATT_DOUBLE) json_double(fp, att_double(a));
        if (a->kind == ATT_STR) json_string(fp, string_at(d, (uint32_t)a->value));
        sep = ", ";
    }
    fputs("}", fp);
}

static void json_metadata(FILE *fp, const TraceRankData *d, const char **sep) {
    fprintf(fp, "%s{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": {\"name\": ", *sep, d->rank);
    json_string(fp, string_at(d, d->process_name));
    fprintf(fp, "}},\n{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": %d, \"args\": {\"sort_index\": %d}}",
            d->rank, d->rank);
    for (size_t t = 0; t < d->tracks.n; t++) {
        fprintf(fp, ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %d, \"tid\": %zu, \"args\": {\"name\": ",
                d->rank, t + 1);
        json_string(fp, string_at(d, d->tracks.at[t].name));
        fprintf(fp, "}},\n{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": %d, \"tid\": %zu, "
                    "\"args\": {\"sort_index\": %zu}}",
                d->rank, t + 1, t);
    }
    *sep = ",\n";
}

static void json_slice(FILE *fp, const TraceRankData *d, const Item *item) {
    const Slice *s = &d->slices.at[item->ref];
    fputs("{\"ph\": \"X\", \"cat\": ", fp);
    json_string(fp, string_at(d, s->category));
    fputs(", \"name\": ", fp);
    json_string(fp, string_at(d, s->name));
    fprintf(fp, ", \"pid\": %d, \"tid\": %u, \"ts\": ", d->rank, s->track + 1);
    json_us(fp, item->ts);
    fputs(", \"dur\": ", fp);
    json_us(fp, s->end - s->begin);
    fputs(", \"args\": ", fp);
    json_args(fp, d, s);
    fputs("}", fp);
}

// Flow events v1: the importer binds each to the innermost slice open on its thread at its time.
static void json_flow(FILE *fp, const TraceRankData *d, const Item *item, uint32_t track) {
    bool out = item->kind == ITEM_FLOW_OUT;
    fputs(out ? "{\"ph\": \"s\"" : "{\"ph\": \"f\", \"bp\": \"e\"", fp);
    fprintf(fp, ", \"id\": %" PRIu64 ", \"cat\": \"flow\", \"name\": \"flow\", \"pid\": %d, \"tid\": %u, \"ts\": ",
            d->atts.at[item->ref].value, d->rank, track + 1);
    json_us(fp, item->ts);
    fputs("}", fp);
}

static void json_counter(FILE *fp, const TraceRankData *d, const Item *item) {
    const Sample *sample = &d->samples.at[item->ref];
    fputs("{\"ph\": \"C\", \"name\": ", fp);
    json_string(fp, string_at(d, d->counters.at[sample->counter]));
    fprintf(fp, ", \"pid\": %d, \"ts\": ", d->rank);
    json_us(fp, item->ts);
    fputs(", \"args\": {\"bytes\": ", fp);
    json_double(fp, sample->value);
    fputs("}}", fp);
}

typedef struct {
    uint64_t id;
    int64_t ts;
} FlowStart;

static int compare_flow_starts(const void *pa, const void *pb) {
    const FlowStart *a = pa, *b = pb;
    return a->id < b->id ? -1 : a->id > b->id;
}

// When each flow leaves its sender (shifted time), sorted by id for lookup.
static FlowStart *flow_starts(const TraceRankInput *ranks, int n, int64_t shift, size_t *count) {
    ARRAY(FlowStart) starts = {0};
    for (int r = 0; r < n; r++) {
        const TraceRankData *d = ranks[r].data;
        for (size_t i = 0; i < d->slices.n; i++)
            for (uint32_t a = d->slices.at[i].first_att; a != NONE; a = d->atts.at[a].next)
                if (d->atts.at[a].kind == ATT_FLOW_OUT)
                    *PUSH(starts) = (FlowStart){d->atts.at[a].value,
                                                d->slices.at[i].begin + ranks[r].clock_offset_ns + shift};
    }
    if (starts.n) qsort(starts.at, starts.n, sizeof *starts.at, compare_flow_starts);
    *count = starts.n;
    return starts.at;
}

// A flow's end goes inside its receiving slice [begin, end] but after its start (the importer
// drops a flow whose end comes first), so just after the start when the receive began earlier.
static int64_t flow_end_time(const FlowStart *starts, size_t n_starts, uint64_t id, int64_t begin, int64_t end) {
    FlowStart key = {.id = id};
    const FlowStart *start = n_starts ? bsearch(&key, starts, n_starts, sizeof *starts, compare_flow_starts) : NULL;
    int64_t ts = start ? start->ts + 1 : begin;
    return ts < begin ? begin : ts > end ? end : ts;
}

// Slices (X) with their flow events, and counter samples, of all ranks in time order.
static Items merge_json_items(const TraceRankInput *ranks, int n, int64_t shift) {
    size_t n_starts;
    FlowStart *starts = flow_starts(ranks, n, shift, &n_starts);
    Items items = {0};
    for (int r = 0; r < n; r++) {
        const TraceRankData *d = ranks[r].data;
        int64_t offset = ranks[r].clock_offset_ns + shift;
        for (size_t i = 0; i < d->events.n; i++) {
            const Event *e = &d->events.at[i];
            if (e->kind == EV_COUNTER) add_item(&items, e->ts + offset, r, ITEM_COUNTER, e->ref);
            if (e->kind != EV_BEGIN) continue;
            const Slice *s = &d->slices.at[e->ref];
            add_item(&items, s->begin + offset, r, ITEM_BEGIN, e->ref);
            for (uint32_t a = s->first_att; a != NONE; a = d->atts.at[a].next) {
                if (d->atts.at[a].kind == ATT_FLOW_OUT) add_item(&items, s->begin + offset, r, ITEM_FLOW_OUT, a);
                if (d->atts.at[a].kind == ATT_FLOW_IN)
                    add_item(&items,
                             flow_end_time(starts, n_starts, d->atts.at[a].value, s->begin + offset, s->end + offset),
                             r, ITEM_FLOW_IN, a);
            }
        }
    }
    free(starts);
    if (items.n) qsort(items.at, items.n, sizeof *items.at, compare_items);
    return items;
}

// A flow item needs its slice's track: found through the slice that lists the attachment.
static uint32_t *attachment_tracks(const TraceRankData *d) {
    uint32_t *tracks = malloc((d->atts.n ? d->atts.n : 1) * sizeof *tracks);
    if (!tracks) fatal("trace: out of memory");
    for (size_t i = 0; i < d->slices.n; i++)
        for (uint32_t a = d->slices.at[i].first_att; a != NONE; a = d->atts.at[a].next)
            tracks[a] = d->slices.at[i].track;
    return tracks;
}

static void write_json_body(FILE *fp, const TraceRankInput *ranks, int n, int64_t shift) {
    // HTA finds the rank with a regex that expects exactly this spacing.
    fprintf(fp, "{\"schemaVersion\": 1, \"distributedInfo\": {\"rank\": %d, \"world_size\": %d},\n\"traceEvents\": [\n",
            ranks[0].data->rank, n);
    const char *sep = "";
    uint32_t **tracks = malloc((size_t)n * sizeof *tracks);
    if (!tracks) fatal("trace: out of memory");
    for (int r = 0; r < n; r++) {
        json_metadata(fp, ranks[r].data, &sep);
        tracks[r] = attachment_tracks(ranks[r].data);
    }
    Items items = merge_json_items(ranks, n, shift);
    for (size_t i = 0; i < items.n; i++) {
        const Item *item = &items.at[i];
        const TraceRankData *d = ranks[item->rank_index].data;
        fputs(sep, fp);
        if (item->kind == ITEM_BEGIN) json_slice(fp, d, item);
        if (item->kind == ITEM_COUNTER) json_counter(fp, d, item);
        if (item->kind == ITEM_FLOW_OUT || item->kind == ITEM_FLOW_IN)
            json_flow(fp, d, item, tracks[item->rank_index][item->ref]);
    }
    fputs("\n]}\n", fp);
    for (int r = 0; r < n; r++) free(tracks[r]);
    free(tracks);
    free(items.at);
}

bool trace_write_json_ranks(const char *path, const TraceRankInput *ranks, int n_ranks, char *err,
                            size_t err_len) {
    return write_atomically(path, write_json_body, ranks, n_ranks, err, err_len);
}

// ================================================================================================
// Single-process convenience
// ================================================================================================

void trace_report_write_error(const char *path, const char *err) {
    if (strncmp(err, path, strlen(path)) == 0) fprintf(stderr, "trace: %s\n", err);
    else fprintf(stderr, "trace: %s: %s\n", path, err);
}

static bool write_local(const char *path, bool json) {
    char err[512];
    lock_buffer();
    TraceRankInput input = {.data = local, .clock_offset_ns = 0};
    bool ok = false;
    if (!local)
        snprintf(err, sizeof err, "tracing is not enabled (trace_init was not called)");
    else if (json)
        ok = trace_write_json_ranks(path, &input, 1, err, sizeof err);
    else
        ok = trace_write_pftrace_ranks(path, &input, 1, err, sizeof err);
    unlock_buffer();
    if (!ok) trace_report_write_error(path, err);
    return ok;
}

bool trace_write_pftrace(const char *path) { return write_local(path, false); }
bool trace_write_json(const char *path) { return write_local(path, true); }
