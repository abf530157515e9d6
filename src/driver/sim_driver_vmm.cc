// SimDriver's virtual memory calls (cuMemAddressReserve/Free, cuMemCreate,
// cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess): reservations,
// physical allocations and mappings, checked as strictly as the driver.
// See include/ctxpool/driver/sim_driver.h.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "sim_driver_state.h"

namespace ctxpool {

// ---------------------------------------------------------------------------
// VMM

absl::StatusOr<std::size_t> SimDriver::MemGetAllocationGranularity(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(
      s.CheckDevice("cuMemGetAllocationGranularity", device));
  return s.devices[device].spec.vmm_granularity;
}

absl::StatusOr<DevicePtr> SimDriver::MemAddressReserve(std::size_t bytes,
                                                       std::size_t alignment) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemAddressReserve));
  const std::size_t granularity = s.devices[0].spec.vmm_granularity;
  if (bytes == 0 || bytes % granularity != 0) {
    return s.Misuse("cuMemAddressReserve", cu::kErrorInvalidValue,
                    absl::StrFormat("size %u is not a positive multiple of the "
                                    "granularity %u",
                                    bytes, granularity));
  }
  if (alignment != 0 && !IsPowerOfTwo(alignment)) {
    return s.Misuse(
        "cuMemAddressReserve", cu::kErrorInvalidValue,
        absl::StrFormat("alignment %u is not a power of two", alignment));
  }
  const std::uint64_t address =
      s.BumpAddress(bytes, std::max<std::size_t>(alignment, granularity));
  s.reservations.emplace(address, bytes);
  return DevicePtr(address);
}

absl::Status SimDriver::MemAddressFree(DevicePtr ptr, std::size_t bytes) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemAddressFree));
  auto it = s.reservations.find(ptr.address());
  if (it == s.reservations.end() || it->second != bytes) {
    return s.Misuse("cuMemAddressFree", cu::kErrorInvalidValue,
                    absl::StrFormat("[0x%x, +%u) is not a whole reservation",
                                    ptr.address(), bytes));
  }
  auto m = s.mappings.lower_bound(ptr.address());
  if (m != s.mappings.end() && m->first < ptr.address() + bytes) {
    return s.Misuse(
        "cuMemAddressFree", cu::kErrorInvalidValue,
        absl::StrFormat("the reservation still has a mapping at 0x%x; "
                        "cuMemUnmap it first",
                        m->first));
  }
  s.reservations.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<PhysicalMemHandle> SimDriver::MemCreate(std::size_t bytes,
                                                       int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemCreate, bytes));
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuMemCreate", device));
  State::Device& d = s.devices[device];
  if (!d.spec.vmm_supported) {
    return DriverError(cu::kErrorNotSupported, "cuMemCreate",
                       "the device does not support VMM");
  }
  if (bytes == 0 || bytes % d.spec.vmm_granularity != 0) {
    return s.Misuse("cuMemCreate", cu::kErrorInvalidValue,
                    absl::StrFormat("size %u is not a positive multiple of the "
                                    "granularity %u",
                                    bytes, d.spec.vmm_granularity));
  }
  if (!s.Fits(d, bytes)) return s.OutOfMemory("cuMemCreate", d, bytes);
  s.AddUsed(d, bytes);
  const std::uint64_t handle = s.NextHandle(kPhysicalBase);
  s.physical.emplace(handle, State::Physical{bytes, device, false, 0});
  return PhysicalMemHandle(handle);
}

absl::Status SimDriver::MemRelease(PhysicalMemHandle handle) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  auto it = s.physical.find(handle.value());
  CTXPOOL_RETURN_IF_ERROR(s.Enter(
      SimCall::kMemRelease, it == s.physical.end() ? 0 : it->second.bytes));
  if (it == s.physical.end() || it->second.released) {
    return s.Misuse("cuMemRelease", cu::kErrorInvalidValue,
                    absl::StrFormat("0x%x is not a live physical allocation "
                                    "(double release?)",
                                    handle.value()));
  }
  if (it->second.maps > 0) {
    it->second.released = true;  // freed by the last cuMemUnmap
    return absl::OkStatus();
  }
  s.devices[it->second.device].used -= it->second.bytes;
  s.physical.erase(it);
  return absl::OkStatus();
}

absl::Status SimDriver::MemMap(DevicePtr ptr, std::size_t bytes,
                               std::size_t offset, PhysicalMemHandle handle) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemMap, bytes));
  auto phys = s.physical.find(handle.value());
  if (phys == s.physical.end() || phys->second.released) {
    return s.Misuse("cuMemMap", cu::kErrorInvalidValue,
                    absl::StrFormat("0x%x is not a live physical allocation",
                                    handle.value()));
  }
  const std::size_t granularity =
      s.devices[phys->second.device].spec.vmm_granularity;
  const std::uint64_t lo = ptr.address();
  const std::uint64_t hi = lo + bytes;
  if (bytes == 0 || lo % granularity != 0 || bytes % granularity != 0 ||
      offset % granularity != 0) {
    return s.Misuse("cuMemMap", cu::kErrorInvalidValue,
                    absl::StrFormat("address 0x%x, size %u and offset %u must "
                                    "be multiples of the granularity %u",
                                    lo, bytes, offset, granularity));
  }
  if (offset > phys->second.bytes || bytes > phys->second.bytes - offset) {
    return s.Misuse("cuMemMap", cu::kErrorInvalidValue,
                    absl::StrFormat("[offset %u, +%u) exceeds the physical "
                                    "allocation of %u bytes",
                                    offset, bytes, phys->second.bytes));
  }
  auto r = s.reservations.upper_bound(lo);
  bool inside = false;
  if (r != s.reservations.begin()) {
    --r;
    inside = r->first <= lo && hi <= r->first + r->second;
  }
  if (!inside) {
    return s.Misuse("cuMemMap", cu::kErrorInvalidValue,
                    absl::StrFormat("[0x%x, 0x%x) is not inside one "
                                    "cuMemAddressReserve reservation",
                                    lo, hi));
  }
  auto m = s.mappings.upper_bound(lo);
  if (m != s.mappings.begin()) --m;
  for (; m != s.mappings.end() && m->first < hi; ++m) {
    if (m->first + m->second.bytes > lo) {
      // The driver answers CUDA_ERROR_INVALID_VALUE (cuMemMap documents no
      // CUDA_ERROR_ALREADY_MAPPED).
      return s.Misuse("cuMemMap", cu::kErrorInvalidValue,
                      absl::StrFormat("[0x%x, 0x%x) overlaps the mapping at "
                                      "0x%x: already mapped",
                                      lo, hi, m->first));
    }
  }
  s.mappings.emplace(lo, State::Mapping{bytes, handle.value(), offset, false});
  ++phys->second.maps;
  return absl::OkStatus();
}

absl::Status SimDriver::MemUnmap(DevicePtr ptr, std::size_t bytes) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemUnmap, bytes));
  const std::uint64_t lo = ptr.address();
  const std::uint64_t hi = lo + bytes;
  // [lo, hi) must be exactly a run of whole, adjacent mappings.
  std::uint64_t cursor = lo;
  auto m = s.mappings.find(lo);
  auto first = m;
  while (bytes != 0 && m != s.mappings.end() && m->first == cursor &&
         cursor < hi) {
    cursor += m->second.bytes;
    ++m;
  }
  if (bytes == 0 || first == s.mappings.end() || cursor != hi) {
    return s.Misuse("cuMemUnmap", cu::kErrorInvalidValue,
                    absl::StrFormat("[0x%x, 0x%x) is not a run of whole "
                                    "mappings (not mapped, or a partial "
                                    "mapping)",
                                    lo, hi));
  }
  std::string user = s.PendingUser(lo, hi);
  if (!user.empty()) {
    s.Misuse("cuMemUnmap", cu::kErrorIllegalAddress, user).IgnoreError();
  }
  // Erasing invalidates btree iterators: collect the keys first.
  absl::InlinedVector<std::uint64_t, 4> keys;
  for (auto it = first; it != m; ++it) keys.push_back(it->first);
  for (std::uint64_t key : keys) {
    auto it = s.mappings.find(key);
    auto phys = s.physical.find(it->second.handle);
    if (phys != s.physical.end() && --phys->second.maps == 0 &&
        phys->second.released) {
      s.devices[phys->second.device].used -= phys->second.bytes;
      s.physical.erase(phys);
    }
    s.mappings.erase(it);
  }
  s.shadow.Forget(lo, hi);
  return absl::OkStatus();
}

absl::Status SimDriver::MemSetAccess(DevicePtr ptr, std::size_t bytes,
                                     int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemSetAccess, bytes));
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuMemSetAccess", device));
  const std::uint64_t lo = ptr.address();
  const std::uint64_t hi = lo + bytes;
  auto m = s.mappings.upper_bound(lo);
  if (m != s.mappings.begin()) --m;
  std::uint64_t cursor = lo;
  auto first = m;
  while (bytes != 0 && m != s.mappings.end() && m->first <= cursor &&
         cursor < m->first + m->second.bytes && cursor < hi) {
    cursor = m->first + m->second.bytes;
    ++m;
  }
  if (bytes == 0 || cursor < hi) {
    return s.Misuse(
        "cuMemSetAccess", cu::kErrorInvalidValue,
        absl::StrFormat("[0x%x, 0x%x) is not wholly mapped", lo, hi));
  }
  for (auto it = first; it != m; ++it) it->second.access = true;
  return absl::OkStatus();
}

}  // namespace ctxpool
