// Fuzz target: a parsed trace replayed on a small simulated device (64 MiB)
// in either backing, trim points on. Whatever the trace, the replay returns
// a result or an error Status: no crash, no sanitizer report, no race or
// misuse on the simulated GPU, and once the replay is over every byte and
// the context reference are back with the driver.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/replay.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data,
                                      std::size_t size) {
  if (size == 0 || size > 64 * 1024) return 0;
  const std::uint8_t pick = data[0];
  const absl::string_view text(reinterpret_cast<const char*>(data + 1),
                               size - 1);
  ctxpool::TraceReadOptions read;
  read.unknown_free = ctxpool::UnknownFreePolicy::kSynthesizeAlloc;
  absl::StatusOr<ctxpool::Trace> trace =
      ctxpool::ParseTrace(text, "fuzz", read);
  if (!trace.ok() || trace->size() > 4096) return 0;
  ctxpool::SimDeviceSpec spec;
  spec.capacity_bytes = std::size_t{64} << 20;
  spec.context_overhead_bytes = 0;
  std::unique_ptr<ctxpool::SimDriver> sim =
      ctxpool::SimDriver::Create({.devices = {spec}});
  ctxpool::ReplayConfig config;
  config.allocator.backing = (pick & 1) != 0 ? ctxpool::BackingMode::kExpandable
                                             : ctxpool::BackingMode::kClassic;
  config.replay_trims = true;
  config.wall_latency = false;
  config.cost_model = (pick & 2) != 0;
  (void)ctxpool::ReplayOnDriver(*trace, *sim, 0, config);
  if (sim->race_count() != 0 || sim->misuse_count() != 0 ||
      sim->used_bytes(0) != 0 || sim->primary_ctx_refcount(0) != 0 ||
      !sim->CheckInvariants().ok()) {
    std::abort();
  }
  return 0;
}
