// safetensors.h: read and write .safetensors files (checkpoints, oracle fixtures).
//
// Format: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "string value"}}
// then the data buffer. Offsets are relative to the buffer start (byte 8 + N) and the tensors
// must cover the buffer exactly: no holes, no overlaps. All data is little-endian.
//
// Writing:
//   StWriter *w = st_writer_new();
//   st_writer_add(w, "wte", ST_F32, 2, (int64_t[]){vocab, dim}, wte, err, sizeof err);
//   st_writer_add_metadata(w, "step", "150", err, sizeof err);
//   if (!st_write(w, "ckpt.safetensors", err, sizeof err)) fatal("%s", err);
//   st_writer_free(w);
// Reading:
//   StFile *f = st_open("ckpt.safetensors", err, sizeof err);
//   if (!f) fatal_input("%s", err);
//   if (!st_read(f, "wte", ST_F32, 2, (int64_t[]){vocab, dim}, wte, err, sizeof err))
//       fatal_input("%s", err);
//   st_close(f);
//
// Every error is one line in err that names the file (and the tensor) and the problem.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    ST_F64, ST_F32, ST_F16, ST_BF16,
    ST_I64, ST_I32, ST_I16, ST_I8,
    ST_U64, ST_U32, ST_U16, ST_U8,
    ST_BOOL,
    ST_N_DTYPES
} StDtype;

// Tensors of more dimensions are rejected by both the writer and the reader.
#define ST_MAX_DIMS 8

size_t st_dtype_size(StDtype dtype);            // bytes per element (BOOL: 1)
const char *st_dtype_name(StDtype dtype);       // "F32", ...; "?" for an invalid value
bool st_dtype_parse(const char *name, StDtype *dtype);  // exact, case-sensitive names

// ---- writing ---------------------------------------------------------------------------------
typedef struct StWriter StWriter;

StWriter *st_writer_new(void);  // exits via fatal() if out of memory
void st_writer_free(StWriter *w);  // NULL is fine
// Records a tensor: the name and shape are copied, the data is NOT; it must stay valid (and hold
// product(shape) * st_dtype_size(dtype) bytes) until st_write() returns. ndim 0 is a scalar.
// Rejects duplicate names, the reserved name "__metadata__", bad dtypes, ndim and negative dims.
bool st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape,
                   const void *data, char *err, size_t err_len);
// Records a "__metadata__" string pair (both copied). Rejects a duplicate key.
bool st_writer_add_metadata(StWriter *w, const char *key, const char *value, char *err,
                            size_t err_len);
// Writes the tensors in the order they were added, atomically (temporary file, fsync, rename):
// on failure the previous file at path, if any, is left as it was and no temporary file remains.
// The header is padded with spaces to a multiple of 8 bytes so the data block is 8-byte aligned.
bool st_write(const StWriter *w, const char *path, char *err, size_t err_len);

// A 64-bit hash of the data block the writer will write (the tensors' bytes in the order added):
// a writer records it in the metadata, and a reader compares it with st_data_hash to find a file
// damaged after it was written. Not cryptographic: any change to one 8-byte word changes it.
uint64_t st_writer_data_hash(const StWriter *w);
// Records that hash as the metadata "data_hash", then a hash of all the metadata (keys and values,
// data_hash included) as "metadata_hash": call it after the last st_writer_add and the last other
// st_writer_add_metadata.
bool st_writer_add_data_hash(StWriter *w, char *err, size_t err_len);

// ---- reading ---------------------------------------------------------------------------------
typedef struct StFile StFile;

typedef struct {
    const char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];  // entries past ndim are 0
    size_t n_elements;           // product of the shape; 1 for a scalar
    size_t n_bytes;              // n_elements * st_dtype_size(dtype)
    // Points into the file's buffer (valid until st_close). NOT aligned for the dtype in general:
    // the buffer starts at byte 8 + N of the file, and while N is a multiple of 8 in files that
    // st_write() made, foreign files need not pad it, and a tensor's offset is the sum of the
    // sizes before it. Read through memcpy or st_copy_to(), never by casting to float*.
    const void *data;            // NULL for a file opened with st_open_header()
    uint64_t file_offset;        // where the tensor's bytes start in the file
} StTensor;

// Loads and validates the whole file. Returns NULL with a one-line message in err for anything
// short of a well-formed file (callers usually turn it into fatal_input, exit status 2).
StFile *st_open(const char *path, char *err, size_t err_len);
// The same checks, reading only the 8-byte length and the header: tensor data stays on disk and is
// read with st_read_bytes(). For large files of which a process needs a part (one rank's shard of
// a 2.5 GB checkpoint). The file stays open until st_close.
StFile *st_open_header(const char *path, char *err, size_t err_len);
// Copies bytes [byte_offset, byte_offset + n) of tensor t's data to dst (from memory or from the
// file, however f was opened). False with a message in err on a range past the tensor or a failed read.
bool st_read_bytes(const StFile *f, const StTensor *t, size_t byte_offset, size_t n, void *dst, char *err,
                   size_t err_len);
void st_close(StFile *f);  // NULL is fine
const char *st_path(const StFile *f);

int st_count(const StFile *f);                         // number of tensors
const StTensor *st_tensor(const StFile *f, int index);  // in header order; NULL if out of range
const StTensor *st_find(const StFile *f, const char *name);  // NULL if absent

int st_metadata_count(const StFile *f);
// Fills key and value of the index-th metadata pair; false if index is out of range.
bool st_metadata_entry(const StFile *f, int index, const char **key, const char **value);
const char *st_metadata(const StFile *f, const char *key);  // NULL if absent
// The same hash of the file's data block, as st_writer_data_hash computes it for the file's
// writer; for a file opened with st_open_header the data is read from disk in chunks (memory stays
// small). False (and err) on a failed read.
bool st_data_hash(const StFile *f, uint64_t *hash, char *err, size_t err_len);
// False (and err) when the file records a "metadata_hash" that its metadata no longer matches, or a
// "data_hash" that its data no longer matches, or its data cannot be read; true when they match or
// when the file records none (files written before them).
bool st_check_data_hash(const StFile *f, char *err, size_t err_len);

// Copies the tensor's bytes to dst, which holds dst_bytes; false (and err) unless they are equal.
bool st_copy_to(const StTensor *t, void *dst, size_t dst_bytes, char *err, size_t err_len);
// Finds name, checks that it has exactly this dtype and shape, and copies its data to dst, which
// must hold product(shape) * st_dtype_size(dtype) bytes. On any mismatch returns false with a
// message such as "ckpt.safetensors: tensor 'wte': shape [256, 64], expected [512, 64]".
bool st_read(const StFile *f, const char *name, StDtype dtype, int ndim, const int64_t *shape,
             void *dst, char *err, size_t err_len);
