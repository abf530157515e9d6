// Tests of ctxpool/interop/cuda_mr.h on SimDriver: the CCCL concepts, and
// allocations through cuda::mr's type-erased resource_ref. Built where CCCL's
// headers are found (tests/interop.cmake); needs nothing from CUDA but its
// headers.
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "ctxpool/interop/cuda_mr.h"
#include "gtest/gtest.h"
#include "interop/interop_fixture.h"

namespace ctxpool::interop {
namespace {

constexpr std::size_t kMiB = kInteropMiB;

// ---- The concepts ---------------------------------------------------------

#if CTXPOOL_CCCL_STREAM_ORDERED_NAMES
static_assert(
    cuda::mr::resource_with<MemoryResource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<MemoryResource,
                                                  cuda::mr::device_accessible>);
static_assert(
    !cuda::mr::resource_with<MemoryResource, cuda::mr::host_accessible>);
#else
static_assert(
    cuda::mr::async_resource_with<MemoryResource, cuda::mr::device_accessible>);
static_assert(
    cuda::mr::resource_with<MemoryResource, cuda::mr::device_accessible>);
static_assert(
    !cuda::mr::async_resource_with<MemoryResource, cuda::mr::host_accessible>);
#endif

// CCCL 3.1's spelling (PR 5313), checked here whatever CCCL is installed, so
// the class keeps satisfying the newer concept too.
template <class R>
concept StreamOrderedResource31 = requires(R& r, void* p, std::size_t n,
                                           std::size_t a, cuda::stream_ref s) {
  { r.allocate(s, n, a) } -> std::same_as<void*>;
  { r.deallocate(s, p, n, a) } -> std::same_as<void>;
  { r.allocate_sync(n, a) } -> std::same_as<void*>;
  { r.deallocate_sync(p, n, a) } -> std::same_as<void>;
  requires std::equality_comparable<R>;
};
static_assert(StreamOrderedResource31<MemoryResource>);
static_assert(std::is_nothrow_copy_constructible_v<MemoryResource>);
static_assert(sizeof(MemoryResource) <= 4 * sizeof(void*));

class InteropCudaMrTest : public InteropFixture {
 protected:
  cuda::stream_ref ref(int i) const { return ToStreamRef(bert_->stream(i)); }
};

TEST_F(InteropCudaMrTest, StreamRefMapsToStreamHandle) {
  const StreamHandle s = bert_->stream(0);
  EXPECT_EQ(ToStreamHandle(ToStreamRef(s)), s);
  EXPECT_EQ(ToStreamRef(s).get(), s.as<cudaStream_t>());
}

TEST_F(InteropCudaMrTest, AllocatorResourceRefAllocatesThroughThePool) {
  MemoryResource mr(alloc());
  device_resource_ref r = mr;
  const std::int64_t allocs = Allocs();
  void* p = r.allocate_async(1 * kMiB, 256, ref(0));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(Live(), static_cast<std::int64_t>(1 * kMiB));
  EXPECT_EQ(Allocs(), allocs + 1);
  ASSERT_TRUE(sim_->Touch(bert_->stream(0), DevicePtr::From(p), kMiB).ok());
  r.deallocate_async(p, 1 * kMiB, 256, ref(0));
  EXPECT_EQ(Live(), 0);
  EXPECT_EQ(bert_->Stats().num_allocs, 0);  // nobody's: the plain pool
}

TEST_F(InteropCudaMrTest, SessionResourceChargesTheModelAndEnforcesItsMax) {
  MemoryResource mr(*bert_);
  device_resource_ref r = mr;
  void* a = r.allocate_async(6 * kMiB, 256, ref(0));
  EXPECT_EQ(bert_->Stats().live_bytes, 6 * kMiB);
  try {
    (void)r.allocate_async(3 * kMiB, 256, ref(1));  // 9 MiB > 8 MiB
    ADD_FAILURE() << "no exception";
  } catch (const BadAlloc& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(e.what()).find("bert"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(bert_->Stats().num_budget_rejections, 1);
  EXPECT_EQ(bert_->Stats().live_bytes, 6 * kMiB);  // unchanged
  r.deallocate_async(a, 6 * kMiB, 256, ref(0));
  EXPECT_EQ(bert_->Stats().live_bytes, 0u);
}

TEST_F(InteropCudaMrTest, DeviceOutOfMemoryThrowsWithTheReport) {
  Init("4GiB");
  MemoryResource mr(alloc());
  device_resource_ref r = mr;
  void* a = r.allocate_async(3ull << 30, 256, ref(0));
  try {
    (void)r.allocate_async(3ull << 30, 256, ref(0));
    ADD_FAILURE() << "no exception";
  } catch (const std::bad_alloc& e) {  // what cuda::mr users catch
    EXPECT_NE(std::string(e.what()).find("out of memory: requested"),
              std::string::npos)
        << e.what();
  }
  r.deallocate_async(a, 3ull << 30, 256, ref(0));
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCudaMrTest, CopiesAreEqualOthersAreNot) {
  MemoryResource a(*bert_);
  MemoryResource b = a;
  EXPECT_TRUE(a == b);
  EXPECT_TRUE(a == MemoryResource(*bert_, bert_->stream(1)));  // same owner
  EXPECT_TRUE(a != MemoryResource(alloc()));
  device_resource_ref ra = a;
  device_resource_ref rb = b;
  EXPECT_TRUE(ra == rb);
  MemoryResource c(alloc());
  device_resource_ref rc = c;
  EXPECT_FALSE(ra == rc);
}

TEST_F(InteropCudaMrTest, BadAlignmentThrowsInvalidArgument) {
  MemoryResource mr(alloc());
  EXPECT_EQ(mr.max_alignment(), 256u);
  void* p = mr.allocate_async(4096, 256, ref(0));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  mr.deallocate_async(p, 4096, 256, ref(0));
  for (std::size_t align : {0u, 3u, 512u, 4096u}) {
    try {
      (void)mr.allocate_async(4096, align, ref(0));
      ADD_FAILURE() << "alignment " << align << " accepted";
    } catch (const BadAlloc& e) {
      EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCudaMrTest, RefusedDeallocateIsCountedAndFreesNothing) {
  MemoryResource mr(*bert_);
  void* p = mr.allocate_async(4096, 256, ref(0));
  mr.deallocate_async(p, 2048, 256, ref(0));  // wrong size
  EXPECT_EQ(MemoryResource::last_error().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bert_->Stats().invalid_frees, 1);
  EXPECT_EQ(bert_->Stats().live_allocations, 1);
  mr.deallocate_async(p, 4096, 256, ref(0));
  EXPECT_EQ(bert_->Stats().live_allocations, 0);
  int x = 0;
  mr.deallocate_async(&x, 4, 256, ref(0));  // a host pointer
  EXPECT_EQ(bert_->Stats().invalid_frees, 2);
}

TEST_F(InteropCudaMrTest, PlainResourceCannotFreeAModelsBlock) {
  MemoryResource model(*bert_);
  MemoryResource pool(alloc());
  void* p = model.allocate_async(4096, 256, ref(0));
  pool.deallocate_async(p, 4096, 256, ref(0));
  EXPECT_EQ(MemoryResource::last_error().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bert_->Stats().live_allocations, 1);
  model.deallocate_async(p, 4096, 256, ref(0));
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCudaMrTest, SynchronousCallsWaitForTheSyncStream) {
  MemoryResource mr(*bert_, bert_->stream(1));
  const std::uint64_t syncs = sim_->call_count(SimCall::kStreamSynchronize);
  void* p = mr.allocate(4096, 256);  // CCCL <= 3.0 spelling
  EXPECT_EQ(sim_->call_count(SimCall::kStreamSynchronize), syncs + 1);
  EXPECT_EQ(bert_->Stats().live_bytes, 4096u);
  mr.deallocate(p, 4096, 256);
  void* q = mr.allocate_sync(4096);  // CCCL >= 3.1 spelling
  EXPECT_EQ(sim_->call_count(SimCall::kStreamSynchronize), syncs + 2);
  mr.deallocate_sync(q, 4096);
  EXPECT_EQ(bert_->Stats().live_bytes, 0u);
}

TEST_F(InteropCudaMrTest, NewSpellingMembersAreStreamOrdered) {
  MemoryResource mr(*bert_);
  sim_->Hold(bert_->stream(1));
  void* p = mr.allocate(ref(0), 64 << 10);
  ASSERT_TRUE(sim_->Touch(bert_->stream(1), DevicePtr::From(p), 64 << 10).ok());
  mr.deallocate(ref(1), p, 64 << 10);  // after stream 1's pending work
  void* q = mr.allocate(ref(0), 64 << 10, 256);
  ASSERT_TRUE(sim_->Touch(bert_->stream(0), DevicePtr::From(q), 64 << 10).ok());
  sim_->Release(bert_->stream(1));
  EXPECT_EQ(sim_->race_count(), 0u);
  mr.deallocate(ref(0), q, 64 << 10, 256);
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCudaMrTest, WarmPairsMakeNoDriverCall) {
  MemoryResource mr(*bert_);
  device_resource_ref r = mr;
  r.deallocate_async(r.allocate_async(256 << 10, 256, ref(0)), 256 << 10, 256,
                     ref(0));
  const std::uint64_t calls = sim_->total_call_count();
  for (int i = 0; i < 500; ++i) {
    void* p = r.allocate_async(256 << 10, 256, ref(0));
    r.deallocate_async(p, 256 << 10, 256, ref(0));
  }
  EXPECT_EQ(sim_->total_call_count(), calls);
}

}  // namespace
}  // namespace ctxpool::interop
