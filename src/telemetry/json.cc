#include "ctxpool/telemetry/json.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/internal/format.h"

namespace ctxpool {
namespace {

constexpr int kAgg = static_cast<int>(StatPool::kAggregate);

std::string Hex(std::uint64_t v) {
  return core_internal::Format("\"0x%x\"", v);
}

absl::string_view StateName(BlockState s) {
  switch (s) {
    case BlockState::kAllocated:
      return "allocated";
    case BlockState::kPendingFree:
      return "pending_free";
    case BlockState::kFree:
      return "free";
  }
  return "unknown";
}

struct ModelSample {
  std::string name;
  std::vector<StreamHandle> streams;
  SessionStats stats;
  std::vector<LiveAllocation> live;
};

void AppendDevice(std::string& out, const DeviceContext& dc) {
  std::vector<ModelSample> models;
  dc.ForEachSession([&models](const ModelSession& s) {
    models.push_back(
        {s.name(),
         std::vector<StreamHandle>(s.streams().begin(), s.streams().end()),
         s.Stats(), s.LiveAllocations()});
  });
  // Node maps: an insert that runs out of host memory leaves them whole
  // (a flat table's failed growth corrupts it, and its destructor then
  // frees a bad pointer).
  std::map<std::uint64_t, const std::string*> stream_owner;  // by handle
  std::map<std::uint64_t, const std::string*> block_owner;   // by address
  for (const ModelSample& m : models) {
    for (StreamHandle s : m.streams) stream_owner[s.value()] = &m.name;
    for (const LiveAllocation& a : m.live) {
      block_owner[a.ptr.address()] = &m.name;
    }
  }
  const DeviceAllocatorStats stats = dc.device_allocator().Stats();
  const FragmentationStats frag = dc.device_allocator().Fragmentation();
  const AllocatorSnapshot snap = dc.device_allocator().Snapshot();
  const ContextReport& report = dc.initial_context_report();

  const auto& t = stats.total;
  absl::StrAppend(
      &out, "{\"device\":", dc.device(),
      ",\"name\":", JsonString(report.device_name),
      ",\"context_bytes\":", report.context_bytes,
      ",\"totals\":{\"live_bytes\":", t.allocated_bytes[kAgg].current,
      ",\"mapped_bytes\":", t.reserved_bytes[kAgg].current,
      ",\"cached_bytes\":",
      t.reserved_bytes[kAgg].current - t.allocated_bytes[kAgg].current,
      ",\"peak_bytes\":", t.allocated_bytes[kAgg].peak,
      ",\"fragmentation\":", core_internal::Format("%.6g", frag.external),
      "},\"models\":[");
  for (std::size_t i = 0; i < models.size(); ++i) {
    const ModelSample& m = models[i];
    absl::StrAppend(&out, i ? "," : "", "{\"name\":", JsonString(m.name),
                    ",\"streams\":[");
    for (std::size_t j = 0; j < m.streams.size(); ++j) {
      absl::StrAppend(&out, j ? "," : "", Hex(m.streams[j].value()));
    }
    absl::StrAppend(&out, "],\"live_bytes\":", m.stats.live_bytes,
                    ",\"allocations\":[");
    for (std::size_t j = 0; j < m.live.size(); ++j) {
      const LiveAllocation& a = m.live[j];
      absl::StrAppend(&out, j ? "," : "", "{\"ptr\":", Hex(a.ptr.address()),
                      ",\"bytes\":", a.bytes,
                      ",\"label\":", a.label ? JsonString(a.label) : "null",
                      ",\"stream\":", Hex(a.stream.value()), "}");
    }
    absl::StrAppend(&out, "]}");
  }
  absl::StrAppend(&out, "],\"segments\":[");
  for (std::size_t i = 0; i < snap.segments.size(); ++i) {
    const SegmentInfo& seg = snap.segments[i];
    auto owner = stream_owner.find(seg.stream.value());
    const std::string model =
        owner == stream_owner.end() ? "null" : JsonString(*owner->second);
    absl::StrAppend(&out, i ? "," : "", "{\"base\":", Hex(seg.base.address()),
                    ",\"size\":", seg.size,
                    ",\"stream\":", Hex(seg.stream.value()),
                    ",\"pool\":", seg.small_pool ? "\"small\"" : "\"large\"",
                    ",\"model\":", model, ",\"blocks\":[");
    for (std::size_t j = 0; j < seg.blocks.size(); ++j) {
      const BlockInfo& b = seg.blocks[j];
      auto bo = block_owner.find(b.ptr.address());
      std::string block_model =
          bo != block_owner.end()        ? JsonString(*bo->second)
          : b.state == BlockState::kFree ? std::string("null")
                                         : model;
      absl::StrAppend(&out, j ? "," : "", "{\"ptr\":", Hex(b.ptr.address()),
                      ",\"size\":", b.size,
                      ",\"requested\":", b.requested_bytes, ",\"state\":\"",
                      StateName(b.state), "\",\"model\":", block_model, "}");
    }
    absl::StrAppend(&out, "]}");
  }
  absl::StrAppend(&out, "]}");
}

}  // namespace

std::string RenderJsonSnapshot(const DeviceContext& device) {
  std::string out = "{\"devices\":[";
  if (!device.InForkedChild()) AppendDevice(out, device);
  absl::StrAppend(&out, "]}");
  return out;
}

std::string RenderJsonSnapshot(const Runtime& runtime) {
  std::string out = absl::StrCat(
      "{\"driver\":", JsonString(runtime.driver_kind()), ",\"devices\":[");
  bool first = true;
  for (const DeviceContext* dc : runtime.devices()) {
    if (!first) out += ",";
    first = false;
    AppendDevice(out, *dc);
  }
  absl::StrAppend(&out, "]}");
  return out;
}

}  // namespace ctxpool
