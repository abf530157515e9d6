#!/usr/bin/env python3
"""Convert a PyTorch CUDA memory snapshot into a ctxpool trace (JSON form).

PyTorch records allocator events when asked:

    torch.cuda.memory._record_memory_history(max_entries=100000)
    ... run the workload ...
    torch.cuda.memory._dump_snapshot("run.pickle")

This script reads such a pickle and writes the JSON trace form that
`ctxpool replay` and `ctxpool report` read (documented in
include/ctxpool/trace/trace_io.h):

    {"format": "ctxpool-trace", "version": 1, "source": "...",
     "events": [
      {"time_ns": 0, "op": "allocate", "ptr": 1234, "size": 512, "stream": 0},
      ...
     ]}

Usage:

    tools/torch_snapshot_to_trace.py run.pickle -o run.trace.json
    ctxpool replay run.trace.json --device a10-24gb

Conversion rules:
  * device_traces[DEVICE] events map to ops: alloc -> allocate,
    free_requested (and the older free) -> free, free_completed ->
    free_completed, segment_alloc / segment_map -> segment_map, segment_free /
    segment_unmap -> segment_unmap, oom -> "allocate failure". snapshot and
    unknown actions are dropped (counted on stderr).
  * time_ns is the event's time_us relative to the first event, in ns, made
    non-decreasing.
  * PyTorch keeps only the last max_entries events, so the trace may free
    blocks allocated before it starts, and blocks still allocated at the
    snapshot may have no allocation in it. Both are added as allocations at
    the top (time 0), so every free names a live allocation and the live
    bytes at the end match the snapshot. This is the convention of the RMM
    traces in ../shared/traces (beside the checkout).

The pickle is loaded with a restricted unpickler that refuses every global:
snapshots are plain dicts, lists, tuples, strings and numbers, so a pickle
that names a class or function is not a snapshot and is rejected instead of
executed. Needs only the Python standard library.
"""

import argparse
import io
import json
import os
import pickle
import sys

OP_FOR_ACTION = {
    "alloc": "allocate",
    "free_requested": "free",
    "free": "free",
    "free_completed": "free_completed",
    "segment_alloc": "segment_map",
    "segment_map": "segment_map",
    "segment_free": "segment_unmap",
    "segment_unmap": "segment_unmap",
    "oom": "allocate failure",
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that refuses globals (classes, functions, modules)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"refusing global {module}.{name}: a memory snapshot holds only "
            "plain dicts and lists")


def load_snapshot(data):
    """Loads snapshot bytes with the restricted unpickler."""
    snapshot = RestrictedUnpickler(io.BytesIO(data)).load()
    if isinstance(snapshot, list):  # very old form: segments only
        snapshot = {"segments": snapshot, "device_traces": []}
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("not a torch.cuda.memory snapshot (no 'segments')")
    return snapshot


def convert(snapshot, device=0, source="snapshot"):
    """Returns (trace dict, stats dict) for one device of a snapshot."""
    traces = snapshot.get("device_traces") or []
    events_in = traces[device] if device < len(traces) else []
    stats = {"input_events": len(events_in), "dropped": {},
             "synthesized_before_trace": 0, "synthesized_live_at_end": 0}

    live = {}  # ptr -> size of allocations made in (or before) the trace
    prefix = []  # allocations synthesized at the top
    seen = set()  # pointers allocated in the trace so far
    events = []
    t0 = None
    last_t = 0
    for ev in events_in:
        action = ev.get("action")
        op = OP_FOR_ACTION.get(action)
        if op is None:
            stats["dropped"][action] = stats["dropped"].get(action, 0) + 1
            continue
        time_us = ev.get("time_us", 0) or 0
        if t0 is None:
            t0 = time_us
        t = max(last_t, int((time_us - t0) * 1000))
        last_t = t
        ptr = int(ev.get("addr", 0) or 0)
        size = int(ev.get("size", 0) or 0)
        stream = int(ev.get("stream", 0) or 0)
        if op == "allocate failure":
            ptr = 0
        if op == "allocate":
            if ptr in live:
                raise ValueError(f"alloc of live address {ptr:#x}")
            live[ptr] = size
            seen.add(ptr)
        elif op == "free":
            if ptr in live:
                size = live.pop(ptr)
            elif ptr not in seen:
                # Allocated before the recorded window.
                prefix.append({"time_ns": 0, "op": "allocate", "ptr": ptr,
                               "size": size, "stream": stream})
                seen.add(ptr)
                stats["synthesized_before_trace"] += 1
            else:
                raise ValueError(f"double free of {ptr:#x}")
        events.append({"time_ns": t, "op": op, "ptr": ptr, "size": size,
                       "stream": stream})

    # Blocks allocated at snapshot time with no allocation in the window.
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            ptr = int(block["address"])
            if ptr in live or ptr in seen:
                continue
            prefix.append({"time_ns": 0, "op": "allocate", "ptr": ptr,
                           "size": int(block["size"]),
                           "stream": int(seg.get("stream", 0) or 0)})
            seen.add(ptr)
            stats["synthesized_live_at_end"] += 1

    trace = {"format": "ctxpool-trace", "version": 1, "source": source,
             "events": prefix + events}
    stats["output_events"] = len(trace["events"])
    return trace, stats


def write_trace(trace, out):
    """Writes the trace JSON with one event per line."""
    out.write('{"format": "ctxpool-trace", "version": 1, "source": ')
    out.write(json.dumps(trace["source"]))
    out.write(',\n "events": [')
    for i, ev in enumerate(trace["events"]):
        out.write(",\n  " if i else "\n  ")
        out.write(json.dumps(ev, separators=(", ", ": ")))
    out.write("\n]}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Convert a torch.cuda.memory._snapshot() pickle into a "
        "ctxpool trace (JSON form).")
    parser.add_argument("snapshot", help="the .pickle file")
    parser.add_argument("-o", "--output", default="-",
                        help="output file (default: standard output)")
    parser.add_argument("--device", type=int, default=0,
                        help="CUDA device index (default 0)")
    args = parser.parse_args(argv)

    with open(args.snapshot, "rb") as f:
        data = f.read()
    try:
        snapshot = load_snapshot(data)
        trace, stats = convert(snapshot, args.device,
                               source=f"torch-snapshot:"
                               f"{os.path.basename(args.snapshot)}"
                               f":device{args.device}")
    except (pickle.UnpicklingError, ValueError, KeyError, EOFError) as e:
        print(f"torch_snapshot_to_trace: {args.snapshot}: {e}",
              file=sys.stderr)
        return 1
    if args.output == "-":
        write_trace(trace, sys.stdout)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            write_trace(trace, out)
    print(f"torch_snapshot_to_trace: {stats['input_events']} events in, "
          f"{stats['output_events']} out "
          f"({stats['synthesized_before_trace']} allocations from before the "
          f"trace, {stats['synthesized_live_at_end']} live blocks without one; "
          f"dropped {stats['dropped'] or 'nothing'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
