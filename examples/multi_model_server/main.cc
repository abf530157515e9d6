// multi_model_server — several models in one process, one context per GPU.
//
// Each model gets a thread and a ModelSession on device 0: its own leased
// streams, a memory budget and an allocator charged to it, all on the one
// primary context the Runtime retained. Each model warms up for its request
// mix, serves requests (allocate activations, enqueue work, free — no
// driver allocation after the warm-up), and closes its session, which
// would report any allocation it forgot. At the end the program prints the
// Prometheus metrics and what one context per model would have cost.
//
//   $ ./multi_model_server --models=4 --requests=100
//   multi_model_server: driver: sim (...), chosen by 'auto' because ...
//   ...
//   multi_model_server: served 400 requests for 4 models on 1 context(s)
//
// Runs on a GPU when one is present (CTXPOOL_DRIVER=auto), on the simulated
// GPU otherwise; CTXPOOL_DRIVER=sim:a10-24gb picks a simulated device.
// --leak makes the last model forget one allocation, to show the report.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ctxpool/ctxpool.h"

namespace {

using ::ctxpool::DeviceContext;
using ::ctxpool::DevicePtr;
using ::ctxpool::ModelSession;
using ::ctxpool::StreamHandle;
using ::ctxpool::WarmupPlan;

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct Model {
  std::string name;
  int streams;
  std::size_t max_bytes;
  WarmupPlan mix;  // one request's allocations, all live at once
};

// A few model shapes; model i uses shape i % 4 with its own name.
Model MakeModel(int i) {
  const int shape = i % 4;
  Model m;
  m.name = absl::StrCat(
      (const char*[]){"bert", "resnet50", "whisper", "llama"}[shape], "-", i);
  switch (shape) {
    case 0:  // encoder: a few medium activations
      m.streams = 1;
      m.mix.items = {{0, 24 * kMiB, 2}, {0, 512 << 10, 8}};
      break;
    case 1:  // CNN: many small buffers
      m.streams = 2;
      m.mix.items = {{0, 6 * kMiB, 4}, {1, 64 << 10, 16}};
      break;
    case 2:  // encoder-decoder on two streams
      m.streams = 2;
      m.mix.items = {{0, 48 * kMiB, 1}, {1, 8 * kMiB, 3}};
      break;
    default:  // decoder: a big KV block and scratch
      m.streams = 1;
      m.mix.items = {{0, 96 * kMiB, 1}, {0, 2 * kMiB, 4}};
      break;
  }
  m.mix.events = 1;
  m.max_bytes = 1024 * kMiB;
  return m;
}

// One request: allocate the mix, "run" it (a memset per buffer on its
// stream), record completion, free. Stream order makes the frees safe
// without waiting.
absl::Status Serve(ModelSession& session, const WarmupPlan& mix,
                   ctxpool::Driver& driver) {
  std::vector<std::pair<DevicePtr, std::size_t>> buffers;
  absl::Status status;
  for (const WarmupPlan::Item& item : mix.items) {
    const StreamHandle stream = session.stream(item.stream_index);
    for (int k = 0; k < item.count && status.ok(); ++k) {
      absl::StatusOr<DevicePtr> p =
          session.Allocate(item.bytes, stream, "activation");
      if (!p.ok()) {
        status = p.status();
        break;
      }
      buffers.emplace_back(*p, item.bytes);
      status = driver.MemsetD8Async(*p, 0, item.bytes, stream);
    }
  }
  absl::StatusOr<ctxpool::EventHandle> done = session.AcquireEvent();
  if (done.ok()) {
    if (status.ok()) status = driver.EventRecord(*done, session.stream(0));
    session.ReleaseEvent(*done).IgnoreError();
  } else if (status.ok()) {
    status = done.status();
  }
  for (const auto& [p, bytes] : buffers) {
    absl::Status s = session.Deallocate(p);
    if (status.ok()) status = s;
  }
  return status;
}

absl::Status RunModel(DeviceContext& gpu, const Model& model, int requests,
                      bool leak) {
  // Work this thread enqueues itself (the memsets) needs the context current.
  CTXPOOL_RETURN_IF_ERROR(gpu.MakeCurrent());
  CTXPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<ModelSession> session,
      gpu.OpenSession(model.name, {.streams = model.streams,
                                   .max_bytes = model.max_bytes}));
  CTXPOOL_RETURN_IF_ERROR(session->Warmup(model.mix));
  for (int r = 0; r < requests; ++r) {
    CTXPOOL_RETURN_IF_ERROR(Serve(*session, model.mix, gpu.driver()));
  }
  if (leak) {
    CTXPOOL_RETURN_IF_ERROR(
        session->Allocate(kMiB, session->stream(0), "forgotten_kv_cache")
            .status());
  }
  absl::Status closed = session->Close();
  if (!closed.ok()) {
    std::printf("multi_model_server: %s\n",
                std::string(closed.message()).c_str());
  }
  return leak ? absl::OkStatus() : closed;
}

int Flag(int argc, char** argv, absl::string_view name, int fallback) {
  const std::string prefix = absl::StrCat("--", name, "=");
  for (int i = 1; i < argc; ++i) {
    int v = 0;
    if (absl::StartsWith(argv[i], prefix) &&
        absl::SimpleAtoi(argv[i] + prefix.size(), &v) && v > 0) {
      return v;
    }
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int models = Flag(argc, argv, "models", 4);
  const int requests = Flag(argc, argv, "requests", 100);
  bool leak = false;
  for (int i = 1; i < argc; ++i) leak |= std::string(argv[i]) == "--leak";

  absl::StatusOr<std::unique_ptr<ctxpool::Runtime>> rt =
      ctxpool::Runtime::Create();
  if (!rt.ok()) {
    std::fprintf(stderr, "multi_model_server: %s\n",
                 rt.status().ToString().c_str());
    return 1;
  }
  std::printf("multi_model_server: %s\n", (*rt)->driver_note().c_str());
  DeviceContext* gpu = *(*rt)->device(0);
  std::printf("%s", gpu->initial_context_report().ToString().c_str());

  std::vector<std::thread> threads;
  std::vector<absl::Status> results(models);
  for (int i = 0; i < models; ++i) {
    threads.emplace_back([&, i] {
      results[i] =
          RunModel(*gpu, MakeModel(i), requests, leak && i == models - 1);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (int i = 0; i < models; ++i) {
    if (!results[i].ok()) {
      ++failed;
      std::fprintf(stderr, "multi_model_server: %s: %s\n",
                   MakeModel(i).name.c_str(), results[i].ToString().c_str());
    }
  }

  std::printf("%s", ctxpool::RenderPrometheus(**rt).c_str());
  const ctxpool::DeviceContextStats st = gpu->Stats();
  const std::size_t context = gpu->initial_context_report().context_bytes;
  std::printf(
      "multi_model_server: %d models shared %d context(s) (%.0f MiB); one "
      "context per model would take %.0f MiB; %d streams served %lld "
      "sessions\n",
      models, st.primary_retains, static_cast<double>(context) / kMiB,
      static_cast<double>(context) * models / kMiB, st.streams_created,
      static_cast<long long>(st.sessions_opened));
  if (failed != 0) return 1;
  std::printf(
      "multi_model_server: served %d requests for %d models on %d "
      "context(s)\n",
      models * requests, models, st.primary_retains);
  return 0;
}
