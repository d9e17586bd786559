"""trace-summary: per rank, where the time went in a trace written by common/trace.c.

    trace_summary.py FILE [--json]

FILE is a merged .pftrace (native Perfetto) or the Chrome-trace JSON of the same run. Each process
track is a rank; its "compute" thread track holds compute, every "comm:<group>" track holds
communication. Per rank (all figures are lengths of unions of intervals, so overlapping or nested
slices count once):

  compute   union of the top-level slices on "compute", minus the slices of category "comm-wait"
            or "pipeline-wait" at any depth (the main thread blocked on communication: DDP's
            final wait, FSDP's all-gather waits inside forward, a pipeline stage waiting for its
            input)
  comm      union of the slices on the "comm:*" tracks
  exposed   comm time during which no compute slice runs, outside pipeline waits (what
            communication costs the step)
  overlap   1 - exposed / comm, in percent (empty when the rank has no comm)
  exposed by group   the same for each communicator's "comm:<group>" track alone (a line under
            the table, summed over ranks; per rank in --json): e.g. how much of the cp ring shows
  span      first begin to last end of the rank's compute and comm slices
  idle      span minus the union of compute and comm
  bubble%   bubble / span: the rank's measured bubble fraction (chapter 7 compares it with
            (p-1)/(m+p-1))
  bubble    between the first compute begin and the last compute end, the time with neither
            compute nor exposed comm: idle time, and the "pipeline-wait" slices (a stage waiting
            for the activations or gradients of another: the pipeline bubble, even though a
            receive is posted on the comm stream meanwhile)

With --device cuda, the GPU's tracks ("cuda:compute", the regions the model marks; "cuda:stream <id>",
every kernel, copy and fill CUPTI recorded) give a second set, on the device's own time:

  gpu compute   union of the top-level slices on the "cuda:*" tracks, except NCCL's kernels
  gpu comm      union of the slices of category "nccl" (NCCL's kernels)
  gpu exposed   gpu comm time during which no gpu compute runs

Other tracks (data loading, counters) are outside every figure. The total line adds the ranks up
(overlap from those sums) and gives the wall time from the earliest to the latest slice of any rank.
Text output is in milliseconds; --json prints microseconds (exact to the nanosecond) for tests.
"""
import argparse
import json
import sys
from collections import defaultdict


# ---- intervals: lists of (begin, end) in ns --------------------------------------------------------

def union(intervals):
    """Sorted, disjoint, non-touching intervals covering the same time."""
    merged = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [tuple(m) for m in merged]


def length(merged):
    return sum(end - begin for begin, end in merged)


def subtract(a, b):
    """The parts of union a not covered by union b (both sorted and disjoint)."""
    out, j = [], 0
    for begin, end in a:
        while j < len(b) and b[j][1] <= begin:
            j += 1
        k, cursor = j, begin
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def intersection_length(a, b):
    """Time covered by both of two unions (each sorted and disjoint): one merge-like sweep."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---- reading the two file forms ---------------------------------------------------------------------

WAIT_CATEGORY = "comm-wait"
PIPELINE_WAIT_CATEGORY = "pipeline-wait"
GPU_COMM_CATEGORY = "nccl"  # gpu/activity.c's category of NCCL's kernels


class Rank:
    def __init__(self, rank, name=""):
        self.rank, self.name = rank, name
        self.compute, self.comm, self.waits, self.pipeline_waits = [], [], [], []  # (begin, end) in ns
        self.comm_by_group = defaultdict(list)  # "cp", "tp", ... -> (begin, end) of its comm track
        self.gpu_compute, self.gpu_comm = [], []  # the "cuda:*" tracks: kernels and regions; NCCL's kernels
        self.kernels = defaultdict(lambda: [0, 0])  # a "cuda:stream N" slice's name -> [total ns, count]
        self.slices_seen = 0

    def add(self, track_name, begin, end, depth, category="", slice_name=""):
        self.slices_seen += 1
        if track_name.startswith("cuda:stream") and depth == 0:  # CUPTI's records: kernels, copies, fills
            self.kernels[slice_name][0] += end - begin
            self.kernels[slice_name][1] += 1
        # A slice of category "comm-wait" on the compute track (DDP's "ddp wait", FSDP's all-gather
        # waits) is the main thread blocked on communication: not compute, so the comm under it
        # counts as exposed, even when it sits inside a "forward" slice.
        if track_name == "compute" and category == WAIT_CATEGORY:
            self.waits.append((begin, end))
        elif track_name == "compute" and category == PIPELINE_WAIT_CATEGORY:
            self.pipeline_waits.append((begin, end))
        elif track_name == "compute" and depth == 0:
            self.compute.append((begin, end))
        elif track_name.startswith("comm:"):
            self.comm.append((begin, end))
            self.comm_by_group[track_name[len("comm:"):]].append((begin, end))
        elif track_name.startswith("cuda:") and category == GPU_COMM_CATEGORY:
            self.gpu_comm.append((begin, end))
        elif track_name.startswith("cuda:") and depth == 0:
            self.gpu_compute.append((begin, end))


def read_pftrace(data):
    """Ranks from the protobuf form. trace.c gives rank r the pid r + 1 (Perfetto ignores pid 0)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace()
    try:
        trace.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"not a Perfetto protobuf trace ({e})") from e
    ranks, threads = {}, {}  # pid -> Rank; track uuid -> (pid, thread name)
    for packet in trace.packet:
        track = packet.track_descriptor
        if not packet.HasField("track_descriptor"):
            continue
        if track.HasField("process"):
            ranks.setdefault(track.process.pid, Rank(track.process.pid - 1)).name = track.process.process_name
        elif track.HasField("thread"):
            threads[track.uuid] = (track.thread.pid, track.thread.thread_name)
    events = [(p.timestamp, i, p.track_event) for i, p in enumerate(trace.packet)
              if p.HasField("track_event") and p.track_event.track_uuid in threads]
    events.sort(key=lambda e: (e[0], e[1]))  # as the trace processor orders them
    stacks = defaultdict(list)  # track uuid -> begin times of the open slices
    for ts, _, event in events:
        stack = stacks[event.track_uuid]
        if event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stack.append((ts, event.categories[0] if event.categories else "", event.name))
        elif event.type == pb.TrackEvent.TYPE_SLICE_END and stack:
            begin, category, slice_name = stack.pop()
            pid, name = threads[event.track_uuid]
            ranks.setdefault(pid, Rank(pid - 1)).add(name, begin, ts, len(stack), category, slice_name)
    return list(ranks.values())


def chrome_events(text):
    """The events of a Chrome JSON trace: the object form's traceEvents, or the bare array."""
    doc = json.loads(text)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def load_chrome_events(path):
    """chrome_events of a file (what the tests' trace checks read)."""
    with open(path) as f:
        return chrome_events(f.read())


def read_json(text):
    """Ranks from the Chrome JSON form (pid = rank, one tid per track, X events in time order)."""
    events = chrome_events(text)
    ranks, thread_names = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            ranks.setdefault(e["pid"], Rank(e["pid"])).name = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
    open_ends = defaultdict(list)  # (pid, tid) -> end times of the enclosing slices
    slices = [e for e in events if e.get("ph") == "X"]
    # by start, and at one start the longer first: a parent before its children, in any file order
    for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        begin = round(e["ts"] * 1000)
        end = begin + round(e["dur"] * 1000)
        stack = open_ends[(e["pid"], e["tid"])]
        while stack and stack[-1] <= begin:
            stack.pop()
        name = thread_names.get((e["pid"], e["tid"]), "")
        rank = ranks.setdefault(e["pid"], Rank(e["pid"]))
        rank.add(name, begin, end, len(stack), e.get("cat", ""), e.get("name", ""))
        stack.append(end)
    return list(ranks.values())


def read_trace(path):
    with open(path, "rb") as f:
        data = f.read()
    if data.lstrip()[:1] in (b"{", b"["):
        return read_json(data.decode("utf-8"))
    return read_pftrace(data)


# ---- the figures ---------------------------------------------------------------------------------

def overlap_pct(comm, exposed):
    return 100.0 * (1 - exposed / comm) if comm else None


def summarize(rank):
    pipeline_waits = union(rank.pipeline_waits)
    compute = subtract(union(rank.compute), union(rank.waits + rank.pipeline_waits))
    comm = union(rank.comm)
    exposed = subtract(subtract(comm, compute), pipeline_waits)
    busy = union(compute + comm)
    row = {"rank": rank.rank, "name": rank.name, "compute": length(compute), "comm": length(comm)}
    row["exposed"] = length(exposed)
    # the same per communicator: which group's communication the compute did not hide
    row["exposed_by_group"] = {group: length(subtract(subtract(union(spans), compute), pipeline_waits))
                               for group, spans in sorted(rank.comm_by_group.items())}
    row["overlap_pct"] = overlap_pct(row["comm"], row["exposed"])
    gpu_compute, gpu_comm = union(rank.gpu_compute), union(rank.gpu_comm)
    row.update(gpu_compute=length(gpu_compute), gpu_comm=length(gpu_comm),
               gpu_exposed=length(subtract(gpu_comm, gpu_compute)))
    if not busy:
        row.update(start=0, end=0, span=0, idle=0, bubble=0, bubble_pct=0.0)
        return row
    row.update(start=busy[0][0], end=busy[-1][1])
    row["span"] = row["end"] - row["start"]
    row["idle"] = row["span"] - length(busy)
    if compute:
        window = [(compute[0][0], compute[-1][1])]
        row["bubble"] = (length(window) - intersection_length(compute, window)
                         - intersection_length(exposed, window))
    else:
        row["bubble"] = 0
    row["bubble_pct"] = 100.0 * row["bubble"] / row["span"] if row["span"] else 0.0
    return row


TIMES = ("compute", "comm", "exposed", "idle", "bubble", "span", "gpu_compute", "gpu_comm", "gpu_exposed")
US_KEYS = TIMES + ("start", "end", "wall")  # in ns internally; microseconds in --json


def total_of(rows):
    total = {key: sum(row[key] for row in rows) for key in TIMES}
    total["overlap_pct"] = overlap_pct(total["comm"], total["exposed"])
    active = [row for row in rows if row["span"]]
    total["wall"] = max(r["end"] for r in active) - min(r["start"] for r in active) if active else 0
    total["ranks"] = len(rows)
    groups = sorted({group for row in rows for group in row["exposed_by_group"]})
    total["exposed_by_group"] = {group: sum(row["exposed_by_group"].get(group, 0) for row in rows) for group in groups}
    return total


def as_us(row):
    out = {}
    for key, value in row.items():
        if key in US_KEYS:
            out[f"{key}_us"] = value / 1000
        elif key == "exposed_by_group":
            out["exposed_by_group_us"] = {group: ns / 1000 for group, ns in value.items()}
        else:
            out[key] = value
    return out


def table_line(label, row, note):
    overlap = "-" if row["overlap_pct"] is None else f"{row['overlap_pct']:.1f}"
    ms = [f"{row[key] / 1e6:10.3f}" for key in ("compute", "comm", "exposed", "idle", "bubble", "span")]
    bubble = f"{100.0 * row['bubble'] / row['span']:.1f}" if row["span"] else "-"  # totals have no bubble_pct
    return f"{label:>5} {' '.join(ms[:3])} {overlap:>8} {' '.join(ms[3:])} {bubble:>7}  {note}"


def print_table(rows, total):
    print(f"{'rank':>5} {'compute':>10} {'comm':>10} {'exposed':>10} {'overlap%':>8} {'idle':>10} {'bubble':>10} "
          f"{'span':>10} {'bubble%':>7}  (ms)")
    for row in rows:
        print(table_line(row["rank"], row, row["name"]))
    print(table_line("total", total, f"({total['ranks']} ranks, wall {total['wall'] / 1e6:.3f} ms)"))
    for row in rows:
        if row["gpu_compute"] or row["gpu_comm"]:
            gpu_overlap = overlap_pct(row["gpu_comm"], row["gpu_exposed"])
            print(f"GPU of rank {row['rank']} (ms): compute {row['gpu_compute'] / 1e6:.3f}, "
                  f"nccl {row['gpu_comm'] / 1e6:.3f}, nccl exposed {row['gpu_exposed'] / 1e6:.3f}"
                  + ("" if gpu_overlap is None else f" (overlap {gpu_overlap:.1f}%)"))
    if total["exposed_by_group"]:
        print("exposed comm by group, all ranks (ms): "
              + ", ".join(f"{group} {ns / 1e6:.3f}" for group, ns in total["exposed_by_group"].items()))


def top_kernels(rank, n):
    """The n names with the most time on the rank's cuda:stream tracks: (name, ns, count), largest first."""
    return sorted(((name, ns, count) for name, (ns, count) in rank.kernels.items()), key=lambda k: (-k[1], k[0]))[:n]


def print_kernels(rank, n):
    all_ns = sum(ns for ns, _ in rank.kernels.values())
    print(f"\nrank {rank.rank}: the {n} kernels with the most GPU time (of {all_ns / 1e6:.3f} ms in "
          f"{sum(c for _, c in rank.kernels.values())} records on the cuda:stream tracks)")
    if not rank.kernels:
        print("  none: no per-kernel records (the trace has no cuda:stream track; CUPTI was off)")
    for name, ns, count in top_kernels(rank, n):
        shown = name if len(name) <= 80 else name[:77] + "..."
        print(f"  {ns / 1e6:10.3f} ms {count:7d}x {100 * ns / max(all_ns, 1):5.1f}%  {shown}")


def non_negative_int(text):
    """argparse type: an integer >= 0 (a bad one: argparse's one-line error, exit 2)."""
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Definitions: see the top of traces/trace_summary.py or traces/README.md.")
    parser.add_argument("trace", help=".pftrace or Chrome-trace .json written by common/trace.c")
    parser.add_argument("--json", action="store_true", help="print JSON (microseconds) instead of the table")
    parser.add_argument("--kernels", type=non_negative_int, default=0, metavar="N",
                        help="also each rank's N kernels (CUPTI's records on the cuda:stream tracks) with the most "
                             "GPU time: total, count, share of all records' time")
    args = parser.parse_args()
    try:
        ranks = read_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # also a JSON of other shapes
        print(f"trace-summary: {args.trace}: not a trace this tool reads: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if not any(rank.slices_seen for rank in ranks):  # an empty file, or one cut before its first slice
        print(f"trace-summary: {args.trace}: no slices: not a trace, or one cut short", file=sys.stderr)
        return 2
    ordered = sorted(ranks, key=lambda r: r.rank)
    rows = [summarize(rank) for rank in ordered]
    total = total_of(rows)
    if args.json:
        doc = {"ranks": [as_us(row) for row in rows], "total": as_us(total)}
        if args.kernels:
            for row, rank in zip(doc["ranks"], ordered):
                top = top_kernels(rank, args.kernels)
                row["kernels"] = [{"name": n, "us": ns / 1e3, "count": c} for n, ns, c in top]
        print(json.dumps(doc, indent=1))
    else:
        print_table(rows, total)
        if args.kernels:
            for rank in ordered:
                print_kernels(rank, args.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
