"""pp_bubble.py: the pipeline bubble of each rank, measured in a Chrome-trace JSON written by
build/train --trace-json (chapter 7), next to the ideal figure of the schedule.

    pp_bubble.py RUN.json [--skip-steps 1] [--json | --mean]
    pp_bubble.py RUN.json --expect-lists LISTS.txt

The bubble is a wall-clock measurement: it varies with the machine's load, so tests print it but
never assert on it (a loaded 2-core machine once measured GPipe 42.3% against interleaved 42.4%).
What a test can assert is deterministic: --expect-lists takes the per-rank action lists printed by
build/pp_schedule ("rank 0: F0s0 SA0s0 ... B1s0") and checks that in every step each rank ran
exactly those forwards and backwards (micro-batch and stage from the slices' args), in that order.

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
import pathlib
import sys
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "traces"))  # trace_summary
from trace_summary import intersection_length, length, load_chrome_events, union  # noqa: E402

ACTIONS = ("forward", "backward")


def read(path):
    """Per rank (pid): its step slices and its action slices, as (begin, end) in ns."""
    events = load_chrome_events(path)
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


def read_actions_in_steps(path):
    """Per rank, per step: the (kind, microbatch, stage) of its forward/backward slices, in order."""
    events = load_chrome_events(path)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps, actions = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        track = threads.get((e["pid"], e["tid"]))
        if track == "steps" and e["name"] == "step":
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
        elif track == "compute" and e["name"] in ACTIONS:
            kind = "F" if e["name"] == "forward" else "B"
            actions[e["pid"]].append((e["ts"], f'{kind}{e["args"]["microbatch"]}s{e["args"]["stage"]}'))
    per_step = {}
    for rank, rank_steps in steps.items():
        ordered = sorted(actions[rank])
        per_step[rank] = [[name for ts, name in ordered if begin <= ts < end] for begin, end in sorted(rank_steps)]
    return per_step


def expected_lists(path):
    """rank -> the forwards and backwards of build/pp_schedule's list for it, in order."""
    lists = {}
    with open(path) as f:
        for line in f:
            if line.startswith("rank "):
                rank, actions = line.split(":", 1)
                lists[int(rank.split()[1])] = [a for a in actions.split() if a[0] in "FB"]
    return lists


def check_lists(trace, lists_path):
    """Errors (strings) where the trace's order differs from the schedule's lists; [] when it agrees."""
    per_step, lists = read_actions_in_steps(trace), expected_lists(lists_path)
    errors = []
    if not lists:  # nothing to compare with would agree with anything
        return [f"no rank's list in {lists_path}"]
    if sorted(per_step) != sorted(lists):
        return [f"ranks in the trace {sorted(per_step)}, in the lists {sorted(lists)}"]
    for rank, rank_steps in per_step.items():
        if not rank_steps:
            errors.append(f"rank {rank}: no step slices")
        if not lists[rank]:
            errors.append(f"rank {rank}: an empty list of actions")
        for s, ran in enumerate(rank_steps):
            if ran != lists[rank]:
                errors.append(f"rank {rank} step {s + 1}: ran {' '.join(ran)}; the schedule says "
                              f"{' '.join(lists[rank])}")
    return errors


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
    ap.add_argument("--expect-lists", metavar="LISTS", help="check the order against build/pp_schedule's lists")
    args = ap.parse_args()
    if args.expect_lists:
        errors = check_lists(args.trace, args.expect_lists)
        for e in errors:
            print(f"pp_bubble: {args.trace}: {e}", file=sys.stderr)
        if not errors:
            n = sum(len(s) for s in read_actions_in_steps(args.trace).values())
            print(f"pp_bubble: {args.trace}: every rank ran its schedule's list in order ({n} rank-steps)")
        return 1 if errors else 0
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
