// tools/server_modes.h — a multi-model server replayed two ways on one
// device, shared by `ctxpool demo` and `ctxpool plan`.
//
//   today    per model: its own context (cuCtxCreate, created at its first
//            load and kept, as a framework instance per model keeps its
//            own), its own streams and its own CachingDeviceAllocator
//            (classic backing, PyTorch's default); nothing is trimmed, so an
//            unloaded model's cache stays reserved (as PyTorch keeps its
//            cache unless empty_cache() is called) and one model's cache
//            cannot serve another.
//   ctxpool  one primary context (a DeviceContext), a ModelSession per loaded
//            model with the budget LoadSpec gives, one shared allocator;
//            unloading closes the session and trims.
//
// RunMode replays one multi-tenant trace (tenant = model instance, stream =
// the index of the stream within that model's session) on a Mode:
//   * a tenant is loaded at its first allocation;
//   * with RunOptions::unload_when_empty (the demo) it is unloaded when its
//     last live allocation is freed; without it (the planner), a kTrim event
//     of the tenant unloads it: what it still holds is freed, then Unload;
//   * an allocation that fails with RESOURCE_EXHAUSTED (device, limit or
//     budget) is counted and replay goes on; any other error stops the run.
// Every figure is measured in the run.
//
// Thread-safety: none; one mode is driven by one thread.
#ifndef CTXPOOL_TOOLS_SERVER_MODES_H_
#define CTXPOOL_TOOLS_SERVER_MODES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/telemetry/svg.h"
#include "ctxpool/trace/trace.h"

namespace ctxpool::tool {

// How a tenant is loaded.
struct LoadSpec {
  std::string name;
  int streams = 1;
  // ctxpool mode: the session's budget (its streams, priority ignored).
  SessionOptions session;
};

struct Sample {
  std::size_t event = 0;
  std::uint64_t live = 0;      // the trace's live bytes (requested)
  std::uint64_t reserved = 0;  // allocators' reserved bytes
  double external = 0;         // 1 − largest free / free, all caches
  // With RunOptions::per_tenant_samples: each loaded tenant's physical bytes
  // (today: its allocator's; ctxpool: its session's mapped bytes).
  std::vector<std::pair<std::uint32_t, std::uint64_t>> tenants;
  std::uint64_t device = 0;  // Mode::DeviceBytes()
};

// What one tenant did, summed over its loads.
struct TenantResult {
  std::int64_t allocs = 0;
  std::int64_t failed = 0;             // RESOURCE_EXHAUSTED of any kind
  std::int64_t budget_rejections = 0;  // ctxpool: over the session's max
  std::uint64_t peak_charged = 0;      // ctxpool: session peak_bytes
  std::uint64_t peak_mapped = 0;       // at the samples taken
};

struct ModeResult {
  std::string mode;
  std::string description;
  int contexts = 0;
  std::uint64_t context_bytes = 0;
  std::uint64_t peak_reserved = 0;
  // The most bytes the trace had live at once, all tenants (requested).
  std::uint64_t peak_live = 0;
  // The most device memory the mode held at once: contexts, segments or
  // mapped granules, and cached granules (DeviceBytes after each event).
  std::uint64_t peak_device = 0;
  std::size_t peak_device_event = 0;
  std::uint64_t reserved_after_unload = 0;
  std::int64_t ooms = 0;
  std::int64_t budget_rejections = 0;
  std::int64_t trims = 0;
  std::int64_t loads = 0;
  std::int64_t failed_loads = 0;  // no context / session could be created
  std::int64_t upstream_allocs = 0;
  double mean_fragmentation = 0;
  double max_fragmentation = 0;
  struct Oom {
    std::size_t event = 0;
    std::uint32_t tenant = 0;
    std::uint64_t bytes = 0;
    std::string message;
  };
  std::optional<Oom> first_oom;
  // RunOptions::stop_at_first_failure or max_ooms ended the replay early:
  // the counts cover the events up to there only.
  bool stopped_early = false;
  absl::flat_hash_map<std::uint32_t, TenantResult> tenants;
  std::vector<Sample> samples;
  MemoryMapPanel panel;
};

// What a mode does with the trace's events.
class Mode {
 public:
  virtual ~Mode() = default;
  virtual absl::Status Load(std::uint32_t tenant, const LoadSpec& spec) = 0;
  virtual absl::StatusOr<DevicePtr> Allocate(std::uint32_t tenant, int stream,
                                             std::uint64_t bytes) = 0;
  virtual absl::Status Free(std::uint32_t tenant, DevicePtr ptr) = 0;
  virtual absl::Status Unload(std::uint32_t tenant) = 0;
  // Reserved bytes, cached free bytes and the largest free block.
  struct Memory {
    std::uint64_t reserved = 0;
    std::uint64_t free = 0;
    std::uint64_t largest_free = 0;
  };
  virtual Memory Measure() const = 0;
  // Device memory held now (contexts included). Cheap: called after every
  // event.
  virtual std::uint64_t DeviceBytes() const = 0;
  // Physical bytes of each loaded tenant.
  virtual void MeasureTenants(
      std::vector<std::pair<std::uint32_t, std::uint64_t>>* out) const = 0;
  virtual MemoryMapPanel Snapshot() const = 0;
  // Fills contexts, context bytes, trims, budget rejections, upstream, and
  // the tenants' budget figures.
  virtual void Finish(ModeResult* r) const = 0;
};

class TodayMode final : public Mode {
 public:
  explicit TodayMode(Driver& driver) : driver_(driver) {}
  ~TodayMode() override;
  absl::Status Load(std::uint32_t tenant, const LoadSpec& spec) override;
  absl::StatusOr<DevicePtr> Allocate(std::uint32_t tenant, int stream,
                                     std::uint64_t bytes) override;
  absl::Status Free(std::uint32_t tenant, DevicePtr ptr) override;
  // The framework instance stays: its context and cache are kept.
  absl::Status Unload(std::uint32_t) override { return absl::OkStatus(); }
  Memory Measure() const override;
  std::uint64_t DeviceBytes() const override {
    return context_bytes_ + physical_sum_;
  }
  void MeasureTenants(
      std::vector<std::pair<std::uint32_t, std::uint64_t>>* out) const override;
  MemoryMapPanel Snapshot() const override;
  void Finish(ModeResult* r) const override;

 private:
  struct PerModel {
    std::string name;
    ContextHandle context;
    std::vector<StreamHandle> streams;
    std::unique_ptr<CachingDeviceAllocator> allocator;
    std::uint64_t physical = 0;  // allocator->PhysicalBytes(), kept current
  };
  void Refresh(PerModel& m);
  // Destroys a model's streams (in its context) and its context.
  void DestroyContext(ContextHandle context,
                      const std::vector<StreamHandle>& streams);
  std::vector<std::pair<std::uint32_t, const PerModel*>> SortedModels() const;

  Driver& driver_;
  absl::flat_hash_map<std::uint32_t, PerModel> models_;
  std::uint64_t context_bytes_ = 0;
  std::uint64_t physical_sum_ = 0;
};

class CtxpoolMode final : public Mode {
 public:
  explicit CtxpoolMode(DeviceContext& device) : device_(device) {}
  ~CtxpoolMode() override;
  absl::Status Load(std::uint32_t tenant, const LoadSpec& spec) override;
  absl::StatusOr<DevicePtr> Allocate(std::uint32_t tenant, int stream,
                                     std::uint64_t bytes) override;
  absl::Status Free(std::uint32_t tenant, DevicePtr ptr) override;
  absl::Status Unload(std::uint32_t tenant) override;
  Memory Measure() const override;
  std::uint64_t DeviceBytes() const override;
  void MeasureTenants(
      std::vector<std::pair<std::uint32_t, std::uint64_t>>* out) const override;
  MemoryMapPanel Snapshot() const override;
  void Finish(ModeResult* r) const override;

 private:
  void Account(std::uint32_t tenant, const SessionStats& s);

  DeviceContext& device_;
  absl::flat_hash_map<std::uint32_t, std::unique_ptr<ModelSession>> sessions_;
  // Budget figures of closed sessions, per tenant.
  absl::flat_hash_map<std::uint32_t, TenantResult> closed_;
  std::int64_t budget_rejections_ = 0;
};

struct RunOptions {
  std::string label;
  // The LoadSpec of a tenant (called at each load).
  std::function<LoadSpec(std::uint32_t tenant)> spec;
  bool unload_when_empty = true;
  // The event whose state the memory map panel shows (none: no panel).
  std::optional<std::size_t> snapshot_event;
  std::size_t max_samples = 300;
  bool fragmentation_samples = true;
  bool per_tenant_samples = false;
  // Stop at the first failed allocation or load (a search needs only "fits
  // or not"; a plan far over the device would otherwise fail every event).
  bool stop_at_first_failure = false;
  // Stop once this many allocations failed (0: never): a plan far over the
  // device would spend its time counting failures. The count is then a
  // lower bound (stopped_early).
  std::int64_t max_ooms = 0;
  std::function<void(std::size_t, std::size_t)> progress;
};

absl::StatusOr<ModeResult> RunMode(Mode& mode, const Trace& trace,
                                   const RunOptions& options);

// Per tenant: the most bytes it had live at once (requested sizes).
absl::flat_hash_map<std::uint32_t, std::uint64_t> TenantPeaks(
    const Trace& trace);

}  // namespace ctxpool::tool

#endif  // CTXPOOL_TOOLS_SERVER_MODES_H_
