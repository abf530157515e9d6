// tools/commands.h — the subcommands of the `ctxpool` command line tool.
//
// `ctxpool <command> [args...]` looks <command> up in CTXPOOL_TOOL_COMMANDS
// below and calls its run function with argv[0] == the command name. A run
// function returns the process exit status: 0 on success, 1 on failure, 2 on
// a usage error (print the command's usage to stderr first).
//
// Adding a command takes one file and one line:
//
//   1. tools/demo.cc (picked up by tools/CMakeLists.txt's glob):
//
//        #include "tools/commands.h"
//        namespace ctxpool::tool {
//        int RunDemo(int argc, char** argv) { ...; return 0; }
//        }  // namespace ctxpool::tool
//
//   2. one line in CTXPOOL_TOOL_COMMANDS:
//
//        X("demo", "run N simulated models on one device", RunDemo)
//
// The list declares each run function and builds the table main.cc
// dispatches through, so nothing else needs editing. Keep it sorted by name.
#ifndef CTXPOOL_TOOLS_COMMANDS_H_
#define CTXPOOL_TOOLS_COMMANDS_H_

// X(name, one-line help, run function), one line per command.
#define CTXPOOL_TOOL_COMMANDS(X)                                             \
  X("costs",                                                                 \
    "time each driver call kind and write SimDriver's cost table (JSON)",    \
    RunCosts)                                                                \
  X("demo", "run a multi-model server today vs with ctxpool, side by side",  \
    RunDemo)                                                                 \
  X("info",                                                                  \
    "show the build, the CUDA driver, the devices (or the simulated "        \
    "fallback)",                                                             \
    RunInfo)                                                                 \
  X("plan",                                                                  \
    "will these models fit on one GPU: replicas, budgets, today vs ctxpool", \
    RunPlan)                                                                 \
  X("replay", "replay an allocation trace on a simulated device or the GPU", \
    RunReplay)                                                               \
  X("report", "summarise an allocation trace as a table", RunReport)

namespace ctxpool::tool {

// One subcommand of the tool.
struct Command {
  const char* name;  // what the user types: "info"
  const char* help;  // one line for `ctxpool --help`
  // argv[0] is the command name; argv[argc] is nullptr.
  int (*run)(int argc, char** argv);
};

#define CTXPOOL_TOOL_DECLARE_COMMAND_(name, help, fn) int fn(int, char**);
CTXPOOL_TOOL_COMMANDS(CTXPOOL_TOOL_DECLARE_COMMAND_)
#undef CTXPOOL_TOOL_DECLARE_COMMAND_

}  // namespace ctxpool::tool

#endif  // CTXPOOL_TOOLS_COMMANDS_H_
