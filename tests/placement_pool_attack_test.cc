// Attack tests of expandable placement (a request no mapped free block
// holds maps granules at the cheapest place, the fewest new bytes, never
// unmapping without pressure, and is not refused after a reclaim that made
// room) and of BlockPool (blocks made in chunks that double from 256 to
// 1024 blocks, each handed out default-initialised).
//
// The placement tests build layouts of holes (unmapped free blocks) and
// mapped free blocks in one stream's large range and compare the bytes a
// request maps with the cheapest placement the layout offers, computed
// independently from the allocator's Snapshot(); under pressure they check
// that a request which fits after the reclaim is not refused.
#include <malloc.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/block.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kGranule = 2 * kMiB;
constexpr std::size_t kHalfMiB = kMiB / 2;

std::size_t RoundUpTo(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

class PlacementAttackTest : public test::DeviceAllocatorFixture {
 protected:
  void Init(std::size_t capacity, DeviceAllocatorOptions o = {}) {
    o.backing = BackingMode::kExpandable;
    InitAllocator(capacity, std::move(o));
  }

  std::size_t Reserved() const {
    return static_cast<std::size_t>(
        alloc_->Stats().total.reserved_bytes[0].current);
  }
  // The books against the driver, with what the test took outside.
  absl::Status Books() const { return CheckBooks(hog_bytes_); }

  // Takes device memory outside the allocator until exactly `left` bytes of
  // the device are free.
  void LeaveFree(std::size_t left) {
    absl::StatusOr<MemInfo> info = sim_->MemGetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_GT(info->free_bytes, left);
    absl::StatusOr<DevicePtr> hog = sim_->MemAlloc(info->free_bytes - left);
    ASSERT_TRUE(hog.ok()) << hog.status();
    hog_ = *hog;
    hog_bytes_ = info->free_bytes - left;
    info = sim_->MemGetInfo();
    ASSERT_TRUE(info.ok());
    ASSERT_EQ(info->free_bytes, left);
  }
  void FreeHog() {
    if (hog_bytes_ != 0) {
      EXPECT_TRUE(sim_->MemFree(hog_).ok());
      hog_bytes_ = 0;
    }
  }

  // The fewest bytes a request of `rounded` (large pool, 10 MiB or more, so
  // never mapped ahead) maps on `stream`, from the layout alone: 0 when a
  // mapped free block holds it; else, over every unmapped free block u with
  // its mapped free neighbours p and n (0 where none): the whole request
  // rounded to granules in u, extending p or n by the granules it lacks, or
  // all of u joining both. nullopt when no placement exists. `*ahead`, when
  // given, gets how many mapped free blocks of the stream are larger than
  // the mapped block that cheapest placement extends (0 for a hole alone).
  std::optional<std::size_t> CheapestPlacement(
      StreamHandle stream, std::size_t rounded,
      std::size_t* ahead = nullptr) const {
    const std::size_t whole = RoundUpTo(rounded, kGranule);
    const AllocatorSnapshot snap = alloc_->Snapshot();
    if (ahead != nullptr) *ahead = 0;
    for (const SegmentInfo& seg : snap.segments) {
      if (seg.stream != stream || seg.small_pool) continue;
      auto mapped_free = [&](std::size_t i) -> std::size_t {
        const BlockInfo& b = seg.blocks[i];
        return b.state == BlockState::kFree && b.mapped_bytes == b.size ? b.size
                                                                        : 0;
      };
      for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
        if (mapped_free(i) >= rounded) return 0;
      }
      std::optional<std::size_t> best;
      std::size_t extended = 0;  // the mapped block the best extends
      auto offer = [&](std::size_t bytes, std::size_t beside) {
        if (!best || bytes < *best || (bytes == *best && beside > extended)) {
          best = bytes;
          extended = beside;
        }
      };
      for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
        const BlockInfo& u = seg.blocks[i];
        if (u.state != BlockState::kFree || u.mapped_bytes != 0) continue;
        const std::size_t p = i > 0 ? mapped_free(i - 1) : 0;
        const std::size_t n =
            i + 1 < seg.blocks.size() ? mapped_free(i + 1) : 0;
        if (p + u.size + n < rounded) continue;
        if (u.size >= whole) offer(whole, 0);
        if (p != 0 && RoundUpTo(rounded - p, kGranule) <= u.size) {
          offer(RoundUpTo(rounded - p, kGranule), p);
        }
        if (n != 0 && RoundUpTo(rounded - n, kGranule) <= u.size) {
          offer(RoundUpTo(rounded - n, kGranule), n);
        }
        if (p != 0 && n != 0) offer(u.size, std::max(p, n));
      }
      if (ahead != nullptr && extended != 0) {
        for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
          if (mapped_free(i) > extended) ++*ahead;
        }
      }
      return best;
    }
    return whole;  // no range yet: a fresh one maps the whole request
  }

  DevicePtr hog_;
  std::size_t hog_bytes_ = 0;
};

// Builds, in a1_'s large range and back to back, [l1 10][m 40][hole 60]
// [l2 10][hole 56][l3 10] MiB followed by `larger` mapped free blocks of 44
// MiB, each between live 10 MiB blocks, then frees m. A 50 MiB request is
// then cheapest extending m into the 60 MiB hole (10 MiB) instead of the 56
// MiB hole alone (50 MiB): the number of larger mapped free blocks without
// any hole beside them must not change where it goes.
TEST_F(PlacementAttackTest, ExtensionIsFoundBehindManyLargerFreeBlocks) {
  for (int larger : {0, 15, 16, 40}) {
    SCOPED_TRACE(absl::StrFormat("%d larger mapped free blocks", larger));
    Init(4 * kGiB);
    std::vector<DevicePtr> live;
    live.push_back(Alloc(10 * kMiB, a1_));
    const DevicePtr m = Alloc(40 * kMiB, a1_);
    const DevicePtr b = Alloc(60 * kMiB, a1_);
    live.push_back(Alloc(10 * kMiB, a1_));
    const DevicePtr a = Alloc(56 * kMiB, a1_);
    live.push_back(Alloc(10 * kMiB, a1_));
    std::vector<DevicePtr> frees;
    for (int i = 0; i < larger; ++i) {
      frees.push_back(Alloc(44 * kMiB, a1_));
      live.push_back(Alloc(10 * kMiB, a1_));
    }
    ASSERT_EQ(b, m + 40 * kMiB);
    ASSERT_EQ(a, b + 70 * kMiB);
    Free(b);
    Free(a);
    ASSERT_TRUE(alloc_->Trim(0).ok());
    Free(m);
    for (DevicePtr f : frees) Free(f);
    ASSERT_EQ(CheapestPlacement(a1_, 50 * kMiB), 10 * kMiB);
    const std::size_t before = Reserved();
    const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
    const DevicePtr p = Alloc(50 * kMiB, a1_);
    EXPECT_EQ(Reserved() - before, 10 * kMiB) << "mapped more than needed";
    EXPECT_EQ(p, m);
    EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps);
    EXPECT_TRUE(Books().ok()) << Books();
    Free(p);
    for (DevicePtr q : live) Free(q);
    EXPECT_TRUE(Books().ok()) << Books();
  }
}

// A small hole between two large mapped free blocks: joining both maps only
// the hole (4 MiB), where the hole is far below the best-fit probes' floor
// (4 granules under the request) and the tail would map 60 MiB. Tested
// alone and with a larger mapped free block (58 MiB, no hole beside it)
// ranked first.
TEST_F(PlacementAttackTest, JoinsBothNeighboursAcrossASmallHole) {
  for (bool decoy : {false, true}) {
    SCOPED_TRACE(decoy ? "with a decoy free block" : "alone");
    Init(1 * kGiB);
    const DevicePtr l1 = Alloc(10 * kMiB, a1_);
    const DevicePtr ph = Alloc(34 * kMiB, a1_);  // p (30) and the hole (4)
    const DevicePtr n = Alloc(30 * kMiB, a1_);
    const DevicePtr l2 = Alloc(10 * kMiB, a1_);
    DevicePtr d, l3;
    if (decoy) {
      d = Alloc(58 * kMiB, a1_);
      l3 = Alloc(10 * kMiB, a1_);
    }
    ASSERT_EQ(n, ph + 34 * kMiB);
    Free(ph);
    const DevicePtr p = Alloc(30 * kMiB, a1_);  // splits ph: 4 MiB stay free
    ASSERT_EQ(p, ph);
    ASSERT_TRUE(alloc_->Trim(0).ok());  // the 4 MiB become a hole
    Free(p);
    Free(n);
    if (decoy) Free(d);
    ASSERT_EQ(CheapestPlacement(a1_, 60 * kMiB), 4 * kMiB);
    const std::size_t before = Reserved();
    const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
    const DevicePtr q = Alloc(60 * kMiB, a1_);
    EXPECT_EQ(Reserved() - before, 4 * kMiB);
    EXPECT_EQ(q, p);
    EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps);
    EXPECT_TRUE(Books().ok()) << Books();
    Free(q);
    Free(l1);
    Free(l2);
    if (decoy) Free(l3);
  }
}

// Under pressure: a 101 MiB request is cheapest extending a 1 MiB mapped
// free block m into the 100 MiB hole after it (100 MiB); 16 holes of 96 MiB
// fill the best-fit probes and `xs` mapped free blocks of 11 MiB (8 whole
// granules each, 1.5 MiB partial granules at both ends) rank above m. The
// device has exactly 100 MiB less the granules the reclaim can take from
// the xs: the first mapping fails, the reclaim unmaps the xs' granules
// (skipping m and the hole), and the cache plus the device then hold exactly
// the 100 MiB that the first placement needs. The request must not fail.
TEST_F(PlacementAttackTest, ReclaimedRemnantsDoNotHideTheCheapestPlacement) {
  for (int xs : {7, 8}) {
    SCOPED_TRACE(absl::StrFormat("%d partly reclaimable free blocks", xs));
    Init(4 * kGiB);
    std::vector<DevicePtr> live;
    live.push_back(Alloc(11 * kMiB, a1_));         // [0, 11)
    const DevicePtr big = Alloc(101 * kMiB, a1_);  // [11, 112)
    live.push_back(Alloc(10 * kMiB, a1_));         // [112, 122)
    std::vector<DevicePtr> holes;
    for (int i = 0; i < 16; ++i) {
      holes.push_back(Alloc(96 * kMiB, a1_));  // granule aligned
      live.push_back(Alloc(10 * kMiB, a1_));
    }
    live.push_back(Alloc(10 * kMiB + kHalfMiB, a1_));  // to x.5 MiB
    std::vector<DevicePtr> x;
    for (int i = 0; i < xs; ++i) {
      x.push_back(Alloc(11 * kMiB, a1_));  // [k + 0.5, k + 11.5)
      live.push_back(Alloc(11 * kMiB, a1_));
    }
    live.push_back(Alloc(11 * kMiB + kHalfMiB, a1_));  // ends on a granule
    ASSERT_EQ(big, live[0] + 11 * kMiB);
    ASSERT_EQ((x[0].address() - live[0].address()) % kGranule, kHalfMiB);
    Free(big);
    for (DevicePtr h : holes) Free(h);
    ASSERT_TRUE(alloc_->Trim(0).ok());  // m = [11, 12) stays mapped
    ASSERT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
    for (DevicePtr p : x) Free(p);
    const std::size_t reclaimable = static_cast<std::size_t>(xs) * 8 * kMiB;
    ASSERT_EQ(CheapestPlacement(a1_, 101 * kMiB), 100 * kMiB);
    LeaveFree(100 * kMiB - reclaimable);
    const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(101 * kMiB, a1_);
    EXPECT_GT(sim_->call_count(SimCall::kMemUnmap), unmaps);  // reclaimed
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, big);
    EXPECT_TRUE(sim_->Touch(a1_, *p, 101 * kMiB).ok());
    EXPECT_TRUE(Books().ok()) << Books();
    Free(*p);
    for (DevicePtr q : live) Free(q);
    FreeHog();
    EXPECT_TRUE(Books().ok()) << Books();
  }
}

// Random allocations, frees and trims over two streams on an unconstrained
// device (fixed seed): every request of 10 MiB or more that no mapped free
// block holds maps exactly the fewest bytes its layout allows (computed
// from the snapshot), nothing is unmapped outside Trim, and the books match
// the driver's.
TEST_F(PlacementAttackTest, RandomLayoutsMapTheFewestBytes) {
  Init(64 * kGiB);
  std::mt19937_64 rng(20261206);
  const StreamHandle streams[2] = {a1_, a2_};
  std::vector<DevicePtr> live;
  int checked = 0, mismatches = 0;
  std::string first;
  for (int op = 0; op < 4000; ++op) {
    const int dice = static_cast<int>(rng() % 100);
    if (dice < 3) {
      const std::size_t keep = (rng() % 4) * 64 * kMiB;
      ASSERT_TRUE(alloc_->Trim(keep).ok());
      continue;
    }
    if (dice < 55 && live.size() < 160) {
      const int band = static_cast<int>(rng() % 10);
      const std::size_t bytes =
          band < 2 ? 512 + rng() % (512 * 1024)
                   : (band < 4 ? kMiB + rng() % (9 * kMiB)
                               : 10 * kMiB + 512 * (rng() % (160 * 2048)));
      const StreamHandle s = streams[rng() % 2];
      const std::size_t rounded = RoundUpTo(bytes, 512);
      std::optional<std::size_t> want;
      std::size_t ahead = 0;
      if (rounded >= 10 * kMiB) want = CheapestPlacement(s, rounded, &ahead);
      const std::size_t before = Reserved();
      const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
      live.push_back(Alloc(bytes, s));
      ASSERT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps);
      if (want) {
        ++checked;
        if (Reserved() - before != *want) {
          if (mismatches++ < 3) {
            absl::StrAppendFormat(
                &first,
                "\n  op %d: %d bytes mapped %d; the cheapest placement maps "
                "%d, extending a mapped free block %d larger ones outrank",
                op, rounded, Reserved() - before, *want, ahead);
          }
        }
      }
    } else if (!live.empty()) {
      const std::size_t i = rng() % live.size();
      Free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    if (op % 250 == 0) {
      ASSERT_TRUE(Books().ok()) << Books();
    }
  }
  EXPECT_GT(checked, 500);
  EXPECT_EQ(mismatches, 0) << "of " << checked << " checked:" << first;
  for (DevicePtr p : live) Free(p);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_TRUE(Books().ok()) << Books();
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
}

// ---- BlockPool --------------------------------------------------------------

// Around the chunk boundaries: every block is new, aligned for a
// Block, disjoint from every other, default-initialised; capacity() is the
// chunks made, the i-th of kChunkBlocks << min(i, kMaxDoublings), no more
// than hold the blocks handed out; the pool is destroyed with all of them
// live.
TEST(BlockPoolAttack, BoundariesAlignmentAndDisjointBlocks) {
  const std::size_t c = BlockPool::kChunkBlocks;
  const std::size_t top = c << BlockPool::kMaxDoublings;  // the largest chunk
  ASSERT_GE(c, 1u);
  for (std::size_t n :
       {std::size_t{1}, c - 1, c, c + 1, 3 * c, 3 * c + 1, 7 * c, 7 * c + 1,
        7 * c + top, 7 * c + top + 1, 7 * c + 3 * top + 5}) {
    SCOPED_TRACE(n);
    BlockPool pool;
    std::vector<Block*> blocks;
    for (std::size_t i = 0; i < n; ++i) {
      Block* b = pool.New();
      ASSERT_NE(b, nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % alignof(Block), 0u);
      EXPECT_EQ(b->address, 0u);
      EXPECT_EQ(b->size, 0u);
      EXPECT_EQ(b->prev, nullptr);
      EXPECT_EQ(b->next, nullptr);
      EXPECT_EQ(b->segment, nullptr);
      EXPECT_EQ(b->state, BlockState::kFree);
      EXPECT_FALSE(b->linked());
      EXPECT_TRUE(b->stream_uses.empty());
      b->address = i;
      b->stream_uses.assign({1, 2, 3, 4, 5});  // on the heap
      blocks.push_back(b);
    }
    EXPECT_EQ(pool.live(), n);
    std::size_t made = 0;
    std::size_t last = 0;
    for (std::size_t i = 0; made < n; ++i) {
      last = c << std::min<std::size_t>(i, BlockPool::kMaxDoublings);
      made += last;
    }
    EXPECT_EQ(pool.capacity(), made);
    EXPECT_LT(pool.capacity() - n, last);  // the newest chunk is in use
    std::vector<Block*> sorted = blocks;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 1; i < sorted.size(); ++i) {
      EXPECT_GE(reinterpret_cast<std::uintptr_t>(sorted[i]) -
                    reinterpret_cast<std::uintptr_t>(sorted[i - 1]),
                sizeof(Block));
    }
    // Writing every block did not disturb another.
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(blocks[i]->address, i);
      EXPECT_EQ(blocks[i]->stream_uses.size(), 5u);
    }
  }
}

#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
std::size_t HeapInUse() { return mallinfo2().uordblks; }
#endif

// Pools destroyed with blocks live, recycled and reused across several
// chunks (the newest one partly made) give every heap byte back, their
// blocks' stream_uses included. Each stream_uses is over glibc's tcache
// limit (1032 B), so a freed one is free in mallinfo2 at once and one
// leaked is more than the slack left for incidental small allocations.
TEST(BlockPoolAttack, DestructionFreesEverythingAcrossChunks) {
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  for (std::size_t n :
       {BlockPool::kChunkBlocks, BlockPool::kChunkBlocks + 1,
        3 * BlockPool::kChunkBlocks + 7, 9 * BlockPool::kChunkBlocks + 7}) {
    SCOPED_TRACE(n);
    std::vector<Block*> blocks;
    blocks.reserve(2 * n);
    const std::size_t heap = HeapInUse();
    {
      auto pool = std::make_unique<BlockPool>();
      for (std::size_t i = 0; i < n; ++i) {
        Block* b = pool->New();
        b->stream_uses.assign(200 + i % 7, i);  // 1600 B and more
        blocks.push_back(b);
      }
      for (std::size_t i = 0; i < n; i += 3) pool->Delete(blocks[i]);
      for (std::size_t i = 0; i < n / 2; ++i) {
        Block* b = pool->New();  // recycled first, then new ones
        b->stream_uses.assign(210, i);
      }
      pool.reset();
    }
    const std::size_t after = HeapInUse();
    EXPECT_LE(after, heap + 1024) << after - heap << " bytes leaked";
  }
#else
  GTEST_SKIP() << "needs glibc's mallinfo2 (ASan checks leaks itself)";
#endif
}

// New() documents "a default-initialised Block": a recycled block must
// not carry anything of its previous life, whatever field was set.
TEST(BlockPoolAttack, RecycledBlockIsDefaultInitialisedInEveryField) {
  BlockPool pool;
  Block* b = pool.New();
  Block* keep = pool.New();
  int owner_data = 0;
  b->address = 1;
  b->size = 2;
  b->requested = 3;
  b->prev = keep;
  b->state = BlockState::kAllocated;
  b->unmapped = true;
  b->quarantined = true;
  b->pending_events = 4;
  b->owner = 5;
  b->owner_data = &owner_data;
  b->label = "label";
  b->born_ns = 6;
  b->stream_uses.assign({7, 8, 9});
  pool.Delete(b);
  Block* again = pool.New();
  ASSERT_EQ(again, b);
  const Block fresh;
  EXPECT_EQ(again->address, fresh.address);
  EXPECT_EQ(again->size, fresh.size);
  EXPECT_EQ(again->requested, fresh.requested);
  EXPECT_EQ(again->prev, fresh.prev);
  EXPECT_EQ(again->next, fresh.next);
  EXPECT_EQ(again->segment, fresh.segment);
  EXPECT_EQ(again->state, fresh.state);
  EXPECT_EQ(again->unmapped, fresh.unmapped);
  EXPECT_EQ(again->quarantined, fresh.quarantined);
  EXPECT_EQ(again->pending_events, fresh.pending_events);
  EXPECT_EQ(again->owner, fresh.owner);
  EXPECT_EQ(again->owner_data, fresh.owner_data);
  EXPECT_EQ(again->label, fresh.label);
  EXPECT_EQ(again->born_ns, fresh.born_ns);
  EXPECT_TRUE(again->stream_uses.empty());
  pool.Delete(again);
  pool.Delete(keep);
}

}  // namespace
}  // namespace ctxpool
