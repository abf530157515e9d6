// ctxpool_torch_allocator.h — ctxpool as libtorch's CUDA allocator (C++).
//
// Python's CUDAPluggableAllocator can only set the malloc and free hooks.
// From C++, the same allocator object also takes a record-stream hook
// (Tensor::record_stream, so blocks used on side streams are not reused too
// early) and a reset hook (torch::cuda::emptyCache / c10's emptyCache,
// mapped to ctxpool_empty_cache). Install it before the first CUDA tensor:
//
//   #include "ctxpool_torch_allocator.h"   // link libctxpool_torch.so
//
//   int main() {
//     ctxpool_torch::InstallAllocator();
//     ctxpool_torch::ScopedModel bert("bert");   // charge bert's budget
//     auto x = torch::randn({1024, 1024}, torch::kCUDA);
//   }
//
// Out of memory: ctxpool_malloc throws std::bad_alloc with ctxpool's report
// (see ctxpool_torch.h); the hook installed here rethrows it as
// c10::OutOfMemoryError, what PyTorch's own allocator throws, so C++ callers
// catch c10::OutOfMemoryError and Python callers torch.OutOfMemoryError.
// Other failures (no driver, bad device) become c10::Error.
//
// Header-only; it needs libtorch's headers and libctxpool_torch.so at link
// time. The CMake build compiles plugins/torch/examples/libtorch_example.cc
// with it only when find_package(Torch) succeeds; the test
// torch_allocator_header_test compiles it against a stand-in of the PyTorch
// API it uses (plugins/torch/tests/fake_torch), in both spellings of the
// allocation hook's device parameter.
//
// Thread-safety: InstallAllocator must run before any CUDA allocation and
// not concurrently with one (PyTorch refuses to swap an allocator in use).
// ScopedModel affects only the calling thread.
#ifndef CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_ALLOCATOR_H_
#define CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_ALLOCATOR_H_

#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstddef>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "ctxpool_torch.h"

namespace ctxpool_torch {
namespace internal {

// ctxpool_malloc with its exceptions turned into PyTorch's.
inline void* Malloc(std::size_t size, int device, cudaStream_t stream) {
  try {
    return ctxpool_malloc(size, device, stream);
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  return nullptr;  // not reached: TORCH_CHECK(false, ...) throws
}

}  // namespace internal

// Creates the pluggable allocator over ctxpool_malloc / ctxpool_free, sets
// its reset (empty cache) and record-stream hooks, and makes it PyTorch's
// current CUDA allocator. Returns the allocator (PyTorch keeps it alive too).
// REQUIRES: no CUDA tensor was allocated yet in this process.
inline std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>
InstallAllocator() {
  namespace pa = torch::cuda::CUDAPluggableAllocator;
  // Generic lambdas: the device parameter is `int` in some PyTorch releases
  // and c10::DeviceIndex in others.
  auto alloc = pa::createCustomAllocator(
      [](std::size_t size, auto device, cudaStream_t stream) -> void* {
        return internal::Malloc(size, static_cast<int>(device), stream);
      },
      [](void* ptr, std::size_t size, auto device, cudaStream_t stream) {
        ctxpool_free(ptr, size, static_cast<int>(device), stream);
      });
  auto* pluggable = dynamic_cast<pa::CUDAPluggableAllocator*>(alloc.get());
  if (pluggable != nullptr) {
    pluggable->set_reset_fn([] { (void)ctxpool_empty_cache(); });
    pluggable->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      (void)ctxpool_record_stream(ptr, stream);
    });
  }
  pa::changeCurrentAllocator(alloc);
  return alloc;
}

// Charges the calling thread's allocations to model `name` while it lives,
// then restores the previous model.
class ScopedModel {
 public:
  explicit ScopedModel(const std::string& name)
      : previous_(ctxpool_get_model()) {
    ctxpool_set_model(name.c_str());
  }
  ~ScopedModel() { ctxpool_set_model(previous_.c_str()); }
  ScopedModel(const ScopedModel&) = delete;
  ScopedModel& operator=(const ScopedModel&) = delete;

 private:
  std::string previous_;
};

}  // namespace ctxpool_torch

#endif  // CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_ALLOCATOR_H_
