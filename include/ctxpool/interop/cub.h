// ctxpool/interop/cub.h — CUB's two-phase temporary storage from ctxpool.
//
// Every CUB device algorithm is called twice: once with a null temporary
// buffer to learn how many bytes it needs, then with a buffer of that size.
// RunWithTempStorage does the dance with ctxpool memory on the call's stream
// and frees the buffer stream-ordered after the algorithm's work:
//
//   CTXPOOL_RETURN_IF_ERROR(interop::RunWithTempStorage(
//       interop::MemoryRef(*bert), s, [&](void* temp, std::size_t& bytes) {
//         return cub::DeviceRadixSort::SortKeys(temp, bytes, in, out, n, 0,
//                                               32, s.as<cudaStream_t>());
//       }));
//
// CubTempStorage keeps one buffer across calls (grown when a call needs
// more), for a loop that runs the same algorithms again and again: after the
// first call, no pool call at all.
//
// `algorithm(void* temp_storage, std::size_t& temp_storage_bytes)` returns
// CUB's cudaError_t, or any integral or enum type whose zero value is success.
// A non-zero result is returned as INTERNAL naming the code and the phase;
// nothing leaks. A size query that reports 0 bytes still gets a valid,
// unique buffer (ctxpool's size-0 block), because CUB treats a null buffer
// as "query the size" whatever the byte count.
//
// Needs no CUDA header (the caller's algorithm brings CUB); header-only.
#ifndef CTXPOOL_INTEROP_CUB_H_
#define CTXPOOL_INTEROP_CUB_H_

#include <cstddef>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/interop/memory_ref.h"

namespace ctxpool::interop {

namespace cub_internal {

template <typename R>
absl::Status ToStatus(R result, const char* phase) {
  static_assert(std::is_integral_v<R> || std::is_enum_v<R>,
                "the algorithm must return cudaError_t (or an integral code)");
  if (result == R{}) return absl::OkStatus();
  return absl::InternalError(
      absl::StrFormat("CUB algorithm failed in its %s: cudaError_t %d", phase,
                      static_cast<long long>(result)));
}

}  // namespace cub_internal

class CubTempStorage {
 public:
  // REQUIRES: the memory ref's allocator (session) outlives this object.
  CubTempStorage(MemoryRef mr, StreamHandle stream,
                 const char* label = "cub temp storage") noexcept
      : mr_(mr), stream_(stream), label_(label) {}
  CubTempStorage(const CubTempStorage&) = delete;
  CubTempStorage& operator=(const CubTempStorage&) = delete;
  // Frees the buffer, ordered after the work enqueued on stream().
  ~CubTempStorage() { Free(); }

  // Runs `algorithm`'s size query, grows the buffer if needed (the old one
  // is freed first, stream-ordered, so old and new need not fit the model's
  // budget together; on an error the buffer is then empty), then runs it
  // for real.
  // Errors: the algorithm's (INTERNAL, see the file comment) or the pool's
  // (RESOURCE_EXHAUSTED with the OOM report, the model's budget).
  template <typename Algorithm>
  absl::Status Run(Algorithm&& algorithm) {
    std::size_t need = 0;
    absl::Status s =
        cub_internal::ToStatus(algorithm(nullptr, need), "size query");
    if (!s.ok()) return s;
    if (ptr_.is_null() || need > bytes_) {
      Free();
      absl::StatusOr<DevicePtr> p = mr_.Allocate(need, stream_, label_);
      if (!p.ok()) return std::move(p).status();
      ptr_ = *p;
      bytes_ = need;
    }
    std::size_t have = bytes_;
    return cub_internal::ToStatus(algorithm(ptr_.get(), have), "run");
  }

  StreamHandle stream() const noexcept { return stream_; }
  // Bytes of the buffer kept for the next Run (0 before the first).
  std::size_t capacity() const noexcept { return bytes_; }

 private:
  void Free() noexcept {
    if (!ptr_.is_null()) mr_.Deallocate(ptr_, bytes_, stream_).IgnoreError();
    ptr_ = DevicePtr();
    bytes_ = 0;
  }

  MemoryRef mr_;
  StreamHandle stream_;
  const char* label_;
  DevicePtr ptr_;
  std::size_t bytes_ = 0;
};

// One algorithm, one temporary buffer (allocated for the call and freed
// after it, stream-ordered).
template <typename Algorithm>
absl::Status RunWithTempStorage(MemoryRef mr, StreamHandle stream,
                                Algorithm&& algorithm,
                                const char* label = "cub temp storage") {
  CubTempStorage temp(mr, stream, label);
  return temp.Run(std::forward<Algorithm>(algorithm));
}

}  // namespace ctxpool::interop

#endif  // CTXPOOL_INTEROP_CUB_H_
