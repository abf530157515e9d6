#!/usr/bin/env python3
"""GPU check of libctxpool_torch.so: train and serve a small model with
ctxpool's allocator and with PyTorch's own, and compare.

    python3 plugins/torch/tests/gpu_check.py [path/to/libctxpool_torch.so]

(scripts/gpu-check runs it with the library of its tree.) Each allocator runs
in its own Python process, because an allocator must be chosen before the
first CUDA tensor and cannot be swapped back. Prints, for both: peak reserved,
peak allocated, mean train step and mean inference step time, the final loss;
then checks that ctxpool's run computed the same loss (same seed), saw no
invalid free and gave its cache back on empty_cache().

Exits 0 with "skipped: no CUDA" when torch or a CUDA device is missing; 1 when
a check fails.
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_STEPS = int(os.environ.get("CTXPOOL_GPU_CHECK_STEPS", "60"))
INFER_STEPS = TRAIN_STEPS
WARMUP = 5


def have_cuda():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, ""


def build_model(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(8), nn.Flatten(),
        nn.Linear(64 * 8 * 8, 512), nn.ReLU(),
        nn.Linear(512, 10))


def run(allocator, lib):
    """One measurement in this process; prints one JSON line."""
    import torch
    stats = None
    if allocator == "ctxpool":
        sys.path.insert(0, os.path.join(HERE, "..", "python"))
        import ctxpool_torch
        ctxpool_torch.install(lib)

        def stats():
            s = ctxpool_torch.memory_stats(0)
            return s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
    else:
        def stats():
            return (torch.cuda.max_memory_reserved(0),
                    torch.cuda.max_memory_allocated(0))

    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda", 0)
    model = build_model(torch).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(64, 3, 32, 32, generator=gen),
             torch.randint(0, 10, (64,), generator=gen)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step(i):
        x, y = data[i % len(data)]
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(WARMUP):
        train_step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = None
    for i in range(TRAIN_STEPS):
        loss = train_step(i)
    torch.cuda.synchronize()
    train_ms = (time.perf_counter() - t0) * 1e3 / TRAIN_STEPS

    model.eval()
    with torch.no_grad():
        x = torch.randn(256, 3, 32, 32, generator=gen).to(dev)
        for _ in range(WARMUP):
            model(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(INFER_STEPS):
            out = model(x)
        torch.cuda.synchronize()
        infer_ms = (time.perf_counter() - t0) * 1e3 / INFER_STEPS
        checksum = float(out.float().sum().item())

    peak_reserved, peak_allocated = stats()
    result = {
        "allocator": allocator,
        "peak_reserved": int(peak_reserved),
        "peak_allocated": int(peak_allocated),
        "train_step_ms": train_ms,
        "infer_step_ms": infer_ms,
        "final_loss": float(loss.item()),
        "checksum": checksum,
    }
    if allocator == "ctxpool":
        import ctxpool_torch
        del out, x, data, opt, model, loss
        import gc
        gc.collect()
        torch.cuda.synchronize()
        s = ctxpool_torch.memory_stats(0)
        result["num_invalid_frees"] = s["num_invalid_frees"]
        result["num_ooms"] = s["num_ooms"]
        result["empty_cache_freed"] = ctxpool_torch.empty_cache()
        after = ctxpool_torch.memory_stats(0)
        result["reserved_after_empty_cache"] = \
            after["reserved_bytes.all.current"]
        result["allocated_after_empty_cache"] = \
            after["allocated_bytes.all.current"]
    print("RESULT " + json.dumps(result), flush=True)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--run":
        run(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
        return 0
    ok, why = have_cuda()
    if not ok:
        print("skipped: no CUDA (%s)" % why)
        return 0
    lib = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "CTXPOOL_TORCH_LIB")
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import ctxpool_torch
    lib = ctxpool_torch.find_library(lib)
    print("library: %s" % lib)
    env = dict(os.environ)
    env.pop("CTXPOOL_DRIVER", None)  # the real driver
    results = {}
    for allocator in ("torch", "ctxpool"):
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--run", allocator,
             lib], capture_output=True, text=True, env=env, timeout=200)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print("FAIL: the %s run exited with %d" % (allocator,
                                                      proc.returncode))
            return 1
        results[allocator] = json.loads(lines[-1][len("RESULT "):])

    print("\n%-8s %14s %15s %14s %14s %12s" % (
        "alloc", "peak reserved", "peak allocated", "train step ms",
        "infer step ms", "final loss"))
    for name, r in results.items():
        print("%-8s %14d %15d %14.3f %14.3f %12.6f" % (
            name, r["peak_reserved"], r["peak_allocated"], r["train_step_ms"],
            r["infer_step_ms"], r["final_loss"]))
    t, c = results["torch"], results["ctxpool"]
    print("ratios ctxpool/torch: reserved %.3f, allocated %.3f, train %.3f, "
          "infer %.3f" % (
              c["peak_reserved"] / max(1, t["peak_reserved"]),
              c["peak_allocated"] / max(1, t["peak_allocated"]),
              c["train_step_ms"] / max(1e-9, t["train_step_ms"]),
              c["infer_step_ms"] / max(1e-9, t["infer_step_ms"])))

    failures = []
    if abs(c["final_loss"] - t["final_loss"]) > 1e-3 * max(
            1.0, abs(t["final_loss"])):
        failures.append("final loss differs: ctxpool %r, torch %r" % (
            c["final_loss"], t["final_loss"]))
    if c["num_invalid_frees"] != 0:
        failures.append("ctxpool counted %d invalid frees" %
                        c["num_invalid_frees"])
    if c["num_ooms"] != 0:
        failures.append("ctxpool reported %d OOMs" % c["num_ooms"])
    if c["peak_allocated"] <= 0:
        failures.append("ctxpool reported no allocation")
    for f in failures:
        print("FAIL: " + f)
    print("empty_cache: freed %d bytes; reserved after %d, allocated after %d"
          % (c["empty_cache_freed"], c["reserved_after_empty_cache"],
             c["allocated_after_empty_cache"]))
    if not failures:
        print("PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
