#include "ctxpool/core/cgroup.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fake_cgroup.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

namespace fs = std::filesystem;
using FakeRoot = testing_internal::FakeCgroupRoot;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

TEST(CgroupTest, V2LeafWithLimits) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  r.Cgroup("/kubepods/pod1/ctr", std::to_string(1024 * kMiB),
           std::to_string(768 * kMiB), std::to_string(600 * kMiB));
  r.Write("sys/fs/cgroup/kubepods/pod1/ctr/memory.min", "0\n");
  r.Write("sys/fs/cgroup/kubepods/pod1/ctr/memory.stat",
          "anon 100\nfile 300\nactive_file " + std::to_string(100 * kMiB) +
              "\ninactive_file " + std::to_string(100 * kMiB) + "\nshmem 5\n");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.version, 2);
  EXPECT_EQ(cg.path, "/kubepods/pod1/ctr");
  EXPECT_EQ(cg.max, 1024 * kMiB);
  EXPECT_EQ(cg.high, 768 * kMiB);
  EXPECT_EQ(cg.min, 0u);
  EXPECT_EQ(cg.current, 600 * kMiB);
  EXPECT_EQ(cg.reclaimable, 200 * kMiB);
  EXPECT_EQ(cg.effective_max, 1024 * kMiB);
  EXPECT_EQ(cg.effective_high, 768 * kMiB);
  EXPECT_EQ(cg.max_from, "/kubepods/pod1/ctr");
  EXPECT_EQ(cg.limit(), 768 * kMiB);
  // 600 MiB charged, 200 MiB of it page cache: 400 MiB used of 768.
  EXPECT_EQ(cg.headroom(), 368 * kMiB);
  EXPECT_EQ(cg.note, "");
  EXPECT_NE(cg.ToString().find("memory.max 1024 MiB"), std::string::npos)
      << cg.ToString();
}

TEST(CgroupTest, LimitsOnlyOnAnAncestorSpelledMaxBelow) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/system.slice/app.service\n");
  r.Cgroup("/system.slice", std::to_string(512 * kMiB), "max");
  r.Cgroup("/system.slice/app.service", "max", "max",
           std::to_string(10 * kMiB));
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.max, kCgroupNoLimit);  // the leaf says "max"
  EXPECT_EQ(cg.effective_max, 512 * kMiB);
  EXPECT_EQ(cg.max_from, "/system.slice");
  EXPECT_EQ(cg.effective_high, kCgroupNoLimit);
  EXPECT_EQ(cg.limit(), 512 * kMiB);
  EXPECT_EQ(cg.headroom(), 502 * kMiB);
  EXPECT_NE(cg.ToString().find("(from /system.slice)"), std::string::npos)
      << cg.ToString();
}

TEST(CgroupTest, NoLimitAnywhere) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/user.slice\n");
  r.Cgroup("/user.slice", "max", "max", "4096");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.limit(), kCgroupNoLimit);
  EXPECT_EQ(cg.headroom(), kCgroupNoLimit);
}

TEST(CgroupTest, RootCgroupHasNoLimitFiles) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/\n");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.version, 2);
  EXPECT_EQ(cg.path, "/");
  EXPECT_FALSE(cg.limit().has_value());
  EXPECT_FALSE(cg.headroom().has_value());
  EXPECT_EQ(cg.note, "");
}

TEST(CgroupTest, V1HostSaysSo) {
  FakeRoot r;
  r.Write("proc/self/cgroup",
          "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.version, 1);
  EXPECT_FALSE(cg.limit().has_value());
  EXPECT_NE(cg.note.find("cgroup v1"), std::string::npos) << cg.note;
  EXPECT_NE(cg.ToString().find("unknown"), std::string::npos);
}

TEST(CgroupTest, HybridHostUsesTheV2LineUnlessMemoryIsOnV1) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "1:name=systemd:/x\n0::/x\n");
  r.Cgroup("/x", "1048576", "max", "1024");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_EQ(cg.version, 2);
  EXPECT_EQ(cg.effective_max, 1048576u);
  // This machine's own shape: v2 mounted, the memory controller on v1.
  r.Write("proc/self/cgroup", "4:memory:/x\n1:cpu:/\n0::/\n");
  const CgroupMemory v1 = ReadCgroupMemory(r.path());
  EXPECT_EQ(v1.version, 1);
  EXPECT_FALSE(v1.limit().has_value());
  EXPECT_NE(v1.note.find("memory controller is on cgroup v1"),
            std::string::npos)
      << v1.note;
}

TEST(CgroupTest, MissingFilesAreUnknownNotFatal) {
  FakeRoot r;
  const CgroupMemory none = ReadCgroupMemory(r.path());  // no membership
  EXPECT_EQ(none.version, 0);
  EXPECT_NE(none.note.find("not readable"), std::string::npos) << none.note;
  r.Write("proc/self/cgroup", "0::/gone\n");  // the directory does not exist
  const CgroupMemory gone = ReadCgroupMemory(r.path());
  EXPECT_EQ(gone.version, 2);
  EXPECT_FALSE(gone.current.has_value());
  EXPECT_FALSE(gone.limit().has_value());
  EXPECT_NE(gone.note.find("memory.current"), std::string::npos) << gone.note;
  r.Write("proc/self/cgroup", "garbage without a v2 line\n");
  const CgroupMemory garbage = ReadCgroupMemory(r.path());
  EXPECT_EQ(garbage.version, 0);
  EXPECT_NE(garbage.note.find("no cgroup v2 line"), std::string::npos);
}

TEST(CgroupTest, UnreadableOrMalformedFilesAreUnknown) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/c\n");
  r.Cgroup("/c", "", "", "");
  // A directory where a file should be cannot be read (root reads any file
  // whatever its mode, so a mode of 000 would prove nothing here).
  fs::create_directories(fs::path(r.path()) / "sys/fs/cgroup/c/memory.max");
  r.Write("sys/fs/cgroup/c/memory.high", "lots\n");
  r.Write("sys/fs/cgroup/c/memory.current", "123\n");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_FALSE(cg.max.has_value());
  EXPECT_FALSE(cg.high.has_value());
  EXPECT_EQ(cg.current, 123u);
  EXPECT_FALSE(cg.limit().has_value());
}

TEST(CgroupTest, PathsOutsideTheNamespaceAreUnknown) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "0::/../../escape\n");
  r.Write("sys/escape/memory.max", "1048576\n");
  r.Write("sys/fs/memory.high", "4096\n");
  const CgroupMemory cg = ReadCgroupMemory(r.path());
  EXPECT_FALSE(cg.limit().has_value());
  EXPECT_NE(cg.note.find("outside this cgroup namespace"), std::string::npos)
      << cg.note;
  // Trailing slashes are the same cgroup.
  r.Write("proc/self/cgroup", "0::/a/b/\n");
  r.Cgroup("/a/b", "2097152", "max");
  EXPECT_EQ(ReadCgroupMemory(r.path()).effective_max, 2097152u);
}

TEST(CgroupTest, OddStatAndEmptyMembership) {
  FakeRoot r;
  r.Write("proc/self/cgroup", "");
  EXPECT_NE(ReadCgroupMemory(r.path()).note.find("no cgroup v2 line"),
            std::string::npos);
  r.Write("proc/self/cgroup", "0::/c\n");
  r.Cgroup("/c", "max", "max", "10");
  r.Write("sys/fs/cgroup/c/memory.stat",
          "active_file 18446744073709551615\ninactive_file 2\n");
  EXPECT_EQ(ReadCgroupMemory(r.path()).reclaimable, kCgroupNoLimit);
  r.Write("sys/fs/cgroup/c/memory.stat",
          "active_file 5\nactive_file 7\ninactive_file 1\n");
  EXPECT_EQ(ReadCgroupMemory(r.path()).reclaimable, 8u);
}

TEST(CgroupTest, TheRealMachineNeverFails) {
  const CgroupMemory cg = ReadCgroupMemory();
  EXPECT_FALSE(cg.ToString().empty());
}

}  // namespace
}  // namespace ctxpool
