// The `ctxpool` command line tool: dispatches to the subcommands listed in
// tools/commands.h.
#include <cstdio>
#include <cstring>

#include "absl/synchronization/mutex.h"
#include "tools/commands.h"

namespace ctxpool::tool {
namespace {

#define CTXPOOL_TOOL_TABLE_ENTRY_(name, help, fn) Command{name, help, fn},
constexpr Command kCommands[] = {
    CTXPOOL_TOOL_COMMANDS(CTXPOOL_TOOL_TABLE_ENTRY_)};
#undef CTXPOOL_TOOL_TABLE_ENTRY_

void PrintUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: ctxpool <command> [args...]\n"
               "       ctxpool <command> --help\n\n"
               "CUDA context and memory pooling: tools.\n\ncommands:\n");
  for (const Command& command : kCommands) {
    std::fprintf(out, "  %-10s %s\n", command.name, command.help);
  }
  std::fprintf(out,
               "\nenvironment:\n"
               "  CTXPOOL_LIBCUDA  path of the CUDA driver library "
               "(default libcuda.so.1)\n"
               "  CTXPOOL_DRIVER   simulated device when no GPU is usable "
               "(default sim:h100-80gb)\n");
}

}  // namespace
}  // namespace ctxpool::tool

int main(int argc, char** argv) {
  using ctxpool::tool::kCommands;
  // Debian's Abseil is built without NDEBUG, so absl::Mutex would run its
  // deadlock detection (a graph update per lock) in every SimDriver call of
  // a replay or plan; a release build of Abseil does not.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 ||
      std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "help") == 0) {
    ctxpool::tool::PrintUsage(stderr);
    return 2;
  }
  for (const ctxpool::tool::Command& command : kCommands) {
    if (std::strcmp(argv[1], command.name) == 0) {
      return command.run(argc - 1, argv + 1);
    }
  }
  std::fprintf(stderr, "ctxpool: unknown command '%s'\n\n", argv[1]);
  ctxpool::tool::PrintUsage(stderr);
  return 2;
}
