#include "ctxpool/trace/workloads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

constexpr std::uint64_t kPtrBase = 0x10000000000;  // as in RMM-form traces

// SplitMix64: tiny, fast, and the same on every platform.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed ^ 0x9e3779b97f4a7c15ull) {}
  std::uint64_t Next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (hi >= lo).
  std::uint64_t Uniform(std::uint64_t lo, std::uint64_t hi) {
    const std::uint64_t span = hi - lo + 1;
    if (span == 0) return Next();  // full range
    return lo + static_cast<std::uint64_t>(
                    (static_cast<unsigned __int128>(Next()) * span) >> 64);
  }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1p-53; }
  bool Bernoulli(double p) { return Unit() < p; }
  // Log-uniform in [lo, hi] (lo >= 1).
  std::uint64_t LogUniform(std::uint64_t lo, std::uint64_t hi) {
    const double a = std::log(static_cast<double>(lo));
    const double b = std::log(static_cast<double>(hi));
    const double v = std::exp(a + (b - a) * Unit());
    return std::clamp<std::uint64_t>(static_cast<std::uint64_t>(v), lo, hi);
  }

 private:
  std::uint64_t s_;
};

std::uint64_t RoundUp(std::uint64_t n, std::uint64_t to) {
  return (n + to - 1) / to * to;
}

// Appends events with unique, non-overlapping synthetic pointers and a clock
// that advances 1 us per event (plus explicit Tick()s).
class Gen {
 public:
  struct Block {
    std::uint64_t ptr = 0;
    std::uint64_t size = 0;
    std::uint64_t stream = 0;
    std::uint32_t tenant = 0;
  };

  Block Alloc(std::uint64_t size, std::uint64_t stream,
              std::uint32_t tenant = 0) {
    Block b{next_ptr_, size, stream, tenant};
    next_ptr_ += RoundUp(std::max<std::uint64_t>(size, 1), 512);
    Emit(TraceOp::kAlloc, b);
    live_bytes_ += size;
    return b;
  }
  void Free(const Block& b) {
    Emit(TraceOp::kFree, b);
    live_bytes_ -= b.size;
  }
  // A trim request (size 0) made on behalf of `stream` and `tenant`.
  void Trim(std::uint64_t stream, std::uint32_t tenant) {
    Emit(TraceOp::kTrim, Block{0, 0, stream, tenant});
  }
  void Tick(std::int64_t ns) { now_ += ns; }
  std::uint64_t live_bytes() const { return live_bytes_; }

  Trace Finish(std::string source) && {
    trace_.set_source(std::move(source));
    return std::move(trace_);
  }

 private:
  void Emit(TraceOp op, const Block& b) {
    TraceEvent e;
    e.time_ns = now_;
    e.op = op;
    e.ptr = b.ptr;
    e.size = b.size;
    e.stream = b.stream;
    e.tenant = b.tenant;
    e.thread = 1;
    trace_.Append(e);
    now_ += 1000;
  }

  Trace trace_;
  std::int64_t now_ = 0;
  std::uint64_t next_ptr_ = kPtrBase;
  std::uint64_t live_bytes_ = 0;
};

// Splits `total` bytes into `n` tensors with random proportions (each a
// multiple of 256 B, at least 256 B).
std::vector<std::uint64_t> SplitBytes(Rng& rng, std::uint64_t total, int n) {
  std::vector<double> w(static_cast<std::size_t>(n));
  double sum = 0;
  for (double& x : w) sum += (x = 0.25 + rng.Unit());
  std::vector<std::uint64_t> out;
  out.reserve(w.size());
  for (double x : w) {
    out.push_back(std::max<std::uint64_t>(
        256, RoundUp(static_cast<std::uint64_t>(static_cast<double>(total) * x /
                                                sum),
                     256)));
  }
  return out;
}

// Frees a random element of `live` (swap-remove).
void FreeRandom(Rng& rng, Gen& g, std::vector<Gen::Block>& live) {
  const std::size_t i = rng.Uniform(0, live.size() - 1);
  g.Free(live[i]);
  live[i] = live.back();
  live.pop_back();
}

std::uint64_t MixedSize(Rng& rng, double large_fraction,
                        std::uint64_t max_large) {
  if (rng.Bernoulli(large_fraction)) {
    return RoundUp(rng.LogUniform((1 << 20) + 1, max_large), 2);
  }
  return RoundUp(rng.LogUniform(1, 1 << 20), 4);
}

}  // namespace

Trace MultiModelChurn(const MultiModelChurnOptions& o) {
  Rng rng(o.seed);
  Gen g;
  struct Model {
    std::uint64_t bytes = 0;
    std::vector<Gen::Block> weights;  // empty when not loaded
  };
  std::vector<Model> models(static_cast<std::size_t>(std::max(o.models, 1)));
  for (Model& m : models) {
    m.bytes = rng.LogUniform(std::max<std::uint64_t>(o.min_model_bytes, 1),
                             std::max(o.min_model_bytes, o.max_model_bytes));
  }
  std::deque<int> resident;
  auto unload = [&](int id, bool trim) {
    Model& m = models[static_cast<std::size_t>(id)];
    // Frameworks free parameters in creation order.
    for (const Gen::Block& b : m.weights) g.Free(b);
    m.weights.clear();
    if (trim) {
      g.Trim(static_cast<std::uint64_t>(id + 1),
             static_cast<std::uint32_t>(id + 1));
    }
    g.Tick(1'000'000);
  };
  auto serve = [&](int id) {
    const Model& m = models[static_cast<std::size_t>(id)];
    const auto stream = static_cast<std::uint64_t>(id + 1);
    const auto tenant = static_cast<std::uint32_t>(id + 1);
    // Activations: a handful of tensors, a fraction of the weights each,
    // freed mostly in reverse order (a forward pass).
    const int layers = static_cast<int>(rng.Uniform(3, 8));
    std::vector<Gen::Block> acts;
    for (int l = 0; l < layers; ++l) {
      const std::uint64_t bytes =
          RoundUp(m.bytes / rng.Uniform(50, 400) + rng.Uniform(0, 4095), 256);
      acts.push_back(g.Alloc(bytes, stream, tenant));
      if (acts.size() >= 2 && rng.Bernoulli(0.7)) {
        g.Free(acts[acts.size() - 2]);
        acts.erase(acts.end() - 2);
      }
    }
    const Gen::Block out =
        g.Alloc(RoundUp(rng.Uniform(4096, 1 << 20), 256), stream, tenant);
    for (auto it = acts.rbegin(); it != acts.rend(); ++it) g.Free(*it);
    g.Free(out);
    g.Tick(static_cast<std::int64_t>(rng.Uniform(1'000'000, 20'000'000)));
  };
  const int cap = std::clamp(o.resident, 1, static_cast<int>(models.size()));
  for (int c = 0; c < o.cycles; ++c) {
    // Load a model that is not resident, evicting the oldest if full.
    std::vector<int> candidates;
    for (int i = 0; i < static_cast<int>(models.size()); ++i) {
      if (models[static_cast<std::size_t>(i)].weights.empty()) {
        candidates.push_back(i);
      }
    }
    if (candidates.empty() || static_cast<int>(resident.size()) >= cap) {
      unload(resident.front(), o.trim_after_unload);
      resident.pop_front();
      if (candidates.empty()) {
        for (int i = 0; i < static_cast<int>(models.size()); ++i) {
          if (models[static_cast<std::size_t>(i)].weights.empty()) {
            candidates.push_back(i);
          }
        }
      }
    }
    const int id = candidates[rng.Uniform(0, candidates.size() - 1)];
    Model& m = models[static_cast<std::size_t>(id)];
    for (std::uint64_t bytes :
         SplitBytes(rng, m.bytes, std::max(o.weight_tensors, 1))) {
      m.weights.push_back(g.Alloc(bytes, static_cast<std::uint64_t>(id + 1),
                                  static_cast<std::uint32_t>(id + 1)));
    }
    resident.push_back(id);
    for (int r = 0; r < o.requests_per_cycle; ++r) {
      serve(resident[rng.Uniform(0, resident.size() - 1)]);
    }
  }
  while (!resident.empty()) {
    unload(resident.front(), /*trim=*/false);
    resident.pop_front();
  }
  return std::move(g).Finish(
      absl::StrCat("workload:churn:seed=", o.seed, ",cycles=", o.cycles,
                   o.trim_after_unload ? "" : ",trim_after_unload=false"));
}

Trace LlmServing(const LlmServingOptions& o) {
  Rng rng(o.seed);
  Gen g;
  constexpr std::uint64_t kStream = 1;
  constexpr std::uint32_t kTenant = 1;
  constexpr int kLayers = 32;
  // Weights: embedding and LM head, then per layer q, k, v, o and three MLP
  // matrices (2.69x the attention ones, as in Llama).
  std::vector<Gen::Block> weights;
  const std::uint64_t embed = RoundUp(o.weights_bytes / 28, 256);
  const std::uint64_t per_layer =
      (o.weights_bytes > 2 * embed ? o.weights_bytes - 2 * embed : 0) / kLayers;
  const std::uint64_t attn =
      std::max<std::uint64_t>(256, RoundUp(per_layer * 100 / 1207, 256));
  const std::uint64_t mlp =
      std::max<std::uint64_t>(256, RoundUp(per_layer * 269 / 1207, 256));
  weights.push_back(g.Alloc(embed, kStream, kTenant));
  for (int l = 0; l < kLayers; ++l) {
    for (int i = 0; i < 4; ++i)
      weights.push_back(g.Alloc(attn, kStream, kTenant));
    for (int i = 0; i < 3; ++i)
      weights.push_back(g.Alloc(mlp, kStream, kTenant));
  }
  weights.push_back(g.Alloc(embed, kStream, kTenant));

  struct Request {
    std::uint64_t prompt = 0, output = 0, tokens = 0, kv_tokens = 0;
    Gen::Block kv;
  };
  std::deque<Request> queue;
  for (int i = 0; i < o.requests; ++i) {
    Request r;
    r.prompt = rng.Uniform(static_cast<std::uint64_t>(o.min_prompt_tokens),
                           static_cast<std::uint64_t>(o.max_prompt_tokens));
    r.output = rng.Uniform(static_cast<std::uint64_t>(o.min_output_tokens),
                           static_cast<std::uint64_t>(o.max_output_tokens));
    queue.push_back(r);
  }
  const auto grow = static_cast<std::uint64_t>(std::max(o.kv_grow_tokens, 1));
  std::vector<Request> active;
  constexpr std::uint64_t kLogitsPerToken = 32000 * 4;  // vocab x fp32
  while (!queue.empty() || !active.empty()) {
    // Admit and prefill.
    while (!queue.empty() && static_cast<int>(active.size()) < o.max_batch) {
      Request r = queue.front();
      queue.pop_front();
      const Gen::Block act =
          g.Alloc(r.prompt * o.activation_bytes_per_token, kStream, kTenant);
      r.kv_tokens = RoundUp(r.prompt + 1, grow);
      r.kv = g.Alloc(r.kv_tokens * o.kv_bytes_per_token, kStream, kTenant);
      r.tokens = r.prompt;
      g.Free(act);
      g.Tick(static_cast<std::int64_t>(r.prompt) * 20'000);
      active.push_back(r);
    }
    // One decode step for the whole batch.
    const std::uint64_t batch = active.size();
    const Gen::Block hidden =
        g.Alloc(batch * o.activation_bytes_per_token, kStream, kTenant);
    const Gen::Block logits =
        g.Alloc(batch * kLogitsPerToken, kStream, kTenant);
    for (Request& r : active) {
      ++r.tokens;
      if (r.tokens > r.kv_tokens) {  // grow: allocate larger, copy, free old
        r.kv_tokens += grow;
        const Gen::Block bigger =
            g.Alloc(r.kv_tokens * o.kv_bytes_per_token, kStream, kTenant);
        g.Free(r.kv);
        r.kv = bigger;
      }
    }
    g.Free(logits);
    g.Free(hidden);
    g.Tick(15'000'000);
    for (std::size_t i = 0; i < active.size();) {
      if (active[i].tokens >= active[i].prompt + active[i].output) {
        g.Free(active[i].kv);
        active[i] = active.back();
        active.pop_back();
      } else {
        ++i;
      }
    }
  }
  for (auto it = weights.rbegin(); it != weights.rend(); ++it) g.Free(*it);
  return std::move(g).Finish(absl::StrCat("workload:llm-serving:seed=", o.seed,
                                          ",requests=", o.requests));
}

Trace MixedSizes(const MixedSizesOptions& o) {
  Rng rng(o.seed);
  Gen g;
  std::vector<Gen::Block> live;
  const std::uint64_t max_large =
      std::max<std::uint64_t>(o.max_large_bytes, (2 << 20));
  for (int i = 0; i < o.ops; ++i) {
    const std::uint64_t size = MixedSize(rng, o.large_fraction, max_large);
    while (!live.empty() && g.live_bytes() + size > o.max_live_bytes) {
      FreeRandom(rng, g, live);
    }
    live.push_back(g.Alloc(size, o.stream));
    if (rng.Bernoulli(0.5)) FreeRandom(rng, g, live);
  }
  return std::move(g).Finish(
      absl::StrCat("workload:mixed:seed=", o.seed, ",ops=", o.ops));
}

Trace MultiStream(const MultiStreamOptions& o) {
  Rng rng(o.seed);
  Gen g;
  const int n = std::max(o.streams, 1);
  std::vector<std::vector<Gen::Block>> live(static_cast<std::size_t>(n));
  std::vector<std::uint64_t> live_bytes(static_cast<std::size_t>(n), 0);
  std::vector<int> left(static_cast<std::size_t>(n), o.ops_per_stream);
  int remaining = n * o.ops_per_stream;
  while (remaining > 0) {
    auto s = static_cast<std::size_t>(rng.Uniform(0, n - 1));
    while (left[s] == 0) s = (s + 1) % live.size();
    --left[s];
    --remaining;
    const std::uint64_t stream = s + 1;
    auto free_one = [&] {
      const std::size_t i = rng.Uniform(0, live[s].size() - 1);
      live_bytes[s] -= live[s][i].size;
      g.Free(live[s][i]);
      live[s][i] = live[s].back();
      live[s].pop_back();
    };
    const std::uint64_t size = MixedSize(rng, 0.05, 64ull << 20);
    while (!live[s].empty() &&
           live_bytes[s] + size > o.max_live_bytes_per_stream) {
      free_one();
    }
    live[s].push_back(g.Alloc(size, stream));
    live_bytes[s] += size;
    if (rng.Bernoulli(0.5)) free_one();
  }
  return std::move(g).Finish(
      absl::StrCat("workload:multi-stream:seed=", o.seed, ",streams=", n));
}

std::vector<std::string> WorkloadNames() {
  return {"churn", "llm-serving", "mixed", "multi-stream"};
}

namespace {

// One settable option field.
struct Field {
  absl::string_view key;
  std::variant<int*, std::uint64_t*, double*, bool*> target;
  bool bytes = false;  // parse with ParseByteSize
};

absl::Status ApplyFields(absl::string_view name, absl::string_view args,
                         const std::vector<Field>& fields) {
  if (args.empty()) return absl::OkStatus();
  for (absl::string_view kv : absl::StrSplit(args, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> p =
        absl::StrSplit(kv, absl::MaxSplits('=', 1));
    const Field* f = nullptr;
    for (const Field& x : fields) {
      if (x.key == p.first) f = &x;
    }
    if (f == nullptr) {
      std::vector<absl::string_view> keys;
      for (const Field& x : fields) keys.push_back(x.key);
      return absl::InvalidArgumentError(
          absl::StrCat("workload ", name, ": unknown option '", p.first,
                       "' (known: ", absl::StrJoin(keys, ", "), ")"));
    }
    bool ok = false;
    if (auto* i = std::get_if<int*>(&f->target)) {
      ok = absl::SimpleAtoi(p.second, *i) && **i >= 0;
    } else if (auto* u = std::get_if<std::uint64_t*>(&f->target)) {
      if (f->bytes) {
        absl::StatusOr<std::uint64_t> v = ParseByteSize(p.second);
        ok = v.ok();
        if (ok) **u = *v;
      } else {
        ok = absl::SimpleAtoi(p.second, *u);
      }
    } else if (auto* d = std::get_if<double*>(&f->target)) {
      ok = absl::SimpleAtod(p.second, *d);
    } else if (auto* b = std::get_if<bool*>(&f->target)) {
      ok = absl::SimpleAtob(p.second, *b);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "workload ", name, ": bad value '", p.second, "' for ", p.first));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Trace> GenerateWorkload(absl::string_view spec) {
  std::pair<absl::string_view, absl::string_view> p =
      absl::StrSplit(spec, absl::MaxSplits(':', 1));
  const absl::string_view name = p.first, args = p.second;
  if (name == "churn") {
    MultiModelChurnOptions o;
    CTXPOOL_RETURN_IF_ERROR(
        ApplyFields(name, args,
                    {{"seed", &o.seed},
                     {"models", &o.models},
                     {"cycles", &o.cycles},
                     {"resident", &o.resident},
                     {"min_model_bytes", &o.min_model_bytes, true},
                     {"max_model_bytes", &o.max_model_bytes, true},
                     {"weight_tensors", &o.weight_tensors},
                     {"requests_per_cycle", &o.requests_per_cycle},
                     {"trim_after_unload", &o.trim_after_unload}}));
    if (o.models < 1 || o.cycles < 1 || o.weight_tensors < 1 ||
        o.min_model_bytes > o.max_model_bytes) {
      return absl::InvalidArgumentError("workload churn: bad options");
    }
    o.resident = std::clamp(o.resident, 1, o.models);
    return MultiModelChurn(o);
  }
  if (name == "llm-serving") {
    LlmServingOptions o;
    CTXPOOL_RETURN_IF_ERROR(ApplyFields(
        name, args,
        {{"seed", &o.seed},
         {"requests", &o.requests},
         {"max_batch", &o.max_batch},
         {"min_prompt_tokens", &o.min_prompt_tokens},
         {"max_prompt_tokens", &o.max_prompt_tokens},
         {"min_output_tokens", &o.min_output_tokens},
         {"max_output_tokens", &o.max_output_tokens},
         {"weights_bytes", &o.weights_bytes, true},
         {"kv_bytes_per_token", &o.kv_bytes_per_token, true},
         {"kv_grow_tokens", &o.kv_grow_tokens},
         {"activation_bytes_per_token", &o.activation_bytes_per_token, true}}));
    if (o.requests < 1 || o.max_batch < 1 || o.kv_grow_tokens < 1 ||
        o.min_prompt_tokens > o.max_prompt_tokens ||
        o.min_output_tokens > o.max_output_tokens) {
      return absl::InvalidArgumentError("workload llm-serving: bad options");
    }
    return LlmServing(o);
  }
  if (name == "mixed") {
    MixedSizesOptions o;
    CTXPOOL_RETURN_IF_ERROR(
        ApplyFields(name, args,
                    {{"seed", &o.seed},
                     {"ops", &o.ops},
                     {"large_fraction", &o.large_fraction},
                     {"max_large_bytes", &o.max_large_bytes, true},
                     {"max_live_bytes", &o.max_live_bytes, true},
                     {"stream", &o.stream}}));
    if (o.ops < 1 || o.large_fraction < 0 || o.large_fraction > 1) {
      return absl::InvalidArgumentError("workload mixed: bad options");
    }
    return MixedSizes(o);
  }
  if (name == "multi-stream") {
    MultiStreamOptions o;
    CTXPOOL_RETURN_IF_ERROR(ApplyFields(
        name, args,
        {{"seed", &o.seed},
         {"streams", &o.streams},
         {"ops_per_stream", &o.ops_per_stream},
         {"max_live_bytes_per_stream", &o.max_live_bytes_per_stream, true}}));
    if (o.streams < 1 || o.ops_per_stream < 1) {
      return absl::InvalidArgumentError("workload multi-stream: bad options");
    }
    return MultiStream(o);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown workload '", name,
                   "' (known: ", absl::StrJoin(WorkloadNames(), ", "), ")"));
}

}  // namespace ctxpool
