// ctxpool/options.h — the one table of ctxpool's tunables.
//
// Every knob a deployment may want to turn without recompiling lives in one
// table (after mimalloc's options.c): a name, the CTXPOOL_* environment
// variable that overrides it, a default and a description. The environment is
// read once, on first use; a program may also set a value explicitly
// (SetOption), which wins over the environment. Typed getters parse the
// value and name the variable in the error when it does not parse.
//
//   // CTXPOOL_DRIVER=sim:a10-24gb CTXPOOL_SESSION_MAX_BYTES=8GiB ./server
//   std::string driver = GetOption(OptionId::kDriver);        // "sim:a10-24gb"
//   absl::StatusOr<std::size_t> max =
//       GetOptionBytes(OptionId::kSessionMaxBytes);           // 8 << 30
//   std::cout << DescribeOptions();   // the table, for --help and the docs
//
// Byte values accept a plain number or a number with a unit: B, KiB, MiB,
// GiB, TiB (also K/M/G/T, KB/MB/GB/TB meaning the same powers of two, as in
// PyTorch's PYTORCH_CUDA_ALLOC_CONF). Booleans accept 1/0, true/false,
// on/off, yes/no (any case).
//
// Thread-safety: all functions are thread-safe. Values are snapshots: a
// component reads an option when it is created (Runtime::Create, a session's
// defaults), so changing an option later affects only objects created later.
#ifndef CTXPOOL_OPTIONS_H_
#define CTXPOOL_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace ctxpool {

// The options, in table order.
enum class OptionId : int {
  kDriver,             // CTXPOOL_DRIVER
  kDevices,            // CTXPOOL_DEVICES
  kBacking,            // CTXPOOL_BACKING
  kTrace,              // CTXPOOL_TRACE
  kTraceCapacity,      // CTXPOOL_TRACE_CAPACITY
  kSessionStreams,     // CTXPOOL_SESSION_STREAMS
  kSessionMinBytes,    // CTXPOOL_SESSION_MIN_BYTES
  kSessionHighBytes,   // CTXPOOL_SESSION_HIGH_BYTES
  kSessionMaxBytes,    // CTXPOOL_SESSION_MAX_BYTES
  kSessionTimes,       // CTXPOOL_SESSION_TIMES
  kMaxSplitBytes,      // CTXPOOL_MAX_SPLIT_BYTES
  kMemoryLimit,        // CTXPOOL_MEMORY_LIMIT
  kSimCosts,           // CTXPOOL_SIM_COSTS
  kStreamPoolReserve,  // CTXPOOL_STREAM_POOL_RESERVE
  kVerbose,            // CTXPOOL_VERBOSE
  kHostBudget,         // CTXPOOL_HOST_BUDGET
  kCtxSched,           // CTXPOOL_CTX_SCHED
  kSysfsRoot,          // CTXPOOL_SYSFS_ROOT
  kCount,              // not an option
};
inline constexpr int kOptionCount = static_cast<int>(OptionId::kCount);

// How a value is parsed.
enum class OptionKind { kString, kBool, kInt, kBytes };

// One row of the table.
struct OptionSpec {
  OptionId id;
  absl::string_view name;  // "driver"
  absl::string_view env;   // "CTXPOOL_DRIVER"
  OptionKind kind;
  absl::string_view default_value;  // as text, parsed like an override
  absl::string_view description;
};

// The whole table, indexed by OptionId.
absl::Span<const OptionSpec> AllOptions();
// REQUIRES: id != OptionId::kCount.
const OptionSpec& GetOptionSpec(OptionId id);
// Finds a row by name ("driver") or environment variable ("CTXPOOL_DRIVER");
// NOT_FOUND otherwise.
absl::StatusOr<OptionId> FindOption(absl::string_view name_or_env);

// The value as text: SetOption's value, else the environment variable (read
// once, at the first call of any getter), else the default.
std::string GetOption(OptionId id);
// True when the value comes from SetOption or the environment.
bool IsOptionOverridden(OptionId id);

// Typed getters. INVALID_ARGUMENT naming the variable and the bad text when
// the value does not parse as the option's kind.
absl::StatusOr<bool> GetOptionBool(OptionId id);
absl::StatusOr<std::int64_t> GetOptionInt(OptionId id);
absl::StatusOr<std::size_t> GetOptionBytes(OptionId id);

// Overrides an option for this process (wins over the environment).
// INVALID_ARGUMENT when `value` does not parse as the option's kind; the
// previous value stays.
absl::Status SetOption(OptionId id, absl::string_view value);
// Drops SetOption overrides and reads the environment again. For tests and
// for programs that change their environment before initialising ctxpool.
void ReloadOptions();

// The table as aligned text: name, variable, current value (marked when
// overridden), default and description, one option per line.
std::string DescribeOptions();

// Parses "4096", "512KiB", "1.5GiB", "8G". INVALID_ARGUMENT otherwise.
absl::StatusOr<std::size_t> ParseBytes(absl::string_view text);
// Parses 1/0, true/false, on/off, yes/no. INVALID_ARGUMENT otherwise.
absl::StatusOr<bool> ParseBool(absl::string_view text);

}  // namespace ctxpool

#endif  // CTXPOOL_OPTIONS_H_
