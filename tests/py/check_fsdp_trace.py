"""Checks what chapter 3 tells readers to look for in a ZeRO-3 timeline (Chrome-trace JSON from
`train --trace-json`): with prefetch, the next unit's all-gather is started before the current
block computes, so it can run under that compute; without prefetch (--no-overlap), no all-gather
overlaps a block, since each one is started and waited for right before its unit computes.

Whether a prefetched all-gather really shares time with a block depends on how the operating
system schedules the comm thread (on a loaded machine it may run only after the block), so that
overlap is printed, never asserted. What is asserted is deterministic:
  --expect-no-gather-overlap: no all-gather slice shares time with a block (each ended, and was
    waited for, before its block began: cause and effect, not timing);
  --expect-prefetch NO_PREFETCH.json: at the start of the forward blocks, the gathered weights
    resident ("mem params" counter, updated by the main thread when it allocates the all-gather's
    buffer) exceed those of the same run without prefetch: the next unit's buffer is already there.

usage: check_fsdp_trace.py TRACE.json (--expect-prefetch NO_PREFETCH.json | --expect-no-gather-overlap)
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


def params_at_forward_blocks(path):
    """rank -> the "mem params" counter value at the start of each forward block, in order."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    counters, blocks = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") == "C" and e.get("name") == "mem params":
            counters[e["pid"]].append((e["ts"], e["args"]["bytes"]))
        elif e.get("ph") == "X" and e["name"] == "block fwd" and thread_names.get((e["pid"], e["tid"])) == "compute":
            blocks[e["pid"]].append(e["ts"])
    values = {}
    for rank, starts in blocks.items():
        samples = sorted(counters[rank])
        values[rank] = [max((v for ts, v in samples if ts <= start), default=0.0) for start in sorted(starts)]
    return values


def count_overlapping(comm, compute):
    """Comm slices that share time with at least one compute slice."""
    return sum(any(b0 < c1 and c0 < b1 for c0, c1 in compute) for b0, b1 in comm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--expect-prefetch", metavar="NO_PREFETCH_TRACE")
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
        elif args.expect_no_gather_overlap:
            ok &= gathers == 0
    if args.expect_prefetch:
        with_prefetch, without = params_at_forward_blocks(args.trace), params_at_forward_blocks(args.expect_prefetch)
        for rank in sorted(with_prefetch):
            a, b = sum(with_prefetch[rank]), sum(without.get(rank, []))
            more = len(with_prefetch[rank]) == len(without.get(rank, [])) and a > b
            print(f"rank {rank}: gathered weights at the start of {len(with_prefetch[rank])} forward blocks: "
                  f"{a / 2**20:.2f} MiB summed with prefetch, {b / 2**20:.2f} MiB without")
            ok &= more
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
