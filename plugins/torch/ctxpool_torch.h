// ctxpool_torch.h — the C ABI of libctxpool_torch.so, ctxpool's drop-in
// allocator for PyTorch.
//
// PyTorch loads the allocator through torch.cuda.memory.CUDAPluggableAllocator,
// which needs two C functions of a shared library; everything else here is
// what PyTorch's pluggable path lacks (trim, statistics, record-stream, model
// budgets, snapshots):
//
//   import torch
//   alloc = torch.cuda.memory.CUDAPluggableAllocator(
//       "libctxpool_torch.so", "ctxpool_malloc", "ctxpool_free")
//   torch.cuda.memory.change_current_allocator(alloc)   # before any tensor
//
// or, with the Python wrapper (plugins/torch/python/ctxpool_torch):
//
//   import ctxpool_torch
//   ctxpool_torch.install()
//   with ctxpool_torch.model("bert"):    # charged to bert's budget
//       y = bert(x)
//   print(ctxpool_torch.memory_stats()["reserved_bytes.all.peak"])
//
// State: one process-wide state, created on the first call that needs it.
// It loads the driver named by CTXPOOL_DRIVER ("cuda" when unset; "auto"
// also means "cuda" here, because handing simulated addresses to PyTorch
// kernels would crash them; "sim..." selects the simulated GPU, for tests),
// then opens a ctxpool DeviceContext (the device's primary context, the one
// PyTorch uses) for each device on its first allocation only, so a worker
// that uses GPU 0 creates no context on the other GPUs. The device
// allocator's backing mode and the session budgets come from the CTXPOOL_*
// option table (CTXPOOL_BACKING, CTXPOOL_SESSION_{MIN,HIGH,MAX}_BYTES,
// CTXPOOL_SESSION_TIMES for ages in leak reports, CTXPOOL_MAX_SPLIT_BYTES);
// CTXPOOL_TRACE=1 records every malloc and free in
// a ring buffer of CTXPOOL_TRACE_CAPACITY events (ctxpool_write_trace).
//
// Models: every allocation is charged to a ctxpool ModelSession: the one of
// the calling thread's current model (ctxpool_set_model) on the allocation's
// device, opened on first use; "default" until a model is set. A free goes
// to the session that made the allocation, whatever the calling thread.
//
// fork(): a pthread_atfork child handler drops the parent's state (leaked,
// never touched: its driver state belongs to the parent), so a worker forked
// after the parent used ctxpool creates its own on its first call. With the
// real driver that works only when the parent never initialised CUDA
// (create everything in the worker, e.g. in gunicorn's post_fork); otherwise
// the driver fails in the child and ctxpool_last_error says why.
//
// Errors: no function crashes on bad input, and only ctxpool_malloc throws.
// Functions returning int return 0 on success and -1 on failure; a failed
// ctxpool_try_malloc returns NULL. The text of the last failure in the
// process (any thread) is ctxpool_last_error(). Host memory running out
// inside a function (std::bad_alloc) is such a failure too, never an
// exception out of it: the function fails as above (ctxpool_malloc throws
// the std::bad_alloc; ctxpool_free may leave the block live) and
// ctxpool_last_error() names it, with nothing lost or half-done.
//
// Out of memory: PyTorch's CUDAPluggableAllocator does not check the
// allocator's result for NULL (it wraps it in a DataPtr as is), so a NULL
// would surface as an illegal-address error in the first kernel that touches
// the tensor. ctxpool_malloc therefore reports failure the way PyTorch's own
// allocator does, with a C++ exception: a std::bad_alloc whose what() is
// ctxpool's out-of-memory report (which model, its budget and usage, the
// device's reserved and free bytes) when the device or the model's budget
// is exhausted, a std::runtime_error for anything else (no driver, bad
// device). PyTorch's Python bindings turn either into a Python exception
// carrying that text (RuntimeError or MemoryError, depending on the
// release). The libtorch header ctxpool_torch_allocator.h rethrows it as
// c10::OutOfMemoryError, i.e. torch.OutOfMemoryError. C and ctypes callers
// must use ctxpool_try_malloc: an exception cannot cross a C frame.
//
// Strings returned by ctxpool_last_error, ctxpool_memory_stats and
// ctxpool_info live in a buffer owned by the calling thread, valid until the
// same thread calls one of those three functions again (ctypes' c_char_p
// copies it at once). Never free them.
//
// Thread-safety: every function may be called from any thread concurrently,
// except ctxpool_shutdown (see there).
#ifndef CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_H_
#define CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define CTXPOOL_TORCH_API
#else
#define CTXPOOL_TORCH_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// The CUDA runtime's stream type, declared as cuda_runtime_api.h declares it
// (an identical typedef is allowed twice), so this header needs no CUDA.
typedef struct CUstream_st* cudaStream_t;

// ---- The two functions CUDAPluggableAllocator loads -----------------------

// A block of at least `size` bytes on `device`, usable by work on `stream` in
// stream order (PyTorch's contract). Charged to the calling thread's current
// model. size 0 returns a valid, unique pointer (freed like any other).
// Throws std::bad_alloc when the device or the model's budget is exhausted
// and std::runtime_error for a bad device or when the driver cannot be
// loaded (see "Out of memory" above); never returns NULL. For C++ callers
// (PyTorch); C and ctypes callers use ctxpool_try_malloc.
// REQUIRES: `stream` is NULL (the legacy default stream) or a live stream of
// `device`.
CTXPOOL_TORCH_API void* ctxpool_malloc(size_t size, int device,
                                       cudaStream_t stream);

// ctxpool_malloc without exceptions: NULL on failure, with
// ctxpool_last_error() saying why. Never throws.
CTXPOOL_TORCH_API void* ctxpool_try_malloc(size_t size, int device,
                                           cudaStream_t stream);

// Returns `ptr` to ctxpool's cache, ordered after the work already enqueued on
// the stream it was allocated on (and streams named by
// ctxpool_record_stream); `stream` is informational, as in PyTorch. NULL is a
// no-op. A pointer ctxpool did not hand out (or already freed), or a `size`
// or `device` that differs from the allocation's, is refused: nothing is
// freed, the free is counted (memory_stats "num_invalid_frees") and
// ctxpool_last_error() describes it. Never crashes.
CTXPOOL_TORCH_API void ctxpool_free(void* ptr, size_t size, int device,
                                    cudaStream_t stream);

// ---- What the pluggable path lacks ----------------------------------------

// Gives every device's cached memory back to the driver (Trim(0)), waiting
// only for streams whose pending work still uses it. Returns the bytes freed,
// or -1 on error (some devices' caches may have been given back by then:
// memory_stats tells). Stream order: blocks still in use by a pending stream
// stay.
CTXPOOL_TORCH_API int64_t ctxpool_empty_cache(void);

// Statistics of `device` as JSON, with the key names of
// torch.cuda.memory_stats() ("allocated_bytes.all.current",
// "reserved_bytes.large_pool.peak", "num_ooms", ...) plus ctxpool's own
// counters ("num_invalid_frees", "num_cache_hits", ...) and a "models" object
// with each model's usage and budget on the device. A device that has not
// allocated yet reports zeros. NULL for a bad device or no driver. See the
// file comment for the buffer's lifetime.
CTXPOOL_TORCH_API const char* ctxpool_memory_stats(int device);

// Marks that work on `stream` uses `ptr` (torch.Tensor.record_stream): after
// ctxpool_free the block is reused only once the work enqueued on `stream`
// before the free completes. -1 for a pointer that is not live.
CTXPOOL_TORCH_API int ctxpool_record_stream(void* ptr, cudaStream_t stream);

// Sets the calling thread's current model: its following allocations are
// charged to model `name`'s session (and budget) on their device. NULL or ""
// selects "default". Returns -1 for a name longer than 255 bytes, or when
// host memory ran out (the model is then unchanged).
CTXPOOL_TORCH_API int ctxpool_set_model(const char* name);
// The calling thread's current model name ("default" when none was set).
// The pointer stays valid until the thread's next ctxpool_set_model.
CTXPOOL_TORCH_API const char* ctxpool_get_model(void);

// Sets model `name`'s hard budget (bytes; 0: no limit) for sessions opened
// after this call; other limits come from the option table. -1 (and nothing
// changes) when the model already has a session on some device: set budgets
// before the model's first allocation.
CTXPOOL_TORCH_API int ctxpool_set_model_budget(const char* name,
                                               size_t max_bytes);

// A stream leased by the calling thread's current model on `device` (index
// `i` of the session's streams, see CTXPOOL_SESSION_STREAMS), for
// torch.cuda.ExternalStream. NULL (with ctxpool_last_error) on failure.
CTXPOOL_TORCH_API cudaStream_t ctxpool_model_stream(int device, int i);

// Writes a JSON snapshot of every opened device (segments, blocks, models,
// live allocations: ctxpool/telemetry/json.h) to `path`. -1 on error.
CTXPOOL_TORCH_API int ctxpool_snapshot(const char* path);

// Writes the allocation trace recorded with CTXPOOL_TRACE=1 to `path` (CSV,
// RMM's log columns, read by `ctxpool replay`). -1 when tracing is off or
// the file cannot be written.
CTXPOOL_TORCH_API int ctxpool_write_trace(const char* path);

// The last failure's text, "" when nothing failed yet.
CTXPOOL_TORCH_API const char* ctxpool_last_error(void);

// One JSON object describing the state: driver kind and note, process id,
// device count, opened devices, tracing. Creates the state if needed.
CTXPOOL_TORCH_API const char* ctxpool_info(void);

// Destroys the state (sessions, contexts, driver) so that the next call
// creates a new one. Refused (-1) while allocations are live unless `force`,
// which reports them as leaks and takes their memory back (their pointers
// become invalid). For tests and orderly shutdown; the state is otherwise
// leaked at exit on purpose (PyTorch frees tensors after static destructors).
// REQUIRES: no other ctxpool_* call runs concurrently or afterwards with a
// pointer allocated before.
CTXPOOL_TORCH_API int ctxpool_shutdown(int force);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_H_
