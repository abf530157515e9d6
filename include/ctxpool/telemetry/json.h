// ctxpool/telemetry/json.h — a JSON snapshot of a device's memory.
//
// RenderJsonSnapshot() writes what a memory viewer needs to draw a device:
// the context report, the allocator's totals, each open model session with
// its streams and live allocations, and every segment with its blocks, each
// block attributed to the model that owns it (by allocation, else by the
// stream its segment belongs to).
//
//   std::ofstream("gpu0.json") << RenderJsonSnapshot(*gpu0);
//
// Shape (addresses and handles as "0x..." strings, sizes as integers):
//   {"devices": [{"device": 0, "name": "...", "context_bytes": N,
//     "totals": {"live_bytes": N, "mapped_bytes": N, "cached_bytes": N,
//                "peak_bytes": N, "fragmentation": 0.25},
//     "models": [{"name": "bert", "streams": ["0x1"], "live_bytes": N,
//                 "allocations": [{"ptr": "0x..", "bytes": N, "label": "..",
//                                  "stream": "0x.."}]}],
//     "segments": [{"base": "0x..", "size": N, "stream": "0x..",
//                   "pool": "small", "model": "bert",
//                   "blocks": [{"ptr": "0x..", "size": N, "requested": N,
//                               "state": "allocated", "model": "bert"}]}]}]}
//
// Thread-safety: as prometheus.h.
#ifndef CTXPOOL_TELEMETRY_JSON_H_
#define CTXPOOL_TELEMETRY_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/core/json_string.h"  // JsonString, re-exported

namespace ctxpool {

std::string RenderJsonSnapshot(const Runtime& runtime);
std::string RenderJsonSnapshot(const DeviceContext& device);

}  // namespace ctxpool

#endif  // CTXPOOL_TELEMETRY_JSON_H_
