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
// logits: both take the max in fp32 (the same value) and sum exp in double; only the order of the
// double sum over the vocabulary shards differs, which can move the log-sum (rounded to fp32) by an
// ulp or two. Relative to max(|value|, 1), 1e-6 is ~8 fp32 ulps; the mistakes it guards against (a
// max summed over ranks, no max subtraction, a mean over ignored tokens) are off by 1e-1 or give
// inf/NaN.
#define TP_LOSS_RTOL 1e-6

// Context-parallel attention (chapter 8) against single-process attention, relative to each
// tensor's largest |value|. The blocks are the same tile computations; what changes is that a
// query's softmax is assembled from up to N partial results through the log-sum-exp merge (an exp,
// a log1p and two multiplies per merge, each <= 1 ulp = 6e-8), and dK/dV are sums of N partial
// sums instead of one running sum. With N <= 4 that is a few 1e-7; 1e-5 leaves room for larger
// rings and still fails a wrong merge, a missed block or a dK/dV sent to the wrong owner by orders
// of magnitude. With one rank the computation is the plain call: bit-identical.
#define CP_ATTENTION_RTOL 1e-5
#define CP_ATTENTION_RTOL_TEXT "1e-5"

// FP8 (chapter 9), as signal-to-quantization-noise ratios, SQNR = 20 log10(|x| / |x - q(x)|) in dB
// (torchao's test thresholds). A cast keeps 3 (E4M3) or 2 (E5M2) mantissa bits: relative error up
// to 2^-4 or 2^-3 per element, about 31 dB and 25 dB on Gaussian data with a tensor-wide scale
// (test_fp8's fixed-seed data: 31.6 and 25.6 dB; the E5M2 bound sits 0.6 dB under it, which the
// same data always meets, and one mantissa bit lost costs 6 dB). A GEMM averages K such errors, so
// no worse: its output measures 28.4 dB against FP8_SQNR_GEMM_DB. The linear's input gradient
// (an E5M2 dY times an E4M3 W, tensorwise or delayed scaling: 24.7 dB) and weight gradient (E5M2 dY
// times E4M3 X: 24.5 dB, and 19.8-22.1 dB inside the model after a backward pass) compound two and
// three quantized operands: 18 dB and 17 dB. Rowwise scaling keeps every GEMM at 28.3-28.6 dB,
// bounded by FP8_SQNR_GEMM_DB. A wrong scale or a format mix-up drops far below these (a factor-of-2
// scale error costs nothing, so the tests also check the scales themselves).
#define FP8_SQNR_CAST_DB 25.0
#define FP8_SQNR_GEMM_DB 25.0
#define FP8_SQNR_LINEAR_DGRAD_DB 18.0
#define FP8_SQNR_LINEAR_WGRAD_DB 17.0
// And at most: 3 mantissa bits cap a cast near 31 dB and nothing above averages it past ~35, while
// bf16's 8 bits give about 50 dB and no cast at all infinity. Above 45 dB no FP8 rounding happened.
#define FP8_SQNR_MAX_DB 45.0
// A tiny model's loss after one FP8 forward vs fp32: the quantization noise (~3% per element) averages
// over thousands of products; measured 6e-6 relative (tensorwise) to 1.2e-4 (rowwise), so 1e-3. At
// initialisation the loss sits near ln(vocab) whatever the blocks compute (zero logits would be 1.5e-3
// away), so the per-projection gradient SQNRs beside it are what catch a wrong projection.
#define FP8_LOSS_RTOL 1e-3
