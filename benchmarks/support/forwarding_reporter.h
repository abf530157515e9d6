// ForwardingReporter: a Google Benchmark reporter that shows every run
// through the usual display reporter and hands each successful run to a
// subclass, which keeps the figures for the ratio table the benchmark prints
// after the runs:
//
//   class Table final : public ForwardingReporter {
//    public:
//     using ForwardingReporter::ForwardingReporter;
//    private:
//     void Collect(const Run& run) override { /* keep run's counters */ }
//   };
//   Table table(display.get());
//   benchmark::RunSpecifiedBenchmarks(&table);
//   if (table.errors() != 0) return 1;
//
// Not thread-safe; Google Benchmark calls reporters from one thread.
#ifndef CTXPOOL_BENCHMARKS_SUPPORT_FORWARDING_REPORTER_H_
#define CTXPOOL_BENCHMARKS_SUPPORT_FORWARDING_REPORTER_H_

#include <vector>

#include "benchmark/benchmark.h"

namespace ctxpool::bench {

class ForwardingReporter : public benchmark::BenchmarkReporter {
 public:
  // REQUIRES: `display` outlives this reporter.
  explicit ForwardingReporter(benchmark::BenchmarkReporter* display)
      : display_(display) {}

  bool ReportContext(const Context& context) override {
    return display_->ReportContext(context);
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    display_->ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) {
        ++errors_;
      } else {
        Collect(run);
      }
    }
  }
  void Finalize() override { display_->Finalize(); }

  // Runs that reported an error.
  int errors() const { return errors_; }
  // True when the display reporter is the console (the table is printed).
  bool console() const {
    return dynamic_cast<benchmark::ConsoleReporter*>(display_) != nullptr;
  }

 private:
  // Called for each run without an error, iterations and aggregates alike.
  virtual void Collect(const Run& run) = 0;

  benchmark::BenchmarkReporter* display_;
  int errors_ = 0;
};

}  // namespace ctxpool::bench

#endif  // CTXPOOL_BENCHMARKS_SUPPORT_FORWARDING_REPORTER_H_
