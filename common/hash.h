// hash.h: FNV-1a, 64-bit, the project's one hash for names and fingerprints: parameter names (the
// stream of each weight's initial values; rng.c starts that one from another basis, and says why),
// communicator identities, the trace's string table, the token stream a checkpoint was trained on,
// DDP's check that replicas hold the same weights. Byte by byte, so not fast: safetensors.c runs the
// same step in four lanes over whole files.
//
//   h = basis;  for each byte b:  h = (h ^ b) * prime
#pragma once
#include <stddef.h>
#include <stdint.h>

#define FNV1A_BASIS 14695981039346656037ULL  // 0xcbf29ce484222325
#define FNV1A_PRIME 1099511628211ULL         // 0x100000001b3

static inline uint64_t fnv1a_byte(uint64_t h, uint8_t byte) { return (h ^ byte) * FNV1A_PRIME; }

// A whole 64-bit word in one step (not byte by byte): the step is a bijection of h for a fixed word
// and of the word for a fixed h, so a changed word still changes the value.
static inline uint64_t fnv1a_word(uint64_t h, uint64_t word) { return (h ^ word) * FNV1A_PRIME; }

static inline uint64_t fnv1a_bytes(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    for (size_t i = 0; i < n; i++) h = fnv1a_byte(h, p[i]);
    return h;
}

// The bytes of s up to its terminating 0.
static inline uint64_t fnv1a_string(uint64_t h, const char *s) {
    for (; *s; s++) h = fnv1a_byte(h, (uint8_t)*s);
    return h;
}
