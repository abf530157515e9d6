// ctxpool/driver/sim_costs.h — SimDriver's cost model as a table.
//
// Each driver call kind costs `ns` plus `ns_per_mib` for every MiB it moves
// (the bytes a call allocates, maps, frees or releases); a synchronising
// call also pays for the stream work it waits for (`work_ns` per simulated
// kernel). The first context a device creates costs `context_create_ns`.
//
// RealisticSimCosts() is the built-in table: estimates, not measurements,
// chosen so that the VMM calls add up to what cuMemAlloc costs (cuMemAlloc
// is a reservation, a physical allocation, a mapping and an access grant in
// one call): cuMemCreate carries the physical allocation's share of the
// per-MiB cost, cuMemSetAccess the page tables', and each call its own
// fixed overhead. scripts/gpu-check measures every kind on a GPU and writes
// a table in the JSON form below; CTXPOOL_SIM_COSTS=that.json makes
// SimDriver::UseRealisticCosts() load it over the built-in rows.
//
//   {"cuMemAlloc": {"ns": 10000, "ns_per_mib": 1000},
//    "cuMemCreate": {"ns": 6000, "ns_per_mib": 750},
//    "work_ns": 5000, "context_create_ns": 100000000}
//
// Names are SimCallName's (the driver's names). Rows not in a file keep
// their built-in value; a row in it replaces the built-in one whole (a
// field it leaves out is 0; a name given twice: the last wins). Costs are
// in [0, 1e12] ns; the simulated clocks saturate rather than overflow. Thread-compatible value types; the functions are
// pure apart from LoadSimCostTable reading its file.
#ifndef CTXPOOL_DRIVER_SIM_COSTS_H_
#define CTXPOOL_DRIVER_SIM_COSTS_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/sim_driver.h"

namespace ctxpool {

struct SimCost {
  std::int64_t ns = 0;
  std::int64_t ns_per_mib = 0;
};

struct SimCostTable {
  std::array<SimCost, kSimCallCount> calls = {};
  std::int64_t work_ns = 0;
  std::int64_t context_create_ns = 0;
};

// The built-in estimates (see the banner).
SimCostTable RealisticSimCosts();

// Applies the JSON text over `base`: every named row replaces base's.
// INVALID_ARGUMENT naming the offset and the problem for malformed JSON, an
// unknown call name or a cost outside [0, 1e12] ns.
absl::StatusOr<SimCostTable> ParseSimCostTable(absl::string_view json,
                                               const SimCostTable& base);
// Reads `path` and parses it over `base`; NOT_FOUND when it cannot be read.
absl::StatusOr<SimCostTable> LoadSimCostTable(const std::string& path,
                                              const SimCostTable& base);
// The table in the same JSON form (every row with a non-zero cost).
std::string SimCostTableToJson(const SimCostTable& table);

}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_SIM_COSTS_H_
