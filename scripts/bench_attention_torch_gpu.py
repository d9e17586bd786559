"""Times causal GQA attention alone in PyTorch on a CUDA GPU -- F.scaled_dot_product_attention in
bf16, forward and backward apart -- at the shapes `build/bench_gpu --attention-only` uses, and
prints the same line, with the same FLOP counts (gpu/mfu.h: forward 2 B H T^2 hd for the causal
half, backward 2.5x that):

    attention: batch=<B> seq=<T> heads=<H> kv_heads=<KV> head_dim=<hd> fwd_ms=<x> bwd_ms=<y> fwd_tflops=<f> bwd_tflops=<g>

Inputs are (B, heads, T, hd) as SDPA takes them; each timing is between CUDA-synchronised host
clocks, as the C side's.
"""
import argparse
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        return
    B, T, H, KV, hd = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(heads):
        return torch.randn(B, heads, T, hd, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = randn(H).requires_grad_(), randn(KV).requires_grad_(), randn(KV).requires_grad_()
    dout = randn(H)
    fwd_s = bwd_s = 0.0
    for i in range(args.steps):
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.backward(dout)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= args.warmup:
            fwd_s += t1 - t0
            bwd_s += t2 - t1
    measured = args.steps - args.warmup
    fwd_flops = 2.0 * B * H * T * T * hd
    print(f"attention: batch={B} seq={T} heads={H} kv_heads={KV} head_dim={hd} "
          f"fwd_ms={fwd_s * 1e3 / measured:.3f} bwd_ms={bwd_s * 1e3 / measured:.3f} "
          f"fwd_tflops={fwd_flops * measured / fwd_s / 1e12:.2f} "
          f"bwd_tflops={2.5 * fwd_flops * measured / bwd_s / 1e12:.2f}")


if __name__ == "__main__":
    main()
