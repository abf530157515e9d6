// ctxpool/ctxpool.h — everything in one include.
//
// ctxpool gives a multi-model GPU server one CUDA context per device, a
// session per model (streams, a memory budget, allocators charged to it) and
// caching allocators that measure and return their memory. Programs that do
// not care about compile times include this header; libraries include the
// layer headers they use.
//
//   #include "ctxpool/ctxpool.h"
//
//   auto rt = ctxpool::Runtime::Create();          // GPU, or the simulator
//   ctxpool::DeviceContext* gpu0 = *(*rt)->device(0);
//   auto bert = gpu0->OpenSession("bert", {.max_bytes = 8ull << 30});
//   auto p = (*bert)->Allocate(1 << 20, (*bert)->stream(0));
//   std::cout << ctxpool::RenderPrometheus(**rt);
//
// Layers, each using only those before it: driver (the seam to CUDA),
// core (CUDA-free algorithms), alloc (the allocators), context (Runtime,
// DeviceContext, ModelSession), trace, telemetry.
#ifndef CTXPOOL_CTXPOOL_H_
#define CTXPOOL_CTXPOOL_H_

#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/core/block.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/core/fragmentation.h"
#include "ctxpool/core/free_index.h"
#include "ctxpool/core/host_size_classes.h"
#include "ctxpool/core/segment.h"
#include "ctxpool/core/size_classes.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"
#include "ctxpool/telemetry/json.h"
#include "ctxpool/telemetry/prometheus.h"
#include "ctxpool/trace/recorder.h"
#include "ctxpool/trace/replay.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"

#endif  // CTXPOOL_CTXPOOL_H_
