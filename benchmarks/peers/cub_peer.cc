// CubPeer: cub::CachingDeviceAllocator behind ctxpool types.
//
// Peer-benchmark code: includes CUDA headers. CUB's allocator is host code
// and compiles with the host compiler; its cuda* calls resolve to the CUDA
// runtime shim (cuda_runtime_shim.cc) in the same static library.
#include "peers/cub_peer.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cub/util_allocator.cuh>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/driver/types.h"

namespace ctxpool {
namespace peers {
namespace {

absl::Status ToStatus(cudaError_t error, absl::string_view call) {
  if (error == cudaSuccess) return absl::OkStatus();
  // CUB leaves the error as the runtime's last error; clear it as CUB's own
  // OOM path does, so a later call starts clean.
  (void)cudaGetLastError();
  std::string message =
      absl::StrCat("cub::CachingDeviceAllocator::", call, ": ",
                   cudaGetErrorName(error), " (", static_cast<int>(error), ")");
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace

struct CubPeer::Impl {
  explicit Impl(const CubPeerOptions& o)
      : cub(o.bin_growth, o.min_bin, o.max_bin, o.max_cached_bytes,
            /*skip_cleanup=*/false) {}
  cub::CachingDeviceAllocator cub;
};

std::unique_ptr<CubPeer> CubPeer::Create(CubPeerOptions options) {
  auto impl = std::make_unique<Impl>(options);
  return std::unique_ptr<CubPeer>(new CubPeer(options, std::move(impl)));
}

CubPeer::CubPeer(CubPeerOptions options, std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

CubPeer::~CubPeer() = default;  // CUB's destructor calls FreeAllCached

absl::StatusOr<DevicePtr> CubPeer::Allocate(std::size_t bytes,
                                            StreamHandle stream) {
  void* ptr = nullptr;
  cudaError_t error =
      impl_->cub.DeviceAllocate(&ptr, bytes, stream.as<cudaStream_t>());
  if (error != cudaSuccess) return ToStatus(error, "DeviceAllocate");
  return DevicePtr::From(ptr);
}

absl::Status CubPeer::Deallocate(DevicePtr ptr) {
  cudaError_t error = impl_->cub.DeviceFree(ptr.get());
  if (error != cudaSuccess) return ToStatus(error, "DeviceFree");
  return absl::OkStatus();
}

absl::Status CubPeer::FreeAllCached() {
  return ToStatus(impl_->cub.FreeAllCached(), "FreeAllCached");
}

CubPeerStats CubPeer::Stats() const {
  cub::CachingDeviceAllocator& c = impl_->cub;
  std::lock_guard<std::mutex> lock(c.mutex);
  CubPeerStats stats;
  stats.cached_blocks = c.cached_blocks.size();
  stats.live_blocks = c.live_blocks.size();
  for (const auto& [device, totals] : c.cached_bytes) {
    stats.cached_bytes += totals.free;
    stats.live_bytes += totals.live;
  }
  return stats;
}

}  // namespace peers
}  // namespace ctxpool
