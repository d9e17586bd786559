#!/usr/bin/env python3
"""A cluster profile for chapter 11's planner (build/plan --cluster FILE) from what bench_gpu measured
on this GPU: `bench_gpu --gemm-only` (the linears' GEMMs in bf16 and FP8, a device copy) and
`bench_gpu --attention-only` (one layer's attention). Usage:

  scripts/gpu_profile.py --gemm gemm.txt --attention attn.txt --peak-tflops 989 --out this-gpu.json

The profile holds what one GPU can measure; every other field (GPUs per node, NVLink and network
bandwidths and latencies, power) stays the default profile's (h100-sxm-ib), as cluster.c fills
a file's missing fields. What each field is:
  peak_bf16, peak_fp8   --peak-tflops (dense bf16), and twice it for FP8 (Hopper's dense FP8 rate)
  gemm_eff              the bf16 GEMMs' FLOPs / time / peak_bf16 (forward and both backward GEMMs)
  fp8_gemm_eff          the same with FP8 operands, over peak_fp8 (left out when bench_gpu skipped FP8)
  attn_eff              the planner charges attention 3 x its forward FLOPs (backward = 2 x forward,
                        plan.c) where bench_gpu counts FlashAttention's 2.5 x: the efficiency is chosen
                        so the planner's 3 x forward FLOPs take the measured forward + backward time
  hbm_bw                the copy's bytes read and written per second
  hbm_bytes             the device's memory
Exits 2 with one line when an input lacks its line or a number.
"""
import argparse
import json
import sys


def fields(path, prefix):
    """The key=value pairs of the last line of `path` starting with `prefix`, as floats."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.startswith(prefix)]
    except OSError as e:
        print(f"gpu_profile: {path}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    if not lines:
        print(f"gpu_profile: {path}: no line starting '{prefix}' (a bench_gpu run that failed or printed SKIP?)",
              file=sys.stderr)
        sys.exit(2)
    out = {}
    for token in lines[-1].split():
        key, sep, value = token.partition("=")
        if sep:
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def need(values, key, path):
    if key not in values:
        print(f"gpu_profile: {path}: no {key}= on its line", file=sys.stderr)
        sys.exit(2)
    return values[key]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm", required=True, help="bench_gpu --gemm-only output")
    ap.add_argument("--attention", required=True, help="bench_gpu --attention-only output")
    ap.add_argument("--peak-tflops", type=float, required=True, help="the device's dense bf16 peak")
    ap.add_argument("--name", default="this-gpu (bench_gpu)")
    ap.add_argument("--out", required=True, help="the profile (JSON) to write")
    args = ap.parse_args()
    if args.peak_tflops <= 0:
        print(f"gpu_profile: --peak-tflops {args.peak_tflops}: must be positive", file=sys.stderr)
        sys.exit(2)
    g, a = fields(args.gemm, "gemm:"), fields(args.attention, "attention:")
    peak = args.peak_tflops * 1e12
    profile = {"name": args.name, "peak_bf16": peak, "peak_fp8": 2 * peak}
    bf16_ms = need(g, "bf16_ms", args.gemm)
    if bf16_ms <= 0:
        print(f"gpu_profile: {args.gemm}: bf16_ms={bf16_ms}", file=sys.stderr)
        sys.exit(2)
    profile["gemm_eff"] = need(g, "bf16_flops", args.gemm) / (bf16_ms / 1e3) / peak
    if g.get("fp8_ms", 0) > 0:
        profile["fp8_gemm_eff"] = need(g, "fp8_flops", args.gemm) / (g["fp8_ms"] / 1e3) / (2 * peak)
    B, H, T, hd = (need(a, k, args.attention) for k in ("batch", "heads", "seq", "head_dim"))
    fwd_flops = 2 * B * H * T * T * hd  # causal: QK^T and PV over half the scores (gpu/mfu.h)
    attn_s = (need(a, "fwd_ms", args.attention) + need(a, "bwd_ms", args.attention)) / 1e3
    profile["attn_eff"] = 3 * fwd_flops / attn_s / peak
    profile["hbm_bw"] = need(g, "copy_bytes_per_s", args.gemm)
    profile["hbm_bytes"] = need(g, "device_bytes", args.gemm)
    # A share above 1 means the peak given is below what the device ran: build/plan refuses it.
    for k in ("gemm_eff", "fp8_gemm_eff", "attn_eff"):
        if profile.get(k, 0) > 1:
            print(f"gpu_profile: {k} {profile[k]:.3f} > 1: --peak-tflops {args.peak_tflops} is below what this "
                  f"device measured; give its dense bf16 peak", file=sys.stderr)
            sys.exit(2)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    print(f"gpu_profile: {args.out}: gemm_eff {profile['gemm_eff']:.3f}, "
          f"fp8_gemm_eff {profile.get('fp8_gemm_eff', float('nan')):.3f}, attn_eff {profile['attn_eff']:.3f}, "
          f"hbm_bw {profile['hbm_bw'] / 1e12:.2f} TB/s, {profile['hbm_bytes'] / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
