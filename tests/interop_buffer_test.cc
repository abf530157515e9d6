// Tests of ctxpool/interop/buffer.h and memory_ref.h on SimDriver.
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ctxpool/interop/buffer.h"
#include "ctxpool/interop/memory_ref.h"
#include "gtest/gtest.h"
#include "heap_counter.h"
#include "interop/interop_fixture.h"

namespace ctxpool::interop {
namespace {

constexpr std::size_t kMiB = kInteropMiB;

using InteropTest = InteropFixture;

// ---- MemoryRef ------------------------------------------------------------

TEST_F(InteropTest, MemoryRefChargesTheSessionOrNobody) {
  MemoryRef pool(alloc());
  MemoryRef model(*bert_);
  EXPECT_FALSE(pool == model);
  EXPECT_TRUE(model == MemoryRef(*bert_));
  EXPECT_EQ(model.session(), bert_.get());
  EXPECT_EQ(pool.session(), nullptr);
  static_assert(std::is_trivially_copyable_v<MemoryRef>);

  DevicePtr a = model.Allocate(4096, s0(), "scratch").value();
  DevicePtr b = pool.Allocate(4096, s0()).value();
  EXPECT_EQ(bert_->Stats().live_bytes, 4096u);
  std::vector<LiveAllocation> live = bert_->LiveAllocations();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].ptr, a);
  EXPECT_STREQ(live[0].label, "scratch");
  EXPECT_EQ(live[0].ptr.address() % model.max_alignment(), 0u);
  EXPECT_TRUE(model.Deallocate(a, 4096, s0()).ok());
  EXPECT_TRUE(pool.Deallocate(b, 4096, s0()).ok());
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropTest, MemoryRefRefusesWrongSizeForeignAndDoubleFrees) {
  MemoryRef model(*bert_);
  DevicePtr a = model.Allocate(4096, s0()).value();
  absl::Status s = model.Deallocate(a, 4095, s0());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(bert_->Stats().live_allocations, 1);  // nothing freed
  EXPECT_EQ(bert_->Stats().invalid_frees, 1);

  // Another model's ref cannot free bert's block.
  auto gpt = std::move(dc_->OpenSession("gpt", {.streams = 1})).value();
  EXPECT_EQ(MemoryRef(*gpt).Deallocate(a, 4096, s0()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bert_->Stats().live_allocations, 1);

  EXPECT_TRUE(model.Deallocate(a, 4096, s0()).ok());
  EXPECT_EQ(model.Deallocate(a, 4096, s0()).code(),
            absl::StatusCode::kInvalidArgument);  // double free
  EXPECT_EQ(model.Deallocate(DevicePtr(0x1234), 1, s0()).code(),
            absl::StatusCode::kInvalidArgument);  // foreign
  EXPECT_TRUE(gpt->Close().ok());
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropTest, PlainRefCannotFreeAModelsBlock) {
  MemoryRef pool(alloc());
  MemoryRef model(*bert_);
  DevicePtr a = model.Allocate(4096, s0()).value();
  const std::int64_t invalid = alloc().Stats().invalid_frees;
  absl::Status s = pool.Deallocate(a, 4096, s0());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(bert_->Stats().live_allocations, 1);  // still bert's
  EXPECT_EQ(alloc().Stats().invalid_frees, invalid + 1);
  EXPECT_EQ(LastFreeError().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(model.Deallocate(a, 4096, s0()).ok());
}

TEST_F(InteropTest, RefusedSessionFreeNamesTheModel) {
  MemoryRef model(*bert_);
  DevicePtr a = model.Allocate(4096, s0()).value();
  absl::Status s = model.Deallocate(a, 100, s0());
  EXPECT_NE(s.message().find("model 'bert'"), absl::string_view::npos) << s;
  EXPECT_EQ(LastFreeError(), s);
  EXPECT_TRUE(model.Deallocate(a, 4096, s0()).ok());
}

TEST_F(InteropTest, MaxAlignmentIsWhatEveryBlockHas) {
  EXPECT_EQ(MemoryRef(alloc()).max_alignment(), 256u);  // round_bytes 512
  for (std::size_t round : {128u, 4096u}) {
    DeviceAllocatorOptions o;
    o.round_bytes = round;
    auto a = std::move(CachingDeviceAllocator::Create(*sim_, 0, o)).value();
    MemoryRef ref(*a);
    EXPECT_EQ(ref.max_alignment(), round < 256 ? round : 256u);
    // Someone else's small cuMemAlloc moves the next segment's base.
    DevicePtr other = sim_->MemAlloc(512).value();
    std::vector<DevicePtr> ps;
    for (int i = 0; i < 4; ++i) {
      ps.push_back(ref.Allocate(round, s0()).value());
      EXPECT_EQ(ps.back().address() % ref.max_alignment(), 0u) << round;
    }
    for (DevicePtr p : ps) EXPECT_TRUE(ref.Deallocate(p, round, s0()).ok());
    ASSERT_TRUE(sim_->MemFree(other).ok());
  }
}

TEST_F(InteropTest, OveralignedTypesAreRefusedWhereBlocksAreNotAligned) {
  struct alignas(256) Wide {
    char bytes[256];
  };
  DeviceAllocatorOptions o;
  o.round_bytes = 128;  // blocks aligned to 128 only
  auto a = std::move(CachingDeviceAllocator::Create(*sim_, 0, o)).value();
  StlAllocator<Wide> wide(MemoryRef(*a), s0());
  try {
    (void)wide.allocate(1);
    ADD_FAILURE() << "no exception";
  } catch (const BadAlloc& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(
      UniqueDevicePtr<Wide>::Create(MemoryRef(*a), 1, s0()).status().code(),
      absl::StatusCode::kInvalidArgument);
  // With the default unit the same type is served, aligned.
  auto p = UniqueDevicePtr<Wide>::Create(MemoryRef(alloc()), 3, s0()).value();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.get()) % alignof(Wide), 0u);
}

// Freed on a stream other than the allocation stream: the block is not
// reused (even on its own stream) before that stream's work is done. Without
// FreeCheck::order_after_stream the second Touch below races.
TEST_F(InteropTest, FreeOnAnotherStreamWaitsForThatStream) {
  MemoryRef model(*bert_);
  DevicePtr a = model.Allocate(64 << 10, s0()).value();
  sim_->Hold(s1());
  ASSERT_TRUE(sim_->Touch(s1(), a, 64 << 10).ok());  // pending on s1
  ASSERT_TRUE(model.Deallocate(a, 64 << 10, s1()).ok());
  DevicePtr b = model.Allocate(64 << 10, s0()).value();
  ASSERT_TRUE(sim_->Touch(s0(), b, 64 << 10).ok());
  sim_->Release(s1());
  EXPECT_EQ(sim_->race_count(), 0u);
  EXPECT_TRUE(model.Deallocate(b, 64 << 10, s0()).ok());
}

// ---- DeviceBuffer -----------------------------------------------------------

TEST_F(InteropTest, BufferFreesItselfOnScopeExit) {
  {
    DeviceBuffer buf =
        DeviceBuffer::Create(MemoryRef(*bert_), 1 * kMiB, s0(), "act").value();
    EXPECT_NE(buf.data(), nullptr);
    EXPECT_EQ(buf.size(), 1 * kMiB);
    EXPECT_EQ(buf.capacity(), 1 * kMiB);
    EXPECT_EQ(buf.stream(), s0());
    EXPECT_EQ(bert_->Stats().live_bytes, 1 * kMiB);
    ASSERT_TRUE(sim_->Touch(s0(), buf.ptr(), buf.size()).ok());
  }
  EXPECT_EQ(bert_->Stats().live_bytes, 0u);
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropTest, BufferMovesWithoutCopyOrLeak) {
  DeviceBuffer a = DeviceBuffer::Create(MemoryRef(alloc()), 4096, s0()).value();
  const DevicePtr p = a.ptr();
  DeviceBuffer b(std::move(a));
  EXPECT_EQ(b.ptr(), p);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.size(), 0u);       // NOLINT(bugprone-use-after-move)
  DeviceBuffer c = DeviceBuffer::Create(MemoryRef(alloc()), 8192, s1()).value();
  c = std::move(b);  // frees c's block, takes b's
  EXPECT_EQ(c.ptr(), p);
  EXPECT_EQ(c.stream(), s0());
  EXPECT_EQ(Live(), 4096);
  c = DeviceBuffer();
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropTest, BufferResizeCopiesOnlyWhenItGrows) {
  DeviceBuffer buf =
      DeviceBuffer::Create(MemoryRef(*bert_), 1 * kMiB, s0()).value();
  const DevicePtr first = buf.ptr();
  const std::int64_t allocs = Allocs();
  const std::uint64_t copies = sim_->call_count(SimCall::kMemcpyAsync);

  ASSERT_TRUE(buf.Resize(512 << 10).ok());  // within capacity
  EXPECT_EQ(buf.size(), 512u << 10);
  EXPECT_EQ(buf.capacity(), 1 * kMiB);
  EXPECT_EQ(buf.ptr(), first);
  EXPECT_EQ(Allocs(), allocs);

  ASSERT_TRUE(buf.Resize(3 * kMiB).ok());  // grows: new block, one copy
  EXPECT_EQ(buf.size(), 3 * kMiB);
  EXPECT_NE(buf.ptr(), first);
  EXPECT_EQ(Allocs(), allocs + 1);
  EXPECT_EQ(sim_->call_count(SimCall::kMemcpyAsync), copies + 1);
  EXPECT_EQ(bert_->Stats().live_bytes, 3 * kMiB);  // the old block is free

  ASSERT_TRUE(buf.Resize(1 * kMiB).ok());
  ASSERT_TRUE(buf.ShrinkToFit().ok());
  EXPECT_EQ(buf.capacity(), 1 * kMiB);
  EXPECT_EQ(bert_->Stats().live_bytes, 1 * kMiB);
  ASSERT_TRUE(buf.Resize(0).ok());
  ASSERT_TRUE(buf.ShrinkToFit().ok());
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_EQ(Live(), 0);
  EXPECT_EQ(DeviceBuffer().Resize(1).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(InteropTest, BufferOverTheModelsBudgetFailsAndKeepsItsContents) {
  absl::StatusOr<DeviceBuffer> big =
      DeviceBuffer::Create(MemoryRef(*bert_), 9 * kMiB, s0());
  ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("bert"), absl::string_view::npos)
      << big.status();

  DeviceBuffer buf =
      DeviceBuffer::Create(MemoryRef(*bert_), 6 * kMiB, s0()).value();
  const DevicePtr p = buf.ptr();
  absl::Status s = buf.Resize(7 * kMiB);  // old + new > 8 MiB
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(buf.ptr(), p);
  EXPECT_EQ(buf.size(), 6 * kMiB);
  EXPECT_EQ(bert_->Stats().live_bytes, 6 * kMiB);
}

TEST_F(InteropTest, BufferReleaseHandsOverTheBlock) {
  MemoryRef model(*bert_);
  DeviceBuffer buf = DeviceBuffer::Create(model, 4096, s0()).value();
  const std::size_t cap = buf.capacity();
  DevicePtr p = buf.release();
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_EQ(bert_->Stats().live_bytes, 4096u);  // still live: the caller's
  EXPECT_TRUE(model.Deallocate(p, cap, s0()).ok());
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropTest, BufferSetStreamOrdersTheFreeAfterBothStreams) {
  MemoryRef model(*bert_);
  DevicePtr p;
  sim_->Hold(s1());
  {
    DeviceBuffer buf = DeviceBuffer::Create(model, 64 << 10, s0()).value();
    p = buf.ptr();
    buf.set_stream(s1());
    ASSERT_TRUE(sim_->Touch(s1(), buf.ptr(), buf.size()).ok());
  }  // freed after s1's pending Touch
  DeviceBuffer next = DeviceBuffer::Create(model, 64 << 10, s0()).value();
  ASSERT_TRUE(sim_->Touch(s0(), next.ptr(), next.size()).ok());
  sim_->Release(s1());
  EXPECT_EQ(sim_->race_count(), 0u);
}

TEST_F(InteropTest, WarmBufferLoopMakesNoDriverCallAndNoHeapAllocation) {
  MemoryRef model(*bert_);
  { auto warm = DeviceBuffer::Create(model, 256 << 10, s0()).value(); }
  const std::uint64_t calls = sim_->total_call_count();
  g_allocations = 0;
  g_count_allocations = true;
  for (int i = 0; i < 200; ++i) {
    absl::StatusOr<DeviceBuffer> b =
        DeviceBuffer::Create(model, 256 << 10, s0());
    ASSERT_TRUE(b.ok());
  }
  g_count_allocations = false;
  EXPECT_EQ(sim_->total_call_count(), calls);
#ifndef CTXPOOL_TEST_TSAN
  EXPECT_EQ(g_allocations, 0);
#endif
}

// ---- UniqueDevicePtr --------------------------------------------------------

TEST_F(InteropTest, UniqueDevicePtrOwnsCountElements) {
  auto p =
      UniqueDevicePtr<float>::Create(MemoryRef(*bert_), 1000, s0(), "weights")
          .value();
  EXPECT_TRUE(p);
  EXPECT_EQ(p.count(), 1000u);
  EXPECT_EQ(bert_->Stats().requested_bytes, 4000u);
  UniqueDevicePtr<float> q = std::move(p);
  EXPECT_FALSE(p);  // NOLINT(bugprone-use-after-move)
  q.reset();
  EXPECT_FALSE(q);
  EXPECT_EQ(Live(), 0);

  EXPECT_EQ(
      UniqueDevicePtr<double>::Create(MemoryRef(*bert_), SIZE_MAX / 4, s0())
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(UniqueDevicePtr<int>::Create(MemoryRef(*bert_), 0, s0())
                   .value());  // 0 elements: null, nothing allocated
  EXPECT_EQ(Live(), 0);
}

// ---- StlAllocator -----------------------------------------------------------

TEST_F(InteropTest, StlAllocatorServesAStdVectorsAllocations) {
  const std::int64_t allocs = bert_->Stats().num_allocs;
  {
    StlAllocator<int> a(MemoryRef(*bert_), s0());
    std::vector<int, StlAllocator<int>> v(a);
    v.reserve(1000);  // allocates, constructs nothing on the host
    EXPECT_EQ(bert_->Stats().live_bytes, 4096u);  // 4000 B rounded to 512
    v.reserve(5000);  // a new block; the old one freed (no element moved)
    EXPECT_EQ(bert_->Stats().live_allocations, 1);
    std::vector<int, StlAllocator<int>> w(std::move(v));
    EXPECT_EQ(w.capacity(), 5000u);
  }
  SessionStats s = bert_->Stats();
  EXPECT_EQ(s.num_allocs - allocs, 2);
  EXPECT_EQ(s.num_frees, s.num_allocs);
  EXPECT_EQ(s.live_bytes, 0u);
}

TEST_F(InteropTest, StlAllocatorRebindsComparesAndThrows) {
  using Traits = std::allocator_traits<StlAllocator<float>>;
  StlAllocator<float> f(MemoryRef(*bert_), s0());
  Traits::rebind_alloc<double> d(f);
  EXPECT_TRUE(f == d);
  EXPECT_TRUE(f == StlAllocator<float>(MemoryRef(*bert_), s0()));
  EXPECT_FALSE(f == StlAllocator<float>(MemoryRef(*bert_), s1()));
  EXPECT_FALSE(f == StlAllocator<float>(MemoryRef(alloc()), s0()));

  double* p = Traits::rebind_traits<double>::allocate(d, 16);
  EXPECT_NE(p, nullptr);
  d.deallocate(p, 16);

  try {
    (void)f.allocate(4 * kMiB);  // 16 MiB > bert's 8 MiB
    ADD_FAILURE() << "no exception";
  } catch (const BadAlloc& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(e.what()).find("bert"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)f.allocate(SIZE_MAX / 2), std::bad_alloc);
  EXPECT_EQ(Live(), 0);
}

TEST(InteropBadAlloc, CopiesCheaplyAndKeepsTheStatus) {
  BadAlloc e(absl::ResourceExhaustedError("out of memory: report"));
  BadAlloc f = e;  // noexcept copy, shared message
  EXPECT_STREQ(f.what(), e.what());
  EXPECT_NE(std::string(f.what()).find("out of memory: report"),
            std::string::npos);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted);
  static_assert(std::is_nothrow_copy_constructible_v<BadAlloc>);
}

}  // namespace
}  // namespace ctxpool::interop
