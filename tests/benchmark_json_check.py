#!/usr/bin/env python3
"""A Google Benchmark executable's JSON output is pure JSON.

  benchmark_json_check.py --work=DIR [--table=REGEX] -- BENCHMARK [ARGS...]

Runs BENCHMARK ARGS twice (benchmarks/CMakeLists.txt registers it for each
ctxpool_bench_*):
  1. with --benchmark_format=json: stdout must json.load as a whole, with a
     non-empty "benchmarks" list of named runs; the benchmark's own summary
     table (matching REGEX, when given) must be on stderr, not stdout;
  2. with --benchmark_out=DIR/<name>.json --benchmark_out_format=json and
     the console display: the file must be such JSON, and the table must
     still be on stdout beside the console reporter's rows.
Each run must exit 0.
"""

import argparse
import json
import os
import re
import subprocess
import sys


def fail(msg):
    print(f"benchmark_json_check: FAIL: {msg}", flush=True)
    sys.exit(1)


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=300)
    out = p.stdout.decode(errors="replace")
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}:\n{out}\n{err}")
    return out, err


def check_json(text, what):
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"{what} is not pure JSON ({e}):\n{text[-2000:]}")
    runs = doc.get("benchmarks") if isinstance(doc, dict) else None
    if not isinstance(runs, list) or not runs:
        fail(f"{what}: no \"benchmarks\" list with entries:\n{text[-2000:]}")
    for r in runs:
        if not isinstance(r, dict) or not r.get("name"):
            fail(f"{what}: a benchmark entry without a name: {r!r}")
    if "context" not in doc:
        fail(f"{what}: no \"context\"")
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--table", default=None,
                    help="a regex the summary table matches")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        fail("no benchmark command given")
    table = re.compile(args.table, re.M) if args.table else None
    name = os.path.basename(cmd[0])

    out, err = run(cmd + ["--benchmark_format=json"])
    runs = check_json(out, f"{name} --benchmark_format=json: stdout")
    if table and not table.search(err):
        fail(f"{name} --benchmark_format=json: no summary table on stderr:\n"
             f"{err}")
    print(f"benchmark_json_check: {name} --benchmark_format=json: "
          f"{len(runs)} runs, pure JSON on stdout")

    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, name + ".json")
    if os.path.exists(path):
        os.remove(path)
    out, err = run(cmd + [f"--benchmark_out={path}",
                          "--benchmark_out_format=json"])
    if not os.path.exists(path):
        fail(f"{name} --benchmark_out={path}: no file written")
    with open(path, encoding="utf-8") as f:
        runs = check_json(f.read(), f"{name} --benchmark_out={path}")
    if table and not table.search(out):
        fail(f"{name} (console): no summary table on stdout:\n{out}")
    print(f"benchmark_json_check: {name} --benchmark_out_format=json: "
          f"{len(runs)} runs, pure JSON in {path}; console table on stdout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
