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
// Header-only; it needs libtorch's headers and libctxpool_torch.so at link
// time. The CMake build compiles plugins/torch/examples/libtorch_example.cc
// with it only when find_package(Torch) succeeds.
//
// Thread-safety: InstallAllocator must run before any CUDA allocation and
// not concurrently with one (PyTorch refuses to swap an allocator in use).
// ScopedModel affects only the calling thread.
#ifndef CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_ALLOCATOR_H_
#define CTXPOOL_PLUGINS_TORCH_CTXPOOL_TORCH_ALLOCATOR_H_

#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstddef>
#include <memory>
#include <string>

#include "ctxpool_torch.h"

namespace ctxpool_torch {

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
        return ctxpool_malloc(size, static_cast<int>(device), stream);
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
