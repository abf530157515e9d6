#!/usr/bin/env python3
"""Tests tools/torch_snapshot_to_trace.py and that ctxpool reads its output.

Run by ctest (tests/trace.cmake):

    torch_snapshot_to_trace_test.py --ctxpool PATH/ctxpool [--traces DIR]

1. A small synthetic snapshot (built here) converts to the expected events,
   including blocks allocated before the recorded window.
2. A pickle that names a global is refused, not executed.
3. Each *.snapshot.pickle in --traces (the real PyTorch snapshots in
   ../shared/traces beside the checkout, when present) converts, and
   `ctxpool replay --json` replays the output with every allocation and free executed and no OOM;
   `ctxpool report --json` agrees on the event counts.
"""

import argparse
import glob
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tools", "torch_snapshot_to_trace.py")

spec = importlib.util.spec_from_file_location("torch_snapshot_to_trace",
                                              SCRIPT)
conv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conv)

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def synthetic_snapshot():
    base = 0x7F0000000000
    return {
        "segments": [{
            "device": 0, "address": base, "total_size": 2 << 20,
            "stream": 0, "segment_type": "small",
            "segment_pool_id": (0, 0),
            "blocks": [
                {"address": base, "size": 512, "requested_size": 500,
                 "state": "active_allocated"},          # live, never traced
                {"address": base + 512, "size": 1024, "requested_size": 1000,
                 "state": "active_allocated"},          # allocated in trace
                {"address": base + 1536, "size": (2 << 20) - 1536,
                 "state": "inactive"},
            ]}],
        "device_traces": [[
            {"action": "free_requested", "addr": base + 4096, "size": 2048,
             "stream": 0, "time_us": 100},            # before the window
            {"action": "free_completed", "addr": base + 4096, "size": 2048,
             "stream": 0, "time_us": 101},
            {"action": "segment_alloc", "addr": base, "size": 2 << 20,
             "stream": 0, "time_us": 102},
            {"action": "alloc", "addr": base + 512, "size": 1024,
             "stream": 0, "time_us": 103, "frames": [{"name": "f"}]},
            {"action": "snapshot", "addr": 0, "size": 0, "stream": 0,
             "time_us": 104},
            {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0,
             "time_us": 104, "device_free": 0},
        ]],
        "allocator_settings": {},
    }


def test_synthetic():
    data = pickle.dumps(synthetic_snapshot())
    trace, stats = conv.convert(conv.load_snapshot(data), 0, "synthetic")
    ops = [(e["op"], e["ptr"] - 0x7F0000000000 if e["ptr"] else 0, e["size"])
           for e in trace["events"]]
    check(ops == [
        ("allocate", 4096, 2048),    # synthesized: freed before allocated
        ("allocate", 0, 512),        # synthesized: live at the snapshot
        ("free", 4096, 2048),
        ("free_completed", 4096, 2048),
        ("segment_map", 0, 2 << 20),
        ("allocate", 512, 1024),
        ("allocate failure", 0, 1 << 40),
    ], f"synthetic conversion: {ops}")
    times = [e["time_ns"] for e in trace["events"]]
    check(times == sorted(times), "times are non-decreasing")
    check(trace["events"][-1]["time_ns"] == 4000, "time_us becomes ns")
    check(stats["dropped"] == {"snapshot": 1}, f"dropped: {stats['dropped']}")
    out = io.StringIO()
    conv.write_trace(trace, out)
    check(json.loads(out.getvalue()) == trace, "written JSON parses back")


class Evil:
    pass


def test_refuses_globals():
    data = pickle.dumps({"segments": [], "x": Evil()})
    try:
        conv.load_snapshot(data)
        check(False, "a pickle with a global must be refused")
    except pickle.UnpicklingError as e:
        check("refusing global" in str(e), f"refusal message: {e}")
    data = pickle.dumps({"segments": [], "x": os.system})
    try:
        conv.load_snapshot(data)
        check(False, "a pickle naming os.system must be refused")
    except pickle.UnpicklingError:
        pass


def run_json(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}: "
          f"{p.stderr.strip()}")
    return json.loads(p.stdout) if p.returncode == 0 else None


def test_real_snapshots(ctxpool, traces_dir, tmp):
    pickles = sorted(glob.glob(os.path.join(traces_dir, "*.snapshot.pickle")))
    if not pickles:
        print(f"note: no *.snapshot.pickle in {traces_dir}; real snapshots "
              "not tested", file=sys.stderr)
        return
    for path in pickles:
        out = os.path.join(tmp, os.path.basename(path) + ".json")
        rc = conv.main([path, "-o", out])
        check(rc == 0, f"convert {path}")
        if rc != 0:
            continue
        with open(out, encoding="utf-8") as f:
            trace = json.load(f)
        n_alloc = sum(e["op"] == "allocate" for e in trace["events"])
        n_free = sum(e["op"] == "free" for e in trace["events"])
        check(n_alloc > 100, f"{path}: {n_alloc} allocations")
        if ctxpool is None:
            continue
        r = run_json([ctxpool, "replay", out, "--json", "--no-cost-model"])
        if r is not None:
            check(r["ops"] == n_alloc + n_free,
                  f"{path}: replay ops {r['ops']} != {n_alloc + n_free}")
            check(r["ooms"] == 0, f"{path}: {r['ooms']} OOMs")
            check(r["peak_reserved_bytes"] >= r["peak_live_bytes"] > 0,
                  f"{path}: peak reserved/live {r['peak_reserved_bytes']}"
                  f"/{r['peak_live_bytes']}")
            check(r["upstream_allocations"] > 0, f"{path}: upstream")
        rep = run_json([ctxpool, "report", out, "--json"])
        if rep is not None and r is not None:
            check(rep["allocs"] == n_alloc and rep["frees"] == n_free,
                  f"{path}: report counts")
            check(rep["peak_live_bytes"] == r["peak_live_bytes"],
                  f"{path}: report and replay agree on peak live")


def test_tool_on_test_data(ctxpool):
    """The tool's JSON has the documented keys; bad traces fail with a line."""
    if ctxpool is None:
        return
    data = os.path.join(HERE, "data")
    r = run_json([ctxpool, "replay", os.path.join(data, "rmm_small.csv"),
                  "--json", "--find-min-capacity", "--device", "l4-24gb",
                  "--config", "backing=classic,max_split_size=64MiB"])
    if r is not None:
        for key in ("ops", "peak_live_bytes", "peak_reserved_bytes", "ooms",
                    "upstream_allocations", "wall_time_ns", "latency",
                    "min_capacity"):
            check(key in r, f"replay --json has {key}")
        check(r.get("ops") == 7, f"rmm_small.csv ops: {r.get('ops')}")
        check(r.get("skipped_events") == 1, "the logged failure is skipped")
        check(r["min_capacity"]["min_capacity_bytes"] >
              r["peak_live_bytes"], "min capacity above peak live")
    rep = run_json([ctxpool, "report", os.path.join(data, "rmm_small.csv"),
                    "--json"])
    if rep is not None:
        check(rep.get("allocs") == 4 and rep.get("frees") == 3,
              f"report counts: {rep}")
    bad = os.path.join(data, "bad_unknown_free.csv")
    p = subprocess.run([ctxpool, "replay", bad], capture_output=True,
                       text=True, check=False)
    check(p.returncode == 1 and f"{bad}:5: free of unknown pointer" in
          p.stderr, f"bad trace: exit {p.returncode}: {p.stderr.strip()}")
    p = subprocess.run([ctxpool, "replay", bad, "--unknown-free",
                        "synthesize", "--json"], capture_output=True,
                       text=True, check=False)
    check(p.returncode == 0, f"--unknown-free synthesize: {p.stderr}")
    p = subprocess.run([ctxpool, "replay"], capture_output=True, text=True,
                       check=False)
    check(p.returncode == 2 and "usage" in p.stderr, "usage error exits 2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctxpool", help="path of the ctxpool tool")
    ap.add_argument("--traces", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
        "traces"))
    args = ap.parse_args()
    test_synthetic()
    test_refuses_globals()
    test_tool_on_test_data(args.ctxpool)
    with tempfile.TemporaryDirectory() as tmp:
        test_real_snapshots(args.ctxpool, args.traces, tmp)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed", file=sys.stderr)
        return 1
    print("torch_snapshot_to_trace_test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
