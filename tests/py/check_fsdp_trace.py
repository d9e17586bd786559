"""Checks what chapter 3 tells readers to look for in a ZeRO-3 timeline (Chrome-trace JSON from
`train --trace-json`): with prefetch, all-gathers run under the compute of the blocks (the next
unit's weights arrive while the current one computes) and reduce-scatters run under backward;
without prefetch (--no-overlap), no all-gather overlaps a block, since each one is started and
waited for right before its unit computes.

usage: check_fsdp_trace.py TRACE.json (--expect-overlap | --expect-no-gather-overlap)
Prints, per rank, how many all-gathers and reduce-scatters overlap a block's forward or backward.
"""
import argparse
import json
import sys
from collections import defaultdict


def slices_by_rank(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    thread_names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
    ranks = defaultdict(lambda: defaultdict(list))  # rank -> kind -> [(begin, end)]
    for e in events:
        if e.get("ph") != "X":
            continue
        track = thread_names.get((e["pid"], e["tid"]), "")
        span = (e["ts"], e["ts"] + e["dur"])
        if track == "compute" and e["name"] in ("block fwd", "block bwd"):
            ranks[e["pid"]][e["name"]].append(span)
        elif track.startswith("comm:") and e["name"] in ("all_gather", "reduce_scatter"):
            ranks[e["pid"]][e["name"]].append(span)
    return ranks


def count_overlapping(comm, compute):
    """Comm slices that share time with at least one compute slice."""
    return sum(any(b0 < c1 and c0 < b1 for c0, c1 in compute) for b0, b1 in comm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--expect-overlap", action="store_true")
    mode.add_argument("--expect-no-gather-overlap", action="store_true")
    args = ap.parse_args()
    ranks = slices_by_rank(args.trace)
    if not ranks:
        sys.exit(f"{args.trace}: no block or comm slices")
    ok = True
    for rank, kinds in sorted(ranks.items()):
        blocks = kinds["block fwd"] + kinds["block bwd"]
        gathers = count_overlapping(kinds["all_gather"], blocks)
        reduces = count_overlapping(kinds["reduce_scatter"], kinds["block bwd"])
        print(f"rank {rank}: {gathers} of {len(kinds['all_gather'])} all-gathers overlap a block, "
              f"{reduces} of {len(kinds['reduce_scatter'])} reduce-scatters overlap a block's backward")
        if not kinds["all_gather"] or not kinds["reduce_scatter"]:
            ok = False
        elif args.expect_overlap:
            ok &= gathers > 0 and reduces > 0
        else:
            ok &= gathers == 0
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
