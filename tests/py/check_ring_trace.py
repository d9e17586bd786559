"""Checks a ring trace from `collectives --trace FILE --trace-iters ITERS` on N ranks: every ring
step is one slice on the "ring" track with one flow out (to the right neighbour) and one flow in,
2(N-1) steps per all-reduce, and the comm stream's sendrecvs carry the same number of flows.

Each rank's steps also carry what the ring does at them (chapter 1): step s of the reduce-scatter
sends chunk (rank - s - 1) mod N and receives chunk (rank - s - 2) mod N, step s of the all-gather
sends chunk (rank - s) mod N and receives (rank - s - 1) mod N, in the order 0 .. N-2 each; with
COUNT (the floats of one all-reduce, --trace-bytes / 4) a step's bytes are its sent chunk's.

usage: check_ring_trace.py TRACE.pftrace N ITERS [COUNT]      (exits 1 naming the first problems)
"""
import re
import sys
from collections import defaultdict

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

path, n, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
count = int(sys.argv[4]) if len(sys.argv) > 4 else None


def chunk_begin(k):  # ring.c's ring_chunk_begin: chunk sizes differ by at most one
    q, rem = divmod(count, n)
    return q * k + rem * k // n
trace = pb.Trace()
trace.ParseFromString(open(path, "rb").read())
rank_of_pid, tracks = {}, {}
for packet in trace.packet:
    d = packet.track_descriptor
    if packet.HasField("track_descriptor") and d.HasField("process"):
        rank_of_pid[d.process.pid] = int(d.process.process_name.split()[1])
    if packet.HasField("track_descriptor") and d.HasField("thread"):
        tracks[d.uuid] = (d.thread.pid, d.thread.thread_name)

slices, stacks = [], defaultdict(list)  # slices: dicts; stacks: open slices per track
for packet in trace.packet:
    if not packet.HasField("track_event"):
        continue
    event = packet.track_event
    if event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
        pid, track = tracks[event.track_uuid]
        args = {a.name: a.string_value or a.int_value for a in event.debug_annotations}
        s = {"rank": rank_of_pid[pid], "track": track, "name": event.name, "args": args,
             "out": list(event.flow_ids), "in": []}
        stacks[event.track_uuid].append(s)
        slices.append(s)
    elif event.type == pb.TrackEvent.TYPE_SLICE_END:
        stacks[event.track_uuid].pop()["in"] += list(event.terminating_flow_ids)

problems = []
steps = [s for s in slices if s["track"] == "ring" and re.fullmatch(r"(reduce-scatter|all-gather) \d+", s["name"])]
want = iters * 2 * (n - 1) * n
if len(steps) != want:
    problems.append(f"{len(steps)} ring step slices, want {want} = {iters} x 2({n}-1) steps x {n} ranks")
for rank in range(n):  # what each step sends and receives, in order
    mine = [s for s in steps if s["rank"] == rank]
    for i, s in enumerate(mine):
        per_call = i % (2 * (n - 1))
        phase, step = ("reduce-scatter", per_call) if per_call < n - 1 else ("all-gather", per_call - (n - 1))
        send = (rank - step - 1) % n if phase == "reduce-scatter" else (rank - step) % n
        expect = {"phase": phase, "step": step, "chunk": send, "recv_chunk": (send - 1) % n}
        if count is not None:
            expect["bytes"] = 4 * (chunk_begin(send + 1) - chunk_begin(send))
        got = {k: s["args"].get(k) for k in expect}
        if s["name"] != f"{phase} {step}" or got != expect:
            problems.append(f"rank {rank} slice {i} ({s['name']}): {got}, want {expect} (named '{phase} {step}')")
sender, receiver = {}, {}
for s in steps:
    if len(s["out"]) != 1 or len(s["in"]) != 1:
        problems.append(f"rank {s['rank']} {s['name']}: {len(s['out'])} flows out and {len(s['in'])} in, want 1 and 1")
    for key in ("step", "phase", "chunk", "bytes", "peer"):
        if key not in s["args"]:
            problems.append(f"rank {s['rank']} {s['name']}: no arg {key!r}")
    if s["args"].get("peer") != (s["rank"] + 1) % n:
        problems.append(f"rank {s['rank']} {s['name']}: peer {s['args'].get('peer')}, want the right neighbour")
    sender.update({f: s for f in s["out"]})
    receiver.update({f: s for f in s["in"]})
for flow, s in sender.items():
    r = receiver.get(flow)
    if r is None:
        problems.append(f"flow {flow} from rank {s['rank']} {s['name']} ends on no ring step")
    elif r["rank"] != (s["rank"] + 1) % n or r["name"] != s["name"]:
        problems.append(f"flow {flow}: rank {s['rank']} {s['name']} -> rank {r['rank']} {r['name']}")
    if (flow - 1) & ((1 << 29) - 1) < (1 << 28):
        problems.append(f"flow {flow}: seq below RING_FLOW_SEQ0 (the comm layer's range)")
if len(sender) != want or set(sender) != set(receiver):
    problems.append(f"{len(sender)} ring flows out and {len(receiver)} in, want {want} each, the same ids")
comm_flows = sum(len(s["out"]) for s in slices if s["track"] == "comm:world")
if comm_flows != want:
    problems.append(f"{comm_flows} flows on comm:world (the comm stream's sendrecvs), want {want}")
for p in problems[:10]:
    print("ring trace:", p)
if problems:
    sys.exit(1)
print(f"ok: ring trace: {len(steps)} step slices, {len(sender)} flows each from rank r to rank r+1 mod {n} "
      f"at the same step, and {comm_flows} more on the comm stream's track")
