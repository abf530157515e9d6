// SimDriver's cost table: the built-in estimates and the JSON form.
#include "ctxpool/driver/sim_costs.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

// A scanner for the table's small JSON subset: one object whose values are
// numbers or objects of numbers; string keys without escapes.
class Scanner {
 public:
  explicit Scanner(absl::string_view text) : text_(text) {}

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("cost table: %s at offset %d", what, pos_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\t' ||
            text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Peek(char c) {
    SkipSpace();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  absl::Status Expect(char c) {
    if (!Peek(c))
      return Error(absl::StrCat("expected '", std::string(1, c), "'"));
    ++pos_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Key() {
    CTXPOOL_RETURN_IF_ERROR(Expect('"'));
    const std::size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\') return Error("escapes are not supported");
      ++pos_;
    }
    if (pos_ >= text_.size()) return Error("unterminated string");
    std::string key(text_.substr(start, pos_ - start));
    ++pos_;
    CTXPOOL_RETURN_IF_ERROR(Expect(':'));
    return key;
  }
  // A non-negative number, rounded to an integer.
  absl::StatusOr<std::int64_t> Number() {
    SkipSpace();
    const std::size_t start = pos_;
    while (pos_ < text_.size() &&
           (absl::ascii_isdigit(static_cast<unsigned char>(text_[pos_])) ||
            text_[pos_] == '.' || text_[pos_] == '-' || text_[pos_] == '+' ||
            text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
    }
    double v = 0;
    if (start == pos_ ||
        !absl::SimpleAtod(text_.substr(start, pos_ - start), &v)) {
      pos_ = start;
      return Error("expected a number");
    }
    if (!(v >= 0) || v > 1e12) {
      pos_ = start;
      return Error("costs must be in [0, 1e12] ns (1000 s)");
    }
    return static_cast<std::int64_t>(std::llround(v));
  }
  // Calls fn(key) for each member of an object; fn reads the value.
  template <typename Fn>
  absl::Status Members(Fn fn) {
    CTXPOOL_RETURN_IF_ERROR(Expect('{'));
    if (Peek('}')) {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      CTXPOOL_ASSIGN_OR_RETURN(std::string key, Key());
      CTXPOOL_RETURN_IF_ERROR(fn(key));
      if (Peek(',')) {
        ++pos_;
        continue;
      }
      return Expect('}');
    }
  }
  bool AtEnd() {
    SkipSpace();
    return pos_ == text_.size();
  }

 private:
  absl::string_view text_;
  std::size_t pos_ = 0;
};

int CallByName(absl::string_view name) {
  for (int i = 0; i < kSimCallCount; ++i) {
    if (SimCallName(static_cast<SimCall>(i)) == name) return i;
  }
  return -1;
}

}  // namespace

SimCostTable RealisticSimCosts() {
  struct Row {
    SimCall call;
    std::int64_t ns;
    std::int64_t ns_per_mib;
  };
  // cuMemAlloc = physical allocation + mapping + access in one call; the VMM
  // calls split its per-MiB cost (create 0.75 us, access 0.25 us per MiB)
  // and each pays its own fixed overhead, so that mapping memory through
  // VMM costs what cuMemAlloc does plus the extra calls.
  static constexpr Row kRows[] = {
      {SimCall::kMemAlloc, 10'000, 1'000},
      {SimCall::kMemFree, 50'000, 0},  // synchronises the device
      {SimCall::kMemCreate, 6'000, 750},
      {SimCall::kMemRelease, 5'000, 250},
      {SimCall::kMemMap, 2'000, 0},
      {SimCall::kMemUnmap, 10'000, 250},  // synchronises, tears down tables
      {SimCall::kMemSetAccess, 4'000, 250},
      {SimCall::kMemAddressReserve, 2'000, 0},
      {SimCall::kMemAddressFree, 2'000, 0},
      {SimCall::kMemHostAlloc, 5'000, 977},  // ~1 ms per GiB
      {SimCall::kMemFreeHost, 20'000, 0},
      {SimCall::kMemHostRegister, 5'000, 500},
      {SimCall::kMemHostUnregister, 5'000, 0},
      {SimCall::kStreamCreate, 5'000, 0},
      {SimCall::kStreamDestroy, 5'000, 0},
      {SimCall::kEventCreate, 1'000, 0},
      {SimCall::kEventDestroy, 1'000, 0},
      {SimCall::kEventRecord, 2'000, 0},
      {SimCall::kEventQuery, 500, 0},
      {SimCall::kStreamWaitEvent, 1'000, 0},
      {SimCall::kStreamQuery, 500, 0},
      {SimCall::kLaunchHostFunc, 3'000, 0},
      {SimCall::kPrimaryCtxRetain, 1'000, 0},
      {SimCall::kCtxCreate, 1'000, 0},
      {SimCall::kMemsetAsync, 3'000, 0},
      {SimCall::kMemcpyAsync, 3'000, 0},
  };
  SimCostTable t;
  for (const Row& row : kRows) {
    t.calls[static_cast<int>(row.call)] = {row.ns, row.ns_per_mib};
  }
  t.work_ns = 5'000;
  t.context_create_ns = 100'000'000;  // creating a context: ~100 ms
  return t;
}

absl::StatusOr<SimCostTable> ParseSimCostTable(absl::string_view json,
                                               const SimCostTable& base) {
  SimCostTable t = base;
  Scanner sc(json);
  CTXPOOL_RETURN_IF_ERROR(
      sc.Members([&](const std::string& key) -> absl::Status {
        if (key == "work_ns") {
          CTXPOOL_ASSIGN_OR_RETURN(t.work_ns, sc.Number());
          return absl::OkStatus();
        }
        if (key == "context_create_ns") {
          CTXPOOL_ASSIGN_OR_RETURN(t.context_create_ns, sc.Number());
          return absl::OkStatus();
        }
        const int call = CallByName(key);
        if (call < 0) {
          return sc.Error(
              absl::StrCat("unknown call '", key,
                           "' (names as the driver's, e.g. cuMemMap)"));
        }
        SimCost cost;
        CTXPOOL_RETURN_IF_ERROR(
            sc.Members([&](const std::string& field) -> absl::Status {
              if (field == "ns") {
                CTXPOOL_ASSIGN_OR_RETURN(cost.ns, sc.Number());
              } else if (field == "ns_per_mib") {
                CTXPOOL_ASSIGN_OR_RETURN(cost.ns_per_mib, sc.Number());
              } else {
                return sc.Error(absl::StrCat("unknown field '", field,
                                             "' (ns, ns_per_mib)"));
              }
              return absl::OkStatus();
            }));
        t.calls[call] = cost;
        return absl::OkStatus();
      }));
  if (!sc.AtEnd()) return sc.Error("trailing text");
  return t;
}

absl::StatusOr<SimCostTable> LoadSimCostTable(const std::string& path,
                                              const SimCostTable& base) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("cost table: cannot open '", path, "'"));
  }
  std::string text;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    text.append(buf, n);
    if (text.size() > (1 << 20)) {
      std::fclose(f);
      return absl::InvalidArgumentError(
          absl::StrCat("cost table: '", path, "' is larger than 1 MiB"));
    }
  }
  std::fclose(f);
  absl::StatusOr<SimCostTable> t = ParseSimCostTable(text, base);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

std::string SimCostTableToJson(const SimCostTable& table) {
  std::string out = "{";
  for (int i = 0; i < kSimCallCount; ++i) {
    const SimCost& c = table.calls[i];
    if (c.ns == 0 && c.ns_per_mib == 0) continue;
    absl::StrAppendFormat(&out, "\"%s\": {\"ns\": %d, \"ns_per_mib\": %d}, ",
                          SimCallName(static_cast<SimCall>(i)), c.ns,
                          c.ns_per_mib);
  }
  absl::StrAppendFormat(&out, "\"work_ns\": %d, \"context_create_ns\": %d}",
                        table.work_ns, table.context_create_ns);
  return out;
}

}  // namespace ctxpool
