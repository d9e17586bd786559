"""Times one training step of the Llama 3 model in PyTorch (fp32, CPU): forward, backward,
clip_grad_norm_ and AdamW, on random weights and random tokens, with the same shapes as the C
trainer's `--model` configs (pass the JSON that `build/train --model X --model-info` prints). Prints the same `timing:` line as build/train:

    timing: steps=<n> measured=<m> mean_step_ms=<x> tokens_per_s=<y>

(mean over the steps after the first --warmup).

Variants: --attention matmul (the oracle's explicit softmax(QK^T)V, any torch) or sdpa (torch 2.x's
fused scaled_dot_product_attention, GQA native where available); --fused-adamw (torch 2.x's
single-kernel AdamW); --compile (torch.compile of the model; the first steps pay for compilation
and are left out with --warmup).
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "py"))
import json  # noqa: E402

from llama_torch import Attention, Llama, LlamaConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-json", required=True,
                    help="the model config as printed by `build/train --model X --model-info` (config: ...)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=0, help="default: the model's max_seq_len")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the mean")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        ap.add_argument("--" + field.replace("_", "-"), type=int, help=f"override the config's {field}")
    ap.add_argument("--tied", action="store_true", help="tie the output projection to the embedding")
    ap.add_argument("--attention", choices=("matmul", "sdpa"), default="matmul")
    ap.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) (torch >= 2.4 on CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--label", default="", help="printed in the first line")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")

    torch.set_num_threads(args.threads)
    cfg = LlamaConfig.from_dict(json.loads(args.config_json))
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    cfg.tied = cfg.tied or args.tied
    T = args.seq_len or cfg.max_seq_len
    B = args.batch

    torch.manual_seed(args.seed)
    Attention.use_sdpa = args.attention == "sdpa"
    model = Llama(cfg, dtype=torch.float32).init_random(seed=args.seed)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay, **({"fused": True} if args.fused_adamw else {}))
    forward = torch.compile(model) if args.compile else model
    rng = np.random.default_rng(args.seed)
    print(f"bench_torch{' ' + args.label if args.label else ''}: torch {torch.__version__}, attention {args.attention}, "
          f"fused AdamW {args.fused_adamw}, compile {args.compile}, threads {torch.get_num_threads()}, dim {cfg.dim} x {cfg.n_layers} layers "
          f"({n_params / 1e6:.2f} M params), batch {B}, seq {T}, steps {args.steps}", flush=True)

    times = []
    for step in range(1, args.steps + 1):
        data = rng.integers(0, cfg.vocab_size, size=(2, B, T))
        tokens, targets = torch.from_numpy(data[0]), torch.from_numpy(data[1])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = Llama.loss(forward(tokens), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip) if args.grad_clip > 0 else None
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step:4d} | loss {loss.item():.6f} | grad_norm "
              f"{norm.item() if norm is not None else float('nan'):.4f} | {B * T / dt:.0f} tok/s", flush=True)
    measured = times[args.warmup:]
    mean = sum(measured) / len(measured)
    print(f"timing: steps={args.steps} measured={len(measured)} mean_step_ms={mean * 1e3:.3f} "
          f"tokens_per_s={B * T / mean:.1f}")


if __name__ == "__main__":
    main()
