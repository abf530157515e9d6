// The two ways of running a multi-model server (see server_modes.h).
#include "tools/server_modes.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ctxpool/status.h"

namespace ctxpool::tool {

// ---- today: a context and an allocator per model ---------------------------

TodayMode::~TodayMode() {
  for (auto& [tenant, m] : models_) {
    m.allocator.reset();
    DestroyContext(m.context, m.streams);
  }
}

void TodayMode::DestroyContext(ContextHandle context,
                               const std::vector<StreamHandle>& streams) {
  if (driver_.CtxPushCurrent(context).ok()) {
    for (StreamHandle s : streams) (void)driver_.StreamDestroy(s);
    (void)driver_.CtxPopCurrent();
  }
  (void)driver_.CtxDestroy(context);
}

absl::Status TodayMode::Load(std::uint32_t tenant, const LoadSpec& spec) {
  if (models_.contains(tenant)) return absl::OkStatus();  // cache kept
  PerModel m;
  m.name = spec.name;
  // The context's cost: free memory before and after cuCtxCreate.
  std::uint64_t before = 0;
  if (models_.empty()) {
    CTXPOOL_ASSIGN_OR_RETURN(before, driver_.DeviceTotalMem(0));
  } else {
    CTXPOOL_RETURN_IF_ERROR(
        driver_.CtxPushCurrent(models_.begin()->second.context));
    absl::StatusOr<MemInfo> info = driver_.MemGetInfo();
    (void)driver_.CtxPopCurrent();
    if (!info.ok()) return info.status();
    before = info->free_bytes;
  }
  CTXPOOL_ASSIGN_OR_RETURN(m.context, driver_.CtxCreate(0, 0));
  absl::StatusOr<MemInfo> after = driver_.MemGetInfo();
  absl::Status made = after.status();
  for (int i = 0; made.ok() && i < std::max(1, spec.streams); ++i) {
    absl::StatusOr<StreamHandle> stream =
        driver_.StreamCreate(kStreamNonBlocking, 0);
    if (stream.ok()) {
      m.streams.push_back(*stream);
    } else {
      made = stream.status();
    }
  }
  (void)driver_.CtxPopCurrent();
  if (!made.ok()) {
    DestroyContext(m.context, m.streams);
    return made;
  }
  context_bytes_ += before > after->free_bytes ? before - after->free_bytes : 0;
  DeviceAllocatorOptions options;
  options.context = m.context;
  absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> alloc =
      CachingDeviceAllocator::Create(driver_, 0, options);
  if (!alloc.ok()) {
    DestroyContext(m.context, m.streams);
    return alloc.status();
  }
  m.allocator = std::move(alloc).value();
  models_.emplace(tenant, std::move(m));
  return absl::OkStatus();
}

void TodayMode::Refresh(PerModel& m) {
  const std::uint64_t now = m.allocator->PhysicalBytes();
  physical_sum_ = physical_sum_ - m.physical + now;
  m.physical = now;
}

absl::StatusOr<DevicePtr> TodayMode::Allocate(std::uint32_t tenant, int stream,
                                              std::uint64_t bytes) {
  PerModel& m = models_.at(tenant);
  absl::StatusOr<DevicePtr> p = m.allocator->Allocate(
      bytes, m.streams[static_cast<std::size_t>(stream) % m.streams.size()]);
  Refresh(m);
  return p;
}

absl::Status TodayMode::Free(std::uint32_t tenant, DevicePtr ptr) {
  PerModel& m = models_.at(tenant);
  absl::Status s = m.allocator->Deallocate(ptr);
  Refresh(m);
  return s;
}

Mode::Memory TodayMode::Measure() const {
  Memory mem;
  for (const auto& [tenant, m] : models_) {
    const DeviceAllocatorStats s = m.allocator->Stats();
    const FragmentationStats f = m.allocator->Fragmentation();
    mem.reserved += static_cast<std::uint64_t>(
        s.total.reserved_bytes[StatIndex(StatPool::kAggregate)].current);
    mem.free += f.free_bytes;
    mem.largest_free =
        std::max<std::uint64_t>(mem.largest_free, f.largest_free_bytes);
  }
  return mem;
}

void TodayMode::MeasureTenants(
    std::vector<std::pair<std::uint32_t, std::uint64_t>>* out) const {
  for (const auto& [tenant, m] : SortedModels()) {
    out->emplace_back(tenant, m->physical);
  }
}

std::vector<std::pair<std::uint32_t, const TodayMode::PerModel*>>
TodayMode::SortedModels() const {
  std::vector<std::pair<std::uint32_t, const PerModel*>> v;
  for (const auto& [tenant, m] : models_) v.emplace_back(tenant, &m);
  std::sort(v.begin(), v.end());
  return v;
}

MemoryMapPanel TodayMode::Snapshot() const {
  MemoryMapPanel p;
  for (const auto& [tenant, m] : SortedModels()) {
    AllocatorSnapshot s = m->allocator->Snapshot();
    for (SegmentInfo& seg : s.segments) {
      p.snapshot.segments.push_back(std::move(seg));
    }
    for (StreamHandle stream : m->streams) {
      p.stream_models.emplace_back(stream, m->name);
    }
  }
  std::sort(p.snapshot.segments.begin(), p.snapshot.segments.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) {
              return a.base < b.base;
            });
  return p;
}

void TodayMode::Finish(ModeResult* r) const {
  r->contexts = static_cast<int>(models_.size());
  r->context_bytes = context_bytes_;
  for (const auto& [tenant, m] : models_) {
    const DeviceAllocatorStats s = m.allocator->Stats();
    r->trims += s.num_trims;
    r->upstream_allocs += s.upstream_allocs;
  }
}

// ---- ctxpool: one context, sessions, budgets, trim -------------------------

CtxpoolMode::~CtxpoolMode() {
  for (auto& [tenant, s] : sessions_) (void)s->Close();
}

absl::Status CtxpoolMode::Load(std::uint32_t tenant, const LoadSpec& spec) {
  if (sessions_.contains(tenant)) return absl::OkStatus();
  SessionOptions options = spec.session;
  options.streams = std::max(1, spec.streams);
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ModelSession> session,
                           device_.OpenSession(spec.name, options));
  sessions_.emplace(tenant, std::move(session));
  return absl::OkStatus();
}

absl::StatusOr<DevicePtr> CtxpoolMode::Allocate(std::uint32_t tenant,
                                                int stream,
                                                std::uint64_t bytes) {
  ModelSession& s = *sessions_.at(tenant);
  return s.Allocate(bytes,
                    s.stream(stream % static_cast<int>(s.streams().size())));
}

absl::Status CtxpoolMode::Free(std::uint32_t tenant, DevicePtr ptr) {
  return sessions_.at(tenant)->Deallocate(ptr);
}

void CtxpoolMode::Account(std::uint32_t tenant, const SessionStats& s) {
  TenantResult& t = closed_[tenant];
  t.budget_rejections += s.num_budget_rejections;
  t.peak_charged = std::max<std::uint64_t>(t.peak_charged, s.peak_bytes);
}

absl::Status CtxpoolMode::Unload(std::uint32_t tenant) {
  auto it = sessions_.find(tenant);
  if (it == sessions_.end()) return absl::OkStatus();
  const SessionStats stats = it->second->Stats();
  budget_rejections_ += stats.num_budget_rejections;
  Account(tenant, stats);
  absl::Status closed = it->second->Close();
  sessions_.erase(it);
  CTXPOOL_RETURN_IF_ERROR(closed);
  // Give the unloaded model's memory back to the device now.
  return device_.device_allocator().Trim(0).status();
}

Mode::Memory CtxpoolMode::Measure() const {
  const DeviceAllocatorStats s = device_.device_allocator().Stats();
  const FragmentationStats f = device_.device_allocator().Fragmentation();
  return {static_cast<std::uint64_t>(
              s.total.reserved_bytes[StatIndex(StatPool::kAggregate)].current),
          f.free_bytes, f.largest_free_bytes};
}

std::uint64_t CtxpoolMode::DeviceBytes() const {
  return device_.initial_context_report().context_bytes +
         device_.device_allocator().PhysicalBytes();
}

void CtxpoolMode::MeasureTenants(
    std::vector<std::pair<std::uint32_t, std::uint64_t>>* out) const {
  std::vector<std::uint32_t> tenants;
  for (const auto& [tenant, s] : sessions_) tenants.push_back(tenant);
  std::sort(tenants.begin(), tenants.end());
  for (std::uint32_t t : tenants) {
    out->emplace_back(t, sessions_.at(t)->Stats().mapped_bytes);
  }
}

MemoryMapPanel CtxpoolMode::Snapshot() const {
  MemoryMapPanel p;
  p.snapshot = device_.device_allocator().Snapshot();
  std::vector<std::uint32_t> tenants;
  for (const auto& [tenant, s] : sessions_) tenants.push_back(tenant);
  std::sort(tenants.begin(), tenants.end());
  for (std::uint32_t t : tenants) {
    const ModelSession& s = *sessions_.at(t);
    for (StreamHandle stream : s.streams()) {
      p.stream_models.emplace_back(stream, s.name());
    }
    for (const LiveAllocation& a : s.LiveAllocations()) {
      p.block_models.emplace_back(a.ptr, s.name());
    }
  }
  return p;
}

void CtxpoolMode::Finish(ModeResult* r) const {
  r->contexts = 1;
  r->context_bytes = device_.initial_context_report().context_bytes;
  const DeviceAllocatorStats s = device_.device_allocator().Stats();
  r->trims = s.num_trims;
  r->upstream_allocs = s.upstream_allocs;
  r->budget_rejections = budget_rejections_;
  for (const auto& [tenant, t] : closed_) {
    TenantResult& out = r->tenants[tenant];
    out.budget_rejections += t.budget_rejections;
    out.peak_charged = std::max(out.peak_charged, t.peak_charged);
  }
  for (const auto& [tenant, session] : sessions_) {
    const SessionStats st = session->Stats();
    r->budget_rejections += st.num_budget_rejections;
    TenantResult& out = r->tenants[tenant];
    out.budget_rejections += st.num_budget_rejections;
    out.peak_charged = std::max<std::uint64_t>(out.peak_charged, st.peak_bytes);
  }
}

// ---- The replay loop shared by both modes ----------------------------------

absl::flat_hash_map<std::uint32_t, std::uint64_t> TenantPeaks(
    const Trace& trace) {
  absl::flat_hash_map<std::uint32_t, std::uint64_t> peak;
  absl::flat_hash_map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t>
      live;
  absl::flat_hash_map<std::uint32_t, std::uint64_t> now;
  for (const TraceEvent& e : trace.events()) {
    if (e.op == TraceOp::kAlloc) {
      live[{e.tenant, e.ptr}] = e.size;
      std::uint64_t& t = now[e.tenant];
      t += e.size;
      peak[e.tenant] = std::max(peak[e.tenant], t);
    } else if (e.op == TraceOp::kFree) {
      auto it = live.find({e.tenant, e.ptr});
      if (it == live.end()) continue;
      now[e.tenant] -= it->second;
      live.erase(it);
    }
  }
  return peak;
}

absl::StatusOr<ModeResult> RunMode(Mode& mode, const Trace& trace,
                                   const RunOptions& options) {
  ModeResult r;
  r.mode = options.label;
  struct Live {
    std::uint64_t size = 0;
    DevicePtr ptr;  // null when the allocation failed
  };
  // Keyed by (tenant, pointer): replicas of one model reuse its pointers.
  absl::flat_hash_map<std::pair<std::uint32_t, std::uint64_t>, Live> live;
  absl::flat_hash_map<std::uint32_t, std::int64_t> tenant_count;
  absl::flat_hash_map<std::uint32_t, bool> loaded;
  std::uint64_t live_bytes = 0;
  const std::size_t n = trace.size();
  const std::size_t sample_every = std::max<std::size_t>(
      1, n / std::max<std::size_t>(1, options.max_samples));
  const std::size_t progress_every = std::max<std::size_t>(1000, n / 50);
  double frag_sum = 0;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> tenant_bytes;
  auto sample = [&](std::size_t i) {
    Sample s;
    s.event = i;
    s.live = live_bytes;
    s.device = mode.DeviceBytes();
    if (options.fragmentation_samples) {
      const Mode::Memory m = mode.Measure();
      s.reserved = m.reserved;
      s.external = m.free == 0 ? 0.0
                               : 1.0 - static_cast<double>(m.largest_free) /
                                           static_cast<double>(m.free);
      frag_sum += s.external;
      r.max_fragmentation = std::max(r.max_fragmentation, s.external);
    }
    if (options.per_tenant_samples) {
      mode.MeasureTenants(&s.tenants);
      for (const auto& [tenant, bytes] : s.tenants) {
        TenantResult& t = r.tenants[tenant];
        t.peak_mapped = std::max(t.peak_mapped, bytes);
      }
    }
    r.samples.push_back(std::move(s));
  };
  auto free_one = [&](std::uint32_t tenant, const Live& l) -> absl::Status {
    live_bytes -= l.size;
    if (!l.ptr.is_null()) CTXPOOL_RETURN_IF_ERROR(mode.Free(tenant, l.ptr));
    return absl::OkStatus();
  };
  for (std::size_t i = 0; i < n; ++i) {
    const TraceEvent& e = trace.events()[i];
    if (e.op == TraceOp::kAlloc) {
      if (tenant_count[e.tenant]++ == 0 && !loaded[e.tenant]) {
        ++r.loads;
        absl::Status s = mode.Load(e.tenant, options.spec(e.tenant));
        if (!s.ok() && s.code() != absl::StatusCode::kResourceExhausted) {
          return s;
        }
        // A model whose context or session cannot be created does not load:
        // each of its allocations counts as an OOM.
        if (!s.ok()) ++r.failed_loads;
        loaded[e.tenant] = s.ok();
        if (!s.ok() && !r.first_oom) {
          r.first_oom = ModeResult::Oom{
              i, e.tenant, e.size, absl::StrCat("load failed: ", s.message())};
        }
      }
      TenantResult& t = r.tenants[e.tenant];
      ++t.allocs;
      absl::StatusOr<DevicePtr> p =
          loaded[e.tenant]
              ? mode.Allocate(e.tenant, static_cast<int>(e.stream), e.size)
              : absl::StatusOr<DevicePtr>(
                    absl::ResourceExhaustedError("model not loaded"));
      if (!p.ok() &&
          p.status().code() != absl::StatusCode::kResourceExhausted) {
        return p.status();
      }
      if (!p.ok()) {
        ++r.ooms;
        ++t.failed;
        if (!r.first_oom) {
          r.first_oom = ModeResult::Oom{i, e.tenant, e.size,
                                        std::string(p.status().message())};
        }
      }
      live[{e.tenant, e.ptr}] = {e.size, p.ok() ? *p : DevicePtr()};
      live_bytes += e.size;
      r.peak_live = std::max(r.peak_live, live_bytes);
    } else if (e.op == TraceOp::kFree) {
      auto it = live.find({e.tenant, e.ptr});
      if (it == live.end()) continue;
      const Live l = it->second;
      live.erase(it);
      CTXPOOL_RETURN_IF_ERROR(free_one(e.tenant, l));
      if (--tenant_count[e.tenant] == 0 && loaded[e.tenant] &&
          options.unload_when_empty) {
        CTXPOOL_RETURN_IF_ERROR(mode.Unload(e.tenant));
        loaded[e.tenant] = false;
      }
    } else if (e.op == TraceOp::kTrim && e.tenant != 0 &&
               !options.unload_when_empty) {
      // The tenant is unloaded: what it still holds is freed first.
      std::vector<std::pair<std::uint64_t, Live>> held;
      for (const auto& [key, l] : live) {
        if (key.first == e.tenant) held.emplace_back(key.second, l);
      }
      std::sort(held.begin(), held.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& [ptr, l] : held) {
        live.erase({e.tenant, ptr});
        CTXPOOL_RETURN_IF_ERROR(free_one(e.tenant, l));
      }
      tenant_count[e.tenant] = 0;
      if (loaded[e.tenant]) {
        CTXPOOL_RETURN_IF_ERROR(mode.Unload(e.tenant));
        loaded[e.tenant] = false;
      }
    }
    const std::uint64_t device = mode.DeviceBytes();
    if (device > r.peak_device) {
      r.peak_device = device;
      r.peak_device_event = i;
    }
    if (options.fragmentation_samples) {
      r.peak_reserved = std::max(r.peak_reserved, mode.Measure().reserved);
    }
    if (options.snapshot_event && i == *options.snapshot_event) {
      r.panel = mode.Snapshot();
      r.panel.caption = absl::StrFormat(
          "at event %d (peak live): reserved %s, live %s", i,
          FormatBytes(mode.Measure().reserved), FormatBytes(live_bytes));
    }
    if (i % sample_every == 0 || i + 1 == n) sample(i);
    if (options.progress && (i % progress_every == 0 || i + 1 == n)) {
      options.progress(i + 1, n);
    }
    if ((options.stop_at_first_failure && r.first_oom) ||
        (options.max_ooms > 0 && r.ooms >= options.max_ooms)) {
      r.stopped_early = true;
      break;
    }
  }
  if (options.fragmentation_samples) {
    r.reserved_after_unload = mode.Measure().reserved;
  }
  r.mean_fragmentation = r.samples.empty() || !options.fragmentation_samples
                             ? 0
                             : frag_sum / static_cast<double>(r.samples.size());
  mode.Finish(&r);
  return r;
}

}  // namespace ctxpool::tool
