// libtorch with ctxpool as its CUDA allocator: two models, one process,
// each charged to its own ctxpool model session. Built only when CMake finds
// Torch (see plugins/torch/CMakeLists.txt).
#include <torch/torch.h>

#include <iostream>

#include "ctxpool_torch_allocator.h"

int main() {
  if (!torch::cuda::is_available()) {
    std::cout << "skipped: no CUDA\n";
    return 0;
  }
  ctxpool_torch::InstallAllocator();
  torch::nn::Linear a(1024, 1024), b(1024, 4096);
  {
    ctxpool_torch::ScopedModel m("a");
    a->to(torch::kCUDA);
  }
  {
    ctxpool_torch::ScopedModel m("b");
    b->to(torch::kCUDA);
  }
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 10; ++i) {
    ctxpool_torch::ScopedModel m(i % 2 ? "a" : "b");
    auto x = torch::randn({64, 1024}, torch::kCUDA);
    auto y = (i % 2 ? a->forward(x) : b->forward(x));
    (void)y.sum().item<float>();
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::cout << ctxpool_memory_stats(0) << "\n";
  return 0;
}
