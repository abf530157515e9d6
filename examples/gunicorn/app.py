"""A small inference server for a pre-fork server (gunicorn), served with
ctxpool as PyTorch's CUDA allocator.

The master process imports this module (gunicorn's --preload): it builds the
model and loads its weights into *host* memory only. No CUDA call happens in
the master. Each worker, after the fork, runs `init_worker()` from
gunicorn.conf.py's post_fork hook: it installs ctxpool's allocator, moves the
weights to the GPU inside the worker's model session and warms up. Requests
then run in that session.

    gunicorn -c gunicorn.conf.py app:app
    curl -s -X POST localhost:8000/predict -d '{"inputs": [[0.1, ...]]}'
    curl -s localhost:8000/stats
"""

import json
import os
import threading

import torch

import ctxpool_torch

MODEL_NAME = os.environ.get("MODEL_NAME", "mlp")
IN_FEATURES = 256
OUT_FEATURES = 16


def build_model():
    """Random weights, built in code, on the CPU (the master's job)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, OUT_FEATURES)).eval()


# Loaded in the master (with --preload) and shared copy-on-write by workers.
# Host memory only: this line must not touch CUDA.
HOST_MODEL = build_model()

_worker = {"model": None, "device": None}
_worker_lock = threading.Lock()


def init_worker(worker_id=0):
    """Runs once in each worker after fork (gunicorn post_fork).

    Installs ctxpool before the first CUDA tensor of the process, moves the
    weights to the GPU charged to this model's session, and warms the cache
    with one request of the expected size.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("this example needs a CUDA device")
    ctxpool_torch.install()
    budget = os.environ.get("MODEL_MAX_BYTES")
    if budget:
        ctxpool_torch.set_model_budget(MODEL_NAME, int(budget))
    device_count = torch.cuda.device_count()
    device = torch.device("cuda", worker_id % device_count)
    torch.cuda.set_device(device)
    with ctxpool_torch.model(MODEL_NAME):
        model = HOST_MODEL.to(device)
        with torch.inference_mode():
            model(torch.zeros(32, IN_FEATURES, device=device))
        torch.cuda.synchronize(device)
    _worker["model"], _worker["device"] = model, device


def predict(inputs):
    model, device = _worker["model"], _worker["device"]
    if model is None:
        raise RuntimeError("worker not initialised (post_fork did not run)")
    with ctxpool_torch.model(MODEL_NAME), torch.inference_mode():
        x = torch.tensor(inputs, dtype=torch.float32, device=device)
        return model(x).cpu().tolist()


def _respond(start_response, status, body):
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data)))])
    return [data]


def app(environ, start_response):
    """The WSGI application."""
    path = environ.get("PATH_INFO", "/")
    try:
        if path == "/predict" and environ["REQUEST_METHOD"] == "POST":
            size = int(environ.get("CONTENT_LENGTH") or 0)
            request = json.loads(environ["wsgi.input"].read(size) or b"{}")
            return _respond(start_response, "200 OK",
                            {"outputs": predict(request["inputs"])})
        if path == "/stats":
            device = _worker["device"]
            stats = ctxpool_torch.memory_stats(device)
            return _respond(start_response, "200 OK", {
                "pid": os.getpid(),
                "device": str(device),
                "reserved_bytes": stats["reserved_bytes.all.current"],
                "allocated_bytes": stats["allocated_bytes.all.current"],
                "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
                "models": stats["models"],
            })
        return _respond(start_response, "404 Not Found", {"error": path})
    except (KeyError, ValueError, TypeError) as e:
        return _respond(start_response, "400 Bad Request", {"error": str(e)})
    except RuntimeError as e:
        return _respond(start_response, "503 Service Unavailable",
                        {"error": str(e),
                         "ctxpool": ctxpool_torch.last_error()})
