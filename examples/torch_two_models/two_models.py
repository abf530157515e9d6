#!/usr/bin/env python3
"""Two small PyTorch models served from one process, each in its own ctxpool
model budget.

    CTXPOOL_TORCH_LIB=build/plugins/torch/libctxpool_torch.so \
    PYTHONPATH=plugins/torch/python \
    python3 examples/torch_two_models/two_models.py

Both models share the process's one CUDA context and one caching allocator,
but every tensor is charged to the model whose `ctxpool_torch.model(...)`
block created it: an encoder with a 256 MiB budget and a classifier with a
64 MiB budget. The script serves interleaved requests from two threads, then
shows that a request too big for the classifier's budget fails with an
out-of-memory error naming the model, while the encoder keeps serving.

Prints "skipped: no CUDA" and exits 0 without torch or a GPU.
"""

import sys
import threading

MiB = 1 << 20
BUDGETS = {"encoder": 256 * MiB, "classifier": 64 * MiB}


def main():
    try:
        import torch
    except ImportError:
        print("skipped: no CUDA (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False)")
        return 0
    import ctxpool_torch

    ctxpool_torch.install()  # before the first CUDA tensor
    for name, budget in BUDGETS.items():
        ctxpool_torch.set_model_budget(name, budget)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)

    # Random weights, built in code; each model's parameters are charged to
    # its own session.
    with ctxpool_torch.model("encoder"):
        encoder = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.GELU(),
            torch.nn.Linear(2048, 2048), torch.nn.GELU(),
            torch.nn.Linear(2048, 512)).to(dev).eval()
    with ctxpool_torch.model("classifier"):
        classifier = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
            torch.nn.Linear(16 * 16, 10)).to(dev).eval()

    def serve(name, model, make_input, requests, results):
        with ctxpool_torch.model(name), torch.inference_mode():
            for _ in range(requests):
                out = model(make_input())
                torch.cuda.current_stream().synchronize()
                results.append(out.shape[0])

    results = {"encoder": [], "classifier": []}
    threads = [
        threading.Thread(target=serve, args=(
            "encoder", encoder, lambda: torch.randn(64, 512, device=dev),
            50, results["encoder"])),
        threading.Thread(target=serve, args=(
            "classifier", classifier,
            lambda: torch.randn(32, 3, 64, 64, device=dev), 50,
            results["classifier"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("served: encoder %d requests, classifier %d requests" % (
        len(results["encoder"]), len(results["classifier"])))

    # Budgets are hard: a request over a model's budget fails in ctxpool's
    # allocator with an exception (PyTorch's bindings raise it in Python with
    # ctxpool's report: the model, its budget and usage); the other model is
    # unaffected and the refusal is counted in "num_budget_rejections".
    m = ctxpool_torch.memory_stats(0)["models"]["classifier"]
    big = m["max_bytes"] - m["live_bytes"] + (64 << 20)
    with ctxpool_torch.model("classifier"):
        try:
            torch.empty(big, dtype=torch.uint8, device=dev)
            print("classifier: a %d-byte tensor fit (unexpected)" % big)
        except (RuntimeError, MemoryError) as e:
            print("classifier: a %d-byte tensor over its budget was refused:"
                  " %s" % (big, str(e).splitlines()[0][:160]))

    stats = ctxpool_torch.memory_stats(0)
    print("\n%-12s %12s %12s %12s %10s" % (
        "model", "live bytes", "peak bytes", "budget", "rejected"))
    for name in BUDGETS:
        m = stats["models"][name]
        print("%-12s %12d %12d %12d %10d" % (
            name, m["live_bytes"], m["peak_bytes"], m["max_bytes"],
            m["num_budget_rejections"]))
    print("device 0: reserved %d bytes (peak %d), allocated %d bytes" % (
        stats["reserved_bytes.all.current"], stats["reserved_bytes.all.peak"],
        stats["allocated_bytes.all.current"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
