// The PyTorch plugin's C ABI as the tests see it: the functions of
// libctxpool_torch.so resolved with dlsym, and a reader for its JSON stats.
// Shared by the plugin's tests, which dlopen the library from
// CTXPOOL_TORCH_PLUGIN_PATH (tests/torch_plugin.cmake), with RunTestInChild
// for cases that need their own process (an environment read once, a
// shutdown that prints).
//
//   void* h = dlopen(CTXPOOL_TORCH_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
//   torch_plugin_test::Api api;
//   torch_plugin_test::ResolveApi(h, &api);
//   int64_t live = torch_plugin_test::JsonInt(api.memory_stats(0),
//                                             "allocation.all.current");
#ifndef CTXPOOL_TESTS_TORCH_PLUGIN_API_H_
#define CTXPOOL_TESTS_TORCH_PLUGIN_API_H_

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

#ifndef CTXPOOL_TORCH_PLUGIN_PATH
#define CTXPOOL_TORCH_PLUGIN_PATH ""  // the plugin is not built: skip
#endif

// The plugin's stream type, declared exactly as plugins/torch/ctxpool_torch.h
// does (at global scope): a function pointer type that differs from the
// exported function's is undefined behaviour (UBSan's -fsanitize=function).
typedef struct CUstream_st* cudaStream_t;

namespace torch_plugin_test {

// The plugin's C functions; null where the library lacks one.
struct Api {
  void* (*malloc)(size_t, int, cudaStream_t) = nullptr;
  void* (*try_malloc)(size_t, int, cudaStream_t) = nullptr;
  void (*free)(void*, size_t, int, cudaStream_t) = nullptr;
  int64_t (*empty_cache)() = nullptr;
  const char* (*memory_stats)(int) = nullptr;
  int (*record_stream)(void*, cudaStream_t) = nullptr;
  int (*set_model)(const char*) = nullptr;
  const char* (*get_model)() = nullptr;
  int (*set_model_budget)(const char*, size_t) = nullptr;
  cudaStream_t (*model_stream)(int, int) = nullptr;
  int (*snapshot)(const char*) = nullptr;
  int (*write_trace)(const char*) = nullptr;
  const char* (*last_error)() = nullptr;
  const char* (*info)() = nullptr;
  int (*shutdown)(int) = nullptr;
};

template <typename F>
void Resolve(void* handle, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
}

// Fills *api from the dlopened library `handle`.
inline void ResolveApi(void* handle, Api* api) {
  Resolve(handle, "ctxpool_malloc", api->malloc);
  Resolve(handle, "ctxpool_try_malloc", api->try_malloc);
  Resolve(handle, "ctxpool_free", api->free);
  Resolve(handle, "ctxpool_empty_cache", api->empty_cache);
  Resolve(handle, "ctxpool_memory_stats", api->memory_stats);
  Resolve(handle, "ctxpool_record_stream", api->record_stream);
  Resolve(handle, "ctxpool_set_model", api->set_model);
  Resolve(handle, "ctxpool_get_model", api->get_model);
  Resolve(handle, "ctxpool_set_model_budget", api->set_model_budget);
  Resolve(handle, "ctxpool_model_stream", api->model_stream);
  Resolve(handle, "ctxpool_snapshot", api->snapshot);
  Resolve(handle, "ctxpool_write_trace", api->write_trace);
  Resolve(handle, "ctxpool_last_error", api->last_error);
  Resolve(handle, "ctxpool_info", api->info);
  Resolve(handle, "ctxpool_shutdown", api->shutdown);
}

// Reads the integer after "key": in a flat JSON object; INT64_MIN if absent.
inline int64_t JsonInt(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const std::size_t at = json.find(needle);
  if (at == std::string::npos) return INT64_MIN;
  return std::strtoll(json.c_str() + at + needle.size(), nullptr, 10);
}

// This test executable's path.
inline std::string SelfExe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

// True in the process RunTestInChild started for the running test (its
// `marker` names that test); a test meant only for it skips elsewhere.
inline bool InChildFor(const char* marker) {
  const char* which = std::getenv(marker);
  return which != nullptr &&
         which == std::string(::testing::UnitTest::GetInstance()
                                  ->current_test_info()
                                  ->name());
}

// Runs this test executable again with only `suite`.`test` selected, the
// environment changed by `env` in order ("K=V" sets, a bare "K" unsets) and
// `marker`=`test` set (how the child's fixture knows it runs there). Its
// stdout and stderr go to *output. True when that one test ran and passed.
inline bool RunTestInChild(const std::string& suite, const std::string& test,
                           const char* marker,
                           const std::vector<std::string>& env,
                           std::string* output) {
  const std::string out_path = ::testing::TempDir() + "/ctxpool_child_" +
                               std::to_string(getpid()) + "_" + test + ".txt";
  const std::string filter = "--gtest_filter=" + suite + "." + test;
  const std::string exe = SelfExe();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    for (const std::string& kv : env) {
      if (kv.find('=') == std::string::npos) {
        unsetenv(kv.c_str());
      } else {
        putenv(strdup(kv.c_str()));
      }
    }
    setenv(marker, test.c_str(), 1);
    execl(exe.c_str(), exe.c_str(), filter.c_str(), (char*)nullptr);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::stringstream text;
  text << std::ifstream(out_path).rdbuf();
  *output = text.str();
  std::remove(out_path.c_str());
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
         output->find("[  PASSED  ] 1 test") != std::string::npos &&
         output->find("SKIPPED") == std::string::npos;
}

}  // namespace torch_plugin_test

#endif  // CTXPOOL_TESTS_TORCH_PLUGIN_API_H_
