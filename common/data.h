// data.h: training batches as a pure function of (source, seed, step, sequence index).
//
// The global batch at step s is B sequences of T+1 tokens. Data-parallel ranks each take a slice
// of it and runs resume from checkpoints, so nothing here keeps state between calls: sequence b
// of step s is the same tokens whichever rank asks for it, in whatever order, after whatever was
// asked before. A checkpoint's "data position" is therefore just its step number.
//
// Sources (the spec string given to data_open; formats in common/DATA.md):
//   "markov"                          synthetic Markov chain, order 1, 4 branches (the default)
//   "markov:order=K,branches=N,table=S"  any subset of the options, in any order
//   "text:PATH"                       a file's bytes are the tokens (vocab 256)
//   "tokens:PATH"                     a pre-tokenized file (scripts/make_token_file.py writes one)
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct DataSource DataSource;

// Opens a source for a model with this vocabulary and context length. Every problem with the
// spec or the file (unknown source, bad option, missing, truncated or corrupt file, a token
// >= vocab_size, a vocabulary too small for the source, fewer than seq_len+1 tokens) ends the
// run through fatal_input(): one line naming the spec or file and the problem, exit status 2.
// seed chooses which sequences are drawn; for "markov" the chain itself is fixed by the spec
// (table=S), so another seed gives held-out data from the same distribution.
DataSource *data_open(const char *spec, int vocab_size, int seq_len, uint64_t seed);

// Fills inputs and targets, each (n_seqs, T) row-major: row j is sequence first_seq + j of the
// global batch of global_batch sequences at this step, and targets[t] is the token after
// inputs[t]. Needs step >= 0, 0 <= first_seq, first_seq + n_seqs <= global_batch and
// 1 <= T <= seq_len. A shorter T gives a prefix of the seq_len-long sequence.
void data_batch(const DataSource *src, long long step, int global_batch, int first_seq, int n_seqs,
                int T, int *inputs, int *targets);

// The loss (nats per token) a perfect model reaches at positions with a full context: H(p) for
// "markov" (see DATA.md for the first order-1 positions of a sequence), NAN for files.
double data_entropy_floor(const DataSource *src);
// The mean loss over a sequence of T targets that a perfect model reaches: for "markov" of order
// K > 1 above the entropy floor, its first K-1 targets being uniform (DATA.md); NAN for files.
double data_mean_loss_floor(const DataSource *src, int T);

// One line for the log: the source, its parameters and size.
const char *data_describe(const DataSource *src);

// What the data is, independent of how the spec spells it: the chain's parameters in one canonical
// form ("markov:order=1,branches=4,table=0"), or a file's token count, width and a 64-bit hash of
// its tokens (a changed file is other data; the same file under another path is not). Into out
// (len bytes), which it returns. Checkpoints record it, and a resume compares it.
const char *data_identity(const DataSource *src, char *out, size_t len);

void data_close(DataSource *src);  // NULL is fine
