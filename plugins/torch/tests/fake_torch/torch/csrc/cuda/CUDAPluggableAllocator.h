// Stand-in for PyTorch's torch/csrc/cuda/CUDAPluggableAllocator.h: the
// functions and hooks ctxpool_torch_allocator.h uses, with PyTorch 2.x's
// signatures and minimal bodies that call the hooks as PyTorch does. See
// ../../../README.md.
#ifndef CTXPOOL_FAKE_TORCH_CUDA_PLUGGABLE_ALLOCATOR_H_
#define CTXPOOL_FAKE_TORCH_CUDA_PLUGGABLE_ALLOCATOR_H_

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

typedef struct CUstream_st* cudaStream_t;

namespace c10 {
using DeviceIndex = std::int8_t;
namespace cuda::CUDACachingAllocator {

class CUDAAllocator {
 public:
  virtual ~CUDAAllocator() = default;
  virtual void* malloc(std::size_t size, DeviceIndex device,
                       cudaStream_t stream) = 0;
  virtual void raw_delete(void* ptr) = 0;
  virtual void emptyCache() = 0;
  virtual void recordStream(void* ptr, cudaStream_t stream) = 0;
};

}  // namespace cuda::CUDACachingAllocator
}  // namespace c10

namespace torch::cuda::CUDAPluggableAllocator {

#if defined(CTXPOOL_FAKE_TORCH_DEVICE_INDEX_HOOK)
using HookDevice = c10::DeviceIndex;
#else
using HookDevice = int;
#endif

class CUDAPluggableAllocator
    : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  CUDAPluggableAllocator(
      std::function<void*(std::size_t, HookDevice, cudaStream_t)> alloc_fn,
      std::function<void(void*, std::size_t, int, cudaStream_t)> free_fn)
      : alloc_fn_(std::move(alloc_fn)), free_fn_(std::move(free_fn)) {}

  void set_reset_fn(std::function<void()> fn) { reset_fn_ = std::move(fn); }
  void set_record_stream_fn(std::function<void(void*, cudaStream_t)> fn) {
    record_stream_fn_ = std::move(fn);
  }

  // As PyTorch: the hook's result is recorded without a NULL check.
  void* malloc(std::size_t size, c10::DeviceIndex device,
               cudaStream_t stream) override {
    void* p = alloc_fn_(size, device, stream);
    std::lock_guard<std::mutex> lock(mu_);
    meta_[p] = {size, device, stream};
    return p;
  }
  void raw_delete(void* ptr) override {
    std::tuple<std::size_t, int, cudaStream_t> m;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = meta_.find(ptr);
      TORCH_CHECK(it != meta_.end(),
                  "Trying to free a pointer not allocated here");
      m = it->second;
      meta_.erase(it);
    }
    free_fn_(ptr, std::get<0>(m), std::get<1>(m), std::get<2>(m));
  }
  void emptyCache() override {
    if (reset_fn_) reset_fn_();
  }
  void recordStream(void* ptr, cudaStream_t stream) override {
    if (record_stream_fn_) record_stream_fn_(ptr, stream);
  }

 private:
  std::function<void*(std::size_t, HookDevice, cudaStream_t)> alloc_fn_;
  std::function<void(void*, std::size_t, int, cudaStream_t)> free_fn_;
  std::function<void()> reset_fn_;
  std::function<void(void*, cudaStream_t)> record_stream_fn_;
  std::mutex mu_;
  std::map<void*, std::tuple<std::size_t, int, cudaStream_t>> meta_;
};

inline std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>&
CurrentForTest() {
  static auto* current =
      new std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>();
  return *current;
}

inline std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>
createCustomAllocator(
    std::function<void*(std::size_t, HookDevice, cudaStream_t)> alloc_fn,
    std::function<void(void*, std::size_t, int, cudaStream_t)> free_fn) {
  return std::make_shared<CUDAPluggableAllocator>(std::move(alloc_fn),
                                                  std::move(free_fn));
}

inline void changeCurrentAllocator(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>&
        allocator) {
  TORCH_CHECK(CurrentForTest() == nullptr,
              "Can't swap an already initialized allocator");
  CurrentForTest() = allocator;
}

inline std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>
getCurrentAllocator() {
  return CurrentForTest();
}

}  // namespace torch::cuda::CUDAPluggableAllocator

#endif  // CTXPOOL_FAKE_TORCH_CUDA_PLUGGABLE_ALLOCATOR_H_
