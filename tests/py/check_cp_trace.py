"""Checks the context-parallel communication in a trace (Chrome-trace JSON from
`train --cp N --trace-json`) against the chapter's formula. Ring attention, per layer and per
micro-batch: N-1 K/V rotations forward; backward N-1 K/V rotations and N dK/dV transfers (the last
one brings each rank its own tokens' gradients back). Each is one send/recv batch on the comm:cp
track, drawn as flows to the neighbouring ranks. With --ac full the backward recomputes each
block's forward, ring included: N-1 more per layer. So each rank's comm:cp track holds
steps x micro-batches x layers x (N-1 + [N-1 if ac full] + 2N-1) batches. With --mode alltoall
(DeepSpeed-Ulysses) the track holds all-to-alls instead, per layer and micro-batch: 5 forward (q,
k, v, out, lse), 5 more with ac full, and 9 backward (q, k, v, out, dout, lse, dq, dk, dv); and no
ring batch, as the ring mode has no all-to-all. Prints, and does not assert, how much of that
communication overlaps the attention blocks (timing depends on the load).

usage: check_cp_trace.py TRACE.json --cp N --layers L --microbatches M --steps S [--ac-full] [--mode alltoall]
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
    ap.add_argument("--cp", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ac-full", action="store_true")
    ap.add_argument("--mode", choices=["ring", "alltoall"], default="ring")
    args = ap.parse_args()
    events = load_chrome_events(args.trace)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    n = args.cp
    ring = args.mode == "ring"
    if ring:
        per_layer = (n - 1) + (n - 1 if args.ac_full else 0) + (2 * n - 1)
    else:
        per_layer = 5 + (5 if args.ac_full else 0) + 9
    transfer, other = ("batch", "all_to_all") if ring else ("all_to_all", "batch")
    expected = args.steps * args.microbatches * args.layers * per_layer
    transfers, others, blocks, comm = Counter(), Counter(), defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        track = names.get((e["pid"], e["tid"]))
        if track == "comm:cp":
            transfers[e["pid"]] += e["name"] == transfer
            others[e["pid"]] += e["name"] == other
            comm[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
        elif track == "compute" and e["name"].startswith("ring attention"):
            blocks[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    flows = sum(1 for e in events if e.get("ph") == "s")
    ok = len(transfers) == n
    for pid in sorted(transfers):
        overlap = sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in comm[pid] for b0, b1 in blocks[pid])
        busy = sum(a1 - a0 for a0, a1 in comm[pid])
        print(f"rank {pid}: {transfers[pid]} cp {transfer} slices (expected {expected} = {args.steps} steps x "
              f"{args.microbatches} micro-batches x {args.layers} layers x {per_layer}); "
              f"{100 * overlap / busy if busy else 0:.0f}% of the cp communication time overlaps attention blocks")
        ok &= transfers[pid] == expected
        if others[pid]:
            print(f"rank {pid}: {others[pid]} {other} slices on comm:cp, which --mode {args.mode} has none of")
            ok = False
    print(f"flows drawn: {flows}")
    if ring:
        ok &= flows >= n * expected  # every batch sends to a neighbour
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
