#include "rng.h"

#include <math.h>

#include "hash.h"

// Philox constants from Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11).
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

// FNV-1a from 1469598103934665603, the standard basis (FNV1A_BASIS) with its last digit lost. Every
// initial weight's Philox stream is this hash of its parameter's name, so the basis stays: another
// would change every initial weight, and every loss the chapters quote.
uint64_t hash_string(const char *text) { return fnv1a_string(1469598103934665603ULL, text); }

static void philox_block(uint64_t seed, uint64_t stream, uint64_t index, uint32_t out[4]) {
    const uint32_t counter[4] = {(uint32_t)index, (uint32_t)(index >> 32), (uint32_t)stream,
                                 (uint32_t)(stream >> 32)};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    philox4x32_10(counter, key, out);
}

// 53 bits -> (0, 1): add half an ulp so neither 0 nor 1 can come out (log() in Box-Muller needs > 0).
static double to_open_unit(uint32_t hi, uint32_t lo) {
    uint64_t bits = (((uint64_t)hi << 32) | lo) >> 11;
    return ((double)bits + 0.5) * 0x1.0p-53;
}

double rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t out[4];
    philox_block(seed, stream, index, out);
    return to_open_unit(out[0], out[1]);
}

double rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t out[4];
    philox_block(seed, stream, index, out);
    double u1 = to_open_unit(out[0], out[1]);
    double u2 = to_open_unit(out[2], out[3]);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n) {
    uint32_t out[4];
    philox_block(seed, stream, index, out);
    uint64_t bits = ((uint64_t)out[0] << 32) | out[1];
    return (uint64_t)(((unsigned __int128)bits * n) >> 64);
}
