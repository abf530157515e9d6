// ctxpool/core/cgroup.h — the memory limits the process runs under.
//
// Pinned host memory (cuMemHostAlloc) is host RAM: a container's memory
// cgroup charges it, and a pinned cache that grows towards `memory.max`
// gets the whole container OOM-killed, GPU work and all; near `memory.high`
// the kernel reclaims everything else first. ReadCgroupMemory tells the
// host allocator (and the operator) what those limits are:
//
//   CgroupMemory cg = ReadCgroupMemory();       // or ReadCgroupMemory(root)
//   if (cg.effective_high() != kCgroupNoLimit) ...
//   std::puts(cg.ToString().c_str());           // "cgroup v2 /kubepods/...: "
//
// It reads /proc/self/cgroup (the cgroup v2 line "0::/path") and, under
// /sys/fs/cgroup/<path>, memory.max, memory.high, memory.min,
// memory.current and memory.stat. A limit the leaf does not set ("max", or
// the file is absent, as in the root cgroup) comes from the nearest
// ancestor that sets one: the effective limit is the smallest on the way to
// the root, and `max_from` / `high_from` name the cgroup it comes from.
// Headroom counts reclaimable page cache (memory.stat's active_file +
// inactive_file) as free, or a container full of page cache would look
// full. Nothing here fails: a cgroup v1 host, a missing or unreadable file
// give "unknown" (nullopt) and a `note` that says so.
//
// `root` (tests; CTXPOOL_SYSFS_ROOT) prefixes both paths, so a fake tree
// stands for /proc and /sys/fs/cgroup.
//
// Thread-compatible: a plain value.
#ifndef CTXPOOL_CORE_CGROUP_H_
#define CTXPOOL_CORE_CGROUP_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace ctxpool {

// A limit file that says "max".
inline constexpr std::uint64_t kCgroupNoLimit =
    std::numeric_limits<std::uint64_t>::max();

struct CgroupMemory {
  // 2 for a cgroup v2 membership, 1 for a v1-only host (limits not read),
  // 0 when /proc/self/cgroup could not be read.
  int version = 0;
  std::string path;  // the process's cgroup, e.g. "/kubepods/pod1/ctr"
  // The leaf's own files; nullopt: absent or unreadable. kCgroupNoLimit for
  // "max".
  std::optional<std::uint64_t> max;
  std::optional<std::uint64_t> high;
  std::optional<std::uint64_t> min;
  std::optional<std::uint64_t> current;
  std::optional<std::uint64_t> reclaimable;  // active_file + inactive_file
  // The effective limits: the smallest on the path to the root
  // (kCgroupNoLimit: none anywhere; nullopt: nothing readable), and where.
  std::optional<std::uint64_t> effective_max;
  std::optional<std::uint64_t> effective_high;
  std::string max_from;
  std::string high_from;
  // What could not be read, for humans ("" when everything was).
  std::string note;

  // The lower of effective high and max (kCgroupNoLimit when neither is set,
  // nullopt when neither is known).
  std::optional<std::uint64_t> limit() const;
  // limit() − (current − reclaimable), 0 when over; nullopt when unknown.
  std::optional<std::uint64_t> headroom() const;
  // "cgroup v2 /a/b: memory.max 1 GiB (from /a), memory.high max, current
  // 12 MiB (3 MiB reclaimable)" or why nothing is known.
  std::string ToString() const;
};

// Reads the calling process's cgroup memory state under `root` ("" for the
// real /proc and /sys/fs/cgroup). Never fails; see the file comment.
CgroupMemory ReadCgroupMemory(absl::string_view root = "");

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_CGROUP_H_
