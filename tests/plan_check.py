#!/usr/bin/env python3
"""Checks `ctxpool plan` by replaying what it claims.

  plan_check.py --tool PATH quick
      bad input (one line on stderr, exit 2), a plan of generated workloads in
      both schedules, the JSON's shape, the SVG's stacked areas.
  plan_check.py --tool PATH traces DIR
      on the real traces in DIR, on h100-80gb and a10-24gb:
        * every replica count --max-replicas reports replays with 0 OOMs, and
          one more replica of that model replays with at least one (both
          modes); today's way fits fewer replicas than ctxpool for at least
          one model on each device;
        * the budgets --suggest-budgets proposes, given back as --model
          flags, replay with no OOM and no budget rejection, and each model's
          max one granule (2 MiB) lower makes that model fail.
      Exit 77 (skipped) when DIR has no traces.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

GRANULE = 2 << 20
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)
    return cond


def run(tool, args, want_rc=0):
    p = subprocess.run([tool, "plan"] + args, capture_output=True, text=True)
    if p.returncode != want_rc:
        raise SystemExit(
            "ctxpool plan %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s" %
            (" ".join(args), p.returncode, want_rc, p.stdout, p.stderr))
    return p


def plan_json(tool, args):
    return json.loads(run(tool, args + ["--json"]).stdout)


def mode(j, name):
    return next(m for m in j["modes"] if m["mode"] == name)


def model_flag(m, replicas=None, budget=None):
    text = "%s=%s,replicas=%d" % (m["name"], m["trace"],
                                 replicas if replicas is not None else
                                 m["replicas"])
    if budget:
        for key in ("min", "high", "max"):
            if budget.get(key):
                text += ",%s=%d" % (key, budget[key])
    return text


def quick(tool):
    traces = tempfile.mkdtemp()
    bad = [
        (["--model", "a=/no/such/trace.csv"], "cannot open"),
        (["--device", "no-such-gpu", "--model", "a=workload:mixed"],
         "unknown simulated device preset"),
        (["--model", "a=workload:mixed,replicas=0"], "replicas"),
        (["--device", "a10-24gb", "--model",
          "a=workload:mixed,replicas=3,min=10GiB"], "min sum"),
        (["--model", "a=workload:mixed,min=2GiB,max=1GiB"], "exceeds max"),
        (["--model", "a=" + traces], "directory"),
        ([], "no --model"),
        (["--model", "a=workload:mixed", "--model", "a=workload:mixed"],
         "given twice"),
        (["--model", "a=workload:mixed", "--schedule", "weekly"],
         "bad --schedule"),
        (["--model", "a=workload:mixed", "--schedule", "churn",
          "--max-replicas"], "--max-replicas needs"),
        (["--model", "a=workload:mixed", "--max-replicas=b"], "no such"),
        (["--model", "a=workload:mixed,replicas=2", "--schedule",
          "churn:resident=3"], "more than the plan's 2"),
        (["--model", "a=workload:mixed,replicas=2,replicas=3"], "given twice"),
        (["--model", "a=workload:mixed,max=0"], "no limit"),
        (["--model", "a=workload:mixed,min=2GiB,high=1GiB"], "exceeds high"),
        (["--model", "a=workload:mixed", "--capacity", "1MiB"],
         "cannot hold its"),
        # min counts with the context: 80 GiB of min leave it no room.
        (["--model", "a=workload:mixed,min=80GiB"], "context"),
        (["--gpu", "--device", "a10-24gb", "--model", "a=workload:mixed"],
         "no --device"),
        (["--model", "a=%s/t.csv,foo=1" % traces], "unknown option"),
        (["--model", "a=workload:mixed", "--svg", "/no/such/dir/p.svg"],
         "cannot write"),
        (["--model", "a=workload:mixed", "--config", "round_bytes=3"],
         "powers of two"),
        (["--model", "a#1=workload:mixed"], "may not hold '#'"),
        (["--model", "a=workload:mixed", "--svg", traces], "Is a directory"),
        (["--model", "a=workload:mixed", "--schedule",
          "churn:resident=1,resident=2"], "given twice"),
        (["--model", "a=workload:mixed", "--config",
          "backing=classic,backing=expandable"], "given twice"),
        (["--model", "a=workload:mixed,max=0.0001"], "is 0 bytes"),
        # The merged trace would be too long to hold.
        (["--model", "a=workload:mixed,replicas=4096", "--schedule",
          "churn:cycles=1000"], "more than the"),
        # Under churn only the resident replicas' min count at once.
        (["--device", "a10-24gb", "--model",
          "a=workload:mixed,replicas=3,min=10GiB", "--schedule",
          "churn:resident=3"], "min sum"),
    ]
    for args, text in bad:
        p = run(tool, args, want_rc=2)
        err = p.stderr.strip()
        check(text in err, "plan %s: stderr %r lacks %r" % (args, err, text))
        check(len(err.splitlines()) == 1,
              "plan %s: want one line on stderr, got %r" % (args, err))
        check("terminate called" not in err and "what()" not in err,
              "plan %s: an exception escaped" % args)

    # --gpu: a replay on the GPU where there is one, else one line, exit 1.
    p = subprocess.run([tool, "plan", "--gpu", "--model",
                        "a=workload:mixed:ops=200"], capture_output=True,
                       text=True)
    if p.returncode != 0:
        check(p.returncode == 1 and "UNAVAILABLE" in p.stderr and
              len(p.stderr.strip().splitlines()) == 1,
              "plan --gpu without a GPU: exit %d, %r" % (p.returncode,
                                                         p.stderr))
    run(tool, ["--gpu", "--max-replicas", "--model", "a=workload:mixed"],
        want_rc=2)

    svg = os.path.join(traces, "plan.svg")
    models = ["--model", "mixed=workload:mixed:ops=3000,max_live_bytes=1GiB,replicas=3",
              "--model", "llm=workload:llm-serving:requests=16,weights_bytes=2GiB,max=12GiB"]
    for schedule in ("concurrent", "churn:resident=2,cycles=2"):
        j = plan_json(tool, ["--device", "a10-24gb", "--schedule", schedule,
                             "--svg", svg] + models)
        check(j["schedule"] == schedule, "schedule echoed: %s" % j["schedule"])
        check([m["name"] for m in j["models"]] == ["mixed", "llm"],
              "models listed in order")
        today, pooled = mode(j, "today"), mode(j, "ctxpool")
        check(today["contexts"] == 4 and pooled["contexts"] == 1,
              "%s: contexts today %d (want 4 replicas), ctxpool %d" %
              (schedule, today["contexts"], pooled["contexts"]))
        for m in (today, pooled):
            check(m["fits"] == (m["ooms"] == 0 and m["failed_loads"] == 0),
                  "%s %s: fits agrees with its OOMs" % (schedule, m["mode"]))
            check(m["headroom_bytes"] == j["capacity_bytes"] -
                  m["peak_device_bytes"], "headroom = capacity - peak")
            check(m["peak_device_bytes"] > m["context_bytes"],
                  "peak device memory counts more than the contexts")
            check(sum(x["replicas"] for x in m["models"]) == 4,
                  "per-model rows cover the replicas")
        check(pooled["fits"], "%s: ctxpool fits the small plan" % schedule)
        with open(svg, encoding="utf-8") as f:
            text = f.read()
        for name in ("mixed", "llm", "contexts", "device capacity"):
            check(text.count('data-name="%s"' % name) == 2,
                  "%s: the SVG has a %r series in both plots" %
                  (schedule, name))
        check(text.count("stacked-area") >= 8,
              "%s: the SVG's models are stacked areas" % schedule)
    # Staggered replicas do not peak together: three LLM servers that do
    # not fit a 24 GB card in phase fit it out of phase.
    llm3 = ["--device", "a10-24gb", "--model",
            "llm=workload:llm-serving:requests=16,weights_bytes=2GiB,replicas=3"]
    in_phase = plan_json(tool, llm3)
    staggered = plan_json(tool, llm3 + ["--schedule", "staggered"])
    check(staggered["schedule"] == "staggered", "staggered echoed")
    check(staggered["events"] == in_phase["events"],
          "staggered replays the same events")
    check(staggered["peak_live_bytes"] < in_phase["peak_live_bytes"],
          "staggered: peak live %d below in phase %d" %
          (staggered["peak_live_bytes"], in_phase["peak_live_bytes"]))
    check(not mode(in_phase, "ctxpool")["fits"] and
          mode(staggered, "ctxpool")["fits"],
          "three LLM replicas fit 24 GB staggered, not in phase")
    # Three replicas with min 10 GiB on a 24 GB card: refused together
    # (above), accepted when two are resident at once.
    j = plan_json(tool, ["--device", "a10-24gb", "--schedule",
                         "churn:resident=2", "--model",
                         "a=workload:mixed:ops=2000,max_live_bytes=1GiB,"
                         "replicas=3,min=10GiB"])
    check(mode(j, "ctxpool")["fits"], "churn: resident replicas' min fits")
    # The search honours the min sum: the count past it is refused, not
    # replayed, and says why.
    j = plan_json(tool, ["--device", "a10-24gb", "--max-replicas", "--model",
                         "a=workload:mixed:ops=2000,max_live_bytes=1GiB,"
                         "min=10GiB"])
    c = j["max_replicas"][0]["ctxpool"]
    check(c["max"] == 2 and c["refused"] and
          c["ooms_at_max_plus_1"] is None and
          "min sum" in c["message"] and not c["at_least"],
          "max replicas stops at the min sum: %r" % c)
    check(j["max_replicas"][0]["today"]["max"] > 2,
          "today's way has no min to honour")
    # A model that fits nowhere: the plan is still reported, the suggestion
    # says why there is none (exit 0).
    j = plan_json(tool, ["--capacity", "2GiB", "--suggest-budgets", "--model",
                         "big=workload:llm-serving:requests=4,weights_bytes=4GiB"])
    sb = j["suggested_budgets"]["models"][0]
    check(not mode(j, "ctxpool")["fits"] and "does not fit" in sb["error"] and
          sb["max_bytes"] is None and not j["suggested_budgets"]["verified"]["fits"],
          "a suggestion that cannot be made is a result: %r" % sb)
    # ... and costs only that model its suggestion.
    j = plan_json(tool, ["--capacity", "2GiB", "--suggest-budgets", "--model",
                         "big=workload:llm-serving:requests=4,weights_bytes=4GiB",
                         "--model", "small=workload:mixed:ops=2000,max_live_bytes=256MiB"])
    sb = {m["model"]: m for m in j["suggested_budgets"]["models"]}
    check(sb["big"]["error"] and sb["small"]["error"] is None and
          sb["small"]["max_bytes"] >= sb["small"]["peak_charged_bytes"] > 0,
          "the model that fits alone keeps its suggestion: %r" % sb["small"])
    # A plan far over the device stops counting its failures: the count is
    # a lower bound and says so.
    j = plan_json(tool, ["--capacity", "1GiB", "--model",
                         "m=workload:mixed:ops=200000,max_live_bytes=8GiB,"
                         "replicas=10"])
    for m in j["modes"]:
        check(m["stopped_early"] and m["ooms"] == 100000 and not m["fits"],
              "%s stops at 100000 OOMs: %r" % (m["mode"], m["ooms"]))
    p = run(tool, ["--capacity", "1GiB", "--model",
                   "m=workload:mixed:ops=200000,max_live_bytes=8GiB,replicas=10"])
    check("100000+" in p.stdout, "the text marks the count as a lower bound")
    check(mode(j, "today")["models"][0]["peak_charged_bytes"] is None and
          mode(j, "ctxpool")["models"][0]["sampled_peak_mapped_bytes"] is None,
          "what a run did not measure is null")
    # A tenant over its max fails in ctxpool mode only.
    j = plan_json(tool, ["--device", "a10-24gb", "--model",
                         "llm=workload:llm-serving:requests=16,weights_bytes=2GiB,max=1GiB"])
    pooled = mode(j, "ctxpool")
    check(not pooled["fits"] and pooled["budget_rejections"] > 0 and
          pooled["first_oom"]["model"] == "llm",
          "a max below the model's need is rejected and named")
    check(mode(j, "today")["fits"], "today's way has no budgets")


def traces_check(tool, directory):
    names = {
        "gpt2": "gpt2-large-train-step.rmm.csv",
        "opt": "opt-federated-finetune.rmm.csv",
        "octree": "octree-nca-inference.rmm.csv",
        "ddp": "ddp-transformer-v100-5-steps.rmm.csv",
    }
    paths = {k: os.path.join(directory, v) for k, v in names.items()}
    if not all(os.path.exists(p) for p in paths.values()):
        print("SKIP: the traces are not in %s" % directory)
        return 77
    plans = {
        "h100-80gb": ["gpt2", "opt", "octree", "ddp"],
        # gpt2 and octree do not fit a 24 GB card together.
        "a10-24gb": ["opt", "ddp", "octree"],
    }
    for device, chosen in plans.items():
        base = ["--device", device]
        for name in chosen:
            base += ["--model", "%s=%s" % (name, paths[name])]
        j = plan_json(tool, base + ["--max-replicas", "--suggest-budgets"])
        models = j["models"]
        fewer_today = False
        for s in j["max_replicas"]:
            i = next(k for k, m in enumerate(models) if m["name"] == s["model"])
            for side in ("ctxpool", "today"):
                n = s[side]["max"]
                if n is None:
                    continue  # the others alone do not fit
                for count, want_fit in ((n, True), (n + 1, False)):
                    flags = list(base[:2])
                    for k, m in enumerate(models):
                        if k == i and count == 0:
                            continue  # replicas=0 is refused: leave it out
                        flags += ["--model",
                                  model_flag(m, count if k == i else None)]
                    got = mode(plan_json(tool, flags), side)
                    check(got["fits"] == want_fit and
                          (got["ooms"] == 0) == want_fit,
                          "%s: %s with %d x %s: fits %s (%d OOMs), want %s" %
                          (device, side, count, s["model"], got["fits"],
                           got["ooms"], want_fit))
            today_n = s["today"]["max"]
            if today_n is None or today_n < s["ctxpool"]["max"]:
                fewer_today = True
            print("%s: %s: ctxpool %s, today %s replicas (verified)" %
                  (device, s["model"], s["ctxpool"]["max"], today_n))
        check(fewer_today, "%s: today's way fits fewer replicas" % device)

        # Staggered: each count up to the answer fits, not only the answer
        # (the search bisects, so it needs "fits" monotone in the count; the
        # offsets do not move as replicas are added).
        if device == "h100-80gb":
            st = base + ["--schedule", "staggered"]
            j2 = plan_json(tool, st + ["--max-replicas=opt"])
            n = j2["max_replicas"][0]["ctxpool"]["max"]
            i = next(k for k, m in enumerate(models) if m["name"] == "opt")
            for count in range(1, n + 2):
                flags = ["--device", device, "--schedule", "staggered"]
                for k, m in enumerate(models):
                    flags += ["--model",
                              model_flag(m, count if k == i else None)]
                got = mode(plan_json(tool, flags), "ctxpool")
                check(got["fits"] == (count <= n),
                      "staggered: %d x opt fits %s, the search says %d" %
                      (count, got["fits"], n))
            print("%s: staggered: opt 1..%d fit, %d does not (ctxpool)" %
                  (device, n, n + 1))

        sug = {m["model"]: m for m in j["suggested_budgets"]["models"]}
        flags = list(base[:2])
        for m in models:
            b = sug[m["name"]]
            flags += ["--model", model_flag(
                m, budget={"min": b["min_bytes"], "high": b["high_bytes"],
                           "max": b["max_bytes"]})]
        got = mode(plan_json(tool, flags), "ctxpool")
        check(got["fits"] and got["ooms"] == 0 and
              got["budget_rejections"] == 0,
              "%s: the suggested budgets replay with no OOM (%d) and no "
              "rejection (%d)" % (device, got["ooms"],
                                  got["budget_rejections"]))
        for row in got["models"]:
            check(row["peak_charged_bytes"] <= sug[row["name"]]["max_bytes"],
                  "%s: %s peaks at %d B charged, above its max %d" %
                  (device, row["name"], row["peak_charged_bytes"],
                   sug[row["name"]]["max_bytes"]))
        for m in models:
            b = sug[m["name"]]
            tighter = list(base[:2])
            for other in models:
                ob = sug[other["name"]]
                budget = {"min": ob["min_bytes"], "high": ob["high_bytes"],
                          "max": ob["max_bytes"]}
                if other["name"] == m["name"]:
                    budget["max"] -= GRANULE
                    budget["min"] = min(budget["min"], budget["max"])
                tighter += ["--model", model_flag(other, budget=budget)]
            got = mode(plan_json(tool, tighter), "ctxpool")
            row = next(x for x in got["models"] if x["name"] == m["name"])
            check(row["failed_allocations"] >= 1 and
                  row["budget_rejections"] >= 1,
                  "%s: %s with max %d - 2 MiB must fail (failed %d)" %
                  (device, m["name"], b["max_bytes"],
                   row["failed_allocations"]))
            print("%s: %s: max %d B is tight (%d rejections one granule "
                  "below)" % (device, m["name"], b["max_bytes"],
                              row["budget_rejections"]))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("what", choices=["quick", "traces"])
    ap.add_argument("dir", nargs="?")
    a = ap.parse_args()
    rc = 0
    if a.what == "quick":
        quick(a.tool)
    else:
        rc = traces_check(a.tool, a.dir)
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
