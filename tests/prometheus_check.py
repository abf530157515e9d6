#!/usr/bin/env python3
"""Checks ctxpool's Prometheus expositions with a real text-format parser.

  prometheus_check.py --parser=promtool|python --work=DIR
                      [--multi-model-server=PATH] [--exposition-test=PATH]

Expositions (each that its binary is given for):
  multi_model_server        the metrics examples/multi_model_server prints
                            (the block between its own output lines), one
                            simulated H100
  multi_model_server_rich   the same on two simulated L4s, 6 models, --leak,
                            CTXPOOL_CTX_SCHED=spin and a fake cgroup v2 whose
                            path needs escaping (quote, backslash, space,
                            UTF-8) through CTXPOOL_SYSFS_ROOT
  exposition_test           tests/prometheus_exposition_test.cc's dump: open
                            sessions on two devices, model names that need
                            escaping (and one that is not UTF-8)

Parsers:
  promtool  `promtool check metrics` (Debian package prometheus): it must
            exit 0 and print nothing (any lint or parse problem fails)
  python    prometheus_client.parser.text_string_to_metric_families (Debian
            package python3-prometheus-client): every sample line parses,
            enough families, each family's type as its # TYPE line says, the
            escaped label values come back as written

Exits 77 (ctest: skipped) when the parser is not installed, 1 on a problem.
"""

import argparse
import os
import shutil
import subprocess
import sys

SKIP = 77
MIN_FAMILIES = 30

# The cgroup of the rich run, relative to the fake root's /sys/fs/cgroup.
WEIRD_CGROUP = 'kube"pods\\pod 1/ctr-\u00e9'

# tests/prometheus_exposition_test.cc's model names as they must parse back
# (bytes that are not UTF-8 become U+FFFD).
EXPOSITION_TEST_MODELS = {
    "bert",
    'we"ird\\name\nx',
    "tab\there",
    "mod\u00e8le-\u6a21\u578b",
    "not-utf8-\ufffd\ufffd",
    "gone",
}

# Families every exposition has, with their types (counters by the name of
# their samples).
CORE_FAMILIES = {
    "ctxpool_runtime_info": "gauge",
    "ctxpool_process_info": "gauge",
    "ctxpool_device_live_bytes": "gauge",
    "ctxpool_device_fragmentation_ratio": "gauge",
    "ctxpool_device_ooms_total": "counter",
    "ctxpool_device_cache_hits_total": "counter",
    "ctxpool_model_live_bytes": "gauge",
    "ctxpool_model_leaked_bytes_total": "counter",
    "ctxpool_device_context_sched_flags": "gauge",
}


def fail(msg):
    print(f"prometheus_check: FAIL: {msg}", flush=True)
    sys.exit(1)


def run(cmd, env_extra, what):
    env = dict(os.environ)
    env.update(env_extra)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=120)
    if p.returncode != 0:
        fail(f"{what}: {' '.join(cmd)} exited {p.returncode}:\n"
             f"{p.stdout.decode(errors='replace')}\n"
             f"{p.stderr.decode(errors='replace')}")
    return p.stdout


def fake_cgroup_root(work):
    root = os.path.join(work, "fake_root")
    shutil.rmtree(root, ignore_errors=True)
    cg = os.path.join(root, "sys/fs/cgroup", WEIRD_CGROUP)
    os.makedirs(cg)
    os.makedirs(os.path.join(root, "proc/self"))

    def write(path, text):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    write(os.path.join(root, "proc/self/cgroup"), f"0::/{WEIRD_CGROUP}\n")
    write(os.path.join(os.path.dirname(cg), "memory.max"), "2147483648\n")
    write(os.path.join(cg, "memory.max"), "max\n")
    write(os.path.join(cg, "memory.high"), "1073741824\n")
    write(os.path.join(cg, "memory.current"), "1048576\n")
    write(os.path.join(cg, "memory.stat"),
          "active_file 4096\ninactive_file 8192\n")
    return root


def metrics_block(stdout, what):
    """The exposition in multi_model_server's output: from the first # HELP
    line while lines are comments or ctxpool_ samples; the example's own
    summary line must follow (so no malformed line ended the block early)."""
    lines = stdout.split(b"\n")
    start = next((i for i, l in enumerate(lines) if l.startswith(b"# HELP ")),
                 None)
    if start is None:
        fail(f"{what}: no metrics in the output:\n{stdout.decode(errors='replace')}")
    end = start
    while end < len(lines) and (lines[end].startswith(b"# ") or
                                lines[end].startswith(b"ctxpool_")):
        end += 1
    if end >= len(lines) or not lines[end].startswith(b"multi_model_server: "):
        fail(f"{what}: the metrics block ends at an unexpected line "
             f"{lines[end] if end < len(lines) else b'<eof>'!r}")
    return b"\n".join(lines[start:end]) + b"\n"


def expositions(args):
    out = []
    work = args.work
    os.makedirs(work, exist_ok=True)
    if args.multi_model_server:
        mms = args.multi_model_server
        text = metrics_block(
            run([mms, "--models=4", "--requests=20"],
                {"CTXPOOL_DRIVER": "sim:h100-80gb"}, "multi_model_server"),
            "multi_model_server")
        out.append(("multi_model_server", text, {}))
        root = fake_cgroup_root(work)
        text = metrics_block(
            run([mms, "--models=6", "--requests=10", "--leak"],
                {"CTXPOOL_DRIVER": "sim:2xl4-24gb", "CTXPOOL_SYSFS_ROOT": root,
                 "CTXPOOL_CTX_SCHED": "spin"},
                "multi_model_server (rich)"),
            "multi_model_server (rich)")
        out.append(("multi_model_server_rich", text,
                    {"cgroup": "/" + WEIRD_CGROUP, "devices": 2}))
    if args.exposition_test:
        root = fake_cgroup_root(work)
        dump = os.path.join(work, "exposition_test.prom")
        if os.path.exists(dump):
            os.remove(dump)
        run([args.exposition_test, "--gtest_filter=PrometheusExposition.*"],
            {"CTXPOOL_PROMETHEUS_DUMP": dump, "CTXPOOL_SYSFS_ROOT": root,
             "CTXPOOL_CTX_SCHED": "yield"}, "prometheus_exposition_test")
        if not os.path.exists(dump):
            fail(f"prometheus_exposition_test wrote no {dump}")
        with open(dump, "rb") as f:
            out.append(("exposition_test", f.read(),
                        {"cgroup": "/" + WEIRD_CGROUP, "devices": 2,
                         "models": EXPOSITION_TEST_MODELS}))
    if not out:
        fail("no binary given: nothing to check")
    for name, text, _ in out:
        with open(os.path.join(work, name + ".prom"), "wb") as f:
            f.write(text)
    return out


def check_promtool(promtool, name, text):
    p = subprocess.run([promtool, "check", "metrics"], input=text,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=60)
    report = p.stdout.decode(errors="replace").strip()
    if p.returncode != 0 or report:
        fail(f"{name}: promtool check metrics exited {p.returncode}:\n{report}")
    print(f"prometheus_check: {name}: promtool check metrics: clean "
          f"({text.count(b'# TYPE ')} families)")


def check_python(parser, name, raw, expect):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{name}: the exposition is not UTF-8: {e}")
    declared = {}
    sample_lines = 0
    for line in text.split("\n"):
        if line.startswith("# TYPE "):
            _, _, fam, typ = line.split(" ", 3)
            if fam in declared:
                fail(f"{name}: a second # TYPE line for {fam}")
            declared[fam] = typ
        elif line and not line.startswith("#"):
            sample_lines += 1
    try:
        families = list(parser(text))
    except Exception as e:  # the parser raises ValueError & co.
        fail(f"{name}: prometheus_client cannot parse it: {e!r}")
    parsed = sum(len(f.samples) for f in families)
    if parsed != sample_lines:
        fail(f"{name}: {sample_lines} sample lines, {parsed} samples parsed")
    if len(families) < MIN_FAMILIES or len(families) != len(declared):
        fail(f"{name}: {len(families)} families parsed, {len(declared)} "
             f"declared (want >= {MIN_FAMILIES})")
    by_name = {}
    for f in families:
        # The client names a counter family without its _total suffix.
        fam = f.name + "_total" if f.type == "counter" else f.name
        if declared.get(fam) != f.type:
            fail(f"{name}: family {fam} parsed as {f.type}, "
                 f"# TYPE says {declared.get(fam)}")
        if f.type == "counter" and not fam.endswith("_total"):
            fail(f"{name}: counter {fam} does not end in _total")
        if not f.documentation:
            fail(f"{name}: family {fam} has no HELP")
        for s in f.samples:
            if s.name != fam:
                fail(f"{name}: sample {s.name} in family {fam}")
            if s.value != s.value:
                fail(f"{name}: {s.name}{s.labels} is NaN")
        by_name[fam] = f
    for fam, typ in CORE_FAMILIES.items():
        if fam not in by_name or by_name[fam].type != typ:
            fail(f"{name}: no {typ} family {fam}")
    info = by_name["ctxpool_process_info"].samples
    if len(info) != 1 or info[0].labels.get("pid") in (None, ""):
        fail(f"{name}: ctxpool_process_info: {info}")
    if "cgroup" in expect and info[0].labels.get("cgroup") != expect["cgroup"]:
        fail(f"{name}: cgroup label {info[0].labels.get('cgroup')!r}, want "
             f"{expect['cgroup']!r}")
    devices = {s.labels["device"]
               for s in by_name["ctxpool_device_live_bytes"].samples}
    if len(devices) != expect.get("devices", 1):
        fail(f"{name}: devices {sorted(devices)}")
    if "models" in expect:
        got = {s.labels["model"]
               for s in by_name["ctxpool_model_leaked_bytes_total"].samples}
        live = {s.labels["model"]
                for s in by_name["ctxpool_model_live_bytes"].samples}
        if got != expect["models"] or live != expect["models"] - {"gone"}:
            fail(f"{name}: model labels {sorted(got)} / {sorted(live)}, want "
                 f"{sorted(expect['models'])}")
    print(f"prometheus_check: {name}: prometheus_client: {len(families)} "
          f"families, {parsed} samples, types as declared")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parser", choices=["promtool", "python"], required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--promtool", default=None)
    ap.add_argument("--multi-model-server", default=None)
    ap.add_argument("--exposition-test", default=None)
    args = ap.parse_args()

    if args.parser == "promtool":
        promtool = args.promtool or shutil.which("promtool")
        if not promtool or not os.access(promtool, os.X_OK):
            print("prometheus_check: SKIP: promtool not found (Debian: "
                  "apt-get install --no-install-recommends prometheus; "
                  "scripts/setup --tests installs it)")
            return SKIP
    else:
        try:
            from prometheus_client.parser import \
                text_string_to_metric_families as parser
        except ImportError as e:
            print(f"prometheus_check: SKIP: {sys.executable} has no "
                  f"prometheus_client ({e}; Debian: apt-get install "
                  "python3-prometheus-client; scripts/setup --tests installs "
                  "it)")
            return SKIP

    for name, text, expect in expositions(args):
        if args.parser == "promtool":
            check_promtool(promtool, name, text)
        else:
            check_python(parser, name, text, expect)
    return 0


if __name__ == "__main__":
    sys.exit(main())
