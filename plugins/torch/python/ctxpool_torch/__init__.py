"""ctxpool as PyTorch's CUDA allocator, in three lines.

    import ctxpool_torch
    ctxpool_torch.install()              # before the first CUDA tensor
    with ctxpool_torch.model("bert"):    # charged to bert's budget
        y = bert(x)

Plain ctypes over libctxpool_torch.so (its C ABI is plugins/torch/ctxpool_torch.h).
``pip install --no-build-isolation --no-index ./plugins/torch/python`` (from
the checkout's root, offline) builds the library with CMake and installs it
inside the package. The library is found, in order: the ``path`` argument,
$CTXPOOL_TORCH_LIB, next to this package, then the build directories of the
ctxpool checkout this file lives in (scripts/test's out/main, the other
unsanitized out/* trees, then build*/).

Everything except ``install()`` works without torch (on the simulated driver,
CTXPOOL_DRIVER=sim, for tests and capacity planning).

Configuration is read from CTXPOOL_* environment variables when the library
creates its state (first allocation): CTXPOOL_DRIVER (default "cuda"),
CTXPOOL_BACKING, CTXPOOL_SESSION_MAX_BYTES (every model's budget),
CTXPOOL_TRACE=1 (record a trace for ``write_trace``). In pre-fork servers,
call ``install()`` in each worker after the fork (gunicorn's post_fork), never
in the master.
"""

import contextlib
import ctypes
import glob
import json
import os
import threading

__all__ = [
    "LIBRARY_NAME",
    "find_library",
    "library",
    "install",
    "installed",
    "memory_stats",
    "empty_cache",
    "model",
    "set_model",
    "get_model",
    "set_model_budget",
    "model_stream",
    "record_stream",
    "snapshot",
    "write_trace",
    "last_error",
    "info",
]

LIBRARY_NAME = "libctxpool_torch.so"

_lock = threading.Lock()
_lib = None
_lib_path = None
_installed = False


def _sanitized(build):
    """True when the CMake tree ``build`` was configured with
    CTXPOOL_SANITIZE (its library cannot be loaded into a plain python)."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CTXPOOL_SANITIZE:"):
                    return bool(line.split("=", 1)[1].strip())
    except OSError:
        pass
    return False


def _checkout_builds(root):
    """The checkout's build trees, most preferred first: scripts/test's
    out/main, the other out/* trees, then build*/ (not sanitized ones)."""
    if not os.path.isfile(os.path.join(root, "plugins", "torch",
                                       "CMakeLists.txt")):
        return
    main = os.path.join(root, "out", "main")
    others = [d for d in sorted(glob.glob(os.path.join(root, "out", "*")))
              if d != main]
    builds = sorted(glob.glob(os.path.join(root, "build*")))
    for build in [main] + others + builds:
        if os.path.isdir(build) and not _sanitized(build):
            yield build


def _candidates():
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, LIBRARY_NAME)
    # plugins/torch/python/ctxpool_torch -> the checkout's root.
    root = os.path.abspath(os.path.join(here, "..", "..", "..", ".."))
    for build in _checkout_builds(root):
        yield os.path.join(build, "plugins", "torch", LIBRARY_NAME)
    for prefix in ("/usr/local/lib", "/usr/lib"):
        yield os.path.join(prefix, LIBRARY_NAME)


def find_library(path=None):
    """Returns the path of libctxpool_torch.so, or raises FileNotFoundError."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError("ctxpool_torch: no library at %r" % path)
        return os.path.abspath(path)
    env = os.environ.get("CTXPOOL_TORCH_LIB")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(
                "ctxpool_torch: CTXPOOL_TORCH_LIB=%r does not exist" % env)
        return os.path.abspath(env)
    tried = []
    for candidate in _candidates():
        tried.append(candidate)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        "ctxpool_torch: %s not found; install the package with `pip install "
        "--no-build-isolation --no-index ./plugins/torch/python` (from the "
        "checkout's root), or build the target ctxpool_torch and set "
        "CTXPOOL_TORCH_LIB to its path (looked in: %s)"
        % (LIBRARY_NAME, ", ".join(tried)))


def _declare(lib):
    c = ctypes
    sigs = {
        # ctxpool_malloc throws a C++ exception on failure (for PyTorch):
        # never call it through ctypes; ctxpool_try_malloc returns None.
        "ctxpool_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "ctxpool_try_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "ctxpool_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "ctxpool_empty_cache": (c.c_int64, []),
        "ctxpool_memory_stats": (c.c_char_p, [c.c_int]),
        "ctxpool_record_stream": (c.c_int, [c.c_void_p, c.c_void_p]),
        "ctxpool_set_model": (c.c_int, [c.c_char_p]),
        "ctxpool_get_model": (c.c_char_p, []),
        "ctxpool_set_model_budget": (c.c_int, [c.c_char_p, c.c_size_t]),
        "ctxpool_model_stream": (c.c_void_p, [c.c_int, c.c_int]),
        "ctxpool_snapshot": (c.c_int, [c.c_char_p]),
        "ctxpool_write_trace": (c.c_int, [c.c_char_p]),
        "ctxpool_last_error": (c.c_char_p, []),
        "ctxpool_info": (c.c_char_p, []),
        "ctxpool_shutdown": (c.c_int, [c.c_int]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def library(path=None):
    """The loaded library (ctypes.CDLL) with every function's signature set.

    Loaded once per process; a different ``path`` after the first load is an
    error.
    """
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path and os.path.abspath(path) != _lib_path:
                raise RuntimeError(
                    "ctxpool_torch: already loaded from %r" % _lib_path)
            return _lib
        resolved = find_library(path)
        lib = ctypes.CDLL(resolved)
        _declare(lib)
        _lib, _lib_path = lib, resolved
        return lib


def _error(what):
    text = library().ctxpool_last_error().decode("utf-8", "replace")
    return RuntimeError("ctxpool_torch: %s failed: %s" % (what, text))


def last_error():
    """The text of the library's last failure ("" when none)."""
    return library().ctxpool_last_error().decode("utf-8", "replace")


def install(path=None):
    """Makes ctxpool PyTorch's CUDA allocator.

    Must run before the first CUDA tensor of the process (PyTorch cannot swap
    an allocator that has memory out). Raises RuntimeError when torch is not
    installed, has no CUDA, or already initialised its own allocator.
    Calling it again after success does nothing. Returns the library path.
    """
    global _installed
    try:
        import torch  # noqa: F401  (imported here: the module works without)
    except ImportError as e:
        raise RuntimeError(
            "ctxpool_torch.install() needs PyTorch: %s" % e) from None
    if not torch.cuda.is_available():
        raise RuntimeError(
            "ctxpool_torch.install(): torch.cuda.is_available() is False "
            "(no GPU, no driver, or a CPU-only torch build); ctxpool's "
            "allocator serves CUDA memory only")
    resolved = find_library(path)
    with _lock:
        if _installed:
            return resolved
        try:
            alloc = torch.cuda.memory.CUDAPluggableAllocator(
                resolved, "ctxpool_malloc", "ctxpool_free")
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise RuntimeError(
                "ctxpool_torch.install(): PyTorch refused the allocator (%s). "
                "Call install() before any CUDA tensor is created, in each "
                "worker process" % e) from None
        _installed = True
    library(resolved)
    return resolved


def installed():
    """True after a successful install() in this process."""
    return _installed


def _default_device(device):
    if device is not None:
        if hasattr(device, "index"):  # a torch.device
            return 0 if device.index is None else int(device.index)
        return int(device)
    if _installed:
        import torch
        return torch.cuda.current_device()
    return 0


def memory_stats(device=None):
    """The device's statistics as a dict with torch.cuda.memory_stats() keys.

    Also ctxpool's counters ("num_invalid_frees", "num_cache_hits", ...) and
    "models" (per model: live_bytes, peak_bytes, max_bytes, ...).
    """
    d = _default_device(device)
    raw = library().ctxpool_memory_stats(d)
    if raw is None:
        raise _error("memory_stats(%d)" % d)
    return json.loads(raw.decode("utf-8"))


def empty_cache():
    """Gives cached, unused memory back to the driver; returns bytes freed."""
    freed = library().ctxpool_empty_cache()
    if freed < 0:
        raise _error("empty_cache()")
    return freed


def set_model(name):
    """Sets the calling thread's current model (None: "default")."""
    encoded = None if name is None else str(name).encode("utf-8")
    if library().ctxpool_set_model(encoded) != 0:
        raise _error("set_model(%r)" % name)


def get_model():
    """The calling thread's current model name."""
    return library().ctxpool_get_model().decode("utf-8")


@contextlib.contextmanager
def model(name):
    """Charges the calling thread's allocations to model ``name`` inside the
    block, then restores the previous model (also on exceptions)."""
    previous = get_model()
    set_model(name)
    try:
        yield name
    finally:
        set_model(previous)


def set_model_budget(name, max_bytes):
    """Sets model ``name``'s hard limit in bytes (0: none). Must be called
    before the model's first allocation."""
    if library().ctxpool_set_model_budget(
            str(name).encode("utf-8"), int(max_bytes)) != 0:
        raise _error("set_model_budget(%r)" % name)


def model_stream(device=None, index=0):
    """A stream leased by the current model's session, as an int handle for
    torch.cuda.ExternalStream(handle)."""
    d = _default_device(device)
    handle = library().ctxpool_model_stream(d, int(index))
    if not handle:
        raise _error("model_stream(%d, %d)" % (d, index))
    return handle


def record_stream(ptr, stream):
    """Marks that work on ``stream`` (an int handle, a torch.cuda.Stream) uses
    the block at ``ptr`` (an int, or a tensor: its data_ptr())."""
    if hasattr(ptr, "data_ptr"):
        ptr = ptr.data_ptr()
    if hasattr(stream, "cuda_stream"):
        stream = stream.cuda_stream
    if library().ctxpool_record_stream(ptr, stream) != 0:
        raise _error("record_stream")


def snapshot(path):
    """Writes a JSON snapshot of every opened device to ``path``."""
    if library().ctxpool_snapshot(os.fsencode(path)) != 0:
        raise _error("snapshot(%r)" % path)


def write_trace(path):
    """Writes the trace recorded with CTXPOOL_TRACE=1 to ``path`` (CSV)."""
    if library().ctxpool_write_trace(os.fsencode(path)) != 0:
        raise _error("write_trace(%r)" % path)


def info():
    """The library's state: driver, process id, devices, tracing."""
    raw = library().ctxpool_info()
    if raw is None:
        raise _error("info()")
    return json.loads(raw.decode("utf-8"))
