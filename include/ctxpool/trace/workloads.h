// ctxpool/trace/workloads.h — seeded synthetic allocation workloads.
//
// Each generator returns a valid Trace (every free names a live allocation)
// that is a pure function of its options: the same options, seed included,
// give the same trace on every platform (the generators use their own
// SplitMix64 stream, not <random>'s distributions). They model the patterns
// that fragment caching allocators:
//
//   MultiModelChurn  models of different sizes are loaded (weights), serve
//                    requests (activations) and are unloaded, `cycles` times;
//                    each model has its own stream and tenant id. A server
//                    trims after it unloads a model: with trim_after_unload
//                    each unload inside the cycles is followed by a kTrim
//                    event (size 0, the unloaded model's stream and tenant;
//                    the trim itself is device-wide) — a trim point,
//                    where a replay calls Trim(0) and measures what stays
//                    reserved (replay.h).
//   LlmServing       one set of weights, then requests with random prompt and
//                    output lengths batched together; each request's KV cache
//                    grows by reallocation (allocate larger, free old) as it
//                    decodes, plus per-step temporaries.
//   MixedSizes       mostly small tensors (512 B – 1 MiB) with a few large
//                    ones (1 MiB – max_large), random lifetimes, bounded live.
//   MultiStream      MixedSizes-like traffic on several streams, interleaved.
//
//   Trace t = LlmServing({.seed = 7, .requests = 100});
//   ReplayResult r = *Replay(t, {});
//
// GenerateWorkload("llm-serving:seed=7,requests=100") builds the same trace
// from a spec string (what `ctxpool replay workload:...` uses).
//
// Thread-safety: all functions are pure.
#ifndef CTXPOOL_TRACE_WORKLOADS_H_
#define CTXPOOL_TRACE_WORKLOADS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/trace/trace.h"

namespace ctxpool {

struct MultiModelChurnOptions {
  std::uint64_t seed = 1;
  int models = 6;    // distinct models (tenant ids 1..models)
  int cycles = 100;  // load / serve / unload cycles
  int resident = 3;  // models loaded at once
  std::uint64_t min_model_bytes = 256ull << 20;
  std::uint64_t max_model_bytes = 4ull << 30;
  int weight_tensors = 24;     // per model
  int requests_per_cycle = 8;  // served by the model loaded in a cycle
  // Append a kTrim event after each unload inside the cycles (not after the
  // final teardown, which unloads every model).
  bool trim_after_unload = true;
};
// REQUIRES: models >= resident >= 1, cycles >= 1, weight_tensors >= 1,
// min_model_bytes <= max_model_bytes.
Trace MultiModelChurn(const MultiModelChurnOptions& options);

struct LlmServingOptions {
  std::uint64_t seed = 1;
  int requests = 64;
  int max_batch = 8;  // requests decoding at once
  int min_prompt_tokens = 16;
  int max_prompt_tokens = 2048;
  int min_output_tokens = 16;
  int max_output_tokens = 512;
  std::uint64_t weights_bytes = 14ull << 30;  // a 7B model in fp16
  // K and V for all layers (32 layers x 2 x 4096 x fp16 = 512 KiB/token).
  std::uint64_t kv_bytes_per_token = 512 << 10;
  int kv_grow_tokens = 128;  // the cache is reallocated in steps of this
  std::uint64_t activation_bytes_per_token = 64 << 10;
};
// REQUIRES: requests >= 1, max_batch >= 1, min <= max for each range,
// kv_grow_tokens >= 1.
Trace LlmServing(const LlmServingOptions& options);

struct MixedSizesOptions {
  std::uint64_t seed = 1;
  int ops = 20000;              // allocations (each later freed or left live)
  double large_fraction = 0.1;  // of allocations that are large
  std::uint64_t max_large_bytes = 256ull << 20;
  std::uint64_t max_live_bytes = 4ull << 30;  // frees keep live below this
  std::uint64_t stream = 0;
};
// REQUIRES: ops >= 1, 0 <= large_fraction <= 1, max_large_bytes > 1 MiB.
Trace MixedSizes(const MixedSizesOptions& options);

struct MultiStreamOptions {
  std::uint64_t seed = 1;
  int streams = 4;  // stream ids 1..streams
  int ops_per_stream = 5000;
  std::uint64_t max_live_bytes_per_stream = 1ull << 30;
};
// REQUIRES: streams >= 1, ops_per_stream >= 1.
Trace MultiStream(const MultiStreamOptions& options);

// "churn", "llm-serving", "mixed", "multi-stream".
std::vector<std::string> WorkloadNames();
// Builds a workload from "NAME[:key=value,...]"; keys are the option field
// names (seed, models, cycles, requests, max_batch, ops, streams, ...), byte
// fields accept sizes such as 4GiB, boolean fields (trim_after_unload)
// true/false/1/0. INVALID_ARGUMENT for unknown names/keys.
absl::StatusOr<Trace> GenerateWorkload(absl::string_view spec);

}  // namespace ctxpool

#endif  // CTXPOOL_TRACE_WORKLOADS_H_
