// rng.h: counter-based random numbers (Philox4x32-10, the generator cuRAND and PyTorch use).
// A value is a pure function of (seed, stream, index): no state, so any rank can produce any
// element of any tensor without producing the ones before it. Parameter init uses
// stream = hash of the parameter's name and index = the element's flat index, which makes the
// initial weights independent of how they are sharded.
#pragma once
#include <stdint.h>

// The raw generator: 10 rounds over a 128-bit counter with a 64-bit key.
void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

uint64_t hash_string(const char *text);  // FNV-1a, 64-bit (rng.c: its basis)

// Uniform in the open interval (0, 1), 53 random bits.
double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller on two uniforms drawn from the same Philox block).
double rng_normal(uint64_t seed, uint64_t stream, uint64_t index);
// Uniform integer in [0, n) (n > 0), by rejection-free multiply-shift on 64 bits.
uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n);
