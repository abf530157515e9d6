// src/driver/sim_driver_state.h — SimDriver's state, shared by the files
// that implement it (internal; not installed): sim_driver.cc (devices,
// contexts, streams, events, cuMemAlloc, host memory, faults and counters)
// and sim_driver_vmm.cc (the virtual memory calls). The cost table lives in
// sim_costs.cc. Everything in State is guarded by State::mu.
#ifndef CTXPOOL_SRC_DRIVER_SIM_DRIVER_STATE_H_
#define CTXPOOL_SRC_DRIVER_SIM_DRIVER_STATE_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/internal/sim_race_detector.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace sim_internal {

// The simulated clocks saturate here (about 292 years).
inline constexpr std::int64_t kMaxSimulatedNs =
    std::numeric_limits<std::int64_t>::max();

inline constexpr std::uint64_t kDeviceAddressBase = std::uint64_t{1} << 52;
inline constexpr std::uint64_t kHandleStride = 0x10;
inline constexpr std::uint64_t kContextBase = 0xC7000000;
inline constexpr std::uint64_t kStreamBase = 0x57000000;
inline constexpr std::uint64_t kEventBase = 0xE7000000;
inline constexpr std::uint64_t kPhysicalBase = 0x9A000000;
inline constexpr int kPriorityLeast = 0;
inline constexpr int kPriorityGreatest = -5;
inline constexpr std::size_t kLogCap = 1000;
inline constexpr std::size_t kHostPage = 4096;

inline std::uint64_t RoundUp(std::uint64_t x, std::uint64_t align) {
  return (x + align - 1) / align * align;
}
inline bool IsPowerOfTwo(std::uint64_t x) {
  return x != 0 && (x & (x - 1)) == 0;
}

inline std::atomic<std::uint64_t> g_next_driver_id{1};

inline thread_local std::int64_t t_simulated_ns = 0;

// How many SimDriver calls the thread is inside (SimDriver::InCall).
inline thread_local int t_call_depth = 0;
struct CallScope {
  CallScope() { ++t_call_depth; }
  ~CallScope() { --t_call_depth; }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
};

// The calling thread's context stack for each SimDriver (keyed by a unique
// driver id, never by address, so a new SimDriver at a reused address starts
// with an empty stack).
inline std::vector<std::uint64_t>& ThreadCtxStack(std::uint64_t driver_id) {
  thread_local absl::flat_hash_map<std::uint64_t, std::vector<std::uint64_t>>
      stacks;
  return stacks[driver_id];
}

}  // namespace sim_internal

// The SimDriver files use these unqualified.
using sim_internal::CallScope;
using sim_internal::ClockAt;
using sim_internal::g_next_driver_id;
using sim_internal::IsPowerOfTwo;
using sim_internal::JoinClock;
using sim_internal::kContextBase;
using sim_internal::kDeviceAddressBase;
using sim_internal::kEventBase;
using sim_internal::kHandleStride;
using sim_internal::kHostPage;
using sim_internal::kLogCap;
using sim_internal::kMaxSimulatedNs;
using sim_internal::kPhysicalBase;
using sim_internal::kPriorityGreatest;
using sim_internal::kPriorityLeast;
using sim_internal::kStreamBase;
using sim_internal::RaceShadow;
using sim_internal::RoundUp;
using sim_internal::t_simulated_ns;
using sim_internal::ThreadCtxStack;
using sim_internal::VectorClock;

// ---------------------------------------------------------------------------
// State

struct SimDriver::State {
  struct Op {
    enum Kind : std::uint8_t { kWork, kRecord, kWait, kHostFn };
    Kind kind = kWork;
    std::uint64_t seq = 0;
    std::uint64_t lo = 0;  // kWork: the range touched
    std::uint64_t hi = 0;
    absl::InlinedVector<std::pair<std::uint32_t, std::uint64_t>, 1> deps;
    HostFn fn = nullptr;
    void* user_data = nullptr;
  };
  struct Stream {
    StreamHandle handle;
    std::uint64_t ctx = 0;
    unsigned flags = 0;
    int priority = 0;
    bool legacy = false;
    bool destroyed = false;
    bool held = false;
    std::uint64_t enqueued = 0;   // seq of the last enqueued op
    std::uint64_t completed = 0;  // seq of the last completed op
    std::deque<Op> queue;         // enqueued, not complete (seq order)
    VectorClock clock;
    std::uint64_t host_version_seen = 0;
    std::int64_t outstanding_work_ns = 0;  // work the host has not waited for
  };
  struct Event {
    std::uint64_t ctx = 0;
    unsigned flags = 0;
    bool recorded = false;
    std::uint32_t stream = 0;
    std::uint64_t seq = 0;
    VectorClock snapshot;
  };
  struct Context {
    ContextHandle handle;
    int device = 0;
    bool primary = false;
    bool alive = false;
    std::uint32_t legacy_stream = 0;
    std::vector<std::uint32_t> streams;  // live user streams
    std::size_t limits[3] = {1024, 1 * kMiB, 8 * kMiB};
  };
  struct Alloc {
    std::size_t bytes = 0;
    std::size_t charged = 0;
    int device = 0;
    std::uint64_t ctx = 0;
  };
  struct Mapping {
    std::size_t bytes = 0;
    std::uint64_t handle = 0;
    std::size_t offset = 0;
    bool access = false;
  };
  struct Physical {
    std::size_t bytes = 0;
    int device = 0;
    bool released = false;
    int maps = 0;
  };
  struct HostRange {
    std::size_t bytes = 0;
    bool allocated = false;  // MemHostAlloc (else MemHostRegister)
  };
  struct Device {
    SimDeviceSpec spec;
    std::size_t used = 0;
    std::size_t peak = 0;
    std::size_t context_bytes = 0;
    int primary_refcount = 0;
    unsigned primary_flags = 0;
    std::uint64_t primary_ctx = 0;
    int contexts_created = 0;
  };
  struct Fault {
    int count = 0;
    int error = 0;
  };

  explicit State(SimOptions options) : driver_id(g_next_driver_id++) {
    if (options.devices.empty()) {
      options.devices.push_back(*SimDevicePreset("h100-80gb"));
    }
    absl::MutexLock lock(&mu);
    for (SimDeviceSpec& spec : options.devices) {
      Device device;
      device.spec = std::move(spec);
      if (device.spec.vmm_granularity == 0) device.spec.vmm_granularity = 1;
      if (device.spec.alloc_alignment == 0) device.spec.alloc_alignment = 256;
      const std::uint64_t handle = NextHandle(kContextBase);
      device.primary_ctx = handle;
      Context ctx;
      ctx.handle = ContextHandle(handle);
      ctx.device = static_cast<int>(devices.size());
      ctx.primary = true;
      contexts.emplace(handle, std::move(ctx));
      devices.push_back(std::move(device));
    }
  }

  ~State() {
    absl::MutexLock lock(&mu);
    for (auto& [address, range] : host_ranges) {
      if (range.allocated) std::free(reinterpret_cast<void*>(address));
    }
  }

  const std::uint64_t driver_id;
  mutable absl::Mutex mu;

  std::vector<Device> devices ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uint64_t, Context> contexts ABSL_GUARDED_BY(mu);
  std::vector<Stream> streams ABSL_GUARDED_BY(mu);  // by internal index
  absl::flat_hash_map<std::uint64_t, std::uint32_t> stream_index
      ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uint64_t, Event> events ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uint64_t, bool> destroyed_events ABSL_GUARDED_BY(mu);
  absl::btree_set<std::uint32_t> pending_streams ABSL_GUARDED_BY(mu);
  std::size_t pending_ops ABSL_GUARDED_BY(mu) = 0;

  absl::btree_map<std::uint64_t, Alloc> allocs ABSL_GUARDED_BY(mu);
  absl::btree_map<std::uint64_t, std::size_t> reservations ABSL_GUARDED_BY(mu);
  absl::btree_map<std::uint64_t, Mapping> mappings ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uint64_t, Physical> physical ABSL_GUARDED_BY(mu);
  absl::btree_map<std::uint64_t, HostRange> host_ranges ABSL_GUARDED_BY(mu);
  std::uint64_t next_address ABSL_GUARDED_BY(mu) = kDeviceAddressBase;
  std::uint64_t next_handle_serial ABSL_GUARDED_BY(mu) = 0;

  VectorClock host_clock ABSL_GUARDED_BY(mu);
  std::uint64_t host_version ABSL_GUARDED_BY(mu) = 1;
  RaceShadow shadow ABSL_GUARDED_BY(mu);
  bool race_detection ABSL_GUARDED_BY(mu) = true;
  bool ignore_primary_flags ABSL_GUARDED_BY(mu) =
      false;  // SetIgnorePrimaryCtxFlags
  std::vector<RaceShadow::Conflict> conflicts ABSL_GUARDED_BY(mu);
  std::uint64_t race_count ABSL_GUARDED_BY(mu) = 0;
  std::vector<SimRace> races ABSL_GUARDED_BY(mu);

  std::uint64_t misuse_count ABSL_GUARDED_BY(mu) = 0;
  std::deque<std::string> misuse_log ABSL_GUARDED_BY(mu);

  std::array<std::uint64_t, kSimCallCount> calls ABSL_GUARDED_BY(mu) = {};
  std::array<Fault, kSimCallCount> faults ABSL_GUARDED_BY(mu) = {};
  std::array<std::int64_t, kSimCallCount> costs ABSL_GUARDED_BY(mu) = {};
  std::array<std::int64_t, kSimCallCount> costs_per_mib
      ABSL_GUARDED_BY(mu) = {};
  std::int64_t work_cost ABSL_GUARDED_BY(mu) = 0;
  std::int64_t context_create_cost ABSL_GUARDED_BY(mu) = 0;
  std::int64_t simulated_ns ABSL_GUARDED_BY(mu) = 0;

  // Host funcs whose operation completed, run in order outside the mutex by
  // one thread at a time (like the driver's callback thread).
  std::deque<std::pair<HostFn, void*>> callbacks ABSL_GUARDED_BY(mu);
  bool callbacks_running ABSL_GUARDED_BY(mu) = false;

  // ---- helpers (all with mu held) ----------------------------------------

  std::uint64_t NextHandle(std::uint64_t base)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return base + (++next_handle_serial) * kHandleStride;
  }

  // Adds `ns` to both clocks, saturating at kMaxSimulatedNs (a cost table
  // of huge values must not overflow them).
  static std::int64_t SaturatingAdd(std::int64_t a, std::int64_t b) {
    return a > kMaxSimulatedNs - b ? kMaxSimulatedNs : a + b;
  }
  void Charge(std::int64_t ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    simulated_ns = SaturatingAdd(simulated_ns, ns);
    t_simulated_ns = SaturatingAdd(t_simulated_ns, ns);
  }

  // Counts the call, charges its cost and consumes an injected fault.
  absl::Status Enter(SimCall call, std::size_t bytes = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int i = static_cast<int>(call);
    ++calls[i];
    std::int64_t cost = costs[i];
    if (costs_per_mib[i] != 0) {
      const double per_size = static_cast<double>(costs_per_mib[i]) *
                              static_cast<double>(bytes) /
                              static_cast<double>(kMiB);
      cost =
          SaturatingAdd(cost, per_size >= static_cast<double>(kMaxSimulatedNs)
                                  ? kMaxSimulatedNs
                                  : static_cast<std::int64_t>(per_size));
    }
    Charge(cost);
    if (faults[i].count > 0) {
      --faults[i].count;
      return DriverError(faults[i].error, SimCallName(call), "injected fault");
    }
    return absl::OkStatus();
  }

  absl::Status Misuse(absl::string_view call, int error, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++misuse_count;
    absl::Status status = DriverError(error, call, why);
    misuse_log.emplace_back(status.message());
    if (misuse_log.size() > kLogCap) misuse_log.pop_front();
    return status;
  }

  absl::Status CheckDevice(absl::string_view call, int device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (device < 0 || device >= static_cast<int>(devices.size())) {
      return Misuse(call, cu::kErrorInvalidDevice,
                    absl::StrCat("device ", device, " does not exist (",
                                 devices.size(), " simulated)"));
    }
    return absl::OkStatus();
  }

  // The calling thread's current context, alive.
  absl::StatusOr<Context*> Current(absl::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const std::vector<std::uint64_t>& stack = ThreadCtxStack(driver_id);
    if (stack.empty() || stack.back() == 0) {
      return Misuse(call, cu::kErrorInvalidContext,
                    "no context is current on this thread");
    }
    auto it = contexts.find(stack.back());
    if (it == contexts.end()) {
      return Misuse(call, cu::kErrorInvalidContext,
                    "the current context is not a context of this driver");
    }
    if (!it->second.alive) {
      return Misuse(call, cu::kErrorContextIsDestroyed,
                    "the current context was destroyed");
    }
    return &it->second;
  }

  // Resolves a stream handle; the null handle is the legacy default stream of
  // the current context.
  absl::StatusOr<std::uint32_t> ResolveStream(absl::string_view call,
                                              StreamHandle handle,
                                              bool allow_destroyed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (handle.is_null()) {
      absl::StatusOr<Context*> ctx = Current(call);
      if (!ctx.ok()) return ctx.status();
      return (*ctx)->legacy_stream;
    }
    auto it = stream_index.find(handle.value());
    if (it == stream_index.end()) {
      return Misuse(
          call, cu::kErrorInvalidHandle,
          absl::StrFormat("stream 0x%x is not a stream", handle.value()));
    }
    if (!allow_destroyed && streams[it->second].destroyed) {
      return Misuse(
          call, cu::kErrorInvalidHandle,
          absl::StrFormat("stream 0x%x was destroyed", handle.value()));
    }
    return it->second;
  }

  absl::StatusOr<Event*> ResolveEvent(absl::string_view call,
                                      EventHandle handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = events.find(handle.value());
    if (it != events.end()) return &it->second;
    if (destroyed_events.contains(handle.value())) {
      return Misuse(
          call, cu::kErrorInvalidHandle,
          absl::StrFormat("event 0x%x was destroyed", handle.value()));
    }
    return Misuse(
        call, cu::kErrorInvalidHandle,
        absl::StrFormat("event 0x%x is not an event", handle.value()));
  }

  std::uint32_t NewStream(std::uint64_t ctx, unsigned flags, int priority,
                          bool legacy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stream stream;
    stream.handle =
        legacy ? StreamHandle() : StreamHandle(NextHandle(kStreamBase));
    stream.ctx = ctx;
    stream.flags = flags;
    stream.priority = priority;
    stream.legacy = legacy;
    const auto index = static_cast<std::uint32_t>(streams.size());
    streams.push_back(std::move(stream));
    if (!legacy) stream_index.emplace(streams[index].handle.value(), index);
    return index;
  }

  void ActivateContext(Context& ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ctx.alive = true;
    ctx.streams.clear();
    ctx.limits[0] = 1024;
    ctx.limits[1] = 1 * kMiB;
    ctx.limits[2] = 8 * kMiB;
    ctx.legacy_stream = NewStream(ctx.handle.value(), kStreamDefault, 0, true);
    Device& device = devices[ctx.device];
    Charge(context_create_cost);
    ++device.contexts_created;
    AddUsed(device, device.spec.context_overhead_bytes);
    device.context_bytes += device.spec.context_overhead_bytes;
  }

  // Destroys a context: its streams and events, and the cuMemAlloc memory it
  // still owns (as the driver frees it).
  void DeactivateContext(Context& ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ctx.alive = false;
    const std::uint64_t id = ctx.handle.value();
    streams[ctx.legacy_stream].destroyed = true;
    for (std::uint32_t s : ctx.streams) streams[s].destroyed = true;
    ctx.streams.clear();
    for (auto it = events.begin(); it != events.end();) {
      if (it->second.ctx == id) {
        destroyed_events.emplace(it->first, true);
        events.erase(it++);
      } else {
        ++it;
      }
    }
    for (auto it = allocs.begin(); it != allocs.end();) {
      if (it->second.ctx == id) {
        devices[it->second.device].used -= it->second.charged;
        shadow.Forget(it->first, it->first + it->second.bytes);
        it = allocs.erase(it);
      } else {
        ++it;
      }
    }
    Device& device = devices[ctx.device];
    device.used -= device.spec.context_overhead_bytes;
    device.context_bytes -= device.spec.context_overhead_bytes;
  }

  bool Fits(const Device& device, std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return bytes <= device.spec.capacity_bytes &&
           device.used <= device.spec.capacity_bytes - bytes;
  }
  void AddUsed(Device& device, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    device.used += bytes;
    device.peak = std::max(device.peak, device.used);
  }

  absl::Status OutOfMemory(absl::string_view call, const Device& device,
                           std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return DriverError(
        cu::kErrorOutOfMemory, call,
        absl::StrFormat("%u bytes requested, %u of %u bytes in use on %s",
                        bytes, device.used, device.spec.capacity_bytes,
                        device.spec.name));
  }

  std::uint64_t BumpAddress(std::size_t bytes, std::size_t alignment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const std::uint64_t address = RoundUp(next_address, alignment);
    next_address = address + RoundUp(bytes, alignment);
    return address;
  }

  // ---- happens-before and the stream engine -------------------------------

  void HostJoin(const VectorClock& clock) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (JoinClock(host_clock, clock)) ++host_version;
  }

  // The host waited for everything enqueued on `s` (charges its work).
  void HostSynced(std::uint32_t s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stream& stream = streams[s];
    HostJoin(stream.clock);
    Charge(stream.outstanding_work_ns);
    stream.outstanding_work_ns = 0;
  }

  bool EventComplete(const Event& event) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return !event.recorded || streams[event.stream].completed >= event.seq;
  }

  void AddDep(Op& op, std::uint32_t s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const Stream& other = streams[s];
    if (other.completed < other.enqueued)
      op.deps.emplace_back(s, other.enqueued);
  }

  // Prepares `op` for stream `s`: joins the host clock and legacy-stream
  // barriers into the stream's clock, ticks it and assigns the op's seq.
  void Prepare(std::uint32_t s, Op& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stream& stream = streams[s];
    if (stream.host_version_seen != host_version) {
      JoinClock(stream.clock, host_clock);
      stream.host_version_seen = host_version;
    }
    if ((stream.flags & kStreamNonBlocking) == 0) {
      auto ctx_it = contexts.find(stream.ctx);
      if (ctx_it != contexts.end() && ctx_it->second.alive) {
        const Context& ctx = ctx_it->second;
        if (stream.legacy) {
          for (std::uint32_t b : ctx.streams) {
            if ((streams[b].flags & kStreamNonBlocking) != 0) continue;
            AddDep(op, b);
            JoinClock(streams[s].clock, streams[b].clock);
          }
        } else if (ctx.legacy_stream != s) {
          AddDep(op, ctx.legacy_stream);
          JoinClock(streams[s].clock, streams[ctx.legacy_stream].clock);
        }
      }
    }
    Stream& st = streams[s];
    if (st.clock.size() <= s) st.clock.resize(s + 1, 0);
    op.seq = ++st.enqueued;
    st.clock[s] = op.seq;
  }

  bool DepsDone(const Op& op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& [s, seq] : op.deps) {
      if (streams[s].completed < seq) return false;
    }
    return true;
  }

  void CompleteOp(Stream& stream, const Op& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    stream.completed = op.seq;
    if (op.kind == Op::kHostFn && op.fn != nullptr) {
      callbacks.emplace_back(op.fn, op.user_data);
    }
  }

  // Completes `op` at once when possible, else queues it.
  void Submit(std::uint32_t s, Op op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stream& stream = streams[s];
    if (stream.queue.empty() && !stream.held && DepsDone(op)) {
      CompleteOp(stream, op);
      return;
    }
    stream.queue.push_back(std::move(op));
    ++pending_ops;
    pending_streams.insert(s);
  }

  // Completes up to `limit` front operations of `s` (ignoring a hold when
  // `force`). Returns the number completed.
  std::size_t Drain(std::uint32_t s, std::size_t limit, bool force)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stream& stream = streams[s];
    std::size_t done = 0;
    while (done < limit && !stream.queue.empty() && (force || !stream.held) &&
           DepsDone(stream.queue.front())) {
      CompleteOp(stream, stream.queue.front());
      stream.queue.pop_front();
      --pending_ops;
      ++done;
    }
    if (stream.queue.empty()) pending_streams.erase(s);
    return done;
  }

  // Completes everything that can complete.
  void Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    bool progress = true;
    std::vector<std::uint32_t> order;
    while (progress && !pending_streams.empty()) {
      progress = false;
      order.assign(pending_streams.begin(), pending_streams.end());
      for (std::uint32_t s : order) {
        if (Drain(s, static_cast<std::size_t>(-1), false) > 0) progress = true;
      }
    }
  }

  // ---- memory validation and the race detector ---------------------------

  // True when [lo, hi) is inside one cuMemAlloc allocation, inside mappings
  // with access, or inside pinned host memory. Else sets *why.
  bool Accessible(std::uint64_t lo, std::uint64_t hi, std::string* why) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto a = allocs.upper_bound(lo);
    if (a != allocs.begin()) {
      --a;
      if (a->first <= lo && hi <= a->first + a->second.bytes) return true;
    }
    auto h = host_ranges.upper_bound(lo);
    if (h != host_ranges.begin()) {
      --h;
      if (h->first <= lo && hi <= h->first + h->second.bytes) return true;
    }
    auto m = mappings.upper_bound(lo);
    if (m != mappings.begin()) {
      --m;
      std::uint64_t cursor = lo;
      while (m != mappings.end() && m->first <= cursor &&
             cursor < m->first + m->second.bytes) {
        if (!m->second.access) {
          *why = absl::StrFormat(
              "[0x%x, 0x%x) is mapped but cuMemSetAccess was not called", lo,
              hi);
          return false;
        }
        cursor = m->first + m->second.bytes;
        if (cursor >= hi) return true;
        ++m;
      }
    }
    *why = absl::StrFormat(
        "[0x%x, 0x%x) is not inside allocated or mapped memory", lo, hi);
    return false;
  }

  void RecordAccess(std::uint32_t s, std::uint64_t lo, std::uint64_t hi)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!race_detection) return;
    conflicts.clear();
    shadow.Access(lo, hi, s, streams[s].clock, host_clock, &conflicts);
    for (const RaceShadow::Conflict& c : conflicts) {
      ++race_count;
      if (races.size() >= kLogCap) continue;
      SimRace race;
      race.first_ptr = DevicePtr(c.lo);
      race.first_bytes = c.hi - c.lo;
      race.first_stream = streams[c.stream].handle;
      race.second_ptr = DevicePtr(lo);
      race.second_bytes = hi - lo;
      race.second_stream = streams[s].handle;
      race.description = absl::StrFormat(
          "race: access [0x%x, +%u) on stream 0x%x (op %u) is not ordered "
          "with the earlier access [0x%x, +%u) on stream 0x%x (op %u); order "
          "them with cuEventRecord + cuStreamWaitEvent",
          lo, hi - lo, streams[s].handle.value(), streams[s].enqueued, c.lo,
          c.hi - c.lo, streams[c.stream].handle.value(), c.epoch);
      races.push_back(std::move(race));
    }
  }

  // A work operation (Touch, memset, memcpy) on stream `s`.
  void EnqueueWork(std::uint32_t s, std::uint64_t lo, std::uint64_t hi,
                   std::uint64_t lo2 = 0, std::uint64_t hi2 = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Op op;
    op.kind = Op::kWork;
    op.lo = lo;
    op.hi = hi;
    Prepare(s, op);
    RecordAccess(s, lo, hi);
    if (lo2 < hi2) RecordAccess(s, lo2, hi2);
    streams[s].outstanding_work_ns += work_cost;
    Submit(s, std::move(op));
  }

  // A pending (held) work op touches [lo, hi): freeing it is a use after
  // free. Returns a description or empty.
  std::string PendingUser(std::uint64_t lo, std::uint64_t hi) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (pending_ops == 0) return {};
    for (std::uint32_t s : pending_streams) {
      for (const Op& op : streams[s].queue) {
        if (op.kind == Op::kWork && op.lo < hi && lo < op.hi) {
          return absl::StrFormat(
              "use after free: pending work [0x%x, 0x%x) on stream 0x%x "
              "(held) still touches [0x%x, 0x%x)",
              op.lo, op.hi, streams[s].handle.value(), lo, hi);
        }
      }
    }
    return {};
  }

  // The implicit device synchronisation of cuMemFree: the host waits for
  // every stream of `device` whose work is complete.
  void DeviceSync(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (std::uint32_t s = 0; s < streams.size(); ++s) {
      const Stream& stream = streams[s];
      if (stream.completed != stream.enqueued) continue;
      auto ctx = contexts.find(stream.ctx);
      if (ctx == contexts.end() || ctx->second.device != device) continue;
      if (stream.outstanding_work_ns != 0 ||
          ClockAt(host_clock, s) < stream.enqueued) {
        HostSynced(s);
      }
    }
  }

  absl::Status CheckInvariants() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<std::size_t> used(devices.size(), 0);
    for (const auto& [address, alloc] : allocs)
      used[alloc.device] += alloc.charged;
    for (const auto& [handle, phys] : physical) used[phys.device] += phys.bytes;
    for (std::size_t d = 0; d < devices.size(); ++d) {
      used[d] += devices[d].context_bytes;
      if (used[d] != devices[d].used) {
        return absl::InternalError(absl::StrFormat(
            "device %d: used %u != allocs + physical + contexts %u", d,
            devices[d].used, used[d]));
      }
    }
    std::size_t pending = 0;
    for (const Stream& stream : streams) {
      pending += stream.queue.size();
      if (stream.completed + stream.queue.size() != stream.enqueued) {
        return absl::InternalError("stream: completed + queued != enqueued");
      }
    }
    if (pending != pending_ops) {
      return absl::InternalError("pending_ops does not match the queues");
    }
    return absl::OkStatus();
  }
};

}  // namespace ctxpool

#endif  // CTXPOOL_SRC_DRIVER_SIM_DRIVER_STATE_H_
