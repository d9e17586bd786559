"""Times training steps of the Llama 3 model in PyTorch on a CUDA GPU, set up as build/bench_gpu
is: fp32 master weights with bf16 compute (torch.autocast), causal GQA attention through
F.scaled_dot_product_attention, clip_grad_norm_(1.0) and fused AdamW, on one fixed random batch.
--mode eager or compile (torch.compile of the model). Prints the same `timing:` line as
build/bench_gpu (means over the steps after --warmup):

    timing: steps=<n> measured=<m> mean_step_ms=<x> tokens_per_s=<y> tflops=<z> mfu=<u> last_loss=<l>

The model is tests/py/llama_torch.py's (the oracle's), with its attention's score/softmax/value
matmuls replaced by SDPA; MFU uses the FLOPs per token the C side prints (--flops-per-token), so
both count the same work.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "py"))
from llama_torch import Attention, Llama, LlamaConfig, apply_rope, rope_tables  # noqa: E402


def sdpa_forward(self, x, cos, sin):
    b, t, _ = x.shape
    hd = self.head_dim
    q = apply_rope(self.wq(x).view(b, t, self.n_heads, hd), cos, sin)
    k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, hd), cos, sin)
    v = self.wv(x).view(b, t, self.n_kv_heads, hd)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, heads, T, hd)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return self.wo(out.transpose(1, 2).reshape(b, t, self.n_heads * hd))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-json", required=True, help="`build/train --model X --model-info`'s config line")
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--n-layers", type=int, default=0, help="override n_layers (0: the config's; the trainer's flag)")
    ap.add_argument("--flops-per-token", type=float, required=True, help="as build/bench_gpu prints it")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        return
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")

    cfg = LlamaConfig.from_dict(json.loads(args.config_json))
    if args.n_layers:
        cfg.n_layers = args.n_layers
    B, T = args.batch, args.seq_len
    dev = torch.device("cuda")
    Attention.forward = sdpa_forward
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(cfg, dtype=torch.float32)
    with torch.no_grad():  # the C reference's init scheme (values differ: benchmark only)
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, resid_std if (".wo." in name or ".w2." in name) else 0.02)
    for dtype in (torch.float32, torch.bfloat16):  # RoPE tables on the device, for either input dtype
        model._rope[(T, dtype)] = tuple(t.to(dev) for t in rope_tables(cfg, T, dtype))
    n_params = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model) if args.mode == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    g = torch.Generator(device=dev).manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    print(f"bench_torch_gpu: torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.mode}, "
          f"dim {cfg.dim} x {cfg.n_layers} layers ({n_params / 1e9:.3f} B params), batch {B} x {T}", flush=True)

    loss = None
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = Llama.loss(step_model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step <= args.warmup:
            print(f"warm-up step {step}: loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    measured = args.steps - args.warmup
    tokens_per_s = B * T * measured / seconds
    flops = tokens_per_s * args.flops_per_token
    print(f"timing: steps={args.steps} measured={measured} mean_step_ms={seconds * 1e3 / measured:.3f} "
          f"tokens_per_s={tokens_per_s:.1f} tflops={flops / 1e12:.2f} mfu={flops / (args.peak_tflops * 1e12):.4f} "
          f"last_loss={loss.item():.4f}")
    print(f"memory: peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
