"""Checks the tensor-parallel communication in a one-step trace (Chrome-trace JSON from
`train --tp N --steps 1 --trace-json`) against the chapter's formula: per block and per
micro-batch, 2 all-reduces of (tokens x dim) forward and 2 backward; plus one for the
vocab-parallel embedding lookup and one for the head's input gradient. So each rank's comm:tp
track must hold exactly 4 L + 2 all-reduces of tokens*dim*4 bytes (fp32), besides the loss's
small ones (one number or two per token) and the gradient norm's single double.

usage: check_tp_trace.py TRACE.json --layers L --tokens B*T --dim D
"""
import argparse
import json
import sys
from collections import Counter, defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    args = ap.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_rank = defaultdict(Counter)  # pid -> bytes -> count
    for e in events:
        if e.get("ph") == "X" and names.get((e["pid"], e["tid"])) == "comm:tp" and e["name"] == "all_reduce":
            per_rank[e["pid"]][e["args"]["bytes"]] += 1
    activation_bytes = args.tokens * args.dim * 4
    expected = 4 * args.layers + 2
    ok = len(per_rank) > 0
    for pid, sizes in sorted(per_rank.items()):
        n = sizes[activation_bytes]
        others = {b: c for b, c in sizes.items() if b != activation_bytes}
        print(f"rank {pid}: {n} all-reduces of {activation_bytes} bytes (expected {expected} = 4 x {args.layers} "
              f"layers + 2), {activation_bytes * n / 1e6:.3f} MB; others (bytes: count) {others}")
        ok &= n == expected and all(b <= 16 * args.tokens for b in others)
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
