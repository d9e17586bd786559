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

// The vocab-parallel loss (build/tp_loss) against cross_entropy_forward/backward on the full
// logits: both take the max in fp32 and sum exp in double; only the order of the double sum over
// the vocabulary shards differs, which can move lse (rounded to fp32) by an ulp or two. Relative
// to max(|value|, 1), 1e-6 is ~8 fp32 ulps; the mistakes it guards against (a max summed over
// ranks, no max subtraction, a mean over ignored tokens) are off by 1e-1 or give inf/NaN.
#define TP_LOSS_RTOL 1e-6
