// tolerances.h: every numerical tolerance of the C tests, with the reason for its size.
// A comparison passes when |ours - ref| <= ATOL + RTOL * |ref| element-wise (test_util.h).
#pragma once

// Finite differences in the float64 build: central differences with step h have truncation error
// O(h^2 * f''') and rounding error O(eps_64 / h); h = 1e-5 balances them at ~1e-10 relative.
// 1e-6 leaves headroom for the non-smooth spots (SiLU is smooth; max in softmax is not
// differentiated) without hiding a wrong gradient, which shows up at 1e-2 or worse.
#define FD_STEP 1e-5
#define FD_RTOL 1e-6
#define FD_ATOL 1e-9

// Two fp32 implementations of the same sum in a different order (OpenBLAS vs the loop matmul,
// naive vs blockwise attention): each result has error ~ sqrt(K) * eps_32 * |terms|, K <= 1024
// here, so differences of a few 1e-6 relative; 2e-5 relative plus 1e-6 absolute (for entries that
// cancel to near zero) bounds them.
#define FP32_ORDER_RTOL 2e-5
#define FP32_ORDER_ATOL 1e-6

// Context-parallel ring attention vs single-process blockwise attention (tests/test_cp_mpi.c,
// T <= 96 keys, head_dim 8, unit-normal inputs). The ring computes the same sums in another order:
// each query's softmax average is split into N <= 4 partial averages (other tile boundaries, so other
// running-max rescalings) and merged through their lse, adding ~4 roundings per merge; dK/dV are
// summed over ranks in ring order instead of query order. Reordering a sum of k <= 96 terms moves
// it by at most ~k eps_32 (6e-8) times the largest term: ~6e-6 worst case for terms of size 1, a
// few 1e-7 typically. Relative 1e-5 bounds that for entries of size ~1; absolute 1e-5 covers
// entries that cancel to near zero. A wrong block (a missed mask, a stale K/V, a dK lost on the
// ring) moves results by O(0.1-1).
#define CP_ATTN_RTOL 1e-5
#define CP_ATTN_ATOL 1e-5
