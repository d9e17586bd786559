"""pp_bubble.py: the pipeline bubble of each rank, measured in a Chrome-trace JSON written by
build/train --trace-json (chapter 7), next to the ideal figure of the schedule.

    pp_bubble.py RUN.json [--skip-steps 1] [--json | --mean]

Definition, the one the formula (p-1)/(v*m+p-1) uses: per step, the schedule's window runs from the
first forward or backward of any rank to the last one of any rank (all ranks share the clock, see
traces/README.md); a rank's bubble is the part of the window in which it runs no forward or backward
(the "forward" and "backward" slices of its compute track: the pipeline's actions). The figure per
rank is the sum over the steps of its idle time over the sum of the windows. The first steps are
skipped (warm-up: page faults, first allocations).

trace-summary's "bubble%" column measures the same per rank over the rank's whole span (the
executor's "pipeline-wait" slices count as bubble there).
"""
import argparse
import json
import sys
from collections import defaultdict

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/traces")
from trace_summary import intersection_length, length, union  # noqa: E402

ACTIONS = ("forward", "backward")


def read(path):
    """Per rank (pid): its step slices and its action slices, as (begin, end) in ns."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps, actions = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        begin = round(e["ts"] * 1000)
        interval = (begin, begin + round(e["dur"] * 1000))
        track = threads.get((e["pid"], e["tid"]))
        if track == "steps" and e["name"] == "step":
            steps[e["pid"]].append(interval)
        elif track == "compute" and e["name"] in ACTIONS:
            actions[e["pid"]].append(interval)
    return steps, actions


def bubbles(steps, actions, skip):
    ranks = sorted(actions)
    n_steps = min(len(steps[r]) for r in ranks)
    idle, window_total = defaultdict(int), 0
    for s in range(skip, n_steps):
        mine = {r: union([a for a in actions[r] if steps[r][s][0] <= a[0] < steps[r][s][1]]) for r in ranks}
        window = (min(m[0][0] for m in mine.values()), max(m[-1][1] for m in mine.values()))
        window_total += window[1] - window[0]
        for r in ranks:
            idle[r] += (window[1] - window[0]) - intersection_length(mine[r], [window])
    return {r: idle[r] / window_total for r in ranks}, window_total / (n_steps - skip) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="Chrome-trace JSON from build/train --trace-json")
    ap.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out (default 1)")
    ap.add_argument("--json", action="store_true", help="print the fractions per rank, their mean and the window")
    ap.add_argument("--mean", action="store_true", help="print only the mean fraction over the ranks")
    args = ap.parse_args()
    steps, actions = read(args.trace)
    if not actions:
        print(f"pp_bubble: {args.trace}: no forward/backward slices", file=sys.stderr)
        return 2
    per_rank, window_ms = bubbles(steps, actions, args.skip_steps)
    mean = sum(per_rank.values()) / len(per_rank)
    if args.mean:
        print(mean)
        return 0
    if args.json:
        print(json.dumps({"ranks": {str(r): f for r, f in per_rank.items()}, "mean": mean, "window_ms": window_ms}))
        return 0
    for r, f in per_rank.items():
        print(f"rank {r}: bubble {100 * f:5.1f}% of the schedule window")
    print(f"mean {100 * mean:5.1f}% (window {window_ms:.2f} ms per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
