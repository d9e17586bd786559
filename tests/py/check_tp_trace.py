"""Checks the tensor-parallel communication in a one-step trace (Chrome-trace JSON from
`train --tp N --steps 1 --trace-json`) against the chapter's formula: per block and per
micro-batch, 2 all-reduces of (tokens x dim) forward and 2 backward; plus one for the
vocab-parallel embedding lookup and one for the head's input gradient. So each rank's comm:tp
track must hold exactly 4 L + 2 all-reduces of tokens*dim*4 bytes (fp32), besides the loss's
small ones (one number or two per token) and the gradient norm's single double.

With --sequence-parallel each of those all-reduces becomes a pair: 4 L + 2 all-gathers and
4 L + 2 reduce-scatters of the same (tokens x dim) buffer, and no activation-sized all-reduce; and
the norms' weight gradients, computed on each rank's rows, are summed: 2 L + 1 all-reduces of dim
floats. Any other collective of the activations' size fails the check.

usage: check_tp_trace.py TRACE.json --layers L --tokens B*T --dim D [--sequence-parallel] [--last-step]
(--last-step: only the trace's last training step, e.g. when step 1 also gathered a --grad-dump)
"""
import argparse
import pathlib
import sys
from collections import Counter, defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "traces"))  # trace_summary
from trace_summary import load_chrome_events  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--last-step", action="store_true", help="count only the last training step")
    args = ap.parse_args()
    events = load_chrome_events(args.trace)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps = defaultdict(list)  # pid -> [(begin, end)] of the training steps (not the checkpoint's gathers)
    for e in events:
        if e.get("ph") == "X" and names.get((e["pid"], e["tid"])) == "steps" and e["name"] == "step":
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    per_rank = defaultdict(Counter)  # pid -> (op, bytes) -> count
    for e in events:
        spans = steps[e["pid"]][-1:] if args.last_step else steps[e["pid"]]
        in_step = any(b <= e.get("ts", -1) <= end for b, end in spans) or not spans
        if e.get("ph") == "X" and names.get((e["pid"], e["tid"])) == "comm:tp" and in_step:
            per_rank[e["pid"]][(e["name"], e["args"]["bytes"])] += 1
    activation_bytes = args.tokens * args.dim * 4
    expected = 4 * args.layers + 2
    ops = ("all_gather", "reduce_scatter") if args.sequence_parallel else ("all_reduce",)
    ok = len(per_rank) > 0
    for pid, sizes in sorted(per_rank.items()):
        counts = {op: sizes[(op, activation_bytes)] for op in ops}
        others = {k: c for k, c in sizes.items() if k[1] != activation_bytes}
        print(f"rank {pid}: " + ", ".join(f"{n} {op} of {activation_bytes} bytes" for op, n in counts.items())
              + f" (expected {expected} each = 4 x {args.layers} layers + 2), "
              f"{activation_bytes * sum(counts.values()) / 1e6:.3f} MB; others (op, bytes): count {others}")
        unexpected = {k: c for k, c in sizes.items() if k[1] == activation_bytes and k[0] not in ops}
        if unexpected:
            print(f"rank {pid}: FAIL: collectives of the activations' size the layout does not make: {unexpected}")
        ok &= not unexpected and all(n == expected for n in counts.values())
        ok &= all(b <= 16 * args.tokens for (_, b) in others)  # the loss's per-token numbers, the norm grads
        if args.sequence_parallel:
            norms = sizes[("all_reduce", args.dim * 4)]
            print(f"rank {pid}: {norms} all_reduce of {args.dim * 4} bytes (the norms' weight gradients; "
                  f"expected {2 * args.layers + 1} = 2 x {args.layers} layers + 1)")
            ok &= norms == 2 * args.layers + 1
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
