# gunicorn configuration for app.py: model weights in the master's host
# memory, CUDA and ctxpool created per worker after the fork.
#
#   CTXPOOL_TORCH_LIB=/path/to/libctxpool_torch.so \
#   PYTHONPATH=/path/to/ctxpool/plugins/torch/python \
#   gunicorn -c gunicorn.conf.py app:app
import os

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WORKERS", "2"))
# Sync workers: one request at a time per worker, so the GPU work of a
# request is not interleaved with another's in the same process.
worker_class = "sync"
# Import app.py in the master before forking: the model's host copy is built
# once and shared copy-on-write. app.py must not touch CUDA at import.
preload_app = True
# Loading weights to the GPU and the warm-up take a while.
timeout = 120


def on_starting(server):
    # Refuse to start if something initialised CUDA in the master: a CUDA
    # context does not survive fork(), and every worker would fail.
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the gunicorn master; "
                           "move every CUDA call into post_fork")


def post_fork(server, worker):
    # In the worker, before it serves: install ctxpool (this is the
    # process's first CUDA use), move the model to the GPU, warm up.
    import app
    app.init_worker(worker_id=worker.age - 1)
    server.log.info("worker %s: ctxpool ready: %s", worker.pid,
                    app.ctxpool_torch.info()["note"])


def worker_exit(server, worker):
    # Optional: hand cached memory back before the process goes away (the
    # driver reclaims everything at exit anyway).
    try:
        import app
        app.ctxpool_torch.empty_cache()
    except Exception:  # noqa: BLE001 - never block a worker's exit
        pass
