"""Checks the context-parallel communication in a one-step trace (Chrome-trace JSON from
`train --cp N --steps 1 --trace-json`) against chapter 8's count, per layer and micro-batch:

  ring      forward N-1 K/V hops; backward N-1 K/V hops + N dK/dV hops (the last one home), each
            one batched send+recv ("batch" on comm:cp) with one flow arrow out and one in;
            --ac full adds the forward's N-1 again (the recompute reruns the ring).
  alltoall  forward 5 all-to-alls (Q, K, V in; out, lse back); backward 9 (Q, K, V, out, dout,
            lse in; dQ, dK, dV back); --ac full adds 5.

and that the ring's transfers overlap the attention blocks: on every rank some comm:cp slice runs
at the same time as a "ring attention [backward] step" slice on the compute track.

usage: check_cp_trace.py TRACE.json --cp N --layers L --microbatches M [--mode ring|alltoall] [--ac-full]
"""
import argparse
import json
import sys
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--cp", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--mode", choices=("ring", "alltoall"), default="ring")
    ap.add_argument("--ac-full", action="store_true")
    args = ap.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    n = args.cp
    if args.mode == "ring":
        op, fwd, bwd = "batch", n - 1, (n - 1) + n
    else:
        op, fwd, bwd = "all_to_all", 5, 9
    per_layer = fwd + bwd + (fwd if args.ac_full else 0)
    expected = per_layer * args.layers * args.microbatches
    comm, steps, flows_out, flows_in = (defaultdict(list) for _ in range(4))
    for e in events:
        track = names.get((e.get("pid"), e.get("tid")))
        if e.get("ph") == "X" and track == "comm:cp":
            comm[e["pid"]].append((e["name"], e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") == "X" and track == "compute" and e["name"].startswith("ring attention"):
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") in ("s", "f") and track == "comm:cp":
            (flows_out if e["ph"] == "s" else flows_in)[e["pid"]].append(e["id"])
    ok = len(comm) == n
    for pid in sorted(comm):
        count = sum(1 for name, _, _ in comm[pid] if name == op)
        line = (f"rank {pid}: {count} {op} on comm:cp (expected {expected} = {per_layer} per layer x "
                f"{args.layers} layers x {args.microbatches} micro-batches)")
        ok &= count == expected and len(comm[pid]) == count
        if args.mode == "ring":
            overlapping = sum(1 for _, b, e in comm[pid] if any(b < se and sb < e for sb, se in steps[pid]))
            line += (f", {len(flows_out[pid])} flows out / {len(flows_in[pid])} in, "
                     f"{overlapping} transfers overlapping a ring attention step (forward or backward)")
            ok &= len(flows_out[pid]) == expected and len(flows_in[pid]) == expected and overlapping > 0
        print(line)
    all_out = {i for ids in flows_out.values() for i in ids}
    all_in = {i for ids in flows_in.values() for i in ids}
    if all_out != all_in:  # every arrow leaves one cp rank and lands on another
        print(f"{len(all_out ^ all_in)} flow ids without both ends")
        ok = False
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
