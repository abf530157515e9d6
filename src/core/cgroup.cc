#include "ctxpool/core/cgroup.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace ctxpool {
namespace {

// The whole file, or nullopt (absent, a directory, unreadable).
std::optional<std::string> ReadFile(const std::string& path) {
  // A directory opens on Linux but cannot be read.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();  // an empty file reads as ""
  if (in.bad()) return std::nullopt;
  return s.str();
}

// A limit file: a number or "max". nullopt when absent or malformed.
std::optional<std::uint64_t> ReadLimit(const std::string& path) {
  std::optional<std::string> text = ReadFile(path);
  if (!text.has_value()) return std::nullopt;
  absl::string_view v = absl::StripAsciiWhitespace(*text);
  if (v == "max") return kCgroupNoLimit;
  std::uint64_t n = 0;
  if (!absl::SimpleAtoi(v, &n)) return std::nullopt;
  return n;
}

// active_file + inactive_file of a memory.stat.
std::optional<std::uint64_t> ReadReclaimable(const std::string& path) {
  std::optional<std::string> text = ReadFile(path);
  if (!text.has_value()) return std::nullopt;
  std::optional<std::uint64_t> active;
  std::optional<std::uint64_t> inactive;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    std::vector<absl::string_view> kv = absl::StrSplit(
        absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
    if (kv.size() != 2) continue;
    std::uint64_t n = 0;
    if (!absl::SimpleAtoi(kv[1], &n)) continue;
    if (kv[0] == "active_file") active = n;  // a repeated key: the last
    if (kv[0] == "inactive_file") inactive = n;
  }
  if (!active.has_value() && !inactive.has_value()) return std::nullopt;
  const std::uint64_t a = active.value_or(0);
  const std::uint64_t b = inactive.value_or(0);
  return a > kCgroupNoLimit - b ? kCgroupNoLimit : a + b;  // saturates
}

std::string Bytes(std::uint64_t n) {
  if (n == kCgroupNoLimit) return "max";
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  if (n >= kMiB && n % kMiB == 0) return absl::StrCat(n / kMiB, " MiB");
  return absl::StrCat(n, " B");
}

}  // namespace

std::optional<std::uint64_t> CgroupMemory::limit() const {
  if (!effective_max.has_value() && !effective_high.has_value()) {
    return std::nullopt;
  }
  return std::min(effective_max.value_or(kCgroupNoLimit),
                  effective_high.value_or(kCgroupNoLimit));
}

std::optional<std::uint64_t> CgroupMemory::headroom() const {
  const std::optional<std::uint64_t> lim = limit();
  if (!lim.has_value() || !current.has_value()) return std::nullopt;
  if (*lim == kCgroupNoLimit) return kCgroupNoLimit;
  const std::uint64_t free_cache = std::min(*current, reclaimable.value_or(0));
  const std::uint64_t used = *current - free_cache;
  return used >= *lim ? 0 : *lim - used;
}

std::string CgroupMemory::ToString() const {
  if (version != 2) {
    return absl::StrCat("cgroup: limits unknown (", note, ")");
  }
  auto limit_text = [](const std::optional<std::uint64_t>& v,
                       const std::string& from, const std::string& self) {
    if (!v.has_value()) return std::string("unknown");
    std::string out = Bytes(*v);
    if (*v != kCgroupNoLimit && from != self) {
      absl::StrAppend(&out, " (from ", from, ")");
    }
    return out;
  };
  std::string out =
      absl::StrCat("cgroup v2 ", path, ": memory.max ",
                   limit_text(effective_max, max_from, path), ", memory.high ",
                   limit_text(effective_high, high_from, path));
  if (current.has_value()) {
    absl::StrAppend(&out, ", current ", Bytes(*current));
    if (reclaimable.has_value()) {
      absl::StrAppend(&out, " (", Bytes(*reclaimable), " reclaimable)");
    }
  }
  if (!note.empty()) absl::StrAppend(&out, "; ", note);
  return out;
}

CgroupMemory ReadCgroupMemory(absl::string_view root) {
  CgroupMemory cg;
  const std::string proc = absl::StrCat(root, "/proc/self/cgroup");
  std::optional<std::string> membership = ReadFile(proc);
  if (!membership.has_value()) {
    cg.note = absl::StrCat(proc, " is not readable");
    return cg;
  }
  bool v1 = false;
  bool memory_v1 = false;
  bool found = false;
  for (absl::string_view line : absl::StrSplit(*membership, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "0::")) {
      cg.path = std::string(line);
      found = true;
      continue;
    }
    // "N:controllers:/path": a v1 hierarchy.
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    v1 = true;
    for (absl::string_view c : absl::StrSplit(f[1], ',')) {
      if (c == "memory") memory_v1 = true;
    }
  }
  // A controller lives in one hierarchy: on a hybrid host whose memory
  // controller is v1, the v2 tree has no memory limits to read.
  if (!found || memory_v1) {
    cg.version = v1 ? 1 : 0;
    cg.note = memory_v1 ? "the memory controller is on cgroup v1: its "
                          "limits are not read"
              : v1      ? "cgroup v1 host: memory limits are not read"
                        : absl::StrCat(proc, " has no cgroup v2 line");
    return cg;
  }
  cg.version = 2;
  if (cg.path.empty() || cg.path[0] != '/') cg.path = "/" + cg.path;
  // Inside a cgroup namespace the kernel shows cgroups outside it as
  // "/../x": not under this mount, and its ancestors are not ours.
  for (absl::string_view part : absl::StrSplit(cg.path, '/')) {
    if (part == "..") {
      cg.note = absl::StrCat("cgroup ", cg.path,
                             " lies outside this cgroup namespace: its "
                             "limits are not read");
      return cg;
    }
  }
  while (cg.path.size() > 1 && cg.path.back() == '/') cg.path.pop_back();
  const std::string base = absl::StrCat(root, "/sys/fs/cgroup");
  auto dir = [&base](absl::string_view p) {
    return p == "/" ? base : absl::StrCat(base, p);
  };
  const std::string leaf = dir(cg.path);
  cg.max = ReadLimit(leaf + "/memory.max");
  cg.high = ReadLimit(leaf + "/memory.high");
  cg.min = ReadLimit(leaf + "/memory.min");
  cg.current = ReadLimit(leaf + "/memory.current");
  if (cg.current == kCgroupNoLimit) cg.current.reset();
  cg.reclaimable = ReadReclaimable(leaf + "/memory.stat");
  std::vector<std::string> missing;
  if (!cg.current.has_value()) missing.push_back("memory.current");
  if (!cg.max.has_value()) missing.push_back("memory.max");
  if (!cg.high.has_value()) missing.push_back("memory.high");
  // The effective limits: the smallest from the leaf up to the root.
  std::string p = cg.path;
  while (true) {
    const std::string d = dir(p);
    for (auto [file, eff, from] :
         {std::tuple{"/memory.max", &cg.effective_max, &cg.max_from},
          std::tuple{"/memory.high", &cg.effective_high, &cg.high_from}}) {
      std::optional<std::uint64_t> v = ReadLimit(d + file);
      if (!v.has_value()) continue;
      if (!eff->has_value() || *v < **eff) {
        *eff = v;
        *from = p;
      }
    }
    if (p == "/") break;
    const std::size_t slash = p.rfind('/');
    p = slash == 0 ? "/" : p.substr(0, slash);
  }
  if (!missing.empty() && cg.path != "/") {
    cg.note = absl::StrCat("not readable in ", leaf, ": ",
                           absl::StrJoin(missing, ", "));
  }
  return cg;
}

}  // namespace ctxpool
