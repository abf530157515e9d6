// tests/fake_cgroup.h — a fake /proc + /sys/fs/cgroup tree for the cgroup
// reader (ctxpool/core/cgroup.h), in a fresh temporary directory that is
// removed again; point ReadCgroupMemory (or CTXPOOL_SYSFS_ROOT) at path().
#ifndef CTXPOOL_TESTS_FAKE_CGROUP_H_
#define CTXPOOL_TESTS_FAKE_CGROUP_H_

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace ctxpool {
namespace testing_internal {

// A fake /proc + /sys/fs/cgroup tree in a fresh temporary directory.
class FakeCgroupRoot {
 public:
  FakeCgroupRoot() {
    root_ = std::filesystem::temp_directory_path() /
            ("ctxpool_cgroup_" + std::to_string(getpid()) + "_" +
             std::to_string(counter_++));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "proc/self");
    std::filesystem::create_directories(root_ / "sys/fs/cgroup");
  }
  ~FakeCgroupRoot() { std::filesystem::remove_all(root_); }
  std::string path() const { return root_.string(); }
  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = root_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A cgroup directory with the given files (empty value: not written).
  void Cgroup(const std::string& cg, const std::string& max,
              const std::string& high, const std::string& current = "") {
    const std::string d = "sys/fs/cgroup" + cg;
    std::filesystem::create_directories(root_ / d);
    if (!max.empty()) Write(d + "/memory.max", max + "\n");
    if (!high.empty()) Write(d + "/memory.high", high + "\n");
    if (!current.empty()) Write(d + "/memory.current", current + "\n");
  }

 private:
  static inline int counter_ = 0;
  std::filesystem::path root_;
};

}  // namespace testing_internal
}  // namespace ctxpool

#endif  // CTXPOOL_TESTS_FAKE_CGROUP_H_
