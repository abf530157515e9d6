// benchmarks/peers/cuda_runtime_shim.h — a small CUDA runtime over a Driver.
//
// Peer allocators written against the CUDA runtime API (CUB's
// CachingDeviceAllocator) run on the CPU by linking this shim instead of
// libcudart. It defines, as extern "C" functions with the runtime's own
// signatures, exactly the entry points cub/util_allocator.cuh calls plus a few
// neighbours a peer benchmark needs:
//
//   cudaGetDevice  cudaSetDevice  cudaGetDeviceCount  cudaGetLastError
//   cudaPeekAtLastError  cudaGetErrorString  cudaGetErrorName
//   cudaMalloc  cudaFree  cudaMemGetInfo
//   cudaEventCreate  cudaEventCreateWithFlags  cudaEventDestroy
//   cudaEventRecord  cudaEventQuery  cudaEventSynchronize
//   cudaStreamWaitEvent  cudaStreamSynchronize  cudaDeviceSynchronize
//
// Each forwards to the process-global ctxpool::Driver installed with
// InstallShimDriver (in the benchmarks, a SimDriver). Like the runtime, the
// shim uses each device's primary context, made current lazily on each
// calling thread, and keeps a per-thread current device and last error.
//
//   auto sim = ctxpool::SimDriver::Create();
//   CTXPOOL_RETURN_IF_ERROR(ctxpool::peers::InstallShimDriver(sim.get()));
//   void* p = nullptr;
//   cudaMalloc(&p, 1 << 20);  // SimDriver::MemAlloc on device 0
//   cudaFree(p);
//   CTXPOOL_RETURN_IF_ERROR(ctxpool::peers::InstallShimDriver(nullptr));
//
// The symbols clash by design with libcudart's: the shim is a static library
// (ctxpool_cub_peer) linked only into benchmark executables that never link
// cudart. This header does not include CUDA headers; the shim's .cc does.
//
// Thread-safety: the cuda* functions may be called from any thread
// concurrently, as the runtime's. InstallShimDriver must not run concurrently
// with any cuda* call.
#ifndef CTXPOOL_BENCHMARKS_PEERS_CUDA_RUNTIME_SHIM_H_
#define CTXPOOL_BENCHMARKS_PEERS_CUDA_RUNTIME_SHIM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {
namespace peers {

// Makes `driver` the device behind the shim's cuda* functions: retains the
// primary context of every device of `driver` (released when another driver,
// or nullptr, is installed). With nullptr, or before any install, every cuda*
// call fails with cudaErrorNoDevice. The calling thread's current device
// resets to 0; other threads keep theirs (checked on their next call) and
// make the new driver's primary context current on their next call.
// REQUIRES: no cuda* call runs concurrently; `driver` outlives its install;
//           memory and events obtained through the shim from the previous
//           driver are freed before it is replaced.
absl::Status InstallShimDriver(Driver* driver);

// The installed driver, or nullptr.
Driver* ShimDriver();

// Calls made through the shim since the last install, by kind. Thread-safe
// (relaxed counters; exact once the calling threads are joined).
struct ShimCallCounts {
  std::uint64_t malloc_calls = 0;
  std::uint64_t free_calls = 0;
  std::uint64_t event_create_calls = 0;
  std::uint64_t event_destroy_calls = 0;
  std::uint64_t event_record_calls = 0;
  std::uint64_t event_query_calls = 0;
  std::uint64_t errors = 0;  // calls that returned an error (not NotReady)
};
ShimCallCounts GetShimCallCounts();

}  // namespace peers
}  // namespace ctxpool

#endif  // CTXPOOL_BENCHMARKS_PEERS_CUDA_RUNTIME_SHIM_H_
