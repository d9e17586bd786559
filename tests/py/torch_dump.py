"""A one-step dump written by PyTorch in float64, for `build/train --compare` (reference_cpu/dump.c):
the reference's forward and backward checked against torch's on what the trainer's data never
produces. --ignore puts IGNORE_INDEX targets in: some (every third of the first sequence), a
whole sequence, or every target (torch's mean is then 0/0 = NaN; the reference's promise, ops.h,
is a loss of 0 and zero gradients, which is what the dump then holds).

    torch_dump.py OUT.safetensors [--ignore none|some|row|all] [--seed S]
"""
import argparse
import json
import sys

import numpy as np
import torch

sys.path.insert(0, "tests/py")
import safetensors_io  # noqa: E402
from llama_torch import IGNORE_INDEX, Llama, LlamaConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--ignore", choices=("none", "some", "row", "all"), default="some")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    B, T = 2, 16
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=T)
    model = Llama(cfg, dtype=torch.float64).init_random(seed=args.seed, std=0.02)
    rng = np.random.default_rng(args.seed)
    inputs = rng.integers(0, cfg.vocab_size, size=(1, B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, size=(1, B, T)).astype(np.int32)
    if args.ignore == "some":
        targets[0, 0, ::3] = IGNORE_INDEX
    elif args.ignore == "row":
        targets[0, 0, :] = IGNORE_INDEX
    elif args.ignore == "all":
        targets[:] = IGNORE_INDEX
    logits = model(torch.from_numpy(inputs[0].astype(np.int64)))
    loss = Llama.loss(logits, torch.from_numpy(targets[0].astype(np.int64)))
    if args.ignore == "all":
        assert torch.isnan(loss), loss  # torch's 0/0; the reference's defined value instead
        loss = (logits * 0).sum()
    loss.backward()
    out = {"inputs": inputs, "targets": targets, "logits": logits.detach().numpy(), "loss": np.array([loss.item()])}
    for name, p in model.named_parameters():
        out["param." + name] = p.detach().numpy()
        out["grad." + name] = p.grad.numpy()
    safetensors_io.save(args.out, out, {"format": "llama-ref-dump-v1", "config": json.dumps(cfg.to_dict())})
    print(f"torch_dump: {args.out}: --ignore {args.ignore}, loss {loss.item():.12g}")


if __name__ == "__main__":
    main()
