// libctxpool_torch.so: the C ABI of ctxpool_torch.h over ctxpool's
// DeviceContext / ModelSession / CachingDeviceAllocator.
//
// Layout: `Globals` (a mutex, the last error, the state pointer) is replaced
// wholesale in a forked child by the atfork handler, so no lock a parent
// thread held at fork() is ever taken in the child. `PluginState` owns the
// driver, the lazily opened DeviceContexts and one ModelSession per (device,
// model).
//
// The cached path takes no lock of the plugin's. ctxpool_malloc finds the
// calling thread's session in a thread-local cache (filled under
// PluginState::mu_ on a miss: first use, a new model, a new state) and
// calls the session's inline front end, i.e. one owned Allocate of the
// device allocator. ctxpool_free needs no session: the block carries its
// owner (the session that allocated it, whatever thread frees it) and its
// requested size, so one owned Deallocate of the device's allocator checks
// and frees it (FreeCheck). Only failures, tracing (CTXPOOL_TRACE) and the
// cold paths take PluginState::mu_.
//
// Lock order: Globals::mu -> PluginState::mu_ -> ModelSession's lock ->
// the device allocator's locks (its global lock, then its shards').

#include "ctxpool_torch.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"
#include "ctxpool/telemetry/json.h"
#include "ctxpool/trace/recorder.h"
#include "ctxpool/trace/trace_io.h"

namespace ctxpool {
namespace torch_plugin {
namespace {

constexpr absl::string_view kDefaultModel = "default";
constexpr std::size_t kMaxModelName = 255;

// The calling thread's current model. Empty means kDefaultModel.
thread_local std::string tls_model;

absl::string_view CurrentModel() {
  return tls_model.empty() ? kDefaultModel : absl::string_view(tls_model);
}

class PluginState;

// The calling thread's sessions of its current model, by device, valid for
// the state of generation `generation` (0: empty). Plain data with
// initial-exec TLS, so reading it is a couple of instructions even though
// the library is dlopened (glibc keeps static TLS room for that).
constexpr int kCachedDevices = 16;
struct SessionCache {
  std::uint64_t generation = 0;
  ModelSession* by_device[kCachedDevices] = {};
};
__attribute__((
    tls_model("initial-exec"))) thread_local SessionCache tls_sessions;
// Bumped for every state created, so no cache survives its state.
std::atomic<std::uint64_t> g_state_generation{0};
// Buffers behind the const char* results (see ctxpool_torch.h).
thread_local std::string tls_result;

// Loads the driver the plugin uses; `note` says which and why.
absl::StatusOr<std::unique_ptr<Driver>> LoadDriver(std::string& note) {
  std::string spec = "cuda";
  if (IsOptionOverridden(OptionId::kDriver)) {
    spec = absl::AsciiStrToLower(
        absl::StripAsciiWhitespace(GetOption(OptionId::kDriver)));
  }
  if (absl::StartsWith(spec, "sim")) {
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SimDriver> sim,
                             SimDriver::CreateFromSpec(spec));
    note = absl::StrCat("driver: sim (", sim->Describe(),
                        "); CTXPOOL_DRIVER=", spec,
                        ": simulated addresses, not for real tensors");
    return std::unique_ptr<Driver>(std::move(sim));
  }
  if (spec != "cuda" && spec != "auto" && !spec.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ctxpool_torch: CTXPOOL_DRIVER='", spec,
        "' is not 'cuda', 'auto' (same as 'cuda' here) or a SimDriver spec "
        "('sim', 'sim:h100-80gb', 'sim:2xa10-24gb')"));
  }
  absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
  if (!cuda.ok()) {
    return absl::Status(
        cuda.status().code(),
        absl::StrCat("ctxpool_torch: cannot load the CUDA driver: ",
                     cuda.status().message()));
  }
  note = absl::StrCat("driver: cuda (", (*cuda)->Describe(), ")");
  return std::move(cuda).value();
}

struct SessionKey {
  int device;
  std::string model;
  friend bool operator<(const SessionKey& a, const SessionKey& b) {
    return std::tie(a.device, a.model) < std::tie(b.device, b.model);
  }
};

class PluginState {
 public:
  static absl::StatusOr<std::unique_ptr<PluginState>> Create() {
    std::string note;
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Driver> driver, LoadDriver(note));
    CTXPOOL_ASSIGN_OR_RETURN(int count, driver->DeviceCount());
    if (count <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ctxpool_torch: the ", driver->Kind(), " driver reports no device"));
    }
    std::unique_ptr<PluginState> s(
        new PluginState(std::move(driver), std::move(note), count));
    CTXPOOL_ASSIGN_OR_RETURN(bool trace, GetOptionBool(OptionId::kTrace));
    if (trace) {
      CTXPOOL_ASSIGN_OR_RETURN(std::int64_t capacity,
                               GetOptionInt(OptionId::kTraceCapacity));
      s->recorder_.Enable(
          static_cast<std::size_t>(capacity > 0 ? capacity : 1 << 16));
    }
    return s;
  }

  // Sessions first, then the contexts, then the driver. In a forked child
  // the whole state is leaked instead (see OnForkChild), never destroyed.
  ~PluginState() {
    absl::MutexLock lock(&mu_);
    sessions_.clear();
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      open_[d].store(nullptr, std::memory_order_relaxed);
      devices_[d].reset();
    }
  }

  // The thread's cached session of its model on `device`, or null (none
  // yet, another state's, or a device beyond the cache). No lock.
  ABSL_ATTRIBUTE_ALWAYS_INLINE ModelSession* CachedSession(int device) const {
    const SessionCache& cache = tls_sessions;
    if (ABSL_PREDICT_TRUE(cache.generation == generation_ &&
                          static_cast<unsigned>(device) < kCachedDevices)) {
      return cache.by_device[device];
    }
    return nullptr;
  }

  // True while the trace recorder records (every call then takes the
  // general path, which records it).
  bool tracing() const { return recorder_.enabled(); }

  // The opened DeviceContext of `device`, or null; no lock.
  ABSL_ATTRIBUTE_ALWAYS_INLINE DeviceContext* OpenDevice(int device) const {
    if (ABSL_PREDICT_FALSE(static_cast<std::size_t>(device) >=
                           device_count())) {
      return nullptr;  // negative devices wrap to huge
    }
    return open_[device].load(std::memory_order_acquire);
  }

  // The general path of an allocation (the hot one is MallocEntry below):
  // the thread's session (opened on first use), one owned Allocate, the
  // trace. Null with *error set on failure.
  void* Malloc(std::size_t size, int device, StreamHandle stream,
               absl::Status* error) ABSL_LOCKS_EXCLUDED(mu_) {
    ModelSession* session = CachedSession(device);
    if (ABSL_PREDICT_FALSE(session == nullptr)) {
      absl::StatusOr<ModelSession*> found = CacheSession(device);
      if (!found.ok()) {
        *error = found.status();
        return nullptr;
      }
      session = *found;
    }
    // The trace's model id first: it may take host memory, and a
    // std::bad_alloc after the Allocate would lose the block.
    const std::uint32_t model_id =
        ABSL_PREDICT_FALSE(recorder_.enabled()) ? ModelId(*session) : 0;
    absl::StatusOr<DevicePtr> p = session->Allocate(size, stream);
    if (ABSL_PREDICT_FALSE(!p.ok())) {
      *error = MallocFailed(*session, size, stream, p.status());
      return nullptr;
    }
    if (ABSL_PREDICT_FALSE(recorder_.enabled())) {
      recorder_.Record(TraceOp::kAlloc, p->address(), size, stream.value(),
                       model_id);
    }
    return p->get();
  }

  // The general path of a free (the hot one is FreeEntry below): one owned
  // Deallocate that checks the size, and the trace.
  absl::Status Free(void* ptr, std::size_t size, int device,
                    StreamHandle stream) ABSL_LOCKS_EXCLUDED(mu_) {
    const DevicePtr p = DevicePtr::From(ptr);
    DeviceContext* dc = OpenDevice(device);
    if (ABSL_PREDICT_FALSE(dc == nullptr)) return FreeFailed(ptr, size, device);
    std::uint32_t model_id = 0;
    if (ABSL_PREDICT_FALSE(recorder_.enabled())) {
      absl::StatusOr<BlockInfo> b = dc->device_allocator().Lookup(p);
      if (b.ok()) model_id = ModelIdOfOwner(device, b->owner);
    }
    absl::Status s = dc->device_allocator().Deallocate(p, FreeOf(size));
    if (ABSL_PREDICT_FALSE(!s.ok())) return FreeRefused(ptr, size, device, s);
    if (ABSL_PREDICT_FALSE(recorder_.enabled())) {
      recorder_.Record(TraceOp::kFree, p.address(), size, stream.value(),
                       model_id);
    }
    return absl::OkStatus();
  }

  // What a free of `size` bytes checks: a live block of some session (any
  // thread may free it), allocated with that size.
  static FreeCheck FreeOf(std::size_t size) {
    return FreeCheck{.owner = kAnyOwner,
                     .check_size = true,
                     .requested_bytes = size,
                     .owned_only = true};
  }

  // The failure ends of the hot paths, out of line so that those stay
  // small: an owned Allocate that failed; a Deallocate that refused.
  ABSL_ATTRIBUTE_NOINLINE absl::Status MallocFailed(ModelSession& session,
                                                    std::size_t size,
                                                    StreamHandle stream,
                                                    const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kOom, 0, size, stream.value(),
                       ModelId(session));
    }
    // More than the whole device is out of memory to PyTorch (as
    // cudaMalloc and its own allocator say), not a bad argument.
    if (status.code() == absl::StatusCode::kInvalidArgument &&
        size > session.device().device_allocator().device_total_bytes()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of memory: ", status.message()));
    }
    return status;
  }
  ABSL_ATTRIBUTE_NOINLINE absl::Status FreeRefused(void* ptr, std::size_t size,
                                                   int device,
                                                   const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (!absl::IsInvalidArgument(status)) return status;
    return FreeFailed(ptr, size, device);
  }

  absl::Status RecordStream(void* ptr, StreamHandle stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const DevicePtr p = DevicePtr::From(ptr);
    if (std::optional<LiveOn> live = FindLive(p)) {
      return live->device->device_allocator().RecordStream(p, stream,
                                                           live->block.owner);
    }
    return absl::InvalidArgumentError(core_internal::Format(
        "ctxpool_record_stream(%p): not a live allocation of ctxpool", ptr));
  }

  absl::StatusOr<std::int64_t> EmptyCache() ABSL_LOCKS_EXCLUDED(mu_) {
    std::int64_t freed = 0;
    for (DeviceContext* dc : OpenDevices()) {
      CTXPOOL_ASSIGN_OR_RETURN(TrimResult r, dc->device_allocator().Trim(0));
      freed += static_cast<std::int64_t>(r.freed_bytes);
    }
    return freed;
  }

  absl::Status SetBudget(absl::string_view model, std::size_t max_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, session] : sessions_) {
      if (key.model == model) {
        return absl::FailedPreconditionError(
            absl::StrCat("ctxpool_set_model_budget: model '", model,
                         "' already has a session on device ", key.device,
                         "; set its budget before its first allocation"));
      }
    }
    if (auto it = budgets_.find(model); it != budgets_.end()) {
      it->second = max_bytes;
    } else {
      budgets_.emplace(std::string(model), max_bytes);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<StreamHandle> ModelStream(int device, absl::string_view model,
                                           int i) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    CTXPOOL_ASSIGN_OR_RETURN(ModelSession * session,
                             SessionLocked(device, model));
    if (i < 0 || static_cast<std::size_t>(i) >= session->streams().size()) {
      return absl::OutOfRangeError(absl::StrCat(
          "ctxpool_model_stream: model '", model, "' has ",
          session->streams().size(), " stream(s) on device ", device,
          " (CTXPOOL_SESSION_STREAMS); asked for index ", i));
    }
    return session->stream(i);
  }

  absl::StatusOr<std::string> MemoryStats(int device) ABSL_LOCKS_EXCLUDED(mu_);

  std::string SnapshotJson() ABSL_LOCKS_EXCLUDED(mu_) {
    std::string out = "{\"devices\":[";
    bool first = true;
    for (DeviceContext* dc : OpenDevices()) {
      // RenderJsonSnapshot(device) is {"devices":[{...}]}: keep the object.
      std::string one = RenderJsonSnapshot(*dc);
      constexpr absl::string_view kPrefix = "{\"devices\":[";
      if (!absl::StartsWith(one, kPrefix) || !absl::EndsWith(one, "]}")) {
        continue;
      }
      absl::string_view body(one);
      body.remove_prefix(kPrefix.size());
      body.remove_suffix(2);
      if (body.empty()) continue;
      if (!first) out += ",";
      first = false;
      absl::StrAppend(&out, body);
    }
    absl::StrAppend(&out, "]}");
    return out;
  }

  absl::Status WriteTrace(const std::string& path) {
    if (!recorder_.enabled() && recorder_.recorded() == 0) {
      return absl::FailedPreconditionError(
          "ctxpool_write_trace: tracing is off; set CTXPOOL_TRACE=1 before "
          "the first allocation");
    }
    return WriteFile(path, WriteTraceCsv(recorder_.Snapshot()));
  }

  std::string Info() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::string opened;
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      if (devices_[d] == nullptr) continue;
      absl::StrAppend(&opened, opened.empty() ? "" : ",", d);
    }
    return absl::StrCat(
        "{\"driver\":", JsonString(driver_->Kind()),
        ",\"note\":", JsonString(note_), ",\"pid\":", pid_,
        ",\"device_count\":", devices_.size(), ",\"opened_devices\":[", opened,
        "],\"sessions\":", sessions_.size(),
        ",\"live_allocations\":", LiveAllocationsLocked(-1),
        ",\"trace\":", recorder_.enabled() ? "true" : "false", "}");
  }

  // Closes every session. Refused with live allocations unless `force`.
  absl::Status PrepareShutdown(bool force) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const std::int64_t live = LiveAllocationsLocked(-1);
    if (live != 0 && !force) {
      return absl::FailedPreconditionError(
          absl::StrCat("ctxpool_shutdown: ", live,
                       " allocation(s) still live; free them or pass force=1"));
    }
    return absl::OkStatus();
  }

 private:
  PluginState(std::unique_ptr<Driver> driver, std::string note, int count)
      : driver_(std::move(driver)),
        note_(std::move(note)),
        pid_(getpid()),
        generation_(g_state_generation.fetch_add(1) + 1),
        open_(new std::atomic<DeviceContext*>[static_cast<std::size_t>(count)]),
        devices_size_(static_cast<std::size_t>(count)),
        devices_(static_cast<std::size_t>(count)) {
    for (int d = 0; d < count; ++d) open_[d].store(nullptr);
  }

  std::size_t device_count() const { return devices_size_; }

  // The miss of Malloc's cache: the session of the thread's model on
  // `device` (opened on first use), remembered for the thread.
  absl::StatusOr<ModelSession*> CacheSession(int device)
      ABSL_LOCKS_EXCLUDED(mu_) {
    ModelSession* session = nullptr;
    {
      absl::MutexLock lock(&mu_);
      CTXPOOL_ASSIGN_OR_RETURN(session, SessionLocked(device, CurrentModel()));
    }
    SessionCache& cache = tls_sessions;
    if (cache.generation != generation_) {
      cache = SessionCache{};
      cache.generation = generation_;
    }
    if (device < kCachedDevices) cache.by_device[device] = session;
    return session;
  }

  // The opened device on which `p` is a live block of one of the sessions.
  struct LiveOn {
    DeviceContext* device;
    BlockInfo block;
  };
  std::optional<LiveOn> FindLive(DevicePtr p) ABSL_LOCKS_EXCLUDED(mu_) {
    for (DeviceContext* dc : OpenDevices()) {
      absl::StatusOr<BlockInfo> b = dc->device_allocator().Lookup(p);
      if (b.ok() && b->owner != kNoOwner) return LiveOn{dc, *std::move(b)};
    }
    return std::nullopt;
  }

  // Why a free was refused (nothing was freed): a foreign pointer, a double
  // free, or a size or device that differs from the allocation's.
  absl::Status FreeFailed(void* ptr, std::size_t size, int device)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (std::optional<LiveOn> live = FindLive(DevicePtr::From(ptr))) {
      const int on = live->device->device();
      if (on != device) {
        // A device mismatch: counted as invalid by the allocator of
        // `device` when it is open (it was asked), here when it is not.
        absl::MutexLock lock(&mu_);
        if (OpenDevice(device) == nullptr) ++invalid_frees_;
        ++mismatched_frees_;
      }
      // (A size mismatch on the right device is counted by its allocator.)
      return absl::InvalidArgumentError(core_internal::Format(
          "ctxpool_free(%p, %u, device %d): the allocation was %u bytes on "
          "device %d; refused, the block stays allocated",
          ptr, size, device, live->block.requested_bytes, on));
    }
    if (OpenDevice(device) == nullptr) {
      absl::MutexLock lock(&mu_);
      ++invalid_frees_;  // no allocator of `device` saw it
    }
    return absl::InvalidArgumentError(core_internal::Format(
        "ctxpool_free(%p, %u, device %d): not a live allocation of ctxpool (a "
        "foreign pointer or a double free); nothing freed",
        ptr, size, device));
  }

  // The trace's model number of `session` / of an allocator owner.
  std::uint32_t ModelId(const ModelSession& session) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return ModelIdLocked(session.name());
  }
  std::uint32_t ModelIdOfOwner(int device, OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, session] : sessions_) {
      if (key.device == device && session->owner() == owner) {
        return ModelIdLocked(key.model);
      }
    }
    return 0;
  }

  // Live allocations of the sessions on `device` (-1: every device).
  std::int64_t LiveAllocationsLocked(int device) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::int64_t live = 0;
    for (const auto& [key, session] : sessions_) {
      if (device >= 0 && key.device != device) continue;
      absl::StatusOr<OwnerStats> o =
          session->device().device_allocator().GetOwnerStats(session->owner());
      if (o.ok()) live += o->live_allocations;
    }
    return live;
  }

  // The session of (device, model), opening the device and the session on
  // first use.
  absl::StatusOr<ModelSession*> SessionLocked(int device,
                                              absl::string_view model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (device < 0 || static_cast<std::size_t>(device) >= devices_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctxpool_torch: device ", device, " does not exist (",
                       devices_.size(), " device(s), ", note_, ")"));
    }
    SessionKey key{device, std::string(model)};
    auto it = sessions_.find(key);
    if (it != sessions_.end()) return it->second.get();
    std::unique_ptr<DeviceContext>& dc = devices_[device];
    if (dc == nullptr) {
      CTXPOOL_ASSIGN_OR_RETURN(dc, DeviceContext::Create(*driver_, device));
      open_[device].store(dc.get(), std::memory_order_release);
    }
    SessionOptions options;
    auto budget = budgets_.find(key.model);
    if (budget != budgets_.end()) options.max_bytes = budget->second;
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ModelSession> session,
                             dc->OpenSession(key.model, options));
    ModelSession* raw = session.get();
    sessions_.emplace(std::move(key), std::move(session));
    return raw;
  }

  std::uint32_t ModelIdLocked(absl::string_view model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = model_ids_.find(model); it != model_ids_.end()) {
      return it->second;
    }
    const auto id = static_cast<std::uint32_t>(model_ids_.size() + 1);
    model_ids_.emplace(std::string(model), id);
    return id;
  }

  // The opened DeviceContexts. They live as long as the state.
  std::vector<DeviceContext*> OpenDevices() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::vector<DeviceContext*> out;
    for (auto& d : devices_) {
      if (d != nullptr) out.push_back(d.get());
    }
    return out;
  }

  const std::unique_ptr<Driver> driver_;
  const std::string note_;
  const pid_t pid_;
  const std::uint64_t generation_;
  TraceRecorder recorder_;
  // devices_[d].get() once opened, for the lock-free paths.
  const std::unique_ptr<std::atomic<DeviceContext*>[]> open_;
  const std::size_t devices_size_;

  absl::Mutex mu_;
  // By ordinal; null until the device's first allocation.
  std::vector<std::unique_ptr<DeviceContext>> devices_ ABSL_GUARDED_BY(mu_);
  // Node maps: an insert that runs out of host memory leaves them as they
  // were (Abseil's flat tables are corrupted by a failed growth), and these
  // are off the hot path.
  std::map<SessionKey, std::unique_ptr<ModelSession>> sessions_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::size_t, std::less<>> budgets_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::uint32_t, std::less<>> model_ids_
      ABSL_GUARDED_BY(mu_);
  // Frees no device allocator saw (a device never opened, or the wrong
  // device); the allocators count the rest.
  std::int64_t invalid_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t mismatched_frees_ ABSL_GUARDED_BY(mu_) = 0;
};

void AppendStatArray(std::string& out, absl::string_view name,
                     const StatArray& a) {
  static constexpr absl::string_view kPools[] = {"all", "small_pool",
                                                 "large_pool"};
  for (int i = 0; i < 3; ++i) {
    const Stat& s = a[i];
    absl::StrAppend(&out, ",\"", name, ".", kPools[i], ".current\":", s.current,
                    ",\"", name, ".", kPools[i], ".peak\":", s.peak, ",\"",
                    name, ".", kPools[i], ".allocated\":", s.allocated, ",\"",
                    name, ".", kPools[i], ".freed\":", s.freed);
  }
}

absl::StatusOr<std::string> PluginState::MemoryStats(int device) {
  DeviceAllocatorStats stats;
  std::size_t max_split = 0;
  std::string models;
  std::int64_t invalid_frees = 0;
  std::int64_t mismatched_frees = 0;
  std::size_t live = 0;
  {
    absl::MutexLock lock(&mu_);
    if (device < 0 || static_cast<std::size_t>(device) >= devices_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctxpool_memory_stats: device ", device,
                       " does not exist (", devices_.size(), " device(s))"));
    }
    invalid_frees = invalid_frees_;
    mismatched_frees = mismatched_frees_;
    live = static_cast<std::size_t>(LiveAllocationsLocked(device));
    if (devices_[device] != nullptr) {
      const CachingDeviceAllocator& alloc =
          devices_[device]->device_allocator();
      stats = alloc.Stats();
      max_split = alloc.options().max_split_size;
    }
    for (const auto& [key, session] : sessions_) {
      if (key.device != device) continue;
      const SessionStats s = session->Stats();
      absl::StrAppend(
          &models, models.empty() ? "" : ",", JsonString(key.model),
          ":{\"live_bytes\":", s.live_bytes, ",\"peak_bytes\":", s.peak_bytes,
          ",\"requested_bytes\":", s.requested_bytes,
          ",\"live_allocations\":", s.live_allocations,
          ",\"num_allocs\":", s.num_allocs, ",\"num_frees\":", s.num_frees,
          ",\"num_ooms\":", s.num_ooms,
          ",\"num_budget_rejections\":", s.num_budget_rejections,
          ",\"mapped_bytes\":", s.mapped_bytes,
          ",\"cached_bytes\":", s.cached_bytes, ",\"min_bytes\":", s.min_bytes,
          ",\"high_bytes\":", s.high_bytes, ",\"max_bytes\":", s.max_bytes,
          ",\"streams\":", s.streams, "}");
    }
  }
  std::string out = absl::StrCat("{\"device\":", device);
  const PoolStats& t = stats.total;
  AppendStatArray(out, "allocation", t.allocation);
  AppendStatArray(out, "segment", t.segment);
  AppendStatArray(out, "active", t.active);
  AppendStatArray(out, "inactive_split", t.inactive_split);
  AppendStatArray(out, "allocated_bytes", t.allocated_bytes);
  AppendStatArray(out, "reserved_bytes", t.reserved_bytes);
  AppendStatArray(out, "active_bytes", t.active_bytes);
  AppendStatArray(out, "inactive_split_bytes", t.inactive_split_bytes);
  AppendStatArray(out, "requested_bytes", t.requested_bytes);
  // max_split_size: PyTorch reports -1 for "no limit".
  const std::int64_t max_split_json =
      max_split == 0 || max_split > (std::size_t{1} << 62)
          ? -1
          : static_cast<std::int64_t>(max_split);
  absl::StrAppend(
      &out, ",\"num_alloc_retries\":", stats.num_alloc_retries,
      ",\"num_ooms\":", stats.num_ooms,
      ",\"num_device_alloc\":", stats.upstream_allocs,
      ",\"num_device_free\":", stats.upstream_frees,
      ",\"num_sync_all_streams\":", stats.num_host_syncs,
      ",\"max_split_size\":", max_split_json,
      ",\"num_invalid_frees\":", invalid_frees + stats.invalid_frees,
      ",\"num_mismatched_frees\":", mismatched_frees + stats.mismatched_frees,
      ",\"num_cache_hits\":", stats.cache_hits,
      ",\"num_trims\":", stats.num_trims,
      ",\"num_stream_waits\":", stats.num_stream_waits,
      ",\"num_live_pointers\":", live, ",\"models\":{", models, "}}");
  return out;
}

// Process-wide globals; replaced (the old ones leaked) in a forked child.
struct Globals {
  absl::Mutex mu;
  // Written under `mu`; read without it on the hot path.
  std::atomic<PluginState*> state{nullptr};
  std::string last_error ABSL_GUARDED_BY(mu);
  // True in a child forked after the parent had created its state.
  bool forked_with_state ABSL_GUARDED_BY(mu) = false;
};

std::atomic<Globals*> g_globals{nullptr};

void OnForkChild() {
  // Single-threaded here. Leak the parent's globals and state: their locks
  // may be held by threads that do not exist in the child and their driver
  // state belongs to the parent.
  Globals* old = g_globals.load(std::memory_order_relaxed);
  auto* fresh = new Globals;
  if (old != nullptr && old->state.load(std::memory_order_relaxed) != nullptr) {
    absl::MutexLock lock(&fresh->mu);  // new, so never contended
    fresh->forked_with_state = true;
  }
  g_globals.store(fresh, std::memory_order_release);
}

Globals& GetGlobals() {
  Globals* g = g_globals.load(std::memory_order_acquire);
  if (ABSL_PREDICT_TRUE(g != nullptr)) return *g;
  static const bool registered = [] {
    auto* fresh = new Globals;
    Globals* expected = nullptr;
    if (!g_globals.compare_exchange_strong(expected, fresh)) delete fresh;
    pthread_atfork(nullptr, nullptr, &OnForkChild);
    return true;
  }();
  (void)registered;
  return *g_globals.load(std::memory_order_acquire);
}

// The last failure when it was host memory running out (std::bad_alloc) in
// a C function: a literal, so noting it needs no memory. A later SetError
// replaces it.
std::atomic<const char*> g_host_oom{nullptr};

void SetError(const absl::Status& status) {
  Globals& g = GetGlobals();
  absl::MutexLock lock(&g.mu);
  g.last_error = std::string(status.message());
  if (g.last_error.empty()) g.last_error = status.ToString();
  g_host_oom.store(nullptr, std::memory_order_release);
}

// Runs the body of a C function: a std::bad_alloc (host memory ran out)
// becomes `failed`, with `text` as the last error. No exception crosses
// a C frame (a ctypes caller) or a noexcept one (PyTorch's deleters).
template <typename R, typename F>
R NoHostOomEscapes(const char* text, R failed, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    g_host_oom.store(text, std::memory_order_release);
    return failed;
  }
}

// The state when it exists (the hot paths' two loads), else null.
inline PluginState* ExistingState() {
  Globals* g = g_globals.load(std::memory_order_acquire);
  return ABSL_PREDICT_TRUE(g != nullptr)
             ? g->state.load(std::memory_order_acquire)
             : nullptr;
}

// The state, created on first use. Failures are returned (and not cached: the
// next call tries again).
absl::StatusOr<PluginState*> GetState() {
  if (PluginState* s = ExistingState(); ABSL_PREDICT_TRUE(s != nullptr)) {
    return s;
  }
  Globals& g = GetGlobals();
  PluginState* s = nullptr;
  absl::MutexLock lock(&g.mu);
  s = g.state.load(std::memory_order_relaxed);
  if (s != nullptr) return s;
  absl::StatusOr<std::unique_ptr<PluginState>> created = PluginState::Create();
  if (!created.ok()) {
    if (g.forked_with_state) {
      return absl::Status(
          created.status().code(),
          absl::StrCat(created.status().message(),
                       " (this process was forked from one that had already "
                       "used ctxpool: a CUDA context does not survive fork(); "
                       "initialise CUDA and ctxpool only in the workers, "
                       "e.g. in gunicorn's post_fork hook)"));
    }
    return created.status();
  }
  s = created->release();
  g.state.store(s, std::memory_order_release);
  return s;
}

const char* Result(std::string text) {
  tls_result = std::move(text);
  return tls_result.c_str();
}

// The usual body of a C function: `body` on the state (made on first use).
// A state that cannot be made, or a body that fails (an absl::Status or
// absl::StatusOr<R>), sets the last error and gives `failed`; a body's
// absl::Status that is OK gives R{} (0, success).
template <typename R, typename F>
R WithState(R failed, F&& body) {
  absl::StatusOr<PluginState*> s = GetState();
  if (!s.ok()) {
    SetError(s.status());
    return failed;
  }
  auto r = body(**s);
  if constexpr (std::is_same_v<decltype(r), absl::Status>) {
    if (!r.ok()) {
      SetError(r);
      return failed;
    }
    return R{};
  } else {
    if (!r.ok()) {
      SetError(r.status());
      return failed;
    }
    return *std::move(r);
  }
}

// The general path of an allocation: the state made on first use, then
// PluginState::Malloc. Null with *error set on failure.
ABSL_ATTRIBUTE_NOINLINE void* Malloc(size_t size, int device,
                                     cudaStream_t stream, absl::Status* error) {
  absl::StatusOr<PluginState*> s = GetState();
  if (!s.ok()) {
    *error = s.status();
    return nullptr;
  }
  return (*s)->Malloc(size, device, StreamHandle::From(stream), error);
}

// The hot paths are inline and small: the state, the thread's cached
// session and one owned Allocate (or the open device and one Deallocate),
// with no absl::Status of their own on success. Anything else (first use,
// a session not cached yet, the trace recorder on, a failure) goes out of
// line, to functions that also set the last error (and throw, for
// ctxpool_malloc).
[[noreturn]] void ThrowFor(const absl::Status& status);

template <bool kThrow>
ABSL_ATTRIBUTE_NOINLINE void* MallocError(const absl::Status& error) {
  SetError(error);
  if constexpr (kThrow) ThrowFor(error);
  return nullptr;
}

template <bool kThrow>
ABSL_ATTRIBUTE_NOINLINE void* AllocateFailed(PluginState& s,
                                             ModelSession& session,
                                             std::size_t size,
                                             StreamHandle stream,
                                             const absl::Status& status) {
  return MallocError<kThrow>(s.MallocFailed(session, size, stream, status));
}

template <bool kThrow>
ABSL_ATTRIBUTE_NOINLINE void* MallocSlow(size_t size, int device,
                                         cudaStream_t stream) {
  absl::Status error;
  void* p = Malloc(size, device, stream, &error);
  if (p != nullptr) return p;
  return MallocError<kThrow>(error);
}

template <bool kThrow>
ABSL_ATTRIBUTE_ALWAYS_INLINE inline void* MallocEntry(size_t size, int device,
                                                      cudaStream_t stream) {
  if (PluginState* s = ExistingState(); ABSL_PREDICT_TRUE(s != nullptr)) {
    ModelSession* session = s->CachedSession(device);
    if (ABSL_PREDICT_TRUE(session != nullptr) &&
        ABSL_PREDICT_TRUE(!s->tracing())) {
      const StreamHandle st = StreamHandle::From(stream);
      absl::StatusOr<DevicePtr> p = session->Allocate(size, st);
      if (ABSL_PREDICT_TRUE(p.ok())) return p->get();
      return AllocateFailed<kThrow>(*s, *session, size, st, p.status());
    }
  }
  return MallocSlow<kThrow>(size, device, stream);
}

// A refused free: the error named, the last error set.
ABSL_ATTRIBUTE_NOINLINE void FreeRefused(PluginState& s, void* ptr, size_t size,
                                         int device,
                                         const absl::Status& status) {
  SetError(s.FreeRefused(ptr, size, device, status));
}

// The general path of a free: the state made on first use, then
// PluginState::Free.
ABSL_ATTRIBUTE_NOINLINE void FreeSlow(void* ptr, size_t size, int device,
                                      cudaStream_t stream) {
  absl::StatusOr<PluginState*> s = GetState();
  if (!s.ok()) {
    SetError(s.status());
    return;
  }
  absl::Status st = (*s)->Free(ptr, size, device, StreamHandle::From(stream));
  if (!st.ok()) SetError(st);
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void FreeEntry(void* ptr, size_t size,
                                                   int device,
                                                   cudaStream_t stream) {
  if (PluginState* s = ExistingState(); ABSL_PREDICT_TRUE(s != nullptr)) {
    DeviceContext* dc = s->OpenDevice(device);
    if (ABSL_PREDICT_TRUE(dc != nullptr) && ABSL_PREDICT_TRUE(!s->tracing())) {
      absl::Status st = dc->device_allocator().Deallocate(
          DevicePtr::From(ptr), PluginState::FreeOf(size));
      if (ABSL_PREDICT_TRUE(st.ok())) return;
      return FreeRefused(*s, ptr, size, device, st);
    }
  }
  FreeSlow(ptr, size, device, stream);
}

// What ctxpool_malloc throws when memory ran out: PyTorch's own allocator
// throws too (c10::OutOfMemoryError, which derives from std::exception), so
// every caller PyTorch has is ready for an exception here.
class OutOfMemory final : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

[[noreturn]] void ThrowFor(const absl::Status& status) {
  std::string text = absl::StrCat("ctxpool: ", status.message());
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    throw OutOfMemory(std::move(text));
  }
  throw std::runtime_error(text);
}

}  // namespace
}  // namespace torch_plugin
}  // namespace ctxpool

using ctxpool::StreamHandle;
using namespace ctxpool::torch_plugin;  // NOLINT: the C ABI below

extern "C" {

void* ctxpool_try_malloc(size_t size, int device, cudaStream_t stream) {
  return NoHostOomEscapes(
      "ctxpool_try_malloc: host memory ran out; nothing was allocated",
      static_cast<void*>(nullptr),
      [&] { return MallocEntry</*kThrow=*/false>(size, device, stream); });
}

void* ctxpool_malloc(size_t size, int device, cudaStream_t stream) {
  try {
    return MallocEntry</*kThrow=*/true>(size, device, stream);
  } catch (const OutOfMemory&) {
    throw;  // the device or the model's budget: its report is the error
  } catch (const std::bad_alloc&) {
    g_host_oom.store(
        "ctxpool_malloc: host memory ran out; nothing was allocated",
        std::memory_order_release);
    throw;
  }
}

void ctxpool_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  if (ptr == nullptr) return;
  NoHostOomEscapes(
      "ctxpool_free: host memory ran out; the block may still be live", 0, [&] {
        FreeEntry(ptr, size, device, stream);
        return 0;
      });
}

int64_t ctxpool_empty_cache(void) {
  return NoHostOomEscapes(
      "ctxpool_empty_cache: host memory ran out", std::int64_t{-1}, [] {
        return WithState(std::int64_t{-1},
                         [](PluginState& s) { return s.EmptyCache(); });
      });
}

const char* ctxpool_memory_stats(int device) {
  return NoHostOomEscapes(
      "ctxpool_memory_stats: host memory ran out",
      static_cast<const char*>(nullptr), [&] {
        return WithState(static_cast<const char*>(nullptr),
                         [&](PluginState& s) -> absl::StatusOr<const char*> {
                           CTXPOOL_ASSIGN_OR_RETURN(std::string json,
                                                    s.MemoryStats(device));
                           return Result(std::move(json));
                         });
      });
}

int ctxpool_record_stream(void* ptr, cudaStream_t stream) {
  return NoHostOomEscapes(
      "ctxpool_record_stream: host memory ran out", -1, [&] {
        return WithState(-1, [&](PluginState& s) {
          return s.RecordStream(ptr, StreamHandle::From(stream));
        });
      });
}

int ctxpool_set_model(const char* name) {
  return NoHostOomEscapes(
      "ctxpool_set_model: host memory ran out; the model is unchanged", -1,
      [&] {
        tls_sessions.generation = 0;  // the cached sessions are the old model's
        if (name == nullptr || name[0] == '\0' || kDefaultModel == name) {
          tls_model.clear();
          return 0;
        }
        const std::size_t n = std::strlen(name);
        if (n > kMaxModelName) {
          SetError(absl::InvalidArgumentError(
              absl::StrCat("ctxpool_set_model: the name is ", n,
                           " bytes; at most ", kMaxModelName)));
          return -1;
        }
        tls_model.assign(name, n);  // unchanged if it throws
        return 0;
      });
}

const char* ctxpool_get_model(void) {
  // The thread's own name (valid until its next ctxpool_set_model, which is
  // the only writer): no copy, so nothing to run out of.
  return tls_model.empty() ? "default" : tls_model.c_str();
}

int ctxpool_set_model_budget(const char* name, size_t max_bytes) {
  return NoHostOomEscapes(
      "ctxpool_set_model_budget: host memory ran out", -1, [&] {
        return WithState(-1, [&](PluginState& s) {
          return s.SetBudget(
              name == nullptr || name[0] == '\0' ? kDefaultModel : name,
              max_bytes);
        });
      });
}

cudaStream_t ctxpool_model_stream(int device, int i) {
  return NoHostOomEscapes(
      "ctxpool_model_stream: host memory ran out",
      static_cast<cudaStream_t>(nullptr), [&] {
        return WithState(static_cast<cudaStream_t>(nullptr),
                         [&](PluginState& s) -> absl::StatusOr<cudaStream_t> {
                           CTXPOOL_ASSIGN_OR_RETURN(
                               StreamHandle h,
                               s.ModelStream(device, CurrentModel(), i));
                           return h.as<cudaStream_t>();
                         });
      });
}

int ctxpool_snapshot(const char* path) {
  return NoHostOomEscapes("ctxpool_snapshot: host memory ran out", -1, [&] {
    if (path == nullptr) {
      SetError(absl::InvalidArgumentError("ctxpool_snapshot: null path"));
      return -1;
    }
    return WithState(-1, [&](PluginState& s) {
      return ctxpool::WriteFile(path, s.SnapshotJson());
    });
  });
}

int ctxpool_write_trace(const char* path) {
  return NoHostOomEscapes("ctxpool_write_trace: host memory ran out", -1, [&] {
    if (path == nullptr) {
      SetError(absl::InvalidArgumentError("ctxpool_write_trace: null path"));
      return -1;
    }
    return WithState(-1, [&](PluginState& s) { return s.WriteTrace(path); });
  });
}

const char* ctxpool_last_error(void) {
  if (const char* oom = g_host_oom.load(std::memory_order_acquire)) {
    return oom;
  }
  // Reading the error must not replace it: no note on failure here.
  try {
    Globals& g = GetGlobals();
    std::string copy;
    {
      absl::MutexLock lock(&g.mu);
      copy = g.last_error;
    }
    return Result(std::move(copy));
  } catch (const std::bad_alloc&) {
    return "ctxpool_last_error: host memory ran out while copying the last "
           "error";
  }
}

const char* ctxpool_info(void) {
  return NoHostOomEscapes(
      "ctxpool_info: host memory ran out", static_cast<const char*>(nullptr),
      [] {
        return WithState(static_cast<const char*>(nullptr),
                         [](PluginState& s) -> absl::StatusOr<const char*> {
                           return Result(s.Info());
                         });
      });
}

int ctxpool_shutdown(int force) {
  return NoHostOomEscapes(
      "ctxpool_shutdown: host memory ran out; the state is kept", -1, [&] {
        Globals& g = GetGlobals();
        absl::MutexLock lock(&g.mu);
        PluginState* s = g.state.load(std::memory_order_relaxed);
        if (s == nullptr) return 0;
        absl::Status st = s->PrepareShutdown(force != 0);
        if (!st.ok()) {
          g.last_error = std::string(st.message());
          g_host_oom.store(nullptr, std::memory_order_release);
          return -1;
        }
        g.state.store(nullptr, std::memory_order_release);
        delete s;
        return 0;
      });
}

}  // extern "C"
