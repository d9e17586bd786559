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

Two more checks, also deterministic, from the order in which the main thread queues work on the
comm stream (one worker runs it in that order, so the slices' start times keep it):
  --expect-prefetch-order  in backward, the all-gather of the unit that runs next is queued before
                         the reduce-scatter of the unit that just finished (it was prefetched when
                         that unit's weights were asked for); --expect-no-prefetch-order: after it.
  --expect-reduce-formula  per step and rank, every unit's gradients are reduce-scattered exactly
                         once over the shard group, at the size of the unit's forward all-gather
                         (its padded length); no gradient-sized all-reduce on the shard group; with
                         --replicate R > 1 (HSDP) each reduce-scatter is followed by one all-reduce
                         over the replicate group of its shard, 1/N of the reduce-scatter's bytes.

And the reshard policy, by its count of weight all-gathers:
  --expect-gathers N     per step and rank, exactly N all-gathers on the shard group: forward gathers
                         every unit once (L + 2 for L blocks), backward again each unit it
                         resharded after forward but the embedding, whose gradient needs no
                         weights: the default policy keeps the embedding, the head and the last
                         block (2L + 1 in all), always keeps none (2L + 3), never all (L + 2).

usage: check_fsdp_trace.py TRACE.json [--expect-prefetch NO_PREFETCH.json | --expect-no-gather-overlap]
                           [--expect-prefetch-order | --expect-no-prefetch-order]
                           [--expect-reduce-formula --shard N [--replicate R]] [--expect-gathers N]
Prints, per rank, how many all-gathers and reduce-scatters overlap a block's forward or backward.
"""
import argparse
import pathlib
import sys
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "traces"))  # trace_summary
from trace_summary import load_chrome_events  # noqa: E402


def slices_by_rank(path):
    events = load_chrome_events(path)
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
    events = load_chrome_events(path)
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


def comm_sequence_by_step(path):
    """{rank: [[(op, group, bytes), ...] per step]} in the order the comm worker started them."""
    events = load_chrome_events(path)
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps, comms = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        track = thread_names.get((e["pid"], e["tid"]), "")
        if track == "steps" and e["name"] == "step":  # not the checkpoint's gathers
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
        elif track.startswith("comm:"):
            comms[e["pid"]].append((e["ts"], e["name"], e["args"].get("group", ""), e["args"].get("bytes", 0)))
    out = {}
    for rank, spans in steps.items():
        ordered = sorted(comms[rank])
        out[rank] = [[c[1:] for c in ordered if b <= c[0] <= end] for b, end in sorted(spans)]
    return out


def backward_order_problems(seq, prefetch):
    """Backward's weight and gradient traffic from its first reduce-scatter (the head's) on: with
    prefetch R G R G R ... (block i-1's all-gather is queued when block i's weights are asked for,
    before block i's reduce-scatter), without R R G R G ... (queued when block i-1 itself runs)."""
    ops = [op for op, group, size in seq if op in ("all_gather", "reduce_scatter")]
    if "reduce_scatter" not in ops:
        return ["no reduce-scatter in the step"]
    back = ops[ops.index("reduce_scatter"):]
    if "all_gather" not in back:
        return ["no all-gather in backward"]
    first_gather = back.index("all_gather")  # reduce-scatters queued before backward's first all-gather
    if prefetch and first_gather != 1:
        return [f"backward queues {first_gather} reduce-scatters before its first all-gather: the next unit's "
                "all-gather was not started before this unit's backward (no prefetch in backward?)"]
    if not prefetch and first_gather == 1:
        return ["backward queues an all-gather before the previous unit's reduce-scatter: prefetched with "
                "prefetch off (--no-overlap)?"]
    return []


def reduce_formula_problems(seq, shard, replicate):
    reduces = [size for op, group, size in seq if op == "reduce_scatter" and group == "dp_shard_cp"]
    problems = []
    # Forward gathers every unit once, before the first reduce-scatter.
    first_r = next((i for i, (op, g, s) in enumerate(seq) if op == "reduce_scatter"), len(seq))
    forward = [size for op, group, size in seq[:first_r] if op == "all_gather" and group == "dp_shard_cp"]
    if sorted(reduces) != sorted(forward):
        problems.append(f"reduce-scatters of {sorted(reduces)} bytes, want one per unit: {sorted(forward)} "
                        "(the units' forward all-gathers)")
    big = [size for op, group, size in seq if op == "all_reduce" and group == "dp_shard_cp" and size > 64]
    if big:
        problems.append(f"gradient-sized all-reduces on the shard group ({big} bytes): reduce-scatter instead")
    if replicate > 1:
        rep = sorted(size for op, group, size in seq if op == "all_reduce" and group == "dp_replicate")
        want = sorted(size // shard for size in reduces)
        if rep != want:
            problems.append(f"replicate-group all-reduces of {rep} bytes, want {want} (each unit's shard)")
    elif any(group == "dp_replicate" for op, group, size in seq):
        problems.append("traffic on the replicate group without HSDP")
    return problems


def count_overlapping(comm, compute):
    """Comm slices that share time with at least one compute slice."""
    return sum(any(b0 < c1 and c0 < b1 for c0, c1 in compute) for b0, b1 in comm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--expect-prefetch", metavar="NO_PREFETCH_TRACE")
    mode.add_argument("--expect-no-gather-overlap", action="store_true")
    order = ap.add_mutually_exclusive_group()
    order.add_argument("--expect-prefetch-order", action="store_true")
    order.add_argument("--expect-no-prefetch-order", action="store_true")
    ap.add_argument("--expect-reduce-formula", action="store_true")
    ap.add_argument("--shard", type=int, default=0, help="ranks in the shard group (--expect-reduce-formula)")
    ap.add_argument("--replicate", type=int, default=1, help="ranks in the replicate group (HSDP)")
    ap.add_argument("--expect-gathers", type=int, metavar="N", help="all-gathers on the shard group per step")
    args = ap.parse_args()
    if args.expect_reduce_formula and args.shard < 2:
        ap.error("--expect-reduce-formula needs --shard N (N >= 2)")
    problems = []
    for rank, per_step in sorted(comm_sequence_by_step(args.trace).items()):
        for step, seq in enumerate(per_step, 1):
            found = []
            if args.expect_prefetch_order or args.expect_no_prefetch_order:
                found += backward_order_problems(seq, args.expect_prefetch_order)
            if args.expect_reduce_formula:
                found += reduce_formula_problems(seq, args.shard, args.replicate)
            if args.expect_gathers is not None:
                n = sum(op == "all_gather" and group == "dp_shard_cp" for op, group, size in seq)
                if n != args.expect_gathers:
                    found.append(f"{n} all-gathers on the shard group, want {args.expect_gathers} (reshard policy)")
            problems += [f"rank {rank} step {step}: {p}" for p in found]
    for p in problems[:6]:
        print("FAIL:", p)
    if (args.expect_prefetch_order or args.expect_no_prefetch_order or args.expect_reduce_formula
            or args.expect_gathers is not None):
        print("comm order and sizes: " + ("ok" if not problems else f"{len(problems)} problems"))
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
    print("ok" if ok and not problems else "FAIL")
    sys.exit(0 if ok and not problems else 1)


if __name__ == "__main__":
    main()
