// Fuzz target: the parsers of sizes, options and configuration strings —
// ParseBytes / ParseBool (the options table), ParseByteSize and
// ParseAllocatorConfig (the tools), SetOption on every option, and
// SimDriver::CreateFromSpec, and the JSON cost table (ParseSimCostTable).
// Whatever the text, each returns a value or an error Status (never a crash
// or an exception), and what parses formats back to the same value.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_costs.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "ctxpool/trace/replay.h"
#include "ctxpool/trace/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data,
                                      std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t pick = data[0];
  const absl::string_view text(reinterpret_cast<const char*>(data + 1),
                               size - 1);
  switch (pick % 7) {
    case 0: {
      absl::StatusOr<std::size_t> b = ctxpool::ParseBytes(text);
      if (b.ok()) {
        absl::StatusOr<std::size_t> again =
            ctxpool::ParseBytes(std::to_string(*b));
        if (!again.ok() || *again != *b) std::abort();
      }
      break;
    }
    case 1: {
      absl::StatusOr<std::uint64_t> b = ctxpool::ParseByteSize(text);
      if (b.ok()) {
        absl::StatusOr<std::uint64_t> again =
            ctxpool::ParseByteSize(std::to_string(*b));
        if (!again.ok() || *again != *b) std::abort();
      }
      break;
    }
    case 2:
      (void)ctxpool::ParseBool(text);
      break;
    case 3: {
      ctxpool::DeviceAllocatorOptions options;
      (void)ctxpool::ParseAllocatorConfig(text, &options);
      break;
    }
    case 4: {
      const auto all = ctxpool::AllOptions();
      const ctxpool::OptionSpec& spec = all[(pick / 6) % all.size()];
      if (ctxpool::SetOption(spec.id, text).ok()) {
        (void)ctxpool::GetOption(spec.id);
        (void)ctxpool::GetOptionBool(spec.id);
        (void)ctxpool::GetOptionInt(spec.id);
        (void)ctxpool::GetOptionBytes(spec.id);
      }
      ctxpool::ReloadOptions();
      break;
    }
    case 5: {
      const ctxpool::SimCostTable base = ctxpool::RealisticSimCosts();
      absl::StatusOr<ctxpool::SimCostTable> t =
          ctxpool::ParseSimCostTable(text, base);
      if (t.ok()) {
        absl::StatusOr<ctxpool::SimCostTable> again =
            ctxpool::ParseSimCostTable(ctxpool::SimCostTableToJson(*t),
                                       ctxpool::SimCostTable{});
        if (!again.ok() || again->work_ns != t->work_ns ||
            again->context_create_ns != t->context_create_ns) {
          std::abort();
        }
        for (int i = 0; i < ctxpool::kSimCallCount; ++i) {
          if (again->calls[i].ns != t->calls[i].ns ||
              again->calls[i].ns_per_mib != t->calls[i].ns_per_mib) {
            std::abort();
          }
        }
      }
      break;
    }
    default: {
      absl::StatusOr<std::unique_ptr<ctxpool::SimDriver>> sim =
          ctxpool::SimDriver::CreateFromSpec(text);
      if (sim.ok()) (void)(*sim)->DeviceCount();
      break;
    }
  }
  return 0;
}
