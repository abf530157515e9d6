// benchmarks/peers/cub_peer.h — CUB's CachingDeviceAllocator as a peer.
//
// CubPeer wraps cub::CachingDeviceAllocator (cub/util_allocator.cuh, the
// host-side caching allocator CUB and Thrust users reach for) behind ctxpool
// types, so benchmarks run the same workload on ctxpool and on CUB. On the
// CPU, CUB's cuda* calls go to the CUDA runtime shim (cuda_runtime_shim.h)
// and from there to a SimDriver; install the driver first:
//
//   auto sim = ctxpool::SimDriver::Create();
//   CTXPOOL_RETURN_IF_ERROR(ctxpool::peers::InstallShimDriver(sim.get()));
//   auto cub = ctxpool::peers::CubPeer::Create();
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, cub->Allocate(4096, stream));
//   CTXPOOL_RETURN_IF_ERROR(cub->Deallocate(p));
//   CTXPOOL_RETURN_IF_ERROR(cub->FreeAllCached());
//
// CUB's design, for comparison with ctxpool's: sizes round up to a power of
// `bin_growth` (default 8: 512 B, 4 KiB, 32 KiB, 256 KiB, 2 MiB, 16 MiB);
// each cached block is one cudaMalloc, never split or merged; bins are a
// std::multiset searched linearly for a block of the same stream or one whose
// ready event completed; every cached free records an event (cudaEventRecord).
// Requests above the largest bin are cudaMalloc'd exactly and never cached.
//
// This header includes no CUDA header; cub_peer.cc does.
//
// Thread-safety: all methods are thread-safe (CUB's own std::mutex).
// Stream ordering is CUB's: a block is reusable at once on the stream it was
// allocated on, and on other streams once the work enqueued on its stream
// before Deallocate completes.
#ifndef CTXPOOL_BENCHMARKS_PEERS_CUB_PEER_H_
#define CTXPOOL_BENCHMARKS_PEERS_CUB_PEER_H_

#include <cstddef>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/driver/types.h"

namespace ctxpool {
namespace peers {

struct CubPeerOptions {
  unsigned bin_growth = 8;
  unsigned min_bin = 3;  // 8^3 = 512 B, ctxpool's rounding
  // 8^8 = 16 MiB, so every size of the hot-path mixes (<= 8 MiB) is cached;
  // CUB's own default (7: 2 MiB) would send 8 MiB requests to cudaMalloc.
  unsigned max_bin = 8;
  // Unlimited (CUB's own default caps the cache at 6 MiB per device).
  std::size_t max_cached_bytes = std::numeric_limits<std::size_t>::max();
};

// CUB's counters, read under its lock.
struct CubPeerStats {
  std::size_t cached_blocks = 0;  // free, reusable
  std::size_t live_blocks = 0;
  std::size_t cached_bytes = 0;  // all devices
  std::size_t live_bytes = 0;
};

class CubPeer {
 public:
  // Never fails: CUB's constructor makes no runtime call.
  static std::unique_ptr<CubPeer> Create(CubPeerOptions options = {});
  // Frees everything cached (FreeAllCached) through the shim.
  // REQUIRES: the shim's driver is still installed.
  ~CubPeer();

  CubPeer(const CubPeer&) = delete;
  CubPeer& operator=(const CubPeer&) = delete;

  // cub::CachingDeviceAllocator::DeviceAllocate on the calling thread's
  // current device. Errors carry the runtime's error name in the message:
  // RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation, INTERNAL otherwise.
  // REQUIRES: a shim driver is installed.
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream);
  // cub::CachingDeviceAllocator::DeviceFree. A pointer CUB does not know is
  // passed to cudaFree, as CUB does (the simulated driver reports it).
  absl::Status Deallocate(DevicePtr ptr);
  // cub::CachingDeviceAllocator::FreeAllCached: cudaFree every cached block.
  absl::Status FreeAllCached();

  CubPeerStats Stats() const;
  const CubPeerOptions& options() const { return options_; }

 private:
  struct Impl;  // the cub::CachingDeviceAllocator (cub_peer.cc)
  CubPeer(CubPeerOptions options, std::unique_ptr<Impl> impl);
  CubPeerOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace peers
}  // namespace ctxpool

#endif  // CTXPOOL_BENCHMARKS_PEERS_CUB_PEER_H_
