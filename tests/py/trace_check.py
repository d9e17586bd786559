"""Validates a trace written by common/trace.c against the official Perfetto schema.

    trace_check.py FILE.pftrace [--json FILE.json] [--expect-slice NAME ...]
                   [--expect-counter NAME ...] [--expect-tracks N]

The .pftrace is decoded with Perfetto's generated classes (PyPI `perfetto`), then checked for what
the trace processor silently drops or mangles: fields the schema does not know, events on
undeclared tracks, BEGIN/END that do not nest, packets without a sequence id, flows without exactly
one start and one end (or ending before they start), negative timestamps. --expect-tracks counts
every TrackDescriptor (process, thread and counter tracks). The optional JSON (Chrome trace, PyTorch
profiler shape) is checked for what Perfetto's JSON importer and Holistic Trace Analysis need.
Exit status 0 and a one-line summary on success; 1 and one line per problem otherwise.
"""
import argparse
import json
import re
import sys
from collections import Counter, defaultdict

from google.protobuf.unknown_fields import UnknownFieldSet
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TrackEvent = pb.TrackEvent
INT64_MAX = 2**63 - 1


class Problems:
    """Collects failures, at most a few of each kind, so one bug does not flood the output."""

    def __init__(self):
        self.lines, self.per_kind = [], Counter()

    def add(self, kind, message):
        self.per_kind[kind] += 1
        if self.per_kind[kind] <= 5:
            self.lines.append(f"{kind}: {message}")

    def __bool__(self):
        return bool(self.per_kind)


def unknown_field_paths(message, path):
    """Yields the path of every message in the tree that carries fields the schema does not know."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        yield f"{path} (field numbers {numbers})"
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.is_repeated:
            for i, item in enumerate(value):
                yield from unknown_field_paths(item, f"{path}.{field.name}[{i}]")
        else:
            yield from unknown_field_paths(value, f"{path}.{field.name}")


class PftraceCheck:
    def __init__(self, data, problems):
        self.problems = problems
        self.trace = pb.Trace()
        self.trace.ParseFromString(data)
        self.tracks = {}  # uuid -> TrackDescriptor
        self.slices = self.counters = 0
        self.slice_names, self.counter_names = set(), set()
        self.flow_starts, self.flow_ends = defaultdict(list), defaultdict(list)

    def run(self):
        for path in unknown_field_paths(self.trace, "trace"):
            self.problems.add("unknown field", path)
        for i, packet in enumerate(self.trace.packet):
            if packet.HasField("track_descriptor"):
                self.declare_track(i, packet.track_descriptor)
        events = []
        for i, packet in enumerate(self.trace.packet):
            if packet.HasField("track_event"):
                if self.check_event_packet(i, packet):
                    events.append((packet.timestamp, i, packet.track_event))
        # The trace processor sorts by time; equal times keep file order.
        events.sort(key=lambda e: (e[0], e[1]))
        self.check_slices_and_counters(events)
        self.check_flows()

    def declare_track(self, index, track):
        where = f"packet {index}: track {track.uuid}"
        if track.uuid == 0 or track.uuid in self.tracks:
            self.problems.add("track", f"{where}: uuid is 0 or declared twice")
        if track.HasField("thread") and not (track.thread.HasField("pid") and track.thread.HasField("tid")):
            self.problems.add("track", f"{where}: thread descriptor without pid and tid")
        if track.HasField("process") and track.process.pid == 0:
            self.problems.add("track", f"{where}: process pid 0")
        if track.HasField("parent_uuid") and track.parent_uuid not in self.tracks:
            self.problems.add("track", f"{where}: parent {track.parent_uuid} not declared before it")
        self.tracks[track.uuid] = track
        if track.HasField("counter"):
            self.counter_names.add(track.name)

    def check_event_packet(self, index, packet):
        event, where = packet.track_event, f"packet {index}"
        if packet.trusted_packet_sequence_id == 0:
            self.problems.add("sequence", f"{where}: track_event without trusted_packet_sequence_id")
        if not packet.HasField("timestamp") or packet.timestamp > INT64_MAX:
            self.problems.add("timestamp", f"{where}: missing or negative timestamp {packet.timestamp}")
        if event.track_uuid not in self.tracks:
            self.problems.add("track", f"{where}: event on undeclared track {event.track_uuid}")
            return False
        return True

    def check_slices_and_counters(self, events):
        open_slices = defaultdict(list)  # track uuid -> stack of (name, ts)
        for ts, index, event in events:
            where, track = f"packet {index} (ts {ts})", self.tracks[event.track_uuid]
            is_counter_track = track.HasField("counter")
            if event.type == TrackEvent.TYPE_COUNTER:
                if not is_counter_track:
                    self.problems.add("counter", f"{where}: counter value on non-counter track {event.track_uuid}")
                self.counters += 1
                continue
            if is_counter_track:
                self.problems.add("slice", f"{where}: slice event on counter track {track.name!r}")
            stack = open_slices[event.track_uuid]
            if event.type == TrackEvent.TYPE_SLICE_BEGIN:
                stack.append((event.name, ts))
                self.slices += 1
                self.slice_names.add(event.name)
                self.flow_starts_and_ends(event, ts, where)
            elif event.type == TrackEvent.TYPE_SLICE_END:
                if not stack:
                    self.problems.add("nesting", f"{where}: SLICE_END on track {event.track_uuid} with no open slice")
                    continue
                stack.pop()
                self.flow_starts_and_ends(event, ts, where)
            else:
                self.problems.add("event", f"{where}: unexpected event type {event.type}")
        for uuid, stack in open_slices.items():
            for name, ts in stack:
                self.problems.add("nesting", f"track {uuid}: slice {name!r} begun at {ts} never ends")

    def flow_starts_and_ends(self, event, ts, where):
        for flow in event.flow_ids:
            self.flow_starts[flow].append((ts, where))
        for flow in event.terminating_flow_ids:
            self.flow_ends[flow].append((ts, where))

    def check_flows(self):
        for flow in set(self.flow_starts) | set(self.flow_ends):
            starts, ends = self.flow_starts.get(flow, []), self.flow_ends.get(flow, [])
            if len(starts) != 1 or len(ends) != 1:
                self.problems.add("flow", f"flow {flow}: {len(starts)} starts and {len(ends)} ends, want 1 and 1")
            elif ends[0][0] < starts[0][0]:
                self.problems.add("flow", f"flow {flow}: ends ({ends[0][1]}) before it starts ({starts[0][1]})")

    def summary(self):
        return (f"{len(self.trace.packet)} packets, {len(self.tracks)} tracks, {self.slices} slices, "
                f"{self.counters} counter values, {len(self.flow_starts)} flows")


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_x_nesting(stack, event, where, problems):
    """X events on one thread must nest; partly overlapping ones go to an overflow track."""
    begin = round(event["ts"] * 1000)
    end = begin + round(event["dur"] * 1000)
    while stack and stack[-1] <= begin:
        stack.pop()
    if stack and end > stack[-1]:
        problems.add("json slice", f"{where}: {event.get('name')!r} overlaps its enclosing slice partly")
    stack.append(end)


def check_json(path, problems, expect_slices, expect_counters):
    """Returns (slices, flows) counted in the JSON file."""
    text = open(path, encoding="utf-8").read()
    if not re.search(r'"distributedInfo": \{"rank": \d+', text):
        problems.add("json", f'{path}: no "distributedInfo": {{"rank": N (HTA reads the rank with that regex)')
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        problems.add("json", f"{path}: does not parse: {e}")
        return 0, 0
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        problems.add("json", f"{path}: no traceEvents list")
        return 0, 0
    slices, names, counters, last_ts = 0, set(), set(), None
    open_ends = defaultdict(list)  # (pid, tid) -> end times (ns) of the enclosing X events
    flows = defaultdict(lambda: {"s": 0, "f": 0})
    for i, event in enumerate(events):
        where, ph = f"{path}: traceEvents[{i}]", event.get("ph")
        if not is_int(event.get("pid")) or ("tid" in event and (not is_int(event["tid"]) or event["tid"] == 0)):
            problems.add("json ids", f"{where}: pid/tid must be integers and tid non-zero: {event}")
        if ph in ("X", "s", "f") and "tid" not in event:
            problems.add("json ids", f"{where}: {ph} event without tid")
        if ph != "M":
            ts = event.get("ts")
            if not isinstance(ts, (int, float)) or ts < 0:
                problems.add("json time", f"{where}: bad ts {ts!r}")
                continue
            if last_ts is not None and ts < last_ts:
                problems.add("json time", f"{where}: ts {ts} before the previous event's {last_ts}")
            last_ts = ts
        if ph == "X":
            slices += 1
            names.add(event.get("name"))
            if not isinstance(event.get("dur"), (int, float)) or event["dur"] < 0:
                problems.add("json slice", f"{where}: X event needs dur >= 0: {event}")
                continue
            check_x_nesting(open_ends[(event["pid"], event.get("tid"))], event, where, problems)
            if not isinstance(event.get("args", {}), dict):
                problems.add("json slice", f"{where}: args must be an object")
        elif ph in ("s", "f"):
            if not is_int(event.get("id")):
                problems.add("json flow", f"{where}: flow id must be an integer: {event}")
                continue
            if ph == "f" and event.get("bp") != "e":
                problems.add("json flow", f'{where}: flow end without "bp": "e"')
            flows[event["id"]][ph] += 1
        elif ph == "C":
            counters.add(event.get("name"))
    for flow, seen in flows.items():
        if seen["s"] != 1 or seen["f"] != 1:
            problems.add("json flow", f"{path}: flow {flow}: {seen['s']} starts and {seen['f']} ends, want 1 and 1")
    for name in expect_slices:
        if name not in names:
            problems.add("expected", f"{path}: no slice named {name!r}")
    for name in expect_counters:
        if name not in counters:
            problems.add("expected", f"{path}: no counter named {name!r}")
    return slices, len(flows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pftrace")
    parser.add_argument("--json", help="also check this Chrome-trace JSON file (same run)")
    parser.add_argument("--expect-slice", action="append", default=[], metavar="NAME")
    parser.add_argument("--expect-counter", action="append", default=[], metavar="NAME")
    parser.add_argument("--expect-tracks", type=int, metavar="N", help="number of TrackDescriptors")
    args = parser.parse_args()

    problems = Problems()
    with open(args.pftrace, "rb") as f:
        check = PftraceCheck(f.read(), problems)
    check.run()
    for name in args.expect_slice:
        if name not in check.slice_names:
            problems.add("expected", f"no slice named {name!r} (have {sorted(check.slice_names)[:20]})")
    for name in args.expect_counter:
        if name not in check.counter_names:
            problems.add("expected", f"no counter track named {name!r} (have {sorted(check.counter_names)})")
    if args.expect_tracks is not None and len(check.tracks) != args.expect_tracks:
        problems.add("expected", f"{len(check.tracks)} tracks, expected {args.expect_tracks}")
    summary = check.summary()
    if args.json:
        json_slices, json_flows = check_json(args.json, problems, args.expect_slice, args.expect_counter)
        if (json_slices, json_flows) != (check.slices, len(check.flow_starts)):
            problems.add("json", f"{json_slices} slices and {json_flows} flows in the JSON, "
                                 f"{check.slices} and {len(check.flow_starts)} in the pftrace")
        summary += f"; json: {json_slices} slices, {json_flows} flows"

    if problems:
        for line in problems.lines:
            print(f"trace_check: {line}", file=sys.stderr)
        hidden = sum(problems.per_kind.values()) - len(problems.lines)
        if hidden:
            print(f"trace_check: ... and {hidden} more", file=sys.stderr)
        print(f"trace_check: FAIL {args.pftrace}: {summary}", file=sys.stderr)
        return 1
    print(f"trace_check: OK {args.pftrace}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
