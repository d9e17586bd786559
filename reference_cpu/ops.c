// ops.c: the reference ops, forward and backward side by side. Loops are parallel only over
// independent outputs (rows, heads), never over a reduction, so this file's results do not depend
// on the number of threads, and a run is bit-reproducible. OpenBLAS's GEMMs (the default --matmul
// blas) are the exception: their blocking follows the thread count, so a weight gradient's sum over
// tokens can change in its last bits between thread counts (chapter 0; --matmul loop does not).
#define _GNU_SOURCE  // sched_setaffinity, for the restart below
#include "reference_cpu/ops.h"

#include <float.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sched.h>  // sched_getaffinity, sched_setaffinity
#endif

#ifdef HAVE_OPENBLAS
#include <cblas.h>
#include <unistd.h>  // execv
#ifdef REF_FLOAT64
#define gemm_r cblas_dgemm
#else
#define gemm_r cblas_sgemm
#endif
#endif

// Dot product and axpy: the inner loops of matmul and attention. `omp simd reduction` lets the
// compiler vectorise the sum (a fixed order per binary, so still deterministic run to run).
static inline real dot(const real *a, const real *b, int n) {
    real sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(real *y, real alpha, const real *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

// ================================ matmul ========================================================

#ifdef HAVE_OPENBLAS
static MatmulBackend matmul_backend = MATMUL_BLAS;
#else
static MatmulBackend matmul_backend = MATMUL_LOOP;
#endif

bool matmul_blas_available(void) {
#ifdef HAVE_OPENBLAS
    return true;
#else
    return false;
#endif
}
void matmul_set_backend(MatmulBackend backend) { matmul_backend = matmul_blas_available() ? backend : MATMUL_LOOP; }
MatmulBackend matmul_get_backend(void) { return matmul_backend; }

// The GEMM work given to the backend so far: 2 M N K per product, summed over every matmul and every
// attention tile (atomically: tiles run on several threads at once).
static unsigned long long gemm_flops_total;
static void count_gemm(int M, int N, int K) {
    __atomic_fetch_add(&gemm_flops_total, 2ull * (unsigned)M * (unsigned)N * (unsigned)K, __ATOMIC_RELAXED);
}
double matmul_flops_counted(void) { return (double)__atomic_load_n(&gemm_flops_total, __ATOMIC_RELAXED); }

int matmul_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#ifdef __linux__
// The CPUs of all OpenMP places (false: no places, OMP_PROC_BIND unset).
static bool places_cpus(cpu_set_t *all) {
    CPU_ZERO(all);
#ifdef _OPENMP
    for (int p = 0; p < omp_get_num_places(); p++) {
        int n = omp_get_place_num_procs(p), ids[CPU_SETSIZE];
        if (n <= 0 || n > CPU_SETSIZE) continue;
        omp_get_place_proc_ids(p, ids);
        for (int i = 0; i < n; i++)
            if (ids[i] >= 0 && ids[i] < CPU_SETSIZE) CPU_SET(ids[i], all);
    }
#endif
    return CPU_COUNT(all) > 0;
}

int matmul_cpus_usable(void) {
    cpu_set_t cpus;
    if (places_cpus(&cpus) || sched_getaffinity(0, sizeof cpus, &cpus) == 0) return CPU_COUNT(&cpus);
    return 1;
}
#else
int matmul_cpus_usable(void) {
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}
#endif

// ---- OpenBLAS's kernels for this CPU --------------------------------------------------------------
// OpenBLAS (built for every x86 CPU at once, as Debian's is) picks its kernels when the library loads,
// mostly from the CPU's model number. A virtual machine that hides the model ("Intel(R) Xeon(R)
// Processor") can make it fall back to its SSE3 kernels ("Prescott") on a CPU with AVX-512: sgemm then
// runs at a fifth of its speed (64 against 316 GFLOP/s on the 2-core machine this was written on). The
// choice can only be changed before the library loads, through OPENBLAS_CORETYPE, so this constructor
// (it runs after OpenBLAS's own, before main) compares OpenBLAS's choice with the instruction sets the
// CPU reports and, when OpenBLAS chose less, sets OPENBLAS_CORETYPE and runs the program again with the
// same arguments. An OPENBLAS_CORETYPE the user set is left alone. matmul_blas_kernels() says what ran.
#if defined(HAVE_OPENBLAS) && defined(__x86_64__) && defined(__GLIBC__)
#define BLAS_DETECTED_ENV "LLAMA_OPENBLAS_DETECTED"  // what OpenBLAS chose before the restart

// 2: AVX-512 kernels, 1: AVX2 + FMA, 0: older.
static int blas_core_tier(const char *core) {
    const char *avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"}, *avx2[] = {"Haswell", "Zen"};
    for (size_t i = 0; i < sizeof avx512 / sizeof avx512[0]; i++)
        if (strcmp(core, avx512[i]) == 0) return 2;
    for (size_t i = 0; i < sizeof avx2 / sizeof avx2[0]; i++)
        if (strcmp(core, avx2[i]) == 0) return 1;
    return 0;
}
static int cpu_tier(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

// With OMP_PROC_BIND set, the OpenMP runtime (libgomp, or clang's libomp) has already bound this
// thread to the first of its places when the constructor below runs, and a program started by
// execv inherits that one-core mask: it would then build its places, and run every thread, on that
// core alone (half the speed on 2 cores). The places were built from the mask the program was
// started with, so their union gives it back.
static void restore_affinity_of_all_places(void) {
#ifdef __linux__
    cpu_set_t all;
    if (places_cpus(&all)) sched_setaffinity(0, sizeof all, &all);
#endif
}

// glibc passes the program's argc, argv and environment to constructors.
__attribute__((constructor)) static void blas_kernels_for_this_cpu(int argc, char **argv, char **envp) {
    (void)argc, (void)envp;
    if (getenv("OPENBLAS_CORETYPE")) return;  // the user's choice, or already restarted
    const char *core = openblas_get_corename(), *names[] = {NULL, "Haswell", "SkylakeX"};
    int tier = cpu_tier();
    if (!core || !argv || tier == 0 || blas_core_tier(core) >= tier) return;
    char self[4096];  // the program's own path (not /proc/self/exe, which would rename the process "exe")
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return;
    self[len] = 0;
    setenv(BLAS_DETECTED_ENV, core, 1);
    setenv("OPENBLAS_CORETYPE", names[tier], 1);
    restore_affinity_of_all_places();
    execv(self, argv);  // only returns on failure: carry on with OpenBLAS's choice
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv(BLAS_DETECTED_ENV);
}

const char *matmul_blas_kernels(char *out, size_t out_len) {
    const char *detected = getenv(BLAS_DETECTED_ENV);
    if (detected)
        snprintf(out, out_len, "OpenBLAS %s kernels (OPENBLAS_CORETYPE, set for this CPU's instruction sets: "
                 "the library had chosen %s)", openblas_get_corename(), detected);
    else snprintf(out, out_len, "OpenBLAS %s kernels", openblas_get_corename());
    return out;
}
#else
const char *matmul_blas_kernels(char *out, size_t out_len) {
    snprintf(out, out_len, matmul_blas_available() ? "BLAS" : "no BLAS: the plain loops");
    return out;
}
#endif

// out (M,N) = inp (M,K) . weight (N,K)^T
static void matmul_forward_loop(real *out, const real *inp, const real *weight, int M, int K, int N) {
#pragma omp parallel for schedule(static)
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) out[(size_t)m * N + n] = dot(inp + (size_t)m * K, weight + (size_t)n * K, K);
}

static void matmul_backward_loop(real *dinp, real *dweight, const real *dout, const real *inp,
                                 const real *weight, int M, int K, int N) {
    if (dinp) {  // dinp[m,:] += sum_n dout[m,n] * weight[n,:]
#pragma omp parallel for schedule(static)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) axpy(dinp + (size_t)m * K, dout[(size_t)m * N + n], weight + (size_t)n * K, K);
    }
    if (dweight) {  // dweight[n,:] += sum_m dout[m,n] * inp[m,:]; each thread owns whole rows n
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            for (int m = 0; m < M; m++) axpy(dweight + (size_t)n * K, dout[(size_t)m * N + n], inp + (size_t)m * K, K);
    }
}

void matmul_forward(real *out, const real *inp, const real *weight, int M, int K, int N) {
    count_gemm(M, N, K);
#ifdef HAVE_OPENBLAS
    if (matmul_backend == MATMUL_BLAS) {
        // Zeroing out on every thread, then accumulating into it (beta 1), is faster than OpenBLAS's
        // own zeroing pass for beta 0 (about 6% on `small`'s projections), and gives the same bits.
        zero_fill(out, (size_t)M * N);
        gemm_r(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, inp, K, weight, K, 1, out, N);
        return;
    }
#endif
    matmul_forward_loop(out, inp, weight, M, K, N);
}

void matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                     int M, int K, int N) {
    if (dinp) count_gemm(M, K, N);
    if (dweight) count_gemm(N, K, M);
#ifdef HAVE_OPENBLAS
    if (matmul_backend == MATMUL_BLAS) {
        if (dinp) gemm_r(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1, dout, N, weight, K, 1, dinp, K);
        if (dweight) gemm_r(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1, dout, N, inp, K, 1, dweight, K);
        return;
    }
#endif
    matmul_backward_loop(dinp, dweight, dout, inp, weight, M, K, N);
}

// ================================ embedding =====================================================

void embedding_forward(real *out, const int *tokens, const real *table, int N, int C) {
    embedding_forward_rows(out, tokens, table, N, C, 0, INT_MAX);
}

// Serial: two positions holding the same token add into the same row.
void embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C) {
    embedding_backward_rows(dtable, dout, tokens, N, C, 0, INT_MAX);
}

static bool row_here(int token, int row_start, int n_rows) {
    return token >= row_start && token - row_start < n_rows;
}

void embedding_forward_rows(real *out, const int *tokens, const real *table, int N, int C, int row_start, int n_rows) {
    for (int n = 0; n < N; n++) {
        if (row_here(tokens[n], row_start, n_rows))
            memcpy(out + (size_t)n * C, table + (size_t)(tokens[n] - row_start) * C, sizeof(real) * C);
        else
            memset(out + (size_t)n * C, 0, sizeof(real) * C);
    }
}

void embedding_backward_rows(real *dtable, const real *dout, const int *tokens, int N, int C, int row_start,
                             int n_rows) {
    for (int n = 0; n < N; n++)
        if (row_here(tokens[n], row_start, n_rows))
            axpy(dtable + (size_t)(tokens[n] - row_start) * C, 1, dout + (size_t)n * C, C);
}

// ================================ RMSNorm =======================================================

// out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps). Sums in double: C can be 16384.
void rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C, double eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        double sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
        for (int i = 0; i < C; i++) sum_sq += (double)x[i] * x[i];
        real r = (real)(1.0 / sqrt(sum_sq / C + eps));
        rstd[n] = r;
        real *y = out + (size_t)n * C;
        for (int i = 0; i < C; i++) y[i] = x[i] * r * weight[i];
    }
}

// With y_i = x_i r w_i and r = (mean(x^2) + eps)^-1/2:
//   dx_i = r w_i dy_i - x_i r^3 / C * sum_k dy_k w_k x_k ;   dw_i += sum_rows dy_i x_i r
// dweight is summed in two stages, grouped as the GPU kernel groups it (gpu/ops.cu): chunks of
// RMSNORM_DW_ROWS rows, each summed in row order into partial[chunk] by the thread that computes
// those rows' dx (while they are in its cache: one pass over dout and inp, not two), then the
// chunks added in chunk order. The grouping depends only on N, never on the thread count.
#define RMSNORM_DW_ROWS 64
void rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                      const real *rstd, int N, int C) {
    if (N <= 0 || C <= 0) return;
    int rows_per_chunk = RMSNORM_DW_ROWS, chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
    real *partial = malloc(sizeof(real) * (size_t)chunks * C);  // (chunks, C)
    if (!partial) {
        fprintf(stderr, "rmsnorm_backward: out of memory for %d x %d partial sums\n", chunks, C);
        exit(1);
    }
#pragma omp parallel for schedule(static)
    for (int chunk = 0; chunk < chunks; chunk++) {
        real *dw = partial + (size_t)chunk * C;
        for (int i = 0; i < C; i++) dw[i] = 0;
        int end = (chunk + 1) * rows_per_chunk < N ? (chunk + 1) * rows_per_chunk : N;
        for (int n = chunk * rows_per_chunk; n < end; n++) {
            const real *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            real r = rstd[n];
            double proj = 0;
#pragma omp simd reduction(+ : proj)
            for (int i = 0; i < C; i++) proj += (double)dy[i] * weight[i] * x[i];
            real coef = (real)(proj * r * r * r / C);
            real *dx = dinp + (size_t)n * C;
#pragma omp simd
            for (int i = 0; i < C; i++) {
                dx[i] += r * weight[i] * dy[i] - x[i] * coef;
                dw[i] += dy[i] * x[i] * r;
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (int i0 = 0; i0 < C; i0 += 64) {  // blocks of 64 columns: each row of partial read in slices
        int i1 = i0 + 64 < C ? i0 + 64 : C;
        for (int i = i0; i < i1; i++) {
            real sum = 0;
            for (int chunk = 0; chunk < chunks; chunk++) sum += partial[(size_t)chunk * C + i];
            dweight[i] += sum;
        }
    }
    free(partial);
}

// ================================ RoPE ==========================================================

// Llama 3.1 frequency scaling: long wavelengths (low frequencies) are slowed by `factor`, short ones
// kept, and the band between is interpolated smoothly.
static double rope_scaled_frequency(double freq, double factor, double low_ff, double high_ff, int original_max) {
    double wavelen = 2.0 * M_PI / freq;
    double low_freq_wavelen = original_max / low_ff, high_freq_wavelen = original_max / high_ff;
    if (wavelen < high_freq_wavelen) return freq;
    if (wavelen > low_freq_wavelen) return freq / factor;
    double smooth = (original_max / wavelen - low_ff) / (high_ff - low_ff);
    return (1.0 - smooth) * freq / factor + smooth * freq;
}

RopeTable rope_table_build(int max_pos, int head_dim, double theta, double scaling_factor,
                           double low_freq_factor, double high_freq_factor, int original_max_pos) {
    RopeTable t = {max_pos, head_dim, NULL, NULL};
    int half = head_dim / 2;
    t.cos = mem_alloc(MEM_OTHER, sizeof(real) * (size_t)max_pos * half);
    t.sin = mem_alloc(MEM_OTHER, sizeof(real) * (size_t)max_pos * half);
    for (int i = 0; i < half; i++) {
        double freq = pow(theta, -2.0 * i / head_dim);
        if (scaling_factor > 0)
            freq = rope_scaled_frequency(freq, scaling_factor, low_freq_factor, high_freq_factor, original_max_pos);
        for (int p = 0; p < max_pos; p++) {
            t.cos[(size_t)p * half + i] = (real)cos(p * freq);
            t.sin[(size_t)p * half + i] = (real)sin(p * freq);
        }
    }
    return t;
}

void rope_table_free(RopeTable *t) {
    mem_free(t->cos);
    mem_free(t->sin);
    t->cos = t->sin = NULL;
}

// Rotates each pair (x[2i], x[2i+1]) by +angle (sign = 1) or -angle (sign = -1: the transpose,
// which is what backward needs since a rotation's inverse is its transpose).
static void rope_rotate(real *x, const RopeTable *t, const int *positions, int B, int T, int n_heads, real sign) {
    int hd = t->head_dim, half = hd / 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int tt = 0; tt < T; tt++) {
            int pos = positions ? positions[tt] : tt;
            const real *c = t->cos + (size_t)pos * half, *s = t->sin + (size_t)pos * half;
            for (int h = 0; h < n_heads; h++) {
                real *v = x + (((size_t)b * T + tt) * n_heads + h) * hd;
                for (int i = 0; i < half; i++) {
                    real x0 = v[2 * i], x1 = v[2 * i + 1], sn = sign * s[i];
                    v[2 * i] = x0 * c[i] - x1 * sn;
                    v[2 * i + 1] = x0 * sn + x1 * c[i];
                }
            }
        }
}

void rope_forward(real *x, const RopeTable *t, const int *positions, int B, int T, int n_heads) {
    rope_rotate(x, t, positions, B, T, n_heads, 1);
}

void rope_backward(real *dx, const RopeTable *t, const int *positions, int B, int T, int n_heads) {
    rope_rotate(dx, t, positions, B, T, n_heads, -1);
}

// ================================ attention =====================================================
// Indexing: q/out/dq element (b, i, h, d) at ((b*Tq + i)*H + h)*hd + d; k/v at ((b*Tk + j)*KV + g)*hd + d.
// Work is split over (b, kv head g) so that the heads sharing a kv head (GQA) write dk/dv from one
// thread only.

// The position of query i (key j): explicit, or the index itself.
static inline int q_position(const AttnShape *s, int i) { return s->q_pos ? s->q_pos[i] : i; }
static inline int k_position(const AttnShape *s, int j) { return s->k_pos ? s->k_pos[j] : j; }

static inline bool attn_visible(const AttnShape *s, int i, int j) {
    return !s->causal || k_position(s, j) <= q_position(s, i);
}

static inline const real *q_row(const real *q, const AttnShape *s, int b, int i, int h) {
    return q + (((size_t)b * s->Tq + i) * s->n_heads + h) * s->head_dim;
}
static inline const real *kv_row(const real *k, const AttnShape *s, int b, int j, int g) {
    return k + (((size_t)b * s->Tk + j) * s->n_kv_heads + g) * s->head_dim;
}

void attention_naive_forward(real *out, real *probs, const real *q, const real *k, const real *v,
                             const AttnShape *s) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    real scale = (real)(1.0 / sqrt((double)hd));
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->n_heads; h++)
            for (int i = 0; i < s->Tq; i++) {
                int g = h / group;
                real *p = probs + (((size_t)b * s->n_heads + h) * s->Tq + i) * s->Tk;
                real max_score = -INFINITY;
                for (int j = 0; j < s->Tk; j++) {
                    p[j] = attn_visible(s, i, j) ? dot(q_row(q, s, b, i, h), kv_row(k, s, b, j, g), hd) * scale : -INFINITY;
                    if (p[j] > max_score) max_score = p[j];
                }
                double sum = 0;
                for (int j = 0; j < s->Tk; j++) {
                    p[j] = max_score == -INFINITY ? 0 : exp_r(p[j] - max_score);
                    sum += p[j];
                }
                real *o = (real *)q_row(out, s, b, i, h);
                memset(o, 0, sizeof(real) * hd);
                for (int j = 0; j < s->Tk; j++) {
                    if (sum > 0) p[j] = (real)(p[j] / sum);
                    if (p[j] != 0) axpy(o, p[j], kv_row(v, s, b, j, g), hd);
                }
            }
}

// With P = softmax(S), S = scale Q K^T, O = P V:
//   dV = P^T dO ;  dP = dO V^T ;  dS = P * (dP - rowsum(P * dP)) ;  dQ = scale dS K ;  dK = scale dS^T Q
void attention_naive_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                              const real *v, const real *probs, const AttnShape *s) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    real scale = (real)(1.0 / sqrt((double)hd));
#pragma omp parallel
    {
        real *dp = malloc(sizeof(real) * s->Tk);
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < s->B; b++)
            for (int g = 0; g < s->n_kv_heads; g++)
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int i = 0; i < s->Tq; i++) {
                        const real *p = probs + (((size_t)b * s->n_heads + h) * s->Tq + i) * s->Tk;
                        const real *dO = q_row(dout, s, b, i, h);
                        double p_dot_dp = 0;
                        for (int j = 0; j < s->Tk; j++) {
                            dp[j] = p[j] != 0 ? dot(dO, kv_row(v, s, b, j, g), hd) : 0;
                            p_dot_dp += (double)p[j] * dp[j];
                        }
                        for (int j = 0; j < s->Tk; j++) {
                            if (p[j] == 0) continue;
                            real ds = p[j] * (dp[j] - (real)p_dot_dp) * scale;
                            axpy((real *)kv_row(dv, s, b, j, g), p[j], dO, hd);
                            axpy((real *)q_row(dq, s, b, i, h), ds, kv_row(k, s, b, j, g), hd);
                            axpy((real *)kv_row(dk, s, b, j, g), ds, q_row(q, s, b, i, h), hd);
                        }
                    }
        free(dp);
    }
}

// Blockwise attention: ATTN_Q_TILE queries against ATTN_KV_TILE keys at a time, every inner
// product of a tile pair one GEMM call (S = Q K^T, O += P V; in backward dP = dO V^T, dV += P^T dO,
// dK += dS^T Q, dQ += dS K). Forward keeps, per query row, a running max m, a running normaliser l
// and an unnormalised output; a new key tile rescales the old state by exp(m_old - m_new). The
// result equals softmax(S) V without ever storing a row of S. 64 x 64 tiles are what OpenBLAS's
// small-matrix kernels run fastest (on `small`, 128- or 256-key tiles made attention 15-20% slower:
// they fall back to its packing path). Each tile pair is computed by one thread in a fixed order
// (OpenBLAS runs single-threaded inside an OpenMP region), so the result does not depend on the
// thread count.
#define ATTN_Q_TILE 64
#define ATTN_KV_TILE 64

// C (M,N) = alpha A (M,K) . B (K,N) + beta C, with A or B read transposed (row-major, leading dimensions
// given): OpenBLAS with the blas matmul backend, else the plain triple loop (sums in k order). A
// tile GEMM is at most 64 in every dimension, and inside an OpenMP region OpenBLAS runs it on the
// calling thread whatever the thread settings.
static void tile_gemm(bool trans_a, bool trans_b, int M, int N, int K, real alpha, const real *A, int lda,
                      const real *B, int ldb, real beta, real *C, int ldc) {
    count_gemm(M, N, K);
#ifdef HAVE_OPENBLAS
    if (matmul_backend == MATMUL_BLAS) {
        gemm_r(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
               A, lda, B, ldb, beta, C, ldc);
        return;
    }
#endif
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            real sum = 0;
            for (int k = 0; k < K; k++)
                sum += (trans_a ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k]) *
                       (trans_b ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n]);
            C[(size_t)m * ldc + n] = (beta != 0 ? beta * C[(size_t)m * ldc + n] : 0) + alpha * sum;
        }
}

// The smallest and largest position of queries [i0, i1) (keys: k_pos over [j0, j1)).
static void position_range(const int *pos, int i0, int i1, int *lo, int *hi) {
    *lo = INT_MAX, *hi = INT_MIN;
    for (int i = i0; i < i1; i++) {
        int p = pos ? pos[i] : i;
        *lo = p < *lo ? p : *lo, *hi = p > *hi ? p : *hi;
    }
}

// Which keys of [j0, j1) the queries of [i0, i1) see: none (the first key comes after the last
// query: the pair is skipped), all (the last key comes no later than the first query: no mask to
// apply), or some (the diagonal crosses the pair: masked element by element). *j_end is cut back
// past the trailing keys that no query of the tile sees (so a causal tile pair computes no more
// than the diagonal's width of hidden scores).
typedef enum { TILE_HIDDEN, TILE_PARTLY_VISIBLE, TILE_VISIBLE } TileVisibility;
static TileVisibility tile_visibility(const AttnShape *s, int i0, int i1, int j0, int *j_end) {
    if (!s->causal) return TILE_VISIBLE;
    int q_lo, q_hi, k_lo, k_hi;
    position_range(s->q_pos, i0, i1, &q_lo, &q_hi);
    while (*j_end > j0 && k_position(s, *j_end - 1) > q_hi) (*j_end)--;
    if (*j_end == j0) return TILE_HIDDEN;
    position_range(s->k_pos, j0, *j_end, &k_lo, &k_hi);
    return k_hi <= q_lo ? TILE_VISIBLE : TILE_PARTLY_VISIBLE;
}

static int tile_end(int start, int tile, int n) { return start + tile < n ? start + tile : n; }

// K (or V) transposed tile by tile: kt (B, n_kv_heads, key tiles, hd, ATTN_KV_TILE), so that S = Q K^T
// and dP = dO V^T are plain GEMMs Q . K^T[:, J] whose second operand is one contiguous block
// (OpenBLAS 0.3's small-matrix kernels, several times faster on a 64-wide tile than its packing path,
// take A . B and A^T . B but not A . B^T in row-major terms; and rows a power-of-two kilobytes apart
// would share cache sets).
static int kv_tiles(const AttnShape *s) { return (s->Tk + ATTN_KV_TILE - 1) / ATTN_KV_TILE; }
static const real *kt_tile(const real *kt, const AttnShape *s, int b, int g, int j0) {
    size_t tile = ((size_t)b * s->n_kv_heads + g) * kv_tiles(s) + j0 / ATTN_KV_TILE;
    return kt + tile * s->head_dim * ATTN_KV_TILE;
}
static size_t kt_numel(const AttnShape *s) { return (size_t)s->B * s->n_kv_heads * kv_tiles(s) * s->head_dim * ATTN_KV_TILE; }

// Scratch memory that lives as long as the calling thread, grown when a call needs more: a fresh
// allocation per attention call would be fresh pages, and their page faults, every time.
static real *attention_scratch(size_t numel) {
    static _Thread_local real *buf;
    static _Thread_local size_t capacity;
    if (numel > capacity) {
        free(buf);
        buf = malloc(sizeof(real) * numel);
        if (!buf) {
            fprintf(stderr, "attention: out of memory for %zu floats of scratch\n", numel);
            exit(1);
        }
        capacity = numel;
    }
    return buf;
}

// kt = K transposed tile by tile (a last tile's padding columns are left as they are: never read).
static real *transpose_kv(real *kt, const real *k, const AttnShape *s) {
    int hd = s->head_dim, G = s->n_kv_heads, n_tiles = kv_tiles(s);
#pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < s->B; b++)
        for (int g = 0; g < G; g++)
            for (int jt = 0; jt < n_tiles; jt++) {
                real *dst = (real *)kt_tile(kt, s, b, g, jt * ATTN_KV_TILE);
                for (int j = jt * ATTN_KV_TILE; j < tile_end(jt * ATTN_KV_TILE, ATTN_KV_TILE, s->Tk); j++) {
                    const real *row = kv_row(k, s, b, j, g);
                    for (int d = 0; d < hd; d++) dst[(size_t)d * ATTN_KV_TILE + j % ATTN_KV_TILE] = row[d];
                }
            }
    return kt;
}

// S (ni, nj), row stride ATTN_KV_TILE = scale * Q[i0..i1) K[j0..j1)^T, invisible pairs -inf; kt is
// K transposed (transpose_kv).
static void tile_scores(real *S, const real *q, const real *kt, const AttnShape *s, int b, int h, int i0, int i1,
                        int j0, int j1, real scale, TileVisibility visibility) {
    int hd = s->head_dim, g = h / (s->n_heads / s->n_kv_heads);
    tile_gemm(false, false, i1 - i0, j1 - j0, hd, scale, q_row(q, s, b, i0, h), s->n_heads * hd,
              kt_tile(kt, s, b, g, j0), ATTN_KV_TILE, 0, S, ATTN_KV_TILE);
    if (visibility == TILE_VISIBLE) return;
    for (int i = i0; i < i1; i++) {
        real *row = S + (size_t)(i - i0) * ATTN_KV_TILE;
        int qp = q_position(s, i);
#pragma omp simd
        for (int j = j0; j < j1; j++) row[j - j0] = k_position(s, j) <= qp ? row[j - j0] : -INFINITY;
    }
}

// One query row's online-softmax step over its scores row[0..nj): row becomes P = exp(S - m_new)
// (0 where hidden); m, l and the output row o (hd) are rescaled to the new max.
static void softmax_tile_row(real *row, int nj, real *m, real *l, real *o, int hd) {
    real tile_max = -INFINITY;
#pragma omp simd reduction(max : tile_max)
    for (int j = 0; j < nj; j++) tile_max = row[j] > tile_max ? row[j] : tile_max;
    real m_new = tile_max > *m ? tile_max : *m;
    real correction = *m == -INFINITY ? 0 : exp_r(*m - m_new);
    real sum = 0;  // in the vector lanes' fixed order (one per binary)
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < nj; j++) {
        row[j] = row[j] == -INFINITY ? 0 : exp_r(row[j] - m_new);
        sum += row[j];
    }
    *l = *l * correction + sum;
    *m = m_new;
    for (int d = 0; d < hd; d++) o[d] *= correction;
}

void attention_flash_forward(real *out, real *lse, const real *q, const real *k, const real *v,
                             const AttnShape *s) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads, n_qtiles = (s->Tq + ATTN_Q_TILE - 1) / ATTN_Q_TILE;
    real scale = (real)(1.0 / sqrt((double)hd)), *kt = transpose_kv(attention_scratch(kt_numel(s)), k, s);
#pragma omp parallel
    {
        real *S = malloc(sizeof(real) * ATTN_Q_TILE * ATTN_KV_TILE), m[ATTN_Q_TILE], l[ATTN_Q_TILE];
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int b = 0; b < s->B; b++)
            for (int h = 0; h < s->n_heads; h++)
                for (int it = 0; it < n_qtiles; it++) {
                    int g = h / group, i0 = it * ATTN_Q_TILE, i1 = tile_end(i0, ATTN_Q_TILE, s->Tq);
                    for (int i = i0; i < i1; i++) {
                        m[i - i0] = -INFINITY, l[i - i0] = 0;
                        memset((real *)q_row(out, s, b, i, h), 0, sizeof(real) * hd);
                    }
                    for (int j0 = 0; j0 < s->Tk; j0 += ATTN_KV_TILE) {
                        int j1 = tile_end(j0, ATTN_KV_TILE, s->Tk);
                        TileVisibility visibility = tile_visibility(s, i0, i1, j0, &j1);
                        if (visibility == TILE_HIDDEN) continue;
                        tile_scores(S, q, kt, s, b, h, i0, i1, j0, j1, scale, visibility);
                        for (int i = i0; i < i1; i++)  // S row -> P row; rescale this row's state
                            softmax_tile_row(S + (size_t)(i - i0) * ATTN_KV_TILE, j1 - j0, &m[i - i0], &l[i - i0],
                                             (real *)q_row(out, s, b, i, h), hd);
                        tile_gemm(false, false, i1 - i0, hd, j1 - j0, 1, S, ATTN_KV_TILE, kv_row(v, s, b, j0, g),
                                  s->n_kv_heads * hd, 1, (real *)q_row(out, s, b, i0, h), s->n_heads * hd);
                    }
                    for (int i = i0; i < i1; i++) {
                        real *o = (real *)q_row(out, s, b, i, h), *row_lse = lse + ((size_t)b * s->n_heads + h) * s->Tq + i;
                        if (l[i - i0] > 0) {
                            for (int d = 0; d < hd; d++) o[d] /= l[i - i0];
                            *row_lse = m[i - i0] + log_r(l[i - i0]);
                        } else {
                            *row_lse = -INFINITY;  // saw no key: output 0 (ring attention merges such rows away)
                        }
                    }
                }
        free(S);
    }
}

// FlashAttention-2 backward: P is recomputed tile by tile as exp(S - lse); D_i = dO_i . O_i
// replaces rowsum(P * dP), which is the same number without needing the whole row of P. Work is
// split over (b, kv head g): the heads sharing g add into its dK/dV from one thread.
void attention_flash_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                              const real *v, const real *out, const real *lse, const AttnShape *s) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads, n_qtiles = (s->Tq + ATTN_Q_TILE - 1) / ATTN_Q_TILE;
    int ldq = s->n_heads * hd, ldk = s->n_kv_heads * hd;
    real scale = (real)(1.0 / sqrt((double)hd)), *scratch = attention_scratch(2 * kt_numel(s));
    real *kt = transpose_kv(scratch, k, s), *vt = transpose_kv(scratch + kt_numel(s), v, s);
#pragma omp parallel
    {
        real *P = malloc(sizeof(real) * ATTN_Q_TILE * ATTN_KV_TILE);
        real *dS = malloc(sizeof(real) * ATTN_Q_TILE * ATTN_KV_TILE), D[ATTN_Q_TILE];
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < s->B; b++)
            for (int g = 0; g < s->n_kv_heads; g++)
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int it = 0; it < n_qtiles; it++) {
                        int i0 = it * ATTN_Q_TILE, i1 = tile_end(i0, ATTN_Q_TILE, s->Tq), ni = i1 - i0;
                        const real *row_lse = lse + ((size_t)b * s->n_heads + h) * s->Tq;
                        for (int i = i0; i < i1; i++) D[i - i0] = dot(q_row(dout, s, b, i, h), q_row(out, s, b, i, h), hd);
                        for (int j0 = 0; j0 < s->Tk; j0 += ATTN_KV_TILE) {
                            int j1 = tile_end(j0, ATTN_KV_TILE, s->Tk);
                            TileVisibility visibility = tile_visibility(s, i0, i1, j0, &j1);
                            if (visibility == TILE_HIDDEN) continue;
                            int nj = j1 - j0;
                            tile_scores(P, q, kt, s, b, h, i0, i1, j0, j1, scale, visibility);
                            // dP = dO_I V_J^T into dS, then dS = P (dP - D) scale
                            tile_gemm(false, false, ni, nj, hd, 1, q_row(dout, s, b, i0, h), ldq, kt_tile(vt, s, b, g, j0),
                                      ATTN_KV_TILE, 0, dS, ATTN_KV_TILE);
                            for (int i = 0; i < ni; i++) {
                                real *p = P + (size_t)i * ATTN_KV_TILE, *ds = dS + (size_t)i * ATTN_KV_TILE;
                                real L = row_lse[i0 + i];
#pragma omp simd  // p and ds are different tiles
                                for (int j = 0; j < nj; j++) {
                                    p[j] = p[j] == -INFINITY || L == -INFINITY ? 0 : exp_r(p[j] - L);
                                    ds[j] = p[j] * (ds[j] - D[i]) * scale;
                                }
                            }
                            tile_gemm(true, false, nj, hd, ni, 1, P, ATTN_KV_TILE, q_row(dout, s, b, i0, h), ldq, 1,
                                      (real *)kv_row(dv, s, b, j0, g), ldk);  // dV_J += P^T dO_I
                            tile_gemm(true, false, nj, hd, ni, 1, dS, ATTN_KV_TILE, q_row(q, s, b, i0, h), ldq, 1,
                                      (real *)kv_row(dk, s, b, j0, g), ldk);  // dK_J += dS^T Q_I
                            tile_gemm(false, false, ni, hd, nj, 1, dS, ATTN_KV_TILE, kv_row(k, s, b, j0, g), ldk, 1,
                                      (real *)q_row(dq, s, b, i0, h), ldq);  // dQ_I += dS K_J
                        }
                    }
        free(P);
        free(dS);
    }
}

// ================================ SwiGLU ========================================================

static inline real sigmoid_r(real x) { return 1 / (1 + exp_r(-x)); }

void swiglu_forward(real *out, const real *gate, const real *up, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = gate[i] * sigmoid_r(gate[i]) * up[i];
}

// silu(g) = g s(g), silu'(g) = s(g) (1 + g (1 - s(g)))
void swiglu_backward(real *dgate, real *dup, const real *dout, const real *gate, const real *up, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real sg = sigmoid_r(gate[i]);
        dgate[i] = dout[i] * up[i] * sg * (1 + gate[i] * (1 - sg));
        dup[i] = dout[i] * gate[i] * sg;
    }
}

// ================================ cross-entropy =================================================

static int count_valid_targets(const int *targets, int N) {
    int n_valid = 0;
    for (int n = 0; n < N; n++) n_valid += targets[n] != IGNORE_INDEX;
    return n_valid;
}

double cross_entropy_forward(real *stats, const real *logits, const int *targets, int N, int V) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = logits + (size_t)n * V;
        real max_logit = -INFINITY;
        for (int j = 0; j < V; j++) max_logit = x[j] > max_logit ? x[j] : max_logit;
        double sum = 0;
        for (int j = 0; j < V; j++) sum += exp((double)(x[j] - max_logit));
        stats[2 * (size_t)n] = max_logit, stats[2 * (size_t)n + 1] = (real)log(sum);
    }
    double total = 0;  // summed in row order: deterministic whatever the threads
    for (int n = 0; n < N; n++)
        if (targets[n] != IGNORE_INDEX)
            total += ((double)stats[2 * (size_t)n] - logits[(size_t)n * V + targets[n]]) + stats[2 * (size_t)n + 1];
    int n_valid = count_valid_targets(targets, N);
    return n_valid ? total / n_valid : 0.0;
}

void cross_entropy_backward(real *dlogits, const real *logits, const real *stats, const int *targets, int N, int V,
                            double dloss) {
    cross_entropy_backward_columns(dlogits, logits, stats, targets, N, 0, V, dloss);
}

void cross_entropy_backward_columns(real *dlogits, const real *logits, const real *stats, const int *targets, int N,
                                    int v_start, int v_count, double dloss) {
    int n_valid = count_valid_targets(targets, N);
    real coef = n_valid ? (real)(dloss / n_valid) : 0;  // n_valid 0: every row is ignored
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = logits + (size_t)n * v_count;
        real *dx = dlogits + (size_t)n * v_count;
        if (targets[n] == IGNORE_INDEX) {
            memset(dx, 0, sizeof(real) * (size_t)v_count);
            continue;
        }
        real max_logit = stats[2 * (size_t)n], log_sum = stats[2 * (size_t)n + 1];
        for (int j = 0; j < v_count; j++) dx[j] = coef * exp_r((x[j] - max_logit) - log_sum);
        int target = targets[n] - v_start;  // this shard's column of the target, if it holds it
        if (target >= 0 && target < v_count) dx[target] -= coef;
    }
}

void add_inplace(real *x, const real *y, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

// This thread's share [*first, *first + *count) of n elements, inside a parallel region.
static void thread_share(size_t n, size_t *first, size_t *count) {
#ifdef _OPENMP
    size_t threads = (size_t)omp_get_num_threads(), t = (size_t)omp_get_thread_num();
#else
    size_t threads = 1, t = 0;
#endif
    size_t share = (n + threads - 1) / threads;
    *first = share * t < n ? share * t : n;
    *count = n - *first < share ? n - *first : share;
}

// One memset (memcpy) per thread: a single thread's stores reach about half the memory bandwidth
// of two.
void zero_fill(real *x, size_t n) {
#pragma omp parallel
    {
        size_t first, count;
        thread_share(n, &first, &count);
        memset(x + first, 0, sizeof(real) * count);
    }
}

void copy_fill(real *dst, const real *src, size_t n) {
#pragma omp parallel
    {
        size_t first, count;
        thread_share(n, &first, &count);
        memcpy(dst + first, src + first, sizeof(real) * count);
    }
}
